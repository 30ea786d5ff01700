"""tfremat.largest_batch: the batch it returns fits the memory on the
training step a user traces for that batch, and the way it returns is the
fastest of those that fit there."""

import keras
import pytest
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat._src.planning import batch_fit


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
  assert found.measured.bound_bytes <= found.memory_bytes, found
  step = chain.training_step(found.model)
  peaks = measure.peaks(step, batch_fit.resized(sample, found.batch),
                        calls=3)
  assert min(peaks) <= found.measured.peak_bytes * 1.01, (found, peaks)

class _Step:
  """A stand-in for a way's training step: its peak at a batch, and how
  long a call takes."""

  def __init__(self, bound_line, seconds):
    self.bound_line, self.seconds = bound_line, seconds

  def peak(self, batch):
    # Peaks whose bound (peak plus the 5% reserve) is bound_line(batch).
    return int(self.bound_line(batch) / 1.05)


class _Ways:
  """Stands in for largest_batch's ways of training: every layer
  rematerialized ("full"), the planner's plan nested ("nested"), and
  keeping everything ("none"), with the peaks and speeds given."""

  def __init__(self, steps):
    self.steps = steps
    self.names = list(steps)
    self.plans = {"nested": None}

  def add_planned(self, sample_input):
    del sample_input

  def step(self, way):
    return self.steps[way]

  def peaks(self, way, x, calls):
    return [self.steps[way].peak(int(x.shape[0]))] * calls

  def warm(self, way, x):
    del way, x

  def method(self, way):
    return "planner" if way in self.plans else way

  def result(self, way, batch, memory_bytes, measured):
    del batch, memory_bytes, measured
    return way


def _found(monkeypatch, nested):
  """largest_batch at 1000 bytes, in multiples of 2, with stand-in ways:
  keeping everything (bound 20 per example), every layer rematerialized
  (5.25 per example, so 190 fits and 192 does not; 1 s a step) and the
  nested plan `nested` (a _Step)."""
  steps = {"none": _Step(lambda b: 20 * b, 0.5),
           "full": _Step(lambda b: 5.25 * b, 1.0), "nested": nested}
  monkeypatch.setattr(batch_fit, "_Ways", lambda *args: _Ways(steps))
  monkeypatch.setattr(batch_fit.measure, "median_seconds",
                      lambda fns, x, repeats, warmup: [f.seconds for f in fns])
  return tfremat.largest_batch([], 1000, tf.zeros([8, 1]), multiple=2,
                               verbose=0)


def test_the_batch_is_the_largest_multiple_that_fits(monkeypatch):
  # Every layer rematerialized fits 190 (a bound of 997.5 of 1000), not
  # 192: the search ends there, not within a few percent of it.
  found = _found(monkeypatch, _Step(lambda b: 6 * b, 1.5))
  assert (found.batch, found.method) == (190, "full"), (
      found, [(t.way, t.batch, t.fits) for t in found.trials])


def test_the_ways_that_fit_the_batch_are_timed_against_each_other(
    monkeypatch):
  # Both fit 190 and neither 192: the faster per example is returned,
  # whichever search ended there first.
  found = _found(monkeypatch, _Step(lambda b: 5.25 * b - 0.5, 1.5))
  assert (found.batch, found.method, found.model) == (190, "full", "full"), (
      found, [(t.way, t.batch, t.fits) for t in found.trials])
  assert found.examples_per_second == 190 / 1.0


def test_a_slower_way_is_probed_once_above_the_batch_and_not_checked(
    monkeypatch):
  # "nested" peaks a little above "full" and is slower: after full's search
  # ends at 190, nested is probed at 192 alone (over), timed at 190 and,
  # full being faster and fitting, never measured there.
  found = _found(monkeypatch, _Step(lambda b: 5.3 * b - 7, 1.5))
  assert (found.batch, found.method) == (190, "full")
  nested = [(t.batch, t.fits) for t in found.trials if t.way == "nested"]
  assert nested == [(8, True), (16, True), (192, False)], (
      [(t.way, t.batch, t.fits) for t in found.trials])
