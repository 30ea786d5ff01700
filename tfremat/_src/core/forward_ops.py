"""What a forward pass's ops are watched for while it runs (`ForwardOps`):
ops that cannot be replayed (stateful random ops, writes to `tf.Variable`s)
are refused, tensors captured by closure and the first read of each
variable are recorded, and gradient tapes outside the call are kept aside.
"""

import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record
from tensorflow.python.eager import tape as tape_lib
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import gen_resource_variable_ops
from tensorflow.python.ops import resource_variable_ops

from tfremat import errors
from tfremat._src.core import selective
from tfremat._src.core import op_types
from tfremat._src.core import tapes
from tfremat._src.core import unreplayable
from tfremat._src.core import watch

__all__ = [
    "ForwardOps",
    "RandomAfterInputs",
    "capture_origin",
    "record_capture",
    "handle",
]


_READS = frozenset(["ReadVariableOp", "ResourceGather"])


class RandomAfterInputs(watch.Handler):
  """In a graph, makes each random op that reads nothing computed from the
  call's inputs wait for the last op built before it that does (or, before
  any, for the inputs).

  A dropout mask is drawn from a seed and a static shape, nothing of the
  layer's input. Left alone, the graph executor may draw a call's masks (or
  every rematerialized call's) at the start of the step and hold them until
  their layers run, and a step's peak then moves from call to call by
  several masks (docs/design.md, "Budgets that hold"). Waiting for the op
  built before it, the draw runs when its layer is reached, as in eager
  mode. XLA ignores control edges and orders its ops itself. Used by the
  forward pass and by the rerun.
  """

  def __init__(self, inputs):
    self._inputs = inputs
    self._derived = set()
    self._last = None  # The last op built that reads the inputs.

  def __enter__(self):
    self._derived = {id(t) for t in self._inputs}
    self._last = None
    return super().__enter__()

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    if graph is None or not outputs:
      return outputs
    if any(id(t) in self._derived for t in inputs):
      self._derived.update(id(t) for t in outputs)
      self._last = outputs[0].op
    elif (selective.is_random_draw(op_type) and
          not control_flow_util.GraphOrParentsInXlaContext(graph)):
      anchor = self._last
      if anchor is None or anchor.graph is not graph:
        # Nothing built from the inputs yet: the inputs themselves.
        anchor = next((t.op for t in self._inputs
                       if getattr(t, "graph", None) is graph), None)
      if anchor is not None:
        outputs[0].op._add_control_inputs([anchor])  # pylint: disable=protected-access
    return outputs


class _Refuser(watch.Handler):
  """Refuses ops the rerun could not replay, undoing an eager draw first."""

  def __init__(self):
    self._undoing = False

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    if self._undoing:
      return outputs  # The write that undoes a refused draw.
    try:
      unreplayable.check_op(op_type, op_name)
    except errors.UnreplayableOpError:
      self._undoing = True
      try:
        unreplayable.undo_generator_draw(op_type, inputs, outputs)
      finally:
        self._undoing = False
      raise
    return outputs


class _Closures(watch.Handler):
  """Finds the tensors a block reads that it neither received nor computed:
  closure captures (docs/design.md, invariant 7)."""

  def __init__(self, inputs):
    self._seen = {id(t) for t in inputs}
    self.external = {}  # id -> tensor, in first-use order.

  def computed(self, tensor):
    """Notes a tensor made where no callback sees it as computed."""
    self._seen.add(id(tensor))

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    for t in inputs:
      if id(t) not in self._seen:
        self._seen.add(id(t))
        self.external[id(t)] = t
    if op_type != "Placeholder":
      # A placeholder made while the block is traced stands for a tensor of
      # an enclosing graph that the block captured (inside a while loop's
      # body, say): an input from outside, not a computed value.
      self._seen.update(id(t) for t in outputs or ())
    return outputs


class _FirstReads(watch.Handler):
  """Names the variables a block reads, and in a graph makes every dense
  read of one return the forward pass's first read (invariant 6)."""

  def __init__(self, closures):
    self._closures = closures
    self.graph = None  # The forward's graph; None in eager mode.
    self.reads = {}  # id(handle) -> (handle, first read in self.graph).
    self.handles = {}  # id -> (handle, dtype), in first-read order.
    self._reading = False

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    if op_type in _READS and inputs and outputs:
      origin = capture_origin(inputs[0])
      self.handles.setdefault(id(origin), (origin, outputs[0].dtype))
    if (self.graph is not None and graph is not None and not self._reading
        and op_type == "ReadVariableOp" and outputs):
      outputs = self._shared_read(inputs[0], outputs, graph)
    return outputs

  def _shared_read(self, handle, outputs, graph):
    """A read's outputs: the forward's first read of the variable."""
    origin = capture_origin(handle)
    entry = self.reads.get(id(origin))
    if entry is None:
      if graph is self.graph:
        self.reads[id(origin)] = (origin, outputs[0])
        return outputs
      if not _encloses(self.graph, graph):
        return outputs
      # First read inside a graph nested in the forward's (a loop body, a
      # branch, an inner tf.function): read in the forward's graph, where
      # the rerun can use the value too, and capture that.
      self._reading = True
      try:
        with self.graph.as_default():
          read = gen_resource_variable_ops.read_variable_op(
              selective.in_graph(origin, self.graph), outputs[0].dtype)
      finally:
        self._reading = False
      # Made inside a callback, it is not seen by one: mark it computed, or
      # a forward-graph op reading it later would take it for a closure.
      self._closures.computed(read)
      entry = self.reads[id(origin)] = (origin, read)
    return [selective.in_graph(entry[1], graph)]

  def __enter__(self):
    self.graph = op_types.running_graph()
    return super().__enter__()


class _TapesAside:
  """Lets a `tf.GradientTape` the block opens itself, and only it, record
  (invariant 9): the tapes open outside are set aside while it is open."""

  def __init__(self):
    self.used = False
    self._open = 0
    self._hidden = []

  def entered(self):
    self.used = True
    if self._open == 0:
      self._set_aside()
    self._open += 1

  def _set_aside(self):
    # A tape an enclosing forward pass set aside is out of the tape set
    # already: removing it again would drop a reference TensorFlow's tape
    # set holds, and free the tape while it is in use.
    aside = tapes.thread_list("aside")
    hidden = [t for t in tapes.thread_list("tapes")
              if t._recording and not any(t is a for a in aside)]  # pylint: disable=protected-access
    for t in hidden:
      tape_lib.pop_tape(t._tape)  # pylint: disable=protected-access
    if record.could_possibly_record():
      # A tape opened before tfremat was imported, or a forward accumulator:
      # it cannot be set aside, and would record the block.
      for t in hidden:
        tape_lib.push_tape(t._tape)  # pylint: disable=protected-access
      raise errors.UnreplayableOpError(
          "The rematerialized function opens a tf.GradientTape while a "
          "gradient tape or forward accumulator that tfremat cannot set "
          "aside is recording (one opened before tfremat was imported, or "
          "a tf.autodiff.ForwardAccumulator). Import tfremat before opening "
          "tapes, or compute the inner gradient outside the rematerialized "
          "function.")
    pywrap_tfe.TFE_Py_TapeSetRestartOnThread()
    self._hidden = hidden
    aside.extend(hidden)

  def exited(self):
    self._open -= 1
    if self._open == 0:
      pywrap_tfe.TFE_Py_TapeSetStopOnThread()
      aside = tapes.thread_list("aside")
      for t in self._hidden:
        tape_lib.push_tape(t._tape)  # pylint: disable=protected-access
        aside.remove(t)
      self._hidden = []


class ForwardOps:
  """Watches every op the forward pass runs or builds, one handler per job.

  Op callbacks see ops as they are added to a graph being traced (before
  anything runs) and, in eager mode, right after each op executed, so one
  check covers eager mode and `tf.function`. The jobs, in the order each op
  meets them:

  - refuse unreplayable ops (`_Refuser`). An eager direct tf.Variable write
    has happened once when the error is raised; a tf.random.Generator draw
    is undone; no other state has changed, since `RecordingScope` defers
    Keras variable updates;
  - count op types, for the rerun's comparison (`OpTypes`);
  - find closure captures, which need a gradient as much as the inputs do
    (`_Closures`);
  - in a graph, make every dense read of a variable in the forward pass
    return the pass's first read of it, made in the forward's own graph,
    which the rerun then reads too (`_FirstReads`). The rerun's values are
    thereby computed by ops the forward outputs depend on. A read made
    anywhere else would be ordered before the step's later writes to the
    variable (an optimizer's update in the same `tf.function`) by a control
    edge alone, and Grappler drops that edge: the custom-gradient identity
    that attaches the call's gradient reads the gradient's sources, which
    makes the edge look redundant, and is then bypassed. The rerun would
    then sometimes read the updated weights (tests/variable_order_test.py).

  The forward pass runs with gradient recording stopped. A `tf.GradientTape`
  that the block opens itself (a gradient inside the function) must still
  record the block's ops (`_TapesAside`).
  """

  def __init__(self, inputs, debug=False):
    self._types = op_types.OpTypes(debug)
    self._closures = _Closures(inputs)
    self._reads = _FirstReads(self._closures)
    self._handlers = [_Refuser(), self._types, self._closures, self._reads,
                      RandomAfterInputs(inputs)]
    self._tapes = _TapesAside()

  @property
  def op_types(self):
    return self._types.op_types

  @property
  def op_details(self):
    """Each counted op described, under `debug`; else None."""
    return self._types.details

  @property
  def inner_tape_used(self):
    return self._tapes.used

  def inner_tape_entered(self):
    self._tapes.entered()

  def inner_tape_exited(self):
    self._tapes.exited()

  def external_tensors(self):
    """Tensors the block read but did not receive or compute, in use order."""
    return list(self._closures.external.values())

  def first_read(self, variable):
    """The forward pass's read of a tf.Variable or keras.Variable, a tensor
    of the forward's graph, or None (eager mode, or never read densely)."""
    return self.first_read_of_handle(capture_origin(handle(variable)))

  def first_read_of_handle(self, handle):
    entry = self._reads.reads.get(id(handle))
    return None if entry is None else entry[1]

  def read_handles(self):
    """(handle, dtype) of every variable the block read, followed out of
    function captures, in first-read order."""
    return list(self._reads.handles.values())

  def record_reads(self, variables):
    """Has the gradient tapes open now record the forward pass's reads of
    `variables` as reads, as `tf.Variable` records its own.

    The forward pass runs unrecorded; recorded, a read the rerun uses
    connects a gradient of the rerun (a second-order one) to the variable.
    """
    for variable in variables:
      read = self.first_read(variable)
      if read is None:
        continue
      resource_variable_ops.variable_accessed(variable)
      record.record_operation("ReadVariableOp", [read], [handle(variable)],
                              backward_function=lambda x: [x],
                              forward_function=lambda x: [x])

  def __enter__(self):
    # New handlers per block: nested rematerialized calls each enter and
    # leave their own.
    for handler in self._handlers:
      handler.__enter__()
    tapes.thread_list("forwards").append(self)
    return self

  def __exit__(self, *args):
    tapes.thread_list("forwards").pop()
    for handler in reversed(self._handlers):
      handler.__exit__(*args)


def capture_origin(tensor):
  """The tensor that a function graph's placeholder captured, followed out to
  the graph that computed it; `tensor` itself if it is no capture."""
  while tf.is_symbolic_tensor(tensor) and tensor.op.type == "Placeholder":
    captures = getattr(tensor.graph, "captures", ())
    origin = next((e for e, internal in captures if internal is tensor), None)
    if origin is None:
      break
    tensor = origin
  return tensor


def record_capture(tensor):
  """Ties `tensor`, a function graph's capture, to what it captured on the
  gradient tapes recording now, as a use of the capture in user code does
  (TensorFlow records the tie at every use, so a use while recording was
  stopped left none)."""
  captures = getattr(getattr(tensor, "graph", None), "captures", ())
  origin = next((e for e, internal in captures if internal is tensor), None)
  if origin is not None and origin.dtype != tf.resource:
    record.record_operation("captured_value", [tensor], [origin],
                            backward_function=lambda x: [x],
                            forward_function=lambda x: [x])


def handle(variable):
  """The resource handle a read of a tf.Variable or keras.Variable takes."""
  variable = getattr(variable, "_value", variable)  # A keras.Variable's.
  try:
    return variable.handle
  except ValueError:
    # A distributed variable outside a replica context (a model called in a
    # strategy's scope) is read from its copy on this device or its primary.
    return variable._get_on_device_or_primary().handle  # pylint: disable=protected-access


def _encloses(outer, graph):
  """Whether `graph` is `outer` or a function graph nested in it."""
  while graph is not None:
    if graph is outer:
      return True
    graph = getattr(graph, "outer_graph", None)
  return False
