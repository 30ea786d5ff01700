"""A KerasHub causal LM under a memory budget, rematerialized in place: it
stays a GPT2CausalLM.

  pip install ".[hub]"
  python examples/keras_hub_lm.py --budget=60%

Builds a small `keras_hub.models.GPT2CausalLM` from a config (a tiny
character vocabulary; nothing is downloaded), rematerializes as few of its
transformer blocks as keep a training step within the budget
(`tfremat.remat_in_place_for_budget`, measured on `train_on_batch`), prints
the peak with and without, trains it with `fit` on generated text, and
generates from a prompt. The model object is never rebuilt: `fit` on
strings, `generate()`, `save` and its config work as they do without
rematerialization.
"""

import os

# TensorFlow prints its start-up lines (CPU features, CUDA drivers looked
# for) when it is imported; this example prints its own results only.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

# pylint: disable=g-import-not-at-top,wrong-import-position
import re
import string

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import tfremat
from tfremat import measure

FLAGS = flags.FLAGS


def define_flags():
  """Command-line flags, defined only when run as a program (tests import
  this file)."""
  flags.DEFINE_integer("layers", 4, "Transformer blocks.")
  flags.DEFINE_integer("hidden", 128, "Hidden width.")
  flags.DEFINE_integer("seq_len", 128, "Sequence length.")
  flags.DEFINE_integer("batch", 8, "Batch size.")
  flags.DEFINE_integer("epochs", 2, "Training epochs over the generated text.")
  flags.DEFINE_string("budget", "60%", "The training step's memory budget: "
                      "a fraction of its peak without remat (\"60%\", "
                      "\"0.6\"), or bytes (\"500MB\", \"500000000\").")


def small_gpt2(keras_hub, layers=2, hidden=64, seq_len=64, dropout=0.1):
  """A GPT2CausalLM with its preprocessor, from a config: byte-pair
  vocabulary of single letters and a space, random weights."""
  keras.utils.set_random_seed(0)
  # GPT2Tokenizer pads with id 0. The end token, which stops generate(),
  # must have another id: padding after a prompt would stop it at once.
  vocab = {"\u0120": 0, "<|endoftext|>": 1}  # A space on its own, first.
  for c in string.ascii_lowercase:
    vocab[c] = len(vocab)
    vocab["\u0120" + c] = len(vocab)  # GPT-2 marks a leading space so.
  vocab["th"] = len(vocab)
  # One merge: the tokenizer needs a non-empty merge list.
  tokenizer = keras_hub.models.GPT2Tokenizer(vocabulary=vocab,
                                             merges=["t h"])
  preprocessor = keras_hub.models.GPT2CausalLMPreprocessor(
      tokenizer=tokenizer, sequence_length=seq_len)
  backbone = keras_hub.models.GPT2Backbone(
      vocabulary_size=tokenizer.vocabulary_size(), num_layers=layers,
      num_heads=max(1, hidden // 32), hidden_dim=hidden,
      intermediate_dim=4 * hidden, max_sequence_length=seq_len,
      dropout=dropout)
  return keras_hub.models.GPT2CausalLM(backbone=backbone,
                                       preprocessor=preprocessor)


def text(n, seed=0):
  """n sentences of lowercase words, generated."""
  words = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
           "and", "then", "sleeps"]
  rng = np.random.default_rng(seed)
  return [" ".join(rng.choice(words, size=12)) for _ in range(n)]


def peak_train_bytes(lm, batch):
  """Peak bytes of one `train_on_batch` step on `batch` sentences (the task
  preprocesses them, as `fit` does)."""
  lm.make_train_function(force=True)  # Traced anew: remat on or off.
  return measure.peak_bytes(lm.train_on_batch, text(batch))


def main(argv):
  del argv
  import keras_hub  # pylint: disable=g-import-not-at-top
  lm = small_gpt2(keras_hub, FLAGS.layers, FLAGS.hidden, FLAGS.seq_len)
  lm.compile(optimizer=keras.optimizers.Adam(1e-3), sampler="greedy")
  budget = FLAGS.budget
  if re.fullmatch(r"\s*\d*\.\d+\s*", budget):
    budget = float(budget)  # "0.6": a fraction; "500000000": bytes.
  chosen = tfremat.remat_in_place_for_budget(
      lm, lm.backbone.transformer_layers, budget, text(FLAGS.batch))
  print(f"{type(lm).__name__}, {FLAGS.layers} blocks, hidden {FLAGS.hidden}, "
        f"sequence {FLAGS.seq_len}, batch {FLAGS.batch}, budget "
        f"{FLAGS.budget}: {chosen}")
  sentences = tf.data.Dataset.from_tensor_slices(text(32 * FLAGS.batch))
  # Shuffled by the dataset; fit's own shuffle does not apply to one.
  lm.fit(sentences.shuffle(32 * FLAGS.batch, seed=0).batch(FLAGS.batch),
         epochs=FLAGS.epochs, shuffle=False, verbose=2)
  print("generated:", lm.generate("the quick", max_length=32))


if __name__ == "__main__":
  define_flags()
  app.run(main)
