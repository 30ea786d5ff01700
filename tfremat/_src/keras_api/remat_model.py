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

from tfremat._src.keras_api import chain_layers
from tfremat._src.planning import chain_measure
from tfremat._src.planning import chain_plan as chain_lib
from tfremat import errors
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import model_chain
from tfremat._src.core import remat
from tfremat._src.planning import search
from tfremat._src.keras_api.layers import RematerializationLayer
from tfremat._src.keras_api.layers import refuse_keras2
from tfremat._src.keras_api.model_chain import chain_units

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


def remat_model(model, mode="full", output_size_threshold=1024,
                layer_names=None, policy=None, budget=None, sample_input=None,
                policies=policies_lib.PLANNED, verbose=1, settings=None):
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
    settings: with `budget`, the planner's `tfremat.planner.Settings`
      (None: the shipped defaults).

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
                      mode=mode, policy=policy, layer_names=layer_names,
                      settings=settings)
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


def _planned(model, budget, sample_input, policy_names, verbose, mode,
             policy, layer_names, settings=None):
  """`remat_model(model, budget=...)`: the planner's choice on the model's
  chain of parts."""
  if mode != "full" or policy is not None or layer_names is not None:
    raise errors.InvalidArgumentError(
        "remat_model: with budget= the planner chooses what to "
        "rematerialize and under which policy; leave mode, policy and "
        "layer_names unset (name the policies it may use with policies=).")
  budget, policy_names = chain_lib.planning_arguments(
      "remat_model", budget, sample_input, policy_names)
  planning = ModelPlanning(model)
  chosen = planning.plan(budget, sample_input, policy_names, verbose=verbose,
                         settings=settings or search.DEFAULT_SETTINGS)
  return planning.model_with(chosen)


class ModelPlanning:
  """A model as the planner sees it: its chain of units (`planning_units`),
  the input the chain takes, and the model rebuilt around a plan for them
  (`remat_model(model, budget=...)`, `tfremat.largest_batch`)."""

  def __init__(self, model):
    if not model_chain.is_graph_model(model) or not model.built or not (
        getattr(model, "inputs", None)):
      _check(model, "full", 0, None)
    self.model = model
    self.parts = model_chain.ModelChain.of(model)
    if self.parts is None:
      raise errors.InvalidArgumentError(
          f"remat_model: {model.name} has fewer than two parts between "
          "tensors that every path from its inputs to its outputs passes "
          "through, so there is nothing for a budget to choose between. "
          "Give mode= instead (\"full\" rematerializes its layers one by "
          "one).")
    self.units = model_chain.planning_units(self.parts, model.name)

  def chain_input(self, sample_input):
    """What the chain's first unit reads, for the model's input."""
    if self.parts.prefix is None:
      return sample_input
    return self.parts.prefix(sample_input)

  @contextlib.contextmanager
  def reading(self, sample_input):
    """While open, the units that read the chain's context (a padding mask,
    token ids) read `sample_input`'s, as they do when measured alone."""
    contexts = [u for u in self.parts.units
                if isinstance(u, chain_layers.ContextUnit)]
    sample_context = (keras.tree.flatten(self.parts.context_of(sample_input))
                      if self.parts.context else None)
    for unit in contexts:
      unit.sample_context = sample_context
    try:
      yield
    finally:
      for unit in contexts:
        unit.sample_context = None  # Not kept alive by the model.

  def measure_costs(self, sample_input, policies, settings):
    """The units' `LayerCost`s on `sample_input`."""
    with self.reading(sample_input):
      return chain_measure.measure_chain(
          self.units, self.chain_input(sample_input), policies=policies,
          waiting_fraction=settings.waiting_fraction)

  def plan(self, budget, sample_input, policies, verbose=0, costs=None,
           settings=search.DEFAULT_SETTINGS):
    """The planner's checked plan for the units on `sample_input`."""
    with self.reading(sample_input):
      return chain_lib.checked_plan(
          self.units, budget, self.chain_input(sample_input),
          verbose=verbose, policies=policies, costs=costs, settings=settings)

  def model_with(self, chosen):
    """The model, its chain run as `chosen` says."""
    return self.parts.model_with(chain_layers.apply_plan(
        self.units, chosen, name=f"{self.model.name}_chain"))
