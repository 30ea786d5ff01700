"""The planner's cost model: what each layer of a chain costs, at the
sample's shape and, through how each cost grows (`growth.Rows`), at any
other; the plans (segments) a chain can run under; and the exact search for
the fastest plan whose predicted peak fits a number of bytes. `predict`
computes with numbers, or with `Rows` (`LayerCost.symbolic`): a plan's
peak at every shape, as a few polynomials of the input's axis ratios.

Pure: it computes with measured costs and never measures. Its public names
are `tfremat.planner`'s; `tfremat.planner` holds plans, their measured
bounds and the budget search.
"""

import dataclasses
import re

import numpy as np

from tfremat import errors
from tfremat._src.core import policies as policies_lib
from tfremat._src import units
from tfremat._src.keras_api.segments import Segment
from tfremat._src.keras_api.segments import check_segments
from tfremat._src.keras_api.segments import keep_all
from tfremat._src.keras_api.segments import policy_of
from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning import growth as growth_lib
from tfremat._src.planning.growth import Rows
from tfremat._src.planning.growth import maximum

__all__ = [
    "LayerCost",
    "Segment",
    "Budget",
    "predict",
    "check_segments",
    "segment_policies",
    "segment_table",
    "fastest",
    "fits",
    "least_retained",
    "smallest_budget",
    "keep_all",
    "uniform_segments",
    "floor_terms",
    "nested_segments",
]

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
    policy_costs: per save policy (`tfremat.policies.PLANNED`'s values), a pair
      [kept bytes, recompute seconds]: what the layer's forward pass keeps
      under the policy when rematerialized (beyond its output), and what
      rematerializing it under the policy adds to a training step's time
      (measured, like the rest, by `measure_chain`).
    policy_keeps: per save policy, what it keeps of this layer by
      kind, for printouts: "dots", "masks", "softmax", other op types joined
      with "+", or "nothing" (a softmax policy on a layer without softmax).
    growth: how its costs change with the input's shape, read from its
      traced step (`profile.measure_layer`): {byte field: `growth.Rows` of
      its bytes}, "saved_share" (normalized `Rows`: what a save policy
      keeps grows as the saved tensors) and "work" (normalized: its times).
      A field without rows grows in proportion to the input's size.
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
  growth: dict = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    # Keyed by policy values; a built-in's name given here is parsed.
    for field in ("policy_costs", "policy_keeps"):
      entries = getattr(self, field)
      if any(isinstance(p, str) for p in entries):
        object.__setattr__(self, field, {policy_of(p): value
                                         for p, value in entries.items()})

  def get_config(self):
    """A JSON-able dict (each policy serialized); `LayerCost.from_config`
    reads it back."""
    # Not dataclasses.asdict: it would turn each policy key into a dict.
    config = {field.name: getattr(self, field.name)
              for field in dataclasses.fields(self)}
    config["policy_costs"] = [[policies_lib.serialize(p), kept, seconds]
                              for p, (kept, seconds) in
                              self.policy_costs.items()]
    config["policy_keeps"] = [[policies_lib.serialize(p), kinds]
                              for p, kinds in self.policy_keeps.items()]
    config["growth"] = {k: v.get_config() for k, v in self.growth.items()}
    return config

  @classmethod
  def from_config(cls, config):
    """The LayerCost `get_config` described (or tfremat 0.1's config, whose
    policies are keyed by name)."""
    config = dict(config)
    for field in ("policy_costs", "policy_keeps"):
      entries = config.get(field) or []
      if isinstance(entries, dict):
        entries = [[name, *([value] if field == "policy_keeps" else value)]
                   for name, value in entries.items()]
      config[field] = {
          policy_of(entry[0]): (entry[1] if field == "policy_keeps" else
                                 list(entry[1:]))
          for entry in entries}
    config["growth"] = {k: Rows.from_config(v)
                        for k, v in (config.get("growth") or {}).items()}
    return cls(**config)

  def _grown(self, field, num_axes):
    """`Rows` of a field's bytes at every shape: its growth, or in
    proportion to the input's size over `num_axes` axes."""
    if field in self.growth:
      return self.growth[field]
    return growth_lib.PROPORTIONAL(num_axes) * getattr(self, field)

  def _share(self, name, num_axes):
    """Normalized `Rows` of "saved_share" or "work"."""
    return self.growth.get(name, growth_lib.PROPORTIONAL(num_axes))

  def symbolic(self, num_axes=1):
    """This layer's costs as `Rows` of the input's axis ratios (its times
    as they are; `num_axes` for a cost with no growth of its own):
    `predict` on them gives a plan's peak at every shape."""
    share = self._share("saved_share", num_axes)
    changes = {f: self._grown(f, num_axes) for f in _BYTE_FIELDS}
    changes["policy_costs"] = {p: [share * kept, seconds]
                               for p, (kept, seconds) in
                               self.policy_costs.items()}
    return dataclasses.replace(self, **changes)

  def at(self, ratios):
    """This layer's costs at a shape whose axes are `ratios` times the
    sample's (`growth.ratios`; axes left out: 1)."""
    ratios = tuple(ratios)
    n = len(ratios)
    time = self._share("work", n).at(ratios)
    kept = self._share("saved_share", n).at(ratios)
    changes = {f: int(max(0.0, self._grown(f, n).at(ratios)))
               for f in _BYTE_FIELDS}
    changes.update({f: getattr(self, f) * time for f in _SECOND_FIELDS})
    changes["policy_costs"] = {
        p: [int(k * kept), seconds * time]
        for p, (k, seconds) in self.policy_costs.items()}
    return dataclasses.replace(self, growth={}, **changes)

  def scaled(self, factor):
    """This layer's costs at `factor` times the sample's batch."""
    return self.at((factor,))

  def recompute_seconds(self, policy=None):
    """What rematerializing this layer adds to a step (before waiting)."""
    if policy is None:
      return self.forward_seconds
    return self.policy_costs[policy][1]

  def kept_bytes(self, policy=None):
    """What a rematerialized forward pass keeps beyond its output."""
    return 0 if policy is None else self.policy_costs[policy][0]


# LayerCost's fields that grow with the input's shape.
_BYTE_FIELDS = ("input_bytes", "output_bytes", "saved_bytes",
                "forward_transient_bytes", "backward_transient_bytes")
_SECOND_FIELDS = ("forward_seconds", "backward_seconds",
                  "waiting_recompute_seconds")


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
      return units.format_bytes(self.num_bytes)
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
      peak = maximum(peak, kept + prev + c.output_bytes + c.saved_bytes +
                 c.forward_transient_bytes)
      kept += c.kept_bytes(policy)
    else:
      peak = maximum(peak, held + c.output_bytes + c.saved_bytes +
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
      peak = maximum(peak, kept + dy + held + c.output_bytes + c.saved_bytes +
                 c.forward_transient_bytes)
    held += c.output_bytes + c.saved_bytes
  grads = 0
  for c in reversed(layers):
    peak = maximum(peak, held + c.output_bytes + c.input_bytes + grads +
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
    peak = maximum(peak, retained + after[seg.stop - 1] + seg_peak)
    retained += seg_retained
    seconds += seg_seconds
  # The loss's gradient arrives while everything retained is still held.
  peak = maximum(peak, retained + costs[-1].output_bytes)
  return peak, seconds


def segment_policies(costs):
  """The save policies measured for every layer of the chain."""
  if not costs:
    return ()
  return tuple(p for p in costs[0].policy_costs
               if all(p in c.policy_costs for c in costs[1:]))


def _candidates(n, policies=()):
  """Segments worth considering: kept single layers, any remat range, fully
  or under each policy."""
  for start in range(n):
    yield Segment(start, start + 1, False)
    for stop in range(start + 1, n + 1):
      yield Segment(start, stop, True)
      for policy in policies:
        yield Segment(start, stop, True, policy)


def segment_table(costs):
  """Every candidate segment's `_segment_terms`, by its start: a list of
  [(segment, (peak, retained, seconds))] per start. Computed once per chain
  and shared by every budget searched."""
  table = [[] for _ in costs]
  for seg in _candidates(len(costs), segment_policies(costs)):
    table[seg.start].append((seg, _segment_terms(costs, seg)))
  return table


def fastest(costs, budget, table=None):
  """The fastest plan with predicted peak <= budget, or None. `table`:
  `segment_table(costs)`, if already computed.

  A dynamic program over positions in the chain: the plans reaching each
  position, pruned to the (retained bytes, seconds) Pareto front, each
  extended by every segment starting there whose peak fits."""
  n = len(costs)
  after = _grads_after(costs)
  table = segment_table(costs) if table is None else table
  # reached[i]: chunks of plans reaching position i, each (retained,
  # seconds, where each came from: (position, index in its front, segment)).
  reached = [[] for _ in range(n + 1)]
  reached[0] = [(np.zeros(1), np.zeros(1), np.full((1, 3), -1))]
  fronts = [None] * (n + 1)
  for start in range(n + 1):
    if not reached[start]:
      continue
    retained, seconds, came = (np.concatenate(parts) for parts in
                               zip(*reached[start]))
    # Plans faster than every plan retaining as little or less.
    order = np.lexsort((seconds, retained))
    before = np.minimum.accumulate(np.concatenate([[np.inf],
                                                   seconds[order]]))[:-1]
    order = order[seconds[order] < before]
    fronts[start] = retained, seconds, came, order
    if start == n:
      break
    segs = table[start]
    peak, kept, cost, stops = (np.array(v) for v in zip(*(
        (p, r, s, seg.stop) for seg, (p, r, s) in segs)))
    r, s = retained[order], seconds[order]
    ok = (r[:, None] + np.array(after)[stops - 1][None, :]) + peak <= budget
    rows, cols = np.nonzero(ok)
    for stop in np.unique(stops[cols]):
      at = stops[cols] == stop
      i, j = rows[at], cols[at]
      reached[stop].append((r[i] + kept[j], s[i] + cost[j], np.stack(
          [np.full(len(i), start), order[i], j], axis=1)))
  if fronts[n] is None:
    return None
  retained, seconds, came, order = fronts[n]
  # Every plan reaching the end, in the order it was found.
  final = [i for i in range(len(retained))
           if retained[i] + costs[-1].output_bytes <= budget]
  if not final:
    return None
  i = min(final, key=lambda k: seconds[k])
  plan, at = [], n
  while at:
    start, index, j = fronts[at][2][i]
    plan.append(table[start][j][0])
    at, i = start, index
  return tuple(plan[::-1])


def fits(costs, budget, table):
  """Whether some plan's predicted peak is within `budget`."""
  return least_retained(costs, budget, table) is not None


def least_retained(costs, budget, table):
  """The plan within `budget` (predicted) that retains the fewest bytes
  between its segments' forward and backward passes (then the fastest of
  those), or None when no plan fits.

  Less retained is never worse for what follows, so the best state at each
  position, over plans within the budget so far, decides: one per position
  instead of `fastest`'s (retained, time) fronts. Each state names the
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


def smallest_budget(costs, table=None):
  """The smallest budget (bytes) for which some plan fits. `table`:
  `segment_table(costs)`, if already computed."""
  table = segment_table(costs) if table is None else table
  lo, hi = 0, predict(costs, [Segment(0, len(costs), False)])[0]
  hi = max(hi, predict(costs, uniform_segments(len(costs), len(costs)))[0])
  while lo < hi:
    mid = (lo + hi) // 2
    if not fits(costs, mid, table):
      lo = mid + 1
    else:
      hi = mid
  return lo


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


def nested_segments(segments, nestable):
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
