"""A plan: which layers of a chain to rematerialize, as a value, with the
cost model's predictions and, once checked, its measured bound (`Measured`)
and the search that chose it. `plan` is the cost model's choice alone."""

import dataclasses
import functools

from tfremat import errors
from tfremat._src.planning import plan_text
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import LayerCost
from tfremat._src.planning.cost_model import Segment
from tfremat._src.planning.cost_model import check_segments
from tfremat._src.planning.cost_model import fastest
from tfremat._src.planning.cost_model import keep_all
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.cost_model import smallest_budget

__all__ = [
    "Measured",
    "Plan",
    "plan",
    "Infeasible",
    "infeasible_budget_error",
]


@dataclasses.dataclass(frozen=True)
class Measured:
  """A candidate's measured peaks over several calls of its training step,
  and the bound a budget is compared with: the largest peak, plus the
  spread (largest less smallest) of the calls, plus the reserve.

  Attributes:
    peak_bytes: the largest peak of the calls.
    bound_bytes: the bound.
    calls: how many calls were measured.
    reserve_bytes: the reserve included in `bound_bytes`.
  """
  peak_bytes: int
  bound_bytes: int
  calls: int = 1
  reserve_bytes: int = 0

  @classmethod
  def of(cls, value, reserve=0.0):
    """A Measured from a list of per-call peaks, a Measured (whose bound
    then gets the reserve), or one int (a single peak); `reserve` is a
    fraction of the largest peak."""
    if isinstance(value, Measured):
      extra = int(reserve * value.peak_bytes)
      return dataclasses.replace(value, bound_bytes=value.bound_bytes + extra,
                                 reserve_bytes=value.reserve_bytes + extra)
    peaks = list(value) if isinstance(value, (list, tuple)) else [value]
    top, low = int(max(peaks)), int(min(peaks))
    extra = int(reserve * top)
    return cls(top, 2 * top - low + extra, len(peaks), extra)

  @classmethod
  def from_config(cls, config):
    """From `dataclasses.asdict`; reads the `margin_bytes` of plans saved
    by tfremat 0.1 as the reserve."""
    config = dict(config)
    if "margin_bytes" in config:
      config["reserve_bytes"] = config.pop("margin_bytes")
    return cls(**config)

  @property
  def spread_bytes(self):
    """The calls' spread that `bound_bytes` includes."""
    return self.bound_bytes - self.peak_bytes - self.reserve_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which layers to rematerialize, with the cost model's predictions.

  A Plan is a value: two plans with the same fields are equal, and its
  attributes cannot be set (`replace` makes a changed copy).

  Attributes:
    costs, segments: the chain's measured LayerCosts and the chosen
      segments (tuples).
    budget_bytes: the budget in bytes, or None.
    budget: the Budget as given (bytes or a fraction), or None.
    ordered: whether the chain runs ordered (`RematSequential(...,
      ordered=True)`): the planner orders a plan only where no unordered
      plan it measured fits.
    measured: this plan's measured peaks and bound (a
      `tfremat.planner.Measured`, set when the planner checked it), else
      None.
    measured_keep: the same for keeping everything, else None.
    search: what the planner measured to choose it (a
      `tfremat.planner.Search`; not saved with a model, and not compared).
    peak_bytes, seconds: the cost model's peak and step time for this plan.
    baseline_peak_bytes, baseline_seconds: the same for keeping everything.
  """
  costs: tuple
  segments: tuple
  budget_bytes: int = None
  budget: Budget = None
  ordered: bool = False
  measured: object = None
  measured_keep: object = None
  search: object = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    object.__setattr__(self, "costs", tuple(self.costs))
    object.__setattr__(self, "segments", tuple(
        s if isinstance(s, Segment) else Segment(*s) for s in self.segments))
    object.__setattr__(self, "ordered", bool(self.ordered))
    check_segments(list(self.segments), len(self.costs))

  def replace(self, **changes):
    """A new Plan like this one, with `changes` (any field but `costs`)."""
    allowed = {f.name for f in dataclasses.fields(self)} - {"costs"}
    unknown = set(changes) - allowed
    if unknown:
      raise errors.InvalidArgumentError(
          f"Plan.replace takes {sorted(allowed)}; got {sorted(unknown)}.")
    return dataclasses.replace(self, **changes)

  @functools.cached_property
  def _predicted(self):
    return predict(self.costs, list(self.segments))

  @functools.cached_property
  def _baseline(self):
    return predict(self.costs, keep_all(len(self.costs)))

  @property
  def peak_bytes(self):
    return self._predicted[0]

  @property
  def seconds(self):
    return self._predicted[1]

  @property
  def baseline_peak_bytes(self):
    return self._baseline[0]

  @property
  def baseline_seconds(self):
    return self._baseline[1]

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
    """A JSON-able dict; `Plan.from_config` makes the same Plan from it
    (without its `search`)."""
    return {
        "costs": [c.get_config() for c in self.costs],
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
    measured = {name: Measured.from_config(config[name])
                for name in ("measured", "measured_keep") if config.get(name)}
    return cls([LayerCost.from_config(c) for c in config["costs"]],
               [Segment(*s) for s in config["segments"]],
               config.get("budget_bytes"),
               Budget(**budget) if budget else None,
               config.get("ordered", False), **measured)

  def __str__(self):
    return "\n".join(plan_text.layer_rows(self) +
                     plan_text.summary_rows(self) + [plan_text.LEGEND])


def _refuse_setting(plan_, name, value):
  del plan_, value
  raise dataclasses.FrozenInstanceError(
      f"A Plan is a value: use plan.replace({name}=...) for one with another "
      f"{name}.")


Plan.__setattr__ = _refuse_setting


def plan(costs, budget_bytes):
  """The fastest plan whose predicted peak fits `budget_bytes`, by the cost
  model alone.

  Raises:
    ValueError: no plan fits; the message gives the smallest budget that does.
  """
  segments = fastest(costs, budget_bytes)
  if segments is None:
    raise infeasible_budget_error(budget_bytes, smallest_budget(costs))
  return Plan(costs, segments, budget_bytes)


class Infeasible(errors.InvalidArgumentError):
  """No plan the cost model predicts fits the budget (`plan`)."""


def infeasible_budget_error(budget_bytes, need, estimated_by=None):
  """The ValueError for a budget below `need`, the smallest that works
  (`estimated_by`: how `need` was estimated, if not by the model alone)."""
  about, how = ("about ", f", {estimated_by}") if estimated_by else ("", "")
  return Infeasible(
      f"No rematerialization plan fits a budget of {budget_bytes} bytes "
      f"({budget_bytes / 2**20:.1f} MiB); the smallest budget that works for "
      f"this chain is {about}{need} bytes ({need / 2**20:.1f} MiB){how}. "
      "Raise the budget, or shrink the batch or the layers.")
