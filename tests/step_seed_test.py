"""Lingvo-style step seeds and DeterministicDropout."""

import threading

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat


@pytest.fixture(autouse=True)
def _fresh_seed():
  tfremat.ResetStepSeed()
  tfremat.SetGlobalStep(None)
  yield
  tfremat.SetGlobalStep(None)


def test_step_seed_counts_from_reset_value():
  tfremat.ResetStepSeed(5)
  assert tfremat.GetIncStepSeed().numpy() == 5
  assert tfremat.GetIncStepSeed().numpy() == 6
  assert tfremat.GetStepSeed().numpy() == 7
  assert tfremat.GetStepSeed().dtype == tf.int64


def test_seed_pairs_differ_on_each_call_and_add_seeds():
  first = tfremat.GenerateStepSeedPair().numpy()
  second = tfremat.GenerateStepSeedPair(random_seed=10, op_seed=3).numpy()
  np.testing.assert_array_equal(first, [0, 0])
  np.testing.assert_array_equal(second, [13, 14])
  assert tfremat.GenerateStepSeedPair().shape == (2,)


def test_global_step_is_the_first_element():
  step = tf.Variable(41, dtype=tf.int64)
  tfremat.SetGlobalStep(step)
  np.testing.assert_array_equal(tfremat.GenerateStepSeedPair().numpy(), [41, 0])
  step.assign_add(1)
  np.testing.assert_array_equal(tfremat.GenerateStepSeedPair().numpy(), [42, 1])
  with pytest.raises(TypeError, match="optimizer.iterations"):
    tfremat.SetGlobalStep(3)


@pytest.mark.parametrize("bad", [
    lambda: tf.Variable([1, 2], dtype=tf.int64),
    lambda: tf.Variable(1.0),
    lambda: tf.Variable([[3]], dtype=tf.int64),
], ids=["vector", "float", "matrix"])
def test_set_global_step_refuses_what_is_not_a_scalar_integer(bad):
  # A non-scalar step used to fail later, in GenerateStepSeedPair's Pack.
  step = tf.Variable(7, dtype=tf.int64)
  tfremat.SetGlobalStep(step)
  with pytest.raises(TypeError, match="one integer"):
    tfremat.SetGlobalStep(bad())
  # Refused before any state changed: the step set before still counts.
  np.testing.assert_array_equal(tfremat.GenerateStepSeedPair().numpy()[0], 7)


def test_set_global_step_takes_a_keras_optimizer_iterations():
  optimizer = keras.optimizers.SGD()
  optimizer.build([keras.Variable(1.0)])
  tfremat.SetGlobalStep(optimizer.iterations)
  np.testing.assert_array_equal(tfremat.GenerateStepSeedPair().numpy(), [0, 0])


def test_global_step_is_seen_from_other_threads():
  # tf.distribute replicas run in threads of their own.
  step = tf.Variable(7, dtype=tf.int64)
  tfremat.SetGlobalStep(step)
  seen = []
  thread = threading.Thread(
      target=lambda: seen.append(int(tfremat.GetGlobalStep())))
  thread.start()
  thread.join()
  assert seen == [7]


def test_each_traced_function_starts_from_its_own_seed():
  tfremat.SetGlobalStep(tf.Variable(0, dtype=tf.int64))

  @tf.function
  def pairs():
    return tfremat.GenerateStepSeedPair(), tfremat.GenerateStepSeedPair()

  a, b = pairs()
  np.testing.assert_array_equal(a.numpy(), [0, 0])
  np.testing.assert_array_equal(b.numpy(), [0, 1])
  # The eager counter was not touched by the trace.
  assert tfremat.GetStepSeed().numpy() == 0


def test_deterministic_dropout_same_seeds_same_mask():
  x = tf.ones([64, 64])
  seeds = tf.constant([3, 4], tf.int64)
  a = tfremat.DeterministicDropout(x, 0.75, seeds)
  b = tfremat.DeterministicDropout(x, 0.75, seeds)
  c = tfremat.DeterministicDropout(x, 0.75, seeds + 1)
  np.testing.assert_array_equal(a.numpy(), b.numpy())
  assert not np.array_equal(a.numpy(), c.numpy())
  kept = a.numpy() != 0
  assert abs(kept.mean() - 0.75) < 0.03
  np.testing.assert_allclose(a.numpy()[kept], 1 / 0.75, rtol=1e-6)


def test_deterministic_dropout_noise_shape_and_bfloat16():
  x = tf.ones([8, 16], tf.bfloat16)
  y = tfremat.DeterministicDropout(x, 0.5, tf.constant([1, 2]),
                                   noise_shape=[1, 16])
  assert y.dtype == tf.bfloat16
  rows = y.numpy().astype(np.float32)
  np.testing.assert_array_equal(rows, np.broadcast_to(rows[:1], rows.shape))
  assert tfremat.DeterministicDropout(x, 1.0, [1, 2]) is x


@pytest.mark.parametrize("keep_prob", [0.75, tf.constant(0.75)],
                         ids=["float", "tensor"])
@pytest.mark.parametrize("mode", ["eager", "function"])
def test_deterministic_dropout_draws_lingvos_mask(keep_prob, mode):
  # Issue "Keras and Lingvo users' first hour" [8]: Lingvo keeps an element
  # where floor(keep_prob + u) == 1, u = stateless_uniform(shape, seeds),
  # i.e. where u >= 1 - keep_prob; a scalar tensor keep_prob is accepted.
  x = tf.reshape(tf.range(1.0, 4097.0), [64, 64])
  seeds = tf.constant([3, 4], tf.int64)
  dropout = lambda a, kp: tfremat.DeterministicDropout(a, kp, seeds)
  if mode == "function":
    dropout = tf.function(dropout)
  y = dropout(x, keep_prob).numpy()
  u = tf.random.stateless_uniform([64, 64], seed=seeds).numpy()
  keep = u >= 1 - 0.75
  np.testing.assert_allclose(y[keep], x.numpy()[keep] / 0.75, rtol=1e-6)
  assert not y[~keep].any()


@pytest.mark.parametrize("dtype", [tf.int32, tf.bool])
def test_deterministic_dropout_refuses_a_non_floating_input(dtype):
  # As tf.nn.dropout does, naming the dtype, not a failing Mul.
  with pytest.raises(ValueError, match="floating point.*tf.cast"):
    tfremat.DeterministicDropout(tf.ones([4], dtype), 0.5, [1, 2])


@pytest.mark.parametrize("keep_prob", [0.0, 1.5, -0.1, "0.5"])
def test_deterministic_dropout_rejects_bad_keep_prob(keep_prob):
  with pytest.raises(ValueError, match="probability to KEEP"):
    tfremat.DeterministicDropout(tf.ones([2]), keep_prob, [1, 2])


def test_seeds_in_a_function_without_a_global_step_are_an_error():
  # Issue "Keras and Lingvo users' first hour" [9]: the step seed restarts at
  # every call of a traced function, so a constant global step drew the same
  # dropout mask at every training step, silently.
  x = tf.ones([64])

  @tf.function
  def dropped(x):
    return tfremat.DeterministicDropout(x, 0.5, tfremat.GenerateStepSeedPair())

  with pytest.raises(RuntimeError, match=r"SetGlobalStep\(optimizer.iterations\)"):
    dropped(x)
  # Eager code keeps one step seed that never restarts: no global step needed.
  first = tfremat.DeterministicDropout(x, 0.5, tfremat.GenerateStepSeedPair())
  second = tfremat.DeterministicDropout(x, 0.5, tfremat.GenerateStepSeedPair())
  assert not np.array_equal(first.numpy(), second.numpy())
  # With a global step, each call of the same trace draws a new mask.
  step = tf.Variable(0, dtype=tf.int64)
  tfremat.SetGlobalStep(step)
  masks = []
  for _ in range(3):
    masks.append(dropped(x).numpy())
    step.assign_add(1)
  assert not np.array_equal(masks[0], masks[1])
  assert not np.array_equal(masks[1], masks[2])
