"""Rematerialize a whole Keras model in one call.

  model = keras.Model(inputs, outputs)          # Sequential or functional
  rematerialized = tfremat.remat_model(model, mode="larger_than",
                                       output_size_threshold=2**16)
  rematerialized.compile(...)
  rematerialized.fit(...)                       # trains `model`'s weights

The result computes the same function with the same layer objects: the chosen
layers run inside `RematerializationLayer` (or, in "activations" mode, only
their activation functions run through `RematerializeFn`), so their
activations are recomputed in the backward pass, exactly. The modes mean what
`keras.RematScope`'s do.
"""

import difflib
import functools
import math

import keras
from keras.src.models import functional

from tfremat import policies
from tfremat import remat
from tfremat.layers import RematerializationLayer

MODES = ("full", "activations", "larger_than", "list_of_layers")


@keras.saving.register_keras_serializable(package="tfremat")
class RematerializeActivation(keras.layers.Wrapper):
  """Runs a layer with only its activation function rematerialized.

  The layer's `activation` is recomputed in the backward pass; the rest of
  its call (the matrix product of a Dense, say) is kept as without remat,
  as under `keras.RematScope(mode="activations")`.
  """

  def __init__(self, layer, **kwargs):
    if getattr(layer, "activation", None) is None:
      raise ValueError(
          f"RematerializeActivation needs a layer with an activation; "
          f"{layer.name} ({type(layer).__name__}) has none.")
    kwargs.setdefault("name", f"remat_activation_{layer.name}")
    super().__init__(layer, **kwargs)

  def build(self, input_shape=None):
    if not self.layer.built:
      self.layer.build(input_shape)
    self.built = True

  def call(self, inputs, *args, **kwargs):
    activation = self.layer.activation
    self.layer.activation = lambda h: remat.RematerializeFn(activation, h)
    try:
      return self.layer(inputs, *args, **kwargs)
    finally:
      self.layer.activation = activation

  def compute_output_shape(self, *args, **kwargs):
    return self.layer.compute_output_shape(*args, **kwargs)

  def compute_output_spec(self, *args, **kwargs):
    return self.layer.compute_output_spec(*args, **kwargs)


def _output_size(layer):
  """The largest output of `layer` over its calls, in elements, counting an
  unknown dimension as 1 (as keras.RematScope does)."""
  sizes = [0]
  for node in layer._inbound_nodes:  # pylint: disable=protected-access
    sizes.append(sum(math.prod(d or 1 for d in t.shape)
                     for t in keras.tree.flatten(node.outputs)))
  return max(sizes)


def _is_graph_model(layer):
  return isinstance(layer, (keras.Sequential, functional.Functional))


def _own_layers(model):
  """The model's layers: not its inputs, nor the plain operations (`h + y`
  on symbolic tensors) that a functional model records beside them."""
  return [l for l in model.layers if isinstance(l, keras.layers.Layer) and
          not isinstance(l, keras.layers.InputLayer)]


def _all_layers(model):
  """The model's layers and, recursively, those of its nested models."""
  found = []
  for layer in _own_layers(model):
    found.append(layer)
    if _is_graph_model(layer):
      found += _all_layers(layer)
  return found


def _check(model, mode, output_size_threshold, layer_names):
  """Raises on bad arguments, before anything is built."""
  if not _is_graph_model(model):
    raise TypeError(
        "remat_model needs a keras.Sequential or a functional keras.Model; "
        f"got {type(model).__name__}. For a subclassed model, wrap its "
        "blocks in tfremat.RematerializationLayer where it builds them.")
  if not model.built or not getattr(model, "inputs", None):
    raise ValueError(
        "remat_model needs a built model with known inputs: give a "
        "Sequential an Input (or call build) first.")
  if mode not in MODES:
    raise ValueError(
        f"remat_model: mode must be one of {', '.join(MODES)}; got {mode!r}.")
  if mode == "larger_than" and (
      isinstance(output_size_threshold, bool) or
      not isinstance(output_size_threshold, int) or output_size_threshold < 0):
    raise ValueError(
        "remat_model: output_size_threshold must be a non-negative int (a "
        f"number of elements); got {output_size_threshold!r}.")
  if mode == "list_of_layers":
    if isinstance(layer_names, str) or not layer_names:
      raise ValueError(
          "remat_model: mode=\"list_of_layers\" needs layer_names, a "
          f"non-empty list of layer names; got {layer_names!r}.")
    names = {l.name for l in _all_layers(model)}
    unknown = [n for n in layer_names if n not in names]
    if unknown:
      hints = {n: difflib.get_close_matches(n, sorted(names), n=2)
               for n in unknown}
      raise ValueError(
          f"remat_model: no layers named {unknown} in {model.name} (close: "
          f"{hints}). Its layers: {', '.join(sorted(names))}.")
  elif layer_names is not None:
    raise ValueError(
        f"remat_model: layer_names is for mode=\"list_of_layers\", not "
        f"{mode!r}.")


def remat_model(model, mode="full", output_size_threshold=1024,
                layer_names=None, policy=None):
  """`model` with the chosen layers rematerialized.

  Args:
    model: a built `keras.Sequential` or functional `keras.Model`.
    mode: which layers, with `keras.RematScope`'s meanings:
      "full": every layer of `model`; a nested model (a transformer block
        built as a functional model, say) is rematerialized as one unit.
      "larger_than": every layer of `model` (a nested model as one unit)
        whose output has more than `output_size_threshold` elements (an
        unknown batch dimension counts as 1).
      "activations": the activation function of every layer that has one
        (`Dense(..., activation="relu")`), inside nested models too; the
        rest of each such layer's call is kept.
      "list_of_layers": the layers named in `layer_names`, at any depth (a
        nested model's name wraps the whole nested model).
    output_size_threshold: for "larger_than".
    layer_names: for "list_of_layers".
    policy: the save policy (`tfremat.policies`) of every rematerialized
      unit (not for "activations", which recompute activation functions
      only).

  Returns:
    A new model of the same kind, built from the same layer objects (no
    copies: its weights are `model`'s, and training it trains `model`),
    computing the same function with exact gradients. Nested models that
    contain chosen layers are rebuilt the same way. It saves to `.keras`
    and loads without custom objects.

  Raises:
    TypeError, ValueError: a subclassed or unbuilt model, an unknown mode,
      threshold or layer name; raised before anything is built.
  """
  _check(model, mode, output_size_threshold, layer_names)
  if policy is not None:
    if mode == "activations":
      raise ValueError(
          "remat_model: policy= is for rematerialized layers; "
          "mode=\"activations\" recomputes activation functions only, "
          "which keep nothing worth a policy.")
    policies.get(policy)  # A bad policy is refused before anything is built.
  if mode == "full":
    choose = lambda layer: True
  elif mode == "larger_than":
    choose = lambda layer: _output_size(layer) > output_size_threshold
  elif mode == "activations":
    choose = lambda layer: getattr(layer, "activation", None) is not None
  else:
    choose = lambda layer: layer.name in layer_names
  wrapper = (RematerializeActivation if mode == "activations" else
             functools.partial(RematerializationLayer, policy=policy))
  return _rematerialized(model, choose, wrapper,
                         recurse=mode in ("activations", "list_of_layers"))


def _rematerialized(model, choose, wrapper, recurse):

  def clone(layer):
    if (isinstance(layer, keras.layers.InputLayer) or
        not isinstance(layer, keras.layers.Layer)):
      return layer
    if choose(layer):
      return wrapper(layer)
    if recurse and _is_graph_model(layer) and any(
        choose(l) for l in _all_layers(layer)):
      return _rematerialized(layer, choose, wrapper, recurse)
    return layer

  return keras.models.clone_model(model, clone_function=clone)
