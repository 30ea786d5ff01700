"""Rematerialize layers where they are, so that the model keeps its class.

  lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor)
  tfremat.remat_in_place(lm.backbone.transformer_layers)
  lm.fit(strings)          # the same object: fit, generate, save, presets

`remat_model` builds a new functional model around the chosen layers, which
loses a model's own class (a KerasHub task's `generate()`, its preprocessor,
its presets). Here nothing is rebuilt: each chosen layer is given Keras's own
rematerialization hook (the one `keras.RematScope` sets, which on TensorFlow
runs `tf.recompute_grad`), routed to `RematerializeFn` instead, so its
gradients are exact under dropout and its state updates once.
"""

import contextlib
import functools

import keras
from keras.src.backend.common import global_state
from keras.src.backend.common import remat as keras_remat

from tfremat import errors
from tfremat._src.core import policies
from tfremat._src.core import remat
from tfremat._src.keras_api.layers import keras_layers

__all__ = [
    "remat_in_place",
    "undo_remat_in_place",
    "is_remat_in_place",
    "sublayers",
    "sublayers_rematerialized",
    "can_nest",
]

# Set on a layer remat_in_place rematerializes: its remat mode before.
_MARK = "_tfremat_remat_mode_before"
# Set on a layer rematerialized with nested=True: the sublayers it nested.
_NESTED = "_tfremat_nested_sublayers"


def _hook_missing():
  return not hasattr(keras.layers.Layer, "rematerialized_call")


def sublayers(layer):
  """`layer`'s own layers, one level down, that `remat_in_place` can
  rematerialize (a functional block's layers, a transformer layer's
  attention, feed-forward and normalization layers), in Keras's order."""
  return [l for l in layer._flatten_layers(  # pylint: disable=protected-access
      include_self=False, recursive=False)
          if isinstance(l, keras.layers.Layer) and
          not isinstance(l, keras.layers.InputLayer)]


def remat_in_place(layers, policy=None, nested=False):
  """Rematerializes each of `layers` in its model, without rebuilding it.

  Each layer's call then runs through `RematerializeFn` whenever it trains
  (`training=True`, as in `fit`): its activations are recomputed in the
  backward pass, exactly. Called otherwise (`predict`, `generate()`), it runs
  as before. The model object, its class, its config and its saved file are
  unchanged: a model saved and loaded again is not rematerialized until this
  is called on it again.

  Choose the repeated blocks, whose outputs are small beside what they keep:
  a transformer's blocks (a KerasHub backbone's `transformer_layers`), a
  CNN's stages. Rematerializing a whole model as one layer saves nothing.

  With `nested=True`, each layer's own sublayers (one level down: a
  transformer layer's attention, feed-forward and normalization layers) are
  rematerialized too, inside its rerun. The layer's rerun then keeps only
  their outputs, and each sublayer's activations are recomputed once more
  when its own backward pass comes: a lower peak where a layer holds several
  large working sets, for one more forward pass of its sublayers.

  Args:
    layers: a Keras 3 layer or an iterable of them.
    policy: what each layer keeps from the forward pass instead of
      recomputing it (`tfremat.policies`), or None to keep nothing but its
      inputs (or follow an enclosing `tfremat.policies.scope`).
    nested: also rematerialize each layer's own layers (one level down;
      not Keras input layers), with the same policy.

  Returns:
    The list of layers, now rematerialized.

  Raises:
    TypeError: something other than Keras 3 layers; Keras 2 (tf_keras)
      layers are named as such; `nested` not a bool.
    ValueError: an unknown policy.
    RuntimeError: a Keras without the layer hook this relies on (Keras
      3.9 added it).
  """
  layers = keras_layers(layers, "remat_in_place")
  policy = policies.parsed(policy)
  if _hook_missing():
    raise errors.UnsupportedError(
        f"remat_in_place needs Keras's layer rematerialization hook "
        f"(Layer.rematerialized_call, Keras 3.9 and later); this is Keras "
        f"{keras.__version__}. Upgrade Keras, or use tfremat.remat_model.")
  if not isinstance(nested, bool):
    raise errors.InvalidTypeError(
        f"remat_in_place: nested is True or False; got {nested!r}.")
  for layer in layers:
    _mark(layer, policy)
    if nested:
      inner = [l for l in sublayers(layer) if l not in layers]
      for sublayer in inner:
        _mark(sublayer, policy)
      object.__setattr__(layer, _NESTED, tuple(
          dict.fromkeys(getattr(layer, _NESTED, ()) + tuple(inner))))
  return layers


@contextlib.contextmanager
def sublayers_rematerialized(layers, policy=None):
  """While the block runs, each of `layers`' own layers (`sublayers`) is
  rematerialized as `remat_in_place` does it, unless it already is; after
  it, they run as before. A nested segment of a planned chain
  (`tfremat.planner.Segment.nested`) runs its layers so, in its forward
  pass and again in its rerun. Without Keras's layer hook (before Keras
  3.9), nothing is nested."""
  marked = []
  if not _hook_missing():
    for layer in layers:
      for sublayer in sublayers(layer):
        if not is_remat_in_place(sublayer) and sublayer not in marked:
          _mark(sublayer, policy)
          marked.append(sublayer)
  try:
    yield
  finally:
    for sublayer in marked:
      _unmark(sublayer)


def can_nest(layer):
  """Whether nesting `layer` can lower its rerun's peak: it has at least two
  layers of its own, and one of them has layers of its own (a transformer
  layer's attention, a block's MLP). Nested, a layer reruns keeping its
  input, the output of the layer before it, which the plain rerun holds
  anyway; only what a layer keeps inside it is saved. A chain of single
  layers (a CNN block's convolutions, normalizations and activations)
  keeps little inside each, so nesting it would cost a forward pass for
  next to nothing."""
  own = sublayers(layer)
  return (not _hook_missing() and len(own) >= 2 and
          any(sublayers(l) for l in own))


def _mark(layer, policy):
  """Gives `layer` the hook that rematerializes it."""
  # Attributes of this object only, set past Keras's attribute tracking: the
  # layer's class, config and weights stay as they are. The remat mode a
  # keras.RematScope gave the layer is kept for undo_remat_in_place.
  if not hasattr(layer, _MARK):
    object.__setattr__(layer, _MARK, getattr(layer, "_remat_mode", None))
  object.__setattr__(layer, "_remat_mode",
                     keras_remat.RematMode("full", None, None))
  object.__setattr__(layer, "rematerialized_call",
                     functools.partial(_rematerialized_call, layer, policy))


def undo_remat_in_place(layers):
  """Undoes `remat_in_place` on `layers` (and on the sublayers it nested in
  them): they run as they did before."""
  for layer in keras_layers(layers, "undo_remat_in_place"):
    for sublayer in getattr(layer, _NESTED, ()):
      _unmark(sublayer)
    if hasattr(layer, _NESTED):
      object.__delattr__(layer, _NESTED)
    _unmark(layer)
  return None


def _unmark(layer):
  if hasattr(layer, _MARK):
    object.__delattr__(layer, "rematerialized_call")
    object.__setattr__(layer, "_remat_mode", getattr(layer, _MARK))
    object.__delattr__(layer, _MARK)


def is_remat_in_place(layer):
  """Whether `remat_in_place` rematerializes `layer`."""
  return hasattr(layer, _MARK)


def _training(kwargs):
  """Whether this call trains: its `training` argument, or else the one
  Keras's call context carries for layers whose call takes none."""
  training = kwargs.get("training")
  if training is None:
    context = global_state.get_global_attribute("current_call_ctx")
    training = getattr(context, "training", None)
  return training is not None and training is not False


def _rematerialized_call(layer, policy, call, *args, **kwargs):
  """Keras's hook: returns the function Keras calls in place of `call`."""
  del args, kwargs  # Keras passes them to size outputs; all are chosen here.

  def rematerialized(*args, **kwargs):
    if not _training(kwargs):
      return call(*args, **kwargs)
    outputs, losses = remat.rematerialize_with_losses(
        lambda args, kwargs: call(*args, **kwargs), (args, kwargs),
        on_losses=lambda losses: None, policy=policy)
    for _, loss in losses:  # Sublayers' activity regularizers, as outputs.
      layer.add_loss(loss)
    return outputs

  return rematerialized
