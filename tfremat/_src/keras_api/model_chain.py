"""A functional Keras model as a chain of parts: cut at the tensors that every
path from its inputs to its outputs passes through (`chain_units`), with
what the parts read besides the chain's activation (token ids, masks)
carried alongside. `remat_model` plans budgets on the chain and groups a
CNN's layers into segments.
"""

import math

import keras
from keras.src.models import functional
import numpy as np

from tfremat._src.keras_api import chain_layers as chain_lib
from tfremat._src.keras_api.segments import Segment

__all__ = [
    "chain_units",
    "elements",
    "is_builtin",
    "is_graph_model",
    "grouped",
    "planning_units",
    "ModelChain",
]


def is_graph_model(layer):
  return isinstance(layer, (keras.Sequential, functional.Functional))


def elements(tensors):
  """Elements of symbolic tensors, an unknown dimension counted as 1."""
  return sum(math.prod(d or 1 for d in t.shape)
             for t in keras.tree.flatten(tensors))


def is_builtin(layer):
  return type(layer).__module__.startswith("keras.")


def _held_elements(unit, output):
  """What `unit` (a chain unit with symbolic output `output`) holds for
  its backward pass when kept, estimated as every output its nodes compute,
  in elements; None for a unit whose inside Keras does not record (a
  subclassed layer, a layer reading context)."""
  if not is_graph_model(unit):
    return elements(output) if is_builtin(unit) else None
  graph = getattr(unit, "_functional", None) or unit  # A Sequential's.
  total = 0
  for node in _topological_nodes(graph):
    inner = node.operation
    if is_graph_model(inner):
      held = _held_elements(inner, node.outputs)
    elif isinstance(inner, keras.layers.Layer) and not is_builtin(inner):
      held = None
    else:
      held = elements(node.outputs)  # A built-in layer or a plain op.
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
  Returns a list of `Segment`.
  """
  known = [h for h in held if h is not None]
  if not known:
    return [Segment(i, i + 1, True) for i in range(len(held))]
  best = None
  for cap in sorted(set(np.geomspace(max(known), sum(known), 64).tolist())):
    segments, start, total = [], 0, 0
    for i, h in enumerate(held):
      if h is None or (i > start and (held[i - 1] is None or
                                      total + h > cap)):
        if i > start:
          segments.append(Segment(start, i, True))
        start, total = i, 0
      total += h or 0
    segments.append(Segment(start, len(held), True))
    largest = max(sum(held[j] or 0 for j in range(s.start, s.stop))
                  for s in segments)
    estimate = sum(inputs[s.start] for s in segments) + largest
    if best is None or estimate < best[0]:
      best = (estimate, segments)
  return best[1]


def grouped(model, policy, choose=None):
  """mode="full" (or, with `choose`, "larger_than") on a model whose chain
  (`chain_units`) has units that group into segments (`_grouping`): the
  chosen units rematerialized, the chain's layers inside a `RematSequential`
  of those segments. A unit is chosen when the layer computing its output
  is. None when no segment would have two units: each layer is then
  rematerialized on its own."""
  parts = ModelChain.of(model)
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
  inputs = [elements(t) for t in parts.cuts[:-1]]
  chosen = chosen or [True] * len(held)
  segments, start = [], 0
  for stop in range(1, len(held) + 1):
    if stop < len(held) and chosen[stop] == chosen[start]:
      continue
    if chosen[start]:
      segments += [Segment(start + s.start, start + s.stop, True)
                   for s in _grouping(held[start:stop], inputs[start:stop])]
    else:
      segments.append(Segment(start, stop, False))
    start = stop
  if all(s.stop - s.start == 1 for s in segments if s.remat):
    return None
  return segments


def planning_units(parts, name):
  """The units the planner chooses between: the chain's units, each run of
  consecutive single built-in layers (a CNN's convolutions, normalizations
  and activations) grouped as `mode="full"` would group it, each group a
  `keras.Sequential`. A single layer rematerialized alone keeps its input
  and saves little, and measuring dozens of them one by one is slow; a part
  of several layers (a residual block between two cuts) stays a unit of its
  own, so that the planner chooses block by block (it makes longer
  segments of them itself)."""
  single = [not is_graph_model(u) and is_builtin(u) and
            not isinstance(u, chain_lib.ContextUnit) for u in parts.units]
  segments = _group_segments(parts, single)
  if segments is None:
    return parts.units
  units = []
  for s in segments:
    if s.remat and s.stop - s.start > 1:
      units.append(keras.Sequential(parts.units[s.start:s.stop],
                                    name=f"{name}_group{len(units)}"))
    else:  # One unit, or a run of parts that are not single layers.
      units += parts.units[s.start:s.stop]
  return units


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


class ModelChain:
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
