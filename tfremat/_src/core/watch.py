"""One op callback for every job tfremat does on the ops a function builds.

TensorFlow calls an op callback for each op added to a graph being traced
and, in eager mode, for each op right after it ran; a callback may replace
the op's outputs. tfremat has several such jobs (refusing unreplayable ops,
finding closure captures, sharing a variable's first read, keeping what a
save policy chooses, ordering a chain's ops, ...). Each is a `Handler`;
entered, it joins this thread's list, and a single registered callback
shows each op to the handlers in the order they were entered, each getting
the outputs the previous one returned. Ops made by a handler are seen by
none (TensorFlow does not call callbacks from inside one).
"""

import threading

from tensorflow.python.eager import context
from tensorflow.python.eager import execute

__all__ = ["Handler", "last_op_id"]

_local = threading.local()


def _handlers():
  """This thread's entered handlers, in entry order (TensorFlow keeps op
  callbacks per thread too)."""
  if not hasattr(_local, "handlers"):
    _local.handlers = []
  return _local.handlers


def _dispatch(op_type, inputs, attrs, outputs, op_name=None, graph=None):
  del attrs
  if isinstance(op_type, bytes):  # Eager ops give their type as bytes.
    op_type = op_type.decode()
  for handler in list(_handlers()):
    outputs = handler.on_op(op_type, inputs, outputs, op_name, graph)
  return outputs


def last_op_id(graph):
  """The id of the newest op of `graph`: ops made later have larger ids."""
  return max(graph._nodes_by_id, default=0)  # pylint: disable=protected-access


class Handler:
  """A job done on every op made or run while the handler is entered."""

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    """Returns the op's outputs: `outputs`, or tensors to use in their place.

    `op_type` is a str (eager ops' bytes are decoded); `graph` is the graph
    the op was added to, None for an eager op.
    """
    raise NotImplementedError

  def __enter__(self):
    handlers = _handlers()
    if not handlers:
      _register()
    handlers.append(self)
    return self

  def __exit__(self, *args):
    handlers = _handlers()
    for i in range(len(handlers) - 1, -1, -1):
      if handlers[i] is self:
        del handlers[i]
        break
    if not handlers:
      context.context().remove_op_callback(_dispatch)


def _register():
  """Registers `_dispatch` as this thread's op callback.

  TensorFlow keeps op callbacks per thread, but `op_callbacks.add_op_callback`
  also switches the module-level `execute.execute` (how ops without a fast
  path run eagerly) to the version that calls them, and
  `remove_op_callback` switches it back for every thread as soon as the
  calling thread has none left: a thread still watching would miss some of
  its eager ops (a BiasAdd, a Mean) and its rerun check would fail. So the
  switch is made here and never undone; with no callback registered, the
  calling version only loops over an empty list.
  """
  context.context().add_op_callback(_dispatch)
  execute.execute = execute.execute_with_callbacks
