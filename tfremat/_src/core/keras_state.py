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

import keras
import tensorflow as tf

from tfremat import errors

__all__ = [
    "read_value",
    "NestedScope",
    "RecordingScope",
    "ForwardState",
    "replaying",
]


def _num_uninitialized():
  return len(keras.src.backend.common.global_state.get_global_attribute(
      "uninitialized_variables", []))


def read_value(variable):
  """The stored value of a Keras variable, never autocast to a compute dtype."""
  with keras.src.backend.common.variables.AutocastScope(None):
    return tf.identity(variable.value)


class NestedScope(keras.StatelessScope):
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


class RecordingScope(NestedScope):
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
      raise errors.UnreplayableOpError(
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
  with NestedScope(
      state_mapping=list(zip(variables, values)),
      collect_losses=True,
      initialize_variables=False) as scope:
    yield scope.losses

