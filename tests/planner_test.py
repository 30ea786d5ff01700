"""The planner: its cost model's optimality, budgets, calibration, plans."""

import dataclasses
import math

import numpy as np
import pytest

from tfremat import planner
from tfremat.planner import Segment
from conftest import random_costs


def _all_plans(n, start=0, policies=()):
  """Every plan: kept layers and rematerialized runs of any length, fully
  or under each policy."""
  if start == n:
    yield []
    return
  for rest in _all_plans(n, start + 1, policies):
    yield [Segment(start, start + 1, False)] + rest
  for stop in range(start + 1, n + 1):
    for rest in _all_plans(n, stop, policies):
      for policy in (None,) + tuple(policies):
        yield [Segment(start, stop, True, policy)] + rest


def _with_policies(rng, costs, names):
  """`costs` with random per-policy kept bytes and recompute times: a policy
  keeps part of what the layer saves and recomputes part of its forward."""
  out = []
  for c in costs:
    policy_costs = {}
    for name in names:
      share = float(rng.uniform(0, 1))
      policy_costs[name] = [int(share * (c.saved_bytes + c.output_bytes)),
                            float((1 - share) * rng.uniform(0.5, 1.2) *
                                  c.forward_seconds)]
    out.append(dataclasses.replace(c, policy_costs=policy_costs))
  return out

@pytest.mark.parametrize("seed", range(8))
def test_plan_is_the_fastest_feasible_choice_by_exhaustive_search(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 11))
  costs = random_costs(rng, n)
  predictions = [planner.predict(costs, p) for p in _all_plans(n)]
  low = min(peak for peak, _ in predictions)
  high = max(peak for peak, _ in predictions)
  for fraction in (0.0, 0.2, 0.5, 0.8, 1.0):
    budget = int(low + fraction * (high - low))
    best = min(t for peak, t in predictions if peak <= budget)
    chosen = planner.plan(costs, budget)
    assert chosen.peak_bytes <= budget
    assert chosen.seconds == pytest.approx(best, rel=1e-12)
  assert planner.smallest_budget(costs) == low
  assert planner.MEASUREMENT_SLACK == 1.05  # The allowance.

@pytest.mark.parametrize("seed", range(6))
def test_policy_plans_are_the_fastest_by_exhaustive_search(seed):
  # Per segment: keep, rematerialize fully, or under each policy.
  rng = np.random.default_rng(100 + seed)
  n = int(rng.integers(2, 6))
  names = ("dots_saveable", "masks_saveable")
  costs = _with_policies(rng, random_costs(rng, n), names)
  assert planner.segment_policies(costs) == names
  plans = list(_all_plans(n, policies=names))
  predictions = [planner.predict(costs, p) for p in plans]
  low = min(peak for peak, _ in predictions)
  high = max(peak for peak, _ in predictions)
  used = set()
  for fraction in (0.0, 0.1, 0.3, 0.5, 0.8, 1.0):
    budget = int(low + fraction * (high - low))
    best = min(t for peak, t in predictions if peak <= budget)
    chosen = planner.plan(costs, budget)
    assert chosen.peak_bytes <= budget
    assert chosen.seconds == pytest.approx(best, rel=1e-12)
    used |= {s.policy for s in chosen.segments if s.remat}
  assert planner.smallest_budget(costs) == low
  # Without policies measured, plans are as before.
  plain = [dataclasses.replace(c, policy_costs={}) for c in costs]
  assert planner.segment_policies(plain) == ()


def test_policy_segments_cost_what_the_model_says():
  c = planner.LayerCost("l", forward_seconds=1.0, backward_seconds=2.0,
                        input_bytes=10, output_bytes=10, saved_bytes=100,
                        forward_transient_bytes=0, backward_transient_bytes=0,
                        weight_grad_bytes=0,
                        policy_costs={"dots_saveable": [40, 0.25]})
  # The first layer kept, rematerialized, or rematerialized under the
  # policy; the second kept: its backward pass runs while the first's
  # retained bytes are held.
  keep, full, dots = (
      planner.predict([c, c], [first, Segment(1, 2, False)])
      for first in (Segment(0, 1, False), Segment(0, 1, True),
                    Segment(0, 1, True, "dots_saveable")))
  assert (keep[1], full[1], dots[1]) == (6.0, 7.0, 6.25)
  assert full[0] < dots[0] < keep[0]
  assert dots[0] - full[0] == 40  # What the policy keeps.
  plan = planner.Plan([c], [Segment(0, 1, True, "dots_saveable")])
  assert "remat 0: dots" in str(plan)
  again = planner.Plan.from_config(plan.get_config())
  assert again.segments == plan.segments and str(again) == str(plan)


def test_impossible_budget_names_the_smallest_that_works():
  costs = random_costs(np.random.default_rng(3), 6)
  need = planner.smallest_budget(costs)
  with pytest.raises(ValueError, match=f"smallest budget that works for "
                     f"this chain is {need} bytes"):
    planner.plan(costs, need - 1)
  assert planner.plan(costs, need).peak_bytes <= need

def test_full_budget_rematerializes_nothing_and_plan_prints():
  costs = random_costs(np.random.default_rng(4), 5)
  keep = planner.keep_all(5)
  chosen = planner.plan(costs, planner.predict(costs, keep)[0])
  assert chosen.rematerialized == [False] * 5
  assert chosen.seconds == pytest.approx(planner.predict(costs, keep)[1])
  text = str(planner.plan(costs, planner.smallest_budget(costs)))
  assert "remat segment" in text and "cost model's peak" in text
  assert len(text.splitlines()) == 5 + 1 + 3  # Header, layers, 3 summaries.

def test_long_segments_pay_for_waiting_recomputes():
  costs = [dataclasses.replace(c, waiting_recompute_seconds=0.25 * (i + 1))
           for i, c in enumerate(random_costs(np.random.default_rng(5), 3))]
  singles = planner.predict(costs, planner.uniform_segments(3, 3))[1]
  whole = planner.predict(costs, planner.uniform_segments(3, 1))[1]
  # Layers 0 and 1 wait for the later recomputes; the last does not.
  assert whole - singles == pytest.approx(0.25 + 0.5)
  # Without that cost the two do the same work.
  plain = [dataclasses.replace(c, waiting_recompute_seconds=0.0)
           for c in costs]
  assert planner.predict(plain, planner.uniform_segments(3, 1))[1] == (
      pytest.approx(planner.predict(plain, planner.uniform_segments(3, 3))[1]))

@pytest.mark.parametrize("error,keep_error", [(0.9, 0.9), (1.1, 1.1),
                                               (1.1, 1.0)])
def test_calibrated_plan_corrects_the_model_by_measurement(error, keep_error):
  # A stand-in allocator whose peaks are the model's times `error` (times
  # `keep_error` for keeping everything). 0.9: a model that predicts too much
  # (it would rematerialize more than needed); 1.1: too little (its plans
  # would break the budget); 1.1 with 1.0: a calibration that misleads.
  costs = random_costs(np.random.default_rng(6), 8)

  def measured_peak(segments):
    remat = any(s.remat for s in segments)
    peak = planner.predict(costs, segments)[0]
    return int((error if remat else keep_error) * peak)

  keep_peak = planner.predict(costs, planner.keep_all(8))[0]
  for fraction in np.linspace(0.3, 0.95, 14):
    budget = int(fraction * keep_error * keep_peak)
    chosen = planner.calibrated_plan(costs, budget, measured_peak)
    # The fastest plan whose stand-in peak fits.
    best = planner.plan(costs, budget / error)
    assert chosen.measured_peak_bytes <= budget, (fraction, str(chosen))
    assert chosen.seconds == pytest.approx(best.seconds, rel=1e-12), fraction
  if error == keep_error:
    need = planner.smallest_budget(costs) * error
    with pytest.raises(ValueError, match="smallest budget that works for "
                       f"this chain is about {math.ceil(need)} bytes"):
      planner.calibrated_plan(costs, int(need) - 2, measured_peak)

# Issue "Keras and Lingvo users' first hour" [5]: budgets a person can give.

@pytest.mark.parametrize("given,num_bytes,fraction", [
    (200 * 2**20, 200 * 2**20, None), (np.int64(4096), 4096, None),
    ("200MiB", 200 * 2**20, None), ("1.5 GB", 1_500_000_000, None),
    ("64kib", 65536, None), ("4096", 4096, None),
    (0.5, None, 0.5), (np.float32(0.25), None, 0.25), (1.0, None, 1.0),
    ("50%", None, 0.5), (" 100 % ", None, 1.0)])
def test_budget_reads_bytes_units_fractions_and_percentages(
    given, num_bytes, fraction):
  budget = planner.Budget.parse(given)
  assert (budget.num_bytes, budget.fraction) == (num_bytes, fraction)
  keep = 1000
  assert budget.bytes_given(keep) == (
      num_bytes if num_bytes is not None else int(fraction * keep))

def _stand_in(costs, error=1.0):
  """A measured peak: the model's times `error`."""
  return lambda segments: int(error * planner.predict(costs, segments)[0])

@pytest.mark.parametrize("given", [0.5, "50%"])
def test_fraction_budget_is_of_the_measured_keep_everything_peak(given):
  costs = random_costs(np.random.default_rng(6), 8)
  measured_peak = _stand_in(costs, error=1.1)
  keep_peak = measured_peak(planner.keep_all(len(costs)))
  chosen = planner.calibrated_plan(costs, given, measured_peak)
  assert chosen.budget_bytes == int(0.5 * keep_peak)
  assert chosen.measured_keep_peak_bytes == keep_peak
  assert chosen.measured_peak_bytes <= chosen.budget_bytes
  assert "50% of the measured peak of keeping everything" in str(chosen)

def test_plan_printout_compares_measured_with_measured_and_says_which():
  # The old printout put the model's peak (above the budget) beside the
  # measured one (below it) and named two different "no remat" peaks.
  costs = random_costs(np.random.default_rng(7), 4)
  segments = planner.uniform_segments(4, 2)
  chosen = planner.Plan(costs, segments)
  chosen.budget_bytes = int(0.9 * chosen.peak_bytes)  # Model: over.
  chosen.budget = planner.Budget.parse(0.4)
  chosen.measured_peak_bytes = int(0.8 * chosen.peak_bytes)  # Measured: in.
  chosen.measured_keep_peak_bytes = 2 * chosen.measured_peak_bytes
  summary = str(chosen).splitlines()[5:]
  assert summary[0].startswith("budget") and "40% of the measured peak" in summary[0]
  assert summary[1].startswith("measured peak")
  assert "within the budget" in summary[1]
  assert "0.50x of keeping everything, measured" in summary[1]
  assert summary[2].startswith("cost model's peak") and "by the model" in (
      summary[2])
  assert summary[3].startswith("cost model's time")
  assert "chosen on its measured peak" in summary[4]
  assert "no remat" not in str(chosen)
  chosen.measured_peak_bytes = chosen.budget_bytes + 1
  assert "over the budget, within the 5% allowance" in str(chosen)
