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
stateful random ops and direct writes to `tf.Variable`s
(`forward_ops.ForwardOps`).
"""

import contextlib
import os
import threading
import traceback

import keras
import tensorflow as tf
from tensorflow.python.eager import backprop
from tensorflow.python.framework import ops
from tensorflow.python.ops import gen_resource_variable_ops

from tfremat import errors
from tfremat._src import watch

__all__ = [
    "UnreplayableOpError",
    "counted_op_type",
    "OpTypes",
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


def check_op(op_type, op_name):
  where = f" '{op_name}'" if op_name else ""
  if op_type in _STATEFUL_RANDOM_OPS:
    raise UnreplayableOpError(
        f"The rematerialized function runs the stateful random op "
        f"{op_type}{where} (from {_STATEFUL_RANDOM_OPS[op_type]}). {_RANDOM_FIX}")
  if _is_variable_write(op_type):
    raise UnreplayableOpError(
        f"The rematerialized function writes a tf.Variable directly (op "
        f"{op_type}{where}). {_VARIABLE_FIX}")


def undo_generator_draw(op_type, inputs, outputs):
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


def running_graph():
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
    self._graph = running_graph()
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


_thread = threading.local()


def thread_list(name):
  """A list kept per thread: gradient tapes, forward passes."""
  if not hasattr(_thread, name):
    setattr(_thread, name, [])
  return getattr(_thread, name)


def _install_tape_hooks():
  """Tracks the gradient tapes open on each thread, for `ForwardOps`.

  Installed once, when tfremat is imported, and left in place: outside a
  forward pass it only keeps a per-thread list of open tapes.
  """
  if getattr(backprop.GradientTape.__enter__, "_tfremat_hook", False):
    return
  enter, exit_ = backprop.GradientTape.__enter__, backprop.GradientTape.__exit__

  def hooked_enter(self):
    forwards = thread_list("forwards")
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
    thread_list("tapes").append(self)
    return result

  def hooked_exit(self, *args):
    try:
      return exit_(self, *args)
    finally:
      tapes = thread_list("tapes")
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
