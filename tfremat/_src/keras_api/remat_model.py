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
`keras.RematScope`'s do, except that "activations" leaves functions whose
recomputation would cost memory.
"""

import contextlib
import difflib
import functools
import math
import warnings

import keras
import tensorflow as tf

from tfremat import errors
from tfremat._src.core import policies as policies_lib
from tfremat._src.core import remat
from tfremat._src.keras_api import model_chain
from tfremat._src.keras_api.layers import RematerializationLayer
from tfremat._src.keras_api.model_chain import chain_units

__all__ = [
    "remat_by_mode",
    "check_model",
    "check_mode_arguments",
    "warn_if_unsaveable",
    "chain_units",
    "RematerializeActivation",
    "MODES",
]

MODES = ("full", "activations", "larger_than", "list_of_layers")


@keras.saving.register_keras_serializable(package="tfremat")
class RematerializeActivation(keras.layers.Wrapper):
  """Runs a layer with only its activation functions rematerialized.

  The activation of the layer, and of each layer inside it, whose
  recomputation frees memory (`activation_layers`) is recomputed in the
  backward pass; the rest of the call (the matrix product of a Dense, say)
  is kept as without remat, as under `keras.RematScope(mode="activations")`.
  """

  def __init__(self, layer, **kwargs):
    if not activation_layers(layer):
      raise errors.InvalidArgumentError(
          f"RematerializeActivation needs a layer with an activation whose "
          f"recomputation frees memory, its own or a layer's inside it; "
          f"{layer.name} ({type(layer).__name__}) has none.")
    kwargs.setdefault("name", f"remat_activation_{layer.name}")
    super().__init__(layer, **kwargs)

  def build(self, input_shape=None):
    if not self.layer.built:
      self.layer.build(input_shape)
    self.built = True

  def call(self, inputs, *args, **kwargs):
    with activations_rematerialized(activation_layers(self.layer)):
      return self.layer(inputs, *args, **kwargs)

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


def _output_sizes(model, sample_input):
  """Each of `model`'s own layers' largest output on `sample_input`, in
  elements: one inference call, recorded layer by layer."""
  graph = getattr(model, "_functional", None) or model  # A Sequential's.
  sizes = {}

  def recorded(operation):
    def call(*args, **kwargs):
      out = operation(*args, **kwargs)
      size = sum(math.prod(t.shape) for t in keras.tree.flatten(out))
      sizes[id(operation)] = max(sizes.get(id(operation), 0), size)
      return out
    return call

  graph._run_through_graph(  # pylint: disable=protected-access
      keras.tree.map_structure(keras.ops.convert_to_tensor, sample_input),
      operation_fn=recorded)
  return sizes


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
    if model_chain.is_graph_model(layer):
      found += _all_layers(layer)
  return found


def _check(model, mode, output_size_threshold, layer_names):
  """Raises on bad arguments, before anything is built."""
  if not model_chain.is_graph_model(model):
    raise errors.InvalidTypeError(
        "remat_model needs a keras.Sequential or a functional keras.Model; "
        f"got {type(model).__name__}. For a subclassed model, wrap its "
        "blocks in tfremat.RematerializationLayer where it builds them.")
  if not model.built or not getattr(model, "inputs", None):
    raise errors.InvalidArgumentError(
        "remat_model needs a built model with known inputs: give a "
        "Sequential an Input (or call build) first.")
  check_mode_arguments("remat_model", mode, MODES, output_size_threshold,
                       layer_names)
  if mode == "list_of_layers":
    names = {l.name for l in _all_layers(model)}
    unknown = [n for n in layer_names if n not in names]
    if unknown:
      hints = {n: difflib.get_close_matches(n, sorted(names), n=2)
               for n in unknown}
      raise errors.InvalidArgumentError(
          f"remat_model: no layers named {unknown} in {model.name} (close: "
          f"{hints}). Its layers: {', '.join(sorted(names))}.")


def check_mode_arguments(caller, mode, modes, output_size_threshold,
                         layer_names):
  """Raises, with a message starting with `caller`, on a mode not in
  `modes`, a threshold that is not a number of elements, or layer names
  missing for "list_of_layers" or given for another mode: the checks
  `remat_model` and `tfremat.RematScope` share."""
  if mode not in modes:
    raise errors.InvalidArgumentError(
        f"{caller}: mode must be one of {', '.join(map(repr, modes))}; got "
        f"{mode!r}.")
  if (isinstance(output_size_threshold, bool) or
      not isinstance(output_size_threshold, int) or output_size_threshold < 0):
    raise errors.InvalidArgumentError(
        f"{caller}: output_size_threshold must be a non-negative int (a "
        f"number of elements of a layer's output); got "
        f"{output_size_threshold!r}.")
  if mode == "list_of_layers":
    if isinstance(layer_names, str) or not layer_names:
      raise errors.InvalidArgumentError(
          f"{caller}: mode=\"list_of_layers\" needs layer_names, a "
          f"non-empty list of layer names; got {layer_names!r}.")
  elif layer_names:
    raise errors.InvalidArgumentError(
        f"{caller}: layer_names is for mode=\"list_of_layers\", not "
        f"{mode!r}.")


def remat_by_mode(model, mode, output_size_threshold, layer_names, policy,
                  sample_input):
  """`remat_model(model, mode)`: the layers `mode` chooses, rematerialized
  (`tfremat.remat_model` documents the modes)."""
  _check(model, mode, output_size_threshold, layer_names)
  if policy is not None:
    if mode == "activations":
      raise errors.InvalidArgumentError(
          "remat_model: policy= is for rematerialized layers; "
          "mode=\"activations\" recomputes activation functions only, "
          "which keep nothing worth a policy.")
    policy = policies_lib.parsed(policy)  # Refused before anything is built.
  if sample_input is not None and mode != "larger_than":
    raise errors.InvalidArgumentError(
        "remat_model: sample_input is for budget= or mode=\"larger_than\", "
        f"not mode={mode!r}.")
  choose = _chooser(model, mode, output_size_threshold, sample_input,
                    layer_names)
  if mode in ("full", "larger_than"):
    grouped = model_chain.grouped(model, policy,
                       choose if mode == "larger_than" else None)
    if grouped is not None:
      return grouped
    if mode == "full":
      _warn_if_single_layers(model)
  wrapper = (RematerializeActivation if mode == "activations" else
             functools.partial(RematerializationLayer, policy=policy))
  recurse = mode in ("activations", "list_of_layers")
  if not any(choose(l) for l in
             (_all_layers(model) if recurse else _own_layers(model))):
    hint = ""
    if mode == "larger_than":
      hint = (f" No output has more than {output_size_threshold} elements"
              + (" on sample_input." if sample_input is not None else
                 ", counting each unknown dimension as 1 (a batch or "
                 "sequence length); pass sample_input= (a batch) to size "
                 "outputs from it, or lower output_size_threshold."))
    warnings.warn(f"remat_model: mode={mode!r} selects no layer of "
                  f"{model.name}; nothing is rematerialized.{hint}",
                  stacklevel=3)
  return _rematerialized(model, choose, wrapper, recurse=recurse)


# What a layer's broken get_config raises (a KerasHub layer naming an
# attribute it never sets, say).
_CONFIG_ERRORS = (AttributeError, KeyError, NotImplementedError, TypeError,
                  ValueError)


def warn_if_unsaveable(model, result):
  """Warns when `model` gives its configuration and `result` cannot.

  A model that writes its own configuration (a KerasHub backbone) saves
  without asking its layers for theirs; `result` is a `keras.Model` built
  from those layers, whose configuration is theirs, so a layer whose
  `get_config` fails would make `result.save` fail long after this call.
  """
  try:
    model.get_config()
  except _CONFIG_ERRORS:
    return  # The original does not save either.
  try:
    result.get_config()
    return
  except _CONFIG_ERRORS as e:
    problem = f"{type(e).__name__}: {e}"
  failing = {}
  for layer in result._flatten_layers(include_self=False):  # pylint: disable=protected-access
    try:
      layer.get_config()
    except _CONFIG_ERRORS as e:
      failing[id(layer)] = (layer, e)
  # The innermost: a wrapper's configuration fails with the layer it wraps.
  for layer, e in failing.values():
    if not any(id(inner) in failing for inner in
               layer._flatten_layers(include_self=False)):  # pylint: disable=protected-access
      problem = (f"{type(layer).__name__} {layer.name!r}.get_config() raises "
                 f"{type(e).__name__}: {e}")
      break
  kind = type(model).__name__
  warnings.warn(
      f"remat_model: the result cannot be saved to a .keras file: {problem}. "
      f"{model.name} saves without it ({kind} writes its own "
      "configuration), but the result is a keras.Model made of its layers, "
      f"configured by theirs. To keep the {kind} (its class, saving and "
      "methods), rematerialize its blocks where they are: "
      "tfremat.remat_in_place(layers), or "
      "tfremat.remat_in_place_for_budget(model, layers, budget, x, y).",
      stacklevel=3)


def _chooser(model, mode, output_size_threshold, sample_input, layer_names):
  """Which layers `mode` rematerializes, as a predicate."""
  if mode == "full":
    return lambda layer: True
  if mode == "larger_than":
    sizes = (_output_sizes(model, sample_input) if sample_input is not None
             else {})
    return lambda layer: sizes.get(
        id(layer), _output_size(layer)) > output_size_threshold
  if mode == "activations":
    return lambda layer: bool(activation_layers(layer))
  return lambda layer: layer.name in layer_names


def _has_activation(layer):
  """Whether "activations" recomputes `layer`'s own activation function: a
  layer with one (a function) whose recomputation frees memory
  (`_recomputing_frees`), other than a layer that is nothing but its
  activation (`keras.layers.Activation`). Recomputed, that one keeps its
  input, which the layer before it produced and, without rematerialization,
  frees once the activation has run (a BatchNormalization's output in a
  CNN), while the layer after it still keeps the activation's output."""
  activation = getattr(layer, "activation", None)
  # A function, not a name the layer looks up or a layer it calls (which
  # swapping would untrack): "full" mode rematerializes those.
  return (callable(activation) and
          not isinstance(activation, keras.Operation) and
          not isinstance(layer, keras.layers.Activation) and
          _recomputing_frees(activation, layer.compute_dtype or "float32"))


def activation_layers(layer):
  """The layers whose activation "activations" recomputes when `layer` runs:
  `layer` and the layers inside it, each where `_has_activation`. A block
  may hand its `activation` to a Dense it makes (KerasHub's transformer
  layers do), so the Dense's, not the block's, is the one its call runs. A
  functional or Sequential model has none of its own: `remat_model` goes
  into it layer by layer."""
  if model_chain.is_graph_model(layer):
    return []
  return [l for l in layer._flatten_layers()  # pylint: disable=protected-access
          if _has_activation(l)]


@contextlib.contextmanager
def activations_rematerialized(layers):
  """Within it, each of `layers` runs its activation function through
  `RematerializeFn`; their own functions are put back on exit."""
  saved = [(l, l.activation) for l in layers]
  for layer, activation in saved:
    layer.activation = functools.partial(remat.RematerializeFn, activation)
  try:
    yield
  finally:
    for layer, activation in saved:
      layer.activation = activation


def _recomputing_frees(activation, dtype):
  """Whether recomputing `activation` in the backward pass frees memory.

  Kept, the function holds what its gradient reads; recomputed, it holds
  its input; the layer after it holds its output either way. So recomputing
  frees memory only when the gradient reads more than the output and one
  more tensor of the input's size: gelu and mish (intermediates), not relu,
  tanh, sigmoid or softmax (the output alone) nor silu or softplus (the
  input alone), which recomputed would only keep their input besides.
  Decided on a small traced graph, once per function and dtype; a function
  that cannot be traced is recomputed, as asked.
  """
  key = (id(activation), dtype)
  if key not in _FREES:
    try:
      frees = _gradient_reads(activation, dtype) > 1
    except Exception:  # pylint: disable=broad-except
      frees = True
    # The function is held too, so that its id is not reused.
    _FREES[key] = (activation, frees)
  return _FREES[key][1]


_FREES = {}

# Gradient ops that read a tensor's shape, not its values: the executor runs
# them as soon as the tensor exists, so they keep nothing alive.
_SHAPE_OPS = frozenset(("Shape", "ShapeN", "Size", "Rank",
                        "BroadcastGradientArgs"))


def _gradient_reads(activation, dtype):
  """What `activation`'s gradient reads of its forward pass besides the
  output, in bytes per byte of its input (tensors with fewer than half the
  input's elements, such as constants, not counted)."""
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(dtype, [4, 6])
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = activation(x)
    forward = set(graph.get_operations())
    tape.gradient(y, x)
    read = {t.ref(): t for op in graph.get_operations()
            if op not in forward and op.type not in _SHAPE_OPS
            for t in op.inputs if t.op in forward}
  read.pop(y.ref(), None)
  size = x.shape.num_elements()
  elements = [(t.shape.num_elements() or size, t.dtype.size)
              for t in read.values()]
  return sum(n * b for n, b in elements if 2 * n >= size) / (
      size * x.dtype.size)


def _warn_if_single_layers(model):
  """Warns when mode="full" can only rematerialize built-in layers alone."""
  own = _own_layers(model)
  if len(own) > 1 and all(model_chain.is_builtin(l) and not model_chain.is_graph_model(l)
                          for l in own):
    warnings.warn(
        f"remat_model: mode=\"full\" rematerializes each layer of "
        f"{model.name} on its own, which saves little memory: a layer "
        "rematerialized alone keeps its input, the previous layer's "
        "output. Its layers do not form a chain whose parts could be "
        "grouped (tfremat.chain_units shows its cuts). Wrap larger blocks "
        "in tfremat.RematerializationLayer, or give budget= and "
        "sample_input= to plan what to rematerialize.", stacklevel=4)


def _rematerialized(model, choose, wrapper, recurse):

  def clone(layer):
    if (isinstance(layer, keras.layers.InputLayer) or
        not isinstance(layer, keras.layers.Layer)):
      return layer
    if choose(layer):
      return wrapper(layer)
    if recurse and model_chain.is_graph_model(layer) and any(
        choose(l) for l in _all_layers(layer)):
      return _rematerialized(layer, choose, wrapper, recurse)
    return layer

  return keras.models.clone_model(model, clone_function=clone)


def check_model(model):
  """Raises unless `model` is a built Sequential or functional model with
  known inputs (`remat_model`'s first check)."""
  _check(model, "full", 0, None)
