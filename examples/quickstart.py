"""Train a residual MLP in a hand-written `tf.function` step that calls
`tfremat.RematerializeFn` around each block.

  python examples/quickstart.py

Fits y = sin(x @ A) on data it generates itself, once without and once with
rematerialization, from the same weights and dropout seeds: `--steps` steps
each, every loss recorded, then one more step whose peak memory is
measured. Prints the loss curve and the peak for both.
"""

import os

# TensorFlow prints its start-up lines (CPU features, CUDA drivers looked
# for) when it is imported; this example prints its own results only.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import keras
import tensorflow as tf

import tfremat
from tfremat import models

FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags, defined only when run as a program (tests import
  this file)."""
  flags.DEFINE_integer("steps", 200, "Training steps.")
  flags.DEFINE_integer("blocks", 8, "Residual blocks.")
  flags.DEFINE_integer("width", 128, "Residual width.")
  flags.DEFINE_integer("batch", 1024, "Batch size.")


def train(remat, steps, blocks, width, batch):
  """Returns (the loss of each of `steps` steps, the peak bytes of one
  more) of training the residual MLP."""
  layers = models.residual_mlp(blocks, width, dropout=0.1)
  head = keras.layers.Dense(1)
  head.build((None, width))
  variables = [v for b in layers for v in b.trainable_weights]
  variables += head.trainable_weights
  optimizer = keras.optimizers.Adam(1e-3)
  target = tf.random.stateless_normal([width, 1], seed=[3, 4])

  def block_fn(block):
    fn = lambda h: block(h, training=True)
    return (lambda h: tfremat.RematerializeFn(fn, h)) if remat else fn

  calls = [block_fn(b) for b in layers]

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      h = x
      for call in calls:
        h = h + call(h)
      loss = tf.reduce_mean((head(h) - tf.sin(x @ target)) ** 2)
    optimizer.apply(tape.gradient(loss, variables), variables)
    return loss

  def batch_at(i):
    return tf.random.stateless_normal([batch, width], seed=[i, 0]) / 4

  losses = [float(step(batch_at(i))) for i in range(steps)]
  # One more step, traced already, whose peak is measured.
  peak = tfremat.measure.peak_bytes(step, batch_at(steps), calls=1,
                                    warmup=False)
  return losses, peak


def main(argv):
  del argv
  for remat in (False, True):
    losses, peak = train(remat, FLAGS.steps, FLAGS.blocks, FLAGS.width,
                         FLAGS.batch)
    name = "tfremat" if remat else "no remat"
    curve = ", ".join(f"{losses[i]:.4f}" for i in
                      range(0, len(losses), max(1, len(losses) // 5)))
    print(f"{name:>9}: step peak {peak / 2**20:7.1f} MiB; "
          f"loss {curve}, ..., {losses[-1]:.4f}")


if __name__ == "__main__":
  define_flags()
  app.run(main)
