"""`keras.RematScope`, with tfremat's exact rematerialization.

  with tfremat.RematScope(mode="full"):
    blocks = [make_block() for _ in range(12)]   # made here: rematerialized
  model = build_model(blocks)                     # made here: as it is
  model.fit(...)

Keras gives every layer made inside a `keras.RematScope` a remat mode, and
calls the layer through its `rematerialized_call` hook, which on TensorFlow
runs `tf.recompute_grad`: its rerun draws new dropout masks and updates
BatchNormalization statistics again. Layers made inside a `tfremat.RematScope`
carry the same modes, marked as tfremat's; the hook routes them to
`RematerializeFn` instead, as `remat_in_place` does. Layers made in a
`keras.RematScope`, or in no scope, are left to Keras.
"""

import keras

from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import in_place
from tfremat._src.keras_api import model_chain
from tfremat._src.keras_api import remat_model

__all__ = ["RematScope"]

MODES = ("full", "activations", "larger_than", "list_of_layers", None)


class _Mode(str):
  """A remat mode that `tfremat.RematScope` set: equal to Keras's name for
  it, so that Keras treats it as its own, and carrying the save policy."""

  policy = None


class RematScope:
  """Rematerializes the layers made inside it, exactly, when they train.

  Used as `keras.RematScope` is, with its arguments and their meanings:
  each layer made inside the scope (not one made before it, called in it)
  is rematerialized by `RematerializeFn` whenever it is called with
  `training=True`, as in `fit`: its activations are recomputed in the
  backward pass, with the forward pass's dropout masks and one update of its
  state. Called otherwise (`predict`, `evaluate`), it runs as it is. A
  saved and loaded model is not rematerialized: as with Keras's scope, the
  mode belongs to the layer objects made in it.

  Args:
    mode: "full": every layer made inside (a block made inside, and the
      layers made inside it, each, nested); "larger_than": those whose
      output has more than `output_size_threshold` elements (an unknown
      dimension counted as 1); "activations": the activation function of
      each layer that has one, where recomputing it frees memory
      (`tfremat.remat_model` explains which); "list_of_layers": the layers
      named in `layer_names`; None: none (inside an enclosing scope).
    output_size_threshold: for "larger_than".
    layer_names: for "list_of_layers".
    policy: what each rematerialized layer keeps from its forward pass
      instead of recomputing it (`tfremat.policies`), or None.

  Raises:
    ValueError: an unknown mode or policy, or arguments for another mode;
      raised before the scope is entered.
  """

  def __init__(self, mode="full", output_size_threshold=1024,
               layer_names=None, policy=None):
    remat_model.check_mode_arguments("RematScope", mode, MODES,
                                     output_size_threshold, layer_names)
    policy = policies_lib.parsed(policy)  # An unknown policy is refused here.
    marked = None
    if mode is not None:
      marked = _Mode(mode)
      marked.policy = policy
    self._scope = keras.RematScope(
        mode=marked, output_size_threshold=output_size_threshold,
        layer_names=list(layer_names or ()))

  def __enter__(self):
    _route_keras_hook()
    self._scope.__enter__()
    return self

  def __exit__(self, *exc_info):
    self._scope.__exit__(*exc_info)


# Keras's own Layer.rematerialized_call, once routed.
_KERAS_HOOK = []


def _route_keras_hook():
  """Routes Keras's layer hook through `_hook`, once: layers without a
  tfremat mode still get Keras's own."""
  if not _KERAS_HOOK:
    _KERAS_HOOK.append(keras.layers.Layer.rematerialized_call)
    keras.layers.Layer.rematerialized_call = _hook


def _hook(layer, layer_call, *args, **kwargs):
  """What a layer runs in place of `layer_call` (Keras's hook)."""
  mode = getattr(getattr(layer, "_remat_mode", None), "mode", None)
  if not isinstance(mode, _Mode):
    return _KERAS_HOOK[0](layer, layer_call, *args, **kwargs)
  if (mode == "full" or
      (mode == "list_of_layers" and
       layer.name in layer._remat_mode.layer_names) or  # pylint: disable=protected-access
      (mode == "larger_than" and _output_size(layer, args, kwargs) >
       layer._remat_mode.output_size_threshold)):  # pylint: disable=protected-access
    return in_place._rematerialized_call(  # pylint: disable=protected-access
        layer, mode.policy, layer_call)
  if mode == "activations":
    # The layer's own activation, and those of the layers inside it that
    # carry no tfremat mode of their own (made outside the scope, in
    # `build`, say); the others recompute theirs themselves.
    inside = [l for l in remat_model.activation_layers(layer)
              if l is layer or not isinstance(getattr(
                  getattr(l, "_remat_mode", None), "mode", None), _Mode)]
    if inside:
      return _activation_call(inside, layer_call)
  return layer_call


def _output_size(layer, args, kwargs):
  """Elements of `layer`'s output on these arguments, an unknown dimension
  counted as 1 (as Keras's scope counts them); 0 if Keras cannot tell."""
  try:
    spec = layer.compute_output_spec(*args, **kwargs)
  except Exception:  # pylint: disable=broad-except
    return 0
  return model_chain.elements(
      [t for t in keras.tree.flatten(spec) if hasattr(t, "shape")])


def _activation_call(layers, layer_call):
  """`layer_call` with only the activation functions of `layers`
  rematerialized, when it trains."""

  def call(*args, **kwargs):
    if not in_place._training(kwargs):  # pylint: disable=protected-access
      return layer_call(*args, **kwargs)
    with remat_model.activations_rematerialized(layers):
      return layer_call(*args, **kwargs)

  return call
