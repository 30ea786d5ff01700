"""Choose what to rematerialize in a chain of layers for a memory budget.

  costs = tfremat.chain.measure_chain(blocks, sample_input)
  plan = tfremat.planner.plan(costs, budget_bytes=200 * 2**20)
  print(plan)                 # per-layer decisions, predicted peak and time
  layer = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)

This module is pure: it computes with measured costs and never measures
(`tfremat.chain` measures chains; `tfremat.measure` measures steps).

The budget bounds what `tfremat.measure.peak_bytes` measures: the
allocator's peak during one training step (forward, loss, backward) above
what was allocated just before it. Weights and the input batch are not
counted; activations, temporaries and weight gradients are.

A plan splits the chain into consecutive segments, each either kept (its
layers' activations are stored for the backward pass) or rematerialized (only
the segment's output is stored; the segment reruns in the backward pass). The
cost model below predicts a plan's peak and step time from per-layer
measurements; `plan` finds the fastest plan whose predicted peak fits the
budget, exactly, by dynamic programming over (retained bytes, time) Pareto
fronts; `calibrated_plan` checks its choices against measured peaks and,
before refusing a budget, measures the lowest plan nested (`Segment.nested`).
"""

import dataclasses
import functools
import math

from tfremat import errors
from tfremat import measure
from tfremat._src import cost_model
from tfremat._src import plan_text
from tfremat._src.cost_model import Budget
from tfremat._src.cost_model import LayerCost
from tfremat._src.cost_model import Segment
from tfremat._src.cost_model import check_segments
from tfremat._src.cost_model import floor_terms
from tfremat._src.cost_model import keep_all
from tfremat._src.cost_model import predict
from tfremat._src.cost_model import segment_policies
from tfremat._src.cost_model import short_policy_name
from tfremat._src.cost_model import smallest_budget
from tfremat._src.cost_model import uniform_segments
from tfremat._src.plan_text import LEGEND

__all__ = [
    "Measured",
    "LayerCost",
    "Segment",
    "Budget",
    "Plan",
    "plan",
    "calibrated_plan",
    "fit_budget",
    "Fitted",
    "predict",
    "check_segments",
    "segment_policies",
    "smallest_budget",
    "lowest_plan",
    "short_policy_name",
    "floor_terms",
    "unreachable_budget_error",
    "gradients_floor_error",
    "infeasible_budget_error",
    "keep_all",
    "uniform_segments",
    "ALLOCATOR_MARGIN",
    "margin_bytes",
    "peak_for_bound",
    "FASTER_BY",
    "AIM_BELOW",
    "LEGEND",
]


@dataclasses.dataclass(frozen=True)
class Measured:
  """A plan's measured peaks over several calls of its training step.

  A budget must hold for every later call, in this process and in the next
  one, so a plan is held to a bound above what was measured: the largest
  peak, plus the spread (largest less smallest) of the calls, plus an
  allocator margin. The spread covers what moves from call to call (the
  graph executor's threads order independent ops differently); the margin,
  a fraction of the plan's own largest peak (`ALLOCATOR_MARGIN`), what
  moves from process to process: TensorFlow's BFC allocator (CPU and GPU)
  counts a tensor placed in a free chunk less than twice its size as the
  whole chunk, and which chunks are free depends on what the process did
  before.

  Attributes:
    peak_bytes: the largest peak of the calls.
    bound_bytes: the bound a budget is compared with.
    calls: how many calls were measured.
    margin_bytes: the allocator margin included in `bound_bytes`.
  """
  peak_bytes: int
  bound_bytes: int
  calls: int = 1
  margin_bytes: int = 0

  @classmethod
  def of(cls, value, margin_bytes=0):
    """A Measured from a list of per-call peaks, a Measured, or one int (a
    single peak), with `margin_bytes` added to the bound."""
    if isinstance(value, Measured):
      return dataclasses.replace(
          value, bound_bytes=value.bound_bytes + margin_bytes,
          margin_bytes=value.margin_bytes + margin_bytes)
    if isinstance(value, (list, tuple)):
      top, low = int(max(value)), int(min(value))
      return cls(top, 2 * top - low + margin_bytes, len(value), margin_bytes)
    return cls(int(value), int(value) + margin_bytes, 1, margin_bytes)

  @classmethod
  def with_margin(cls, value):
    """A Measured (from what `of` reads) whose bound adds the allocator
    margin: `ALLOCATOR_MARGIN` of its own largest peak."""
    first = cls.of(value)
    return cls.of(first, margin_bytes(first.peak_bytes))

  @property
  def spread_bytes(self):
    """The calls' spread that `bound_bytes` includes."""
    return self.bound_bytes - self.peak_bytes - self.margin_bytes


def margin_bytes(peak_bytes):
  """The allocator margin of a plan that peaked at `peak_bytes`."""
  return int(ALLOCATOR_MARGIN * peak_bytes)


def peak_for_bound(bound_bytes):
  """The largest peak whose bound, before the calls' spread, is at most
  `bound_bytes`."""
  return int(bound_bytes / (1 + ALLOCATOR_MARGIN))


# The allocator margin of every plan's bound, as a fraction of the plan's
# own measured peak (`Measured`): one plan's peak in fresh processes rose up
# to 27% above its measured peak with one inter-op thread (whose calls do not
# spread), and 18% beyond the spread with the default threads
# (docs/design.md, "Budgets that hold"). Set it to 0 to plan on this
# process's measurements alone.
ALLOCATOR_MARGIN = 0.35


def lowest_plan(costs):
  """The plan the model predicts to peak lowest: every layer rematerialized
  alone if that is among them, else the one among them that retains the
  least elsewhere.

  Several plans often share the model's lowest peak, set by one layer's
  working set, but measured steps do not: layers kept where the model sees
  room raise the peak (a 4-layer KerasHub GemmaBackbone: its fastest plan at
  the floor at 0.41x of keeping everything, every layer alone at 0.34x), and
  so do long rematerialized segments, which rerun more at once (MobileNetV2
  at 64x64, batch 8: 29.0 MiB with 5 segments over its 9 parts, 21.8 MiB
  with every part alone). So this plan is measured before a refusal.
  """
  table = cost_model.segment_table(costs)
  need = smallest_budget(costs, table)
  alone = uniform_segments(len(costs), len(costs))
  if predict(costs, alone)[0] <= need:
    return Plan(costs, alone, need)
  return Plan(costs, cost_model.least_retained(costs, need, table), need)


class Plan:
  """Which layers to rematerialize, with the cost model's predictions.

  Attributes:
    costs, segments: the chain's measured LayerCosts and the chosen segments.
    budget_bytes: the budget in bytes, or None.
    budget: the Budget as given (bytes or a fraction), or None.
    peak_bytes, seconds: the cost model's peak and step time for this plan.
    baseline_peak_bytes, baseline_seconds: the same for keeping everything.
    measured: this plan's measured peaks (a `Measured`, set when
      `calibrated_plan` checks it), else None.
    measured_keep: the same for keeping everything, else None.
    ordered: whether the chain runs ordered (`RematSequential(...,
      ordered=True)`): the planner orders a plan only where no unordered
      plan it measured fits.

  A Plan is a value: its attributes cannot be set; `replace` makes a new
  one with some changed.
  """

  def __init__(self, costs, segments, budget_bytes=None, budget=None,
               ordered=False, measured=None, measured_keep=None):
    peak_bytes, seconds = predict(costs, segments)
    baseline = predict(costs, keep_all(len(costs)))
    for name, value in (
        ("costs", list(costs)), ("segments", list(segments)),
        ("budget_bytes", budget_bytes), ("budget", budget),
        ("ordered", bool(ordered)), ("peak_bytes", peak_bytes),
        ("seconds", seconds), ("measured", measured),
        ("measured_keep", measured_keep),
        ("baseline_peak_bytes", baseline[0]),
        ("baseline_seconds", baseline[1])):
      object.__setattr__(self, name, value)

  def __setattr__(self, name, value):
    raise dataclasses.FrozenInstanceError(
        f"A Plan is a value: use plan.replace({name}=...) for one with "
        f"another {name}.")

  def replace(self, **changes):
    """A new Plan like this one, with `changes` (any of `__init__`'s
    arguments but `costs`) made."""
    given = dict(segments=self.segments, budget_bytes=self.budget_bytes,
                 budget=self.budget, ordered=self.ordered,
                 measured=self.measured, measured_keep=self.measured_keep)
    unknown = set(changes) - set(given)
    if unknown:
      raise errors.InvalidArgumentError(
          f"Plan.replace takes {sorted(given)}; got {sorted(unknown)}.")
    given.update(changes)
    return Plan(self.costs, **given)

  @property
  def measured_peak_bytes(self):
    """The largest measured peak of this plan's step, or None."""
    return self.measured.peak_bytes if self.measured else None

  @property
  def measured_keep_peak_bytes(self):
    """The largest measured peak of keeping everything, or None."""
    return self.measured_keep.peak_bytes if self.measured_keep else None

  @property
  def rematerialized(self):
    """Per layer: whether it is rematerialized."""
    return [s.remat for s in self.segments for _ in range(s.start, s.stop)]

  def get_config(self):
    """A JSON-able dict; `Plan.from_config` makes the same Plan from it."""
    return {
        "costs": [dataclasses.asdict(c) for c in self.costs],
        "segments": [s.as_list() for s in self.segments],
        "budget_bytes": self.budget_bytes,
        "budget": dataclasses.asdict(self.budget) if self.budget else None,
        "measured": (dataclasses.asdict(self.measured) if self.measured
                     else None),
        "measured_keep": (dataclasses.asdict(self.measured_keep)
                          if self.measured_keep else None),
        "ordered": self.ordered,
    }

  @classmethod
  def from_config(cls, config):
    budget = config.get("budget")
    measured = {name: Measured(**config[name])
                for name in ("measured", "measured_keep") if config.get(name)}
    return cls([LayerCost(**c) for c in config["costs"]],
               [Segment(*s) for s in config["segments"]],
               config.get("budget_bytes"),
               Budget(**budget) if budget else None,
               config.get("ordered", False), **measured)

  def __str__(self):
    return "\n".join(plan_text.layer_rows(self) + plan_text.summary_rows(self) +
                     [LEGEND])


# A faster plan is measured (`calibrated_plan`) only if the cost model
# predicts it at least this fraction of keeping everything's step time faster
# than the fastest plan already measured within the budget: each measurement
# traces and runs a training step of the whole chain (seconds, on the
# benchmark's models), and the per-layer timings the model adds up move by
# more than this between planning runs.
FASTER_BY = 0.03

# `calibrated_plan` aims each plan this fraction below the room the budget
# leaves (the budget less the allocator margin): the cost model's error
# moves by several percent from plan to plan and from process to process,
# a plan aimed at the room itself misses whenever the error is positive, and
# each miss costs a check of the whole chain. Aiming lower costs step time:
# on the benchmark's transformer blocks, 6% less room made a plan 0.7-2%
# slower by the model (docs/benchmarks.md, "Measurements behind the
# defaults").
AIM_BELOW = 0.03


@dataclasses.dataclass(frozen=True)
class Fitted:
  """What `fit_budget` chose.

  Attributes:
    choice: the candidate chosen (its key, as the search named it).
    measured: its `Measured` peaks, allocator margin included.
    keep: the same for the candidate that rematerializes nothing.
    budget: the `Budget` asked for.
    budget_bytes: the budget in bytes.
  """
  choice: object
  measured: Measured
  keep: Measured
  budget: Budget
  budget_bytes: int


def fit_budget(budget, measured_peak, keep, search, rank, gradient_bytes=0,
               refusal=None):
  """tfremat's one budget search: `remat_sequential`, `remat_model` and
  `remat_in_place_for_budget` all choose through it.

  Candidates are hashable keys: a plan's segments, or how many layers are
  rematerialized in place. Each is measured at most once, and held to its
  bound (`Measured.with_margin`: the largest peak of its calls, plus their
  spread, plus the allocator margin).

  1. `keep`, the candidate that rematerializes nothing, is measured; a
     fractional budget is a fraction of its largest peak.
  2. A budget below the weight gradients plus their allocator margin is
     refused at once (`gradients_floor_error`): no candidate can meet it.
  3. `keep` is chosen if its bound fits, or if the budget is 100% of it.
  4. `search(measure, fits, budget_bytes)` tries candidates:
     `measure(key)` returns a candidate's `Measured`, and `fits(measured)`
     whether it fits: its bound within the budget and its peak not above
     keep's (such a candidate is never worth its time).
  5. Of the candidates measured that fit, the first by `rank` (the
     fastest) is chosen. If none fits, the budget is refused
     (`unreachable_budget_error`, with `refusal`'s words).

  Args:
    budget: a `Budget`, or what `Budget.parse` reads.
    measured_peak: key -> the per-call peaks of a training step under that
      candidate (or a `Measured`, or one int).
    keep: the key of the candidate that rematerializes nothing.
    search: (measure, fits, budget_bytes) -> None, as in step 4.
    rank: key -> a sort key; lower runs faster.
    gradient_bytes: the weight gradients' bytes, which every candidate's
      step ends holding.
    refusal: a function of no arguments returning keyword arguments for
      `unreachable_budget_error` (`subject`, `terms`, `fix`), called only
      when the budget is refused.

  Returns:
    A `Fitted`.

  Raises:
    ValueError: a `tfremat.errors.BudgetUnreachableError`.
  """
  budget = Budget.parse(budget)
  tried = {}

  def measure_once(key):
    if key not in tried:
      tried[key] = Measured.with_margin(measured_peak(key))
    return tried[key]

  kept = measure_once(keep)
  budget_bytes = budget.bytes_given(kept.peak_bytes)
  error = gradients_floor_error(budget, kept, gradient_bytes)
  if error is not None:
    raise error
  if kept.bound_bytes <= budget_bytes or budget.fraction == 1.0:
    return Fitted(keep, kept, kept, budget, budget_bytes)

  def fits(measured):
    return (measured.bound_bytes <= budget_bytes and
            measured.peak_bytes <= kept.peak_bytes)

  search(measure_once, fits, budget_bytes)
  fitting = [key for key, m in tried.items() if fits(m)]
  if fitting:
    chosen = min(fitting, key=rank)
    return Fitted(chosen, tried[chosen], kept, budget, budget_bytes)
  lowest = min(tried.values(), key=lambda m: m.bound_bytes)
  raise unreachable_budget_error(budget, budget_bytes, kept.peak_bytes,
                                 lowest, **(refusal() if refusal else {}))


def calibrated_plan(costs, budget, measured_peak, rounds=4, nestable=None,
                    gradient_bytes=0, measured_ordered=None):
  """The plan for `budget`, chosen on measured peaks, not on the model alone.

  The cost model's peaks are estimates, above the measured ones on some
  chains and below on others (docs/benchmarks.md, "Measurements behind the
  defaults"). A model that is too high costs
  time (more is rematerialized than needed); one that is too low breaks the
  budget. So, through `fit_budget`:

  1. Keeping everything is measured and chosen if its bound (`Measured`)
     fits, or if the budget is 100% of it. A budget below
     `gradient_bytes` plus the allocator margin is refused here, before any
     plan is measured (`gradients_floor_error`).
  2. That measurement calibrates the model: plans are made for the aim,
     the largest peak whose bound with the allocator margin fits the budget
     (`peak_for_bound`) less `AIM_BELOW` of it, times (predicted / measured
     bound less the margin, of keeping everything).
  3. Each plan is measured, and the model is recalibrated on it: the next
     target is that plan's predicted peak times the aim / (its measured
     bound less margin) (below its predicted peak if it did not fit the
     budget; below the model's floor, the plan it predicts to peak
     lowest). A plan fits when its bound is within the budget, aimed at or
     not.
     This stops after `rounds` plans, when a plan fits and no faster one
     is predicted to, or when a target gives a plan already measured, or
     when the next plan is not predicted to be `FASTER_BY` faster than one
     that fits. Then, if no plan fits or the model predicts every layer
     rematerialized alone (what `remat_model(mode="full")` runs on a chain
     of blocks) faster than each that does, that plan is measured too: the
     model can put it just over a budget it meets.
  4. If no plan measured fits, the plan the model predicts to peak lowest
     (`lowest_plan`) is measured too (if it was not).
  5. If that does not fit either, the same plan nested (`Segment.nested`:
     every layer that has layers of its own, by `nestable`, is
     rematerialized and reruns those one at a time) is measured, before the
     budget is refused. A transformer layer's rerun holds its attention's
     and its feed-forward's working sets at once; nested, one of them.
     With `measured_ordered`, each of these two is measured ordered too,
     right after it is measured unordered: an ordered chain peaks lower on
     some chains (one schedule, no two reruns' tensors alive at once), at a
     cost in step time, so order is taken only where nothing unordered
     fits.

  Args:
    costs: the chain's LayerCosts, a sequence. Its items are first read
      after keeping everything is measured and the floor checked, so a
      sequence that measures them on first access
      (`tfremat.chain.checked_plan` passes one) refuses a budget out of
      reach before any layer is measured.
    budget: a Budget, or what `Budget.parse` reads; a fraction is of the
      measured peak of keeping everything.
    measured_peak: segments -> the measured peaks of a training step of the
      chain under them: a list of per-call peaks, a `Measured`, or one int
      (`tfremat.chain.checked_plan` measures).
    rounds: how many plans to measure at most, besides keeping everything,
      every layer alone (step 3) and, before refusing, the lowest plan
      (steps 4 and 5).
    nestable: per layer, whether it has layers of its own to rematerialize
      inside its rerun (step 5); None: none has.
    gradient_bytes: the bytes of the weight gradients the chain's training
      step returns, as measured (`tfremat.chain.checked_plan` measures):
      every plan's step ends holding them.
    measured_ordered: segments -> measured peaks as for `measured_peak`,
      with the chain run ordered; None: no plan is tried ordered.

  Returns:
    The fastest (by the model) plan whose measured bound is within the
    budget, with its budget and measurements set.

  Raises:
    ValueError: no plan measured fits (`errors.BudgetUnreachableError`).
      The message gives the lowest bound measured, as a fraction of the
      keep-everything peak (also its `lowest_fraction`), and what
      dominates it by the cost model.
  """
  def measured(key):
    segments, ordered = key
    return (measured_ordered if ordered else measured_peak)(list(segments))

  def search(measure_it, fits, budget_bytes):
    _calibrated(list(costs), measure_it, fits, budget_bytes, rounds,
                nestable, ordered=measured_ordered is not None)

  fitted = fit_budget(
      budget, measured, (tuple(keep_all(len(costs))), False), search,
      # The fastest by the model; of the same plan, the unordered one.
      rank=lambda key: (predict(costs, list(key[0]))[1], key[1]),
      gradient_bytes=gradient_bytes,
      refusal=lambda: dict(terms=floor_terms(costs)))
  segments, ordered = fitted.choice
  return Plan(costs, list(segments), fitted.budget_bytes, fitted.budget,
              ordered, fitted.measured, fitted.keep)


def _calibrated(costs, measure_it, fits, budget_bytes, rounds,
                nestable=None, ordered=False):
  """`calibrated_plan`'s search (its steps 2 to 5), once keeping everything
  has not settled the budget: measures plans through
  `measure_it((segments, ordered))`, which returns a `Measured`; `fits` is
  `fit_budget`'s."""
  keep_segments = keep_all(len(costs))
  keep = measure_it((tuple(keep_segments), False))  # Measured already.
  keep_peak, keep_seconds = predict(costs, keep_segments)

  # Each plan's margin is a fraction of its own peak: the room for peaks.
  aim = int(peak_for_bound(budget_bytes) * (1 - AIM_BELOW))
  target = int(aim * keep_peak / max(1, keep.bound_bytes - keep.margin_bytes))
  tried = {}  # Segments -> (predicted seconds, Measured).
  # The plan the model predicts to peak lowest, made once if needed.
  floor_plan = functools.cache(lambda: lowest_plan(costs))
  for _ in range(rounds):
    try:
      chosen = plan(costs, target)
    except _Infeasible:
      # Below the model's floor: the plan it predicts to peak lowest is the
      # last worth measuring, and is measured before refusing (on CNNs the
      # model's error is large: plans above it measured over budget where
      # that one fit).
      chosen = floor_plan()
    key = tuple(chosen.segments)
    if key in tried:
      break  # Converged: this target gives a plan already measured.
    fastest = min((s for s, m in tried.values()
                   if m.bound_bytes <= budget_bytes), default=None)
    if (fastest is not None and
        chosen.seconds > fastest - FASTER_BY * keep_seconds):
      break  # Not worth measuring: too little faster than one that fits.
    measured = measure_it((key, False))
    tried[key] = (chosen.seconds, measured)
    # Recalibrate: the target at which the model's peak, scaled by this
    # plan's measured bound / predicted peak (less margin), meets the aim.
    bound = max(1, measured.bound_bytes - measured.margin_bytes)
    scaled = int(chosen.peak_bytes * aim / bound)
    if measured.bound_bytes > budget_bytes:
      target = min(scaled, chosen.peak_bytes - 1)  # Below this plan.
    elif scaled > target:
      target = scaled  # Room left: try a faster plan.
    else:
      break  # It fits, and no faster plan is predicted to.
  _last_candidates(costs, tried, measure_it, fits, floor_plan, nestable,
                   ordered)


def _last_candidates(costs, tried, measure_it, fits, floor_plan, nestable,
                     ordered):
  """`_calibrated`'s candidates after its rounds (`tried`: segments ->
  (predicted seconds, Measured)).

  Every layer rematerialized alone (`remat_model(mode="full")` on a chain
  of blocks), when no plan fits or when predicted faster than each that
  does: the model can put it just over a budget it meets, and find plans
  that rerun as much in longer segments, which wait on more. Then, if none
  fits, the plan the model predicts to peak lowest, and that plan nested,
  lower still and slower; each unordered, then ordered.
  """
  fitting = [seconds for seconds, m in tried.values() if fits(m)]
  alone = tuple(uniform_segments(len(costs), len(costs)))
  if alone not in tried and (
      not fitting or predict(costs, list(alone))[1] < min(fitting)):
    if fits(measure_it((alone, False))):
      return
  if fitting:
    return
  lowest = floor_plan().segments
  for segments in (lowest, cost_model.nested_segments(lowest, nestable)):
    for in_order in (False, True)[:1 + bool(ordered)]:
      if segments and fits(measure_it((tuple(segments), in_order))):
        return


def unreachable_budget_error(budget, budget_bytes, keep_peak, lowest,
                             subject="No rematerialization plan fits",
                             terms=(),
                             fix="shrink the batch or the widest layer"):
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
  """
  mib = measure.format_bytes
  asked = (f"{budget.fraction:.0%} of the keep-everything peak, "
           if budget is not None and budget.fraction is not None else "")
  parts = ""
  if isinstance(lowest, Measured):
    parts = (f": that plan's largest peak, {mib(lowest.peak_bytes)}, plus "
             f"the spread of its calls, {mib(lowest.spread_bytes)}, plus the "
             f"allocator margin, {mib(lowest.margin_bytes)} "
             "(tfremat.planner.ALLOCATOR_MARGIN of its peak)")
    lowest = lowest.bound_bytes
  held = "; ".join(f"{what}: {mib(n)}" for what, n in terms)
  held = f" What every plan holds, by the cost model: {held}." if held else ""
  least = lowest / max(1, keep_peak)
  return errors.BudgetUnreachableError.of(
      f"{subject} a budget of {asked}{mib(budget_bytes)}: the lowest bound "
      f"measured is {mib(lowest)}, {least:.0%} of the measured "
      f"keep-everything peak ({mib(keep_peak)}){parts}.{held} Raise the "
      f"budget to at least {least:.0%}, or {fix}.", lowest, keep_peak)


def gradients_floor_error(budget, keep, gradient_bytes):
  """The ValueError for a budget that no plan can meet because of its
  weight gradients, or None.

  Every plan's training step returns the same weight gradients, so each
  plan's measured peak is at least their bytes, and its bound
  (`Measured`) at least that plus the allocator margin. A budget below
  that sum is out of reach whatever is rematerialized, which is known as
  soon as keeping everything has been measured. Keeping everything is
  still chosen where its own bound fits or the budget is 100% of it
  (`calibrated_plan`, step 1).

  Args:
    budget: the Budget asked for.
    keep: keeping everything's `Measured`, allocator margin included; a
      fractional budget is a fraction of its peak.
    gradient_bytes: the bytes of the weight gradients a step returns.
  """
  budget_bytes = budget.bytes_given(keep.peak_bytes)
  margin = margin_bytes(gradient_bytes)
  lowest = gradient_bytes + margin
  if (lowest <= budget_bytes or keep.bound_bytes <= budget_bytes or
      budget.fraction == 1.0):
    return None
  mib = measure.format_bytes
  asked = (f"{budget.fraction:.0%} of the keep-everything peak, "
           if budget.fraction is not None else "")
  least = math.ceil(100 * lowest / max(1, keep.peak_bytes))
  return errors.BudgetUnreachableError.of(
      f"No rematerialization plan fits a budget of {asked}{mib(budget_bytes)}:"
      f" the lowest bound any plan can have is {mib(lowest)}, {least}% of the"
      f" measured keep-everything peak ({mib(keep.peak_bytes)}). Every plan's"
      f" training step ends holding the weight gradients, "
      f"{mib(gradient_bytes)}, and every plan's bound adds the allocator "
      f"margin, at least {mib(margin)} (tfremat.planner.ALLOCATOR_MARGIN of "
      "the plan's peak)."
      " Rematerializing frees activations, not weight gradients: raise the "
      f"budget to at least {least}% ({mib(lowest)}).", lowest, keep.peak_bytes)


def plan(costs, budget_bytes):
  """The fastest plan whose predicted peak fits `budget_bytes`.

  Raises:
    ValueError: no plan fits; the message gives the smallest budget that does.
  """
  segments = cost_model.fastest(costs, budget_bytes)
  if segments is None:
    raise infeasible_budget_error(budget_bytes, smallest_budget(costs))
  return Plan(costs, segments, budget_bytes)


class _Infeasible(errors.InvalidArgumentError):
  """No plan the cost model predicts fits the budget (`plan`)."""


def infeasible_budget_error(budget_bytes, need, estimated_by=None):
  """The ValueError for a budget below `need`, the smallest that works
  (`estimated_by`: how `need` was estimated, if not by the model alone)."""
  about, how = ("about ", f", {estimated_by}") if estimated_by else ("", "")
  return _Infeasible(
      f"No rematerialization plan fits a budget of {budget_bytes} bytes "
      f"({budget_bytes / 2**20:.1f} MiB); the smallest budget that works for "
      f"this chain is {about}{need} bytes ({need / 2**20:.1f} MiB){how}. "
      "Raise the budget, or shrink the batch or the layers.")
