"""The op types a pass runs or builds, as the forward-rerun comparison
counts them, and where in the user's code each was made (`debug=True`)."""

import os
import traceback

import keras
import tensorflow as tf

from tfremat._src.core import watch

__all__ = [
    "counted_op_type",
    "running_graph",
    "OpTypes",
]


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

