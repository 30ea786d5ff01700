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
fronts; `calibrated_plan` checks its choices against measured peaks.
Recursive schedules (rematerializing inside a rematerialized segment) are
not searched; before a budget is refused, the lowest plan is measured with
its layers' own layers rematerialized inside their reruns (`Segment.nested`,
`calibrated_plan`).
"""

import dataclasses
import functools
import math
import re
import numpy as np

from tfremat import errors
from tfremat import measure
from tfremat import policies as policies_lib

__all__ = [
    "Measured",
    "LayerCost",
    "Segment",
    "Budget",
    "Plan",
    "plan",
    "calibrated_plan",
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
  graph executor's threads order independent ops differently). The margin
  covers what moves from process to process: TensorFlow's BFC allocator
  (on the CPU here, and on GPUs) counts a tensor placed in a free chunk
  less than twice its size as the whole chunk, and which chunks are free
  depends on everything the process did before. A step's peak can move by
  that rounding of the tensors it holds, so the margin is a fraction of the
  plan's own largest peak (`ALLOCATOR_MARGIN`).

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
# own measured peak (`Measured`): what one plan's peak moved by between the
# process that planned it and fresh processes that loaded it, beyond the
# spread of its calls (docs/design.md, "Budgets that hold"). A budget at
# 1.25x the lowest plan's peak is then planned wherever that plan's calls
# spread by less than 10% of it. Set it to 0 to plan on this process's
# measurements alone.
ALLOCATOR_MARGIN = 0.12


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """What one layer of a chain costs in a training step.

  Attributes:
    name: the layer's name.
    forward_seconds: one forward call, training mode.
    backward_seconds: the gradient computation alone (forward + backward
      minus forward).
    input_bytes: its input (the previous layer's output).
    output_bytes: its output.
    saved_bytes: what its forward pass keeps for its backward pass beyond its
      output, when it is not rematerialized.
    forward_transient_bytes: the forward pass's peak above its inputs,
      output and saved tensors.
    backward_transient_bytes: the backward pass's peak above what it holds
      (saved tensors, output, incoming and outgoing gradients, weight
      gradients).
    weight_grad_bytes: its weight gradients (held until the step ends).
    waiting_recompute_seconds: what its recompute costs beyond
      `forward_seconds` when it is not the last layer of a rematerialized
      segment, so that its recomputed tensors wait while the later layers'
      are recomputed (measured chain-wide by `measure_chain`).
    policy_costs: per save policy name (`tfremat.policies.PLANNED`), a pair
      [kept bytes, recompute seconds]: what the layer's forward pass keeps
      under the policy when rematerialized (beyond its output), and what
      rematerializing it under the policy adds to a training step's time
      (measured, like the rest, by `measure_chain`).
    policy_keeps: per save policy name, what it keeps of this layer by
      kind, for printouts: "dots", "masks", "softmax", other op types joined
      with "+", or "nothing" (a softmax policy on a layer without softmax).
  """
  name: str
  forward_seconds: float
  backward_seconds: float
  input_bytes: int
  output_bytes: int
  saved_bytes: int
  forward_transient_bytes: int
  backward_transient_bytes: int
  weight_grad_bytes: int
  waiting_recompute_seconds: float = 0.0
  policy_costs: dict = dataclasses.field(default_factory=dict)
  policy_keeps: dict = dataclasses.field(default_factory=dict)

  def recompute_seconds(self, policy=None):
    """What rematerializing this layer adds to a step (before waiting)."""
    if policy is None:
      return self.forward_seconds
    return self.policy_costs[policy][1]

  def kept_bytes(self, policy=None):
    """What a rematerialized forward pass keeps beyond its output."""
    return 0 if policy is None else self.policy_costs[policy][0]


@dataclasses.dataclass(frozen=True)
class Segment:
  """Layers [start, stop) of the chain, rematerialized or kept.

  `policy` is the save policy a rematerialized segment runs under
  (`tfremat.policies`: a built-in's name, or a policy value such as
  `save_only_these_names(...)`), or None: everything is recomputed.
  `nested`, for a rematerialized segment: each of its layers' own layers
  (one level down, as `tfremat.remat_in_place(..., nested=True)` takes them;
  for a unit that wraps one layer, that layer's: `tfremat.chain.nest_target`)
  are rematerialized too, inside the segment's rerun, under the same policy.
  The cost model does not model nesting: it predicts a nested segment as
  the same segment not nested.
  """
  start: int
  stop: int
  remat: bool
  policy: object = None
  nested: bool = False

  def __post_init__(self):
    if isinstance(self.policy, dict):  # A policy's config, as saved.
      object.__setattr__(self, "policy",
                         policies_lib.deserialize(self.policy))

  def as_list(self):
    """[start, stop, remat], then the policy (`tfremat.policies.serialize`)
    if there is one, and True if nested (after the policy, None if there
    is none): JSON-able."""
    items = [self.start, self.stop, self.remat]
    policy = policies_lib.serialize(self.policy)
    if self.nested:
      return items + [policy, True]
    return items + [policy] if policy is not None else items


_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10,
          "mib": 2**20, "gib": 2**30}
_BUDGET_FORMS = (
    "bytes as an int (200 * 2**20), a string with a unit (\"200MiB\", "
    "\"1.5GB\"), or a fraction of the measured keep-everything peak as a "
    "float in (0, 1] (0.5) or a percentage (\"50%\")")


@dataclasses.dataclass(frozen=True)
class Budget:
  """A memory budget for a training step's peak: `num_bytes`, or `fraction`
  of the measured peak of keeping everything. Made by `Budget.parse`."""
  num_bytes: int = None
  fraction: float = None

  @classmethod
  def parse(cls, value):
    """A Budget from what a person writes: 200 * 2**20, "200MiB", 0.5,
    "50%". Raises TypeError or ValueError naming the accepted forms."""
    if isinstance(value, Budget):
      return value
    if isinstance(value, (bool, np.bool_)):
      raise errors.InvalidTypeError(f"A budget is {_BUDGET_FORMS}; got {value!r}.")
    if isinstance(value, (int, np.integer)):
      if value <= 0:
        raise errors.InvalidArgumentError(f"A budget must be positive; got {value} bytes.")
      return cls(num_bytes=int(value))
    if isinstance(value, (float, np.floating)):
      if not 0 < value <= 1:  # Also NaN.
        raise errors.InvalidArgumentError(
            f"A float budget is a fraction of the keep-everything peak, in "
            f"(0, 1]; got {value!r}. Give bytes as an int or a string such as "
            "\"200MiB\".")
      return cls(fraction=float(value))
    if isinstance(value, str):
      match = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(%|[a-zA-Z]*)\s*",
                           value)
      unit = match and match.group(2).lower()
      if match and unit == "%":
        if not 0 < float(match.group(1)) <= 100:
          raise errors.InvalidArgumentError(
              f"A percentage budget must be in (0%, 100%]; got {value!r}.")
        return cls(fraction=float(match.group(1)) / 100)
      if match and unit in _UNITS or match and not unit:
        return cls.parse(int(float(match.group(1)) * _UNITS[unit or "b"]))
      raise errors.InvalidArgumentError(f"A budget is {_BUDGET_FORMS}; got {value!r}.")
    raise errors.InvalidTypeError(f"A budget is {_BUDGET_FORMS}; got {value!r}.")

  def bytes_given(self, keep_everything_bytes):
    """The budget in bytes, given the measured peak of keeping everything."""
    if self.num_bytes is not None:
      return self.num_bytes
    return int(self.fraction * keep_everything_bytes)

  def __str__(self):
    if self.num_bytes is not None:
      return measure.format_bytes(self.num_bytes)
    return f"{self.fraction:.0%} of the keep-everything peak"


def _segment_terms(costs, seg):
  """(peak above retained-before, retained after, seconds) of one segment.

  The peak term excludes the bytes retained by earlier segments and the
  weight gradients of later layers, which `predict` adds.
  """
  layers = costs[seg.start:seg.stop]
  policy = seg.policy if seg.remat else None
  peak, held, kept = 0, 0, 0
  # Forward.
  for i, c in enumerate(layers):
    if seg.remat:
      # Only the previous in-segment output is live while this layer runs,
      # and what the policy kept of the earlier ones.
      prev = layers[i - 1].output_bytes if i else 0
      peak = max(peak, kept + prev + c.output_bytes + c.saved_bytes +
                 c.forward_transient_bytes)
      kept += c.kept_bytes(policy)
    else:
      peak = max(peak, held + c.output_bytes + c.saved_bytes +
                 c.forward_transient_bytes)
      held += c.output_bytes + c.saved_bytes
  retained = held if not seg.remat else layers[-1].output_bytes + kept
  # Backward: recompute first when rematerialized; the segment's incoming
  # gradient is live from then on, and so is what the policy kept.
  dy = layers[-1].output_bytes
  held = 0
  for c in layers:
    if seg.remat:
      # What the policy kept of this and later layers is live too; what it
      # kept of earlier ones is now part of `held`.
      kept -= c.kept_bytes(policy)
      peak = max(peak, kept + dy + held + c.output_bytes + c.saved_bytes +
                 c.forward_transient_bytes)
    held += c.output_bytes + c.saved_bytes
  grads = 0
  for c in reversed(layers):
    peak = max(peak, held + c.output_bytes + c.input_bytes + grads +
               c.weight_grad_bytes + c.backward_transient_bytes)
    held -= c.output_bytes + c.saved_bytes
    grads += c.weight_grad_bytes
  seconds = sum(c.forward_seconds + c.backward_seconds for c in layers)
  if seg.remat:
    seconds += sum(c.recompute_seconds(policy) for c in layers)
    # Waiting grows with what is recomputed: scaled by the policy's share.
    seconds += sum(
        c.waiting_recompute_seconds *
        min(1.0, c.recompute_seconds(policy) / max(c.forward_seconds, 1e-12))
        for c in layers[:-1])
  return peak, retained, seconds


def _grads_after(costs):
  after, total = [0] * len(costs), 0
  for i in range(len(costs) - 1, -1, -1):
    after[i] = total
    total += costs[i].weight_grad_bytes
  return after


def predict(costs, segments):
  """The cost model: (peak bytes, seconds) of a training step under a plan."""
  check_segments(segments, len(costs))
  after = _grads_after(costs)
  peak, retained, seconds = 0, 0, 0.0
  for seg in segments:
    seg_peak, seg_retained, seg_seconds = _segment_terms(costs, seg)
    peak = max(peak, retained + after[seg.stop - 1] + seg_peak)
    retained += seg_retained
    seconds += seg_seconds
  # The loss's gradient arrives while everything retained is still held.
  peak = max(peak, retained + costs[-1].output_bytes)
  return peak, seconds


def check_segments(segments, n):
  """Raises ValueError unless `segments` cover layers [0, n) in order."""
  stops = [s.start for s in segments[1:]]
  if (not segments or segments[0].start != 0 or segments[-1].stop != n or
      [s.stop for s in segments[:-1]] != stops or
      any(s.stop <= s.start for s in segments)):
    raise errors.InvalidArgumentError(
        f"segments must cover layers 0..{n} in order without gaps; got "
        f"{segments}.")
  kept_nested = [s for s in segments if s.nested and not s.remat]
  if kept_nested:
    raise errors.InvalidArgumentError(
        f"Only a rematerialized segment can be nested (its layers' own "
        f"layers rematerialized inside its rerun); got {kept_nested}. Give "
        "remat=True, or nested=False.")


def segment_policies(costs):
  """The save policies measured for every layer of the chain."""
  if not costs:
    return ()
  shared = set(costs[0].policy_costs)
  for c in costs[1:]:
    shared &= set(c.policy_costs)
  return tuple(sorted(shared))


def _candidates(n, policies=()):
  """Segments worth considering: kept single layers, any remat range, fully
  or under each policy."""
  for start in range(n):
    yield Segment(start, start + 1, False)
    for stop in range(start + 1, n + 1):
      yield Segment(start, stop, True)
      for policy in policies:
        yield Segment(start, stop, True, policy)


def _segment_table(costs):
  """Every candidate segment's `_segment_terms`, by its start: a list of
  [(segment, (peak, retained, seconds))] per start. Computed once per chain
  and shared by every budget searched."""
  table = [[] for _ in costs]
  for seg in _candidates(len(costs), segment_policies(costs)):
    table[seg.start].append((seg, _segment_terms(costs, seg)))
  return table


def _fastest(costs, budget, table=None):
  """The fastest plan with predicted peak <= budget, or None. `table`:
  `_segment_table(costs)`, if already computed."""
  n = len(costs)
  after = _grads_after(costs)
  table = _segment_table(costs) if table is None else table
  # fronts[i]: Pareto-optimal (retained, seconds, segments) at position i.
  fronts = [[] for _ in range(n + 1)]
  fronts[0] = [(0, 0.0, ())]
  for start in range(n):
    front = sorted(fronts[start], key=lambda s: (s[0], s[1]))
    pruned, best = [], math.inf
    for state in front:  # Keep states that are faster than any with less R.
      if state[1] < best:
        pruned.append(state)
        best = state[1]
    for retained, seconds, segs in pruned:
      for seg, (seg_peak, seg_retained, seg_seconds) in table[start]:
        if retained + after[seg.stop - 1] + seg_peak > budget:
          continue
        fronts[seg.stop].append((retained + seg_retained,
                                 seconds + seg_seconds, segs + (seg,)))
  finals = [(seconds, segs) for retained, seconds, segs in fronts[n]
            if retained + costs[-1].output_bytes <= budget]
  return min(finals, key=lambda f: f[0])[1] if finals else None


def _fits(costs, budget, table):
  """Whether some plan's predicted peak is within `budget`."""
  return _least_retained(costs, budget, table) is not None


def _least_retained(costs, budget, table):
  """The plan within `budget` (predicted) that retains the fewest bytes
  between its segments' forward and backward passes (then the fastest of
  those), or None when no plan fits.

  Less retained is never worse for what follows, so the best state at each
  position, over plans within the budget so far, decides: one per position
  instead of `_fastest`'s (retained, time) fronts. Each state names the
  segment that reached it; the plan is read back from the end.
  """
  after = _grads_after(costs)
  best = [None] * (len(costs) + 1)  # (retained, seconds, last segment)
  best[0] = (0, 0.0, None)
  for start, candidates in enumerate(table):
    if best[start] is None:
      continue
    retained, seconds, _ = best[start]
    for seg, (seg_peak, seg_retained, seg_seconds) in candidates:
      if retained + after[seg.stop - 1] + seg_peak > budget:
        continue
      state = (retained + seg_retained, seconds + seg_seconds, seg)
      if best[seg.stop] is None or state[:2] < best[seg.stop][:2]:
        best[seg.stop] = state
  if best[-1] is None or best[-1][0] + costs[-1].output_bytes > budget:
    return None
  segments, stop = [], len(costs)
  while stop:
    segments.append(best[stop][2])
    stop = segments[-1].start
  return segments[::-1]


def lowest_plan(costs):
  """The plan the model predicts to peak lowest: every layer rematerialized
  alone if that is among them, else the one among them that retains the
  least elsewhere.

  Several plans often share the model's lowest peak, set by one layer's
  working set, but a measured step's peak is not always where the model
  puts it. Layers kept where the model sees room below that peak raise it
  (a 4-layer KerasHub GemmaBackbone: its fastest plan at the floor peaked at
  0.41x of keeping everything, every layer rematerialized alone at 0.34x),
  and so do long rematerialized segments, which retain less but rerun more
  at once (MobileNetV2 at 64x64, batch 8: 29.0 MiB with 5 segments over its
  9 parts, 21.8 MiB with every part alone, both at the model's floor). So
  the plan measured last, before a budget is refused, is this one.
  """
  table = _segment_table(costs)
  need = smallest_budget(costs, table)
  alone = uniform_segments(len(costs), len(costs))
  if predict(costs, alone)[0] <= need:
    return Plan(costs, alone, need)
  return Plan(costs, _least_retained(costs, need, table), need)


def smallest_budget(costs, table=None):
  """The smallest budget (bytes) for which some plan fits. `table`:
  `_segment_table(costs)`, if already computed."""
  table = _segment_table(costs) if table is None else table
  lo, hi = 0, predict(costs, [Segment(0, len(costs), False)])[0]
  hi = max(hi, predict(costs, uniform_segments(len(costs), len(costs)))[0])
  while lo < hi:
    mid = (lo + hi) // 2
    if not _fits(costs, mid, table):
      lo = mid + 1
    else:
      hi = mid
  return lo


# Short names of the built-in policies, for printouts.
_SHORT = {
    "dots_saveable": "dots",
    "dots_with_no_batch_dims_saveable": "dots/nobatch",
    "masks_saveable": "masks",
    "dots_and_masks_saveable": "dots+masks",
    "dots_with_no_batch_dims_and_masks_saveable": "dots/nob+masks",
    "softmax_saveable": "softmax",
    "masks_and_softmax_saveable": "masks+softmax",
    "dots_masks_and_softmax_saveable": "dots+masks+softmax",
    "dots_with_no_batch_dims_masks_and_softmax_saveable":
        "dots/nob+masks+softmax",
}


def short_policy_name(policy):
  """A built-in policy's short name for tables, e.g. "dots+masks"."""
  return _SHORT.get(policy, policy)


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

  def _layer_rows(self):
    mib = measure.format_bytes
    rows = [f"{'layer':<24}{'decision':<36}{'stored':>11}{'output':>11}"
            f"{'fwd ms':>9}{'wait ms':>9}"]
    for k, seg in enumerate(self.segments):
      for i in range(seg.start, seg.stop):
        c = self.costs[i]
        if not seg.remat:
          what, stored = "keep", c.saved_bytes
        else:
          what = f"remat {k}" + (", nested" if seg.nested else "")
          if seg.policy:
            keeps = c.policy_keeps.get(seg.policy)
            what += (f", keeps {keeps}" if keeps else
                     f", {short_policy_name(seg.policy)}")
          stored = c.kept_bytes(seg.policy)
        rows.append(f"{c.name[:23]:<24}{what:<36}{mib(stored):>11}"
                    f"{mib(c.output_bytes):>11}"
                    f"{1000 * c.forward_seconds:>9.2f}"
                    f"{1000 * c.waiting_recompute_seconds:>9.2f}")
    return rows

  def _summary_rows(self):
    # Measured figures are compared with measured ones, the cost model's with
    # the cost model's, and every line says which it is.
    mib, rows = measure.format_bytes, []
    keep = self.measured_keep_peak_bytes
    if self.budget_bytes is not None:
      given = ""
      if self.budget is not None and self.budget.fraction is not None:
        given = (f"{self.budget.fraction:.0%} of the measured peak of keeping "
                 "everything" + (f" ({mib(keep)})" if keep else ""))
      rows.append(("budget", mib(self.budget_bytes), given))
    if self.measured is not None:
      m = self.measured
      versus = (f"; {m.peak_bytes / keep:.2f}x of keeping everything's"
                if keep else "")
      rows.append(("measured peak", mib(m.peak_bytes),
                   f"the largest of {m.calls} calls{versus}"))
      verdict = ""
      if self.budget_bytes is not None:
        verdict = ("; within the budget" if m.bound_bytes <= self.budget_bytes
                   else "; over the budget")
      margin = (f" + allocator margin ({mib(m.margin_bytes)})"
                if m.margin_bytes else "")
      rows.append(("bound", mib(m.bound_bytes),
                   f"for every later call: largest + spread of the {m.calls} "
                   f"calls{margin}{verdict}"))
    if self.ordered:
      rows.append(("order", "ordered", "the chain's ops run in one order "
                   "(no unordered plan measured fits the budget)"))
    rows.append(("cost model's peak", mib(self.peak_bytes),
                 f"{self.peak_bytes / self.baseline_peak_bytes:.2f}x of "
                 f"keeping everything, by the model "
                 f"({mib(self.baseline_peak_bytes)})"))
    rows.append(("cost model's time", f"{1000 * self.seconds:.1f} ms",
                 f"{100 * (self.seconds / self.baseline_seconds - 1):+.1f}% "
                 "over keeping everything, by the model"))
    return [f"{name:<19}{value:>11}  {note}".rstrip()
            for name, value, note in rows]

  def __str__(self):
    return "\n".join(self._layer_rows() + self._summary_rows() + [LEGEND])


LEGEND = """\
decision: keep (the layer's activations are stored for the backward pass) or
  remat k (segment k's layers rerun in the backward pass; only its last
  output is stored, and what its save policy keeps, if one is named: "keeps
  dots" are matrix products and convolutions, "masks" dropout masks;
  "nested": the layer's own layers are rematerialized inside its rerun, one
  working set at a time; the cost model counts it as not nested).
stored: what the layer stores for the backward pass under this decision,
  beyond its output. output: its output. fwd ms: one forward call (what
  rerunning it costs). wait ms: what its rerun adds when it waits for later
  layers of its segment to rerun. Structurally identical layers are measured
  once and share their figures. The cost model's figures are estimates; a
  plan is chosen on its measured bound."""


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


def calibrated_plan(costs, budget, measured_peak, rounds=4, nestable=None,
                    gradient_bytes=0, measured_ordered=None):
  """The plan for `budget`, chosen on measured peaks, not on the model alone.

  The cost model's peaks are estimates, above the measured ones on some
  chains and below on others (docs/benchmarks.md, "Measurements behind the
  defaults"). A model that is too high costs
  time (more is rematerialized than needed); one that is too low breaks the
  budget. So:

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
     that fits.
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
    costs: the chain's LayerCosts.
    budget: a Budget, or what `Budget.parse` reads; a fraction is of the
      measured peak of keeping everything.
    measured_peak: segments -> the measured peaks of a training step of the
      chain under them: a list of per-call peaks, a `Measured`, or one int
      (`tfremat.chain.checked_plan` measures).
    rounds: how many plans to measure at most, besides keeping everything
      and, before refusing, the lowest plan (steps 4 and 5).
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
  budget = Budget.parse(budget)
  keep = Plan(costs, keep_all(len(costs)))
  keep = keep.replace(measured=Measured.with_margin(
      measured_peak(keep.segments)))
  budget_bytes = budget.bytes_given(keep.measured.peak_bytes)
  error = gradients_floor_error(budget, keep.measured, gradient_bytes)
  if error is not None:
    raise error
  ordered = (None if measured_ordered is None else
             lambda s: Measured.with_margin(measured_ordered(s)))
  chosen = _calibrated(costs, keep, budget, budget_bytes,
                       lambda s: Measured.with_margin(measured_peak(s)),
                       rounds, nestable, ordered)
  return chosen.replace(budget=budget, budget_bytes=budget_bytes,
                        measured_keep=keep.measured)


def _calibrated(costs, keep, budget, budget_bytes, measured_peak, rounds,
                nestable=None, measured_ordered=None):
  """`calibrated_plan`'s search, from the measured keep-everything plan."""
  # Keeping everything is the fastest plan; use it whenever it really fits,
  # whatever the model predicts, and for 100% of itself.
  if (keep.measured.bound_bytes <= budget_bytes or
      (budget is not None and budget.fraction == 1.0)):
    return keep
  # Each plan's margin is a fraction of its own peak: the room for peaks.
  room = peak_for_bound(budget_bytes)
  aim = int(room * (1 - AIM_BELOW))
  scale = keep.peak_bytes / max(
      1, keep.measured.bound_bytes - keep.measured.margin_bytes)
  target, tried = int(aim * scale), {}
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
    fastest = min((p.seconds for p in tried.values()
                   if p.measured.bound_bytes <= budget_bytes), default=None)
    if (fastest is not None and
        chosen.seconds > fastest - FASTER_BY * keep.seconds):
      break  # Not worth measuring: too little faster than one that fits.
    chosen = chosen.replace(measured=measured_peak(chosen.segments))
    tried[key] = chosen
    # Recalibrate: the target at which the model's peak, scaled by this
    # plan's measured bound / predicted peak (less margin), meets the aim.
    bound = max(1, chosen.measured.bound_bytes - chosen.measured.margin_bytes)
    scaled = int(chosen.peak_bytes * aim / bound)
    if chosen.measured.bound_bytes > budget_bytes:
      target = min(scaled, chosen.peak_bytes - 1)  # Below this plan.
    elif scaled > target:
      target = scaled  # Room left: try a faster plan.
    else:
      break  # It fits, and no faster plan is predicted to.
  fitting = _fitting(tried, keep, budget_bytes)
  if not fitting:
    fitting = _lowest_fitting(costs, tried, keep, budget_bytes,
                              measured_peak, floor_plan(), nestable,
                              measured_ordered)
  if fitting:
    return min(fitting, key=lambda p: p.seconds)
  lowest = min(tried.values(), key=lambda p: p.measured.bound_bytes)
  raise unreachable_budget_error(costs, budget, budget_bytes,
                                 keep.measured.peak_bytes, lowest.measured)


def _lowest_fitting(costs, tried, keep, budget_bytes, measured_peak, floor,
                    nestable, measured_ordered=None):
  """Before refusing: `floor`, the plan the model predicts to peak lowest,
  if the rounds did not get down to it (plans near the budget measured over
  it, and each round lowered the target only a little); then, if it does
  not fit, the same plan nested, lower still and slower. With
  `measured_ordered`, each is also tried ordered, right after it is tried
  unordered. Measures into `tried`; returns the plans that fit."""
  for segments in (floor.segments, _nested(floor.segments, nestable)):
    if not segments:
      continue
    tries = [(False, measured_peak)]
    if measured_ordered is not None:
      tries.append((True, measured_ordered))
    for ordered, measure_it in tries:
      key = (tuple(segments), ordered) if ordered else tuple(segments)
      if key in tried:
        continue
      tried[key] = Plan(costs, segments, ordered=ordered,
                        measured=measure_it(segments))
      fitting = _fitting(tried, keep, budget_bytes)
      if fitting:
        return fitting
  return []


def _nested(segments, nestable):
  """`segments` with every nestable layer rematerialized and nested: a
  rematerialized segment holding one is nested, a kept one is
  rematerialized and nested (the lowest plan may keep a layer whose working
  set the model sees as the peak anyway, which nesting would lower). None if
  no layer is nestable."""
  if not nestable or not any(nestable):
    return None
  nested = []
  for s in segments:
    if any(nestable[s.start:s.stop]):  # A kept segment is one layer.
      s = (dataclasses.replace(s, nested=True) if s.remat else
           Segment(s.start, s.stop, True, None, True))
    nested.append(s)
  return nested


def _fitting(tried, keep, budget_bytes):
  """The measured plans whose bound fits, never above keeping everything's
  peak (such a plan is never worth its time)."""
  return [p for p in tried.values()
          if p.measured.bound_bytes <= budget_bytes and
          p.measured.peak_bytes <= keep.measured.peak_bytes]


def floor_terms(costs):
  """What a training step holds however much is rematerialized, by the cost
  model: (description, bytes) pairs, largest first."""
  def working_set(c):
    return (c.saved_bytes + c.output_bytes +
            max(c.forward_transient_bytes, c.backward_transient_bytes))

  grads = sum(c.weight_grad_bytes for c in costs)
  ends = costs[0].input_bytes + costs[-1].output_bytes
  widest = max(costs, key=working_set)
  terms = [("the weight gradients", grads),
           ("the chain's input and output (and their gradients)", 2 * ends),
           (f"one layer's working set while it reruns ({widest.name})",
            working_set(widest))]
  return sorted(terms, key=lambda t: -t[1])


def unreachable_budget_error(costs, budget, budget_bytes, keep_peak, lowest):
  """The ValueError for a budget below `lowest`, the lowest bound measured:
  bytes, or that plan's `Measured`, whose parts the message then gives."""
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
  terms = "; ".join(f"{what}: {mib(n)}" for what, n in floor_terms(costs))
  return errors.BudgetUnreachableError.of(
      f"No rematerialization plan fits a budget of {asked}{mib(budget_bytes)}:"
      f" the lowest bound measured is {mib(lowest)}, "
      f"{lowest / max(1, keep_peak):.0%} of the "
      f"measured keep-everything peak ({mib(keep_peak)}){parts}. What every "
      f"plan holds, by the cost model: {terms}. Raise the budget to at least "
      f"{lowest / max(1, keep_peak):.0%}, or shrink the batch or the widest "
      "layer.", lowest, keep_peak)


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
  segments = _fastest(costs, budget_bytes)
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


def keep_all(num_layers):
  """The plan that rematerializes nothing."""
  return [Segment(i, i + 1, False) for i in range(num_layers)]


def uniform_segments(num_layers, segments):
  """`segments` (an int, or "sqrt") equal rematerialized segments."""
  if segments == "sqrt":
    segments = max(1, round(math.sqrt(num_layers)))
  if (not isinstance(segments, int) or isinstance(segments, bool) or
      not 1 <= segments <= max(1, num_layers)):
    raise errors.InvalidArgumentError(
        f"segments must be an int from 1 to the number of layers "
        f"({num_layers}) or \"sqrt\"; got {segments!r}.")
  bounds = [round(i * num_layers / segments) for i in range(segments + 1)]
  return [Segment(lo, hi, True) for lo, hi in zip(bounds, bounds[1:])]
