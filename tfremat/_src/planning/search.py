"""The budget search: candidates measured, each held to a bound, the fastest
that fits chosen, and a record of all of it.

`fit_budget` is the one search every budget goes through (`remat_sequential`,
`remat_model`, `remat_in_place_for_budget`, the builder, `largest_batch`). It
is driven by data: a `Settings` value, a generator of candidates that is told
how each one measured (`Trial`), and a `Search` record of what was measured,
in what order and why, which the chosen plan keeps and a refusal carries.

A candidate's bound (`Measured`) is the largest peak of its calls plus their
spread plus the reserve, `Settings.reserve` of its own peak.
"""

import dataclasses
import functools
import math

from tfremat import errors
from tfremat._src.planning import cost_model
from tfremat._src import units
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import keep_all
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.cost_model import uniform_segments
from tfremat._src.planning.plan import Infeasible
from tfremat._src.planning.plan import Measured
from tfremat._src.planning.plan import Plan
from tfremat._src.planning.plan import plan as plan_for

__all__ = [
    "Settings",
    "DEFAULT_SETTINGS",
    "Measured",
    "Candidate",
    "Trial",
    "Search",
    "fit_budget",
    "calibrated_plan",
    "plan_candidates",
    "lowest_plan",
    "unreachable_budget_error",
    "gradients_floor_error",
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
    check_calls: how many training steps each candidate is measured over:
      their largest peak and their spread make its bound.
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
    waiting_fraction: what a layer's recompute costs beyond its forward time
      when later layers of its segment rerun before its backward pass, as a
      fraction of that forward time (`LayerCost.waiting_recompute_seconds`).
    try_ordered: before a budget is refused, the lowest plan (and that plan
      nested) are measured with the chain's ops run in one order too, which
      peaks lower on some chains and costs step time.
  """
  reserve: float = 0.05
  check_calls: int = 10
  rounds: int = 4
  aim_below: float = 0.03
  faster_by: float = 0.03
  waiting_fraction: float = 0.2
  try_ordered: bool = True

  def __post_init__(self):
    fractions = {name: getattr(self, name) for name in
                 ("reserve", "aim_below", "faster_by", "waiting_fraction")}
    counts = {name: getattr(self, name) for name in ("check_calls", "rounds")}
    bad = [f"{name}={value!r}" for name, value in fractions.items()
           if isinstance(value, bool) or not isinstance(value, (int, float))
           or not 0 <= value < 1]
    bad += [f"{name}={value!r}" for name, value in counts.items()
            if isinstance(value, bool) or not isinstance(value, int) or
            value < 1]
    if not isinstance(self.try_ordered, bool):
      bad.append(f"try_ordered={self.try_ordered!r}")
    if bad:
      raise errors.InvalidArgumentError(
          f"Settings: {', '.join(bad)}: reserve, aim_below, faster_by and "
          "waiting_fraction are fractions in [0, 1), check_calls and rounds "
          "positive ints, try_ordered True or False.")

  def reserve_bytes(self, peak_bytes):
    """The reserve of a candidate that peaked at `peak_bytes`."""
    return int(self.reserve * peak_bytes)

  def room(self, budget_bytes):
    """The largest peak whose bound, before its calls' spread, is within
    `budget_bytes`."""
    return int(budget_bytes / (1 + self.reserve))

  def __str__(self):
    return (f"reserve {self.reserve:.0%} of a plan's peak, "
            f"{self.check_calls} calls per check, {self.rounds} rounds, "
            f"aim {self.aim_below:.0%} below the room, a plan measured only "
            f"if {self.faster_by:.0%} faster, waiting "
            f"{self.waiting_fraction:.0%} of a rerun's forward time, "
            f"{'ordered plans tried' if self.try_ordered else 'unordered only'}"
            " before a refusal")


DEFAULT_SETTINGS = Settings()


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A plan to measure: its segments, run unordered or in one op order."""
  segments: tuple
  ordered: bool = False


@dataclasses.dataclass(frozen=True)
class Trial:
  """One candidate measured: why it was tried, how it measured, whether it
  fits (its bound within the budget, its peak not above keeping
  everything's, which would never be worth its time)."""
  key: object
  why: str
  measured: Measured
  fits: bool


@dataclasses.dataclass(frozen=True)
class Search:
  """What a budget search measured, in order, and what it chose.

  Attributes:
    budget: the `Budget` asked for; budget_bytes: the same in bytes.
    settings: the `Settings` it searched with.
    trials: every `Trial`, in the order measured; the first is keeping
      everything.
    chosen: the Trial chosen (the fastest that fits), or None when the
      budget was refused.
  """
  budget: Budget
  budget_bytes: int
  settings: Settings
  trials: tuple
  chosen: Trial = None

  @property
  def keep(self):
    """Keeping everything's Trial."""
    return self.trials[0]

  def __str__(self):
    mib = units.format_bytes
    rows = [f"budget {mib(self.budget_bytes)} ({self.budget}); "
            f"{self.settings}"]
    for i, t in enumerate(self.trials):
      mark = "chosen" if t is self.chosen else ("fits" if t.fits else "over")
      rows.append(f"{i + 1:>3}. {mark:<7}peak {mib(t.measured.peak_bytes):>11}"
                  f"  bound {mib(t.measured.bound_bytes):>11}  {t.why}")
    if self.chosen is None:
      rows.append("     refused: no candidate fits")
    return "\n".join(rows)


def fit_budget(budget, measure, keep, candidates, rank, *,
               settings=DEFAULT_SETTINGS, gradient_bytes=0, refusal=None):
  """Measures candidates for `budget` and chooses the fastest that fits.

  1. `keep`, the candidate that rematerializes nothing, is measured; a
     fractional budget is a fraction of its largest peak.
  2. A budget below the weight gradients plus their reserve is refused at
     once (`gradients_floor_error`): no candidate can meet it.
  3. `keep` is chosen if its bound fits, or if the budget is 100% of it.
  4. `candidates(budget_bytes, keep_trial)`, a generator, yields
     `(key, why)` pairs and is sent each one's `Trial`; a key already
     measured is not measured again.
  5. Of the candidates that fit, the first by `rank` (the fastest) is
     chosen. If none fits, the budget is refused
     (`unreachable_budget_error`, with `refusal`'s words).

  Args:
    budget: a `Budget`, or what `Budget.parse` reads.
    measure: key -> the per-call peaks of a training step under that
      candidate (or a `Measured`, or one int).
    keep: the key of the candidate that rematerializes nothing.
    candidates: the generator function of step 4.
    rank: key -> a sort key; lower runs faster.
    settings: the `Settings`.
    gradient_bytes: the weight gradients' bytes, which every candidate's
      step ends holding.
    refusal: keyword arguments for `unreachable_budget_error` (`subject`,
      `terms`, `fix`), or a function of none returning them.

  Returns:
    The `Search`, its `chosen` set.

  Raises:
    tfremat.errors.BudgetUnreachableError (a ValueError), whose `search`
    is the `Search` so far.
  """
  budget = Budget.parse(budget)
  trials = {}
  order = []

  def trial(key, why, budget_bytes=None, keep_peak=None):
    if key not in trials:
      measured = Measured.of(measure(key), settings.reserve)
      fits = (budget_bytes is not None and
              measured.bound_bytes <= budget_bytes and
              measured.peak_bytes <= keep_peak)
      trials[key] = Trial(key, why, measured, fits)
      order.append(trials[key])
    return trials[key]

  kept = trial(keep, "keeping everything")
  keep_peak = kept.measured.peak_bytes
  budget_bytes = budget.bytes_given(keep_peak)
  fits_kept = (kept.measured.bound_bytes <= budget_bytes or
               budget.fraction == 1.0)
  kept = trials[keep] = order[0] = dataclasses.replace(kept, fits=fits_kept)

  def record(chosen=None):
    return Search(budget, budget_bytes, settings, tuple(order), chosen)

  error = gradients_floor_error(budget, kept.measured, gradient_bytes,
                                settings)
  if error is not None:
    error.search = record()
    raise error
  if kept.fits:
    return record(kept)
  proposals = candidates(budget_bytes, kept)
  try:
    key, why = next(proposals)
    while True:
      key, why = proposals.send(trial(key, why, budget_bytes, keep_peak))
  except StopIteration:
    pass
  fitting = [t for t in order if t.fits]
  if fitting:
    return record(min(fitting, key=lambda t: rank(t.key)))
  lowest = min(order, key=lambda t: t.measured.bound_bytes).measured
  words = refusal() if callable(refusal) else dict(refusal or {})
  error = unreachable_budget_error(budget, budget_bytes, keep_peak, lowest,
                                   settings=settings, **words)
  error.search = record()
  raise error


def calibrated_plan(costs, budget, measure, *, nestable=None,
                    gradient_bytes=0, settings=DEFAULT_SETTINGS):
  """The plan for `budget`, chosen on measured peaks, not on the model
  alone (`fit_budget` over `plan_candidates`).

  Args:
    costs: the chain's LayerCosts, a sequence. Its items are first read
      after keeping everything is measured and the floor checked, so a
      sequence that measures them on first access refuses a budget out of
      reach before any layer is measured.
    budget: a Budget, or what `Budget.parse` reads; a fraction is of the
      measured peak of keeping everything.
    measure: a `Candidate` -> the measured peaks of a training step of the
      chain under it: a list of per-call peaks, a `Measured`, or one int.
    nestable: per layer, whether it has layers of its own to rematerialize
      inside its rerun (`plan_candidates`, last step); None: none has.
    gradient_bytes: the bytes of the weight gradients the chain's training
      step returns: every plan's step ends holding them.
    settings: the `Settings`.

  Returns:
    The fastest (by the model) plan whose measured bound is within the
    budget, with its budget, measurements and `search` set.

  Raises:
    tfremat.errors.BudgetUnreachableError (a ValueError): no plan measured
      fits. The message gives the lowest bound measured, as a fraction of
      the keep-everything peak (also its `lowest_fraction`), and what
      dominates it by the cost model.
  """
  keep = Candidate(tuple(keep_all(len(costs))))

  def candidates(budget_bytes, kept):
    return plan_candidates(list(costs), budget_bytes, kept, settings,
                           nestable)

  search = fit_budget(
      budget, measure, keep, candidates,
      # The fastest by the model; of the same plan, the unordered one.
      rank=lambda c: (predict(costs, list(c.segments))[1], c.ordered),
      settings=settings, gradient_bytes=gradient_bytes,
      refusal=lambda: dict(terms=cost_model.floor_terms(costs)))
  chosen = search.chosen
  return Plan(costs, chosen.key.segments, search.budget_bytes, search.budget,
              chosen.key.ordered, chosen.measured, search.keep.measured,
              search=search)


def plan_candidates(costs, budget_bytes, keep, settings=DEFAULT_SETTINGS,
                    nestable=None):
  """The plans `calibrated_plan` measures, in order: a generator of
  `(Candidate, why)` that is sent each one's `Trial`.

  1. Keeping everything (`keep`, measured already) calibrates the cost
     model: plans are made for the aim, the room the budget leaves less
     `aim_below` of it, times (predicted / measured peak, of keeping
     everything).
  2. Each plan is measured and the model recalibrated on it: the next target
     is its predicted peak times the aim / its measured bound less reserve
     (below its predicted peak if it did not fit; below the model's floor,
     the plan it predicts to peak lowest). This stops after `rounds` plans,
     when a plan fits and no faster one is predicted to, when a target gives
     a plan already measured, or when the next plan is not predicted to be
     `faster_by` faster than one that fits.
  3. Every layer rematerialized alone (`remat_model(mode="full")` on a chain
     of blocks), when no plan fits or when the model predicts it faster than
     each that does: the model can put it just over a budget it meets.
  4. If none fits: the plan the model predicts to peak lowest, then that
     plan nested (`Segment.nested`: every layer that has layers of its own,
     by `nestable`, is rematerialized and reruns them one at a time), each
     unordered, then (`try_ordered`) ordered: one op order peaks lower on
     some chains, at a cost in step time.
  """
  mib = units.format_bytes
  n = len(costs)
  keep_peak, keep_seconds = predict(costs, keep_all(n))
  measured_keep = keep.measured
  aim = int(settings.room(budget_bytes) * (1 - settings.aim_below))
  target = int(aim * keep_peak / max(
      1, measured_keep.bound_bytes - measured_keep.reserve_bytes))
  tried = {}  # Segments -> (predicted seconds, Trial).
  floor = functools.cache(lambda: lowest_plan(costs))
  for round_ in range(settings.rounds):
    try:
      chosen = plan_for(costs, target)
      why = f"round {round_ + 1}: the fastest plan predicted within {mib(target)}"
    except Infeasible:
      chosen = floor()
      why = f"round {round_ + 1}: the lowest plan predicted"
    key = tuple(chosen.segments)
    if key in tried:
      break  # Converged: this target gives a plan already measured.
    fastest = min((s for s, t in tried.values()
                   if t.measured.bound_bytes <= budget_bytes), default=None)
    if (fastest is not None and
        chosen.seconds > fastest - settings.faster_by * keep_seconds):
      break  # Not worth measuring: too little faster than one that fits.
    trial = yield Candidate(key), why
    tried[key] = (chosen.seconds, trial)
    # The target at which the model's peak, scaled by this plan's measured
    # bound / predicted peak (less reserve), meets the aim.
    measured = trial.measured
    bound = max(1, measured.bound_bytes - measured.reserve_bytes)
    scaled = int(chosen.peak_bytes * aim / bound)
    if measured.bound_bytes > budget_bytes:
      target = min(scaled, chosen.peak_bytes - 1)  # Below this plan.
    elif scaled > target:
      target = scaled  # Room left: try a faster plan.
    else:
      break  # It fits, and no faster plan is predicted to.
  fitting = [seconds for seconds, t in tried.values() if t.fits]
  alone = tuple(uniform_segments(n, n))
  if alone not in tried and (
      not fitting or predict(costs, list(alone))[1] < min(fitting)):
    trial = yield Candidate(alone), "every layer rematerialized alone"
    if trial.fits:
      return
  if fitting:
    return
  lowest = floor().segments
  nested = cost_model.nested_segments(lowest, nestable)
  for segments, what in ((lowest, "the lowest plan predicted"),
                         (nested, "the lowest plan predicted, nested")):
    for ordered in (False, True)[:1 + settings.try_ordered]:
      if segments:
        trial = yield (Candidate(tuple(segments), ordered),
                       what + (", ordered" if ordered else ""))
        if trial.fits:
          return


def lowest_plan(costs):
  """The plan the model predicts to peak lowest: every layer rematerialized
  alone if that is among them, else the one among them that retains the
  least elsewhere.

  Several plans often share the model's lowest peak, set by one layer's
  working set, but measured steps do not: layers kept where the model sees
  room raise the peak, and so do long rematerialized segments, which rerun
  more at once. So this plan is measured before a refusal.
  """
  table = cost_model.segment_table(costs)
  need = cost_model.smallest_budget(costs, table)
  alone = uniform_segments(len(costs), len(costs))
  if predict(costs, alone)[0] <= need:
    return Plan(costs, alone, need)
  return Plan(costs, cost_model.least_retained(costs, need, table), need)


def unreachable_budget_error(budget, budget_bytes, keep_peak, lowest,
                             subject="No rematerialization plan fits",
                             terms=(),
                             fix="shrink the batch or the widest layer",
                             settings=DEFAULT_SETTINGS):
  """The ValueError for a budget below `lowest`, the lowest bound measured
  (`fit_budget`'s one refusal).

  Args:
    budget: the Budget asked for.
    budget_bytes: the budget in bytes.
    keep_peak: the measured peak of keeping everything.
    lowest: the lowest bound measured: bytes, or that candidate's
      `Measured`, whose parts the message then gives.
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
  held = "; ".join(f"{what}: {mib(n)}" for what, n in terms)
  held = f" What every plan holds, by the cost model: {held}." if held else ""
  least = lowest / max(1, keep_peak)
  return errors.BudgetUnreachableError.of(
      f"{subject} a budget of {asked}{mib(budget_bytes)}: the lowest bound "
      f"measured is {mib(lowest)}, {least:.0%} of the measured "
      f"keep-everything peak ({mib(keep_peak)}){parts}.{held} Raise the "
      f"budget to at least {math.ceil(100 * least)}%, or {fix}.", lowest,
      keep_peak)


def gradients_floor_error(budget, keep, gradient_bytes,
                          settings=DEFAULT_SETTINGS):
  """The ValueError for a budget that no plan can meet because of its
  weight gradients, or None.

  Every plan's training step returns the same weight gradients, so each
  plan's measured peak is at least their bytes, and its bound at least that
  plus its reserve. A budget below that sum is out of reach whatever is
  rematerialized, which is known as soon as keeping everything has been
  measured. Keeping everything is still chosen where its own bound fits or
  the budget is 100% of it.

  Args:
    budget: the Budget asked for.
    keep: keeping everything's `Measured`; a fractional budget is a
      fraction of its peak.
    gradient_bytes: the bytes of the weight gradients a step returns.
    settings: the `Settings` searched with.
  """
  budget_bytes = budget.bytes_given(keep.peak_bytes)
  reserve = settings.reserve_bytes(gradient_bytes)
  lowest = gradient_bytes + reserve
  if (lowest <= budget_bytes or keep.bound_bytes <= budget_bytes or
      budget.fraction == 1.0):
    return None
  mib = units.format_bytes
  asked = (f"{budget.fraction:.0%} of the keep-everything peak, "
           if budget.fraction is not None else "")
  least = math.ceil(100 * lowest / max(1, keep.peak_bytes))
  return errors.BudgetUnreachableError.of(
      f"No rematerialization plan fits a budget of {asked}{mib(budget_bytes)}:"
      f" the lowest bound any plan can have is {mib(lowest)}, {least}% of the"
      f" measured keep-everything peak ({mib(keep.peak_bytes)}). Every plan's"
      f" training step ends holding the weight gradients, "
      f"{mib(gradient_bytes)}, and every plan's bound adds its reserve, at "
      f"least {mib(reserve)} ({settings.reserve:.0%} of its peak)."
      " Rematerializing frees activations, not weight gradients: raise the "
      f"budget to at least {least}% ({mib(lowest)}).", lowest, keep.peak_bytes)
