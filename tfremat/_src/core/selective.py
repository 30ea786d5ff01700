"""Keeping the tensors a save policy chooses, and using them in the rerun.

While a rematerialized function is traced for its forward pass, an op
callback (`ForwardSaver`) shows each op added to the forward graph to the
policy and keeps the outputs of those it chooses. While the backward pass's
rerun is traced, another (`RerunReplacer`) meets the same ops again, in the
same order, and replaces each chosen op's outputs with the kept tensors. The
gradient tape that differentiates the rerun records the op with the kept
tensors as its outputs, so the op's registered gradient is computed from the
rerun's inputs to the op and the kept outputs; nothing reads the rerun's op
itself, so the graph runtime (or XLA) prunes it and, with it, everything
upstream that only it needed.

Ops are matched by kind and order: the k-th op of a kind in the rerun is the
k-th of that kind in the forward pass, where a kind is an op type, or a name
given with `policies.checkpoint_name`. The rerun is checked to have made the
same sequence of each kept kind (types, shapes and dtypes), and a rerun that
did not raises `RerunMismatchError`, at trace time.

Only ops of the function's own graph that depend on its inputs are
candidates: ops inside a `tf.cond` branch, a loop body or a nested function
are recomputed, since their tensors do not exist outside that graph. So are
ops computed from weights, seeds or constants alone, ops whose outputs are
resources or variants, ops reading a resource (variable reads), stateful
ops, control flow and function calls, ops carrying a custom gradient, and
plain identities. A function that opens a gradient tape of its own, or
reads a raw tf.Variable (its rerun is differentiated with `tf.gradients`),
keeps nothing, and a rerun that a gradient tape outside records (for a
second-order gradient) replaces nothing: those tapes must see the ops
themselves.
"""

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_util

from tfremat import errors
from tfremat._src.core import policies
from tfremat._src.core import watch

__all__ = [
    "describe",
    "keeps",
    "Saved",
    "ForwardSaver",
    "in_graph",
    "RerunReplacer",
    "is_random_draw",
]

# Never kept: they compute nothing worth keeping, or their gradient is not
# their type's registered one, or their meaning depends on where they run.
_NEVER = frozenset([
    "Placeholder", "Const", "NoOp", "IdentityN", "StopGradient",
    "PreventGradient", "If", "StatelessIf", "While", "StatelessWhile", "Case",
    "StatelessCase", "PartitionedCall", "StatefulPartitionedCall",
    "SymbolicGradient", "ReadVariableOp", "VarHandleOp", "_Retval", "_Arg",
    "Assert", "Print", "PrintV2", "CheckNumerics", "EnsureShape",
])

def _has_gradient(op_type):
  """Whether `op_type` has a registered gradient, or is registered as not
  differentiable (an op with neither is never kept)."""
  try:
    ops.gradient_registry.lookup(op_type)
  except LookupError:
    return False
  return True


def _op_of(outputs):
  for t in outputs or ():
    if hasattr(t, "op"):
      return t.op
  return None


def _kind(op_type, op):
  """The key ops are matched by: a checkpoint name, or the op type."""
  if op_type == "Identity":
    name = policies.pending_checkpoint_name()
    return ("checkpoint", name) if name else None
  return op_type


def _candidate(op_type, op):
  """Whether `op` may be kept at all (before asking the policy)."""
  if op is None or not op.outputs:
    return False
  if op_type in _NEVER:
    return False
  if any(t.dtype in (tf.resource, tf.variant) for t in op.outputs):
    return False
  if any(t.dtype in (tf.resource, tf.variant) for t in op.inputs):
    return False
  try:
    if op.op_def.is_stateful:
      return False
  except (AttributeError, ValueError):
    return False
  try:
    op.get_attr("_gradient_op_type")
    return False  # Under a gradient_override_map: a custom gradient.
  except ValueError:
    pass
  return _has_gradient(op_type)


def _attrs(op):
  attrs = {}
  for name in ("equation", "transpose_a", "transpose_b", "adj_x", "adj_y"):
    try:
      attrs[name] = op.get_attr(name)
    except ValueError:
      pass
  if isinstance(attrs.get("equation"), bytes):
    attrs["equation"] = attrs["equation"].decode()
  return attrs


def describe(op, checkpoint_name=None):
  """The `policies.Op` a policy sees for a graph op."""
  return policies.Op(
      type=op.type, name=op.name,
      input_shapes=tuple(t.shape for t in op.inputs),
      output_shapes=tuple(t.shape for t in op.outputs),
      input_dtypes=tuple(t.dtype for t in op.inputs),
      output_dtypes=tuple(t.dtype for t in op.outputs),
      checkpoint_name=checkpoint_name, attrs=_attrs(op))


def _signature(op):
  return tuple((tuple(t.shape.as_list()) if t.shape.rank is not None else None,
                t.dtype) for t in op.outputs)


def _alike(first, second):
  """Whether two ops' signatures can be the same op's: the same dtypes, and
  shapes that agree wherever both are known. A step traced for any batch
  size may know fewer dimensions in its rerun than in its forward pass (a
  reshape that reads the batch from its input)."""
  return len(first) == len(second) and all(
      a_dtype == b_dtype and tf.TensorShape(a_shape).is_compatible_with(
          tf.TensorShape(b_shape))
      for (a_shape, a_dtype), (b_shape, b_dtype) in zip(first, second))


def keeps(policy, info):
  """Whether `policy` keeps the op `info` (a `policies.Op`) describes; a
  policy answering anything but True, False or None is refused."""
  keep = policy(info)
  if keep is not None and not isinstance(keep, (bool, np.bool_)):
    raise errors.InvalidTypeError(
        f"A save policy must return True or False; "
        f"{policies.name_of(policy)} returned {keep!r} for {info}.")
  return bool(keep)


class Saved:
  """One kept op: its kind, index among its kind, description, outputs."""

  def __init__(self, kind, index, info, outputs, signature):
    self.kind = kind
    self.index = index
    self.info = info
    self.outputs = outputs
    self.signature = signature


def is_random_draw(op_type):
  """Whether the op draws random numbers from a seed (stateless; stateful
  draws are refused in a rematerialized call)."""
  return op_type.startswith("Stateless") and not op_type.startswith(
      ("StatelessRandomGet", "StatelessIf", "StatelessWhile", "StatelessCase"))


# Ops that read a tensor's shape, not its values.
_SHAPE_OPS = frozenset(["Shape", "ShapeN", "Size", "Rank"])


def _captured(tensor):
  """What `tensor` captures from an outer graph where it is a function
  graph's placeholder for it (an argument made outside a `tf.switch_case`
  branch, read inside: the forward pass reads the capture, the rerun its
  own input), else None."""
  if tensor.op.type != "Placeholder" or tensor.dtype == tf.resource:
    return None
  for external, internal in getattr(tensor.graph, "captures", ()):
    if internal is tensor:
      return external
  return None


class _DataTracker:
  """Follows which tensors of the graph depend on the function's inputs or
  on its random draws (dropout masks).

  Only ops reading those are kept. The others compute from weights, seeds,
  step counters or constants alone: cheap to recompute, and the two passes
  build them differently (the forward pass reads variables where the rerun
  gets their replayed values), so they could not be matched. Some must also
  stay visible to XLA as compile-time constants (a loop's trip count, say),
  which a kept tensor gated on the gradient is not. So must a shape read
  from the data under XLA (`_SHAPE_OPS`): in a step traced for any size
  of an axis, XLA resolves it, and the reshapes computed from it, at each
  size it compiles for. (On the executor shapes stay data: there a
  KerasHub `GemmaBackbone`'s rerun recomputing them in a `tf.switch_case`
  branch captured an eager tensor that TensorFlow's cond gradient could
  not resolve.)
  """

  def __init__(self, inputs=()):
    self._data = {id(t) for t in inputs}
    self._shapes_are_data = True  # Set for the graph entered (`_OpWatcher`).

  def depends_on_data(self, op_type, inputs, outputs):
    """Whether the op just made reads the inputs or a random draw; notes its
    outputs if so. A draw itself is noted, not kept."""
    if is_random_draw(op_type):
      self.mark(outputs)
      return False
    if op_type in _SHAPE_OPS and not self._shapes_are_data:
      return False
    if any(id(t) in self._data or id(_captured(t)) in self._data
           for t in inputs):
      self.mark(outputs)
      return True
    return False

  def mark(self, tensors):
    self._data.update(id(t) for t in tensors or ())


class _OpWatcher(_DataTracker, watch.Handler):
  """While entered, it sees every op added to the graph that was the default
  on entry, numbers the candidate ops the same way in both passes, and shows
  each to its subclass's `_on_candidate`, whose return value replaces the
  op's outputs."""

  def __init__(self, inputs):
    super().__init__(inputs)
    self.graph = None
    self._shapes_are_data = True  # The entered graph's rule (`__enter__`).
    self.signatures = {}  # kind -> each candidate op's signature, in order.

  def _numbered(self, op_type, inputs, outputs, graph):
    """(op type, op, kind, index among its kind, signature) of a candidate
    op just made in this graph, or None for any other op."""
    if graph is None or graph is not self.graph:
      return None
    op = _op_of(outputs)
    if not self.depends_on_data(op_type, inputs, outputs):
      return None
    kind = _kind(op_type, op)
    if kind is None or not _candidate(op_type, op):
      return None
    index = len(self.signatures.setdefault(kind, []))
    signature = _signature(op)
    self.signatures[kind].append(signature)
    return op_type, op, kind, index, signature

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    del op_name
    numbered = self._numbered(op_type, inputs, outputs, graph)
    if numbered is None:
      return outputs
    return self._on_candidate(*numbered, inputs, outputs, graph)

  def _on_candidate(self, op_type, op, kind, index, signature, inputs,
                    outputs, graph):
    raise NotImplementedError

  def __enter__(self):
    self.graph = tf.compat.v1.get_default_graph()
    self._shapes_are_data = (
        not control_flow_util.GraphOrParentsInXlaContext(self.graph))
    return super().__enter__()


class ForwardSaver(_OpWatcher):
  """Keeps the outputs of the forward pass's ops that `policy` chooses.

  Used around the forward pass, in a graph (not in eager mode). After it,
  `saved` maps (kind, index) to a `Saved`, and `signatures` holds every
  candidate op's signature per kind, in order, for the rerun's check.
  """

  def __init__(self, policy, inputs):
    super().__init__(inputs)
    self.policy = policies.get(policy)
    self.unsave_named_inputs = getattr(self.policy, "unsave_named_inputs",
                                       False)
    self.saved = {}
    self._index_of_op = {}

  def _on_candidate(self, op_type, op, kind, index, signature, inputs,
                    outputs, graph):
    del op_type, graph
    self._index_of_op[id(op)] = (kind, index)
    name = kind[1] if isinstance(kind, tuple) else None
    info = describe(op, name)
    keep = keeps(self.policy, info)
    if keep:
      self.saved[(kind, index)] = Saved(kind, index, info, list(op.outputs),
                                        signature)
    if name is not None and not keep and self.unsave_named_inputs:
      # The named tensor is recomputed, so the op computing it is too.
      producer = self._index_of_op.get(id(inputs[0].op))
      if producer is not None:
        self.saved.pop(producer, None)
    return outputs

  def __exit__(self, *args):
    super().__exit__(*args)
    self._index_of_op = {}


def in_graph(tensor, graph):
  """`tensor` as seen from `graph`: itself, or the graph's capture of it."""
  if tf.is_symbolic_tensor(tensor) and tensor.graph is graph:
    return tensor
  return graph.capture(tensor) if hasattr(graph, "capture") else tensor


class RerunReplacer(_OpWatcher):
  """Replaces the outputs of the rerun's ops that `saver` kept.

  Used under the gradient tape that differentiates the rerun: the tape
  records each replaced op with the kept tensors as its outputs, so the
  op's registered gradient is computed from the rerun's inputs to the op
  and the forward pass's outputs of it.
  """

  def __init__(self, saver, error, gate, inputs):
    super().__init__(inputs)
    self.saver = saver
    self.error = error  # The exception class for a mismatch.
    # Kept tensors are ordered after the incoming gradient, as the rerun's
    # inputs are: ops computing from them alone would otherwise be free to
    # run in the forward pass (or be merged with the forward's own) and keep
    # their outputs alive until the backward pass. `gate(t)` is t so
    # ordered (remat_memory_test checks the peak).
    self.gate = gate

  def _on_candidate(self, op_type, op, kind, index, signature, inputs,
                    outputs, graph):
    del op_type, op, inputs
    saved = self.saver.saved.get((kind, index))
    if saved is None:
      return outputs
    if not _alike(saved.signature, signature):
      self._mismatch(kind, f"its op {index} of kind {kind!r} has outputs "
                     f"{signature} where the forward pass's had "
                     f"{saved.signature}")
    kept = [self.gate(in_graph(t, graph)) for t in saved.outputs]
    self.mark(kept)
    return kept

  def _mismatch(self, kind, what):
    raise self.error(
        f"The backward-pass rerun of a rematerialized function under the "
        f"save policy {policies.name_of(self.saver.policy)} did not make the "
        f"ops its forward pass made: {what}. Kept tensors are matched to the "
        "rerun's ops by kind and order, so the function must build the same "
        "ops every time it runs (no Python-side state deciding what it "
        "builds). Run it without a policy, or report this with the function.")

  def check(self):
    """Raises unless the rerun made the forward pass's kept kinds alike."""
    kinds = {s.kind for s in self.saver.saved.values()}
    for kind in kinds:
      forward = self.saver.signatures.get(kind, [])
      rerun = self.signatures.get(kind, [])
      if len(forward) != len(rerun) or not all(
          _alike(f, r) for f, r in zip(forward, rerun)):
        self._mismatch(kind, f"{len(rerun)} op(s) of kind {kind!r} where the "
                       f"forward pass made {len(forward)}, or with other "
                       "shapes")
