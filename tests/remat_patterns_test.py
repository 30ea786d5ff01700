"""RematerializeFn in the patterns users write, and the peers' scenarios.

Each test is exact against the same code without rematerialization (same
seeds, same variable values), or checks a clear error raised before any state
changed. The numbers in brackets are the items of the issue "Exact gradients
in every pattern users write"; tests ported from a peer's suite name it.
"""

import functools
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import measure
from conftest import DEVICE_MODES, DEVICES, MODES, device_modes
from conftest import assert_parity, assert_trees_close, compile_step, snapshot

parametrize_all = pytest.mark.parametrize("device, mode", DEVICE_MODES)


def _x(*shape, seed=0):
  return tf.random.stateless_normal(shape, seed=[seed, 11])


class ContextBlock(keras.layers.Layer):
  """A custom layer that rematerializes part of its own call.

  Its inner layers read `training` from Keras's call context, not from an
  argument: the pattern of item [1].
  """

  def __init__(self, remat, batch_norm=False, **kwargs):
    super().__init__(**kwargs)
    self.remat = remat
    self.dense = keras.layers.Dense(8, activation="tanh")
    self.drop = keras.layers.Dropout(0.5, seed=3)
    self.norm = keras.layers.BatchNormalization() if batch_norm else None

  def build(self, input_shape):
    self.dense.build(input_shape)
    if self.norm is not None:
      self.norm.build((input_shape[0], 8))

  def _body(self, u):
    h = self.drop(self.dense(u))
    return self.norm(h) if self.norm is not None else h

  def call(self, x):
    if self.remat:
      return tfremat.RematerializeFn(self._body, x)
    return self._body(x)


def _block_pair(batch_norm=False):
  """The same `ContextBlock` with and without rematerialization, equal weights."""
  blocks = []
  for remat in (False, True):
    keras.utils.set_random_seed(5)
    block = ContextBlock(remat, batch_norm=batch_norm)
    block.build((None, 6))
    blocks.append(block)
  return blocks


@parametrize_all
@pytest.mark.parametrize("batch_norm", [False, True], ids=["dropout", "bn"])
def test_custom_layer_rematerializing_its_call_keeps_training_context(
    device, mode, batch_norm):
  # [1] Inner layers inherit training=True from the enclosing call.
  with tf.device(device):
    plain, remat = _block_pair(batch_norm)
  # Both blocks draw from the same seeds and start from the same weights;
  # the parity check compares outputs, gradients and moving statistics.
  state = remat.variables
  with tf.device(device):
    before = snapshot(state)
    expected = compile_step(_grads(plain), mode)(_x(8, 6))
    got = compile_step(_grads(remat), mode)(_x(8, 6))
  assert_trees_close(got, expected)
  assert_trees_close(snapshot(remat.variables), snapshot(plain.variables))
  assert not all(np.array_equal(a, b) for a, b in zip(before, snapshot(state)))
  # Dropout really ran in training mode: about half of the units are zero.
  assert 0.2 < np.mean(got[0].numpy() == 0) < 0.8 or batch_norm


def _grads(layer, **call_kwargs):
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = layer(x, training=True, **call_kwargs)
      loss = tf.reduce_sum(tf.cast(y, tf.float32) * tf.sin(
          tf.reshape(tf.range(tf.size(y), dtype=tf.float32), y.shape)))
    return y, tape.gradient(loss, [x] + layer.trainable_weights)
  return step


def test_custom_layer_trains_with_fit_like_the_plain_layer():
  # [1] The user's report: model.fit weights diverged.
  weights = []
  for remat in (False, True):
    keras.utils.set_random_seed(5)
    model = keras.Sequential([keras.Input((6,)), ContextBlock(remat),
                              keras.layers.Dense(1)])
    model.compile("sgd", "mse")
    model.fit(_x(16, 6).numpy(), np.ones((16, 1)), epochs=2, batch_size=8,
              shuffle=False, verbose=0)
    weights.append(snapshot(model.trainable_weights))
  assert_trees_close(weights[1], weights[0])


@pytest.fixture
def global_policy():
  """Sets the global Keras dtype policy for one test."""
  yield keras.mixed_precision.set_global_policy
  keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@parametrize_all
def test_custom_layer_under_mixed_precision_matches_plain(device, mode, policy,
                                                          global_policy):
  # [9] The rerun reads weights in the forward pass's autocast dtype.
  global_policy(policy)
  with tf.device(device):
    plain, remat = _block_pair()
    expected = compile_step(_grads(plain), mode)(_x(8, 6))
    got = compile_step(_grads(remat), mode)(_x(8, 6))
  assert got[0].dtype == tf.as_dtype(policy.split("_")[1])
  # Half precision: the rerun is the same program, so equal to its rounding.
  assert_trees_close(got, expected, rtol=1e-2, atol=1e-2)


@parametrize_all
def test_closure_captured_tensor_gets_its_gradient(device, mode):
  # [2] PyTorch test/test_utils.py TestCheckpoint: the non-reentrant
  # checkpoint differentiates tensors the function closes over.
  with tf.device(device):
    w, x = _x(3, 4, seed=1), _x(3, 4, seed=2)

  def step(remat):
    def run(w, x):
      with tf.GradientTape() as tape:
        tape.watch([w, x])
        fn = lambda v: tf.tanh(w * v) * w
        y = tfremat.RematerializeFn(fn, x) if remat else fn(x)
        loss = tf.reduce_sum(y * y) + tf.reduce_sum(w)
      return y, tape.gradient(loss, [w, x])
    return compile_step(run, mode)

  with tf.device(device):
    expected, got = step(False)(w, x), step(True)(w, x)
  assert_trees_close(got, expected)


def _with_inner_gradient(model, unconnected):
  """A function that takes a gradient itself, with a tape of its own."""

  def fn(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = model(x, training=True)
      z = tf.reduce_sum(tf.sin(y) ** 2)
    dz = tape.gradient(z, x, unconnected_gradients=unconnected)
    return y * tf.reduce_sum(dz * x, axis=1, keepdims=True)

  return fn


@parametrize_all
@pytest.mark.parametrize("unconnected", ["none", "zero"])
def test_gradient_tape_inside_fn_matches_plain(device, mode, unconnected):
  # [3] The forward pass runs with recording stopped; a tape the function
  # opens itself must still record, and the outer tape must not (it would
  # keep the block's activations and count their gradient twice). Second
  # order: the outer gradient goes through the inner one.
  with tf.device(device):
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.layers.Dense(5, activation="tanh"),
                              keras.layers.Dropout(0.3, seed=2)])
    model.build((None, 3))
  fn = _with_inner_gradient(model, unconnected)
  call = lambda remat, x: tfremat.RematerializeFn(fn, x) if remat else fn(x)
  assert_parity(call, (_x(4, 3),), model.trainable_weights, mode, device,
                state=model.variables)


def test_inner_tape_leaves_no_activations_on_the_outer_tape():
  # [3] If the outer tape recorded while the inner one does, it would keep
  # every activation of the block until its own gradient: memory held
  # after the forward pass, with the outer tape still open.
  def fn(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      h = x
      for _ in range(16):
        h = tf.tanh(h) * 1.01
      total = tf.reduce_sum(h)
    return h * tape.gradient(total, x)

  def taped(use_remat, x):
    with tf.GradientTape() as outer:
      outer.watch(x)
      y = tfremat.RematerializeFn(fn, x) if use_remat else fn(x)
    return outer, y

  held = {}
  for use_remat in (False, True):
    x = tf.random.stateless_normal([512, 1024], seed=[1, 2])  # 2 MiB.
    _, held[use_remat] = measure.held_bytes(taped, use_remat, x)
  # Plain keeps about 3 tensors per tanh step; rematerialized, the inputs.
  assert held[True] < 0.2 * held[False], held


class _Flaky:
  """A function that computes something else on its second call.

  Python-side nondeterminism: the pattern of item [4].
  """

  def __init__(self, second):
    self.calls = 0
    self.second = second

  def __call__(self, x):
    self.calls += 1
    return tf.sin(x) if self.calls == 1 else self.second(x)


_MISMATCHES = {
    "structure": (lambda x: (tf.sin(x), x), "different structure"),
    "dtype": (lambda x: tf.cast(tf.sin(x), tf.float64), "float64"),
    "shape": (lambda x: tf.sin(x)[:1], "shape"),
    # Same structure, dtype and shape, other ops: caught by default too.
    "ops": (lambda x: tf.tanh(tf.sin(x)), "other ops than the forward pass"),
}


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(_MISMATCHES))
def test_rerun_returning_something_else_raises(mode, kind):
  # [4] PyTorch TestCheckpoint's determinism check: metadata by default.
  second, message = _MISMATCHES[kind]

  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tfremat.RematerializeFn(_Flaky(second), x)
    return tape.gradient(y, x)

  with pytest.raises(tfremat.RerunMismatchError, match=message):
    compile_step(step, mode)(tf.ones([2, 3]))


def _flaky_block(x):
  return tf.tanh(tf.sin(x))  # The second call's extra op: this line.


_FLAKY_LINE = "remat_patterns_test.py:" + str(
    _flaky_block.__code__.co_firstlineno + 1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["argument", "scope", "off"])
def test_debug_shows_every_op_and_the_line_that_made_it(mode, how):
  # PyTorch's checkpoint(debug=True): the whole op sequences of both passes,
  # each op with where in the caller's code it was made.
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tfremat.RematerializeFn(
          _Flaky(_flaky_block), x,
          debug=True if how == "argument" else None)
    return tape.gradient(y, x)

  with tfremat.debug_reruns(how == "scope"):
    with pytest.raises(tfremat.RerunMismatchError) as info:
      compile_step(step, mode)(tf.ones([2, 3]))
  message = str(info.value)
  assert message.count("tfremat: ") == 1, message
  assert ("Sin" in message and "Tanh" in message and
          "the first difference" in message), message
  if how == "off":
    assert "debug=True" in message and _FLAKY_LINE not in message, message
    return
  # Every op of both passes is listed, the rerun's Tanh with its line.
  tanh = [line for line in message.splitlines() if "Tanh" in line]
  assert len(tanh) == 1 and _FLAKY_LINE in tanh[0], message
  assert "debug=True" not in message, message


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_values_determinism_check_catches_different_values(mode):
  # [4] Opt-in, like PyTorch's determinism_check: the values are compared.
  def step(check, x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      scales = iter([1.0, 2.0])  # A Python-side value the rerun changes.
      # Recomputing everything: a save policy keeping the product (under
      # TFREMAT_TEST_POLICY) would hand the rerun the forward's values.
      y = tfremat.RematerializeFn(lambda v: tf.sin(v * next(scales)), x,
                                  determinism_check=check,
                                  policy="nothing_saveable")
    return tape.gradient(y, x)

  x = tf.ones([2, 3])
  # The default check sees the same ops with the same metadata and lets it
  # through ...
  compile_step(functools.partial(step, "default"), mode)(x)
  # ... the value check does not.
  with pytest.raises((tfremat.RerunMismatchError, tf.errors.InvalidArgumentError),
                     match="different values"):
    compile_step(functools.partial(step, "values"), mode)(x)


def test_values_determinism_check_under_xla_is_refused_clearly():
  step = tf.function(
      lambda x: tfremat.RematerializeFn(tf.sin, x, determinism_check="values"),
      jit_compile=True)
  with pytest.raises(ValueError, match="cannot run under XLA"):
    step(tf.ones([2]))


def _unused_output_grads(mode, shape, remat, dynamic=False):
  dynamic = dynamic and mode != "eager"
  """Gradients of `w` and `u`, where only `u` feeds an output the loss uses."""
  # w broadcasts, so the unused output has the (possibly dynamic) x shape.
  w = tf.Variable(tf.ones(shape[1:]), name="only_in_unused_output")
  u = tf.Variable(2.0)

  def fn(x):
    return x * u, x * w

  def step(x):
    with tf.GradientTape() as tape:
      used, unused = tfremat.RematerializeFn(fn, x) if remat else fn(x)
      del unused
    return tape.gradient(used, [w, u])

  if dynamic:  # Traced for a length only known when the step runs.
    signature = [tf.TensorSpec([None] + list(shape[1:]), tf.float32)]
    step = tf.function(step, input_signature=signature,
                       jit_compile=(mode == "xla"))
  else:
    step = compile_step(step, mode)
  return step(tf.ones(shape))


_UNUSED_CASES = [((4,), False), ((200, 100), False), ((4,), True)]


@parametrize_all
@pytest.mark.parametrize("shape, dynamic", _UNUSED_CASES,
                         ids=["small", "over-10k-elements", "dynamic-shape"])
def test_unused_output_gives_none_like_plain(device, mode, shape, dynamic):
  # [5] None, not zeros, for a variable that only an unused output reads:
  # small, over 10k elements, and with a shape unknown at trace time (a
  # dynamic shape means nothing in eager mode, where the case repeats the
  # small one).
  with tf.device(device):
    expected = _unused_output_grads(mode, shape, False, dynamic=dynamic)
    got = _unused_output_grads(mode, shape, True, dynamic=dynamic)
  assert expected[0] is None and got[0] is None
  assert_trees_close(got, expected)


@parametrize_all
def test_all_zero_output_gradients_give_zeros_like_plain(device, mode):
  # [5] A caller's zero output_gradients are a gradient, not "unused".
  with tf.device(device):
    w = tf.Variable([1.0, 2.0])

  def step(remat, x):
    with tf.GradientTape() as tape:
      fn = lambda v: v * w
      y = tfremat.RematerializeFn(fn, x) if remat else fn(x)
    return tape.gradient(y, w, output_gradients=tf.zeros_like(y))

  with tf.device(device):
    expected = compile_step(functools.partial(step, False), mode)(tf.ones([2]))
    got = compile_step(functools.partial(step, True), mode)(tf.ones([2]))
  assert expected is not None and got is not None
  np.testing.assert_array_equal(got.numpy(), expected.numpy())


@pytest.mark.parametrize("mode", MODES)
def test_forward_accumulator_is_refused_before_state_changes(mode):
  # [5] A JVP through the rerun came out all zero (z**3 at [1, 2]: [0, 0]
  # instead of [3, 12]). Forward mode keeps no activations, so there is
  # nothing to rematerialize: refused, with the fix in the message.
  counter = keras.Variable(0.0, trainable=False)

  def cube(v):
    counter.assign(counter + 1.0)
    return v ** 3

  def jvp(remat, z):
    with tf.autodiff.ForwardAccumulator(z, tf.ones_like(z)) as acc:
      y = tfremat.RematerializeFn(cube, z) if remat else cube(z)
    return acc.jvp(y)

  z = tf.constant([1.0, 2.0])
  np.testing.assert_allclose(
      compile_step(functools.partial(jvp, False), mode)(z).numpy(), [3, 12])
  counter.assign(0.0)
  with pytest.raises(tfremat.UnreplayableOpError,
                     match="ForwardAccumulator.*without rematerialization"):
    compile_step(functools.partial(jvp, True), mode)(z)
  assert counter.numpy() == 0.0


@parametrize_all
def test_keras_variable_changed_between_passes_uses_forward_value(device, mode):
  # [6] A persistent tape, an assignment, then the gradient: as plain, the
  # backward pass uses the value the forward pass read.
  with tf.device(device):
    dense = keras.layers.Dense(3)
    dense.build((None, 4))

  def step(remat, x):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(x)
      y = tfremat.RematerializeFn(dense, x) if remat else dense(x)
      loss = tf.reduce_sum(tf.sin(y))
    dense.kernel.assign_add(tf.ones_like(dense.kernel))
    return tape.gradient(loss, [x, dense.kernel])

  with tf.device(device):
    before = snapshot(dense.variables)
    expected = compile_step(functools.partial(step, False), mode)(_x(2, 4))
    for v, value in zip(dense.variables, before):
      v.assign(value)
    got = compile_step(functools.partial(step, True), mode)(_x(2, 4))
  assert_trees_close(got, expected)


@pytest.mark.parametrize("device, mode", device_modes(["function", "xla"]))
def test_raw_variable_changed_between_passes_uses_forward_value(device, mode):
  # [6] In a graph, reads of a raw tf.Variable are replaced by the forward
  # pass's read.
  with tf.device(device):
    w = tf.Variable(_x(4, 3, seed=4))

  def step(remat, x):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(x)
      fn = lambda v: tf.sin(tf.matmul(v, w))
      y = tfremat.RematerializeFn(fn, x) if remat else fn(x)
    w.assign_add(tf.ones_like(w))
    return tape.gradient(y, [x, w])

  with tf.device(device):
    start = w.numpy()
    expected = compile_step(functools.partial(step, False), mode)(_x(2, 4))
    w.assign(start)
    got = compile_step(functools.partial(step, True), mode)(_x(2, 4))
  assert_trees_close(got, expected)


@pytest.mark.parametrize("mode", ["function", "xla"])
def test_raw_variable_of_a_strategy_read_outside_its_replicas(mode):
  # A tf.Variable made in a MirroredStrategy's scope, read by a step run in
  # that scope but not in `strategy.run` (a cross-replica context), as a
  # budget's measurement in remat_model does. The variable's own `.handle`
  # raises there, so neither pass may ask for it. (The distribute worker's
  # Keras case crashed that way before `forward_ops.handle`; this raw case passed
  # without it too, since the passes meet the variable's local copy. It
  # guards the raw path.)
  strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
  with strategy.scope():
    w = tf.Variable(_x(4, 3, seed=4))

  def step(remat, x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      fn = lambda v: tf.sin(tf.matmul(v, w))
      y = tfremat.RematerializeFn(fn, x) if remat else fn(x)
    # Only x's: TensorFlow differentiates a distributed variable only in
    # a replica context.
    return tape.gradient(y, x)

  with strategy.scope():
    expected = compile_step(functools.partial(step, False), mode)(_x(2, 4))
    got = compile_step(functools.partial(step, True), mode)(_x(2, 4))
  assert_trees_close(got, expected)


def test_raw_variable_changed_between_passes_raises_in_eager():
  # [6] Eager reruns reread tf.Variables: refuse rather than be wrong.
  w = tf.Variable(tf.ones([2]))
  x = tf.constant([1.0, 2.0])
  with tf.GradientTape(persistent=True) as tape:
    tape.watch(x)
    y = tfremat.RematerializeFn(lambda v: v * w * w, x)
  w.assign_add(tf.ones([2]))
  with pytest.raises(tfremat.RerunMismatchError, match="changed between"):
    tape.gradient(y, x)


@parametrize_all
def test_tensor_keyword_arguments_of_decorator_get_gradients(device, mode):
  # [7] Keras remat_test.py test_remat_with_kwargs, with a tensor keyword.
  def block(x, scale=None, act="tanh"):
    return keras.activations.get(act)(x * scale)

  remat_block = tfremat.rematerialize(block)
  call = lambda remat, x, s: (remat_block if remat else block)(
      x, scale=s, act="sigmoid")
  with tf.device(device):
    inputs = (_x(3, 2), _x(3, 2, seed=1))
  _, ((dx, ds), _) = assert_parity(call, inputs, [], mode, device)
  assert np.abs(ds).max() > 0


@parametrize_all
def test_watched_non_trainable_variable_input_gets_gradient(device, mode):
  # [8] A variable passed as an input is differentiated whether or not it is
  # trainable, like any watched input.
  with tf.device(device):
    v = tf.Variable(_x(3, 3, seed=3), trainable=False)

  def step(remat, x):
    with tf.GradientTape() as tape:
      tape.watch(v)
      fn = lambda a, var: tf.tanh(tf.matmul(a, var))
      y = tfremat.RematerializeFn(fn, x, v) if remat else fn(x, v)
    return tape.gradient(y, v)

  with tf.device(device):
    expected = compile_step(functools.partial(step, False), mode)(_x(2, 3))
    got = compile_step(functools.partial(step, True), mode)(_x(2, 3))
  assert expected is not None
  assert_trees_close(got, expected)


def _autograph_fn(z):
  # [10] Tensor-dependent Python control flow, converted by AutoGraph.
  if tf.reduce_sum(z) > 0:
    z = tf.sin(z)
  else:
    z = tf.cos(z)
  for _ in tf.range(3):
    z = z * 1.5 + tf.tanh(z)
  return z


@pytest.mark.parametrize("device, mode", device_modes(["function", "xla"]))
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_autograph_control_flow_matches_plain(device, mode, sign):
  call = lambda remat, x: (tfremat.RematerializeFn(_autograph_fn, x) if remat
                           else _autograph_fn(x))
  with tf.device(device):
    x = sign * tf.abs(_x(2, 3))
  assert_parity(call, (x,), [], mode, device)


def _eager_python_fn(z):
  # [11] Code that only eager mode runs: .numpy(), int(), `if tensor`.
  scale = float(z.numpy().max())
  repeats = int(tf.size(z)) // 3
  if tf.reduce_sum(z) > 0:
    z = z * scale
  for _ in range(repeats):
    z = tf.tanh(z) + z
  return z


@pytest.mark.parametrize("device", DEVICES)
def test_eager_python_on_tensor_values_matches_plain(device):
  # [11] TF's recompute_grad tests run in eager mode too
  # (tensorflow/python/ops/gradients_test.py, testFnRecompute).
  call = lambda remat, x: (tfremat.RematerializeFn(_eager_python_fn, x)
                           if remat else _eager_python_fn(x))
  with tf.device(device):
    x = tf.abs(_x(2, 3))
  assert_parity(call, (x,), [], "eager", device)


@parametrize_all
def test_python_scalars_pass_through_positionally(device, mode):
  # [12] DeepSpeed test_activation_checkpointing.py TestCheckpointNonTensor
  # (test_ckpt_non_tensor_input): None, ints, bools, strings reach fn as
  # they are.
  with tf.device(device):
    keras.utils.set_random_seed(2)
    block = keras.Sequential([keras.layers.Dense(4),
                              keras.layers.Dropout(0.5, seed=1)])
    block.build((None, 3))

  def fn(z, training, repeats, act, nothing):
    assert training is True and repeats == 2 and nothing is None
    assert isinstance(act, str)
    for _ in range(repeats):
      z = keras.activations.get(act)(block(z, training=training))[:, :3]
    return z

  call = lambda remat, x: (tfremat.RematerializeFn(fn, x, True, 2, "relu", None)
                           if remat else fn(x, True, 2, "relu", None))
  assert_parity(call, (_x(4, 3),), block.trainable_weights, mode, device,
                state=block.variables)


@parametrize_all
def test_non_tensor_outputs_pass_through(device, mode):
  # [12] PyTorch TestCheckpoint test_checkpoint_non_tensor_inputs_outputs.
  def foo(t1, t2, scale, t3):
    t4 = (t1 + t2 * t3) * scale
    t5 = (t1 * t2 + t3) * scale
    return scale, t4, None, True, t5, "bar", t1

  def call(remat, t1, t2, t3):
    out = (tfremat.RematerializeFn(foo, t1, t2, 4.5, t3) if remat
           else foo(t1, t2, 4.5, t3))
    assert out[0] == 4.5 and out[2] is None and out[3] is True
    assert out[5] == "bar"
    return out[1], out[4], out[6]

  with tf.device(device):
    inputs = (_x(3), _x(3, seed=1), _x(3, seed=2))
  assert_parity(call, inputs, [], mode, device)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_generator_draw_is_refused_and_leaves_its_state(mode):
  # [13] In eager mode the op callback runs after the draw; the generator's
  # state is put back before the error reaches the caller.
  generator = tf.random.Generator.from_seed(7)
  before = generator.state.numpy().copy()
  step = compile_step(lambda x: tfremat.RematerializeFn(
      lambda v: v + generator.normal(tf.shape(v)), x), mode)
  with pytest.raises(tfremat.UnreplayableOpError, match="tf.random.Generator"):
    step(tf.ones([2, 3]))
  np.testing.assert_array_equal(generator.state.numpy(), before)
  # The generator still draws what it would have drawn.
  np.testing.assert_array_equal(
      generator.normal([3]).numpy(),
      tf.random.Generator.from_seed(7).normal([3]).numpy())


@parametrize_all
@pytest.mark.parametrize("fn", [lambda x, y: x * y, lambda x, y: x],
                         ids=["mul", "first-only"])
def test_same_tensor_passed_twice(device, mode, fn):
  # TensorFlow tensorflow/python/ops/gradients_test.py
  # testFnRecomputeSameTensor: f(x, x).
  call = lambda remat, x: (tfremat.RematerializeFn(fn, x, x) if remat
                           else fn(x, x))
  with tf.device(device):
    x = _x(10)
  assert_parity(call, (x,), [], mode, device)


@pytest.mark.parametrize("device, mode", device_modes(["function", "xla"]))
def test_tf_gradients_over_two_outputs_in_a_graph(device, mode):
  # Lingvo lingvo/core/py_utils_test.py RematerializeFnTest.testRandomNormal:
  # tf.gradients of two outputs, inputs passed as tensors.
  def fn(a, b):
    c = tf.matmul(a, b)
    return tf.nn.sigmoid(c), tf.nn.tanh(c)

  def step(a, b):
    grads = []
    for use_remat in (False, True):
      d, e = tfremat.RematerializeFn(fn, a, b) if use_remat else fn(a, b)
      grads.append(tf.gradients([d, e], [a, b]))
    return grads

  with tf.device(device):
    plain, remat = compile_step(step, mode)(_x(2, 3), _x(3, 4, seed=1))
  assert_trees_close(remat, plain)


def test_lambda_layer_in_functional_model_fits_like_plain():
  # Keras keras/src/backend/common/remat_test.py test_remat_basic_call: a
  # rematerialized function in a Lambda layer of a functional model.
  data = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
  target = data[:, :1] * 2.0
  weights = []
  for use_remat in (False, True):
    keras.utils.set_random_seed(1)
    relu = keras.layers.ReLU()
    fn = ((lambda t: tfremat.RematerializeFn(relu, t)) if use_remat
          else relu)
    inputs = keras.Input((4,))
    h = keras.layers.Lambda(fn)(keras.layers.Dense(4)(inputs))
    model = keras.Model(inputs, keras.layers.Dense(1)(h))
    assert_trees_close(model.predict(data, verbose=0), model(data))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(data, target, epochs=2, batch_size=16, shuffle=False, verbose=0)
    weights.append(snapshot(model.trainable_weights))
  assert_trees_close(weights[1], weights[0])


def test_decorator_keyword_defaults_and_numpy_input():
  # Keras remat_test.py test_remat_with_kwargs: Python keyword arguments,
  # their defaults, and a NumPy input, which reaches fn unchanged.
  def fn_with_kwargs(x, scale=1.0, offset=0.0):
    assert isinstance(x, np.ndarray)
    return x * scale + offset

  x = np.array([1.0, 2.0, 3.0], dtype=np.float32)
  remat_fn = tfremat.rematerialize(fn_with_kwargs)
  np.testing.assert_allclose(remat_fn(x, scale=2.0, offset=1.0), [3, 5, 7])
  np.testing.assert_allclose(remat_fn(x), x)
  np.testing.assert_allclose(remat_fn(x, scale=3.0), 3 * x)


def _smooth_block(seed=6):
  keras.utils.set_random_seed(seed)
  block = keras.Sequential([keras.layers.Dense(5, activation="tanh"),
                            keras.layers.Dense(3, activation="softplus")])
  block.build((None, 4))
  return block


@parametrize_all
@pytest.mark.parametrize("pfor", [True, False], ids=["pfor", "while"])
def test_jacobian_matches_plain(device, mode, pfor):
  # PyTorch test/test_autograd.py checkpoint tests take Jacobians through
  # checkpointed code; tf.GradientTape.jacobian vectorizes the backward
  # pass (pfor) or loops over it.
  with tf.device(device):
    block = _smooth_block()

  def step(remat, x):
    with tf.GradientTape(persistent=True) as tape:
      tape.watch(x)
      y = tfremat.RematerializeFn(block, x) if remat else block(x)
    return (tape.jacobian(y, x, experimental_use_pfor=pfor),
            tape.jacobian(y, block.trainable_weights[0],
                          experimental_use_pfor=pfor))

  with tf.device(device):
    expected = compile_step(functools.partial(step, False), mode)(_x(2, 4))
    got = compile_step(functools.partial(step, True), mode)(_x(2, 4))
  assert_trees_close(got, expected)


@parametrize_all
@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_second_order_gradients_match_plain(device, mode, policy):
  # PyTorch TestCheckpoint / test_autograd.py: double backward through a
  # checkpoint. A Hessian-vector product and a gradient penalty, both
  # differentiating the rerun's gradient. Under a policy the outer tape
  # must see the rerun's own ops, not the kept tensors.
  with tf.device(device):
    block = _smooth_block()

  def step(remat, x):
    with tf.GradientTape(persistent=True) as outer:
      outer.watch(x)
      with tf.GradientTape() as inner:
        inner.watch(x)
        y = (tfremat.RematerializeFn(block, x, policy=policy) if remat
             else block(x))
        loss = tf.reduce_sum(y ** 2)
      dx, dw = inner.gradient(loss, [x, block.trainable_weights[0]])
      penalty = tf.reduce_sum(dx ** 2) + tf.reduce_sum(tf.sin(dw))
    return (outer.gradient(penalty, [x] + block.trainable_weights),
            outer.gradient(dx, x, output_gradients=tf.ones_like(x)))

  with tf.device(device):
    expected = compile_step(functools.partial(step, False), mode)(_x(2, 4))
    got = compile_step(functools.partial(step, True), mode)(_x(2, 4))
  assert all(g is not None for g in tf.nest.flatten(expected))
  assert_trees_close(got, expected)


@pytest.mark.parametrize("device, mode", device_modes(["function", "xla"]))
def test_closure_from_outside_a_while_loop_body_gets_its_gradient(device,
                                                                  mode):
  # [2] Inside a loop body, a tensor computed outside the loop reaches the
  # block as the body graph's capture, a placeholder made while the block
  # is traced.
  def step(remat, x, w):
    with tf.GradientTape() as tape:
      tape.watch([x, w])
      y = tf.sin(w)

      def body(i, h):
        fn = lambda v: tf.tanh(v * y)
        return i + 1, tfremat.RematerializeFn(fn, h) if remat else fn(h)

      # XLA differentiates loops with a known maximum only.
      _, h = tf.while_loop(lambda i, h: i < 3, body, [0, x],
                           maximum_iterations=3)
      loss = tf.reduce_sum(h * h)
    return tape.gradient(loss, [x, w])

  with tf.device(device):
    inputs = (tf.constant([0.3, 0.4]), tf.constant([1.5, 2.0]))
    expected = compile_step(functools.partial(step, False), mode)(*inputs)
    got = compile_step(functools.partial(step, True), mode)(*inputs)
  assert np.abs(expected[1]).min() > 1e-3
  assert_trees_close(got, expected)


_EXCEPTION_IN_INNER_TAPES = """
import numpy as np, tensorflow as tf, tfremat

def failing(x):
  with tf.GradientTape() as tape:
    tape.watch(x)
    tf.sin(x)
    raise ValueError("raised inside the block")

def middle(x):
  with tf.GradientTape() as tape:
    tape.watch(x)
    return tfremat.RematerializeFn(failing, x)

x = tf.constant(0.3)
for fn in (failing, middle):
  for compiled in (False, True):
    call = lambda v: tfremat.RematerializeFn(fn, v)
    call = tf.function(call) if compiled else call
    for _ in range(3):
      with tf.GradientTape() as outer:
        outer.watch(x)
        try:
          call(x)
          raise AssertionError("no error")
        except ValueError as e:
          assert "raised inside the block" in str(e), e
        y = tf.sin(x) * 2.0
      np.testing.assert_allclose(outer.gradient(y, x), 2.0 * np.cos(0.3),
                                 rtol=1e-6)

# Third-order gradients through nested checkpoints (PyTorch's
# TestNestedCheckpoint): each call used to drop a reference to the outer tape.
def inner(x):
  with tf.GradientTape() as t3:
    t3.watch(x)
    y = tf.sin(x)
  return t3.gradient(y, x)

def nested(remat):
  def middle(x):
    with tf.GradientTape() as t2:
      t2.watch(x)
      y = tfremat.RematerializeFn(inner, x) if remat else inner(x)
    return t2.gradient(y, x)
  return middle

for _ in range(20):
  grads = []
  for remat in (False, True):
    with tf.GradientTape() as t1:
      t1.watch(x)
      middle = nested(remat)
      y = tfremat.RematerializeFn(middle, x) if remat else middle(x)
    grads.append(float(t1.gradient(y, x)))
  assert grads[0] == grads[1] == float(-tf.cos(x)), grads
print("ok")
"""


def test_nested_inner_tapes_and_errors_inside_them_leave_outer_tapes_working():
  # An error raised while the block's own tape is open (and, nested, while
  # an enclosing call has set the outer tapes aside) puts every tape back:
  # the outer tape then records and differentiates as if nothing happened.
  # Before, the nested case freed the outer tape and crashed the process,
  # so the scenario runs in a subprocess: a crash fails this test alone.
  done = subprocess.run(
      [sys.executable, "-c", _EXCEPTION_IN_INNER_TAPES],
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES=""),
      capture_output=True, text=True, check=False)
  assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (
      done.returncode, done.stdout, done.stderr[-2000:])


class _Residual(keras.layers.Layer):
  """A residual block without a build method: Keras builds it by calling it
  symbolically, in a scratch graph."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.inner = keras.layers.Dense(8, activation="gelu")
    self.drop = keras.layers.Dropout(0.1, seed=1)
    self.outer = keras.layers.Dense(4)

  def call(self, x, training=None):
    return x + self.outer(self.drop(self.inner(x), training=training))


@parametrize_all
def test_sequential_built_during_the_forward_pass_matches_plain(device, mode):
  # A new keras.Sequential builds on its first call, inside the forward pass,
  # by tracing its layers in a scratch graph; those traced ops are not part
  # of what the forward pass computes, and the rerun does not trace them.
  keras.utils.set_random_seed(2)
  blocks = [_Residual() for _ in range(3)]
  for block in blocks:
    block(tf.zeros([1, 4]))
  variables = [v for b in blocks for v in b.trainable_variables]
  made = {}

  def call(remat, x):
    if remat not in made:
      made[remat] = keras.Sequential(blocks)
      if remat:
        made[remat] = tfremat.RematerializationLayer(made[remat])
    return made[remat](x, training=True)

  state = [v for b in blocks for v in b.variables]  # Dropout's seed state.
  with tf.device(device):
    assert_parity(call, (_x(2, 4),), variables, mode, device, state=state)


@parametrize_all
def test_tf_function_called_inside_fn_matches_plain(device, mode):
  # Its first call traces it inside the forward pass; under a gradient tape
  # the rerun calls its forward variant, traced anew.
  inner = tf.function(lambda t: tf.sin(t) * 2.0 + t)
  w = tf.Variable(_x(4, 4, seed=3))

  def call(remat, x):
    body = lambda u: inner(tf.matmul(u, w))
    return tfremat.RematerializeFn(body, x) if remat else body(x)

  assert_parity(call, (_x(2, 4),), [w], mode, device)
