"""A transformer LM described entirely by Lingvo-style builder Params.

  python examples/lingvo_style_transformer.py

`LmTask.Params()` is the whole experiment: the model (a builder subclass,
every block wrapped in `_Rematerialize`) and the training settings. The script
prints its text form, builds the Keras model with `Instantiate()`, and trains
it with `model.fit` on sequences it generates itself (each counts up by a
random stride modulo the vocabulary), printing the loss.
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

from tfremat.lingvo import builder
from tfremat.lingvo import hyperparams

FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags, defined only when run as a program."""
  flags.DEFINE_integer("steps", 300, "Training steps.")


def AddPositions(x):
  """Adds sinusoidal position encodings to (batch, time, dims) inputs."""
  time, dims = tf.shape(x)[1], x.shape[-1]
  positions = tf.cast(tf.range(time), x.dtype)[:, None]
  rates = tf.pow(10000.0, -tf.cast(tf.range(dims // 2), x.dtype) * 2 / dims)
  angles = positions * rates[None]
  return x + tf.concat([tf.sin(angles), tf.cos(angles)], axis=-1)[None]


class TransformerLmBuilder(builder.Base):
  """Builds a causal transformer language model's layer stack."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("vocab", 64, "Vocabulary size.")
    p.Define("dims", 64, "Model width.")
    p.Define("heads", 4, "Attention heads.")
    p.Define("blocks", 4, "Transformer blocks.")
    p.Define("keep_prob", 0.9, "Dropout keep probability.")
    p.Define("remat", True, "Rematerialize every block.")
    return p

  def _Block(self, name):
    p = self.params
    block = self._Seq(
        name,
        self._Residual(
            "attention", self._LN("ln", p.dims),
            self._MultiHeadAttention("mha", p.dims, p.heads, p.keep_prob),
            self._Dropout("drop", p.keep_prob)),
        self._Residual(
            "feedforward", self._LN("ln", p.dims),
            self._Linear("up", p.dims, 4 * p.dims),
            self._Bias("up_bias", 4 * p.dims), self._Fn("gelu", tf.nn.gelu),
            self._Linear("down", 4 * p.dims, p.dims),
            self._Bias("down_bias", p.dims),
            self._Dropout("drop", p.keep_prob)))
    return self._Rematerialize(f"{name}_remat", block) if p.remat else block

  def Lm(self):
    """Token ids (batch, time) -> logits (batch, time, vocab)."""
    p = self.params
    return self._Seq(
        "lm", self._Embedding("embedding", p.vocab, p.dims),
        self._Fn("positions", AddPositions),
        *[self._Block(f"block{i}") for i in range(p.blocks)],
        self._LN("final_ln", p.dims), self._Linear("softmax", p.dims, p.vocab),
        self._Bias("softmax_bias", p.vocab))


class LmTask:
  """A Lingvo Task-like experiment: model params plus training params."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define("builder", TransformerLmBuilder.Params(), "The model.")
    p.Define("seq_len", 64, "Tokens per training sequence.")
    p.Define("batch_size", 32, "Sequences per batch.")
    p.Define("learning_rate", 3e-3, "Adam learning rate.")
    return p

  def __init__(self, params):
    self.params = params.Copy()
    lm = params.builder.Instantiate().Lm().Instantiate()
    tokens = keras.Input((params.seq_len,), dtype="int32")
    self.model = keras.Model(tokens, lm(tokens))
    self.model.compile(
        optimizer=keras.optimizers.Adam(params.learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

  def Data(self, count, seed):
    """Arithmetic sequences modulo the vocabulary; inputs and next tokens."""
    p = self.params
    rng = np.random.RandomState(seed)
    start = rng.randint(p.builder.vocab, size=(count, 1))
    stride = rng.randint(1, 8, size=(count, 1))
    seqs = (start + stride * np.arange(p.seq_len + 1)) % p.builder.vocab
    return seqs[:, :-1].astype("int32"), seqs[:, 1:].astype("int32")

  def Train(self, steps, log=print):
    """Trains for `steps` steps; returns the loss after every 10."""
    x, y = self.Data(steps * self.params.batch_size, seed=0)
    history = self.model.fit(
        x, y, batch_size=self.params.batch_size, epochs=max(1, steps // 10),
        steps_per_epoch=10, verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(
            on_epoch_end=lambda e, logs: log(
                f"step {10 * (e + 1):4d}: loss {logs['loss']:.4f}"))])
    return history.history["loss"]


def main(argv):
  del argv
  p = LmTask.Params().Set(name="lm_task")
  p.builder.Set(deterministic_dropout=True, random_seed=1)
  print(p.ToText())
  task = p.Instantiate()
  losses = task.Train(FLAGS.steps)
  print(f"loss: {losses[0]:.4f} after 10 steps -> {losses[-1]:.4f} after "
        f"{10 * len(losses)} (uniform guessing: "
        f"{np.log(p.builder.vocab):.4f})")


if __name__ == "__main__":
  define_flags()
  app.run(main)
