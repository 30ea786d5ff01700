"""A model of wrapped blocks trains in a fraction of the unwrapped memory."""

import keras
import tensorflow as tf

import tfremat
from tfremat import measure
from tfremat import models

_BLOCKS, _WIDTH, _BATCH = 8, 128, 4096


def _functional_model(wrap):
  inputs = keras.Input((_WIDTH,))
  h = inputs
  for block in models.residual_mlp(_BLOCKS, _WIDTH, dropout=0.1):
    h = h + (tfremat.RematerializationLayer(block) if wrap else block)(h)
  return keras.Model(inputs, keras.layers.Dense(1)(h))


def _train_step(model):
  optimizer = keras.optimizers.SGD(0.01)

  @tf.function
  def step(x, y):
    with tf.GradientTape() as tape:
      loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
    optimizer.apply(tape.gradient(loss, model.trainable_weights),
                    model.trainable_weights)
    return loss

  return step


def test_eight_wrapped_blocks_train_at_most_04x_of_unwrapped_peak():
  x = tf.random.stateless_normal([_BATCH, _WIDTH], seed=[1, 2])
  y = tf.random.stateless_normal([_BATCH, 1], seed=[1, 3])
  peaks = {}
  for wrap in (False, True):
    step = _train_step(_functional_model(wrap))
    peaks[wrap] = measure.peak_bytes(step, x, y, calls=1)
  assert peaks[False] > 150 * 2**20, peaks  # Activations dominate.
  assert peaks[True] <= 0.4 * peaks[False], (peaks[True] / peaks[False], peaks)
