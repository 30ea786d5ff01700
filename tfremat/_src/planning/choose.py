"""The planner's choice, from predictions: each candidate's training step
is read from keeping everything's program where the runner can
(`Runner.simulated`), else from its own (`Runner.predicted`,
`tfremat.measure.predict_peak`), and held to the budget there; the one
chosen is predicted from its own program before it is taken, and then run,
a few steps, to check it (`checked`). The cost model
(`cost_model.fastest`) proposes; the prediction of the whole step decides.

One quantity covers what a prediction cannot see: on TensorFlow's executor,
whose threads order independent ops differently from call to call, a
candidate's predicted peak is held to the budget with `Settings.reserve`
added (`margin_of`); under XLA, whose buffer assignment is the step's
peak, with none."""

import dataclasses
import math

from tfremat import errors
from tfremat._src import units
from tfremat._src.keras_api.segments import keep_all
from tfremat._src.planning import cost_model
from tfremat._src.planning import proposals
from tfremat._src.planning import search
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.plan import Measured
from tfremat._src.planning.plan import Plan
from tfremat._src.planning.search import Candidate
from tfremat._src.planning.search import Search
from tfremat._src.planning.search import Trial

__all__ = [
    "margin_of",
    "predicted_measured",
    "choose_plan",
]


def margin_of(runner, settings):
  """What a predicted peak is held to the budget with, as a fraction of
  it: `settings.reserve` on the executor, nothing under XLA."""
  return 0.0 if runner.jit else settings.reserve


def predicted_measured(peak, margin):
  """A `Measured` standing for a prediction: its bound is the peak plus
  the margin, over no calls."""
  extra = int(math.ceil(margin * peak))
  return Measured(int(peak), int(peak) + extra, 0, extra)


# How far a peak read from keeping everything's program may lie above the
# candidate's own program's prediction (`predicting_reruns`: from -4.4% to
# +8.4% on four model families' plans, +16% on a small LM recomputing every
# block; tests/read_plans_test.py): a candidate read within this
# over the room is predicted from its own program before it is passed over.
_READ_ERROR = 0.2


class _Trials:
  """The candidates predicted for `budget` so far, each once, keeping
  everything's first (`begin`), and the record of them (`record`)."""

  def __init__(self, budget, runner, batch, settings):
    self.budget, self.runner, self.batch = budget, runner, batch
    self.settings = settings
    self.held = runner.held(batch)
    self.margin = margin_of(runner, settings)
    self.costs, self.room, self.keep, self.keep_peak = None, None, None, None
    self.trials, self.peaks = [], {}
    self.exact = set()  # Segments predicted from their own step.

  def begin(self, segments, stage, why, floor_bytes=0):
    """Predicts keeping everything (`segments`), sets the room the budget
    leaves the step (a fraction is of that prediction), and refuses a
    budget below what every plan holds (`search.floor_error`) where
    keeping everything does not fit."""
    self.keep = tuple(segments)
    self.keep_peak = self.add(self.keep, stage, why)
    self.room = (int(self.budget.fraction * self.keep_peak)
                 if self.budget.fraction is not None else
                 self.budget.num_bytes - self.held.total_bytes)
    if not self.keeps():
      error = search.floor_error(
          self.budget, self.budget_bytes, self.held,
          predicted_measured(self.keep_peak, self.margin), floor_bytes,
          self.margin)
      if error is not None:
        error.search = self.record()
        raise error

  @property
  def budget_bytes(self):
    return self.held.total_bytes + self.room

  def keeps(self):
    """Whether keeping everything is chosen: it fits, or the budget is
    all of it."""
    return self.fits(self.keep) or self.budget.fraction == 1.0

  def model(self, segments):
    return predict(self.costs, list(segments))[0]

  def seconds(self, segments):
    return predict(self.costs, list(segments))[1]

  def fits(self, segments):
    bound = predicted_measured(self.peaks[segments], self.margin)
    return bound.bound_bytes <= self.room

  def add(self, segments, stage, why, ordered=False):
    """Predicts `segments`: read from keeping everything's program where
    the runner can (`Runner.simulated`), else from its own."""
    segments = tuple(segments)
    if segments not in self.peaks:
      candidate = Candidate(segments, ordered)
      peak = self.runner.simulated(candidate, self.batch)
      if peak is None:
        peak = self.runner.predicted(candidate, self.batch)
        self.exact.add(segments)
      self.peaks[segments] = peak
      self.trials.append(Trial(
          candidate, stage, why, predicted_measured(peak, self.margin),
          False, peak))
    return self.peaks[segments]

  def fits_read(self, segments):
    """Whether `segments` fits as read from keeping everything's program,
    or, read within `_READ_ERROR` over the room, as its own program
    predicts (`confirm`)."""
    if self.fits(segments):
      return True
    bound = predicted_measured(self.peaks[segments], self.margin).bound_bytes
    return (segments not in self.exact and
            bound <= self.room * (1 + _READ_ERROR) and self.confirm(segments))

  def confirm(self, segments):
    """Whether `segments`, predicted from its own step's program, fits:
    a plan is chosen, or refused, on that prediction."""
    if segments not in self.exact:
      self.exact.add(segments)
      at = next(i for i, t in enumerate(self.trials)
                if t.candidate.segments == segments)
      trial = self.trials[at]
      peak = self.runner.predicted(trial.candidate, self.batch)
      self.peaks[segments] = peak
      self.trials[at] = dataclasses.replace(
          trial, measured=predicted_measured(peak, self.margin),
          predicted_bytes=peak)
    return self.fits(segments)

  def overhead(self, segments):
    """What the predicted step holds beyond the cost model's chain."""
    return self.peaks[segments] - self.model(segments)

  def marked(self):
    """The trials so far, each marked whether it fits."""
    return tuple(dataclasses.replace(t, fits=self.fits(t.candidate.segments))
                 for t in self.trials)

  def record(self, chosen=None):
    """The `Search` of the trials so far."""
    return Search(self.budget, self.budget_bytes, self.held,
                  self.runner.step, self.settings, self.marked(), chosen)

  def refused(self, record, **words):
    """The `BudgetUnreachableError` giving the lowest predicted peak, with
    `record` as its `search`."""
    error = unreachable_error(self.budget, self.budget_bytes, self.held,
                              self.keep_peak, min(self.peaks.values()),
                              self.margin, **words)
    error.search = record
    return error


def choose_plan(costs, budget, runner, batch, settings, floor_bytes=0,
                nestable=None):
  """The fastest plan for `budget` among those the cost model proposes,
  each held to the budget by its predicted peak.

  Keeping everything is predicted first: a fraction is of its peak, and it
  is chosen where it fits. Then, up to `settings.rounds` times, the cost
  model's fastest plan within the room the budget leaves the chain (the
  step's room less the margin, less what the last prediction held beyond
  the cost model) is predicted; the fastest that fits is chosen. Where
  none does, the lowest plan is predicted, and chosen if it fits; else,
  where units have layers of their own (`nestable`, per unit), that plan
  with them nested inside their reruns and the chain run in one op order
  (unordered, a nested plan's peak moved with thread timing from call to
  call), chosen if it fits.

  `costs` is the chain's LayerCosts, or a pair (a function of none that
  returns them, the chain's length): called once keeping everything is
  predicted, so that a budget below `floor_bytes` (the weight gradients
  every plan's step holds) plus the margin is refused before any unit is
  read.

  Returns:
    The `Plan` (its `measured` unset: `checked` runs it).

  Raises:
    tfremat.errors.BudgetUnreachableError: not even the lowest plan is
      predicted to fit.
  """
  found = _Trials(Budget.parse(budget), runner, batch, settings)
  costs_of, n = costs if isinstance(costs, tuple) else (lambda: costs,
                                                          len(costs))
  found.begin(keep_all(n), "keep", "keeping everything", floor_bytes)
  costs = found.costs = list(costs_of())
  best, ordered, last = None, False, found.keep
  while not found.keeps() and (best is None or not found.confirm(best)):
    # Read from keeping everything's program, a plan is chosen once its
    # own program confirms it; else the search goes on from it.
    last = best or last
    best, ordered = _proposed(found, costs, settings, nestable, last)
    if best is None:
      break
  if found.keeps():
    best = found.keep
  record = found.record()
  record = dataclasses.replace(record, chosen=next(
      (t for t in record.trials if t.candidate.segments == best), None))
  if best is None:
    raise found.refused(record, terms=cost_model.floor_terms(costs))
  return Plan(costs, best, found.budget_bytes, found.budget, ordered,
              held=found.held, step=runner.step,
              overhead_bytes=found.overhead(best), margin=found.margin,
              predicted_keep=found.keep_peak, search=record)


def _proposed(found, costs, settings, nestable, last):
  """(segments, ordered) of the fastest plan the cost model proposes that
  `found` predicts to fit (`choose_plan`'s rounds from `last`, the last
  plan predicted, then the lowest plan, then it nested and ordered), or
  (None, False). A proposal read over the room by less than `_READ_ERROR`
  is predicted from its own program only where none read within it uses
  `settings.use_at_least` of the room: each such prediction is a trace."""
  best, margin, near = None, found.margin, []
  for _ in range(settings.rounds):
    target = found.room / (1 + margin) - found.overhead(last)
    segments = cost_model.fastest(costs, target)
    if segments is None or tuple(segments) in found.peaks:
      break
    last = tuple(segments)
    found.add(last, "model", "the cost model's fastest within the room")
    if not found.fits(last):
      near.append(last)
    elif best is None or found.seconds(last) < found.seconds(best):
      best = last
    if best is not None and found.peaks[best] * (1 + margin) >= (
        settings.use_at_least * found.room):
      return best, False
  for segments in sorted(near, key=found.seconds):
    if best is not None and found.seconds(segments) >= found.seconds(best):
      break
    if found.fits_read(segments):
      return segments, False
  if best is not None:
    return best, False
  lowest = tuple(proposals.lowest_plan(costs).segments)
  found.add(lowest, "lowest", "the lowest plan")
  if found.fits(lowest) or found.confirm(lowest):
    return lowest, False
  nested = cost_model.nested_segments(list(lowest), nestable)
  if nested:
    nested = tuple(nested)
    found.add(nested, "lowest", "the lowest plan, nested, ordered", True)
    if found.fits(nested):
      return nested, True
  return None, False


def unreachable_error(budget, budget_bytes, held, keep_peak, lowest, margin,
                      subject="No rematerialization plan fits", terms=(),
                      fix="shrink the batch or the widest layer"):
  """The ValueError for a budget below `lowest`, the lowest predicted peak,
  with the margin it is held to; `terms`, (what, bytes) pairs every plan
  holds by the cost model (`cost_model.floor_terms`), for the message."""
  mib = units.format_bytes
  bound = int(math.ceil(lowest * (1 + margin)))
  asked = (f"{budget.fraction:.0%} of the keep-everything peak, "
           if budget.fraction is not None else "")
  least = bound / max(1, keep_peak)
  need = (f"at least {math.ceil(100 * least)}%" if asked else
          f"at least {mib(held.total_bytes + bound)}")
  how = (f" plus the executor's margin, {margin:.0%} "
         "(tfremat.planner.Settings.reserve)" if margin else "")
  what = "; ".join(f"{w}: {mib(n)}" for w, n in terms)
  what = f" What every plan holds, by the cost model: {what}." if what else ""
  return errors.BudgetUnreachableError.of(
      f"{subject} a budget of {asked}{mib(budget_bytes)}: the lowest "
      f"predicted peak of a training step is {mib(lowest)}{how}, "
      f"{least:.0%} of keeping everything's ({mib(keep_peak)}); training "
      f"holds {held} besides the step.{what} Raise the budget to {need}, or "
      f"{fix}.", bound, keep_peak)


def choose_among(budget, runner, batch, propose, rank, settings,
                 refusal=None):
  """The first by `rank` of the candidates `propose` makes that is
  predicted to fit `budget`, each held to it by its predicted step with
  the margin, as `choose_plan` holds plans; for proposers other than the
  cost model (`remat_in_place_for_budget`'s first k layers).

  `propose(trials, room)` returns the next `(Candidate, stage, why)` from
  the trials so far (the first: keeping everything, whose predicted peak a
  fraction is of), or None.

  Returns:
    The `Search`, its `chosen` set.

  Raises:
    tfremat.errors.BudgetUnreachableError, with `refusal`'s words
    (`unreachable_error`'s `subject` and `fix`), whose `search` is the
    record.
  """
  found = _Trials(Budget.parse(budget), runner, batch, settings)
  keep, stage, why = propose((), None)
  found.begin(keep.segments, stage, why)
  candidates = {keep.segments: keep}
  while not found.keeps():
    proposal = propose(found.marked(), found.room)
    if proposal is None:
      break
    candidate, stage, why = proposal
    candidates[candidate.segments] = candidate
    found.add(candidate.segments, stage, why)
  trials = found.marked()
  fitting = sorted((t for t in trials if t.fits or (
      found.budget.fraction == 1.0 and t is trials[0])),
                   key=lambda t: rank(candidates[t.candidate.segments]))
  if not fitting:
    raise found.refused(found.record(), **(refusal or {}))
  chosen = dataclasses.replace(
      fitting[0], candidate=candidates[fitting[0].candidate.segments])
  return found.record(chosen)
