"""RematerializationLayer: parity with the wrapped layer in everything Keras does."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from conftest import DEVICE_MODES, MODES, assert_trees_close, compile_step
from conftest import assert_serves_without_tfremat
from conftest import restore, snapshot

_X = np.random.RandomState(0).randn(16, 6).astype("float32")
_Y = np.random.RandomState(1).randn(16, 1).astype("float32")


def _block(i, width=6):
  return keras.Sequential([
      keras.layers.Dense(8, activation="relu"),
      keras.layers.Dropout(0.3, seed=i),
      keras.layers.BatchNormalization(),
      keras.layers.Dense(width),
  ], name=f"block{i}")


def _residual_model(wrap, blocks=3, seed=1):
  keras.utils.set_random_seed(seed)
  inputs = keras.Input((6,))
  h = inputs
  for i in range(blocks):
    block = _block(i)
    h = h + (tfremat.RematerializationLayer(block) if wrap else block)(h)
  return keras.Model(inputs, keras.layers.Dense(1)(h))


def _compile(model, mode, optimizer=None):
  model.compile(optimizer=optimizer or keras.optimizers.SGD(0.1), loss="mse",
                run_eagerly=(mode == "eager"), jit_compile=(mode == "xla"))
  return model


@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_fit_step_gives_the_weights_of_the_unwrapped_model(device, mode):
  weights = []
  with tf.device(device):
    for wrap in (False, True):
      model = _compile(_residual_model(wrap), mode)
      model.fit(_X, _Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
      weights.append(model.get_weights())
  # Trainable weights and BatchNormalization statistics (updated once).
  assert len(weights[1]) == 26
  assert_trees_close(weights[1], weights[0])


def _attention(device):
  """A MultiHeadAttention with dropout, and its wrapper."""
  with tf.device(device):
    keras.utils.set_random_seed(2)
    mha = keras.layers.MultiHeadAttention(2, 4, dropout=0.3, seed=3)
  return mha, tfremat.RematerializationLayer(mha)


def _assert_wrapper_parity(step, layer, wrapper, inputs, mode, device):
  """`step(wrapper, *inputs)` gives `step(layer, *inputs)`, from one state."""
  with tf.device(device):
    before = snapshot(layer.variables)
    expected = compile_step(lambda *a: step(layer, *a), mode)(*inputs)
    restore(layer.variables, before)
    got = compile_step(lambda *a: step(wrapper, *a), mode)(*inputs)
  assert_trees_close(got, expected)


@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_attention_with_dropout_and_keyword_tensors(device, mode):
  mha, wrapper = _attention(device)
  with tf.device(device):
    q = tf.random.stateless_normal([2, 5, 8], seed=[1, 1])
    v = tf.random.stateless_normal([2, 4, 8], seed=[1, 2])
    k = tf.random.stateless_normal([2, 4, 8], seed=[1, 3])
    attention_mask = tf.constant(np.tril(np.ones([5, 4]), 1)[None] > 0)
    mha(q, v, key=k)

  def step(layer, q, v, k):
    with tf.GradientTape() as tape:
      tape.watch([q, v, k])
      y = layer(q, v, key=k, attention_mask=attention_mask, training=True)
      loss = tf.reduce_sum(y * tf.sin(y))
    return y, tape.gradient(loss, [q, v, k] + mha.trainable_weights)

  _assert_wrapper_parity(step, mha, wrapper, (q, v, k), mode, device)


def test_weights_are_the_wrapped_layers():
  dense = keras.layers.Dense(3)
  wrapper = tfremat.RematerializationLayer(dense)
  wrapper(tf.ones([2, 4]))
  assert [id(w) for w in wrapper.trainable_weights] == [
      id(w) for w in dense.trainable_weights]
  new = [np.full(w.shape, 0.5, "float32") for w in dense.get_weights()]
  wrapper.set_weights(new)
  assert_trees_close(dense.get_weights(), new, rtol=0, atol=0)


def test_weights_file_round_trip(tmp_path):
  model = _residual_model(True)
  model.save_weights(tmp_path / "m.weights.h5")
  other = _residual_model(True, seed=9)
  other.load_weights(tmp_path / "m.weights.h5")
  assert_trees_close(other.get_weights(), model.get_weights(), rtol=0, atol=0)


def test_trainable_false_freezes_the_wrapped_layer():
  dense = keras.layers.Dense(3)
  wrapper = tfremat.RematerializationLayer(dense, trainable=False)
  wrapper(tf.ones([2, 4]))
  assert not dense.trainable and wrapper.trainable_weights == []
  assert len(wrapper.non_trainable_weights) == 2
  wrapper.trainable = True
  assert len(dense.trainable_weights) == 2


@pytest.mark.parametrize("mode", MODES)
def test_masks_propagate_as_through_the_wrapped_layer(mode):
  tokens = np.array([[3, 4, 0, 0], [5, 0, 0, 0]])
  models = []
  for wrap in (False, True):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((4,), dtype="int32")
    h = keras.layers.Embedding(10, 6, mask_zero=True)(inputs)
    lstm = keras.layers.LSTM(5, return_sequences=True)
    h = (tfremat.RematerializationLayer(lstm) if wrap else lstm)(h)
    # Averages over the unmasked steps only: depends on the mask arriving.
    outputs = keras.layers.GlobalAveragePooling1D()(h)
    models.append(keras.Model(inputs, outputs))

  def step(model, x):
    with tf.GradientTape() as tape:
      y = model(x, training=True)
      loss = tf.reduce_sum(y * y)
    return y, tape.gradient(loss, model.trainable_weights)

  results = [compile_step(lambda x, m=m: step(m, x), mode)(tokens)
             for m in models]
  assert_trees_close(results[1], results[0])
  wrapper = models[1].layers[2]
  assert wrapper.supports_masking
  h = models[1].layers[1](tokens)
  np.testing.assert_array_equal(wrapper(h)._keras_mask.numpy(), tokens > 0)


def test_output_shape_spec_and_dtype_are_the_wrapped_layers():
  mha = keras.layers.MultiHeadAttention(2, 4, output_shape=7)
  wrapper = tfremat.RematerializationLayer(mha)
  q, v = keras.Input((5, 8)), keras.Input((3, 6))
  out = wrapper(q, v)
  assert out.shape == (None, 5, 7) and wrapper.built and mha.built
  assert wrapper.compute_output_shape((2, 5, 8), (2, 3, 6)) == (2, 5, 7)
  assert wrapper.dtype_policy.name == mha.dtype_policy.name


def test_added_losses_are_the_wrapped_layers():
  for wrap in (False, True):
    keras.utils.set_random_seed(5)
    dense = keras.layers.Dense(3, activity_regularizer="l2")
    layer = tfremat.RematerializationLayer(dense) if wrap else dense
    with tf.GradientTape() as tape:
      y = layer(tf.ones([2, 4]))
      loss = tf.add_n(layer.losses) + tf.reduce_sum(y)
    grads = tape.gradient(loss, dense.trainable_weights)
    if wrap:
      assert len(layer.losses) == 1
      assert_trees_close((y, grads, loss), expected)
    else:
      expected = (y, grads, loss)


def test_config_round_trip():
  wrapper = tfremat.RematerializationLayer(_block(0), name="remat")
  config = wrapper.get_config()
  clone = tfremat.RematerializationLayer.from_config(config)
  assert clone.get_config() == config == wrapper.get_config()
  assert isinstance(clone.layer, keras.Sequential)
  assert keras.saving.get_registered_name(
      tfremat.RematerializationLayer) == "tfremat>RematerializationLayer"


def test_keras_file_round_trip_predicts_and_differentiates_the_same(tmp_path):
  model = _residual_model(True)
  path = str(tmp_path / "model.keras")
  model.save(path)
  loaded = keras.models.load_model(path)  # No custom_objects needed.
  assert any(isinstance(l, tfremat.RematerializationLayer)
             for l in loaded.layers)

  def grads(m):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(m(_X, training=False) ** 2)
    return tape.gradient(loss, m.trainable_weights)

  assert_trees_close(loaded.predict(_X, verbose=0), model.predict(_X, verbose=0))
  assert_trees_close(grads(loaded), grads(model))


@pytest.mark.parametrize("how", ["model.export", "tf.saved_model.save"])
def test_serving_artifact_predicts_without_tfremat(tmp_path, how):
  assert_serves_without_tfremat(_residual_model(True), _X, tmp_path, how)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_mixed_precision_matches_the_unwrapped_model(policy, mode):
  previous = keras.config.dtype_policy()
  keras.config.set_dtype_policy(policy)
  try:
    weights, dtypes = [], []
    for wrap in (False, True):
      model = _residual_model(wrap)
      optimizer = keras.optimizers.SGD(0.1)
      if policy == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
      _compile(model, mode, optimizer)
      model.fit(_X, _Y, batch_size=8, epochs=1, verbose=0, shuffle=False)
      weights.append(model.get_weights())
      wrapped = model.layers[1]
      dtypes.append((wrapped.compute_dtype, wrapped.variable_dtype,
                     model(_X[:2]).dtype))
  finally:
    keras.config.set_dtype_policy(previous)
  compute = "float16" if policy == "mixed_float16" else "bfloat16"
  assert dtypes[1] == dtypes[0] and dtypes[1][:2] == (compute, "float32")
  # The policy of conftest's scope (TFREMAT_TEST_POLICY), if any.
  keeps_dots = "dots" in (tfremat.policies.name_of(
      tfremat.policies.current()) or "")
  if policy == "mixed_bfloat16" and (mode == "eager" or keeps_dots):
    # The eager forward pass runs unfused kernels; the rerun is a graph
    # function, where MatMul+BiasAdd+Relu fuse and round differently at
    # bfloat16's 2**-8 precision (tf.function: equal at 1e-5, as with float16).
    # Under a policy that keeps the matmuls, the rerun adds the bias and
    # applies relu to the kept product unfused, where the forward pass fused
    # them (with oneDNN on, as TensorFlow sets it on AVX512_BF16 CPUs).
    assert_trees_close(weights[1], weights[0], rtol=2e-2, atol=2e-2)
  else:
    assert_trees_close(weights[1], weights[0])


def test_construction_errors_name_the_fix():
  with pytest.raises(TypeError, match="wraps a Keras layer.*RematerializeFn"):
    tfremat.RematerializationLayer(lambda x: x)
  with pytest.raises(TypeError, match="InputLayer"):
    tfremat.RematerializationLayer(keras.layers.InputLayer(shape=(3,)))


@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_tensor_and_python_keyword_arguments_mixed(device, mode):
  # Issue "Keras and Lingvo users' first hour" [1]: the wrapper takes what
  # the wrapped layer takes, tensors and Python values side by side.
  mha, wrapper = _attention(device)
  with tf.device(device):
    q = tf.random.stateless_normal([2, 5, 8], seed=[1, 1])
    kv = tf.random.stateless_normal([2, 5, 8], seed=[1, 2])
    mha(q, kv)

  def step(layer, q, kv):
    with tf.GradientTape() as tape:
      tape.watch([q, kv])
      y, scores = layer(q, value=kv, use_causal_mask=True,
                        return_attention_scores=True, training=True)
      loss = tf.reduce_sum(y * tf.sin(y)) + tf.reduce_sum(scores ** 2)
    return y, scores, tape.gradient(loss, [q, kv] + mha.trainable_weights)

  _assert_wrapper_parity(step, mha, wrapper, (q, kv), mode, device)


def test_custom_layer_with_numpy_and_string_keywords():
  # [1] A NumPy scalar and a string beside the tensor input.
  class Scaled(keras.layers.Layer):

    def call(self, x, scale=1.0, act="linear"):
      return keras.activations.get(act)(x * scale)

  layer = Scaled()
  x = tf.constant([[-1.0, 2.0]])
  got = tfremat.RematerializationLayer(layer)(x, scale=np.float32(2.0),
                                              act="relu")
  np.testing.assert_array_equal(got.numpy(), [[0.0, 4.0]])


@pytest.mark.parametrize("mode", ["int8", "float8"])
def test_layer_quantized_before_wrapping(mode):
  # [2] The wrapper runs a quantized layer's quantized call.
  keras.utils.set_random_seed(3)
  dense = keras.layers.Dense(4)
  dense.build((None, 6))
  dense.quantize(mode)
  wrapper = tfremat.RematerializationLayer(dense)
  x = tf.constant(_X[:4])
  assert wrapper.dtype_policy.quantization_mode is None
  assert dense.quantization_mode == mode
  assert_trees_close(wrapper(x), dense(x))
  if mode == "int8":
    # (Keras 3.15's float8 Dense raises in its own gradient on TensorFlow,
    # wrapped or not.)
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = wrapper(x)
    with tf.GradientTape() as plain_tape:
      plain_tape.watch(x)
      plain = dense(x)
    assert_trees_close(tape.gradient(y, x), plain_tape.gradient(plain, x))


def test_summary_names_the_wrapped_layer():
  # [3] A reader of model.summary() can tell which block is wrapped.
  inputs = keras.Input((6,))
  wrapper = tfremat.RematerializationLayer(_block(7))
  model = keras.Model(inputs, wrapper(inputs))
  lines = []
  model.summary(print_fn=lines.append)
  assert wrapper.name == "remat_block7"
  assert "remat_block7" in "\n".join(lines)
  named = tfremat.RematerializationLayer(_block(8), name="mine")
  assert named.name == "mine"


def test_wrapped_dense_round_trips_through_a_keras_file(tmp_path):
  # Found by remat_model: a Dense deserializes already built, and building it
  # again from the wrapper's build config added its weights twice ("cannot
  # add new elements of state").
  keras.utils.set_random_seed(2)
  inputs = keras.Input((4,))
  model = keras.Model(inputs, tfremat.RematerializationLayer(
      keras.layers.Dense(3, activation="relu"))(inputs))
  model.save(tmp_path / "m.keras")
  loaded = keras.models.load_model(tmp_path / "m.keras")
  x = np.ones([2, 4], "float32")
  assert_trees_close(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
