"""Planned chains (`tfremat.chain`): `remat_sequential`, and the planner's
plans checked by measuring training steps (`checked_plan`)."""

import collections.abc
import contextlib
import functools

import tensorflow as tf

from tfremat import errors
from tfremat._src.planning import measure
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import in_place
from tfremat._src.keras_api import layers as layers_lib
from tfremat._src.planning import search
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import keep_all
from tfremat._src.planning.cost_model import uniform_segments
from tfremat._src.keras_api.chain_layers import RematSequential
from tfremat._src.keras_api.chain_layers import apply_plan
from tfremat._src.keras_api.chain_layers import nest_target
from tfremat._src.planning.chain_measure import measure_chain
from tfremat._src.planning.chain_measure import measure_peaks

__all__ = [
    "remat_sequential",
    "planning_arguments",
    "planned_policies",
    "checked_plan",
    "retracing_quiet",
]


def remat_sequential(layers, segments=None, budget=None, sample_input=None,
                     verbose=1, policy=None, policies=policies_lib.PLANNED,
                     settings=search.DEFAULT_SETTINGS):
  """A Keras layer running `layers` in order, with chosen rematerialization.

  Either uniform segments:

    chain = tfremat.remat_sequential(blocks, segments="sqrt")

  or the planner's choice for a memory budget, measured on a sample batch:

    chain = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)
    print(chain.plan)

  Args:
    layers: Keras layers, each taking the previous one's output, or a
      `keras.Sequential` of them.
    segments: an int, or "sqrt" for about sqrt(len(layers)) equal segments,
      every one rematerialized (Chen et al. 2016).
    budget: instead of `segments`, a budget for a training step's peak
      memory (`tfremat.measure.peak_bytes`): bytes as an int or a string
      with a unit ("200MiB"), or a fraction of the measured peak of keeping
      everything, as a float in (0, 1] or a percentage ("50%"). The chain is
      measured on `sample_input`, and the planner picks the fastest choice
      that fits, checked by measurement (`checked_plan`); when nothing else
      fits, that may be layers rematerialized with their own layers nested
      inside their reruns. Every variable of `layers` is left as it was.
    sample_input: a batch like the ones the chain will train on.
    verbose: 1 shows a progress bar while the chain is measured; 0 shows
      nothing.
    policy: with `segments`, the save policy (`tfremat.policies`) every
      rematerialized segment runs under.
    policies: with `budget`, the save policies the planner may choose for
      each rematerialized segment, besides recomputing everything: built-in
      names or `tfremat.policies` values, your own included (default:
      `tfremat.policies.PLANNED`; () for none). Each is measured on every
      layer.
    settings: with `budget`, the planner's `tfremat.planner.Settings`.

  Returns:
    A `RematSequential` layer; `.plan` holds the planner's Plan when a budget
    was given (also after saving and loading), else None; `.plan.search`
    what it measured to choose (until saved).

  Raises:
    ValueError, TypeError: bad arguments, before anything is measured.
    tfremat.errors.BudgetUnreachableError (a ValueError): no plan fits the
      budget; its `lowest_fraction` is the lowest bound measured, as a
      fraction of keeping everything's peak (`checked_plan`).
  """
  if (segments is None) == (budget is None):
    raise errors.InvalidArgumentError(
        "remat_sequential: give either segments (an int or \"sqrt\") or "
        "budget with sample_input, not both or neither.")
  layers = layers_lib.keras_layers(layers, "remat_sequential", chain=True)
  if segments is not None:
    return RematSequential(layers, uniform_segments(len(layers), segments),
                           policy=policy)
  budget, policies = planning_arguments("remat_sequential", budget,
                                        sample_input, policies, policy)
  chosen = checked_plan(layers, budget, sample_input, verbose=verbose,
                        policies=policies, settings=settings)
  return apply_plan(layers, chosen)


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


def checked_plan(layers, budget, sample_input, costs=None, verbose=0,
                 policies=(), settings=search.DEFAULT_SETTINGS):
  """The planner's plan for `layers`, checked by measuring training steps on
  `sample_input`.

  Args:
    layers: the chain: Keras layers or a `keras.Sequential`.
    budget: the budget for a training step's peak, in any form
      `tfremat.planner.Budget.parse` reads (bytes, "200MiB", 0.5, "50%"); a
      fraction is of the measured peak of keeping everything.
    sample_input: the batch to measure on (in a `tf.distribute` strategy's
      scope, one replica's: every replica steps on all of it).
    costs: `measure_chain(layers, sample_input)`, if already known.
    verbose: 1 shows a progress bar over the measurements.
    policies: save policies (names or values) the planner may choose for a
      rematerialized segment (measured on each layer unless `costs` is
      given).
    settings: the planner's `tfremat.planner.Settings`.

  Keeping everything is measured first, before any layer: a budget below
  the weight gradients its step returns plus their reserve is refused then.
  Every candidate is measured as `apply_plan` runs it (kept layers gated)
  over `settings.check_calls` training steps. Layers whose own layers are
  worth rematerializing one at a time inside their reruns (`nest_target`: a
  transformer layer's attention and feed-forward layers) may be nested in
  the lowest plan, measured before a budget is refused (docs/design.md,
  "How the planner chooses").

  Every variable of `layers` is left as it was: measuring runs training
  steps, which move BatchNormalization statistics and advance dropout seed
  generators, so their values are put back afterwards.

  Returns:
    The `tfremat.planner.Plan`; its `search` says what was measured.

  Raises:
    ValueError: no plan measured fits the budget, or the weight gradients
      put it out of reach: a `tfremat.errors.BudgetUnreachableError`, whose
      message gives the lowest bound and what holds it up, whose
      `lowest_fraction` is that bound as a fraction of keeping
      everything's peak, and whose `search` is what was measured.
  """
  layers = layers_lib.keras_layers(layers, "checked_plan", chain=True)
  budget = Budget.parse(budget)
  # Each layer, keeping everything, the rounds' plans, every layer alone
  # and, before refusing, the lowest plan (the bar is filled at the end when
  # those are not needed).
  steps = (len(layers) if costs is None else 0) + 1 + settings.rounds + 2
  progress = measure.progress_bar(steps, "measurement", verbose)

  def measured(candidate, **kwargs):
    peaks = measure_peaks(apply_plan(layers, candidate),
                          sample_input, calls=settings.check_calls, **kwargs)
    if progress is not None:
      progress.add(1)
    return peaks

  keep, gradients = search.Candidate(tuple(keep_all(len(layers)))), []
  if costs is None:
    costs = _CostsOnDemand(len(layers), lambda: measure_chain(
        layers, sample_input, progress=progress, policies=policies,
        waiting_fraction=settings.waiting_fraction))
  with _variables_restored(layers, sample_input), retracing_quiet():
    # Keeping everything first, with its weight gradients' bytes: a budget
    # below them is refused before any layer is measured.
    keep_peaks = measured(keep, gradients=gradients)
    chosen = search.calibrated_plan(
        costs, budget, lambda c: keep_peaks if c == keep else measured(c),
        nestable=[in_place.can_nest(nest_target(l)) for l in layers],
        gradient_bytes=sum(gradients), settings=settings)
  if progress is not None:
    progress.update(progress.target, finalize=True)
  return chosen


class _CostsOnDemand(collections.abc.Sequence):
  """A chain's LayerCosts, measured when first read (`checked_plan`)."""

  def __init__(self, num_layers, measure_them):
    self._num_layers = num_layers
    self._measured = functools.cache(measure_them)

  def __len__(self):
    return self._num_layers

  def __getitem__(self, index):
    return self._measured()[index]


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


def _variables_restored(layers, sample_input):
  """`measure.restoring` every variable of `layers`. Unbuilt layers are
  built first by an inference call, which changes no state, so that their
  variables exist to be restored."""
  x = sample_input
  for layer in layers:
    x = layer(x)
  del x  # Held through the measurements, it would shift their peaks.
  return measure.restoring([v for layer in layers for v in layer.variables])
