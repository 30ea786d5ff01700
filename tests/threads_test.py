"""Rematerialized training steps in several Python threads at once.

A serving process fine-tuning per request, a hyperparameter search in
threads or `MirroredStrategy` in eager mode step models concurrently. Each
thread's steps must give what the same steps give run one after another:
the forward pass's op record, the tapes set aside and the step seeds are
the thread's own. Each thread steps its own model (Dense, Dropout,
BatchNormalization, Dense), a barrier starting every step together so that
the threads' forward passes and reruns overlap.
"""

import threading

import keras
import pytest
import tensorflow as tf

import tfremat
from conftest import assert_one_scale_parity, compile_step, parity_loss
from conftest import to_numpy

STEPS = 4


def _models(n):
  """`n` models, the same ones at every call."""
  models = []
  for i in range(n):
    keras.utils.set_random_seed(20 + i)
    model = keras.Sequential([
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dropout(0.2, seed=30 + i),
        keras.layers.BatchNormalization(),
        keras.layers.Dense(16)])
    model.build((None, 32))
    models.append(model)
  return models


def _block(model, nested):
  """The model's call, rematerialized (with `nested`, its first two layers
  rematerialized again inside)."""
  dense, dropout, norm, out = model.layers
  if not nested:
    return lambda h: tfremat.RematerializeFn(
        lambda g: model(g, training=True), h)
  first = lambda g: dropout(dense(g), training=True)
  return lambda h: tfremat.RematerializeFn(
      lambda g: out(norm(tfremat.RematerializeFn(first, g), training=True)),
      h)


def _stepper(model, nested, mode):
  block = _block(model, nested)

  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      loss = parity_loss(block(x))
    grads = tape.gradient(loss, [x] + model.trainable_weights)
    for v, g in zip(model.trainable_weights, grads[1:]):
      v.assign_sub(0.01 * g)
    return loss, grads

  return compile_step(step, mode)


def _train(model, nested, mode, barrier=None):
  """The model's losses and gradients over STEPS steps, and its variables
  after them."""
  step = _stepper(model, nested, mode)
  x = tf.random.stateless_normal([128, 32], seed=[model.layers[1].seed, 3])
  results = []
  for _ in range(STEPS):
    if barrier is not None:
      barrier.wait()
    results.append(to_numpy(step(x)))
  return results, to_numpy(model.variables)


@pytest.mark.parametrize("mode", ["eager", "function", "xla"])
@pytest.mark.parametrize("nested", [False, True], ids=["flat", "nested"])
@pytest.mark.parametrize("threads", [2, 4])
def test_threads_give_what_the_same_steps_give_one_after_another(
    threads, nested, mode):
  expected = [_train(m, nested, mode) for m in _models(threads)]

  models = _models(threads)
  barrier = threading.Barrier(threads)
  actual, failures = [None] * threads, []

  def run(i):
    try:
      actual[i] = _train(models[i], nested, mode, barrier)
    except Exception as e:  # pylint: disable=broad-except
      failures.append(f"thread {i}: {type(e).__name__}: {e}")
      barrier.abort()

  workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
  for worker in workers:
    worker.start()
  for worker in workers:
    worker.join()
  assert not failures, "\n".join(failures)
  for i in range(threads):
    assert_one_scale_parity(actual[i], expected[i])
