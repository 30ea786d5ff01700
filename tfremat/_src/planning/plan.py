"""A plan: which layers of a chain to rematerialize, as a value, with the
cost model's predictions and, once checked, its measured bound (`Measured`),
what training holds besides the step (`Held`), the plans it runs at other
input shapes (`variants`, chosen where the step runs: `segments_at`, and in
a graph traced for any shape, `choose_in_graph`) and the search that chose
it. `plan` is the cost model's choice alone."""

import dataclasses
import functools

import keras
import tensorflow as tf

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
from tfremat._src.planning import growth
from tfremat._src.planning.growth import Rows

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
  def largest(cls, peaks):
    """The check of a chosen plan: its calls' largest peak, which is also
    its bound (no spread, no reserve)."""
    top = int(max(peaks))
    return cls(top, top, len(peaks))

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

  def rows(self, num_axes):
    """`Rows` of the total at every input shape: the weights and the
    optimizer's state as they are, the batch in proportion to its size."""
    return (growth.PROPORTIONAL(num_axes) * self.batch_bytes +
            (self.weights_bytes + self.optimizer_bytes))

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
    measured: this plan's measured peaks (a `tfremat.planner.Measured`,
      set where the planner ran the chosen plan's step to check it), else
      None.
    measured_keep: the same for keeping everything, else None.
    held: what training holds besides the step at the sample's batch
      (`tfremat.planner.Held`: weights, optimizer state, batch), or None
      (counted as nothing).
    shape: the chain's input shape on the sample, or None.
    overhead_bytes: what this plan's predicted step
      (`tfremat.measure.predict_peak`) holds beyond the cost model's chain
      (the model's layers outside the chain, its loss, the optimizer's
      update).
    variants: the segments it may run, fastest first, this plan's among
      them; at each input shape, the first predicted within the budget
      there (`segments_at`). Empty: this plan's segments at every shape.
    margin: what a predicted peak is held to the budget with, as a
      fraction of it (`Settings.reserve` on TensorFlow's executor, whose
      threads order ops differently from call to call; 0 under XLA), or
      what every call of the check held beyond the prediction, where that
      is more and the check was over the budget (`budget.checked`).
    predicted_keep: keeping everything's predicted peak at the sample, or
      None.
    variant_peaks: each variant's step's predicted peak at the sample, in
      the order of `variants` (empty: `overhead_bytes` stands for every
      variant's).
    step: which training step was predicted: "train_on_batch" (a compiled
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
  shape: tuple = None
  overhead_bytes: int = 0
  variants: tuple = ()
  margin: float = 0.0
  predicted_keep: int = None
  variant_peaks: tuple = ()
  step: str = None
  search: object = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    object.__setattr__(self, "costs", tuple(self.costs))
    object.__setattr__(self, "segments", tuple(
        s if isinstance(s, Segment) else Segment(*s) for s in self.segments))
    object.__setattr__(self, "ordered", bool(self.ordered))
    check_segments(list(self.segments), len(self.costs))
    if self.shape is not None:
      object.__setattr__(self, "shape", tuple(self.shape))
    object.__setattr__(self, "variants", tuple(
        tuple(s if isinstance(s, Segment) else Segment(*s) for s in v)
        for v in self.variants))
    object.__setattr__(self, "margin", float(self.margin))
    object.__setattr__(self, "variant_peaks",
                       tuple(int(p) for p in self.variant_peaks))
    if self.variant_peaks and len(self.variant_peaks) != len(self.variants):
      raise errors.InvalidArgumentError(
          f"Plan got {len(self.variant_peaks)} variant_peaks for "
          f"{len(self.variants)} variants: give one per variant, or none.")

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

  @property
  def num_axes(self):
    """How many of the input's axes may change size (`growth.axes_of`)."""
    return growth.axes_of(self.shape) if self.shape else 1

  def ratios(self, shape):
    """Each axis of an input `shape` over the sample's (None: the
    sample's)."""
    shape = tuple(s if d is None else d for d, s in zip(shape, self.shape))
    return growth.ratios(shape, self.shape)

  def rows(self, segments=None):
    """The step's predicted peak under `segments` (default: this plan's)
    at every input shape, as `Rows`: the cost model on the costs' growth,
    plus what the predicted step held beyond it at the sample, in
    proportion to the input's size and never counted lower than there."""
    segments = tuple(self.segments if segments is None else segments)
    cache = self.__dict__.setdefault("_rows", {})  # Not a field.
    if segments not in cache:
      cache[segments] = _rows(self, segments)
    return cache[segments]


  def variant_peak(self, segments):
    """The step of `segments` predicted at the sample, or None."""
    found = dict(zip(self.variants, self.variant_peaks))
    found.setdefault(tuple(keep_all(len(self.costs))), self.predicted_keep)
    return found.get(tuple(segments))

  def predicted_peak_at(self, shape, segments=None):
    """The step's peak at input `shape` under `segments` (default: this
    plan's), predicted (`rows`)."""
    return int(self.rows(segments).at(self.ratios(shape)))

  def seconds_at(self, shape, segments=None):
    """The cost model's step time at input `shape` under `segments`."""
    segments = list(self.segments if segments is None else segments)
    ratios = self.ratios(shape)
    return predict([c.at(ratios) for c in self.costs], segments)[1]

  def allowed_at(self, shape):
    """What the budget leaves a step's bound at input `shape`: bytes less
    what training holds there, or the fraction of keeping everything's
    predicted peak."""
    ratios = self.ratios(shape)
    if self.budget.fraction is not None:
      keep = self.rows(keep_all(len(self.costs))).at(ratios)
      return self.budget.fraction * keep
    held = self.held.rows(self.num_axes).at(ratios) if self.held else 0
    return self.budget_bytes - held

  @property
  def chooses(self):
    """Whether the plan chooses its segments by the input's shape."""
    return bool(self.variants) and (
        self.shape is not None and self.budget is not None)

  def predicted_bound_at(self, shape, segments):
    """The bound of `segments` at input `shape`: its predicted peak there
    times its measured bound over its peak at the sample."""
    return self.predicted_peak_at(shape, segments) * (1.0 + self.margin)

  def segments_at(self, shape):
    """The segments to run on a chain input of `shape` (a tuple; None for
    an unknown dimension: the sample's): the first of `variants` whose
    predicted bound (`predicted_bound_at`) fits what the budget leaves
    there (`allowed_at`), with no new measurement. At the sample's shape
    that is the fastest variant measured to fit; under a fraction, where
    none reaches it, the lowest if it fits what the fraction allows at the
    sample (at a batch of a few rows, weight gradients are most of the
    step and no plan saves that fraction).

    Raises:
      tfremat.errors.BudgetUnreachableError: none is predicted to fit at
        that shape.
    """
    if not self.chooses:
      return self.segments
    shape = tuple(s if d is None else int(d)
                  for d, s in zip(shape, self.shape))
    allowed = self.allowed_at(shape)
    for segments in self.variants:
      if self.predicted_bound_at(shape, segments) <= allowed:
        return segments
    if (self.budget.fraction is not None and self.predicted_bound_at(
        shape, self.variants[-1]) <= self.allowed_at(self.shape)):
      return self.variants[-1]
    raise _unreachable(self, shape)

  def choose_in_graph(self, shape, xla=False):
    """In the graph being built, for an input of dynamic `shape` (an int
    tensor): the index into `variants` that `segments_at` chooses, and an
    assertion, to run before the chain, that some variant fits (it fails
    naming the shape, the budget and the lowest variant's predicted
    bound). With `xla`, for a step XLA compiles (which drops assertions),
    the check instead fails XLA's compile for a shape where none fits, with
    an InvalidArgumentError naming a tensor `tfremat_no_rematerialization_
    plan_is_predicted_to_fit_the_budget_at_this_input_shape...`."""
    return _choose_in_graph(self, shape, xla)

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
        "shape": list(self.shape) if self.shape else None,
        "overhead_bytes": self.overhead_bytes,
        "variants": [[s.as_list() for s in v] for v in self.variants],
        "margin": self.margin,
        "predicted_keep": self.predicted_keep,
        "variant_peaks": list(self.variant_peaks),
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
               shape=config.get("shape"),
               overhead_bytes=config.get("overhead_bytes", 0),
               variants=[[Segment(*s) for s in v]
                         for v in config.get("variants") or ()],
               margin=config.get("margin", 0.0),
               predicted_keep=config.get("predicted_keep"),
               variant_peaks=config.get("variant_peaks") or (),
               step=config.get("step"), **measured)

  def __str__(self):
    return "\n".join(plan_text.layer_rows(self) +
                     plan_text.summary_rows(self) + [plan_text.LEGEND])


def _rows(plan_, segments):
  """`Plan.rows` of `segments`, computed: the cost model's chain plus what
  the step predicted at the sample held beyond it (that variant's own, or
  keeping everything's, where predicted). Where the step held less (XLA
  fuses what the executor keeps), the cost model in that proportion at
  every shape; where more, that excess in proportion to the input's size
  and never counted lower than at the sample (a bound where the excess is
  a constant plus a part that grows with the size)."""
  costs = [c.symbolic(plan_.num_axes) for c in plan_.costs]
  model = predict(costs, list(segments))[0]
  predicted = plan_.variant_peak(segments)
  over = (plan_.overhead_bytes if predicted is None else
          predicted - model.at(()))
  if over < 0 and model.at(()) > 0:
    # A constant would carry the sample's saving to shapes where the chain
    # is smaller (a negative peak), and short of it where larger: under
    # XLA, a 4-block LM planned at length 64 peaked at 16.4 MB at 128 on
    # its lowest variant, where a constant predicted 9.8 MB.
    return model * (1.0 + over / model.at(()))
  size = growth.PROPORTIONAL(plan_.num_axes)
  return model + growth.maximum(Rows.constant(over), size * over)


# The name of the tensor whose compile fails, under XLA, where no variant
# fits the shape: the error says "Shape of tensor <this name> [0] is not
# compatible with expected shape [1]".
_XLA_REFUSAL = ("tfremat_no_rematerialization_plan_is_predicted_to_fit_the_"
                "budget_at_this_input_shape__raise_the_budget_or_train_on_"
                "smaller_inputs")


def _choose_in_graph(plan_, shape, xla=False):
  """`Plan.choose_in_graph`."""
  n = plan_.num_axes
  ratios = tf.cast(shape[:n], tf.float64) / tf.constant(
      plan_.shape[:n], tf.float64)
  if plan_.budget.fraction is not None:
    allowed = plan_.budget.fraction * plan_.rows(
        keep_all(len(plan_.costs))).in_graph(ratios)
  else:
    held = (plan_.held.rows(n).in_graph(ratios) if plan_.held else
            tf.constant(0.0, tf.float64))
    allowed = float(plan_.budget_bytes) - held
  bounds = tf.stack([plan_.rows(v).in_graph(ratios) * (1.0 + plan_.margin)
                     for v in plan_.variants])
  fits = bounds <= allowed
  # Where none fits, the lowest runs; the assertion fails unless it fits a
  # fraction's bytes at the sample (XLA drops assertions).
  ok = tf.reduce_any(fits)
  index = tf.where(ok, tf.argmax(tf.cast(fits, tf.int32),
                                 output_type=tf.int32), len(plan_.variants) - 1)
  if plan_.budget.fraction is not None:
    ok = tf.logical_or(ok, bounds[-1] <= plan_.allowed_at(plan_.shape))
  if xla:
    # XLA drops assertions, but it compiles the step for each concrete
    # shape, where `ok` is a constant: a tensor of `ok` elements checked to
    # hold one fails that compile, naming the refusal.
    flag = tf.reshape(tf.cast(ok, tf.int32), [1])
    check = tf.ensure_shape(tf.zeros(flag, tf.int8, name=_XLA_REFUSAL), [1])
    return index, check
  message = (f"tfremat: no rematerialization plan is predicted to fit the "
             f"budget of {plan_.budget} at this input shape (planned at "
             f"{plan_.shape}); raise the budget, train on smaller inputs, or "
             "plan on a sample of this shape. Input shape, bytes the budget "
             "leaves the step there, the lowest plan's predicted bound there:")
  check = tf.debugging.Assert(ok, [message, shape, allowed, bounds[-1]],
                              summarize=8)
  return index, check


def _unreachable(plan_, shape):
  """The error for an input `shape` at which no variant is predicted to
  fit (`Plan.segments_at`)."""
  mib = units.format_bytes
  lowest = int(plan_.predicted_bound_at(shape, plan_.variants[-1]))
  if plan_.budget.fraction is not None:
    where = ("the budget is a fraction of keeping everything's peak there "
             "(or, for the lowest plan, "
             f"{mib(int(plan_.allowed_at(plan_.shape)))}, that fraction at "
             "the sample)")
  else:
    held = (plan_.held.rows(plan_.num_axes).at(plan_.ratios(shape))
            if plan_.held else 0)
    where = f"training holds {mib(int(held))} there besides the step"
  return errors.BudgetUnreachableError.of(
      f"No rematerialization plan is predicted to fit the budget of "
      f"{plan_.budget} at input shape {tuple(shape)} (planned at "
      f"{plan_.shape}): {where}, and the lowest plan's bound is predicted "
      f"at {mib(lowest)} there. Raise the budget, train on smaller inputs, "
      "or plan on a sample of this shape.", lowest,
      plan_.predicted_peak_at(shape, keep_all(len(plan_.costs))))


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
