"""Planned chains (`tfremat.chain`): `remat_sequential`, and the planner's
plan for a chain checked by measuring its training steps (`checked_plan`)."""

from tfremat import errors
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import layers as layers_lib
from tfremat._src.keras_api.chain_layers import RematSequential
from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning import search
from tfremat._src.planning.apply import apply_plan
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.runner import ChainRunner

__all__ = [
    "remat_sequential",
    "checked_plan",
]


def remat_sequential(layers, segments=None, budget=None, sample_input=None,
                     verbose=1, policy=None, policies=policies_lib.PLANNED,
                     settings=search.DEFAULT_SETTINGS):
  """A Keras layer running `layers` in order, with chosen rematerialization.

  Either uniform segments:

    chain = tfremat.remat_sequential(blocks, segments="sqrt")

  or the planner's choice for a memory budget, planned on a sample batch:

    chain = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)
    print(chain.plan)

  Args:
    layers: Keras layers, each taking the previous one's output, or a
      `keras.Sequential` of them.
    segments: an int, or "sqrt" for about sqrt(len(layers)) equal segments,
      every one rematerialized (Chen et al. 2016).
    budget: instead of `segments`, a memory budget, planned on
      `sample_input` with the chain's stand-in training step (the gradient
      of sum(y**2)/2 of its output): bytes as an int or a string with a
      unit ("200MiB"), which count the chain's weights and the batch
      besides the step's tensors, or a fraction of the predicted peak of
      keeping everything, as a float in (0, 1] or a percentage ("50%"). The
      planner picks the fastest choice predicted to fit, checked by
      running it (`checked_plan`).
      Every variable of `layers` is left as it was.
    sample_input: a batch like the ones the chain will train on.
    verbose: 1 shows a progress bar while the chain is read; 0 shows
      nothing.
    policy: with `segments`, the save policy (`tfremat.policies`) every
      rematerialized segment runs under.
    policies: with `budget`, the save policies the planner may choose for
      each rematerialized segment, besides recomputing everything: built-in
      names or `tfremat.policies` values, your own included (default:
      `tfremat.policies.PLANNED`; () for none). Each is read on every
      layer.
    settings: with `budget`, the planner's `tfremat.planner.Settings`.

  Returns:
    A `RematSequential` layer; `.plan` holds the planner's Plan when a budget
    was given (also after saving and loading), else None; `.plan.search`
    what it predicted to choose (until saved). At every input shape it runs
    the first of the plan's variants predicted within the budget there
    (`tfremat.planner.Plan.segments_at`), chosen in the step by the shape
    it runs at where the step was traced for any shape, and raises where
    none is (tests/budget_shapes_test.py checks this through Keras's
    `fit`).

  Raises:
    ValueError, TypeError: bad arguments, before anything is traced.
    tfremat.errors.BudgetUnreachableError (a ValueError): no plan fits the
      budget; its `lowest_fraction` is the lowest bound predicted, as a
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
  budget, policies = budget_lib.planning_arguments(
      "remat_sequential", budget, sample_input, policies, policy)
  chosen = checked_plan(layers, budget, sample_input, verbose=verbose,
                        policies=policies, settings=settings)
  return apply_plan(layers, chosen)


def checked_plan(layers, budget, sample_input, costs=None, verbose=0,
                 policies=(), settings=search.DEFAULT_SETTINGS):
  """The planner's plan for `layers`, chosen on predicted training steps
on `sample_input` and checked by running the chosen one.

  Args:
    layers: the chain: Keras layers or a `keras.Sequential`.
    budget: the budget, in any form `tfremat.planner.Budget.parse` reads
      (bytes, "200MiB", 0.5, "50%"): bytes count the chain's weights and
      the batch besides the step's tensors; a fraction is of the predicted
      peak of keeping everything.
    sample_input: the batch to plan on (in a `tf.distribute` strategy's
      scope, one replica's: every replica steps on all of it).
    costs: the chain's `LayerCost`s, if already known (else read from each
      layer's traced programs: `measure_chain(..., read=True)`).
    verbose: 1 shows a progress bar over the layers read.
    policies: save policies (names or values) the planner may choose for a
      rematerialized segment.
    settings: the planner's `tfremat.planner.Settings`.

  Keeping everything's step is predicted first, before any layer is read:
  a budget below what is held plus the weight gradients its step returns
  and the margin is refused then. Every candidate is predicted as
  `apply_plan` runs it (kept layers gated), on the executor read from
  keeping everything's program, the plan chosen from its own
  (`tfremat.measure.predict_peak`), and held to the budget with
  `Plan.margin`; the plan chosen runs `settings.check_calls` training
  steps as a check (`Plan.measured`). Each layer's step is also traced
  with each axis of its input halved, for how its costs grow with the
  shape (`Plan.variants`; docs/design.md, "Every shape a step runs at").

  Every variable of `layers` is left as it was: the check runs training
  steps, which move BatchNormalization statistics and advance dropout seed
  generators, so their values are put back afterwards.

  Returns:
    The `tfremat.planner.Plan`; its `search` says what was predicted.

  Raises:
    ValueError: no plan is predicted to fit the budget, or the weight
      gradients put it out of reach: a
      `tfremat.errors.BudgetUnreachableError`, whose message gives the
      lowest bound and what holds it up, whose `lowest_fraction` is that
      bound as a fraction of keeping everything's peak, and whose `search`
      is what was predicted.
  """
  layers = layers_lib.keras_layers(layers, "checked_plan", chain=True)
  budget = Budget.parse(budget)
  return budget_lib.plan_budget(
      budget_lib.Chain(tuple(layers)), ChainRunner(layers),
      budget_lib.sample_batch(sample_input), budget,
      policies=budget_lib.planned_policies(policies), costs=costs,
      settings=settings, verbose=verbose)
