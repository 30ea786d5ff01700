"""Rematerialize a whole Keras model in one call: `tfremat.remat_model`, by
mode (`keras_api.remat_model`) or for a memory budget (planned on the
model's chain of units, measured on its own training step)."""

import keras

from tfremat import errors
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import model_chain
from tfremat._src.keras_api import remat_model as by_mode
from tfremat._src.keras_api.layers import refuse_keras2
from tfremat._src.planning import apply
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning import search
from tfremat._src.planning.runner import ModelRunner

__all__ = [
    "remat_model",
    "model_chain_of",
    "model_runner",
]


def remat_model(model, mode="full", output_size_threshold=1024,
                layer_names=None, policy=None, budget=None, sample_input=None,
                sample_target=None, policies=policies_lib.PLANNED, verbose=1,
                settings=None):
  """`model` with the chosen layers rematerialized.

  Args:
    model: a built `keras.Sequential` or functional `keras.Model`.
    mode: which layers, with `keras.RematScope`'s meanings:
      "full": every layer of `model`; a nested model (a transformer block
        built as a functional model, say) is rematerialized as one unit.
        Where the model is a chain of small parts (`chain_units`: a CNN's
        single layers), consecutive parts are grouped into rematerialized
        segments of one `tfremat.RematSequential`, as a layer alone would
        keep its input, the previous layer's output; layers before the
        chain's first cut and after its last are then kept.
      "larger_than": every layer of `model` (a nested model as one unit)
        whose output has more than `output_size_threshold` elements, sized
        on `sample_input` when given, else with each unknown dimension
        (batch, sequence length) counted as 1. On a chain of small parts,
        runs of consecutive selected parts are grouped as for "full".
      "activations": the activation function of every layer that has one
        (`Dense(..., activation="gelu")`), inside nested models too, where
        recomputing it frees memory; the rest of each such layer's call is
        kept. Functions whose gradient reads only their output (relu, tanh,
        sigmoid, softmax) or only their input (silu, softplus) are left, as
        are `keras.layers.Activation` layers: recomputed, they would keep
        their input besides.
      "list_of_layers": the layers named in `layer_names`, at any depth (a
        nested model's name wraps the whole nested model).
    output_size_threshold: for "larger_than".
    layer_names: for "list_of_layers".
    policy: the save policy (`tfremat.policies`) of every rematerialized
      unit (not for "activations", which recompute activation functions
      only).
    budget: instead of `mode`, a memory budget for training: bytes (an int,
      "6GiB") count everything training holds, the weights, the
      optimizer's state (with `sample_target`) and the batch, and the
      training step's own tensors; a fraction (0.5, "50%") is of the step's
      own predicted peak keeping everything, beyond what is held, at each
      shape
      (where no plan reaches it, as at a batch of a few rows, the lowest
      plan runs if it fits the fraction's bytes at the sample). The model
      is cut at the tensors every path from its inputs to its outputs
      passes through (the residual stream between transformer blocks,
      say), the parts between consecutive cuts form a chain, and the
      planner chooses which to keep, rematerialize fully or rematerialize
      under one of `policies` (`chain_units` shows the cuts). The parts
      before the first cut and after the last are kept. At every input
      shape, its chain runs the first of the plan's variants predicted
      within the budget there (`tfremat.planner.Plan.segments_at`: keeping
      more where the shape is smaller), chosen in the step by the shape it
      runs at once Keras traces the step for any shape, and the step raises
      naming the shape where none is (tests/budget_shapes_test.py checks
      this through `fit` and `train_on_batch`).
    sample_input: with `budget`, a batch like those the model trains on
      (under a `tf.distribute` strategy's scope, one replica's batch: each
      planned step runs in every replica on all of it). With
      mode="larger_than", a batch on which outputs are sized (one inference
      call); without it, an unknown dimension counts as 1.
    sample_target: with `budget`, the targets of `sample_input`: the plan
      is predicted and checked on what `model.train_on_batch(sample_input,
      sample_target)` runs, the model's loss and its optimizer's update
      (`model` must be compiled). Without it, on a stand-in step: the
      gradient of sum(y**2)/2 of the model's outputs, no loss, no
      optimizer. The plan's printout and its `search` say which.
    policies: with `budget`, the save policies the planner may choose
      (built-in names or `tfremat.policies` values, your own included).
    verbose: with `budget`, 1 shows a progress bar while planning.
    settings: with `budget`, the planner's `tfremat.planner.Settings`
      (None: the shipped defaults).

  Returns:
    A new model of the same kind, built from the same layer objects (no
    copies: its weights are `model`'s, and training it trains `model`),
    computing the same function with exact gradients; compiled as `model`
    was, with `model`'s own optimizer, where `model` was compiled (else
    uncompiled). Nested models that contain chosen layers are rebuilt the
    same way. It saves to `.keras` and loads without custom objects, as
    far as its layers give their configurations: where `model` writes its
    own (a KerasHub backbone) and one of its layers cannot, a warning says
    so and names `tfremat.remat_in_place`, which keeps `model` itself.

  Raises:
    TypeError, ValueError: a subclassed or unbuilt model, an unknown mode,
      threshold or layer name, a `sample_target` for a model that is not
      compiled; raised before anything is built.
    tfremat.errors.BudgetUnreachableError (a ValueError): no plan fits
      `budget`; its `lowest_fraction` is the lowest bound predicted, as a
      fraction of the original's peak. The model is left as it was.
  """
  refuse_keras2(model, "remat_model")
  if budget is not None:
    result = _planned(model, budget, sample_input, sample_target, policies,
                      verbose, mode=mode, policy=policy,
                      layer_names=layer_names, settings=settings)
  else:
    if sample_target is not None:
      raise errors.InvalidArgumentError(
          "remat_model: sample_target is for budget=, which measures "
          "model.train_on_batch(sample_input, sample_target).")
    result = by_mode.remat_by_mode(model, mode, output_size_threshold,
                                   layer_names, policy, sample_input)
  by_mode.warn_if_unsaveable(model, result)
  return apply.compiled_like(result, model)


def model_chain_of(model, caller="remat_model"):
  """`(ModelChain, units)`: the model's chain and the units the planner
  chooses between (`model_chain.planning_units`); ValueError naming the
  fix for a model that is not a chain of two units or more."""
  by_mode.check_model(model)
  parts = model_chain.ModelChain.of(model)
  if parts is None:
    raise errors.InvalidArgumentError(
        f"{caller}: {model.name} has fewer than two parts between "
        "tensors that every path from its inputs to its outputs passes "
        "through, so there is nothing for a budget to choose between. "
        "Give mode= instead (\"full\" rematerializes its layers one by "
        "one).")
  return parts, model_chain.planning_units(parts, model.name)


def model_runner(model, parts, units, sample_target, caller):
  """The runner and `budget.Chain` that plan `model`: on its own
  `train_on_batch` given targets (it must be compiled), else on the
  stand-in step."""
  if sample_target is not None and not apply.is_compiled(model):
    raise errors.InvalidArgumentError(
        f"{caller}: sample_target measures model.train_on_batch(x, y), "
        f"which needs a compiled model: call {model.name}.compile("
        "optimizer=..., loss=...) first, or leave out sample_target to "
        "plan on the stand-in step (no loss, no optimizer).")
  context = None
  if parts.context:
    context = lambda x: keras.tree.flatten(parts.context_of(x))
  chain = budget_lib.Chain(tuple(units), parts.prefix, context)
  return ModelRunner(model, parts, units, sample_target is not None), chain


def _planned(model, budget, sample_input, sample_target, policy_names,
             verbose, mode, policy, layer_names, settings=None):
  """`remat_model(model, budget=...)`: the planner's choice on the model's
  chain of parts."""
  if mode != "full" or policy is not None or layer_names is not None:
    raise errors.InvalidArgumentError(
        "remat_model: with budget= the planner chooses what to "
        "rematerialize and under which policy; leave mode, policy and "
        "layer_names unset (name the policies it may use with policies=).")
  budget, policy_names = budget_lib.planning_arguments(
      "remat_model", budget, sample_input, policy_names)
  parts, units = model_chain_of(model)
  runner, chain = model_runner(model, parts, units, sample_target,
                               "remat_model")
  chosen = budget_lib.plan_budget(
      chain, runner, budget_lib.sample_batch(sample_input, sample_target),
      budget, policies=policy_names, verbose=verbose,
      settings=settings or search.DEFAULT_SETTINGS)
  return apply.apply_plan(units, chosen, chain=parts,
                          name=f"{model.name}_chain")
