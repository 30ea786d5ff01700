"""The budget search, as data: candidates proposed from what was measured so
far, each checked by one rule, the fastest that fits chosen, and a record
of all of it.

Every budget goes through `search_budget` (`remat_sequential`,
`remat_model`, `remat_in_place_for_budget`, the builder): it is handed a
runner (what runs a candidate's training step, `runner.Runner`), a batch,
and a proposer: a function of the trials so far that returns the next
candidate to measure, or None. Nothing is sent back into a generator and no
callback measures: the trials are the state, and each step is a value
handed to the next. `largest_batch` checks its batches by the same rule
(`check`).

A candidate's bound (`Measured`) is the largest peak of its calls plus their
spread plus the reserve, `Settings.reserve` of its own peak. A budget in
bytes counts what training holds besides the step (`Held`: weights,
optimizer state, batch) and the bound; a fraction is of keeping
everything's measured peak, beyond what is held.
"""

import dataclasses
import math

from tfremat import errors
from tfremat._src import units
from tfremat._src.keras_api.segments import keep_all
from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning import cost_model
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.plan import Held
from tfremat._src.planning.plan import Measured
from tfremat._src.planning.plan import Plan
from tfremat._src.planning.proposals import Candidate
from tfremat._src.planning.proposals import next_plan

__all__ = [
    "Settings",
    "DEFAULT_SETTINGS",
    "Candidate",
    "Trial",
    "Search",
    "check",
    "checked_peaks",
    "search_budget",
    "choose_plan",
    "predicted_peak",
    "unreachable_budget_error",
]


@dataclasses.dataclass(frozen=True)
class Settings:
  """How the planner searches, as one value; `print` shows every setting.

  The shipped defaults are `DEFAULT_SETTINGS`; give another value to
  `remat_sequential`, `remat_model`, `remat_in_place_for_budget` or
  `largest_batch` (`settings=tfremat.planner.Settings(reserve=0.1)`).

  Attributes:
    reserve: what every candidate's bound adds, as a fraction of its own
      measured peak: the same plan's peak in a new process, with one
      executor thread or beside a busy process, rose up to 1.7% above the
      largest of its calls and their spread (docs/design.md, "Budgets that
      hold").
    check_calls: how many training steps a candidate that fits is measured
      over: their largest peak and their spread make its bound.
    first_calls: every check measures this many steps first, and the rest
      of `check_calls` only where their bound fits (one rule for the
      planner and `largest_batch`).
    rounds: how many plans the cost model proposes at most, besides keeping
      everything, every layer alone and, before a refusal, the lowest plan
      and that plan nested.
    aim_below: each plan is aimed this fraction below the room the budget
      leaves (the budget less the reserve): the cost model's error moves by
      a few percent, and a plan aimed at the room itself misses whenever it
      is positive, each miss costing a check of the whole chain.
    faster_by: a plan is measured only if the cost model predicts it this
      fraction of keeping everything's step time faster than the fastest
      already measured within the budget.
    use_at_least: where the fastest plan that fits peaks below this
      fraction of what the budget leaves the step, the next faster plan the
      cost model predicts is measured too (it fits, or the record shows
      that the memory left unused is what that plan needs more).
    waiting_fraction: what a layer's recompute costs beyond its forward time
      when later layers of its segment rerun before its backward pass, as a
      fraction of that forward time (`LayerCost.waiting_recompute_seconds`).
    try_ordered: before a budget is refused, the lowest plan is measured
      with the chain's ops run in one order too, which peaks lower on some
      chains and costs step time, and that plan nested is measured (and
      `largest_batch`'s nested way run) only so ordered.
    batch_probes: `largest_batch` probes at most this many batches per way
      of training after the first it predicts.
    near_batch: `largest_batch` times every way whose largest batch came
      within this fraction of the best one's, and keeping everything where
      its line reaches that far.
    variants: how many plans a planned chain chooses between by the input
      shape it runs at, the planned one among them (`Plan.variants`):
      each is traced where a step is traced for any shape.
  """
  reserve: float = 0.05
  check_calls: int = 10
  first_calls: int = 3
  rounds: int = 4
  aim_below: float = 0.03
  faster_by: float = 0.03
  use_at_least: float = 0.8
  waiting_fraction: float = 0.2
  try_ordered: bool = True
  batch_probes: int = 6
  near_batch: float = 0.04
  variants: int = 3

  def __post_init__(self):
    fractions = ("reserve", "aim_below", "faster_by", "use_at_least",
                 "waiting_fraction", "near_batch")
    counts = ("check_calls", "first_calls", "rounds", "batch_probes",
              "variants")
    bad = [f"{name}={getattr(self, name)!r}" for name in fractions
           if isinstance(getattr(self, name), bool) or
           not isinstance(getattr(self, name), (int, float)) or
           not 0 <= getattr(self, name) < 1]
    bad += [f"{name}={getattr(self, name)!r}" for name in counts
            if isinstance(getattr(self, name), bool) or
            not isinstance(getattr(self, name), int) or
            getattr(self, name) < 1]
    if not isinstance(self.try_ordered, bool):
      bad.append(f"try_ordered={self.try_ordered!r}")
    if bad:
      raise errors.InvalidArgumentError(
          f"Settings: {', '.join(bad)}: {', '.join(fractions)} are "
          f"fractions in [0, 1), {', '.join(counts)} positive ints, "
          "try_ordered True or False.")

  def reserve_bytes(self, peak_bytes):
    """The reserve of a candidate that peaked at `peak_bytes`."""
    return int(self.reserve * peak_bytes)

  def room(self, budget_bytes):
    """The largest peak whose bound, before its calls' spread, is within
    `budget_bytes`."""
    return int(budget_bytes / (1 + self.reserve))

  def __str__(self):
    return (f"reserve {self.reserve:.0%} of a plan's peak, "
            f"{self.check_calls} calls per check ({self.first_calls} first), "
            f"{self.rounds} rounds, aim {self.aim_below:.0%} below the room, "
            f"a plan measured only if {self.faster_by:.0%} faster, the next "
            f"faster measured below {self.use_at_least:.0%} of the room, "
            f"waiting {self.waiting_fraction:.0%} of a rerun's forward time, "
            f"{'ordered plans tried' if self.try_ordered else 'unordered only'}"
            f" before a refusal; largest_batch: {self.batch_probes} probes a "
            f"way, ways within {self.near_batch:.0%} timed; {self.variants} "
            "plans at most by input shape")


DEFAULT_SETTINGS = Settings()


@dataclasses.dataclass(frozen=True)
class Trial:
  """One candidate measured: at which stage of the search and why, how it
  measured, whether it fits (its bound within what the budget leaves the
  step, its peak not above keeping everything's, which would never be worth
  its time), and the peak the cost model predicted for it (calibrated on
  keeping everything's measurement), where there is one."""
  candidate: Candidate
  stage: str
  why: str
  measured: Measured
  fits: bool
  predicted_bytes: int = None

  @property
  def key(self):
    """The candidate (the name earlier versions gave it)."""
    return self.candidate


@dataclasses.dataclass(frozen=True)
class Search:
  """What a budget search measured, in order, and what it chose.

  Attributes:
    budget: the `Budget` asked for; budget_bytes: the same in bytes, for
      everything training holds (`held`, then the step's tensors).
    held: what training holds besides the step (`Held`).
    step: which training step was measured ("train_on_batch" or
      "stand-in", `Runner.step`).
    settings: the `Settings` it searched with.
    trials: every `Trial`, in the order measured; the first is keeping
      everything.
    chosen: the Trial chosen (the fastest that fits), or None when the
      budget was refused.
  """
  budget: Budget
  budget_bytes: int
  held: Held
  step: str
  settings: Settings
  trials: tuple
  chosen: Trial = None

  @property
  def keep(self):
    """Keeping everything's Trial."""
    return self.trials[0]

  @property
  def step_bytes(self):
    """What the budget leaves the step's own tensors."""
    return self.budget_bytes - self.held.total_bytes

  def __str__(self):
    mib = units.format_bytes
    rows = [f"budget {mib(self.budget_bytes)} ({self.budget}): held "
            f"{self.held}; the step's bound within {mib(self.step_bytes)}",
            f"on {self.step}; {self.settings}"]
    for i, t in enumerate(self.trials):
      mark = "chosen" if t is self.chosen else ("fits" if t.fits else "over")
      how = "predicted" if not t.measured.calls else "peak"
      rows.append(f"{i + 1:>3}. {mark:<7}{how} "
                  f"{mib(t.measured.peak_bytes):>11}  bound "
                  f"{mib(t.measured.bound_bytes):>11}  {t.why}")
    if self.chosen is None:
      rows.append("     refused: no candidate fits")
    return "\n".join(rows)


def checked_peaks(runner, candidate, batch, limit_bytes, settings, done=(),
                  probe=False):
  """The one rule a candidate is held to, by the planner and by
  `largest_batch`: `settings.first_calls` training steps of `candidate` on
  `batch`, then, where their bound is within `limit_bytes` (or there is no
  limit), up to `settings.check_calls` (not with `probe`: a search's probe
  stops at the first calls). Those in a step traced for the batch's
  shapes, the rest in every program that runs it (each call's larger of
  that and one traced for any shape: `Runner.programs`). `done`: peaks
  already measured there, which count. Returns every peak."""
  calls = settings.check_calls
  peaks = list(done)
  first = min(settings.first_calls, calls)
  if len(peaks) < first:
    peaks += runner.peaks(candidate, batch, first - len(peaks))
  if probe or len(peaks) >= calls:
    return peaks
  if limit_bytes is None or Measured.of(
      peaks, settings.reserve).bound_bytes <= limit_bytes:
    peaks += runner.peaks(candidate, batch, calls - len(peaks),
                          every_program=True)
  return peaks


def check(runner, candidate, batch, limit_bytes, settings):
  """`candidate`'s `Measured` by the one rule (`checked_peaks`)."""
  return Measured.of(checked_peaks(runner, candidate, batch, limit_bytes,
                                   settings), settings.reserve)


def search_budget(budget, runner, batch, propose, rank, *,
                  settings=DEFAULT_SETTINGS, floor_bytes=0, refusal=None,
                  predict=None):
  """Measures candidates for `budget` and chooses the fastest that fits.

  1. What training holds besides the step (`runner.held(batch)`) is
     counted; keeping everything (`Candidate(keep_all(n))`, the first
     proposal) is measured over `settings.first_calls` steps (and the rest
     of `check_calls` where it fits). A fractional budget is a fraction of
     its largest peak; a byte budget leaves the step what is not held.
  2. A budget that leaves the step less than `floor_bytes` (the weight
     gradients every plan's step ends holding) plus their reserve is
     refused at once: no candidate can meet it.
  3. Keeping everything is chosen if its bound fits, or if the budget is
     100% of it.
  4. `propose(trials, step_bytes)` returns the next `(Candidate, stage,
     why)` from the trials so far, or None; each is probed over
     `settings.first_calls` steps.
  5. The first by `rank` (the fastest) of those that fit is checked over
     the rest of `settings.check_calls` (`checked_peaks`), and chosen if it
     still fits; else the next. If none fits, the budget is refused
     (`unreachable_budget_error`, with `refusal`'s words).

  `predict(candidate, keep)`, where given, is the peak a candidate is
  predicted to measure, given keeping everything's `Measured`: each trial
  records it beside its measurement.

  Returns:
    The `Search`, its `chosen` set.

  Raises:
    tfremat.errors.BudgetUnreachableError (a ValueError), whose `search`
    is the `Search` so far.
  """
  budget = Budget.parse(budget)
  held = runner.held(batch)
  keep, stage, why = propose((), None)
  peaks = {keep: checked_peaks(runner, keep, batch, None, settings,
                               probe=True)}
  kept = Measured.of(peaks[keep], settings.reserve)
  step_bytes = (budget.bytes_given(kept.peak_bytes) if budget.fraction
                else budget.num_bytes - held.total_bytes)
  if kept.bound_bytes <= step_bytes:  # Checked over every call, below.
    peaks[keep] = checked_peaks(runner, keep, batch, step_bytes, settings,
                                done=peaks[keep])
    kept = Measured.of(peaks[keep], settings.reserve)
  trials = [Trial(keep, stage, why, kept, kept.bound_bytes <= step_bytes or
                  budget.fraction == 1.0)]
  budget_bytes = held.total_bytes + step_bytes

  def record(chosen=None):
    return Search(budget, budget_bytes, held, runner.step, settings,
                  tuple(trials), chosen)

  error = floor_error(budget, budget_bytes, held, kept, floor_bytes,
                      settings.reserve)
  if error is not None:
    error.search = record()
    raise error
  if trials[0].fits:
    return record(trials[0])
  while True:
    proposal = propose(tuple(trials), step_bytes)
    if proposal is None:
      # The fastest that fits by its first calls is checked over the rest of
      # `check_calls` (one rule: `checked_peaks`). Where it is then over,
      # the proposer is asked again, knowing it.
      checked = _check_fastest(runner, batch, trials, peaks, rank, kept,
                               step_bytes, settings)
      if checked is None or checked.fits:
        break
      continue
    candidate, stage, why = proposal
    if candidate in peaks or candidate == keep:
      raise errors.UnsupportedError(
          f"The budget search proposed {candidate} twice ({why}).")
    peaks[candidate] = checked_peaks(runner, candidate, batch, step_bytes,
                                     settings, probe=True)
    trials.append(_trial(candidate, stage, why, peaks[candidate], kept,
                         step_bytes, settings,
                         predict(candidate, kept) if predict else None))
  if checked is not None:
    return record(checked)
  lowest = min(trials, key=lambda t: t.measured.bound_bytes).measured
  words = dict(refusal or {})
  error = unreachable_budget_error(budget, budget_bytes, held, kept.peak_bytes,
                                   lowest, settings=settings, **words)
  error.search = record()
  raise error


def _check_fastest(runner, batch, trials, peaks, rank, kept, step_bytes,
                   settings):
  """The fastest of `trials` that fits by its first calls, checked over
  the rest of `check_calls` and put in its place in `trials`; None where
  none fits."""
  fitting = sorted((t for t in trials[1:] if t.fits),
                   key=lambda t: rank(t.candidate))
  if not fitting:
    return None
  best = fitting[0]
  done = checked_peaks(runner, best.candidate, batch, step_bytes, settings,
                       done=peaks[best.candidate])
  checked = _trial(best.candidate, best.stage, best.why, done, kept,
                   step_bytes, settings, best.predicted_bytes)
  trials[trials.index(best)] = checked
  return checked


def _trial(candidate, stage, why, peaks, kept, step_bytes, settings,
           predicted):
  """The `Trial` of `candidate` measured at `peaks`: it fits when its bound
  is within `step_bytes` and its peak not above keeping everything's."""
  measured = Measured.of(peaks, settings.reserve)
  return Trial(candidate, stage, why, measured,
               measured.bound_bytes <= step_bytes and
               measured.peak_bytes <= kept.peak_bytes, predicted)


def choose_plan(costs, budget, runner, batch=None, *,
                settings=DEFAULT_SETTINGS, nestable=None, floor_bytes=0,
                num_layers=None):
  """The planner's plan for a chain within `budget`: `search_budget` over
  `next_plan`'s candidates, each measured by `runner` on `batch`.

  Args:
    costs: the chain's LayerCosts, or a function of none returning them,
      called once keeping everything has been measured (so a budget out of
      reach is refused before the chain is profiled).
    budget: a `Budget`, or what `Budget.parse` reads.
    runner: runs a candidate's training step (`runner.Runner`).
    batch: what the runner runs it on.
    settings: the `Settings`.
    nestable: per layer, whether it has layers of its own to nest.
    floor_bytes: the weight gradients every plan's step holds.
    num_layers: the chain's length, where `costs` is a function (keeping
      everything is measured before it is called).

  Returns:
    The `Plan`, with its measurements, what is held, and its `search`.

  Raises:
    tfremat.errors.BudgetUnreachableError (a ValueError), whose `search`
    is the record, and whose message names what every plan holds by the
    cost model once the chain was profiled.
  """
  if callable(costs):
    costs = _Once(costs)
  else:
    costs = _Once(lambda known=list(costs): known)

  def propose(trials, step_bytes):
    if not trials:
      n = len(costs()) if num_layers is None else num_layers
      return Candidate(keep_all(n)), "keep", "keeping everything"
    return next_plan(costs(), trials, step_bytes, settings, nestable)

  try:
    found = search_budget(
        budget, runner, batch, propose,
        rank=lambda c: (predict(costs(), list(c.segments))[1], c.ordered),
        settings=settings, floor_bytes=floor_bytes,
        predict=lambda c, keep: predicted_peak(costs(), c, keep))
  except errors.BudgetUnreachableError as e:
    if not costs.called or e.search is None or len(e.search.trials) < 2:
      raise
    found = e.search
    lowest = min(found.trials, key=lambda t: t.measured.bound_bytes).measured
    error = unreachable_budget_error(
        found.budget, found.budget_bytes, found.held,
        found.keep.measured.peak_bytes, lowest, settings=settings,
        terms=cost_model.floor_terms(costs()))
    error.search = found
    raise error from None
  chosen = found.chosen
  return Plan(costs(), chosen.candidate.segments, found.budget_bytes,
              found.budget, chosen.candidate.ordered, chosen.measured,
              found.keep.measured, held=found.held, step=found.step,
              search=found)


def predicted_peak(costs, candidate, keep):
  """The step's peak under `candidate`, by the cost model plus what the
  measured step of keeping everything (`keep`, a `Measured`) holds beyond
  the model's prediction for it (the step's layers outside the chain, its
  loss, the optimizer's update)."""
  keep_model = predict(costs, keep_all(len(costs)))[0]
  return int(predict(costs, list(candidate.segments))[0] +
             keep.peak_bytes - keep_model)


class _Once:
  """A function of none, called once, on first use (`choose_plan`'s
  costs)."""

  def __init__(self, fn):
    self._fn = fn
    self.called = False
    self._value = None

  def __call__(self):
    if not self.called:
      self._value = list(self._fn())
      self.called = True
    return self._value


def unreachable_budget_error(budget, budget_bytes, held, keep_peak, lowest,
                             subject="No rematerialization plan fits",
                             terms=(),
                             fix="shrink the batch or the widest layer",
                             settings=DEFAULT_SETTINGS):
  """The ValueError for a budget whose step room is below `lowest`, the
  lowest bound measured (`search_budget`'s one refusal).

  Args:
    budget: the Budget asked for.
    budget_bytes: the budget in bytes, `held` included.
    held: what training holds besides the step (`Held`).
    keep_peak: the measured peak of keeping everything.
    lowest: the lowest bound measured: that candidate's `Measured`, whose
      parts the message gives, or bytes.
    subject: what did not fit, as the message's first words.
    terms: (what, bytes) pairs that every candidate holds, by the cost
      model (`floor_terms`), for the message.
    fix: what else to do besides raising the budget.
    settings: the `Settings` searched with.
  """
  mib = units.format_bytes
  asked = (f"{budget.fraction:.0%} of the keep-everything peak, "
           if budget is not None and budget.fraction is not None else "")
  parts = ""
  if isinstance(lowest, Measured):
    parts = (f": that plan's largest peak, {mib(lowest.peak_bytes)}, plus "
             f"the spread of its calls, {mib(lowest.spread_bytes)}, plus the "
             f"reserve, {mib(lowest.reserve_bytes)} ({settings.reserve:.0%} "
             "of its peak, tfremat.planner.Settings.reserve)")
    lowest = lowest.bound_bytes
  what = "; ".join(f"{w}: {mib(n)}" for w, n in terms)
  what = f" What every plan holds, by the cost model: {what}." if what else ""
  least = lowest / max(1, keep_peak)
  need = (f"at least {math.ceil(100 * least)}%" if asked else
          f"at least {mib(held.total_bytes + lowest)}")
  return errors.BudgetUnreachableError.of(
      f"{subject} a budget of {asked}{mib(budget_bytes)}: the lowest bound "
      f"measured is {mib(lowest)}, {least:.0%} of the measured "
      f"keep-everything peak ({mib(keep_peak)}){parts}; training holds "
      f"{held} besides the step.{what} Raise the budget to {need}, or "
      f"{fix}.", lowest, keep_peak)


def floor_error(budget, budget_bytes, held, keep, floor_bytes, margin):
  """The ValueError for a budget that no plan can meet, or None: one that
  leaves the step nothing (what training holds is over it), or less than
  the weight gradients plus their reserve.

  Every plan's training step returns (or applies) the same weight
  gradients, so each plan's measured peak is at least their bytes, and its
  bound at least that plus its reserve. A budget below that is out of reach
  whatever is rematerialized, which is known as soon as keeping everything
  has been measured. Keeping everything is still chosen where its own bound
  fits or the budget is 100% of it.
  """
  step_bytes = budget_bytes - held.total_bytes
  reserve = int(margin * floor_bytes)
  lowest = floor_bytes + reserve
  if ((step_bytes > 0 and lowest <= step_bytes) or
      keep.bound_bytes <= step_bytes or budget.fraction == 1.0):
    return None
  mib = units.format_bytes
  asked = (f"{budget.fraction:.0%} of the keep-everything peak, "
           if budget.fraction is not None else "")
  if step_bytes <= 0:
    return errors.BudgetUnreachableError.of(
        f"No rematerialization plan fits a budget of {mib(budget_bytes)}: "
        f"training holds {held} before a step allocates anything. "
        "Rematerializing frees a step's activations, not these: give at "
        f"least {mib(held.total_bytes + lowest)}, or a smaller batch, model "
        "or optimizer.", held.total_bytes + lowest, keep.peak_bytes)
  least = math.ceil(100 * lowest / max(1, keep.peak_bytes))
  need = f"{least}%" if asked else mib(held.total_bytes + lowest)
  return errors.BudgetUnreachableError.of(
      f"No rematerialization plan fits a budget of {asked}{mib(budget_bytes)}:"
      f" the lowest bound any plan can have is {mib(lowest)}, {least}% of "
      f"the keep-everything peak ({mib(keep.peak_bytes)}), and "
      f"training holds {held} besides the step. Every plan's training step "
      f"ends holding the weight gradients, {mib(floor_bytes)}, and every "
      f"plan's bound adds its reserve, at least {mib(reserve)} "
      f"({margin:.0%} of its peak). Rematerializing frees "
      f"activations, not weight gradients: raise the budget to at least "
      f"{need}.", lowest, keep.peak_bytes)
