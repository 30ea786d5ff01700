"""Ops a rematerialized function cannot replay (stateful random ops, direct
variable writes): refused while its forward pass runs, with the fix."""


from tensorflow.python.framework import ops
from tensorflow.python.ops import gen_resource_variable_ops

from tfremat import errors

__all__ = [
    "check_op",
    "undo_generator_draw",
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


def _is_variable_write(op_type):
  return ((op_type.startswith("Assign") and op_type.endswith("VariableOp")) or
          op_type.startswith(("ResourceScatter", "ResourceApply",
                              "ResourceSparseApply", "ResourceStridedSliceAssign")))


def check_op(op_type, op_name):
  where = f" '{op_name}'" if op_name else ""
  if op_type in _STATEFUL_RANDOM_OPS:
    raise errors.UnreplayableOpError(
        f"The rematerialized function runs the stateful random op "
        f"{op_type}{where} (from {_STATEFUL_RANDOM_OPS[op_type]}). {_RANDOM_FIX}")
  if _is_variable_write(op_type):
    raise errors.UnreplayableOpError(
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

