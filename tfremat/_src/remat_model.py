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
from keras.src.models import functional
import numpy as np
import tensorflow as tf

from tfremat import chain as chain_lib
from tfremat import errors
from tfremat import planner
from tfremat import policies as policies_lib
from tfremat._src import remat
from tfremat._src.layers import RematerializationLayer
from tfremat._src.layers import refuse_keras2

__all__ = [
    "remat_model",
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


def remat_model(model, mode="full", output_size_threshold=1024,
                layer_names=None, policy=None, budget=None, sample_input=None,
                policies=policies_lib.PLANNED, verbose=1):
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
    budget: instead of `mode`, a memory budget for a training step, as for
      `tfremat.remat_sequential` (bytes, "200MiB", 0.5, "50%"), measured on
      `sample_input`: the model is cut at the tensors every path from its
      inputs to its outputs passes through (the residual stream between
      transformer blocks, say), the parts between consecutive cuts form a
      chain, and the planner chooses which to keep, rematerialize fully or
      rematerialize under one of `policies` (`chain_units` shows the cuts).
      The parts before the first cut and after the last are kept.
    sample_input: with `budget`, a batch like those the model trains on
      (under a `tf.distribute` strategy's scope, one replica's batch: each
      measured step runs in every replica on all of it). With
      mode="larger_than", a batch on which outputs are sized (one inference
      call); without it, an unknown dimension counts as 1.
    policies: with `budget`, the save policies the planner may choose
      (built-in names or `tfremat.policies` values, your own included).
    verbose: with `budget`, 1 shows a progress bar while measuring.

  Returns:
    A new model of the same kind, built from the same layer objects (no
    copies: its weights are `model`'s, and training it trains `model`),
    computing the same function with exact gradients. Nested models that
    contain chosen layers are rebuilt the same way. It saves to `.keras`
    and loads without custom objects, as far as its layers give their
    configurations: where `model` writes its own (a KerasHub backbone) and
    one of its layers cannot, a warning says so and names
    `tfremat.remat_in_place`, which keeps `model` itself.

  Raises:
    TypeError, ValueError: a subclassed or unbuilt model, an unknown mode,
      threshold or layer name; raised before anything is built.
    tfremat.errors.BudgetUnreachableError (a ValueError): no plan fits
      `budget`; its `lowest_fraction` is the lowest bound measured, as a
      fraction of the original's peak. The model is left as it was.
  """
  refuse_keras2(model, "remat_model")
  if budget is not None:
    result = _planned(model, budget, sample_input, policies, verbose,
                      mode=mode, policy=policy, layer_names=layer_names)
  else:
    result = _by_mode(model, mode, output_size_threshold, layer_names, policy,
                      sample_input)
  _warn_if_unsaveable(model, result)
  return result


def _by_mode(model, mode, output_size_threshold, layer_names, policy,
             sample_input):
  """`remat_model(model, mode)`: the layers `mode` chooses, rematerialized."""
  _check(model, mode, output_size_threshold, layer_names)
  if policy is not None:
    if mode == "activations":
      raise errors.InvalidArgumentError(
          "remat_model: policy= is for rematerialized layers; "
          "mode=\"activations\" recomputes activation functions only, "
          "which keep nothing worth a policy.")
    policies_lib.get(policy)  # A bad policy is refused before anything is built.
  if sample_input is not None and mode != "larger_than":
    raise errors.InvalidArgumentError(
        "remat_model: sample_input is for budget= or mode=\"larger_than\", "
        f"not mode={mode!r}.")
  choose = _chooser(model, mode, output_size_threshold, sample_input,
                    layer_names)
  if mode in ("full", "larger_than"):
    grouped = _grouped(model, policy,
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


def _warn_if_unsaveable(model, result):
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
  if _is_graph_model(layer):
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
  if len(own) > 1 and all(_is_builtin(l) and not _is_graph_model(l)
                          for l in own):
    warnings.warn(
        f"remat_model: mode=\"full\" rematerializes each layer of "
        f"{model.name} on its own, which saves little memory: a layer "
        "rematerialized alone keeps its input, the previous layer's "
        "output. Its layers do not form a chain whose parts could be "
        "grouped (tfremat.chain_units shows its cuts). Wrap larger blocks "
        "in tfremat.RematerializationLayer, or give budget= and "
        "sample_input= to plan what to rematerialize.", stacklevel=4)


def _elements(tensors):
  """Elements of symbolic tensors, an unknown dimension counted as 1."""
  return sum(math.prod(d or 1 for d in t.shape)
             for t in keras.tree.flatten(tensors))


def _is_builtin(layer):
  return type(layer).__module__.startswith("keras.")


def _held_elements(unit, output):
  """What `unit` (a chain unit with symbolic output `output`) holds for
  its backward pass when kept, estimated as every output its nodes compute,
  in elements; None for a unit whose inside Keras does not record (a
  subclassed layer, a layer reading context)."""
  if not _is_graph_model(unit):
    return _elements(output) if _is_builtin(unit) else None
  graph = getattr(unit, "_functional", None) or unit  # A Sequential's.
  total = 0
  for node in _topological_nodes(graph):
    inner = node.operation
    if _is_graph_model(inner):
      held = _held_elements(inner, node.outputs)
    elif isinstance(inner, keras.layers.Layer) and not _is_builtin(inner):
      held = None
    else:
      held = _elements(node.outputs)  # A built-in layer or a plain op.
    if held is None:
      return None
    total += held
  return total


def _grouping(held, inputs):
  """Segments of consecutive units, all rematerialized, for mode="full".

  `held[i]` is what unit i holds when kept (None: unknown, so it stays a
  segment of its own) and `inputs[i]` its input's size, in elements. A
  rematerialized segment stores its input; its backward pass holds what its
  units hold. So a step holds about the stored inputs plus the largest
  segment's `held`: grouping single layers, which hold little beyond their
  outputs, stores fewer inputs. For each cap on a segment's `held` (a
  geometric grid), units are grouped greedily under it; the cap with the
  smallest estimate wins (ties: the smaller cap, less recomputed at once).
  Returns a list of `planner.Segment`.
  """
  known = [h for h in held if h is not None]
  if not known:
    return [planner.Segment(i, i + 1, True) for i in range(len(held))]
  best = None
  for cap in sorted(set(np.geomspace(max(known), sum(known), 64).tolist())):
    segments, start, total = [], 0, 0
    for i, h in enumerate(held):
      if h is None or (i > start and (held[i - 1] is None or
                                      total + h > cap)):
        if i > start:
          segments.append(planner.Segment(start, i, True))
        start, total = i, 0
      total += h or 0
    segments.append(planner.Segment(start, len(held), True))
    largest = max(sum(held[j] or 0 for j in range(s.start, s.stop))
                  for s in segments)
    estimate = sum(inputs[s.start] for s in segments) + largest
    if best is None or estimate < best[0]:
      best = (estimate, segments)
  return best[1]


def _grouped(model, policy, choose=None):
  """mode="full" (or, with `choose`, "larger_than") on a model whose chain
  (`chain_units`) has units that group into segments (`_grouping`): the
  chosen units rematerialized, the chain's layers inside a `RematSequential`
  of those segments. A unit is chosen when the layer computing its output
  is. None when no segment would have two units: each layer is then
  rematerialized on its own."""
  parts = _ModelChain.of(model)
  if parts is None:
    return None
  chosen = None
  if choose is not None:
    chosen = [choose(_producing_node(out).operation)
              for out in parts.cuts[1:]]
  segments = _group_segments(parts, chosen)
  if segments is None:
    return None
  return parts.model_with(chain_lib.RematSequential(
      parts.units, segments, policy=policy, name=f"{model.name}_chain"))


def _group_segments(parts, chosen=None):
  """`_grouping`'s segments of a `_ModelChain`'s units, or None when none
  would have two units. With `chosen` (a bool per unit), each run of
  chosen units is grouped and the others are kept."""
  held = [None if isinstance(u, chain_lib.ContextUnit) else
          _held_elements(u, out)
          for u, out in zip(parts.units, parts.cuts[1:])]
  inputs = [_elements(t) for t in parts.cuts[:-1]]
  chosen = chosen or [True] * len(held)
  segments, start = [], 0
  for stop in range(1, len(held) + 1):
    if stop < len(held) and chosen[stop] == chosen[start]:
      continue
    if chosen[start]:
      segments += [planner.Segment(start + s.start, start + s.stop, True)
                   for s in _grouping(held[start:stop], inputs[start:stop])]
    else:
      segments.append(planner.Segment(start, stop, False))
    start = stop
  if all(s.stop - s.start == 1 for s in segments if s.remat):
    return None
  return segments


def _planning_units(parts, name):
  """The units the planner chooses between: the chain's units, or, where
  `mode="full"` would group them (single layers of a CNN), those groups,
  each a `keras.Sequential`. A single layer rematerialized alone keeps its
  input and saves little, and measuring dozens of them one by one is slow;
  the groups are what saves memory, and the planner then decides which to
  keep and under which policy to rematerialize the others."""
  segments = _group_segments(parts)
  if segments is None:
    return parts.units
  return [parts.units[s.start] if s.stop - s.start == 1 else
          keras.Sequential(parts.units[s.start:s.stop],
                           name=f"{name}_group{k}")
          for k, s in enumerate(segments)]


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


def _topological_nodes(model):
  """The model's call nodes, inputs first (an order every edge respects)."""
  nodes = []
  for depth in sorted(model._nodes_by_depth, reverse=True):  # pylint: disable=protected-access
    nodes += [n for n in model._nodes_by_depth[depth]  # pylint: disable=protected-access
              if not isinstance(n.operation, keras.layers.InputLayer)]
  return nodes


def _is_context(tensor):
  """Whether a tensor is context for a chain: not float, so without a
  gradient (token ids, a padding mask), and live for the whole step."""
  return not keras.backend.is_float_dtype(tensor.dtype)


def chain_units(model):
  """Where `model` can be cut into a chain, and the parts between the cuts.

  A cut is a tensor every path from the model's inputs to its outputs passes
  through: after the op computing it, it is the only tensor computed so far
  (inputs included) that a later op or the output still needs. Tensors that
  are not float (token ids, a padding mask that every transformer block
  reads) do not count: they have no gradient and are the chain's context.

  Returns:
    (cuts, units): the cut tensors in order, and for each pair of
    consecutive cuts the part of the model between them: the layer itself
    when it is one layer (not a plain operation such as `x * 2`), a
    functional model of the same layer objects when
    it is more, and a `tfremat.chain.ContextUnit` around such a model when
    the part also reads context tensors.
  """
  cuts, units, _ = _chain_parts(model)
  return cuts, units


def _chain_parts(model):
  """`chain_units`, and the context tensors its ContextUnits index."""
  nodes = _topological_nodes(model)
  needed_by = {}  # id(tensor) -> index of the last node reading it.
  for i, node in enumerate(nodes):
    for t in node.input_tensors:
      needed_by[id(t)] = i
  for t in model.outputs:
    needed_by[id(t)] = len(nodes)
  live = {id(t): t for t in model.inputs if not _is_context(t)}
  cuts = list(model.inputs) if len(model.inputs) == 1 else []
  for i, node in enumerate(nodes):
    for t in node.outputs:
      if not _is_context(t):
        live[id(t)] = t
    live = {k: t for k, t in live.items() if needed_by.get(k, -1) > i}
    if len(live) == 1:
      (tensor,) = live.values()
      if not cuts or cuts[-1] is not tensor:
        cuts.append(tensor)
  position = {id(n): i for i, n in enumerate(nodes)}
  context, units = [], []
  for start, stop in zip(cuts, cuts[1:]):
    node = _producing_node(stop)
    # The part's nodes: after start's producer (-1: a model input) up to
    # stop's.
    part_nodes = nodes[position.get(id(_producing_node(start)), -1) + 1:
                       position[id(node)] + 1]
    read = _context_read(part_nodes)
    if (not read and isinstance(node.operation, keras.layers.Layer) and
        node.input_tensors == [start] and len(node.outputs) == 1):
      units.append(node.operation)
      continue
    name = f"{model.name}_part{len(units)}"
    if not read:
      units.append(keras.Model(start, stop, name=name))
      continue
    indices = []
    for t in read:
      if not any(t is c for c in context):
        context.append(t)
      indices.append(next(i for i, c in enumerate(context) if c is t))
    part = _replayed(part_nodes, [start] + read, stop, name)
    units.append(chain_lib.ContextUnit(part, indices,
                                       name=f"{name}_with_context"))
  return cuts, units, context


def _context_in(context, model_inputs, inputs, given, context_of):
  """The context tensors computed from the new model's `inputs`: the
  inputs themselves where they are the model's (a padding mask), else
  through `context_of`."""
  where = [next((i for i, t in enumerate(model_inputs) if t is c), None)
           for c in context]
  if None not in where:
    return [inputs[i] for i in where]
  return keras.tree.flatten(context_of(given))


def _replayed(nodes, inputs, output, name):
  """A functional model of `nodes`' layers from `inputs` to `output`, built
  by calling those layers again on new inputs.

  `keras.Model(inputs, output)` with inputs that mix a model's own Input (a
  padding mask) and an intermediate tensor re-wires the Input's history, so
  that the original model's config can no longer be written: each input is
  made new here instead.
  """
  fresh = [keras.Input(batch_shape=t.shape, dtype=t.dtype) for t in inputs]
  found = {id(t): f for t, f in zip(inputs, fresh)}

  def swap(value):
    return (found.get(id(value), value)
            if isinstance(value, keras.KerasTensor) else value)

  for node in nodes:
    if not all(id(t) in found for t in node.input_tensors):
      continue  # Computes context from the inputs: given as an input.
    outputs = node.operation(
        *keras.tree.map_structure(swap, node.arguments.args),
        **keras.tree.map_structure(swap, node.arguments.kwargs))
    for old, new in zip(node.outputs, keras.tree.flatten(outputs)):
      found[id(old)] = new
  return keras.Model(fresh, keras.tree.map_structure(lambda t: found[id(t)],
                                                     output), name=name)


def _context_read(nodes):
  """The context tensors that `nodes` read, in order, each once."""
  read = []
  for node in nodes:
    for t in node.input_tensors:
      if _is_context(t) and not any(t is r for r in read):
        read.append(t)
  return read


def _producing_node(tensor):
  history = tensor._keras_history  # pylint: disable=protected-access
  return history.operation._inbound_nodes[history.node_index]  # pylint: disable=protected-access


def _planned(model, budget, sample_input, policy_names, verbose, mode,
             policy, layer_names):
  """`remat_model(model, budget=...)`: the planner's choice on the model's
  chain of parts."""
  if not _is_graph_model(model) or not model.built or not getattr(
      model, "inputs", None):
    _check(model, "full", 0, None)
  if mode != "full" or policy is not None or layer_names is not None:
    raise errors.InvalidArgumentError(
        "remat_model: with budget= the planner chooses what to "
        "rematerialize and under which policy; leave mode, policy and "
        "layer_names unset (name the policies it may use with policies=).")
  budget, policy_names = chain_lib.planning_arguments(
      "remat_model", budget, sample_input, policy_names)
  parts = _ModelChain.of(model)
  if parts is None:
    raise errors.InvalidArgumentError(
        f"remat_model: {model.name} has fewer than two parts between "
        "tensors that every path from its inputs to its outputs passes "
        "through, so there is nothing for a budget to choose between. Give "
        "mode= instead (\"full\" rematerializes its layers one by one).")
  x = (sample_input if parts.prefix is None else parts.prefix(sample_input))
  if parts.context:
    # What the units read while they are measured: the sample's context.
    sample_context = keras.tree.flatten(parts.context_of(sample_input))
    for unit in parts.units:
      if isinstance(unit, chain_lib.ContextUnit):
        unit.sample_context = sample_context
  units = _planning_units(parts, model.name)
  chosen = chain_lib.checked_plan(units, budget, x, verbose=verbose,
                                  policies=policy_names)
  for unit in parts.units:
    if isinstance(unit, chain_lib.ContextUnit):
      unit.sample_context = None  # Not kept alive by the model.
  return parts.model_with(chain_lib.RematSequential(
      units, chain_lib.segments_with(chosen.segments, policy_names),
      plan=chosen,
      ordered=chosen.ordered, name=f"{model.name}_chain"))


class _ModelChain:
  """A functional model as prefix, chain of units, suffix.

  The chain runs from the model's first float cut (`chain_units`) to its
  last: parts reading token ids (an embedding) have no input gradient, and
  run before it as `prefix`; what follows the last cut (a head, a final
  normalization, several outputs) runs after it as `suffix`. Either is None
  when empty. `context` lists the tensors the chain's `ContextUnit`s read,
  and `context_of` computes them from the model's inputs.
  """

  def __init__(self, model, cuts, units, context):
    self.model, self.cuts, self.units, self.context = (model, cuts, units,
                                                      context)
    first, last = cuts[0], cuts[-1]
    # Built on the model's own input structure, so that a batch the model
    # takes without a warning passes through them without one too.
    given = model._inputs_struct  # pylint: disable=protected-access
    self.prefix = (None if any(first is t for t in model.inputs) else
                   keras.Model(given, first, name=f"{model.name}_before"))
    self.suffix = None
    if not (len(model.outputs) == 1 and last is model.outputs[0]):
      nodes = _topological_nodes(model)
      after = next(i for i, n in enumerate(nodes)
                   if n is _producing_node(last))
      # Replayed: an output that is `last` itself (BERT's sequence output
      # beside its pooled one) would disconnect `keras.Model(last, outputs)`.
      self.suffix = _replayed(nodes[after + 1:], [last],
                              model._outputs_struct,  # pylint: disable=protected-access
                              f"{model.name}_after")
    self.context_of = keras.Model(given, context) if context else None

  @classmethod
  def of(cls, model):
    """The model's chain, or None when it has fewer than two units."""
    cuts, units, context = _chain_parts(model)
    start = next((i for i, t in enumerate(cuts)
                  if keras.backend.is_float_dtype(t.dtype)), len(cuts))
    if len(units) - start < 2:
      return None
    return cls(model, cuts[start:], units[start:], context)

  def model_with(self, chain):
    """A new model like `self.model`, with `chain` (a RematSequential of
    the units) in place of the units."""
    model = self.model
    inputs = [keras.Input(batch_shape=t.shape, dtype=t.dtype, name=t.name)
              for t in model.inputs]
    # The original's input structure (a dict of token ids and a mask, say).
    given = keras.tree.pack_sequence_as(model._inputs_struct, inputs)  # pylint: disable=protected-access
    h = given if self.prefix is None else self.prefix(given)
    if self.context:
      h = chain(h, context=_context_in(self.context, model.inputs, inputs,
                                       given, self.context_of))
    else:
      h = chain(h)
    if self.suffix is not None:
      h = self.suffix(h)
    return keras.Model(given, h, name=model.name)
