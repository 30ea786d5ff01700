"""Tests of tfremat.measure.predict_peak: a step's peak read from its
program, against what tfremat.measure.peak_bytes measures of the same
step."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import errors
from tfremat import measure

# The measured peak of a step is the largest of this many calls.
_CALLS = 10


def _mlp(remat=False, width=256, depth=4, seed=0):
  keras.utils.set_random_seed(seed)
  h = inputs = keras.Input((width,))
  for _ in range(depth):
    block = keras.Sequential([keras.layers.Dense(width * 2, activation="gelu"),
                              keras.layers.Dense(width)])
    if remat:
      block = tfremat.RematerializationLayer(block)
    h = keras.layers.Add()([h, block(h)])
  return keras.Model(inputs, keras.layers.Dense(16)(h))


def _step(model, jit_compile):
  """A hand-written training step: tape, MSE, Adam."""
  optimizer = keras.optimizers.Adam()
  optimizer.build(model.trainable_variables)

  def step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply(grads, model.trainable_variables)
    return loss

  return tf.function(step, jit_compile=jit_compile)


def _batch(rows, width=256):
  return (tf.random.stateless_normal([rows, width], seed=[1, 2]),
          tf.random.stateless_normal([rows, 16], seed=[3, 4]))


@pytest.mark.parametrize("remat", [False, True], ids=["kept", "remat"])
@pytest.mark.parametrize("rows", [128, 512])
def test_under_xla_the_prediction_is_the_measured_peak(remat, rows):
  step = _step(_mlp(remat), jit_compile=True)
  x, y = _batch(rows)
  predicted = measure.predict_peak(step, x, y)
  measured = measure.peak_bytes(step, x, y, calls=_CALLS)
  assert abs(predicted / measured - 1) <= 0.01, (predicted, measured)


def test_under_xla_it_sees_the_rerun_inside_the_gradient():
  x, y = _batch(512)
  kept = measure.predict_peak(_step(_mlp(False), True), x, y)
  remat = measure.predict_peak(_step(_mlp(True), True), x, y)
  # Each block keeps its input only: the 512 x 512 hidden activations
  # (1 MiB each, two per block) are not kept for the backward pass.
  assert remat < kept - 4 * 2**20, (remat, kept)


@pytest.mark.parametrize("remat", [False, True], ids=["kept", "remat"])
@pytest.mark.parametrize("jit_compile", [False, True], ids=["executor",
                                                             "xla"])
def test_keras_train_on_batch_is_predicted_as_compiled(jit_compile, remat):
  model = _mlp(remat=remat)
  model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
  x, y = _batch(512)
  predicted = measure.predict_peak(model.train_on_batch, x, y)
  measured = measure.peak_bytes(model.train_on_batch, x, y, calls=_CALLS)
  if jit_compile:
    assert 0.99 <= predicted / measured <= 1.01, (predicted, measured)
  elif not remat:
    assert 0.95 <= predicted / measured <= 1.10, (predicted, measured)
  else:
    # A rematerialized step's measured peak moves by up to 21% over its 10
    # calls here (which of the executor's threads reaches a rerun first);
    # the prediction simulates one timing of them: -6% of the largest when
    # idle, -16% beside other tests.
    assert 0.80 <= predicted / measured <= 1.10, (predicted, measured)


def test_a_softmax_heads_gradient_is_written_into_its_logits():
  # A 4096-word head over 2,048 tokens: 32 MiB of logits, which sparse
  # cross-entropy's kernel overwrites with their gradient. Counted apart,
  # the prediction was 1.87x the measured peak.
  keras.utils.set_random_seed(0)
  model = keras.Sequential([keras.Input((None,), dtype="int32"),
                            keras.layers.Embedding(4096, 64),
                            keras.layers.Dense(4096)])
  model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True), jit_compile=False)
  tokens = tf.random.stateless_uniform([16, 128], seed=[1, 2], maxval=4096,
                                       dtype=tf.int32)
  predicted = measure.predict_peak(model.train_on_batch, tokens, tokens)
  measured = measure.peak_bytes(model.train_on_batch, tokens, tokens,
                                calls=_CALLS)
  assert 0.95 <= predicted / measured <= 1.10, (predicted, measured)


def test_keras_auto_jit_compile_follows_what_keras_resolves():
  # "auto" is XLA on a machine with a GPU, the executor on a CPU alone.
  model = _mlp()
  model.compile(optimizer="adam", loss="mse", jit_compile="auto")
  x, y = _batch(256)
  auto = measure.predict_peak(model.train_on_batch, x, y)
  model.compile(optimizer="adam", loss="mse", jit_compile=model.jit_compile)
  assert auto == measure.predict_peak(model.train_on_batch, x, y)


def test_a_numpy_batch_counts_as_converted_during_the_call():
  model = _mlp()
  model.compile(optimizer="adam", loss="mse", jit_compile=True)
  x, y = _batch(256)
  on_device = measure.predict_peak(model.train_on_batch, x, y)
  as_arrays = measure.predict_peak(model.train_on_batch, x.numpy(), y.numpy())
  assert as_arrays - on_device == (256 * 256 + 256 * 16) * 4


def test_on_the_executor_a_chain_is_predicted_closely():
  # The prediction aims near the largest of the calls' peaks, which move up
  # with thread timing on a busy machine (in CI beside another process, the
  # largest of 10 was 7.7% above the prediction): it is held within the
  # calls' spread, widened by 5% below and 10% above.
  step = _step(_mlp(), jit_compile=False)
  x, y = _batch(512)
  predicted = measure.predict_peak(step, x, y)
  peaks = measure.peaks(step, x, y, calls=_CALLS)
  assert 0.95 * min(peaks) <= predicted <= 1.10 * max(peaks), (
      predicted, peaks)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["executor",
                                                             "xla"])
def test_a_shape_that_would_not_fit_is_predicted_without_allocating(
    jit_compile):
  # 2**22 rows of 256 floats: 4 GiB of input alone, predicted from specs.
  step = _step(_mlp(), jit_compile)
  spec = (tf.TensorSpec([2**22, 256]), tf.TensorSpec([2**22, 16]))
  small = measure.predict_peak(step, tf.TensorSpec([2**10, 256]),
                               tf.TensorSpec([2**10, 16]))
  huge = measure.predict_peak(step, *spec)
  assert huge > 2**12 * small * 0.9 > 4 * 2**30, (huge, small)


def test_nested_function_calls_are_read_through():
  width = 512

  @tf.function
  def inner(h, w):
    return tf.nn.gelu(h @ w)

  w = tf.Variable(tf.random.stateless_normal([width, width], seed=[1, 2]))

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      h = x
      for _ in range(4):
        h = inner(h, w)
      loss = tf.reduce_sum(h)
    w.assign_sub(0.01 * tape.gradient(loss, w))
    return loss

  x = tf.random.stateless_normal([1024, width], seed=[3, 4])
  predicted = measure.predict_peak(step, x)
  measured = measure.peak_bytes(step, x, calls=_CALLS)
  # Each call's forward function returns what its backward one reads: read
  # through, the calls hold 16 tensors of 2 MiB at once (unread, a few).
  assert predicted >= 16 * 2 * 2**20
  # Measured here: 18 of them (-11%): the runtime's inlined calls hold two
  # more than their bodies say (docs/design.md, "A peak read from the
  # program").
  assert 0.85 <= predicted / measured <= 1.10, (predicted, measured)


def test_predicting_runs_no_step():
  model = _mlp()
  model.compile(optimizer="adam", loss="mse")
  x, y = _batch(64)
  model.train_on_batch(x, y)
  before = [v.numpy() for v in model.variables]
  iterations = int(model.optimizer.iterations.numpy())
  measure.predict_peak(model.train_on_batch, x, y)
  measure.predict_peak(_step(model, True), x, y)
  assert int(model.optimizer.iterations.numpy()) == iterations
  for a, b in zip(before, model.variables):
    np.testing.assert_array_equal(a, b.numpy())


def test_an_eager_step_is_refused_naming_tf_function():
  with pytest.raises(errors.InvalidArgumentError, match="tf.function"):
    measure.predict_peak(lambda x: x * 2, tf.ones([4]))


def test_an_uncompiled_or_eager_keras_model_is_refused():
  model = _mlp()
  with pytest.raises((errors.InvalidArgumentError, RuntimeError),
                     match="compile"):
    measure.predict_peak(model.train_on_batch, *_batch(8))
  model.compile(optimizer="adam", loss="mse", run_eagerly=True)
  with pytest.raises(errors.InvalidArgumentError, match="run_eagerly"):
    measure.predict_peak(model.train_on_batch, *_batch(8))


def test_arguments_that_do_not_match_raise_what_the_step_raises():
  step = tf.function(lambda x: x * 2,
                     input_signature=[tf.TensorSpec([None, 4])])
  with pytest.raises(TypeError) as called:
    step(tf.ones([2, 5]))
  with pytest.raises(TypeError) as predicted:
    measure.predict_peak(step, tf.ones([2, 5]))
  assert str(predicted.value) == str(called.value)
  two = tf.function(lambda x, y: x * y)
  with pytest.raises(TypeError):
    measure.predict_peak(two, tf.ones([2]))


def test_a_step_xla_cannot_compile_raises_xlas_reason():
  step = tf.function(
      lambda x: tf.py_function(lambda a: a * 2, [x], tf.float32),
      jit_compile=True)
  with pytest.raises(tf.errors.InvalidArgumentError) as called:
    step(tf.ones([4]))
  with pytest.raises(tf.errors.InvalidArgumentError) as predicted:
    measure.predict_peak(step, tf.ones([4]))
  assert "EagerPyFunc" in str(called.value)
  assert "EagerPyFunc" in str(predicted.value)
