"""Planning a chain for a budget, in one direction: profile (each unit's
costs on the sample) -> costs -> the search (`search.search_budget`:
candidates from the cost model, each checked by measuring the runner's
training step) -> the plan -> how its costs change with the input's shape
(`shapes.ShapeFit`: the units profiled and keeping everything measured
again on the sample cut in half). The entry points hand in the chain, the
runner and the batch; `apply.apply_plan` then turns the plan into layers.
"""

import contextlib
import dataclasses

import tensorflow as tf

from tfremat import errors
from tfremat._src import measuring as measure
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import in_place
from tfremat._src.keras_api.chain_layers import call_link
from tfremat._src.keras_api.chain_layers import nest_target
from tfremat._src.keras_api.segments import keep_all
from tfremat._src.planning import profile
from tfremat._src.planning import search
from tfremat._src.planning import shapes
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.runner import Batch
from tfremat._src.planning.runner import nbytes

__all__ = [
    "Chain",
    "plan_budget",
    "profiled",
    "shape_fit",
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


def profiled(chain, batch, policies, settings, progress=None):
  """The chain's LayerCosts on `batch` (`profile.measure_chain`)."""
  return profile.measure_chain(
      chain.units, chain.input_of(batch), policies=policies,
      waiting_fraction=settings.waiting_fraction, progress=progress,
      context=chain.context_of(batch))


def plan_budget(chain, runner, batch, budget, *, policies=(), costs=None,
                settings=search.DEFAULT_SETTINGS, verbose=0, fit_shapes=None):
  """The planner's plan for `chain` within `budget`, checked by measuring
  `runner`'s training step on `batch`, and, with `fit_shapes` (by default
  for a budget in bytes), fitted over shapes (`shape_fit`).

  Keeping everything is measured first, before any unit is profiled: a
  budget put out of reach by what training holds, or by the weight
  gradients plus their reserve, is refused then. Every variable the runner
  trains is left as it was.

  Returns:
    The `tfremat.planner.Plan`; its `search` says what was measured, its
    `shapes` how its costs change with the input's shape (None without
    `fit_shapes`: a fraction of the step's peak holds at another shape
    with the same segments).

  Raises:
    tfremat.errors.BudgetUnreachableError (a ValueError).
  """
  budget = Budget.parse(budget)
  if fit_shapes is None:  # A fraction holds at another shape as it is.
    fit_shapes = budget.num_bytes is not None
  units = list(chain.units)
  steps = ((len(units) if costs is None else 0) + 1 + settings.rounds + 3 +
           (2 if fit_shapes else 0))
  progress = measure.progress_bar(steps, "measurement", verbose)
  with retracing_quiet(), measure.restoring(_built_variables(chain, batch)):
    plan = search.choose_plan(
        (lambda: costs) if costs is not None else
        (lambda: profiled(chain, batch, policies, settings, progress)),
        budget, _Counted(runner, progress), batch, settings=settings,
        nestable=[in_place.can_nest(nest_target(u)) for u in units],
        floor_bytes=nbytes([u.trainable_weights for u in units]),
        num_layers=len(units))
    if fit_shapes:
      plan = plan.replace(shapes=shape_fit(chain, runner, batch, plan,
                                           settings))
  if progress is not None:
    progress.update(progress.target, finalize=True)
  return plan


class _Counted:
  """`runner`, advancing `progress` by one per candidate it measures."""

  def __init__(self, runner, progress):
    self._runner, self._progress = runner, progress
    self.step = runner.step
    self._last = None

  def held(self, batch):
    return self._runner.held(batch)

  def peaks(self, candidate, batch, calls):
    if self._progress is not None and candidate != self._last:
      self._progress.add(1)
    self._last = candidate
    return self._runner.peaks(candidate, batch, calls)


def _built_variables(chain, batch):
  """Every variable of the chain's units, each unit built first by an
  inference call (which changes no state), so that profiling, which runs
  training steps (moving BatchNormalization statistics and dropout seeds),
  can put them back."""
  x, context = chain.input_of(batch), chain.context_of(batch)
  for unit in chain.units:
    x = call_link(unit, x, context, False)
  del x  # Held through the measurements, it would shift their peaks.
  return [v for unit in chain.units for v in unit.variables]


def shape_fit(chain, runner, batch, plan, settings):
  """How the chain's costs, and what the measured step holds beyond them,
  change with the input's shape (`shapes.ShapeFit`): the units profiled
  and keeping everything measured on the sample cut in half along the
  sequence, or where the model takes one length only, the batch."""
  shape = tuple(tf.convert_to_tensor(chain.input_of(batch)).shape)
  keep_peak = predict(plan.costs, keep_all(len(plan.costs)))[0]
  overhead = plan.measured_keep.peak_bytes - keep_peak
  for axis, half in _halves(shape):
    cut = (batch.resized(half) if axis == 0 else
           batch.cut(shape[axis], half))
    try:
      # Without save policies: what a policy keeps is fitted as the layer's
      # saved tensors are (`ShapeFit.costs_at`).
      half_costs = profiled(chain, cut, (), settings) if cut else None
    except ValueError:  # A model built for one length (or batch) only.
      half_costs = None
    if half_costs is None:
      continue
    keep = search.Candidate(keep_all(len(plan.costs)))
    half_keep = max(search.checked_peaks(runner, keep, cut, None, settings,
                                         probe=True))
    half_overhead = half_keep - predict(half_costs,
                                        keep_all(len(half_costs)))[0]
    return shapes.ShapeFit(shape, axis, half, half_costs,
                           (overhead, half_overhead),
                           aim_below=settings.aim_below)
  return shapes.ShapeFit(shape, overheads=(overhead, overhead),
                         aim_below=settings.aim_below)


def _halves(shape):
  """Where to cut the sample in two, in order: its sequence (an input of
  rank 3 or more), then its batch; each (axis, half of its size), where
  that half is 2 or more."""
  axes = [1, 0] if len(shape) >= 3 else [0]
  return [(axis, shape[axis] // 2) for axis in axes
          if shape[axis] is not None and shape[axis] >= 4]


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
  """A `Batch` of the sample: each input a tensor."""
  return Batch(tf.nest.map_structure(tf.convert_to_tensor, x),
               None if y is None else tf.nest.map_structure(
                   tf.convert_to_tensor, y))
