"""RematerializeFn: recompute a function's activations in the backward pass.

Example:

  import tensorflow as tf, keras, tfremat

  block = keras.Sequential([keras.layers.Dense(512, activation="relu"),
                            keras.layers.Dropout(0.1),
                            keras.layers.Dense(512)])

  @tf.function(jit_compile=True)
  def step(x):
    with tf.GradientTape() as tape:
      y = tfremat.RematerializeFn(lambda h: block(h, training=True), x)
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, [x] + block.trainable_weights)

The forward pass keeps only the inputs of `fn`; the backward pass reruns `fn`
with the same random seeds and variable state and differentiates it with
`tf.gradients`, so the gradients equal those without rematerialization.
"""

import functools

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context
from tensorflow.python.eager import record
from tensorflow.python.framework import ops

from tfremat import state
from tfremat import step_seed


def _is_variable(x):
  return isinstance(x, (tf.Variable, keras.Variable))


def _is_differentiable(t):
  return t.dtype.is_floating or t.dtype.is_complex


def _to_input_leaf(x):
  if _is_variable(x) or x is None:
    return x
  try:
    return tf.convert_to_tensor(x)
  except (TypeError, ValueError) as e:
    raise TypeError(
        "RematerializeFn inputs must be tensors, variables, or nested "
        "tuples/lists/dicts of them; got a leaf of type "
        f"{type(x).__name__}: {x!r}. Bind other arguments into fn instead "
        "(e.g. with functools.partial or a lambda).") from e


def _to_output_leaf(y):
  try:
    return tf.convert_to_tensor(y)
  except (TypeError, ValueError) as e:
    raise TypeError(
        "The function given to RematerializeFn must return tensors or nested "
        f"tuples/lists/dicts of them; it returned a leaf of type "
        f"{type(y).__name__}: {y!r}.") from e


def _gradient_gate(dys):
  """A float32 zero computed from the incoming gradient.

  The rerun's inputs are offset by this zero, which makes every recomputed op
  depend on the gradient through data. Control dependencies would not do: XLA
  ignores them, and without any dependency the runtime is free to run the
  recompute during the forward pass (keeping its activations alive, as
  Lingvo's version does under tf.function) or common-subexpression-eliminate it
  with the forward ops. `b & ~b` is False even when the gradient is NaN or
  empty, and no optimizer folds it to a constant.
  """
  for dy in dys:
    if isinstance(dy, tf.IndexedSlices):
      dy = dy.values
    if dy is not None and _is_differentiable(dy):
      first = tf.reshape(dy, [-1])[:1]
      b = tf.cast(tf.reduce_sum(tf.cast(first, tf.float32)), tf.bool)
      return tf.cast(tf.logical_and(b, tf.logical_not(b)), tf.float32)
  return None


def _gate(x, zero):
  """`x` unchanged in value, but computed after `zero` is available."""
  if x.dtype == tf.bool:
    return tf.logical_or(x, tf.cast(zero, tf.bool))
  if x.dtype.is_floating or x.dtype.is_complex or x.dtype.is_integer:
    # Subtracting +0 keeps the sign of a -0.0 input, where adding would not.
    return x - tf.cast(zero, x.dtype)
  with tf.control_dependencies([zero]):
    return tf.identity(x)


def _unconnected_outputs(dys):
  """Which incoming gradients are the tape's stand-ins for "no gradient".

  For an output the loss does not use, the gradient tape passes zeros rather
  than None. Differentiating the rerun against those zeros would give a zero
  gradient, where the plain computation gives None, to variables that only
  that output uses (and an optimizer treats the two differently). The tape's
  zeros are recognizable: in a graph they are a constant, in eager mode the
  tape hands out one cached tensor per shape.
  """
  ctx = context.context()
  zeros_cache = ctx.zeros_cache() if hasattr(ctx, "zeros_cache") else None
  unconnected = []
  for dy in dys:
    if dy is None or isinstance(dy, tf.IndexedSlices):
      unconnected.append(dy is None)
    elif isinstance(dy, ops.EagerTensor):
      key = (tuple(dy.shape.as_list()), dy.dtype, ctx.device_name)
      unconnected.append(
          zeros_cache is not None and zeros_cache.get(key) is dy)
    else:
      value = tf.get_static_value(dy)
      unconnected.append(value is not None and not np.any(value))
  return unconnected


def RematerializeFn(fn, *xs):
  """Returns `fn(*xs)`, recomputing its activations in the backward pass.

  Args:
    fn: a callable. It may call Keras layers and read variables; gradients flow
      to every trainable variable it reads, as without rematerialization. Its
      random numbers must come from seeds (Keras random layers and
      `keras.random` ops with a `SeedGenerator`, `GenerateStepSeedPair`,
      `DeterministicDropout`); a stateful random op raises
      `UnreplayableOpError`. Keras variable updates (BatchNormalization
      statistics, seed generators) are applied once.
    *xs: tensors, variables, or nested tuples/lists/dicts of them. Floating
      point tensors are differentiated; integer and bool tensors are passed
      through without gradient.

  Returns:
    What `fn(*xs)` returns: a tensor or a nested structure of tensors.
  """
  if not callable(fn):
    raise TypeError(
        f"RematerializeFn expects a callable as its first argument, got "
        f"{type(fn).__name__}. Usage: RematerializeFn(fn, *inputs).")
  # The default on_losses refuses losses, so none come back here.
  outputs, _ = rematerialize_with_losses(fn, xs)
  return outputs


def _refuse_losses(losses):
  raise state.UnreplayableOpError(
      f"The rematerialized function added {len(losses)} loss(es) with "
      "add_loss (e.g. an activity_regularizer). RematerializeFn returns only "
      "what the function returns and cannot hand them back to the layer that "
      "added them: wrap the layer with tfremat.RematerializationLayer, which "
      "does, or compute the loss outside the rematerialized function.")


def rematerialize_with_losses(fn, xs, on_losses=_refuse_losses):
  """`RematerializeFn(fn, *xs)` that also returns the losses `fn` added.

  Returns `(outputs, losses)`, where `losses` pairs each loss tensor that `fn`
  passed to `add_loss` in the forward pass with its differentiable
  counterpart: add the latter to the training loss so that its gradient
  reaches the variables. `on_losses(original_losses)` is called before any
  variable update is applied and may raise to refuse them.
  """
  leaves = [_to_input_leaf(x) for x in tf.nest.flatten(xs)]
  tensor_ids = [i for i, x in enumerate(leaves) if isinstance(x, tf.Tensor)]
  diff_ids = [i for i in tensor_ids if _is_differentiable(leaves[i])]

  def call_fn(leaf_values):
    return fn(*tf.nest.pack_sequence_as(xs, leaf_values))

  # Filled in by the forward pass; needed to unpack its flat result.
  forward = {}

  @tf.custom_gradient
  def rematerialized(*diff_inputs):
    values = list(leaves)
    for i, t in zip(diff_ids, diff_inputs):
      values[i] = t
    seed = step_seed.GetStepSeed()
    global_step = step_seed.GetGlobalStep()
    outputs, recorded = _run_forward(call_fn, values, seed)
    flat_outputs = [_to_output_leaf(y) for y in tf.nest.flatten(outputs)]
    if recorded.losses:
      on_losses(recorded.losses)
    forward["structure"] = outputs
    forward["losses"] = recorded.losses
    recorded.apply_updates()

    def grad_fn(*dys, variables=None):
      variables = list(variables or [])
      backward = tf.function(
          functools.partial(_rerun_and_differentiate, call_fn, values,
                            tensor_ids, diff_ids, recorded.variables,
                            variables),
          autograph=False)
      unconnected = _unconnected_outputs(dys)
      dys = [None if skip else dy for dy, skip in zip(dys, unconnected)]
      input_grads, variable_grads = backward(
          _gradient_gate(dys), [values[i] for i in tensor_ids], dys,
          seed, global_step, recorded.before)
      return list(input_grads), list(variable_grads)

    return flat_outputs + recorded.losses, grad_fn

  flat = rematerialized(*[leaves[i] for i in diff_ids])
  num_outputs = len(flat) - len(forward["losses"])
  outputs = tf.nest.pack_sequence_as(forward["structure"], flat[:num_outputs])
  return outputs, list(zip(forward["losses"], flat[num_outputs:]))


def _run_forward(call_fn, values, seed):
  """Runs the forward pass, keeping nothing for the backward pass.

  Returns the outputs and the `ForwardState` recorded while they were computed.
  Layers built on this call create their variables inside the recording scope,
  where Keras only initializes them on exit; the outputs of that run used
  placeholder weights, so the pass runs again, from the same step `seed`, once
  the variables exist.
  """
  for _ in range(2):
    with record.stop_recording():
      with state.RecordingScope() as scope, state.unreplayable_ops():
        outputs = call_fn(values)
    if not scope.created_variables:
      return outputs, state.ForwardState(scope)
    step_seed.ResetStepSeed(seed)
  raise RuntimeError(
      "RematerializeFn: the function keeps creating variables on every call. "
      "Create layers and variables once, outside the function, and call them "
      "inside it.")


def _rerun_and_differentiate(call_fn, values, tensor_ids, diff_ids,
                             state_variables, variables, gate, inputs, dys,
                             seed, global_step, state_before):
  """The backward pass, traced as a graph function: rerun, then tf.gradients."""
  if gate is not None:
    # The seeds and state are gated too: otherwise XLA common-subexpression
    # eliminates the rerun's random draws (e.g. dropout masks) with the forward
    # pass's and keeps every mask alive until the backward pass.
    inputs, seed, global_step, state_before = tf.nest.map_structure(
        lambda t: _gate(t, gate), (inputs, seed, global_step, state_before))
  values = list(values)
  for i, x in zip(tensor_ids, inputs):
    values[i] = x
  with step_seed.replaying(seed, global_step):
    with state.replaying(state_variables, state_before) as losses:
      outputs = call_fn(values)
  ys = [tf.convert_to_tensor(y) for y in tf.nest.flatten(outputs)] + losses
  pairs = [(y, dy) for y, dy in zip(ys, dys)
           if dy is not None and _is_differentiable(y)]
  targets = [values[i] for i in diff_ids] + variables
  if not pairs:
    grads = [None] * len(targets)
  else:
    grads = tf.gradients(
        [y for y, _ in pairs], targets, grad_ys=[dy for _, dy in pairs],
        unconnected_gradients=tf.UnconnectedGradients.NONE)
  return grads[:len(diff_ids)], grads[len(diff_ids):]


def rematerialize(fn):
  """Decorator form of `RematerializeFn`.

  Positional arguments are the (differentiated) inputs; keyword arguments are
  bound as Python values, so `training=True`, `mask=...` and the like work in
  eager mode and inside `tf.function` alike. Keyword arguments receive no
  gradient.

  Example:

    @tfremat.rematerialize
    def block(x, training=False):
      return dense2(dropout(dense1(x), training=training))

    y = block(x, training=True)
  """
  if not callable(fn):
    raise TypeError(
        f"rematerialize expects a callable, got {type(fn).__name__}.")

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    if kwargs:
      return RematerializeFn(functools.partial(fn, **kwargs), *args)
    return RematerializeFn(fn, *args)

  return wrapper
