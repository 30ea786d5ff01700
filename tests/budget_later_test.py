"""A planned budget holds on the training that follows, in a new process.

The planner measures each plan over `chain.CHECK_CALLS` calls and holds it to
their largest peak plus their spread (`planner.Measured`). This checks the
promise itself: the planned layer, saved to a `.keras` file and loaded in a
fresh Python, peaks within its budget on each of 100 later training steps.
Slow (about a minute per budget): CI runs it in its second stage.
"""

import json
import os
import subprocess
import sys
import textwrap

import keras
import pytest
import tensorflow as tf

import tfremat
from tfremat import models

_LATER = textwrap.dedent("""
    import json, sys
    import keras, tensorflow as tf
    import tfremat
    from tfremat import chain
    layer = keras.models.load_model(sys.argv[1]).layers[1]
    x = tf.random.stateless_normal([2048, 64], seed=[1, 2])
    peaks = chain.measure_peaks(layer, x, calls=100)
    print(json.dumps({"budget": layer.plan.budget_bytes, "peaks": peaks}))
""")


@pytest.mark.slow
@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_budget_holds_on_100_later_steps_in_a_new_process(fraction, tmp_path):
  blocks = models.residual_mlp(10, 64, dropout=0.1, residual_inside=True)
  x = tf.random.stateless_normal([2048, 64], seed=[1, 2])
  layer = tfremat.remat_sequential(blocks, budget=fraction, sample_input=x,
                                   verbose=0)
  assert any(layer.plan.rematerialized), str(layer.plan)
  inputs = keras.Input((64,))
  keras.Model(inputs, layer(inputs)).save(tmp_path / "planned.keras")
  script = tmp_path / "later.py"
  script.write_text(_LATER)
  done = subprocess.run(
      [sys.executable, str(script), str(tmp_path / "planned.keras")],
      check=True, capture_output=True, text=True,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  later = json.loads(done.stdout.strip().splitlines()[-1])
  assert later["budget"] == layer.plan.budget_bytes
  over = [p for p in later["peaks"] if p > later["budget"]]
  assert not over, (len(over), max(later["peaks"]), later["budget"],
                    str(layer.plan))
