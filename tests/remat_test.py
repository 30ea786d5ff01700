"""Gradient and state parity of RematerializeFn against the plain computation.

Each parity test runs the same computation twice from the same variable
values and seeds, once plainly and once rematerialized, and checks that the
outputs, the gradients (inputs and variables) and the variable state after the
step (BatchNormalization statistics, seed generator states) agree.
"""

import functools
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat._src.core import remat as remat_lib
from conftest import DEVICE_MODES, DEVICES, MODES
from conftest import assert_parity, assert_trees_close, compile_step, snapshot
from conftest import training_step as _step


def _maybe_remat(remat, fn, *xs):
  return tfremat.RematerializeFn(fn, *xs) if remat else fn(*xs)


def _x(*shape, seed=0):
  return tf.random.stateless_normal(shape, seed=[seed, 7])


def _mlp(widths, dropout=None, batch_norm=False, seed=0):
  keras.utils.set_random_seed(seed)
  layers = []
  for i, w in enumerate(widths):
    layers.append(keras.layers.Dense(w, activation="tanh"))
    if batch_norm:
      layers.append(keras.layers.BatchNormalization())
    if dropout:
      layers.append(keras.layers.Dropout(dropout, seed=100 + i))
  model = keras.Sequential(layers)
  model.build((None, 6))
  return model


parametrize_all = pytest.mark.parametrize("device, mode", DEVICE_MODES)


@parametrize_all
def test_dense_stack_with_captured_variables_matches_plain(device, mode):
  with tf.device(device):
    model = _mlp([16, 16, 4])
  call = lambda remat, x: _maybe_remat(remat, model, x)
  outputs, (dx, dw) = assert_parity(
      call, (_x(5, 6),), model.trainable_weights, mode, device)
  assert all(g is not None and np.abs(g).max() > 0
             for g in tf.nest.flatten(dx) + dw)


@parametrize_all
def test_keras_dropout_gradients_match_plain(device, mode):
  # tf.recompute_grad redraws the mask here: max gradient error ~1e2.
  with tf.device(device):
    model = _mlp([32, 32, 4], dropout=0.5)
  call = lambda remat, x: _maybe_remat(
      remat, lambda h: model(h, training=True), x)
  outputs, _ = assert_parity(call, (_x(8, 6),), model.trainable_weights, mode,
                             device, state=model.variables)
  # Dropout really ran: about half of the hidden units are zeroed.
  hidden = model.layers[1](model.layers[0](_x(8, 6)), training=True)
  assert 0.2 < np.mean(hidden.numpy() == 0) < 0.8


@parametrize_all
def test_deterministic_dropout_gradients_match_plain(device, mode):
  with tf.device(device):
    w = tf.Variable(tf.random.stateless_normal([6, 32], seed=[1, 2]))

  def block(x):
    h = tf.matmul(x, w)
    h = tfremat.DeterministicDropout(h, 0.5, tfremat.GenerateStepSeedPair())
    return tfremat.DeterministicDropout(
        tf.tanh(h), 0.7, tfremat.GenerateStepSeedPair(op_seed=3))

  def call(remat, x):
    tfremat.ResetStepSeed(11)
    return _maybe_remat(remat, block, x)

  # Seeds drawn in a tf.function need a global step.
  tfremat.SetGlobalStep(tf.Variable(3, dtype=tf.int64))
  try:
    outputs, _ = assert_parity(call, (_x(4, 6),), [w], mode, device)
  finally:
    tfremat.SetGlobalStep(None)
  assert 0.2 < np.mean(outputs.numpy() == 0) < 0.8


@parametrize_all
def test_batch_norm_moving_statistics_updated_once(device, mode):
  with tf.device(device):
    model = _mlp([16, 8], batch_norm=True)
  call = lambda remat, x: _maybe_remat(
      remat, lambda h: model(h, training=True), x)
  bn = model.layers[1]
  before = snapshot(bn.non_trainable_weights)
  assert_parity(call, (_x(10, 6),), model.trainable_weights, mode, device,
                state=model.variables)
  after = snapshot(bn.non_trainable_weights)
  # The statistics moved (by one update: the parity check compares them with
  # the plain step's).
  assert not np.allclose(after[0], before[0])


def test_rerun_builds_no_gradient_towards_a_stopped_tensor():
  # BatchNormalization's variance reads its mean through a stop_gradient.
  # A gradient tape skips the gradient towards an input it does not watch;
  # `tf.gradients` builds it (a Neg, a Sum and a Reshape) and throws it away,
  # in every normalization a CNN's rerun recomputes. The rerun's gradient
  # must build no more of it than the plain step's does.
  keras.utils.set_random_seed(0)
  norm = keras.layers.BatchNormalization()
  norm.build((None, 3, 5))

  def op_types(remat):
    @tf.function
    def step(x):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = _maybe_remat(remat, lambda h: norm(h, training=True), x)
        loss = tf.reduce_sum(y * y)
      return tape.gradient(loss, [x] + norm.trainable_weights)

    graph = step.get_concrete_function(tf.TensorSpec([4, 3, 5])).graph
    return [op.type for op in graph.get_operations()]

  assert op_types(True).count("Neg") == op_types(False).count("Neg")


@parametrize_all
def test_multi_head_attention_dropout_matches_plain(device, mode):
  with tf.device(device):
    keras.utils.set_random_seed(3)
    mha = keras.layers.MultiHeadAttention(2, 4, dropout=0.3, seed=5)
    x = _x(2, 5, 8)
    mha(x, x)
  call = lambda remat, x: _maybe_remat(
      remat, lambda h: mha(h, h, training=True), x)
  assert_parity(call, (x,), mha.trainable_weights, mode, device,
                state=mha.variables)


@parametrize_all
def test_nested_inputs_and_outputs(device, mode):
  with tf.device(device):
    w = tf.Variable(tf.random.stateless_normal([3, 3], seed=[4, 2]))

  def fn(pair, named):
    a, b = pair
    h = tf.matmul(a, w) * named["scale"] + b
    return {"h": h, "parts": (tf.sin(h), [tf.reduce_sum(h, axis=1)])}

  inputs = ((_x(2, 3), _x(2, 3, seed=1)), {"scale": _x(2, 1, seed=2)})
  call = lambda remat, *xs: _maybe_remat(remat, fn, *xs)
  outputs, (dx, _) = assert_parity(call, inputs, [w], mode, device)
  assert set(outputs) == {"h", "parts"}
  assert dx[1]["scale"].shape == (2, 1)


@parametrize_all
def test_int_and_bool_inputs_get_no_gradient(device, mode):
  with tf.device(device):
    table = tf.Variable(tf.random.stateless_normal([10, 4], seed=[5, 2]))

  def fn(x, ids, keep):
    picked = tf.gather(table, ids)
    return tf.where(keep[:, None], picked * x, x), ids + 1

  inputs = (_x(3, 4), tf.constant([1, 7, 7]), tf.constant([True, False, True]))
  call = lambda remat, *xs: _maybe_remat(remat, fn, *xs)
  outputs, (dx, dw) = assert_parity(call, inputs, [table], mode, device)
  assert dx[1] is None and dx[2] is None
  np.testing.assert_array_equal(outputs[1].numpy(), [2, 8, 8])


@parametrize_all
def test_keyword_arguments_in_decorator(device, mode):
  # tf.recompute_grad raises on `training=` inside tf.function.
  with tf.device(device):
    model = _mlp([16, 4], dropout=0.4)

  def block(x, training=False):
    return model(x, training=training)

  remat_block = tfremat.rematerialize(block)
  call = lambda remat, x: (remat_block if remat else block)(x, training=True)
  assert_parity(call, (_x(6, 6),), model.trainable_weights, mode, device,
                state=model.variables)


@parametrize_all
def test_weight_sharing_same_function_called_twice(device, mode):
  with tf.device(device):
    model = _mlp([6, 6], dropout=0.3)
  f = lambda h: model(h, training=True)
  call = lambda remat, x: _maybe_remat(remat, f, _maybe_remat(remat, f, x))
  assert_parity(call, (_x(4, 6),), model.trainable_weights, mode, device,
                state=model.variables)


@parametrize_all
def test_ignored_inputs_and_outputs_match_plain(device, mode):
  with tf.device(device):
    w = tf.Variable(tf.ones([2, 2]))
    unused = tf.Variable(tf.ones([2]))

  def fn(x, ignored):
    del ignored
    return tf.matmul(x, w), tf.constant(3.0) * tf.reduce_sum(unused)

  def call(remat, x, ignored):
    return _maybe_remat(remat, fn, x, ignored)[0]

  _, ((dx, dignored), (dw, dunused)) = assert_parity(
      call, (_x(2, 2), _x(2, 2, seed=1)), [w, unused], mode, device)
  assert dignored is None and dunused is None and dx is not None


@parametrize_all
def test_variable_inputs_receive_gradients(device, mode):
  with tf.device(device):
    v = tf.Variable(tf.random.stateless_normal([4, 4], seed=[6, 1]))
  call = lambda remat, x: _maybe_remat(
      remat, lambda a, var: tf.tanh(tf.matmul(a, var)), x, v)
  _, (_, (dv,)) = assert_parity(call, (_x(3, 4),), [v], mode, device)
  assert np.abs(dv).max() > 0


@pytest.mark.parametrize("device", DEVICES)
def test_nested_rematerialization_matches_plain(device):
  with tf.device(device):
    inner, outer = _mlp([6], dropout=0.5, seed=1), _mlp([6], seed=2)

  def fn(remat, x):
    return outer(_maybe_remat(remat, lambda h: inner(h, training=True), x))

  call = lambda remat, x: _maybe_remat(remat, functools.partial(fn, remat), x)
  assert_parity(call, (_x(4, 6),),
                inner.trainable_weights + outer.trainable_weights, "function",
                device, state=inner.variables + outer.variables)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_incoming_gradient_propagates_as_plain(device):
  # The recompute is gated on the incoming gradient; a NaN there must not
  # change what the gradient computation does.
  with tf.device(device):
    w = tf.Variable([[1.0, 2.0], [3.0, 4.0]])
  call = lambda remat, x: tf.sqrt(
      _maybe_remat(remat, lambda a: tf.matmul(a, w), x) - 100.0)
  with tf.device(device):
    results = []
    for remat in (False, True):
      step = tf.function(_step(functools.partial(call, remat), [w]))
      results.append(step(tf.ones([1, 2])))
  assert np.isnan(results[0][1][1][0].numpy()).all()
  np.testing.assert_array_equal(results[1][1][1][0].numpy(),
                                results[0][1][1][0].numpy())


@pytest.mark.parametrize("mode", MODES)
def test_unbuilt_layer_is_built_on_first_call_with_real_weights(mode):
  keras.utils.set_random_seed(8)
  dense = keras.layers.Dense(5)
  x = _x(3, 6)
  step = compile_step(
      lambda a: tfremat.RematerializeFn(dense, a), mode)
  first = step(x)
  np.testing.assert_allclose(first.numpy(), dense(x).numpy(), rtol=1e-6)
  assert len(dense.trainable_weights) == 2


class _CustomBlock(keras.layers.Layer):
  """The guide's pattern: a layer whose call rematerializes its sublayers."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(4, activation="relu")
    self.dropout = keras.layers.Dropout(0.5, seed=3)
    self.remat = True

  def call(self, x, training=None):
    fn = lambda h: self.dropout(self.dense(h), training=training)
    return tfremat.RematerializeFn(fn, x) if self.remat else fn(x)


def test_custom_layer_builds_on_a_keras_input_without_a_warning():
  # Keras builds it by a symbolic call in a scratch graph, where variables
  # have no values yet: the rematerialized call must not read them there.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    inputs, block = keras.Input((6,)), _CustomBlock()
    model = keras.Model(inputs, block(inputs))
  assert not [w for w in caught if "unbuilt state" in str(w.message)], [
      str(w.message) for w in caught]
  assert model.output.shape == (None, 4) and len(model.trainable_weights) == 2

  def call(remat, x):
    block.remat = remat
    return model(x, training=True)

  assert_parity(call, (_x(5, 6),), model.trainable_weights, "function",
                "/CPU:0", state=model.variables)


_STATEFUL_RANDOM = {
    "tf.random.uniform": lambda x: x * tf.random.uniform(tf.shape(x)),
    "tf.random.normal": lambda x: x + tf.random.normal(tf.shape(x)),
    "tf.nn.dropout": lambda x: tf.nn.dropout(x, 0.5),
    "tf.random.Generator": lambda x: x + _GENERATOR.normal(tf.shape(x)),
}
_GENERATOR = tf.random.Generator.from_seed(1)


@pytest.mark.parametrize("mode", ["eager", "function"])
@pytest.mark.parametrize("name", sorted(_STATEFUL_RANDOM))
def test_stateful_random_op_raises(mode, name):
  step = compile_step(
      lambda x: tfremat.RematerializeFn(_STATEFUL_RANDOM[name], x), mode)
  with pytest.raises(tfremat.UnreplayableOpError,
                     match="stateful random op.*stateless"):
    step(tf.ones([2, 3]))


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_error_is_raised_before_any_state_changes(mode):
  model = _mlp([4], dropout=0.5, batch_norm=True)
  before = snapshot(model.variables)

  def fn(x):
    return tf.nn.dropout(model(x, training=True), 0.5)

  step = compile_step(lambda x: tfremat.RematerializeFn(fn, x), mode)
  with pytest.raises(tfremat.UnreplayableOpError, match="tf.nn.dropout"):
    step(_x(5, 6))
  assert_trees_close(snapshot(model.variables), before, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_direct_variable_write_raises(mode):
  counter = tf.Variable(0.0)

  def fn(x):
    counter.assign_add(1.0)
    return x * 2.0

  step = compile_step(lambda x: tfremat.RematerializeFn(fn, x), mode)
  with pytest.raises(tfremat.UnreplayableOpError,
                     match="writes a tf.Variable.*keras.Variable"):
    step(tf.ones([2]))
  # Traced code is refused before it runs; an eager op is seen only after it
  # ran, so the write has happened exactly once (never twice).
  assert counter.numpy() == (1.0 if mode == "eager" else 0.0)


def test_keras_variable_counter_is_updated_once():
  counter = keras.Variable(0.0, trainable=False)

  def fn(x):
    counter.assign(counter + 1.0)
    return x * counter

  x = tf.ones([2])
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = tfremat.RematerializeFn(fn, x)
  grad = tape.gradient(y, x)
  assert counter.numpy() == 1.0
  # The rerun read the counter as it was at forward time, then added 1.
  np.testing.assert_array_equal(grad.numpy(), [1.0, 1.0])


def test_add_loss_inside_fn_raises_and_names_the_fix():

  class WithLoss(keras.layers.Layer):

    def call(self, x):
      self.add_loss(tf.reduce_sum(x))
      return x

  with pytest.raises(tfremat.UnreplayableOpError,
                     match="add_loss.*RematerializationLayer"):
    tfremat.RematerializeFn(WithLoss(), tf.ones([2]))


@pytest.mark.parametrize("mode", MODES)
def test_added_losses_come_back_differentiable(mode):
  # The layer wrapper hands these back to their layers; here: their
  # gradients equal those of the plain layer's losses.
  keras.utils.set_random_seed(4)
  dense = keras.layers.Dense(3, activity_regularizer="l2")
  x = _x(4, 5)
  dense(x)

  def step(remat, a):
    with tf.GradientTape() as tape:
      tape.watch(a)
      if remat:
        y, losses = remat_lib.rematerialize_with_losses(
            dense, (a,), on_losses=lambda losses: None)
        losses = [differentiable for _, differentiable in losses]
      else:
        y, losses = dense(a), dense.losses
      loss = tf.reduce_sum(y) + tf.add_n(losses)
    return losses, tape.gradient(loss, [a] + dense.trainable_weights)

  expected = compile_step(functools.partial(step, False), mode)(x)
  actual = compile_step(functools.partial(step, True), mode)(x)
  assert len(actual[0]) == 1
  assert_trees_close(actual, expected)


def test_only_variable_inputs_and_no_float_tensors():
  v = tf.Variable([1.0, 2.0])
  ids = tf.constant([1, 0])
  with tf.GradientTape() as tape:
    y = tfremat.RematerializeFn(lambda var, i: tf.gather(var, i) ** 2, v, ids)
  grad = tf.convert_to_tensor(tape.gradient(y, v))  # IndexedSlices, as plain.
  np.testing.assert_array_equal(grad.numpy(), [2.0, 4.0])


def test_bad_arguments_raise_clear_errors():
  with pytest.raises(TypeError, match="expects a callable"):
    tfremat.RematerializeFn(tf.ones([2]), tf.ones([2]))
  with pytest.raises(TypeError, match="expects a callable"):
    tfremat.rematerialize(3)
  with pytest.raises(ValueError, match="determinism_check must be one of"):
    tfremat.RematerializeFn(tf.sin, tf.ones([2]), determinism_check="exact")


@pytest.mark.parametrize("kind", ["ragged", "sparse"])
def test_ragged_and_sparse_arguments_under_xla_are_refused_clearly(kind):
  if kind == "ragged":
    x = tf.ragged.constant([[1.0, 2.0], [3.0]])
    fn = lambda r: tf.sin(r.to_tensor())
  else:
    x = tf.sparse.from_dense(tf.eye(3))
    fn = lambda s: tf.sin(tf.sparse.to_dense(s))
  step = compile_step(lambda: tf.reduce_sum(tfremat.RematerializeFn(fn, x)),
                      "xla")
  with pytest.raises(tfremat.errors.UnsupportedError,
                     match="under XLA.*without jit_compile"):
    step()
