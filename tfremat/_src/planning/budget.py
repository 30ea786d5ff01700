"""Planning a chain for a budget, in one direction: read (each unit's
costs on the sample, and how they grow with its shape, from its traced
programs) -> costs -> the choice (`choose.choose_plan`: the cost model's
proposals, each held to the budget by its whole training step's predicted
peak) -> the plan, with the plans it runs at other shapes
(`Plan.variants`) -> its check (the chosen plan's step run a few times).
The entry points hand in the chain, the runner and the batch;
`apply.apply_plan` then turns the plan into layers.
"""

import contextlib
import dataclasses

import keras
import tensorflow as tf

from tfremat import errors
from tfremat._src import measuring as measure
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import in_place
from tfremat._src.keras_api.chain_layers import call_link
from tfremat._src.keras_api.chain_layers import nest_target
from tfremat._src.planning import choose
from tfremat._src.planning import profile
from tfremat._src.planning import cost_model
from tfremat._src.planning import proposals
from tfremat._src.planning import search
from tfremat._src.planning import growth
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.plan import Measured
from tfremat._src.planning.runner import Batch
from tfremat._src.planning.runner import nbytes

__all__ = [
    "Chain",
    "plan_budget",
    "perturbed",
    "with_variants",
    "planning_arguments",
    "planned_policies",
    "retracing_quiet",
    "sample_batch",
]


@dataclasses.dataclass(frozen=True)
class Chain:
  """The chain a budget is planned on: its units, and how a `Batch` becomes
  the first unit's input (`inputs`; the batch's `x` itself by default) and
  the context tensors its units read (`context`; None by default)."""
  units: tuple
  inputs: object = None
  context: object = None

  def input_of(self, batch):
    return batch.x if self.inputs is None else self.inputs(batch.x)

  def context_of(self, batch):
    return None if self.context is None else self.context(batch.x)


def perturbed(chain, batch):
  """The chain's input with each axis but its last halved in turn (the
  batch, then a sequence or an image's height and width), each a
  `profile.Perturbed`: the batch cut there, so that the context and the
  model's layers before the chain follow. An axis the model takes at one
  size only is left out."""
  x = tf.convert_to_tensor(chain.input_of(batch))
  found = []
  for axis, size in growth.perturbed_sizes(tuple(x.shape)):
    if _fixed(chain.units, axis):
      continue
    try:
      cut = (batch.resized(size) if axis == 0 else
             batch.cut(axis, max(1, _first_length(batch, axis) // 2)))
      if cut is None:
        continue
      other = tf.convert_to_tensor(chain.input_of(cut))
    except (ValueError, TypeError, tf.errors.InvalidArgumentError):
      continue  # A model built for one length (or batch) only.
    changed = [i for i, (a, b) in enumerate(zip(other.shape, x.shape))
               if a != b]
    if changed != [axis]:
      continue
    found.append(profile.Perturbed(axis, other.shape[axis] / x.shape[axis],
                                   other, chain.context_of(cut), cut))
  return found


def _fixed(units, axis):
  """Whether a unit of the chain takes inputs of one size along `axis` (a
  functional part of a CNN built for 224x224 images, say)."""
  for unit in units:
    unit = getattr(unit, "unit", unit)  # A ContextUnit's.
    if isinstance(unit, keras.Sequential):
      # A group of layers (`model_chain`'s), built on the sample's shape
      # by its first call, which fixes nothing: its layers may.
      if _fixed(unit.layers, axis):
        return True
      continue
    try:
      inputs = tf.nest.flatten(getattr(unit, "inputs", None) or [])
    except (AttributeError, ValueError):  # A model never called.
      inputs = []
    for t in inputs:
      shape = getattr(t, "shape", None)
      if shape is not None and len(shape) > axis and shape[axis] is not None:
        return True
  return False


def _first_length(batch, axis):
  return int(tf.nest.flatten(batch.x)[0].shape[axis])


def plan_budget(chain, runner, batch, budget, *, policies=(), costs=None,
                settings=search.DEFAULT_SETTINGS, verbose=0):
  """The planner's plan for `chain` within `budget`: the units' costs read
  from their traced programs (`profile.measure_chain(read=True)`), plans
  held to the budget by their steps' predicted peaks (`choose.choose_plan`),
  the plans it runs at other input shapes (`with_variants`), and the chosen
  plan's step run to check it (`checked`). Every variable the runner
  trains is left as it was.

  Returns:
    The `tfremat.planner.Plan`; its `search` says what was predicted, its
    `variants` what it runs at other shapes.

  Raises:
    tfremat.errors.BudgetUnreachableError (a ValueError).
  """
  budget = Budget.parse(budget)
  units = list(chain.units)
  progress = measure.progress_bar(len(units) + 3, "unit", verbose)
  with retracing_quiet(), measure.restoring(_built_variables(chain, batch)):
    cuts = perturbed(chain, batch)
    read = lambda: profile.measure_chain(
        units, chain.input_of(batch), policies=policies,
        context=chain.context_of(batch), progress=progress,
        perturbed=cuts, read=True)
    plan = choose.choose_plan(
        ((costs if callable(costs) else (lambda: costs)) if costs is not None
         else read, len(units)), budget, runner, batch, settings,
        floor_bytes=nbytes([u.trainable_weights for u in units]),
        nestable=[in_place.can_nest(nest_target(u)) for u in units])
    shape = tuple(tf.convert_to_tensor(chain.input_of(batch)).shape)
    plan = with_variants(plan.replace(shape=shape), settings)
    plan = _variant_peaks(plan, runner, batch)
    plan = checked(plan, runner, batch, settings)
  if progress is not None:
    progress.update(progress.target, finalize=True)
  return plan


def _variant_peaks(plan, runner, batch):
  """`plan` with each variant's step predicted at the sample
  (`Plan.variant_peaks`), reusing the choice's predictions, else read from
  keeping everything's program; under XLA, where that read is an estimate
  (`Runner.simulated`), each compiled: what a step holds beyond the cost
  model differs between variants (under XLA, for an LM, 0.56 of the cost
  model's peak keeping everything, 0.96 recomputing every block), and a
  variant's estimate, carried to other shapes, let steps run 32% over a
  budget."""
  if len(plan.variants) < 2:
    return plan
  found = {t.candidate.segments: t.predicted_bytes
           for t in (plan.search.trials if plan.search else ())
           if t.predicted_bytes is not None and not t.candidate.ordered and
           not runner.jit}
  def predicted(variant):
    candidate = search.Candidate(variant, plan.ordered)
    read = None if runner.jit else runner.simulated(candidate, batch)
    return runner.predicted(candidate, batch) if read is None else read
  peaks = tuple(found[v] if v in found else predicted(v)
                for v in plan.variants)
  return plan.replace(variant_peaks=peaks)


def checked(plan, runner, batch, settings):
  """`plan` with its step run `settings.check_calls` times on `batch`
  (`Plan.measured`: the largest peak), the prediction's check: in the step
  traced for the sample's shapes, as `fit`'s first step, which the chosen
  plan's prediction traced, so that the check adds no trace (under XLA it
  is compiled again as it runs). Where the largest peak is over what the
  budget leaves the step and every call held more than the prediction,
  the margin (`Plan.margin`) becomes what the smallest peak held beyond
  it, as a fraction of it: every variant's prediction is held to the
  budget with that, so a lower one runs at the sample, raising where none
  is then predicted to fit."""
  peaks = runner.peaks(search.Candidate(plan.segments, plan.ordered),
                       batch, settings.check_calls)
  plan = plan.replace(measured=Measured.largest(peaks))
  room, predicted = plan.step_budget_bytes, plan.predicted_peak_at(plan.shape)
  # The smallest peak, not the largest: one call's peak moves with thread
  # timing (on a loaded machine a CNN's by 2 MiB on 10, which, held to
  # every variant, refused a budget its lowest plan met by 16%).
  if room is not None and max(peaks) > room and min(peaks) > predicted:
    plan = plan.replace(margin=max(plan.margin, min(peaks) / predicted - 1))
  plan.segments_at(plan.shape)  # Raises where none fits at the sample.
  return plan


# Each axis's size over the sample's at which `with_variants` plans.
_LADDER = (0.25, 0.5, 0.8, 1.25, 2.0, 4.0)


def with_variants(plan, settings):
  """`plan` with the segments it runs at other input shapes
  (`Plan.variants`): at each of `_LADDER` times the sample's size along
  each axis, the fastest plan the cost model predicts within the budget
  there (with the margin), then the lowest plan; this
  plan's own; the fastest first, at most `settings.variants` (the fastest,
  this plan's and the lowest kept). A nested or ordered plan is its only
  variant."""
  if plan.budget.fraction == 1.0:
    return plan  # Keeping everything, at every shape.
  if plan.ordered or any(s.nested for s in plan.segments):
    # Alone: in a tf.switch_case, the gradient of a nested rerun, or of an
    # ordered chain's tf.gradients, captures a variable's handle, which
    # TensorFlow's cond gradient cannot resolve.
    return plan.replace(variants=(tuple(plan.segments),))
  n = plan.num_axes
  found = {tuple(plan.segments),
           tuple(proposals.lowest_plan(plan.costs).segments)}
  for axis in range(n):
    for factor in _LADDER:
      ratios = tuple(factor if i == axis else 1.0 for i in range(n))
      shape = tuple(max(1, round(d * r)) for d, r in
                    zip(plan.shape, ratios)) + plan.shape[n:]
      costs = [c.at(ratios) for c in plan.costs]
      # The room for the chain's tensors: what the budget leaves the bound
      # there, less what the step holds beyond the cost model.
      target = (plan.allowed_at(shape) / (1 + plan.margin) -
                plan.predicted_peak_at(shape) +
                predict(costs, list(plan.segments))[0])
      segments = cost_model.fastest(costs, target)
      if segments is not None:
        found.add(tuple(segments))
  ordered = sorted(found, key=lambda v: predict(plan.costs, list(v))[1])
  keep = {ordered[0], tuple(plan.segments), ordered[-1]}
  rest = [v for v in ordered if v not in keep]
  room = max(0, settings.variants - len(keep))
  if rest and room:
    step = len(rest) / room
    keep |= {rest[int(i * step)] for i in range(min(room, len(rest)))}
  return plan.replace(variants=tuple(v for v in ordered if v in keep))


def _built_variables(chain, batch):
  """Every variable of the chain's units, the units built first where one
  is not (by an inference call, which changes no state), so that planning,
  which runs training steps (moving BatchNormalization statistics and
  dropout seeds), can put them back."""
  if not all(_built(unit) for unit in chain.units):
    x, context = chain.input_of(batch), chain.context_of(batch)
    for unit in chain.units:
      x = call_link(unit, x, context, False)
    del x  # Held through the measurements, it would shift their peaks.
  return [v for unit in chain.units for v in unit.variables]


def _built(unit):
  """Whether `unit`'s variables all exist: it is built, or it is a group
  of built layers (`model_chain`'s, never called itself)."""
  unit = getattr(unit, "unit", unit)  # A ContextUnit's.
  if getattr(unit, "built", False):
    return True
  return isinstance(unit, keras.Sequential) and bool(unit.layers) and all(
      _built(layer) for layer in unit.layers)


def planning_arguments(caller, budget, sample_input, policies, policy=None):
  """`(Budget, policies)` for planning, checked before anything is measured
  (`remat_sequential`, `remat_model`, the builder's `_RematerializeSeq`);
  TypeError/ValueError naming the fix."""
  if policy is not None:
    raise errors.InvalidArgumentError(
        f"{caller}: with a budget the planner chooses each segment's "
        "policy; name the ones it may choose with policies=[...], or give "
        "segments= to use one policy everywhere.")
  policies = planned_policies(policies)
  budget = Budget.parse(budget)
  if sample_input is None:
    raise errors.InvalidArgumentError(
        f"{caller}: budget needs sample_input, a batch like those it will "
        "train on, to measure on.")
  return budget, policies


def planned_policies(policies):
  """`policies` (built-ins' names or `tfremat.policies` values, a user's
  own included) as a tuple of policy values with distinct names, parsed
  once: the keys of a layer's costs and what a plan's segments run;
  TypeError/ValueError naming the bad ones, all at once."""
  if isinstance(policies, str) or callable(policies):
    policies = (policies,)
  policies = tuple(policies)
  bad = [p for p in policies if
         (isinstance(p, str) and p not in policies_lib.BUILT_IN) or
         not (isinstance(p, str) or callable(p)) or policies_lib.is_nothing(p)]
  if bad:
    raise errors.InvalidArgumentError(
        f"The planner chooses among save policies; got {bad!r}. Choose "
        f"from the built-ins' names or tfremat.policies values (your own "
        f"included) other than nothing_saveable (default: "
        f"{[p.name for p in policies_lib.PLANNED]}); recomputing everything "
        "is always among the choices.")
  policies = tuple(policies_lib.get(p) for p in policies)
  names = [p.name for p in policies]
  if len(set(names)) < len(names):
    raise errors.InvalidArgumentError(
        f"The planner's policies need distinct names; got {names}.")
  return policies


@contextlib.contextmanager
def retracing_quiet():
  """Silences TensorFlow's retracing warnings while the block runs.

  Planning traces a new training step for every layer, policy and plan it
  measures, on purpose; TensorFlow's warning about frequent retracing ("5
  out of the last 17 calls ... triggered tf.function retracing") would only
  mislead. Other warnings and errors still show.
  """
  logger = tf.get_logger()

  def not_retracing(record):
    return "triggered tf.function retracing" not in record.getMessage()

  logger.addFilter(not_retracing)
  try:
    yield
  finally:
    logger.removeFilter(not_retracing)


def sample_batch(x, y=None):
  """A `Batch` of the sample: each input a tensor (a list of strings, a
  KerasHub task's text, one string tensor)."""
  def tensors(value):
    if isinstance(value, (list, tuple)) and value and all(
        isinstance(v, (str, bytes)) for v in value):
      return tf.convert_to_tensor(value)
    return tf.nest.map_structure(tf.convert_to_tensor, value)
  return Batch(tensors(x), None if y is None else tensors(y))
