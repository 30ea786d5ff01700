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

import functools

import keras
from keras.src.backend.common import global_state
from keras.src.backend.common import remat as keras_remat

from tfremat import policies
from tfremat import remat
from tfremat.layers import refuse_keras2

__all__ = [
    "remat_in_place",
    "undo_remat_in_place",
    "is_remat_in_place",
]

# Set on a layer remat_in_place rematerializes: its remat mode before.
_MARK = "_tfremat_remat_mode_before"


def _layers(layers, caller):
  """`layers` as a list of Keras 3 layers, or a clear error."""
  if isinstance(layers, keras.layers.Layer):
    layers = [layers]
  try:
    layers = list(layers)
  except TypeError:
    layers = [layers]
  for layer in layers:
    refuse_keras2(layer, caller)
    if (not isinstance(layer, keras.layers.Layer) or
        isinstance(layer, keras.layers.InputLayer)):
      raise TypeError(
          f"{caller} takes Keras layers (or a list of them), such as a "
          "KerasHub backbone's `transformer_layers`; got "
          f"{type(layer).__name__}: {layer!r}.")
  return layers


def _hook_missing():
  return not hasattr(keras.layers.Layer, "rematerialized_call")


def remat_in_place(layers, policy=None):
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

  Args:
    layers: a Keras 3 layer or an iterable of them.
    policy: what each layer keeps from the forward pass instead of
      recomputing it (`tfremat.policies`), or None to keep nothing but its
      inputs (or follow an enclosing `tfremat.policies.scope`).

  Returns:
    The list of layers, now rematerialized.

  Raises:
    TypeError: something other than Keras 3 layers; Keras 2 (tf_keras)
      layers are named as such.
    ValueError: an unknown policy.
    RuntimeError: a Keras without the layer hook this relies on (Keras
      3.9 added it).
  """
  layers = _layers(layers, "remat_in_place")
  if policy is not None:
    policies.get(policy)
  if _hook_missing():
    raise RuntimeError(
        f"remat_in_place needs Keras's layer rematerialization hook "
        f"(Layer.rematerialized_call, Keras 3.9 and later); this is Keras "
        f"{keras.__version__}. Upgrade Keras, or use tfremat.remat_model.")
  for layer in layers:
    # Attributes of this object only, set past Keras's attribute tracking:
    # the layer's class, config and weights stay as they are. The remat mode
    # a keras.RematScope gave the layer is kept for undo_remat_in_place.
    if not hasattr(layer, _MARK):
      object.__setattr__(layer, _MARK, getattr(layer, "_remat_mode", None))
    object.__setattr__(layer, "_remat_mode",
                       keras_remat.RematMode("full", None, None))
    object.__setattr__(layer, "rematerialized_call",
                       functools.partial(_rematerialized_call, layer, policy))
  return layers


def undo_remat_in_place(layers):
  """Undoes `remat_in_place` on `layers`: they run as they did before."""
  for layer in _layers(layers, "undo_remat_in_place"):
    if hasattr(layer, _MARK):
      object.__delattr__(layer, "rematerialized_call")
      object.__setattr__(layer, "_remat_mode", getattr(layer, _MARK))
      object.__delattr__(layer, _MARK)
  return None


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
