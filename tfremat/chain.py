"""Chains of layers with chosen rematerialization, and measuring them.

  chain = tfremat.remat_sequential(blocks, segments="sqrt")
  chain = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)
  print(chain.plan)

`RematSequential` runs a chain of Keras layers, rematerializing the chosen
segments. `remat_sequential` chooses them: uniformly, or for a memory budget
by measuring the chain (`measure_chain`) and asking the planner
(`tfremat.planner`), whose choice `checked_plan` checks by measurement.
"""

import collections.abc
import contextlib
import dataclasses
import functools

import tensorflow as tf

from tfremat import errors
from tfremat import measure
from tfremat import planner
from tfremat import policies as policies_lib
from tfremat._src import in_place
from tfremat._src import layers as layers_lib
# The chain's layers and its measuring live in tfremat._src; these are their
# public names.
from tfremat._src.chain_layers import ContextSegment
from tfremat._src.chain_layers import ContextUnit
from tfremat._src.chain_layers import RematSequential
from tfremat._src.chain_layers import nest_target
from tfremat._src.chain_measure import CHECK_CALLS
from tfremat._src.chain_measure import PLANNED_ORDER
from tfremat._src.chain_measure import WAITING_FRACTION
from tfremat._src.chain_measure import WAITING_PROBE_LAYERS
from tfremat._src.chain_measure import measure_chain
from tfremat._src.chain_measure import measure_layer
from tfremat._src.chain_measure import measure_peak
from tfremat._src.chain_measure import measure_peaks
from tfremat._src.chain_measure import structure_key
from tfremat._src.chain_measure import training_step

__all__ = [
    "ContextUnit",
    "ContextSegment",
    "nest_target",
    "RematSequential",
    "remat_sequential",
    "planned_policies",
    "checked_plan",
    "retracing_quiet",
    "training_step",
    "measure_layer",
    "measure_peak",
    "measure_peaks",
    "structure_key",
    "measure_chain",
    "PLANNED_ORDER",
    "CHECK_CALLS",
    "WAITING_FRACTION",
    "WAITING_PROBE_LAYERS",
]


def remat_sequential(layers, segments=None, budget=None, sample_input=None,
                     verbose=1, policy=None, policies=policies_lib.PLANNED):
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

  Returns:
    A `RematSequential` layer; `.plan` holds the planner's Plan when a budget
    was given (also after saving and loading), else None.

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
    return RematSequential(layers,
                           planner.uniform_segments(len(layers), segments),
                           policy=policy)
  budget, policies = planning_arguments("remat_sequential", budget,
                                        sample_input, policies, policy)
  chosen = checked_plan(layers, budget, sample_input, verbose=verbose,
                        policies=policies)
  return RematSequential(layers, segments_with(chosen.segments, policies),
                         plan=chosen,
                         ordered=chosen.ordered)


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
  budget = planner.Budget.parse(budget)
  if sample_input is None:
    raise errors.InvalidArgumentError(
        f"{caller}: budget needs sample_input, a batch like those it will "
        "train on, to measure on.")
  return budget, policies


def planned_policies(policies):
  """`policies` as a tuple, each a built-in's name or a policy value
  (`tfremat.policies`), with distinct names (`tfremat.policies.name_of`,
  the key of a layer's costs under it); TypeError/ValueError."""
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
        f"{list(policies_lib.PLANNED)}); recomputing everything is always "
        "among the choices.")
  names = [policies_lib.name_of(p) for p in policies]
  if len(set(names)) < len(names):
    raise errors.InvalidArgumentError(
        f"The planner's policies need distinct names; got {names}.")
  return policies


def segments_with(segments, policies):
  """`segments` (a Plan's, whose policies are names: the keys of the
  layers' costs) with each name replaced by the policy in `policies` it
  names, so that a user's policy runs as itself."""
  by_name = {policies_lib.name_of(p): p for p in policies}
  return [dataclasses.replace(s, policy=by_name.get(s.policy, s.policy))
          for s in segments]


def checked_plan(layers, budget, sample_input, rounds=4, costs=None,
                 verbose=0, policies=()):
  """The planner's plan for `layers`, checked by measuring training steps on
  `sample_input` (`planner.calibrated_plan`).

  Args:
    layers: the chain: Keras layers or a `keras.Sequential`.
    budget: the budget for a training step's peak, in any form
      `planner.Budget.parse` reads (bytes, "200MiB", 0.5, "50%"); a fraction
      is of the measured peak of keeping everything.
    sample_input: the batch to measure on (in a `tf.distribute` strategy's
      scope, one replica's: every replica steps on all of it).
    rounds: how many plans to measure at most.
    costs: `measure_chain(layers, sample_input)`, if already known.
    verbose: 1 shows a progress bar over the measurements.
    policies: save policies (names or values) the planner may choose for a
      rematerialized segment (measured on each layer unless `costs` is
      given).

  Keeping everything is measured first, before any layer: a budget below
  the weight gradients its step returns plus the allocator margin is
  refused then (`planner.gradients_floor_error`).

  Layers whose own layers are worth rematerializing one at a time inside
  their reruns (`nest_target`: a transformer layer's attention and
  feed-forward layers) may be nested in the lowest plan, measured before a
  budget is refused (`planner.calibrated_plan`, step 5).

  Every variable of `layers` is left as it was: measuring runs training
  steps, which move BatchNormalization statistics and advance dropout seed
  generators, so their values are put back afterwards.

  Raises:
    ValueError: no plan measured fits the budget, or the weight gradients
      put it out of reach: a `tfremat.errors.BudgetUnreachableError`, whose
      message gives the lowest bound and what holds it up, and whose
      `lowest_fraction` is that bound as a fraction of keeping
      everything's peak.
  """
  layers = layers_lib.keras_layers(layers, "checked_plan", chain=True)
  budget = planner.Budget.parse(budget)
  # Each layer, keeping everything, the rounds' plans, every layer alone
  # and, before refusing, the lowest plan (the bar is filled at the end when
  # those are not needed).
  steps = (len(layers) if costs is None else 0) + 1 + rounds + 2
  progress = measure.progress_bar(steps, "measurement", verbose)

  def measured_peak(segments, ordered=PLANNED_ORDER, **kwargs):
    peaks = measure_peaks(RematSequential(
        layers, segments_with(segments, policies), ordered=ordered),
                          sample_input, calls=CHECK_CALLS, **kwargs)
    if progress is not None:
      progress.add(1)
    return peaks

  keep, gradients = planner.keep_all(len(layers)), []
  if costs is None:
    costs = _CostsOnDemand(len(layers), lambda: measure_chain(
        layers, sample_input, progress=progress, policies=policies))
  with _variables_restored(layers, sample_input), retracing_quiet():
    # Keeping everything first, with its weight gradients' bytes: a budget
    # below them is refused before any layer is measured.
    keep_peaks = measured_peak(keep, gradients=gradients)
    chosen = planner.calibrated_plan(
        costs, budget,
        lambda s: keep_peaks if s == keep else measured_peak(s), rounds,
        nestable=[in_place.can_nest(nest_target(l)) for l in layers],
        gradient_bytes=sum(gradients),
        measured_ordered=lambda s: measured_peak(s, ordered=True))
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
