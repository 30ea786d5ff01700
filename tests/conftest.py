"""Shared test helpers: devices, execution modes, parity checks.

Every parity test is parametrized over `DEVICES` (each visible CPU and GPU) and
`MODES`, so this suite is also the GPU correctness suite on a machine with a
GPU. Without a GPU the GPU parameter is reported as skipped, not silently
dropped.
"""

import contextlib
import functools
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# A step's memory is measured from the CPU's BFC allocator, which importing
# tfremat turns on; TensorFlow starts below, before tfremat is imported.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

import keras  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import pytest  # pylint: disable=g-import-not-at-top
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import tfremat  # pylint: disable=g-import-not-at-top
from tfremat import planner  # pylint: disable=g-import-not-at-top
from tfremat._src.planning.search import Candidate  # pylint: disable=g-import-not-at-top
from tfremat import policies  # pylint: disable=g-import-not-at-top

# TFREMAT_TEST_POLICY=dots_saveable pytest tests/remat_test.py runs every
# rematerialized call that names no policy under that save policy: the whole
# parity suite, under each built-in policy, is how CI checks them. Several
# names, comma-separated, run each test once under each (in one process, which
# saves a start of TensorFlow per policy).
TEST_POLICIES = tuple(
    name.strip()
    for name in os.environ.get("TFREMAT_TEST_POLICY", "").split(",")
    if name.strip())
for _name in TEST_POLICIES:
  policies.get(_name)  # A misspelt name fails here, before any test runs.


# Tests marked `long` (minutes each: budgets planned on real CNNs and
# KerasHub models) run only with TFREMAT_LONG=1: CI's time cannot hold them
# for every submission.
_LONG = pytest.mark.skip(reason="minutes each: run with TFREMAT_LONG=1")


# CI's time on 2 cores (.ci/run: main suite within 8 minutes, slow
# stage within 10): cases run in the slow stage, or only with TFREMAT_LONG=1,
# where another case of the same test, or another test, checks the same
# claim in the stage before. Patterns match pytest's node ids.
_STAGE_OF = {
    "slow": (
        # XLA compiles each case for seconds: the main suite compiles the
        # core parity files' cases, the policies CI runs under, and one
        # case elsewhere.
        "tests/policies_test.py::*[CPU:0-xla-*]",
        "tests/remat_scope_test.py::*[CPU:0-xla-*]",
        "tests/threads_test.py::*[2-nested-xla]",
        "tests/in_place_test.py::test_nested_sublayers_give_the_plain_*"
        "[CPU:0-xla]",
        "tests/chain_test.py::test_nested_segments_match_plain_in_every_mode"
        "[CPU:0-xla-dots_saveable]",
        # A second case of a claim the main suite checks once.
        "tests/remat_model_test.py::test_the_result_exports_*",
        "tests/remat_model_test.py::test_activations_recomputes_functions_*"
        "[mish]",
        "tests/remat_model_test.py::test_activations_recomputes_the_"
        "activation_of_layers_inside_a_block[only_inside]",
        "tests/remat_model_test.py::test_a_policy_value_groups_a_cnn_as_its_"
        "name_does[user]",
        "tests/remat_scope_test.py::test_a_scoped_chain_peaks_below_*",
        "tests/remat_memory_test.py::test_one_executor_thread_frees_*",
        # Subprocesses that start TensorFlow again.
        "tests/examples_test.py::test_keras_transformer_*",
        "tests/examples_test.py::test_lingvo_style_transformer_*",
        "tests/layers_distribute_test.py::test_multi_worker_*",
        "tests/measure_test.py::test_peak_bytes_without_the_bfc_allocator_*",
        "tests/measure_test.py::test_importing_tfremat_turns_on_the_bfc_*",
        "tests/hyperparams_test.py::test_to_text_of_a_script_is_read_back_*",
        "tests/remat_memory_test.py::test_lingvos_rerun_*",
        # Planning (tens of seconds each): the main suite keeps one test per
        # entry point's planned step; these plan a second time.
        "tests/budget_step_test.py::test_a_planned_chain_runs_the_plan_for_"
        "the_shape_it_is_traced_for",
        "tests/budget_step_test.py::test_largest_batch_counts_the_optimizer_*",
        "tests/budget_step_test.py::test_a_byte_budget_counts_what_training_*",
        "tests/budget_step_test.py::test_a_compiled_model_is_planned_on_its_"
        "own_train_on_batch",
        "tests/in_place_test.py::test_budget_in_place_rematerializes_the_"
        "fewest_that_fit",
        "tests/largest_batch_test.py::test_the_batch_found_fits_on_a_step_*",
        "tests/remat_model_test.py::test_budget_plans_without_keras_warnings",
        # Reading plans: the MLP's case checks the claim in the main suite.
        "tests/read_plans_test.py::test_a_plans_peak_read_from_keeping_*[lm]",
        # A fraction at other shapes: the main suite checks it at a much
        # smaller batch (the main suite took 480 s of its 8 minutes in CI).
        "tests/budget_shapes_test.py::test_a_fraction_is_of_keeping_"
        "everything_at_each_length",
    ),
    # The slow stage keeps one test per claim: a small CNN's grouping on
    # both convolution kernels (remat_model_test), every mode on a KerasHub
    # backbone (keras_hub_test), nested planning (chain_test), 100 later
    # steps of one chain's plan (alone and beside a busy process) and of a
    # fit step's plan (budget_later_test).
    "long": (
        "tests/bench_test.py::test_methods_table_*[eager]",
        "tests/bench_test.py::test_methods_table_*[policy]",
        "tests/bench_test.py::test_whole_models_*",
        "tests/bench_test.py::test_sweep_*",
        "tests/builder_test.py::test_sqrt_segments_save_memory_*",
        "tests/chain_test.py::test_budgets_hold_when_measured*",
        "tests/chain_test.py::test_rematerializing_every_layer_peaks_at_most_"
        "keeping_everything[residual_mlp]",
        "tests/chain_test.py::test_the_planner_takes_policies_by_value_*",
        "tests/chain_test.py::test_a_budget_at_115_percent_of_the_lowest_*",
        "tests/in_place_test.py::test_budget_in_place_below_every_layer_*",
        "tests/in_place_test.py::test_nested_sublayers_peak_lower_*",
        "tests/in_place_test.py::test_budget_in_place_nests_the_layers_*",
        "tests/keras_hub_test.py::test_a_backbone_made_in_remat_scope_*",
        "tests/layers_test.py::test_serving_artifact_*[tf.saved_model.save]",
        "tests/remat_memory_test.py::test_every_block_rematerialized_peaks_*",
        "tests/remat_model_test.py::test_budget_plans_a_functional_"
        "transformer_*",
        "tests/remat_model_test.py::test_budget_plans_blocks_that_read_a_"
        "padding_mask_exactly[xla]",
        "tests/remat_model_test.py::test_budget_on_a_cnn_plans_over_the_*",
        "tests/remat_model_test.py::test_grouping_saves_a_quarter_of_a_cnns_"
        "peak_on_either_kernel[larger_than-*]",
        "tests/remat_provenance_test.py::*[function]",
        "tests/threads_test.py::*[4-*-xla]",
        "tests/budget_later_test.py::*[twelve-0.3]",
        "tests/budget_later_test.py::*[residual_mlp-0.7]",
        "tests/budget_later_test.py::test_a_keras_hub_backbone_budget_*",
        "tests/budget_later_test.py::test_a_remat_model_budget_holds_*",
        "tests/budget_later_test.py::test_a_budget_planned_with_one_executor_*",
    ),
}
# The policies CI runs the parity suite under (.ci/run) keep their XLA cases
# in the main suite.
_MAIN_AFTER_ALL = ("*[CPU:0-xla-dots_saveable]",
                   "*[CPU:0-xla-masks_and_softmax_saveable]",
                   "tests/remat_scope_test.py::*[CPU:0-xla-full-kwargs0]")


def _matches(node_id, pattern):
  """Whether `node_id` is `pattern`, each `*` in it standing for any text
  (brackets are literal, as in the ids)."""
  return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))),
                      node_id) is not None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
  """Marks the cases of `_STAGE_OF` (before `-m` selects). Skips the `long`
  tests unless TFREMAT_LONG=1. Under
  TFREMAT_TEST_POLICY, leaves out the eager cases: policies act in graphs
  only (an eager call recomputes everything), so those cases are the main
  suite's own."""
  for item in items:
    if any(_matches(item.nodeid, p) for p in _MAIN_AFTER_ALL):
      continue
    for stage in ("long", "slow"):
      if any(_matches(item.nodeid, p) for p in _STAGE_OF[stage]):
        item.add_marker(pytest.mark.slow)
        if stage == "long":
          item.add_marker(pytest.mark.long)
        break
  if not os.environ.get("TFREMAT_LONG"):
    for item in items:
      if "long" in item.keywords:
        item.add_marker(_LONG)
  if not TEST_POLICIES:
    return
  eager = [item for item in items
           if getattr(item, "callspec", None) is not None and
           item.callspec.params.get("mode") == "eager"]
  if eager:
    config.hook.pytest_deselected(items=eager)
    items[:] = [item for item in items if item not in eager]


def _under(name):
  return contextlib.nullcontext() if name is None else policies.scope(name)


if len(TEST_POLICIES) > 1:
  @pytest.fixture(autouse=True, params=TEST_POLICIES)
  def _test_policy(request):
    with _under(request.param):
      yield
else:
  @pytest.fixture(autouse=True)
  def _test_policy():
    with _under(TEST_POLICIES[0] if TEST_POLICIES else None):
      yield


# Parity compares a rematerialized computation with the same one unrematerialized
# to float32 rounding. On GPUs with TensorFlow 32 (Ampere and newer), TensorFlow
# rounds matmul and convolution inputs to 10-bit mantissas by default, and a
# second derivative or a Jacobian taken through a different graph amplifies
# that rounding past RTOL (seen on an H200: 5 such failures with TF32 on, none
# with it off). The parity suite therefore compares in full float32;
# TFREMAT_TEST_TF32=1 keeps TensorFlow's default instead.
if os.environ.get("TFREMAT_TEST_TF32") != "1":
  tf.config.experimental.enable_tensor_float_32_execution(False)


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


def device_modes(modes=tuple(MODES)):
  """(device, mode) parameters; a skipped device skips all its modes."""
  return [pytest.param(d.values[0], mode, id=f"{d.id}-{mode}", marks=d.marks)
          for d in DEVICES for mode in modes]


DEVICE_MODES = device_modes()

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


def assert_one_scale_parity(actual, expected):
  """Equal to float rounding against the largest expected magnitude of all
  tensors: max |diff| <= RTOL * max |expected| + ATOL.

  A gradient that is zero but for float noise (a key projection's bias,
  which softmax cannot see) is then held to the rounding of the whole
  computation, not to its own noise.
  """
  actual, expected = to_numpy(actual), to_numpy(expected)
  tf.nest.assert_same_structure(actual, expected)
  flat_a, flat_e = tf.nest.flatten(actual), tf.nest.flatten(expected)
  assert len(flat_a) == len(flat_e)
  assert [a is None for a in flat_a] == [e is None for e in flat_e], (
      "None gradients differ", flat_a, flat_e)
  pairs = [(a, e) for a, e in zip(flat_a, flat_e) if e is not None]
  scale = max((float(np.max(np.abs(e))) for _, e in pairs if np.size(e)),
              default=0.0)
  worst = max((float(np.max(np.abs(a - e))) if np.size(e) else 0.0
               for a, e in pairs), default=0.0)
  assert worst <= RTOL * scale + ATOL, (
      f"max |diff| {worst:.3g} against max |expected| {scale:.3g}")


def snapshot(variables):
  return [np.array(v.numpy()) for v in variables]


def restore(variables, values):
  for v, value in zip(variables, values):
    v.assign(value)


def parity_loss(outputs):
  """A loss with a non-uniform gradient for every floating output.

  A fixed projection, not only sum(y**2): after BatchNormalization sum(y**2)
  hardly depends on the input, and its tiny, cancellation-dominated input
  gradient would compare kernel rounding rather than rematerialization.
  """
  terms = []
  for y in tf.nest.flatten(outputs):
    if y.dtype.is_floating:
      y = tf.cast(y, tf.float32)
      weights = tf.sin(1.0 + tf.cast(tf.range(tf.size(y)), tf.float32))
      terms.append(tf.reduce_sum(tf.reshape(y, [-1]) * weights) +
                   0.5 * tf.reduce_sum(y * y))
  return tf.add_n(terms)


def training_step(call, variables):
  """A training step: outputs, input gradients and variable gradients."""

  def step(*xs):
    with tf.GradientTape() as tape:
      tape.watch([x for x in tf.nest.flatten(xs) if x.dtype.is_floating])
      outputs = call(*xs)
      loss = parity_loss(outputs)
    return outputs, tape.gradient(loss, (xs, variables))

  return step


def assert_parity(call, inputs, variables, mode, device, state=None):
  """Rematerialized `call` gives the plain outputs, gradients and state.

  Args:
    call: `call(remat, *inputs)`, computing with or without rematerialization.
    inputs: the (nested) inputs.
    variables: the variables to differentiate.
    mode: "eager", "function" or "xla".
    device: where to run.
    state: all variables the step may change; defaults to `variables`.
  """
  state = list(variables) if state is None else list(state)
  with tf.device(device):
    before = snapshot(state)
    expected = compile_step(
        training_step(functools.partial(call, False), variables), mode)(*inputs)
    expected_state = snapshot(state)
    restore(state, before)
    actual = compile_step(
        training_step(functools.partial(call, True), variables), mode)(*inputs)
    actual_state = snapshot(state)
  assert_one_scale_parity(actual, expected)
  assert_trees_close(actual_state, expected_state)
  return actual


def random_costs(rng, n):
  """A random chain of n LayerCosts, for planner tests."""
  costs = []
  for i in range(n):
    size = int(rng.integers(1, 50)) * 1000
    costs.append(planner.LayerCost(
        name=f"l{i}", forward_seconds=float(rng.uniform(0.1, 2)),
        backward_seconds=float(rng.uniform(0.1, 4)),
        input_bytes=costs[-1].output_bytes if costs else size,
        output_bytes=int(rng.integers(1, 50)) * 1000,
        saved_bytes=int(rng.integers(0, 400)) * 1000,
        forward_transient_bytes=int(rng.integers(0, 100)) * 1000,
        backward_transient_bytes=int(rng.integers(0, 100)) * 1000,
        weight_grad_bytes=int(rng.integers(0, 20)) * 1000,
        waiting_recompute_seconds=float(rng.uniform(0, 0.3))))
  return costs


_SERVE_WITHOUT_TFREMAT = textwrap.dedent("""
    import sys
    import numpy as np
    import tensorflow as tf
    loaded = tf.saved_model.load(sys.argv[1])
    x = np.load(sys.argv[2])
    fn = loaded.serve if hasattr(loaded, "serve") else loaded.signatures[
        "serving_default"]
    y = fn(tf.constant(x))
    y = list(y.values())[0] if isinstance(y, dict) else y
    assert "tfremat" not in sys.modules
    np.save(sys.argv[3], y.numpy())
""")


def assert_serves_without_tfremat(model, x, tmp_path, how="model.export"):
  """Exports `model` (`model.export` or `tf.saved_model.save`), loads the
  artifact in a fresh Python that never imports tfremat, and checks it
  predicts what `model` does on `x`."""
  expected = model.predict(x, verbose=0)
  path = str(tmp_path / "artifact")
  if how == "model.export":
    model.export(path, verbose=False)
  else:
    tf.saved_model.save(model, path)
  np.save(tmp_path / "x.npy", x)
  script = tmp_path / "serve.py"
  script.write_text(_SERVE_WITHOUT_TFREMAT)
  subprocess.run(
      [sys.executable, str(script), path, str(tmp_path / "x.npy"),
       str(tmp_path / "y.npy")],
      check=True, cwd=str(tmp_path),
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=""))
  assert_trees_close(np.load(tmp_path / "y.npy"), expected)


class FeedForward(keras.layers.Layer):
  """Dense(1024, activation) -> Dense(width), made in `build` with the
  block's activation handed to the first Dense, as KerasHub's transformer
  layers make theirs: the Dense applies it, not the block's `call`."""

  def __init__(self, activation="gelu", own_activation=True, **kwargs):
    super().__init__(**kwargs)
    self._function = keras.activations.get(activation)
    if own_activation:
      self.activation = self._function

  def build(self, input_shape):
    self.up = keras.layers.Dense(1024, activation=self._function)
    self.up.build(input_shape)
    self.down = keras.layers.Dense(input_shape[-1])
    self.down.build(tuple(input_shape[:-1]) + (1024,))

  def call(self, x, training=None):
    del training  # Its layers have no training behaviour.
    return self.down(self.up(x))


@contextlib.contextmanager
def remat_modes_off(model):
  """Runs `model` without rematerialization: every layer's remat mode (set
  by `keras.RematScope` or `tfremat.RematScope`) off within the block."""
  layers = list(model._flatten_layers())  # pylint: disable=protected-access
  before = [l._remat_mode for l in layers]  # pylint: disable=protected-access
  for layer in layers:
    object.__setattr__(layer, "_remat_mode", None)
  try:
    yield
  finally:
    for layer, mode in zip(layers, before):
      object.__setattr__(layer, "_remat_mode", mode)


def scoped_or_plain(model):
  """`call(remat, x)` for `assert_parity`: `model` as made in a remat scope
  when `remat`, else with every layer's remat mode off."""

  def call(remat, x):
    if remat:
      return model(x, training=True)
    with remat_modes_off(model):
      return model(x, training=True)

  return call


def sample_chain(name):
  """(blocks, batch): the chains the planner's tests plan, by name.

  "tanh": six Dense(64, tanh) at batch 2048, each keeping only its output;
  "wide_hidden": weight gradients as large as activations; "residual_mlp":
  eight functional residual blocks Dense(1024, gelu), Dropout, Dense(256)
  at batch 512; "mlp": ten residual MLP blocks of width 64 at batch 2048 (4
  MiB activations each); "twelve": twelve Dense blocks, hidden 1024 in
  every third and 512 in the others, whose lowest plan peaks at about a
  fifth of keeping everything's; "bench_mlp" and "bench_transformer": the
  benchmark's chains at its default sizes.
  """
  # pylint: disable=g-import-not-at-top
  from tfremat.bench import methods as bench
  from tfremat import models
  keras.utils.set_random_seed(0)
  if name in ("bench_mlp", "bench_transformer"):
    model = name.split("_")[1]
    return bench.chain_and_batch(model, bench.DEFAULTS[model], 0.1)
  if name == "mlp":
    return (models.residual_mlp(10, 64, dropout=0.1, residual_inside=True),
            tf.random.stateless_normal([2048, 64], seed=[1, 2]))
  if name == "tanh":
    blocks = [keras.Sequential([keras.layers.Dense(64, activation="tanh")])
              for _ in range(6)]
    x = tf.random.stateless_normal([2048, 64], seed=[1, 2])
  elif name == "wide_hidden":
    blocks = [keras.Sequential([keras.layers.Dense(512, activation="relu"),
                                keras.layers.Dense(128)]) for _ in range(6)]
    x = tf.random.stateless_normal([256, 128], seed=[1, 2])
  elif name == "twelve":
    blocks = [keras.Sequential([
        keras.layers.Dense(1024 if i % 3 == 0 else 512, activation="gelu"),
        keras.layers.Dense(128)]) for i in range(12)]
    x = tf.random.stateless_normal([2048, 128], seed=[1, 2])
  elif name == "residual_mlp":
    blocks, x = [], tf.random.stateless_normal([512, 256], seed=[1, 2])
    for i in range(8):
      h = inputs = keras.Input((256,))
      h = keras.layers.Dense(1024, activation="gelu")(h)
      h = keras.layers.Dropout(0.1, seed=i)(h)
      blocks.append(keras.Model(inputs, inputs + keras.layers.Dense(256)(h)))
  else:
    raise ValueError(f"no sample chain {name!r}")
  for block in blocks:
    block.build(x.shape)
  return blocks, x


def planned_chain(model):
  """The `RematSequential` a planned model's chain runs in."""
  return next(l for l in model.layers
              if isinstance(l, tfremat.RematSequential))


def functional_mlp():
  """(model, batch): one functional model of eight residual blocks,
  Dense(1024, gelu) then Dense(256), at batch 512, as a user builds it."""
  keras.utils.set_random_seed(0)
  h = inputs = keras.Input((256,))
  for _ in range(8):
    y = keras.layers.Dense(1024, activation="gelu")(h)
    h = keras.layers.Add()([h, keras.layers.Dense(256)(y)])
  return (keras.Model(inputs, h),
          tf.random.stateless_normal([512, 256], seed=[1, 2]))


class StandInRunner:
  """Stands in for the planner's runner (what runs a candidate's training
  step): `measure(candidate)` gives its step's per-call peaks (a list,
  repeated over as many calls as are asked for, or one int), once per
  candidate; `measured` lists the candidates in the order first measured.
  Training holds `held_bytes` besides the step (as weights)."""

  step = "stand-in"
  jit = False

  def __init__(self, measure, held_bytes=0):
    self.measure = measure
    self.held_bytes = held_bytes
    self.measured = []
    self._peaks = {}

  def held(self, batch):
    del batch
    return planner.Held(weights_bytes=self.held_bytes)

  def peaks(self, candidate, batch, calls, every_program=False):
    del batch, every_program
    if candidate not in self._peaks:
      self.measured.append(candidate)
      value = self.measure(candidate)
      self._peaks[candidate] = (list(value) if isinstance(value, (list, tuple))
                                else [value])
    values = self._peaks[candidate]
    return [values[i % len(values)] for i in range(calls)]

  def variant_peaks(self, plan, batches, calls):
    return [[self.peaks(Candidate(v, plan.ordered), b, calls)
             for v in plan.variants] for b in batches]

  def predicted(self, candidate, batch):
    """The largest of its peaks: the planner's prediction of its step."""
    return max(self.peaks(candidate, batch, 1))

  def simulated(self, candidate, batch):
    """No program to read other plans from: each is predicted."""
    del candidate, batch


EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def load_example(name):
  """The example `examples/<name>.py`, imported as a module."""
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  # Registered as an import would be: Params text names classes by module.
  sys.modules[name] = module
  spec.loader.exec_module(module)
  return module
