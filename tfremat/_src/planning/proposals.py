"""The planner's candidates for a chain, as a pure function of what was
measured so far (`next_plan`): keeping everything, plans the cost model
makes for the room the budget leaves (recalibrated on each one measured),
every layer alone, the next faster plan where room is left unused, and,
before a refusal, the lowest plan, nested and ordered."""

import dataclasses

from tfremat._src import units
from tfremat._src.keras_api.segments import keep_all
from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning import cost_model
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.plan import Infeasible
from tfremat._src.planning.plan import Plan
from tfremat._src.planning.plan import plan as plan_for

__all__ = [
    "Candidate",
    "candidate_for",
    "next_plan",
    "lowest_plan",
]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A plan to measure: its segments, run unordered or in one op order."""
  segments: tuple
  ordered: bool = False

  def __post_init__(self):
    object.__setattr__(self, "segments", tuple(self.segments))


def candidate_for(segments, settings):
  """`segments` as measured and run: ordered where a segment is nested and
  `settings.try_ordered` (unordered, a nested plan's peak moved on later
  steps past every call checked: budget_later_test)."""
  return Candidate(segments, settings.try_ordered and
                   any(s.nested for s in segments))


def next_plan(costs, trials, step_bytes, settings,
              nestable=None):
  """The planner's next candidate for a chain with `costs`, given the
  `trials` so far, as `search_budget`'s `propose`: (Candidate, stage, why),
  or None when there is nothing more worth measuring.

  0. Keeping everything, first.
  1. "round": the cost model calibrated on what was measured: plans are
     made for the aim, the room the budget leaves less `aim_below` of it,
     times (predicted / measured peak, of keeping everything), then of each
     round's plan as measured (below its predicted peak if it did not fit).
     Rounds stop after `rounds` plans, when a plan fits and no faster one is
     predicted to, when a target gives a plan already measured, or when the
     next plan is not predicted `faster_by` faster than one that fits and
     peaks at `use_at_least` of the room or more.
  2. "alone": every layer rematerialized alone (`remat_model(mode="full")`
     on a chain of blocks), when no plan fits or the model predicts it
     faster than each that does.
  3. "faster": where the fastest plan that fits peaks below `use_at_least`
     of the room, the next plan the model predicts faster than it, while
     those fit and stay below.
  4. "lowest": if none fits, the plan the model predicts to peak lowest,
     unordered, then (`try_ordered`) ordered; then that plan nested
     (`Segment.nested`, where `nestable` says a layer has layers of its
     own), ordered where `try_ordered`.
  """
  n = len(costs)
  if not trials:
    return Candidate(keep_all(n)), "keep", "keeping everything"
  measured = {t.candidate for t in trials}
  fitting = [t for t in trials[1:] if t.fits]
  proposal = _round(costs, trials, step_bytes, settings)
  if proposal is not None:
    return proposal
  alone = Candidate(uniform_segments(n, n))
  seconds = {t.candidate: _seconds(costs, t.candidate) for t in fitting}
  if alone not in measured and (
      not fitting or _seconds(costs, alone) < min(seconds.values())):
    return alone, "alone", "every layer rematerialized alone"
  if fitting:
    return _faster(costs, trials, step_bytes, settings, measured)
  return _lowest(costs, trials, settings, nestable, measured)


def _seconds(costs, candidate):
  return predict(costs, list(candidate.segments))[1]


def _round(costs, trials, step_bytes, settings):
  """The next round's plan (step 1 of `next_plan`), or None when rounds
  are over. Replays the rounds measured so far to find the next target."""
  keep_peak, keep_seconds = predict(costs, keep_all(len(costs)))
  keep = trials[0].measured
  aim = int(settings.room(step_bytes) * (1 - settings.aim_below))
  target = int(aim * keep_peak / max(1, keep.bound_bytes - keep.reserve_bytes))
  rounds = [t for t in trials if t.stage == "round"]
  for done in rounds:
    chosen = predict(costs, list(done.candidate.segments))[0]
    m = done.measured
    scaled = int(chosen * aim / max(1, m.bound_bytes - m.reserve_bytes))
    if m.bound_bytes > step_bytes:
      target = min(scaled, chosen - 1)  # Below this plan.
    elif scaled > target:
      target = scaled  # Room left: try a faster plan.
    else:
      return None  # It fits, and no faster plan is predicted to.
  if len(rounds) >= settings.rounds:
    return None
  try:
    chosen = plan_for(costs, target)
    why = (f"round {len(rounds) + 1}: the fastest plan predicted within "
           f"{units.format_bytes(target)}")
  except Infeasible:
    chosen = lowest_plan(costs)
    why = f"round {len(rounds) + 1}: the lowest plan predicted"
  candidate = Candidate(chosen.segments)
  if candidate in {t.candidate for t in trials}:
    return None  # Converged: this target gives a plan already measured.
  fitting = [t for t in rounds if t.measured.bound_bytes <= step_bytes]
  fastest = min((predict(costs, list(t.candidate.segments))[1]
                 for t in fitting), default=None)
  roomy = any(t.measured.peak_bytes < settings.use_at_least * step_bytes
              for t in fitting if predict(costs, list(
                  t.candidate.segments))[1] == fastest)
  if (fastest is not None and not roomy and
      chosen.seconds > fastest - settings.faster_by * keep_seconds):
    # Not worth measuring: too little faster than one that fits, which
    # uses the room.
    return None
  return candidate, "round", why


def _faster(costs, trials, step_bytes, settings, measured):
  """Step 3 of `next_plan`: the next plan predicted faster than the fastest
  that fits, where that one leaves more than `1 - use_at_least` of the
  room unused; None otherwise."""
  fitting = [t for t in trials[1:] if t.fits]
  best = min(fitting, key=lambda t: _seconds(costs, t.candidate))
  if (best.measured.peak_bytes >= settings.use_at_least * step_bytes or
      best.stage == "lowest" or
      any(t.stage == "faster" and not t.fits for t in trials)):
    return None  # Room used, a last resort fits, or the next is over.
  seconds = _seconds(costs, best.candidate)
  predicted = predict(costs, list(best.candidate.segments))[0]
  keep_peak = predict(costs, keep_all(len(costs)))[0]
  # The smallest predicted peak above this plan's that buys a faster plan.
  low, high = predicted, max(keep_peak, predicted + 1)
  table = cost_model.segment_table(costs)
  faster = cost_model.fastest(costs, high, table)
  if faster is None or predict(costs, faster)[1] >= seconds:
    return None
  while high - low > max(1, keep_peak // 1000):
    middle = (low + high) // 2
    found = cost_model.fastest(costs, middle, table)
    if found is not None and predict(costs, found)[1] < seconds:
      high, faster = middle, found
    else:
      low = middle
  candidate = Candidate(faster)
  if candidate in measured:
    return None
  return (candidate, "faster",
          f"the next plan predicted faster than the fastest that fits "
          f"(which peaked at {best.measured.peak_bytes / step_bytes:.0%} of "
          "the room)")


def _lowest(costs, trials, settings, nestable, measured):
  """Step 4 of `next_plan`: the lowest plan, nested, ordered; None when
  each was measured."""
  lowest = lowest_plan(costs).segments
  nested = cost_model.nested_segments(list(lowest), nestable)
  tries = [(Candidate(lowest, o), "the lowest plan predicted")
           for o in (False, True)[:1 + settings.try_ordered]]
  if nested:
    tries.append((candidate_for(nested, settings),
                  "the lowest plan predicted, nested"))
  for candidate, what in tries:
    if candidate.segments and candidate not in measured:
      return (candidate, "lowest",
              what + (", ordered" if candidate.ordered else ""))
  return None


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
