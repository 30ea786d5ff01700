"""A plan: which layers of a chain to rematerialize, as a value, with the
cost model's predictions and, once checked, its measured bound (`Measured`),
what training holds besides the step (`Held`), how its costs change with
the input's shape (`shapes.ShapeFit`) and the search that chose it. `plan`
is the cost model's choice alone."""

import dataclasses
import functools

import keras

from tfremat import errors
from tfremat._src import units
from tfremat._src.keras_api.segments import Segment
from tfremat._src.keras_api.segments import check_segments
from tfremat._src.keras_api.segments import keep_all
from tfremat._src.planning import plan_text
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import LayerCost
from tfremat._src.planning.cost_model import fastest
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.cost_model import smallest_budget
from tfremat._src.planning.shapes import ShapeFit

__all__ = [
    "Measured",
    "Held",
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
class Held:
  """What training holds besides a step's own tensors, in bytes: its
  weights, its optimizer's state (slots, step count) and the batch. A byte
  budget, and `largest_batch`'s memory, count these and the step's peak
  together, as `torch.cuda.max_memory_allocated` counts every live tensor.
  Counted from the tensors' shapes and dtypes, as the step's peak counts
  its tensors' bytes."""
  weights_bytes: int = 0
  optimizer_bytes: int = 0
  batch_bytes: int = 0

  @property
  def total_bytes(self):
    return self.weights_bytes + self.optimizer_bytes + self.batch_bytes

  def with_batch(self, factor):
    """The same with the batch `factor` times as large."""
    return dataclasses.replace(self,
                               batch_bytes=int(self.batch_bytes * factor))

  def __str__(self):
    mib = units.format_bytes
    return (f"{mib(self.total_bytes)}: weights {mib(self.weights_bytes)}, "
            f"optimizer {mib(self.optimizer_bytes)}, batch "
            f"{mib(self.batch_bytes)}")


@keras.saving.register_keras_serializable(package="tfremat")
@dataclasses.dataclass(frozen=True)
class Plan:
  """Which layers to rematerialize, with the cost model's predictions.

  A Plan is a value: two plans with the same fields are equal, and its
  attributes cannot be set (`replace` makes a changed copy).

  Attributes:
    costs, segments: the chain's measured LayerCosts and the chosen
      segments (tuples).
    budget_bytes: the budget in bytes, or None: everything training holds
      (`held`, then the step's own tensors).
    budget: the Budget as given (bytes or a fraction), or None.
    ordered: whether the chain runs ordered (`RematSequential(...,
      ordered=True)`): the planner orders a plan only where no unordered
      plan it measured fits.
    measured: this plan's measured peaks and bound (a
      `tfremat.planner.Measured`, set when the planner checked it), else
      None.
    measured_keep: the same for keeping everything, else None.
    held: what training holds besides the step at the sample's batch
      (`tfremat.planner.Held`: weights, optimizer state, batch), or None
      (counted as nothing).
    shapes: how the costs change with the input's shape (`ShapeFit`), for
      `segments_at`; None: the plan is for the sample's shape only.
    step: which training step was measured: "train_on_batch" (a compiled
      model's, with its loss and optimizer) or "stand-in" (the gradient of
      sum(y**2)/2 of the outputs, no optimizer); None where nothing was.
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
  held: Held = None
  shapes: ShapeFit = None
  step: str = None
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
  def held_bytes(self):
    """What training holds besides the step, at the sample (0 if unknown)."""
    return self.held.total_bytes if self.held else 0

  @property
  def step_budget_bytes(self):
    """What the budget leaves for the step's own tensors at the sample: the
    bound a plan's measured step is held to, or None."""
    if self.budget_bytes is None:
      return None
    return self.budget_bytes - self.held_bytes

  @property
  def rematerialized(self):
    """Per layer: whether it is rematerialized."""
    return [s.remat for s in self.segments for _ in range(s.start, s.stop)]

  @functools.cached_property
  def _calibration(self):
    """The measured step's peak beyond the overhead, over the cost model's
    peak, for this plan at the sample (1 where not measured)."""
    if self.measured is None or self.shapes is None:
      return 1.0
    chain = self.measured.peak_bytes - self.shapes.overheads[0]
    return min(2.0, max(0.5, chain / max(1, self.peak_bytes)))

  def predicted_peak_at(self, shape, segments=None):
    """The step's peak at input shape `shape` under `segments` (default: this
    plan's), predicted: the cost model at that shape, scaled as this plan's
    measurement at the sample was, plus the step's overhead there
    (`ShapeFit`). Needs `shapes`."""
    segments = list(self.segments if segments is None else segments)
    costs = self.shapes.costs_at(self.costs, self.shapes.resolved(shape))
    return int(self._calibration * predict(costs, segments)[0] +
               self.shapes.overhead_at(self.shapes.resolved(shape)))

  def seconds_at(self, shape, segments=None):
    """The cost model's step time at input shape `shape` under `segments`
    (default: this plan's), its costs fitted over shapes (`shapes`)."""
    segments = list(self.segments if segments is None else segments)
    costs = self.shapes.costs_at(self.costs, self.shapes.resolved(shape))
    return predict(costs, segments)[1]

  def segments_at(self, shape):
    """The segments to run on a chain input of `shape` (a tuple; None for an
    unknown dimension: the sample's): this plan's at the sample's shape;
    at another, the fastest the cost model predicts within the budget
    there, fitted over shapes (`shapes`), with no new measurement. A byte
    budget is what training holds there (the batch grows with the shape)
    plus the step's predicted peak, held to this plan's measured bound over
    its peak and aimed `shapes.aim_below` lower; a fraction is of the
    predicted peak of keeping everything there.

    Raises:
      tfremat.errors.BudgetUnreachableError: no plan is predicted to fit
        at that shape.
    """
    if self.shapes is None or self.budget is None or self.measured is None:
      return self.segments
    shape = self.shapes.resolved(shape)
    if shape == self.shapes.shape:
      return self.segments
    at = self.__dict__.setdefault("_at_shapes", {})  # Not a field.
    if shape not in at:
      at[shape] = self._solved_at(shape)
    return at[shape]

  def _solved_at(self, shape):
    """`segments_at` for a shape other than the sample's."""
    fit = self.shapes
    costs = fit.costs_at(self.costs, shape)
    overhead = fit.overhead_at(shape)
    keep_peak = predict(costs, keep_all(len(costs)))[0] + overhead
    held = self.held.with_batch(fit.size_ratio(shape)).total_bytes if (
        self.held) else 0
    room = (self.budget.fraction * keep_peak if self.budget.fraction
            else self.budget_bytes - held)
    bound_per_peak = self.measured.bound_bytes / max(
        1, self.measured.peak_bytes)
    target = room / bound_per_peak * (1 - fit.aim_below)
    segments = fastest(costs, (target - overhead) / self._calibration)
    smaller = all(d <= s for d, s in zip(shape, fit.shape))
    if segments is None and smaller:
      return self.segments  # A smaller input peaks no higher.
    if segments is None:
      mib = units.format_bytes
      lowest = int(self._calibration * smallest_budget(costs) + overhead)
      raise errors.BudgetUnreachableError.of(
          f"No rematerialization plan is predicted to fit the budget of "
          f"{self.budget} at input shape {shape} (planned at "
          f"{fit.shape}): there training holds {mib(held)} besides the "
          f"step, which leaves {mib(int(room))} for its tensors, and the "
          f"lowest plan is predicted to peak at {mib(lowest)}. Raise the "
          "budget, train on smaller inputs, or plan on a sample of this "
          "shape.", lowest, keep_peak)
    return tuple(segments)

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
        "held": dataclasses.asdict(self.held) if self.held else None,
        "shapes": self.shapes.get_config() if self.shapes else None,
        "step": self.step,
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
               config.get("ordered", False),
               held=Held(**config["held"]) if config.get("held") else None,
               shapes=(ShapeFit.from_config(config["shapes"])
                       if config.get("shapes") else None),
               step=config.get("step"), **measured)

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
