"""RematerializeFn really frees activation memory (allocator peak)."""

import pytest
import tensorflow as tf

from tfremat import bench
from tfremat import measure
from tfremat import models

# 32 residual blocks: 2 MiB block inputs, 8 MiB hidden activations, so the
# activations dominate the weights' gradients, as in a real model.
_BLOCKS, _WIDTH, _BATCH = 32, 128, 4096


@pytest.mark.parametrize("jit", [False, True], ids=["function", "xla"])
def test_every_block_rematerialized_peaks_at_most_035x_of_plain(jit):
  blocks = models.residual_mlp(_BLOCKS, _WIDTH, dropout=0.1)
  x = tf.random.stateless_normal([_BATCH, _WIDTH], seed=[1, 2])
  peaks = {}
  for method in ("none", "tfremat"):
    step = bench.residual_step(blocks, method, jit)
    peaks[method] = measure.peak_bytes(step, x, calls=1)
  ratio = peaks["tfremat"] / peaks["none"]
  assert peaks["none"] > 400 * 2**20, peaks  # The plain step is big enough.
  assert ratio <= 0.35, (ratio, peaks)
