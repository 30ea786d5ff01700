"""What a rematerialized function reads and writes, recorded so it can replay.

The forward pass of `RematerializeFn` runs the wrapped function inside a
`RecordingScope`, a `keras.StatelessScope` that defers every Keras variable
assignment (BatchNormalization statistics, `SeedGenerator` states, counters)
and collects `add_loss` losses. After the function returns, the values those
variables had *before* the function ran are snapshotted and the deferred
updates are applied, once. The backward-pass rerun runs in a
`keras.StatelessScope` mapped to the snapshot, so it reads exactly the state the
forward pass read (the same dropout masks) and its own updates are discarded.

What cannot be replayed this way is refused while the forward pass runs:
stateful random ops and direct writes to `tf.Variable`s (`ForwardOps`).
"""

import contextlib
import os
import threading
import traceback

import keras
import tensorflow as tf
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import backprop
from tensorflow.python.eager import record
from tensorflow.python.eager import tape as tape_lib
from tensorflow.python.framework import ops
from tensorflow.python.ops import gen_resource_variable_ops
from tensorflow.python.ops import resource_variable_ops

from tfremat import errors
from tfremat._src import selective
from tfremat._src import watch

__all__ = [
    "UnreplayableOpError",
    "counted_op_type",
    "OpTypes",
    "ForwardOps",
    "capture_origin",
    "record_capture",
    "read_value",
    "RecordingScope",
    "ForwardState",
    "replaying",
]

# Stateful random op types, with the public API that creates each.
_STATEFUL_RANDOM_OPS = {
    "RandomUniform": "tf.random.uniform or tf.nn.dropout",
    "RandomUniformInt": "tf.random.uniform with an integer dtype",
    "RandomStandardNormal": "tf.random.normal",
    "TruncatedNormal": "tf.random.truncated_normal",
    "ParameterizedTruncatedNormal": "tf.random.truncated_normal",
    "RandomGamma": "tf.random.gamma",
    "RandomPoisson": "tf.random.poisson",
    "RandomPoissonV2": "tf.random.poisson",
    "RandomShuffle": "tf.random.shuffle",
    "RandomCrop": "tf.image.random_crop",
    "Multinomial": "tf.random.categorical",
    "RandomIndexShuffle": "tf.random.experimental.index_shuffle",
    "StatefulUniform": "tf.random.Generator",
    "StatefulUniformInt": "tf.random.Generator",
    "StatefulUniformFullInt": "tf.random.Generator",
    "StatefulStandardNormal": "tf.random.Generator",
    "StatefulStandardNormalV2": "tf.random.Generator",
    "StatefulTruncatedNormal": "tf.random.Generator",
    "StatefulRandomBinomial": "tf.random.Generator",
    "RngSkip": "tf.random.Generator",
    "RngReadAndSkip": "tf.random.Generator",
}

_RANDOM_FIX = (
    "Rematerialization reruns the function in the backward pass, and a "
    "stateful random op would draw different numbers there, making the "
    "gradients silently wrong. Draw from a seed instead: "
    "tf.random.stateless_* with seed=tfremat.GenerateStepSeedPair(), "
    "tfremat.DeterministicDropout(x, keep_prob, tfremat.GenerateStepSeedPair()) "
    "instead of tf.nn.dropout, or a Keras layer / keras.random op with a "
    "keras.random.SeedGenerator (its state is replayed).")

_VARIABLE_FIX = (
    "Rematerialization reruns the function in the backward pass, so a direct "
    "tf.Variable write would be applied twice. Use a keras.Variable "
    "(e.g. Layer.add_weight; its updates are applied once and replayed), or "
    "make the update outside the rematerialized function.")


UnreplayableOpError = errors.UnreplayableOpError


def _is_variable_write(op_type):
  return ((op_type.startswith("Assign") and op_type.endswith("VariableOp")) or
          op_type.startswith(("ResourceScatter", "ResourceApply",
                              "ResourceSparseApply", "ResourceStridedSliceAssign")))


def _check_op(op_type, op_name):
  where = f" '{op_name}'" if op_name else ""
  if op_type in _STATEFUL_RANDOM_OPS:
    raise UnreplayableOpError(
        f"The rematerialized function runs the stateful random op "
        f"{op_type}{where} (from {_STATEFUL_RANDOM_OPS[op_type]}). {_RANDOM_FIX}")
  if _is_variable_write(op_type):
    raise UnreplayableOpError(
        f"The rematerialized function writes a tf.Variable directly (op "
        f"{op_type}{where}). {_VARIABLE_FIX}")


def _undo_generator_draw(op_type, inputs, outputs):
  """Puts back the state a tf.random.Generator draw advanced in eager mode.

  An eager op callback runs after the op, so the refused draw has already
  advanced the generator. Its `RngReadAndSkip` op returns the state as it
  was (padded to three elements), which is written back, so that the error
  leaves the generator as it found it.
  """
  if op_type != "RngReadAndSkip" or not outputs:
    return
  handle, old = inputs[0], outputs[0]
  if not isinstance(old, ops.EagerTensor):
    return  # Traced: nothing ran.
  size = gen_resource_variable_ops.variable_shape(handle)[0]
  gen_resource_variable_ops.assign_variable_op(handle, old[:size])


# Ops that say nothing about what a pass computes, or that the rerun makes
# differently by design (it reads replayed values where the forward pass
# read variables, and its callbacks add identities and captures).
_UNCOUNTED_OPS = frozenset([
    "Placeholder", "Const", "Identity", "IdentityN", "NoOp", "ReadVariableOp",
    "Cast",
    "VarHandleOp", "_Arg", "_Retval",
])


_STATEFUL_ALIKE = {"StatelessWhile": "While", "StatelessIf": "If",
                   "StatelessCase": "Case",
                   "StatefulPartitionedCall": "PartitionedCall"}


def counted_op_type(op_type):
  """`op_type` as the forward-rerun comparison counts it, or None."""
  if op_type.startswith("__"):
    # An eager tf.function call: under a gradient tape TensorFlow calls the
    # function's forward variant, whose name differs.
    return "<tf.function call>"
  if op_type in _UNCOUNTED_OPS:
    return None
  # Whether control flow or a call is stateful depends on what its body
  # reads: variables in the forward pass, replayed values in the rerun.
  return _STATEFUL_ALIKE.get(op_type, op_type)


def _running_graph():
  """The graph ops are added to now; None when executing eagerly (an eager
  op's callback gets graph=None)."""
  return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


class OpTypes(watch.Handler):
  """Records the types of the ops run or built while it is open, in order:
  what the rerun computed, to compare with `ForwardOps.op_types`.

  Only ops of the graph it was opened in count (eager ops, when opened
  eagerly). Ops traced into other graphs come and go with caches: a new
  keras.Sequential traces its layers in a scratch graph on its first call,
  and a tf.function traces on its first call (and, under a tape, traces a
  forward variant); the call and control-flow ops that run them do count.

  With `debug`, `details` also describes each counted op: its type, its name
  in a graph, and the line of the caller's code that made it.
  """

  def __init__(self, debug=False):
    self.op_types = []
    self.details = [] if debug else None
    self._graph = None

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    counted = counted_op_type(op_type)
    if counted is not None and graph is self._graph:
      self.op_types.append(counted)
      if self.details is not None:
        name = f" '{op_name}'" if op_name else ""
        self.details.append(f"{counted}{name} at {_callers_line()}")
    return outputs

  def __enter__(self):
    self._graph = _running_graph()
    return super().__enter__()


def _library_folders():
  folders = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]
  folders += [os.path.dirname(os.path.abspath(m.__file__)) for m in (tf, keras)]
  return tuple(folder + os.sep for folder in folders)


def _callers_line():
  """"file.py:line" of the innermost frame outside tfremat, TensorFlow and
  Keras: the code that made the op being watched. A line of code AutoGraph
  converted is given as the line it was converted from."""
  libraries = _library_folders()
  for frame in reversed(traceback.extract_stack()):
    filename, lineno = frame.filename, frame.lineno
    if "__autograph_generated_file" in filename:
      filename, lineno = _autograph_origin(filename, lineno)
    if not os.path.abspath(filename).startswith(libraries):
      return f"{os.path.basename(filename)}:{lineno}"
  return "?"


def _autograph_origin(filename, lineno):
  """The source line AutoGraph converted into a generated file's line."""
  try:
    from tensorflow.python.autograph.impl import api  # pylint: disable=g-import-not-at-top,import-outside-toplevel
    from tensorflow.python.autograph.pyct import origin_info  # pylint: disable=g-import-not-at-top,import-outside-toplevel
    for factories in list(api._TRANSPILER._cache._cache.values()):  # pylint: disable=protected-access
      for factory in list(factories.values()):
        if getattr(factory.module, "__file__", None) == filename:
          origin = factory.source_map.get(
              origin_info.LineLocation(filename, lineno))
          if origin is not None:
            return origin.loc.filename, origin.loc.lineno
  except (AttributeError, ImportError):  # Another TensorFlow's internals.
    pass
  return filename, lineno


_READS = frozenset(["ReadVariableOp", "ResourceGather"])

_thread = threading.local()


def _thread_list(name):
  """A list kept per thread: gradient tapes, forward passes."""
  if not hasattr(_thread, name):
    setattr(_thread, name, [])
  return getattr(_thread, name)


class _Refuser(watch.Handler):
  """Refuses ops the rerun could not replay, undoing an eager draw first."""

  def __init__(self):
    self._undoing = False

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    if self._undoing:
      return outputs  # The write that undoes a refused draw.
    try:
      _check_op(op_type, op_name)
    except UnreplayableOpError:
      self._undoing = True
      try:
        _undo_generator_draw(op_type, inputs, outputs)
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
    self.graph = _running_graph()
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
    aside = _thread_list("aside")
    hidden = [t for t in _thread_list("tapes")
              if t._recording and not any(t is a for a in aside)]  # pylint: disable=protected-access
    for t in hidden:
      tape_lib.pop_tape(t._tape)  # pylint: disable=protected-access
    if record.could_possibly_record():
      # A tape opened before tfremat was imported, or a forward accumulator:
      # it cannot be set aside, and would record the block.
      for t in hidden:
        tape_lib.push_tape(t._tape)  # pylint: disable=protected-access
      raise UnreplayableOpError(
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
      aside = _thread_list("aside")
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
    self._types = OpTypes(debug)
    self._closures = _Closures(inputs)
    self._reads = _FirstReads(self._closures)
    self._handlers = [_Refuser(), self._types, self._closures, self._reads]
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
    return self.first_read_of_handle(capture_origin(_handle(variable)))

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
      record.record_operation("ReadVariableOp", [read], [_handle(variable)],
                              backward_function=lambda x: [x],
                              forward_function=lambda x: [x])

  def __enter__(self):
    # New handlers per block: nested rematerialized calls each enter and
    # leave their own.
    for handler in self._handlers:
      handler.__enter__()
    _thread_list("forwards").append(self)
    return self

  def __exit__(self, *args):
    _thread_list("forwards").pop()
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


def _handle(variable):
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


def _install_tape_hooks():
  """Tracks the gradient tapes open on each thread, for `ForwardOps`.

  Installed once, when tfremat is imported, and left in place: outside a
  forward pass it only keeps a per-thread list of open tapes.
  """
  if getattr(backprop.GradientTape.__enter__, "_tfremat_hook", False):
    return
  enter, exit_ = backprop.GradientTape.__enter__, backprop.GradientTape.__exit__

  def hooked_enter(self):
    forwards = _thread_list("forwards")
    forward = forwards[-1] if forwards else None
    if forward is not None:
      forward.inner_tape_entered()
    try:
      result = enter(self)
    except BaseException:
      if forward is not None:
        forward.inner_tape_exited()
      raise
    self._tfremat_forward = forward  # pylint: disable=protected-access
    _thread_list("tapes").append(self)
    return result

  def hooked_exit(self, *args):
    try:
      return exit_(self, *args)
    finally:
      tapes = _thread_list("tapes")
      if self in tapes:
        tapes.remove(self)
      forward = getattr(self, "_tfremat_forward", None)
      if forward is not None:
        self._tfremat_forward = None  # pylint: disable=protected-access
        forward.inner_tape_exited()

  hooked_enter._tfremat_hook = True  # pylint: disable=protected-access
  backprop.GradientTape.__enter__ = hooked_enter
  backprop.GradientTape.__exit__ = hooked_exit


_install_tape_hooks()


def _num_uninitialized():
  return len(keras.src.backend.common.global_state.get_global_attribute(
      "uninitialized_variables", []))


def read_value(variable):
  """The stored value of a Keras variable, never autocast to a compute dtype."""
  with keras.src.backend.common.variables.AutocastScope(None):
    return tf.identity(variable.value)


class _NestedScope(keras.StatelessScope):
  """A StatelessScope that sees the values of the scope it is nested in.

  Keras reads a variable from the innermost scope only. A rematerialized call
  inside another one's backward-pass rerun must read the outer rerun's
  replayed values (e.g. a dropout seed), not the live variable.
  """

  def get_current_value(self, variable):
    value = super().get_current_value(variable)
    if value is None and getattr(self, "original_scope", None) is not None:
      value = self.original_scope.get_current_value(variable)
    return value


class RecordingScope(_NestedScope):
  """A StatelessScope that records which variables the block reads or writes.

  The rerun must read every Keras variable as the forward pass read it: its
  value may change between the two passes (the forward's own deferred
  updates, an optimizer step or an `assign` between two `tape.gradient`
  calls). So the first touch of each variable is remembered, with the value
  an enclosing scope gave it, if any.
  """

  def __init__(self, **kwargs):
    super().__init__(collect_losses=True, **kwargs)
    self.touched = {}  # id -> (variable, enclosing scope's value or None).
    self.updated = {}  # id -> variable, in first-assignment order.
    self._uninitialized_at_entry = 0
    # Whether the scope's body created variables (Keras initializes them on
    # exit): set on exit.
    self.created_variables = False

  def __enter__(self):
    self._uninitialized_at_entry = _num_uninitialized()
    return super().__enter__()

  def __exit__(self, *args):
    # Keras initializes variables created in the scope on exit, but only when
    # the scope is outermost; remember whether any were created first.
    self.created_variables = _num_uninitialized() > self._uninitialized_at_entry
    return super().__exit__(*args)

  def _touch(self, variable):
    if id(variable) not in self.touched:
      outer = getattr(self, "original_scope", None)
      value = None if outer is None else outer.get_current_value(variable)
      self.touched[id(variable)] = (variable, value)

  def get_current_value(self, variable):
    self._touch(variable)
    return super().get_current_value(variable)

  def add_update(self, update):
    variable = update[0]
    if variable.trainable:
      raise UnreplayableOpError(
          f"The rematerialized function assigns to the trainable variable "
          f"'{variable.path}'. Its gradient would be computed against the "
          "assigned value in the backward pass. Assign trainable variables "
          "outside the rematerialized function.")
    self._touch(variable)
    self.updated.setdefault(id(variable), variable)
    super().add_update(update)


class ForwardState:
  """What the forward pass read and wrote, for one rematerialized call."""

  def __init__(self, scope, ops):
    touched = list(scope.touched.values())
    self.variables = [v for v, _ in touched]
    # The variables still hold their pre-call values (the scope deferred the
    # assignments); these, or an enclosing rerun's replayed values, are what
    # the rerun must read. Reads share the variable's buffer until it is
    # next written, so holding them costs memory only when a variable does
    # change before the backward pass, which is when the copy is needed.
    # `before` is what gradient tapes connect to the variable, and the
    # call's gradient to `before`; the rerun reads the forward pass's own
    # read where there is one (`values`, see `ForwardOps`), the same value.
    # A trainable variable's forward read is `before` too: `record_reads`
    # had the tapes record it (a read of its own per variable slowed a CNN's
    # trace). Others are read here, where tapes record.
    self.before, self.values = [], []
    for v, outer in touched:
      read = None if outer is not None else ops.first_read(v)
      if outer is not None:
        before = outer
      elif read is not None and v.trainable:
        before = read
      else:
        before = read_value(v)
      self.before.append(before)
      self.values.append(before if read is None else read)
    self.updated = list(scope.updated.values())
    self.after = [scope.state_mapping[id(v)] for v in self.updated]
    self.losses = list(scope.losses)

  def apply_updates(self):
    """Applies the forward pass's variable updates (once)."""
    for variable, value in zip(self.updated, self.after):
      variable.assign(value)


@contextlib.contextmanager
def replaying(variables, values):
  """Reruns a block against recorded variable values, discarding its updates.

  Yields the list of losses the block adds with `add_loss`, in order.
  """
  with _NestedScope(
      state_mapping=list(zip(variables, values)),
      collect_losses=True,
      initialize_variables=False) as scope:
    yield scope.losses
