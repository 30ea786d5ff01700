"""remat_model on keras.applications CNNs: exact, and never above the
original's peak (slow: each model traces for seconds to tens of seconds).

A CNN is a flat functional model of single layers. `mode="full"` groups
them into rematerialized segments; each layer alone would keep its input,
the previous layer's output, and the reruns would cost memory (1.13x-1.37x
of the original's peak, measured before the grouping).
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from conftest import RTOL, assert_one_scale_parity, assert_parity
from conftest import assert_trees_close, compile_step, restore, snapshot
from conftest import to_numpy, training_step

pytestmark = pytest.mark.slow

# name -> (image size, batch): small sizes these models accept. At 64x64 and
# batch 4, EfficientNetB0's step peaked 62-78 MiB from call to call with
# Eigen's convolution kernels and its grouped step 70-73 MiB; at 96x96 and
# batch 8, 142 against 95 MiB. ResNet50's weight gradients dominate its
# step at 64x64 and batch 4, where grouping saved 8% of the peak: less than
# one step's peak moved in a process that had run the other models first on
# a loaded machine (+17%, once). At 96x96 and batch 8 it saves about 30%.
MODELS = {
    "ResNet50": (96, 8),
    "MobileNetV2": (64, 4),
    "DenseNet121": (64, 4),
    "EfficientNetB0": (96, 8),
    "ConvNeXtTiny": (64, 4),
}


def _model(name):
  keras.utils.set_random_seed(0)
  size, batch = MODELS[name]
  model = getattr(keras.applications, name)(
      weights=None, input_shape=(size, size, 3), classes=10)
  x = tf.random.stateless_normal([batch, size, size, 3], seed=[1, 2])
  return model, x


# XLA compiles these models' rematerialized steps in minutes on 2 cores
# (DenseNet121's in 123 s against 25 s for its plain step): their XLA parity
# is left to the other three CNNs and to the core suite's XLA cases.
_XLA_TOO_SLOW = ("DenseNet121", "EfficientNetB0")


# A minute or more each on 2 cores: with TFREMAT_LONG=1. CI's slow stage
# groups a small CNN on both convolution kernels (remat_model_test).
@pytest.mark.long
@pytest.mark.parametrize("name", sorted(MODELS))
def test_full_mode_is_exact_and_peaks_below_the_original(name):
  model, x = _model(name)
  full = tfremat.remat_model(model, "full")
  assert any(isinstance(l, tfremat.RematSequential) for l in full.layers)
  # "larger_than" selects the layers with large outputs and groups them as
  # "full" does (alone, they raised MobileNetV2's peak to 1.22x).
  larger = tfremat.remat_model(model, "larger_than", sample_input=x)
  variants = (model, full, larger)
  # One traced step per variant, for both the gradients and the peaks.
  steps = [compile_step(training_step(
      lambda h, m=m: m(h, training=True), model.trainable_weights),
                        "function") for m in variants]
  state, before = model.variables, snapshot(model.variables)
  results = []
  for step in steps[:2]:
    restore(state, before)
    results.append((to_numpy(step(x)), snapshot(state)))
  (expected, expected_state), (actual, actual_state) = results
  assert_one_scale_parity(actual, expected)
  assert_trees_close(actual_state, expected_state)
  restore(state, before)  # The XLA steps start where these did.
  if name not in _XLA_TOO_SLOW:
    call = lambda remat, h: (full if remat else model)(h, training=True)
    _assert_xla_within_its_own_rounding(call, x, model, expected)
  # Alternated, so that none always runs on another's allocator state.
  peaks = [[], [], []]
  for _ in range(2):
    for i, step in enumerate(steps):
      peaks[i] += measure.peaks(step, x, calls=3)
  original, grouped, selected = (max(p) for p in peaks)
  assert grouped <= original, (name, original, grouped)
  assert selected <= original, (name, original, selected)


def _assert_xla_within_its_own_rounding(call, x, model, in_function):
  """Under XLA the rematerialized step is a different program, which XLA
  fuses differently: its float rounding differs. On DenseNet121 at batch 4
  (BatchNormalization over 16 values in the last blocks) rounding grows
  through 121 layers: the plain step compiled by XLA differed from the same
  step in a tf.function by 6.4e-3 of the largest gradient, the
  rematerialized one from the plain one under XLA by 1.2e-3. So the
  rematerialized step is held to the model's own rounding: within the
  larger of the suite's tolerance and the distance between the plain step's
  two compilations. State (statistics, seeds) must agree as everywhere."""
  state, grads = model.variables, model.trainable_weights
  before = snapshot(state)
  found = {("function", False): [a for a in tf.nest.flatten(in_function)
                                 if a is not None]}
  for mode, remat in (("xla", False), ("xla", True)):
    restore(state, before)
    step = compile_step(training_step(functools.partial(call, remat), grads),
                        mode)
    found[mode, remat] = [a for a in tf.nest.flatten(to_numpy(step(x)))
                          if a is not None]
    found[mode, remat, "state"] = snapshot(state)
  restore(state, before)

  def distance(a, b):
    return max(float(np.max(np.abs(p - q))) for p, q in zip(found[a],
                                                            found[b]))

  scale = max(float(np.max(np.abs(e))) for e in found["xla", False])
  own = distance(("xla", False), ("function", False))
  remat = distance(("xla", True), ("xla", False))
  assert remat <= max(RTOL * scale, own), (remat / scale, own / scale)
  assert_trees_close(found["xla", True, "state"], found["xla", False, "state"])


@pytest.mark.long
def test_half_the_peak_plans_on_densenet_at_a_larger_batch():
  # At the sizes above half the peak is out of reach: the lowest bounds
  # measured were 56%-62% of keeping everything at batch 8, held up by the
  # weight gradients (ResNet50's are 45% of its peak) or by one block's
  # working set while it reruns, plus the reserve. At
  # batch 32 DenseNet121's blocks are small beside its peak (ResNet50's and
  # MobileNetV2's are not: 63% and 55% there), and a budget of 50% plans.
  keras.utils.set_random_seed(0)
  model = keras.applications.DenseNet121(weights=None, input_shape=(64, 64, 3),
                                         classes=10)
  x = tf.random.stateless_normal([32, 64, 64, 3], seed=[1, 2])
  planned = tfremat.remat_model(model, budget=0.5, sample_input=x, verbose=0)
  (remat_chain,) = [l for l in planned.layers
                    if isinstance(l, tfremat.RematSequential)]
  plan = remat_chain.plan
  assert any(plan.rematerialized), str(plan)
  assert plan.measured.bound_bytes <= plan.budget_bytes, str(plan)
  later = measure.peaks(chain.training_step(planned), x, calls=5)
  assert max(later) <= plan.budget_bytes, (later, str(plan))
  assert_parity(lambda remat, h: (planned if remat else model)(
      h, training=True), (x[:4],), model.trainable_weights, "function",
                "/CPU:0", state=model.variables)
