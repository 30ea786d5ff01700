"""Shared test helpers: devices, execution modes, parity checks.

Every parity test is parametrized over `DEVICES` (each visible CPU and GPU) and
`MODES`, so this suite is also the GPU correctness suite on a machine with a
GPU. Without a GPU the GPU parameter is reported as skipped, not silently
dropped.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top


def _devices():
  found = [d.name for d in tf.config.list_logical_devices()
           if d.device_type in ("CPU", "GPU")]
  params = [pytest.param(name, id=name.split("device:")[-1]) for name in found]
  if not any("GPU" in name for name in found):
    params.append(pytest.param(
        "/GPU:0", id="GPU:0",
        marks=pytest.mark.skip(reason="no GPU visible to TensorFlow")))
  return params


DEVICES = _devices()
MODES = ["eager", "function", "xla"]
# Every (device, mode) pair; a skipped device skips all its modes.
DEVICE_MODES = [
    pytest.param(d.values[0], mode, id=f"{d.id}-{mode}", marks=d.marks)
    for d in DEVICES for mode in MODES
]

# Parity, not "close enough": float32 rounding differences only, from XLA or
# kernels fusing the rerun differently from the original forward pass. An
# element may differ by RTOL of itself or of its tensor's largest magnitude:
# an entry that cancels to near zero (a gradient through LayerNorm) carries the
# rounding error of the terms it cancelled, which are of the tensor's scale. A
# wrong dropout mask or a doubled state update is off by O(1) of that scale.
RTOL = 1e-5
ATOL = 1e-6


def compile_step(step, mode):
  """`step` run eagerly, as a tf.function, or as an XLA-compiled tf.function."""
  if mode == "eager":
    return step
  return tf.function(step, jit_compile=(mode == "xla"))


def to_numpy(tree):
  return tf.nest.map_structure(
      lambda t: None if t is None else np.asarray(tf.convert_to_tensor(t)),
      tree)


def assert_trees_close(actual, expected, rtol=RTOL, atol=ATOL):
  """Asserts two nests of arrays (or Nones) are equal to float rounding."""
  actual, expected = to_numpy(actual), to_numpy(expected)
  tf.nest.assert_same_structure(actual, expected)
  flat_a, flat_e = tf.nest.flatten(actual), tf.nest.flatten(expected)
  assert len(flat_a) == len(flat_e)
  for i, (a, e) in enumerate(zip(flat_a, flat_e)):
    assert (a is None) == (e is None), f"leaf {i}: {a!r} vs {e!r}"
    if a is not None:
      scale = float(np.max(np.abs(e))) if np.size(e) else 0.0
      np.testing.assert_allclose(a, e, rtol=rtol, atol=atol + rtol * scale,
                                 err_msg=f"leaf {i}")


def snapshot(variables):
  return [np.array(v.numpy()) for v in variables]


def restore(variables, values):
  for v, value in zip(variables, values):
    v.assign(value)

