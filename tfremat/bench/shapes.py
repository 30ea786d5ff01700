"""A plan at shapes it was not measured at (`--shapes`): a transformer LM
compiled with Adam is planned for a memory budget on a sample of one
sequence length, then trained (`train_on_batch`, traced for each shape) at
other sequence lengths and batches, where its chain runs the plan the cost
model chooses for that shape (`tfremat.planner.Plan.segments_at`). Each
row sets the prediction (peak, and step time scaled by the sample's
measured one) beside the measurement."""

import dataclasses
import time

import keras
import tensorflow as tf

import tfremat
from tfremat import measure
from tfremat import models
from tfremat._src.planning.runner import Batch
from tfremat._src.planning.runner import fit_step

__all__ = [
    "ShapeRow",
    "SIZES",
    "lm",
    "measure_shapes",
]

# The LM: six blocks, an 8000-word head; planned on a batch of 16 of
# sequence 64, then measured at these (batch, sequence) shapes, the sample's
# first (the last batch of 11: a partial last batch).
SIZES = dict(blocks=6, vocab=8000, width=128, heads=4, batch=16, seq_len=64)
SHAPES = ((16, 64), (16, 32), (16, 96), (16, 128), (8, 64), (11, 128),
          (32, 64))


@dataclasses.dataclass(frozen=True)
class ShapeRow:
  """One shape: the plan chosen there, what was predicted and measured.

  Attributes:
    batch, seq_len: the shape trained on.
    rematerialized: how many of the chain's units the plan there reruns.
    held_bytes: what training holds besides the step there.
    predicted_bytes, measured_bytes: the step's peak, by the plan's cost
      model at that shape (`Plan.predicted_peak_at`) and measured (the
      largest of the calls).
    predicted_seconds, measured_seconds: the step's time, by the cost model
      scaled by the sample's measured time, and measured (the median).
    budget_bytes: the budget.
  """
  batch: int
  seq_len: int
  rematerialized: int
  held_bytes: int
  predicted_bytes: int
  measured_bytes: int
  predicted_seconds: float
  measured_seconds: float
  budget_bytes: int

  @property
  def peak_error(self):
    return self.predicted_bytes / max(1, self.measured_bytes) - 1

  @property
  def time_error(self):
    return self.predicted_seconds / max(1e-12, self.measured_seconds) - 1


def lm(sizes=SIZES):
  """The LM, taking token ids of any length, compiled with Adam and sparse
  cross-entropy on its logits."""
  model = models.flat_lm(sizes["blocks"], sizes["vocab"], None,
                         sizes["width"], sizes["heads"])
  model.compile(optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def _batch(batch, seq_len, vocab):
  tokens = tf.random.stateless_uniform([batch, seq_len + 1], seed=[1, 2],
                                       maxval=vocab, dtype=tf.int32)
  return Batch(tokens[:, :-1], tokens[:, 1:])


def measure_shapes(memory_bytes, shapes=SHAPES, sizes=SIZES, rounds=5,
                   log=print):
  """`ShapeRow`s: the LM planned within `memory_bytes` on its sample (the
  first of `shapes`), then, at each shape, the plan chosen there predicted
  and measured."""
  model = lm(sizes)
  sample = _batch(sizes["batch"], sizes["seq_len"], sizes["vocab"])
  start = time.perf_counter()
  planned = tfremat.remat_model(model, budget=memory_bytes,
                                sample_input=sample.x,
                                sample_target=sample.y, verbose=0)
  planned_chain = next(l for l in planned.layers
                       if isinstance(l, tfremat.RematSequential))
  plan = planned_chain.plan
  log(f"planned in {time.perf_counter() - start:.0f} s:\n{plan}")
  found, seconds = [], []
  for batch, seq_len in shapes:
    x = _batch(batch, seq_len, sizes["vocab"])
    # Traced for this shape (a train function of its own: timed here, one
    # shape after another, as alternating shapes would retrace it).
    step = lambda x=x: fit_step(planned, x)
    measure.wait_for(step())
    peak = measure.peak_bytes(step, warmup=False)
    seconds += measure.median_seconds([step], repeats=rounds, warmup=False)
    shape = (batch, seq_len, sizes["width"])
    segments = plan.segments_at(shape)
    held = plan.held.with_batch(plan.shapes.size_ratio(shape)).total_bytes
    found.append((batch, seq_len, segments, held, peak))
    log(f"batch {batch}, sequence {seq_len}: measured "
        f"{measure.format_bytes(peak)}, {1000 * seconds[-1]:.0f} ms")
  # Times: the cost model's at each shape, scaled by the sample's measured.
  scale = seconds[0] / plan.seconds_at(shapes[0] + (sizes["width"],))
  rows = []
  for (batch, seq_len, segments, held, peak), measured in zip(found, seconds):
    shape = (batch, seq_len, sizes["width"])
    rows.append(ShapeRow(
        batch, seq_len, sum(s.stop - s.start for s in segments if s.remat),
        held, plan.predicted_peak_at(shape, segments), peak,
        scale * plan.seconds_at(shape, segments), measured,
        plan.budget_bytes))
  return rows

