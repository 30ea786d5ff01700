"""Ways of choosing what to rematerialize on a chain of blocks, compared in
one process (`--sweep`, `--budget-fraction`): uniform schemes, every block
under each save policy, and the planner at fractions of the no-remat peak,
each applied as `remat_sequential(budget=...)` applies it."""

import dataclasses
import time

from tfremat import chain
from tfremat import measure
from tfremat import planner
from tfremat import policies
from tfremat.bench import methods as methods_lib

__all__ = [
    "uniform_schemes",
    "policy_schemes",
    "measure_schemes",
    "mark_dominated",
]


def uniform_schemes(num_blocks):
  """The classic choices: name -> segments."""
  schemes = {"none": planner.keep_all(num_blocks)}
  for k, name in ((1, "every block"), (2, "every 2nd block"),
                  (4, "every 4th block")):
    if k <= num_blocks:
      schemes[name] = [planner.Segment(i, i + 1, i % k == 0)
                       for i in range(num_blocks)]
  schemes["sqrt segments"] = planner.uniform_segments(num_blocks, "sqrt")
  return schemes


def policy_schemes(num_blocks, names):
  """Every block rematerialized under each save policy: name -> segments."""
  return {f"every block, {policies.short_name(p)}":
          [planner.Segment(i, i + 1, True, p) for i in range(num_blocks)]
          for p in names}


def measure_schemes(model, sizes, dropout, fractions, planner_policies, *,
                    sweep=False, jit=False, rounds=10, progress=None,
                    log=print):
  """Rows for the uniform schemes (with `sweep`, all of them and every
  block under each of `planner_policies`; else keeping everything and
  every block) and the planner at each of `fractions` of keeping
  everything's peak, on `model`'s blocks as a chain. `log` gets each
  plan's printout, its prediction beside its measurement."""
  blocks, x = methods_lib.chain_and_batch(model, sizes, dropout)
  rows, steps = [], []

  def run(name, kind, segments, fraction=None, plan_seconds=None,
          layer=None):
    # The planner's rows run as remat_sequential(budget=...) returns them.
    layer = layer or chain.apply_plan(blocks, _Scheme(tuple(segments)))
    step = chain.training_step(layer, jit=jit)
    used = sorted({policies.short_name(s.policy) for s in segments
                   if s.remat and s.policy})
    rows.append({"scheme": name, "kind": kind,
                 "rematerialized": sum(s.stop - s.start for s in segments
                                       if s.remat),
                 "policies": " ".join(used),
                 "peak_bytes": measure.peak_bytes(step, x),
                 "budget_fraction": fraction, "plan_seconds": plan_seconds})
    steps.append(step)
    if progress is not None:
      progress.add(1)

  schemes = uniform_schemes(len(blocks))
  if sweep:
    schemes.update(policy_schemes(len(blocks), planner_policies))
  else:
    schemes = {k: schemes[k] for k in ("none", "every block")}
  for name, segments in schemes.items():
    run(name, "policy" if any(s.policy for s in segments) else "uniform",
        segments)
  full = rows[0]["peak_bytes"]
  for fraction, chosen, seconds in _plans(blocks, x, fractions,
                                         planner_policies, full, log):
    if chosen is None:
      if progress is not None:
        progress.add(1)
      continue
    run(f"planner {fraction:.0%}", "planner", chosen.segments, fraction,
        seconds, chain.apply_plan(blocks, chosen))
  methods_lib.add_times(rows, steps, x, rounds=rounds)
  mark_dominated(rows)
  for r in rows:
    r["peak_x_none"] = _ratio(r["peak_bytes"], full)
    r["step_x_none"] = _ratio(r["step_seconds"], rows[0]["step_seconds"])
    r["budget_bytes"] = (None if r["budget_fraction"] is None else
                         int(r["budget_fraction"] * full))
    r["fits"] = (None if r["budget_bytes"] is None else
                 r["peak_bytes"] <= r["budget_bytes"])
  return rows


def _plans(blocks, x, fractions, planner_policies, full, log):
  """(fraction, plan or None where refused, seconds): the planner at each
  fraction, as remat_sequential(budget=...) would take it: the chain's
  measurement (shared by the fractions here) and that fraction's checked
  plan."""
  start = time.perf_counter()
  with chain.retracing_quiet():
    costs = chain.measure_chain(blocks, x, policies=planner_policies)
  costs_seconds = time.perf_counter() - start
  for fraction in fractions:
    start = time.perf_counter()
    try:
      chosen = chain.checked_plan(blocks, fraction, x, costs=costs)
    except ValueError as e:
      log(f"\nplanner at {fraction:.0%}: {e}")
      yield fraction, None, None
      continue
    log(f"\nplanner at {fraction:.0%} of {full / 2**20:.1f} MiB:\n{chosen}")
    yield fraction, chosen, costs_seconds + time.perf_counter() - start


@dataclasses.dataclass(frozen=True)
class _Scheme:
  """Segments chosen by a rule, not by the planner, as `apply_plan` takes
  them (kept layers gated, as the planner's plans run)."""
  segments: tuple
  ordered: bool = False


def mark_dominated(rows):
  """Sets each row's "dominated_by": the name of a row that beats it on both
  axes (a lower peak, and a step time whose 75th percentile is below this
  row's 25th), the one with the lowest peak of those; "" where none does.
  A dominated row is a choice no user should make, and a dominated planner
  row is a regression."""
  for r in rows:
    better = [s for s in rows
              if s["peak_bytes"] < r["peak_bytes"] and
              s["step_p75_seconds"] < r["step_p25_seconds"]]
    r["dominated_by"] = (min(better, key=lambda s: s["peak_bytes"])["scheme"]
                         if better else "")
  return rows


def _ratio(value, base):
  """value / base; nan when a tiny run's base measured 0."""
  return value / base if base else float("nan")
