"""tfremat.largest_batch: the batch it returns fits the memory on the
training step a user traces for that batch, and the way it returns is the
fastest of those that fit there."""

import keras
import pytest
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat._src.api import largest_batch as largest_batch_lib
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning.runner import Batch


def _residual_mlp(blocks=4, width=64, hidden=256):
  keras.utils.set_random_seed(0)
  x = inputs = keras.Input((width,))
  for _ in range(blocks):
    x = x + keras.layers.Dense(width)(
        keras.layers.Dense(hidden, activation="gelu")(x))
  return keras.Model(inputs, keras.layers.Dense(10)(x))


def test_the_batch_found_fits_on_a_step_traced_for_that_batch():
  # A step traced for any batch size can peak lower than one traced for
  # one batch (a tf.function called on tensors of one shape, as Keras's fit
  # traces when the data divides into batches): largest_batch's bound is
  # the latter's. Its peaks move up from call to call on a busy machine,
  # never below the least of them: that one is compared.
  sample = tf.random.normal([64, 64])
  found = tfremat.largest_batch(_residual_mlp(), "16MiB", sample,
                                verbose=0)
  assert found.batch > 0, found
  assert (found.measured.bound_bytes + found.held.total_bytes <=
          found.memory_bytes), found
  step = chain.training_step(found.model)
  peaks = measure.peaks(step, Batch(sample).resized(found.batch).x,
                        calls=3)
  assert min(peaks) <= found.measured.peak_bytes * 1.01, (found, peaks)

class _Lines:
  """Stands in for largest_batch's runner: each way's step peaks on a line
  in the batch and takes a given time, with nothing held besides it.
  Ways: keeping everything (bound 20 per example), every layer
  rematerialized (5.25 per example, so 190 fits 1000 bytes and 192 does
  not; 1 s a step), and every layer nested (`nested`: (bound per batch, s))."""

  step = "stand-in"

  def __init__(self, nested, per_example=1.0):
    self.lines = {"none": (lambda b: 20 * per_example * b, 0.5),
                  "full": (lambda b: 5.25 * per_example * b, 1.0),
                  "nested": nested}

  @staticmethod
  def way(candidate):
    if not any(s.remat for s in candidate.segments):
      return "none"
    return "nested" if any(s.nested for s in candidate.segments) else "full"

  def held(self, batch):
    del batch
    return tfremat.planner.Held()

  def peaks(self, candidate, batch, calls):
    # Peaks whose bound (peak plus the 5% reserve) is on the way's line.
    line, _ = self.lines[self.way(candidate)]
    return [int(line(batch.size) / 1.05)] * calls

  def seconds(self, candidates, batch, rounds):
    del batch, rounds
    return [self.lines[self.way(c)][1] for c in candidates]


def _found(nested, per_example=1.0):
  """largest_batch's search at 1000 bytes, in multiples of 2, from a batch
  of 8, on two stand-in layers with the ways of `_Lines`."""
  units = (keras.layers.Identity(), keras.layers.Identity())
  cost = tfremat.planner.LayerCost(
      "unit", forward_seconds=1.0, backward_seconds=2.0, input_bytes=8,
      output_bytes=8, saved_bytes=8, forward_transient_bytes=0,
      backward_transient_bytes=0, weight_grad_bytes=0)
  ways = largest_batch_lib.Ways(
      units, budget_lib.Chain(units), _Lines(nested, per_example),
      costs=(cost, cost),
      nestable=(True, True))
  finder = largest_batch_lib.BatchSearch(
      ways, Batch(tf.zeros([8, 1])), 1000, tfremat.planner.DEFAULT_SETTINGS,
      verbose=0)
  return finder.run(2, 3, ())


def _trials(found):
  return [(t.way, t.batch, t.fits) for t in found.trials]


def test_the_batch_is_the_largest_multiple_that_fits():
  # Every layer rematerialized fits 190 (a bound of 997.5 of 1000), not
  # 192: the search ends there, not within a few percent of it.
  found = _found((lambda b: 6 * b, 1.5))
  assert (found.batch, found.method) == (190, "full"), _trials(found)


def test_the_ways_that_fit_the_batch_are_timed_against_each_other():
  # Both fit 190 and neither 192: the faster per example is returned,
  # whichever search ended there first.
  found = _found((lambda b: 5.25 * b - 0.5, 1.5))
  assert (found.batch, found.method) == (190, "full"), _trials(found)
  assert found.examples_per_second == 190 / 1.0


def test_a_slower_way_is_probed_once_above_the_batch_and_not_checked():
  # "nested" peaks a little above "full" and is slower: after full's search
  # ends at 190, nested is probed at 192 alone (over), timed at 190 and,
  # full being faster and fitting, never measured there.
  found = _found((lambda b: 5.3 * b - 7, 1.5))
  assert (found.batch, found.method) == (190, "full")
  nested = [(t.batch, t.fits) for t in found.trials if t.way == "nested"]
  assert nested == [(8, True), (192, False)], _trials(found)


def test_nothing_fitting_is_its_own_state():
  # Not even a batch of 2 (the multiple) fits, with no rematerialization
  # or any: no method, no model, and the printout names the multiple.
  found = _found((lambda b: 600 * b, 1.5), per_example=200)
  assert (found.batch, found.method, found.model, found.fits) == (
      0, None, None, False), _trials(found)
  assert str(found).startswith("no batch of 2 or more fits"), str(found)
