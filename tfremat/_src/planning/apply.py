"""The one place a plan becomes layers, for every entry point:
`remat_sequential`, `remat_model`, `remat_in_place_for_budget`, the Lingvo
builder, `largest_batch` and the bench all apply their plans (and the
planner its candidates) through `apply_plan`, and a planned model is
compiled as the original was through `compiled_like`."""

import keras

from tfremat._src.keras_api import in_place
from tfremat._src.keras_api.chain_layers import RematSequential
from tfremat._src.planning.plan import Plan

__all__ = [
    "apply_plan",
    "compiled_like",
    "is_compiled",
]


def apply_plan(layers, plan, *, chain=None, place=False, **kwargs):
  """The chain `layers` run as `plan` says.

  Args:
    layers: the chain's Keras layers.
    plan: a `tfremat.planner.Plan`, or a candidate the planner measures
      (anything with `segments` and `ordered`); its segments' policies are
      values, a user's own included, and run as themselves.
    chain: a model's chain (`ModelChain`) whose units are `layers`: the
      model is rebuilt around the planned chain and returned.
    place: rematerialize `layers` where they are, in their model
      (`remat_in_place`, nested where a segment is), instead of building a
      chain: each rematerialized segment's layers under its policy.
    **kwargs: for the `RematSequential` (its `name`, say).

  Returns:
    A `RematSequential` with the plan's segments, nested ones included, run
    ordered if the plan is, every kept layer gated (`RematSequential`'s
    `gated`), and `.plan` the plan (when a Plan is given); with `chain`, the
    model around it; with `place`, the layers rematerialized in place.
  """
  if place:
    in_place.undo_remat_in_place(layers)
    for seg in plan.segments:
      if seg.remat:
        in_place.remat_in_place(layers[seg.start:seg.stop], policy=seg.policy,
                                nested=seg.nested)
    return [l for seg in plan.segments if seg.remat
            for l in layers[seg.start:seg.stop]]
  planned = RematSequential(layers, plan.segments,
                            plan=plan if isinstance(plan, Plan) else None,
                            ordered=plan.ordered, gated=True, **kwargs)
  return planned if chain is None else chain.model_with(planned)


def compiled_like(model, original):
  """`model` compiled as `original` was (its loss, metrics and settings),
  with `original`'s own optimizer, whose state then carries on: both
  models train the same variables. `model` as it is where `original` was
  not compiled."""
  if not getattr(original, "compiled", False):
    return model
  # pylint: disable-next=protected-access
  config = dict(original._compile_config.config)
  config["optimizer"] = original.optimizer
  model.compile(**config)
  return model


def is_compiled(model):
  """Whether `model` is a compiled Keras model (an optimizer and a loss)."""
  return (isinstance(model, keras.Model) and getattr(model, "compiled", False)
          and getattr(model, "optimizer", None) is not None)
