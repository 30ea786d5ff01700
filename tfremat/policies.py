"""Save policies: which tensors a rematerialized call keeps from its forward
pass instead of recomputing them.

  y = tfremat.RematerializeFn(block, x, policy=tfremat.policies.dots_saveable)

By default a rematerialized call keeps only its inputs and recomputes
everything else in the backward pass. Under a policy it also keeps the
outputs of the ops the policy chooses, and the backward pass uses them where
it would have recomputed them: everything upstream of a kept tensor that only
it needed is not recomputed at all. Matrix products are the expensive part of
a layer and their outputs are often no larger than the elementwise tensors
around them, so keeping them buys most of the time back for little memory.

A policy is a function of an `Op` (the op's type, name, input and output
shapes and dtypes, and the name given by `checkpoint_name`, if any) that
returns True to keep the op's outputs. The built-in ones:

- `nothing_saveable`: keep nothing (the default; the same as no policy);
- `everything_saveable`: keep every op's outputs (nothing is recomputed;
  useful as a check);
- `dots_saveable`: keep matrix products (`MatMul`, `BatchMatMul*`, `Einsum`)
  and convolutions;
- `dots_with_no_batch_dims_saveable`: the same, except products with batch
  dimensions on both sides, such as attention's query-key scores and their
  product with the values, which are recomputed (as Megatron-LM's selective
  recomputation does for the attention core);
- `masks_saveable`: keep boolean tensors: dropout masks and other
  comparisons. They take a quarter of a float32 tensor's bytes, and a
  dropout mask costs a random draw to recompute, which on a CPU takes longer
  than many matrix products;
- `softmax_saveable`: keep softmax outputs, such as attention's
  probabilities. A softmax's gradient reads only its output, so with it kept
  nothing in the backward pass needs the scores it was computed from: the
  scores' product, their masking and the softmax (an exponential and two
  reductions over attention's largest tensor) are not recomputed;
- `dots_and_masks_saveable`, `dots_with_no_batch_dims_and_masks_saveable`,
  `masks_and_softmax_saveable`, `dots_masks_and_softmax_saveable`,
  `dots_with_no_batch_dims_masks_and_softmax_saveable`: the unions of those;
- `save_only_these_names(*names)`: keep the tensors named with
  `checkpoint_name` under these names;
- `save_anything_except_these_names(*names)`: keep every op's outputs except
  the named tensors (and the op that computed each of them);
- `save_from_both_policies(a, b)`: keep what either policy keeps.

`scope(policy)` sets the policy of the rematerialized calls made inside it
that name none.

Policies act in graphs: inside a `tf.function`, with or without XLA. An
eager call runs each op as it is called, before anything could decide not to
run it, so there a policy keeps nothing (the gradients are the same; only the
time and memory of graph mode are at stake).
"""

import dataclasses
import re
import threading

import tensorflow as tf

__all__ = [
    "Op",
    "checkpoint_name",
    "dots_saveable",
    "dots_and_masks_saveable",
    "dots_with_no_batch_dims_and_masks_saveable",
    "dots_masks_and_softmax_saveable",
    "dots_with_no_batch_dims_masks_and_softmax_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "get",
    "masks_and_softmax_saveable",
    "masks_saveable",
    "name_of",
    "nothing_saveable",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
    "scope",
    "softmax_saveable",
]


@dataclasses.dataclass(frozen=True)
class Op:
  """What a policy sees of one op of a rematerialized function.

  Attributes:
    type: the op type, e.g. "MatMul", "BatchMatMulV2", "Conv2D", "Identity".
    name: the op's name in its graph (with name scopes).
    input_shapes, output_shapes: tuples of `tf.TensorShape`.
    input_dtypes, output_dtypes: tuples of `tf.DType`.
    checkpoint_name: the name `checkpoint_name` gave the op's output, or
      None.
    attrs: the op's attributes that the built-in policies read (e.g.
      "equation" of an Einsum), as a dict.
  """
  type: str
  name: str
  input_shapes: tuple
  output_shapes: tuple
  input_dtypes: tuple
  output_dtypes: tuple
  checkpoint_name: str = None
  attrs: dict = dataclasses.field(default_factory=dict, compare=False)

  @property
  def output_bytes(self):
    """The bytes of the op's outputs, if their shapes are fully known."""
    total = 0
    for shape, dtype in zip(self.output_shapes, self.output_dtypes):
      if not shape.is_fully_defined():
        return None
      total += shape.num_elements() * dtype.size
    return total


_thread = threading.local()


def checkpoint_name(x, name):
  """`x` (a tensor or a nest of them), named for `save_only_these_names` and
  `save_anything_except_these_names`.

  The value is unchanged (an identity); a policy sees the op that makes it
  with `Op.checkpoint_name == name`. Outside a rematerialized function, or in
  eager mode, it only costs an identity.
  """
  if not isinstance(name, str) or not name:
    raise TypeError(
        f"checkpoint_name needs a non-empty string name; got {name!r}.")

  def mark(t):
    _thread.name = name
    try:
      return tf.identity(t)
    finally:
      _thread.name = None

  return tf.nest.map_structure(mark, x)


def pending_checkpoint_name():
  """The name `checkpoint_name` is giving the Identity op being created."""
  return getattr(_thread, "name", None)


def _policy(fn, name):
  fn.__name__ = fn.__qualname__ = name
  return fn


def nothing_saveable(op):
  """Keep nothing: every tensor is recomputed (the default)."""
  del op
  return False


def everything_saveable(op):
  """Keep every op's outputs: nothing is recomputed."""
  del op
  return True


_MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
_CONVS = re.compile(r"(Conv\d?D?(Native)?|DepthwiseConv2dNative|Conv)$")


def _is_conv(op_type):
  return bool(_CONVS.fullmatch(op_type))


def _is_dot(op):
  return op.type in _MATMULS or op.type == "Einsum" or _is_conv(op.type)


def _has_batch_dims(op):
  """Whether a product has batch dimensions on both operands (attention
  scores) rather than a weight matrix on one side (a dense layer)."""
  if op.type == "MatMul":
    return False
  if op.type in _MATMULS:
    ranks = [s.rank for s in op.input_shapes[:2]]
    return all(r is None or r > 2 for r in ranks)
  if op.type == "Einsum":
    equation = op.attrs.get("equation")
    if not equation or "->" not in equation:
      return True
    operands, out = equation.split("->")
    terms = operands.split(",")
    if len(terms) != 2:
      return True
    both = set(terms[0]) & set(terms[1]) & set(out)
    return bool(both - {"."})
  return False


def dots_saveable(op):
  """Keep the outputs of matrix products and convolutions."""
  return _is_dot(op)


def dots_with_no_batch_dims_saveable(op):
  """Keep the outputs of matrix products without batch dimensions on both
  operands (dense layers, projections) and of convolutions; products such as
  attention's scores are recomputed."""
  return _is_dot(op) and not _has_batch_dims(op)


def masks_saveable(op):
  """Keep boolean outputs (dropout masks, comparisons)."""
  return bool(op.output_dtypes) and all(d == tf.bool for d in op.output_dtypes)


def softmax_saveable(op):
  """Keep the outputs of softmaxes (attention probabilities)."""
  return op.type in ("Softmax", "LogSoftmax")


def dots_and_masks_saveable(op):
  """`dots_saveable` and `masks_saveable` together."""
  return dots_saveable(op) or masks_saveable(op)


def dots_with_no_batch_dims_and_masks_saveable(op):
  """`dots_with_no_batch_dims_saveable` and `masks_saveable` together."""
  return dots_with_no_batch_dims_saveable(op) or masks_saveable(op)


def masks_and_softmax_saveable(op):
  """`masks_saveable` and `softmax_saveable` together."""
  return masks_saveable(op) or softmax_saveable(op)


def dots_masks_and_softmax_saveable(op):
  """`dots_saveable`, `masks_saveable` and `softmax_saveable` together."""
  return dots_and_masks_saveable(op) or softmax_saveable(op)


def dots_with_no_batch_dims_masks_and_softmax_saveable(op):
  """`dots_with_no_batch_dims_saveable`, `masks_saveable` and
  `softmax_saveable` together."""
  return dots_with_no_batch_dims_and_masks_saveable(op) or softmax_saveable(op)


def _names(names, caller):
  names = tuple(names)
  if not names or not all(isinstance(n, str) and n for n in names):
    raise TypeError(f"{caller} takes one or more non-empty string names; got "
                    f"{names!r}.")
  return names


def save_only_these_names(*names):
  """A policy keeping the tensors named with `checkpoint_name(x, name)` for
  one of `names`, and nothing else."""
  names = _names(names, "save_only_these_names")

  def policy(op):
    return op.checkpoint_name in names

  policy.config = {"save_only_these_names": list(names)}
  return _policy(policy, f"save_only_these_names({', '.join(map(repr, names))})")


def save_anything_except_these_names(*names):
  """A policy keeping every op's outputs except the tensors named with
  `checkpoint_name(x, name)` for one of `names`: those, and the op that
  computed each, are recomputed."""
  names = _names(names, "save_anything_except_these_names")

  def policy(op):
    return op.checkpoint_name not in names

  policy.config = {"save_anything_except_these_names": list(names)}
  policy.unsave_named_inputs = True
  return _policy(policy, "save_anything_except_these_names("
                 f"{', '.join(map(repr, names))})")


def save_from_both_policies(first, second):
  """A policy keeping what either policy keeps."""
  first, second = get(first), get(second)

  def policy(op):
    return bool(first(op)) or bool(second(op))

  policy.unsave_named_inputs = (
      getattr(first, "unsave_named_inputs", False) or
      getattr(second, "unsave_named_inputs", False))
  policy.config = {"save_from_both_policies": [serialize(first),
                                               serialize(second)]}
  return _policy(policy, f"save_from_both_policies({name_of(first)}, "
                 f"{name_of(second)})")


BUILT_IN = {
    "nothing_saveable": nothing_saveable,
    "everything_saveable": everything_saveable,
    "dots_saveable": dots_saveable,
    "dots_with_no_batch_dims_saveable": dots_with_no_batch_dims_saveable,
    "masks_saveable": masks_saveable,
    "dots_and_masks_saveable": dots_and_masks_saveable,
    "dots_with_no_batch_dims_and_masks_saveable":
        dots_with_no_batch_dims_and_masks_saveable,
    "softmax_saveable": softmax_saveable,
    "masks_and_softmax_saveable": masks_and_softmax_saveable,
    "dots_masks_and_softmax_saveable": dots_masks_and_softmax_saveable,
    "dots_with_no_batch_dims_masks_and_softmax_saveable":
        dots_with_no_batch_dims_masks_and_softmax_saveable,
}

# What the planner chooses among, besides keeping and rematerializing fully
# (everything_saveable is keeping, at a higher cost): the policies on the
# bench's time-memory front. Measured every block on its transformer (CPU),
# keeping masks and softmax outputs as well as dots was faster at equal
# memory than keeping dots alone or dots and masks, and on models without
# softmax or dropout the unions equal their parts.
PLANNED = ("dots_masks_and_softmax_saveable",
           "dots_with_no_batch_dims_masks_and_softmax_saveable",
           "dots_with_no_batch_dims_and_masks_saveable",
           "masks_and_softmax_saveable", "masks_saveable")


def serialize(policy):
  """A JSON-able form of a policy (for a layer's config): a built-in's name,
  a composed policy's recipe, or Keras's serialization of a function (which
  loads where the function is importable or registered with
  `keras.saving.register_keras_serializable`). None stays None."""
  if policy is None or isinstance(policy, str):
    return policy
  for name, fn in BUILT_IN.items():
    if policy is fn:
      return name
  config = getattr(policy, "config", None)
  if config is not None:
    return dict(config)
  import keras  # pylint: disable=g-import-not-at-top
  return keras.saving.serialize_keras_object(policy)


def deserialize(config):
  """The policy `serialize` described."""
  if config is None or isinstance(config, str):
    return get(config) if config is not None else None
  if isinstance(config, dict) and len(config) == 1:
    (key, value), = config.items()
    if key == "save_only_these_names":
      return save_only_these_names(*value)
    if key == "save_anything_except_these_names":
      return save_anything_except_these_names(*value)
    if key == "save_from_both_policies":
      return save_from_both_policies(*[deserialize(v) for v in value])
  import keras  # pylint: disable=g-import-not-at-top
  return get(keras.saving.deserialize_keras_object(config))


_default = threading.local()


class scope:  # pylint: disable=invalid-name
  """Within it, rematerialized calls that name no policy use `policy`.

    with tfremat.policies.scope("dots_saveable"):
      loss = model(x, training=True)   # its RematerializationLayers save dots

  A call or layer given `policy=` explicitly keeps its own.
  """

  def __init__(self, policy):
    self.policy = get(policy)

  def __enter__(self):
    stack = getattr(_default, "stack", None)
    if stack is None:
      stack = _default.stack = []
    stack.append(self.policy)
    return self

  def __exit__(self, *args):
    _default.stack.pop()


def current():
  """The policy of the innermost `scope`, or None."""
  stack = getattr(_default, "stack", None)
  return stack[-1] if stack else None


def get(policy):
  """A policy function from a policy, its built-in name, or None (which is
  `nothing_saveable`). Raises TypeError or ValueError naming the choices."""
  if policy is None:
    return nothing_saveable
  if isinstance(policy, str):
    if policy not in BUILT_IN:
      raise ValueError(
          f"Unknown policy {policy!r}. The named policies are "
          f"{sorted(BUILT_IN)}; for names given with checkpoint_name use "
          "tfremat.policies.save_only_these_names(...), or pass a function "
          "of a tfremat.policies.Op returning True to keep its outputs.")
    return BUILT_IN[policy]
  if not callable(policy):
    raise TypeError(
        f"A policy is a function of a tfremat.policies.Op returning True to "
        f"keep the op's outputs, or a built-in policy's name "
        f"({sorted(BUILT_IN)}); got {type(policy).__name__}: {policy!r}.")
  return policy


def name_of(policy):
  """A policy's name, as serialized and printed; None for no policy."""
  if policy is None:
    return None
  if isinstance(policy, str):
    return policy
  return getattr(policy, "__name__", repr(policy))


def is_nothing(policy):
  """Whether `policy` keeps nothing, i.e. is today's full rematerialization."""
  return policy is None or policy is nothing_saveable or (
      policy == "nothing_saveable")
