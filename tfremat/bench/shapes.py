"""Budgets at the shapes training runs at (`--shapes`).

`fit_rows`: a transformer LM over token sequences of any length, compiled
with Adam, planned within a byte budget on a sample of one length, then
trained with `fit` over a dataset whose batches differ in length and size
(tf.data's `padded_batch`, a partial last batch): every step's measured
peak (`tfremat.measure.fit_peaks`) beside the plan's prediction for that
step's shape and the budget. Keras traces its step for the first batch's
shape, then once for any shape: the plan chooses by the shape each step
runs at.

`family_rows`: how well a plan predicts its step's peak at shapes it was
not measured at, over four families (a residual MLP, that transformer LM,
a KerasHub GPT2Backbone trained to a mean squared error on its sequence
output, a keras.applications MobileNetV2 over images of any size), each
planned at 60% of keeping everything on its sample, then run at three
other shapes (a larger batch, a longer sequence or larger
image, a smaller one) in both programs a step runs in: traced for that
shape (as `fit`'s first step) and traced for any shape (every later one).
The prediction is of the larger.
"""

import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

import tfremat
from tfremat import measure
from tfremat import models
from tfremat._src.planning import budget as budget_lib

__all__ = [
    "FitRow",
    "FamilyRow",
    "lm",
    "fit_rows",
    "family_rows",
    "FAMILIES",
]

# The LM: six blocks, an 8000-word head; planned on a batch of 16 of
# sequence 64.
SIZES = dict(blocks=6, vocab=8000, width=128, heads=4, batch=16, seq_len=64)
# `fit_rows`' batches: (rows, longest length) each, padded to the longest;
# the last is partial.
FIT_BATCHES = ((16, 24), (16, 64), (16, 128), (16, 40), (16, 96), (16, 32),
               (16, 112), (11, 80))


@dataclasses.dataclass(frozen=True)
class FitRow:
  """One step of `fit`: its batch's shape, what the plan chose there and
  predicted, what was held and measured, and the budget."""
  batch: int
  seq_len: int
  rematerialized: int
  held_bytes: int
  predicted_bytes: int
  measured_bytes: int
  budget_bytes: int

  @property
  def peak_error(self):
    return self.predicted_bytes / max(1, self.measured_bytes) - 1


@dataclasses.dataclass(frozen=True)
class FamilyRow:
  """One (model, shape): the plan chosen there, its predicted peak, and
  the peaks measured in a step traced for the shape and for any shape."""
  model: str
  shape: tuple
  rematerialized: int
  predicted_bytes: int
  static_bytes: int
  relaxed_bytes: int

  @property
  def measured_bytes(self):
    return max(self.static_bytes, self.relaxed_bytes)

  @property
  def peak_error(self):
    return self.predicted_bytes / max(1, self.measured_bytes) - 1


def lm(sizes=SIZES):
  """The LM, taking token ids of any length, compiled with Adam and sparse
  cross-entropy on its logits."""
  model = models.flat_lm(sizes["blocks"], sizes["vocab"], None,
                         sizes["width"], sizes["heads"])
  model.compile(optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def _tokens(batch, seq_len, vocab):
  tokens = tf.random.stateless_uniform([batch, seq_len + 1], seed=[1, 2],
                                       maxval=vocab, dtype=tf.int32)
  return tokens[:, :-1], tokens[:, 1:]


def _planned_chain(model):
  return next(l for l in model.layers
              if isinstance(l, tfremat.RematSequential))


def _remat(segments):
  return sum(s.stop - s.start for s in segments if s.remat)


def fit_rows(memory_bytes, sizes=SIZES, batches=FIT_BATCHES, log=print):
  """`FitRow`s: the LM planned within `memory_bytes` on its sample, then
  trained with `fit` for one epoch over `batches`, each step measured."""
  model = lm(sizes)
  x, y = _tokens(sizes["batch"], sizes["seq_len"], sizes["vocab"])
  start = time.perf_counter()
  planned = tfremat.remat_model(model, budget=memory_bytes, sample_input=x,
                                sample_target=y, verbose=0)
  plan = _planned_chain(planned).plan
  log(f"planned in {time.perf_counter() - start:.0f} s:\n{plan}")
  lengths = [max(1, n - i % 7) for rows, n in batches for i in range(rows)]
  vocab = sizes["vocab"]
  rows = tf.data.Dataset.from_generator(
      lambda: ((np.arange(n) * 7 % vocab, (np.arange(n) * 7 + 1) % vocab)
               for n in lengths),
      output_signature=(tf.TensorSpec([None], tf.int32),) * 2)
  data = rows.padded_batch(batches[0][0])
  planned.fit(data, epochs=1, verbose=0)  # Traces its steps.
  peaks = measure.fit_peaks(planned, data, epochs=1, verbose=0)
  found = []
  held = plan.held.weights_bytes + plan.held.optimizer_bytes
  for (batch, seq_len), peak in zip(batches, peaks):
    shape = (batch, seq_len, sizes["width"])
    segments = plan.segments_at(shape)
    found.append(FitRow(
        batch, seq_len, _remat(segments), held + 2 * batch * seq_len * 4,
        plan.predicted_peak_at(shape, segments), peak.requested_bytes,
        plan.budget_bytes))
  return found


def _mlp():
  keras.utils.set_random_seed(0)
  h = inputs = keras.Input((256,))
  for _ in range(8):
    y = keras.layers.Dense(1024, activation="gelu")(h)
    h = keras.layers.Add()([h, keras.layers.Dense(256)(y)])
  return keras.Model(inputs, keras.layers.Dense(10)(h))


def _images(batch, size):
  return (tf.random.stateless_normal([batch, size, size, 3], seed=[1, 2]),
          tf.zeros([batch], tf.int32))


def _family(name):
  """(model, compile arguments, batch of a shape, sample shape, shapes)."""
  sparse = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
  if name == "residual MLP":
    return (_mlp(), sparse,
            lambda b: (tf.random.stateless_normal([b, 256], seed=[1, 2]),
                       tf.zeros([b], tf.int32)),
            (512,), [(1024,), (768,), (256,)])
  if name == "transformer LM":
    return (models.flat_lm(SIZES["blocks"], SIZES["vocab"], None,
                           SIZES["width"], SIZES["heads"]), sparse,
            lambda b, s: _tokens(b, s, SIZES["vocab"]), (16, 64),
            [(32, 64), (16, 128), (8, 48)])
  if name == "GPT2Backbone":
    model = models.hub_backbone("GPT2Backbone")
    hidden = models.HUB_SIZES["hidden_dim"]

    def batch_of(b, s):
      tokens = tf.random.stateless_uniform(
          [b, s], seed=[1, 2], maxval=models.HUB_SIZES["vocabulary_size"],
          dtype=tf.int32)
      return ({"token_ids": tokens, "padding_mask": tf.ones_like(tokens)},
              tf.zeros([b, s, hidden]))
    return model, "mse", batch_of, (8, 64), [(16, 64), (8, 128), (4, 96)]
  if name == "MobileNetV2":
    keras.utils.set_random_seed(0)
    base = keras.applications.MobileNetV2(  # Its head needs a size.
        weights=None, input_shape=(None, None, 3), include_top=False,
        pooling="avg")
    model = keras.Model(base.input, keras.layers.Dense(10)(base.output))
    return (model, sparse, _images, (8, 64),
            [(16, 64), (8, 96), (4, 80)])
  raise ValueError(name)


FAMILIES = ("residual MLP", "transformer LM", "GPT2Backbone", "MobileNetV2")


def family_rows(families=FAMILIES, log=print):
  """`FamilyRow`s: each family planned at 60% on its sample, then measured
  at its sample and three other shapes."""
  found = []
  for name in families:
    model, loss, batch_of, sample, shapes = _family(name)
    model.compile(optimizer="adam", loss=loss)
    x, y = batch_of(*sample)
    start = time.perf_counter()
    planned = tfremat.remat_model(model, budget="60%", sample_input=x,
                                  sample_target=y, verbose=0)
    plan = _planned_chain(planned).plan
    log(f"{name}: planned in {time.perf_counter() - start:.0f} s, "
        f"{len(plan.variants)} variants")
    static = tf.function(lambda x, y: planned.train_step((x, y, None)))
    planned.train_on_batch(*batch_of(*shapes[-1]))  # Relaxed from here.
    for shape in [sample] + list(shapes):
      x, y = batch_of(*shape)
      chain_shape = _chain_shape(plan, sample, shape)
      segments = plan.segments_at(chain_shape)
      with budget_lib.retracing_quiet():
        static_peak = measure.peak_bytes(static, x, y, calls=3)
      relaxed_peak = measure.peak_bytes(planned.train_on_batch, x, y, calls=3)
      found.append(FamilyRow(name, shape, _remat(segments),
                             plan.predicted_peak_at(chain_shape, segments),
                             static_peak, relaxed_peak))
      row = found[-1]
      log(f"  {shape}: predicted {measure.format_bytes(row.predicted_bytes)}"
          f", measured {measure.format_bytes(row.measured_bytes)}")
  return found


def _chain_shape(plan, sample, shape):
  """The planned chain's input shape for a batch of `shape` (batch, then
  sequence or image size), from its shape on the `sample`'s: each axis in
  proportion, an image's height and width both by its size."""
  axes = [[0], [1, 2] if len(plan.shape) == 4 else [1]]
  sizes = list(plan.shape)
  for each, d, s in zip(axes, shape, sample):
    for i in each:
      sizes[i] = round(plan.shape[i] * d / s)
  return tuple(sizes)
