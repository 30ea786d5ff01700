"""A small transformer language model with every block rematerialized.

  python examples/keras_transformer.py

Builds a causal transformer LM from Keras layers (tfremat.models.transformer_lm)
with every block wrapped in tfremat.RematerializationLayer, and trains it with
`model.fit` on sequences it generates itself: each sequence counts up by a
random stride modulo the vocabulary, so the next token is predictable from the
previous two. Prints the loss as it goes down, then the training step's peak
memory with and without the wrapper.
"""

import os

# TensorFlow prints its start-up lines (CPU features, CUDA drivers looked
# for) when it is imported; this example prints its own results only.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import tfremat
from tfremat import models

FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags, defined only when run as a program (tests import
  this file)."""
  flags.DEFINE_integer("steps", 300, "Training steps.")
  flags.DEFINE_integer("batch", 32, "Sequences per batch.")
  flags.DEFINE_integer("seq_len", 64, "Tokens per sequence.")
  flags.DEFINE_integer("blocks", 4, "Transformer blocks.")
  flags.DEFINE_integer("width", 64, "Model width.")
  flags.DEFINE_integer("vocab", 64, "Vocabulary size.")


def sequences(count, seq_len, vocab, seed):
  """Arithmetic sequences modulo `vocab`: start + stride * position."""
  rng = np.random.RandomState(seed)
  start = rng.randint(vocab, size=(count, 1))
  stride = rng.randint(1, 8, size=(count, 1))
  return ((start + stride * np.arange(seq_len + 1)) % vocab).astype("int32")


def build(remat, seq_len, blocks, width, vocab):
  model = models.transformer_lm(vocab, seq_len, width, heads=4, blocks=blocks,
                                dropout=0.1, remat=remat)
  model.compile(optimizer=keras.optimizers.Adam(3e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def train(steps, batch, seq_len, blocks, width, vocab, log_every=0):
  """Trains the wrapped model; returns the loss after each epoch of 10 steps."""
  model = build(True, seq_len, blocks, width, vocab)
  data = sequences(steps * batch, seq_len, vocab, seed=0)
  epochs = max(1, steps // 10)
  history = model.fit(data[:, :-1], data[:, 1:], batch_size=batch,
                      epochs=epochs, steps_per_epoch=10, verbose=0,
                      callbacks=[keras.callbacks.LambdaCallback(
                          on_epoch_end=lambda e, logs: log_every and (
                              (e + 1) % log_every == 0) and print(
                                  f"step {10 * (e + 1):4d}: loss "
                                  f"{logs['loss']:.4f}"))])
  return history.history["loss"]


def peak_train_bytes(remat, batch, seq_len, blocks, width, vocab):
  """The peak of one `train_on_batch`: the largest total of the tensors it
  allocated and had not freed (`tfremat.measure.peak_bytes`)."""
  model = build(remat, seq_len, blocks, width, vocab)
  data = sequences(batch, seq_len, vocab, seed=1)
  x, y = tf.constant(data[:, :-1]), tf.constant(data[:, 1:])
  return tfremat.measure.peak_bytes(model.train_on_batch, x, y, calls=1)


def main(argv):
  del argv
  sizes = dict(batch=FLAGS.batch, seq_len=FLAGS.seq_len, blocks=FLAGS.blocks,
               width=FLAGS.width, vocab=FLAGS.vocab)
  losses = train(FLAGS.steps, log_every=max(1, FLAGS.steps // 100), **sizes)
  print(f"loss: {losses[0]:.4f} after 10 steps -> {losses[-1]:.4f} after "
        f"{10 * len(losses)} (uniform guessing: {np.log(FLAGS.vocab):.4f})")
  plain = peak_train_bytes(False, **sizes)
  wrapped = peak_train_bytes(True, **sizes)
  print(f"train step peak: {plain / 2**20:.1f} MiB plain, "
        f"{wrapped / 2**20:.1f} MiB with every block wrapped "
        f"({wrapped / plain:.2f}x)")


if __name__ == "__main__":
  define_flags()
  app.run(main)
