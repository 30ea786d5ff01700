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
stateful random ops and direct writes to `tf.Variable`s (`unreplayable_ops`).
"""

import contextlib

import keras
import tensorflow as tf
from tensorflow.python.framework import op_callbacks

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


class UnreplayableOpError(ValueError):
  """The rematerialized function uses an op whose effect cannot be replayed."""

  # tf.function's AutoGraph re-raises an error from user code with its own
  # type only when the type takes a plain message (Exception.__init__);
  # otherwise the caller sees a StagingError instead of this class.
  __init__ = Exception.__init__


def _is_variable_write(op_type):
  return ((op_type.startswith("Assign") and op_type.endswith("VariableOp")) or
          op_type.startswith(("ResourceScatter", "ResourceApply",
                              "ResourceSparseApply", "ResourceStridedSliceAssign")))


def _check_op(op_type, op_name):
  if isinstance(op_type, bytes):  # Eager execution passes bytes.
    op_type = op_type.decode()
  where = f" '{op_name}'" if op_name else ""
  if op_type in _STATEFUL_RANDOM_OPS:
    raise UnreplayableOpError(
        f"The rematerialized function runs the stateful random op "
        f"{op_type}{where} (from {_STATEFUL_RANDOM_OPS[op_type]}). {_RANDOM_FIX}")
  if _is_variable_write(op_type):
    raise UnreplayableOpError(
        f"The rematerialized function writes a tf.Variable directly (op "
        f"{op_type}{where}). {_VARIABLE_FIX}")


@contextlib.contextmanager
def unreplayable_ops():
  """Raises `UnreplayableOpError` when the block runs or builds such an op.

  Op callbacks see ops as they are added to a graph being traced (before
  anything runs) and, in eager mode, right after each op executed, so one
  check covers eager mode and `tf.function`. An eager direct tf.Variable write
  has therefore happened once when the error is raised; no other state has
  changed, since `RecordingScope` defers Keras variable updates.
  """

  # A new callback per block: nested rematerialized calls each add and remove
  # their own (TensorFlow keeps one registration per callback object).
  def callback(op_type, inputs, attrs, outputs, op_name=None, graph=None):
    del inputs, attrs, outputs, graph  # Only the op's identity matters.
    _check_op(op_type, op_name)

  op_callbacks.add_op_callback(callback)
  try:
    yield
  finally:
    op_callbacks.remove_op_callback(callback)


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
  """A StatelessScope that also remembers which variables were assigned."""

  def __init__(self, **kwargs):
    super().__init__(collect_losses=True, **kwargs)
    self.updated = {}  # id -> variable, in first-assignment order.
    self._uninitialized_at_entry = 0

  def __enter__(self):
    self._uninitialized_at_entry = _num_uninitialized()
    return super().__enter__()

  def __exit__(self, *args):
    # Keras initializes variables created in the scope on exit, but only when
    # the scope is outermost; remember whether any were created first.
    self.created_variables = _num_uninitialized() > self._uninitialized_at_entry
    return super().__exit__(*args)

  def add_update(self, update):
    variable = update[0]
    if variable.trainable:
      raise UnreplayableOpError(
          f"The rematerialized function assigns to the trainable variable "
          f"'{variable.path}'. Its gradient would be computed against the "
          "assigned value in the backward pass. Assign trainable variables "
          "outside the rematerialized function.")
    self.updated.setdefault(id(variable), variable)
    super().add_update(update)


class ForwardState:
  """What the forward pass read and wrote, for one rematerialized call."""

  def __init__(self, scope):
    self.variables = list(scope.updated.values())
    # The variables still hold their pre-call values: the scope deferred the
    # assignments. These are what the rerun must read.
    self.before = [read_value(v) for v in self.variables]
    self.after = [scope.get_current_value(v) for v in self.variables]
    self.losses = list(scope.losses)

  def apply_updates(self):
    """Applies the forward pass's variable updates (once)."""
    for variable, value in zip(self.variables, self.after):
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
