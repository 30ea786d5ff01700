"""Where a rematerialized function's inputs come from, found while its forward
pass runs: its arguments, the Keras variables and raw `tf.Variable`s it
reads, and the tensors it captures by closure. The rerun reads each as the
forward pass did, and each gets its own partial derivative.
"""

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record
from tensorflow.python.ops import gen_resource_variable_ops

from tfremat import errors
from tfremat._src.core import forward_ops
from tfremat._src.core import selective
from tfremat._src.core import watch

__all__ = [
    "find_sources",
    "is_differentiable",
    "in_current_graph",
    "InputSource",
    "KerasSource",
    "RawSource",
    "forward_reads",
]


def is_differentiable(t):
  return t.dtype.is_floating or t.dtype.is_complex


class _Sources:
  """Collects a call's sources, each tensor or variable once."""

  def __init__(self, eager):
    self.eager = eager
    self.found = []
    self._seen = set()

  def first_time(self, obj):
    if id(obj) in self._seen:
      return False
    self._seen.add(id(obj))
    return True

  def add(self, source):
    """Adds `source` unless it is a tensor already seen or not float."""
    if is_differentiable(source.tensor) and self.first_time(source.tensor):
      self.add_if_recorded(source)

  def add_if_recorded(self, source):
    """Adds `source` where a gradient may be asked for it: in a graph always
    (`tf.gradients` may ask later), in eager mode when a tape records it."""
    if not self.eager or _is_recorded(source.tensor):
      self.found.append(source)


def find_sources(eager, leaves, run):
  """Everything the rerun reads whose gradient may be asked for (invariants
  7 and 8): inputs, Keras variables, raw variables, closure captures."""
  if eager and not record.could_possibly_record():
    return ()  # No tape or accumulator: nothing will ask.
  sources = _Sources(eager)
  for i, x in enumerate(leaves):
    if isinstance(x, tf.Tensor):
      sources.add(InputSource(x, i))
  for i, value in enumerate(run.recorded.before):
    sources.add(KerasSource(value, i))
  keras_backing = {id(getattr(v, "_value", v))
                   for v in run.recorded.variables}
  keras_backing |= {_handle_id(v) for v in run.recorded.variables}
  raw = _add_raw_variables(sources, leaves, run, keras_backing)
  _add_read_handles(sources, run.ops, keras_backing | raw)
  graph = None if eager else tf.compat.v1.get_default_graph()
  for t in run.ops.external_tensors():
    # Constants too: a small eager tensor that a tf.function captures is
    # inlined as one, and a gradient tape still differentiates it.
    if eager or t.graph is graph:
      sources.add(_ClosureSource(t))
      # A captured tensor is tied to what it captures on the gradient tapes
      # at each use; the forward pass's use was unrecorded.
      forward_ops.record_capture(t)
  return tuple(sources.found)


def _add_raw_variables(sources, leaves, run, keras_backing):
  """Adds the tf.Variables passed in or watched; returns their handles' ids."""
  raw = [x for x in leaves if isinstance(x, tf.Variable)]
  raw += [v for v in run.watched if isinstance(v, tf.Variable)]
  for v in raw:
    if id(v) in keras_backing or not sources.first_time(v):
      continue
    if is_differentiable(v):
      # The rerun reads the forward pass's read (invariant 6); `read`,
      # recorded by gradient tapes, carries the gradient.
      read = v.value()
      sources.add_if_recorded(
          RawSource(read, value=run.ops.first_read(v), variable=v))
  return {_handle_id(v) for v in raw}


def _add_read_handles(sources, ops, covered):
  """Adds variables read without a tape watching the variable object (a
  non-trainable tf.Variable the caller watched), found by their handles."""
  covered = set(covered)
  for handle, dtype in ops.read_handles():
    if id(handle) in covered or not (dtype.is_floating or dtype.is_complex):
      continue
    covered.add(id(handle))
    if sources.eager and not _is_recorded(handle):
      continue
    read = gen_resource_variable_ops.read_variable_op(
        in_current_graph(handle), dtype)
    sources.found.append(
        RawSource(read, value=ops.first_read_of_handle(handle),
                   handle=handle))


def _handle_id(variable):
  """Identifies a variable by its handle, followed out of captures, as
  `forward_ops.ForwardOps.read_handles` names the variables the block read."""
  return id(forward_ops.capture_origin(forward_ops.handle(variable)))


def in_current_graph(x):
  """`x`, or the current graph's capture of it if it is an eager tensor."""
  if isinstance(x, tf.Tensor) and not tf.is_symbolic_tensor(x):
    return tf.convert_to_tensor(x)
  return x


def _is_recorded(tensor):
  """Whether a gradient tape or a forward accumulator watches `tensor`."""
  if record.should_record_backprop([tensor]):
    return True
  indices, _ = pywrap_tfe.TFE_Py_PackJVPs([tensor])
  return bool(indices)


class _Source:
  """Something the rerun reads and the gradient may be asked for."""

  kind = None  # Named in `saved_residuals`' table.
  # A variable's gradient is handed on last (`rerun._GraphRerun`).
  is_variable = False

  def __init__(self, tensor, index=None):
    self.tensor = tensor
    self.index = index

  def watched(self):
    """What an eager rerun's tape watches for this source."""
    return self.tensor

  def check_unchanged(self):
    """Raises where an eager rerun would read another value."""

  def rerun_target(self, rerun):
    """What a `_GraphRerun` differentiates for this source."""
    raise NotImplementedError

  def closure_read(self, target, graph):
    """Where the function also read this source by closure, that read in
    `graph` (its gradient adds to the source's); else None."""
    del target, graph
    return None

  def raw_read(self):
    """For a raw tf.Variable: (its handle, the value its rerun reads)."""
    return None


class InputSource(_Source):
  """An argument of the function."""

  kind = "input"

  def rerun_target(self, rerun):
    return rerun.tensor(self.tensor)

  def closure_read(self, target, graph):
    # A tensor a tf.function captured, passed and closed over: the rerun's
    # target is a gated copy, and the closure reads the tensor itself.
    if target is self.tensor:
      return None
    return selective.in_graph(self.tensor, graph)


class KerasSource(_Source):
  """A Keras variable the call touched; `index` into the record's
  `keras_values`, which the rerun reads (invariant 5)."""

  kind = "keras"
  is_variable = True

  def rerun_target(self, rerun):
    return rerun.tensor(rerun.forward.keras_values[self.index])


class _ClosureSource(_Source):
  """A tensor the function read without receiving it (invariant 7)."""

  kind = "closure"

  def rerun_target(self, rerun):
    # As the rerun reads it: a gradient graph (a while loop's, say) captures
    # the original tensor anew.
    return selective.in_graph(forward_ops.capture_origin(self.tensor), rerun.graph)


class RawSource(_Source):
  """A raw tf.Variable: the tf.Variable, or (read by a function without a
  tape watching the variable object) only its resource handle. `tensor` is
  a read that gradient tapes record; `value` is what the rerun reads, the
  forward pass's own read where there is one (invariant 6)."""

  kind = "raw"
  is_variable = True

  def __init__(self, tensor, value=None, variable=None, handle=None):
    super().__init__(tensor)
    self.variable = variable
    self._handle = handle
    self.value = tensor if value is None else value

  def handle(self):
    return self.variable.handle if self.variable is not None else self._handle

  def raw_read(self):
    return self.handle(), self.value

  def watched(self):
    return self.variable if self.variable is not None else self._handle

  @property
  def name(self):
    return self.variable.name if self.variable is not None else "(a variable)"

  def read_again(self):
    if self.variable is not None:
      return self.variable.value()
    return gen_resource_variable_ops.read_variable_op(self._handle,
                                                      self.tensor.dtype)

  def check_unchanged(self):
    if not bool(tf.reduce_all(tf.equal(self.read_again(), self.tensor))):
      raise errors.RerunMismatchError(
          f"The tf.Variable '{self.name}' changed between the forward "
          "and the backward pass of a rematerialized call (e.g. an assign "
          "between two gradient calls on a persistent tape). Eager "
          "rematerialization rereads tf.Variables and would differentiate "
          "against the new value. Use a keras.Variable (its forward-time "
          "value is replayed), run the step in a tf.function, or take the "
          "gradients before changing the variable.")

  def rerun_target(self, rerun):
    # The handle: the rerun's dense reads are replaced by the forward read,
    # which the handle feeds, and its sparse reads (ResourceGather) take the
    # handle directly.
    return selective.in_graph(self.handle(), rerun.graph)


class forward_reads(watch.Handler):  # pylint: disable=invalid-name
  """In a graph, reads of raw tf.Variables give their forward-time values.

  A handler may replace the outputs of an op being added to a graph; here,
  each `ReadVariableOp` of a variable in `reads` ((handle, forward-time
  read) pairs) returns that read instead, so an assignment between the two
  passes changes nothing, as without rematerialization (invariant 5).
  """

  def __init__(self, reads):
    self._reads = reads
    self._handles = {}

  def _handle_ids(self, graph):
    if graph not in self._handles:
      ids = {}
      for handle, read in self._reads:
        ids[id(selective.in_graph(handle, graph))] = read
      self._handles[graph] = ids
    return self._handles[graph]

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    if op_type != "ReadVariableOp" or graph is None:
      return outputs
    read = self._handle_ids(graph).get(id(inputs[0]))
    return outputs if read is None else [selective.in_graph(read, graph)]
