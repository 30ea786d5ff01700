"""Save policies (`tfremat.policies`): what a rematerialized call keeps,
as values; their names, serialization and the default's scope."""

import dataclasses
import functools
import inspect
import re
import threading

import tensorflow as tf

from tfremat import errors

__all__ = [
    "Op",
    "Policy",
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
    "parsed",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
    "scope",
    "short_name",
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
    raise errors.InvalidTypeError(
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


class Policy:
  """A save policy as a value: call it on an `Op` (True keeps the op's
  outputs), combine policies with `|` (keep what either keeps), compare them
  with `==`, and write one into a layer's config (`serialize`).

  The built-in policies are instances; so are `save_only_these_names(...)`,
  `save_anything_except_these_names(...)` and unions. A plain function of an
  `Op` is a policy too, and `|` combines it with a `Policy`.
  """
  __slots__ = ()

  # Whether a tensor named with `checkpoint_name` that the policy does not
  # keep is recomputed together with the op computing it
  # (`save_anything_except_these_names`).
  unsave_named_inputs = False

  def keeps(self, op):
    raise NotImplementedError

  def __call__(self, op):
    return self.keeps(op)

  def __or__(self, other):
    return _any_of(self, other)

  def __ror__(self, other):
    return _any_of(other, self)

  @property
  def __name__(self):
    return self.name

  @property
  def description(self):
    """What the policy keeps, in a sentence."""
    return inspect.cleandoc(type(self).__doc__).split("\n\n")[0].replace(
        "\n", " ")

  @property
  def name(self):
    """The policy's name: a built-in's, or how to make it again."""
    return next((n for n, p in BUILT_IN.items() if p == self), self._name())

  def _name(self):
    raise NotImplementedError

  def get_config(self):
    """A JSON-able form: a built-in's name or a recipe (`deserialize`)."""
    return next((n for n, p in BUILT_IN.items() if p == self),
                self._config())

  def _config(self):
    raise NotImplementedError

  def __repr__(self):
    return f"<tfremat policy {self.name}>"


@dataclasses.dataclass(frozen=True, repr=False)
class _Kind(Policy):
  """A built-in policy: keeps the outputs of one kind of op."""
  kind: str
  test: object = dataclasses.field(compare=False)
  says: str = dataclasses.field(compare=False, default="")

  @property
  def description(self):
    return self.says

  def keeps(self, op):
    return self.test(op)

  def _name(self):
    return self.kind

  def _config(self):
    return self.kind


@dataclasses.dataclass(frozen=True, repr=False)
class _Named(Policy):
  """Keeps the tensors named with `checkpoint_name` (`keep_named`), or
  everything except them."""
  names: tuple
  keep_named: bool

  @property
  def unsave_named_inputs(self):
    return not self.keep_named

  def keeps(self, op):
    return (op.checkpoint_name in self.names) == self.keep_named

  def _maker(self):
    return ("save_only_these_names" if self.keep_named else
            "save_anything_except_these_names")

  def _name(self):
    return f"{self._maker()}({', '.join(map(repr, self.names))})"

  def _config(self):
    return {self._maker(): list(self.names)}


@dataclasses.dataclass(frozen=True, repr=False)
class _AnyOf(Policy):
  """Keeps what any of its parts keeps (made by `|`)."""
  parts: frozenset

  @property
  def unsave_named_inputs(self):
    return any(getattr(p, "unsave_named_inputs", False) for p in self.parts)

  @property
  def description(self):
    return (f"Keeps what any of {', '.join(name_of(p) for p in self._ordered())}"
            " keeps.")

  def keeps(self, op):
    return any(bool(p(op)) for p in self._ordered())

  def _ordered(self):
    # One order for equal unions: Policies by their config, then functions.
    return sorted(self.parts, key=lambda p: (
        (0, str(p.get_config())) if isinstance(p, Policy) else
        (1, name_of(p))))

  def _name(self):
    return " | ".join(name_of(p) for p in self._ordered())

  def _config(self):
    return {"any_of": [serialize(p) for p in self._ordered()]}


@dataclasses.dataclass(frozen=True, repr=False)
class _Function(Policy):
  """A user's plain function of an `Op`, as a policy value (`get`)."""
  function: object

  def keeps(self, op):
    return self.function(op)

  def _name(self):
    return getattr(self.function, "__name__", repr(self.function))

  def _config(self):
    import keras  # pylint: disable=g-import-not-at-top
    return keras.saving.serialize_keras_object(self.function)


def _any_of(first, second):
  """`first | second`: a policy keeping what either keeps."""
  parts = set()
  for policy in (first, second):
    policy = policy if isinstance(policy, Policy) else get(policy)
    if policy == everything_saveable:
      return everything_saveable
    if isinstance(policy, _AnyOf):
      parts |= policy.parts
    elif policy != nothing_saveable:
      parts.add(policy)
  if not parts:
    return nothing_saveable
  if len(parts) == 1:
    return next(iter(parts))
  return _AnyOf(frozenset(parts))


_MATMULS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")
_CONVS = re.compile(r"(Conv\d?D?(Native)?|DepthwiseConv2dNative|Conv)$")


def _is_conv(op_type):
  return bool(_CONVS.fullmatch(op_type))


def is_dot_type(op_type):
  """Whether ops of `op_type` are what the dots policies save: matrix
  products and convolutions (the planner's printouts name them "dots")."""
  return op_type in _MATMULS or op_type == "Einsum" or _is_conv(op_type)


def _is_dot(op):
  return is_dot_type(op.type)


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


# Keep nothing: every tensor is recomputed (the default).
nothing_saveable = _Kind("nothing_saveable", lambda op: False,
                         "Keeps nothing: every tensor is recomputed (the default).")
# Keep every op's outputs: nothing is recomputed.
everything_saveable = _Kind("everything_saveable", lambda op: True,
                            "Keeps every op's outputs: nothing is recomputed.")
# Keep the outputs of matrix products and convolutions.
dots_saveable = _Kind("dots_saveable", _is_dot, "Keeps the outputs of matrix "
                      "products and convolutions.")
# Keep the outputs of matrix products without batch dimensions on both
# operands (dense layers, projections) and of convolutions; products such as
# attention's scores are recomputed.
dots_with_no_batch_dims_saveable = _Kind(
    "dots_with_no_batch_dims_saveable",
    lambda op: _is_dot(op) and not _has_batch_dims(op),
    "Keeps the outputs of matrix products without batch dimensions on both "
    "operands (dense layers, projections) and of convolutions.")
# Keep boolean outputs (dropout masks, comparisons).
masks_saveable = _Kind(
    "masks_saveable", lambda op: bool(op.output_dtypes) and all(
        d == tf.bool for d in op.output_dtypes),
    "Keeps boolean outputs (dropout masks, comparisons).")
# Keep the outputs of softmaxes (attention probabilities).
softmax_saveable = _Kind("softmax_saveable",
                         lambda op: op.type in ("Softmax", "LogSoftmax"),
                         "Keeps the outputs of softmaxes (attention "
                         "probabilities).")
# The unions, under the names users already use.
dots_and_masks_saveable = dots_saveable | masks_saveable
dots_with_no_batch_dims_and_masks_saveable = (
    dots_with_no_batch_dims_saveable | masks_saveable)
masks_and_softmax_saveable = masks_saveable | softmax_saveable
dots_masks_and_softmax_saveable = (
    dots_saveable | masks_saveable | softmax_saveable)
dots_with_no_batch_dims_masks_and_softmax_saveable = (
    dots_with_no_batch_dims_saveable | masks_saveable | softmax_saveable)


def _names(names, caller):
  names = tuple(names)
  if not names or not all(isinstance(n, str) and n for n in names):
    raise errors.InvalidTypeError(f"{caller} takes one or more non-empty string names; got "
                    f"{names!r}.")
  return names


def save_only_these_names(*names):
  """A policy keeping the tensors named with `checkpoint_name(x, name)` for
  one of `names`, and nothing else."""
  return _Named(_names(names, "save_only_these_names"), keep_named=True)


def save_anything_except_these_names(*names):
  """A policy keeping every op's outputs except the tensors named with
  `checkpoint_name(x, name)` for one of `names`: those, and the op that
  computed each, are recomputed."""
  return _Named(_names(names, "save_anything_except_these_names"),
                keep_named=False)


def save_from_both_policies(first, second):
  """A policy keeping what either policy keeps: `first | second`."""
  return _any_of(first, second)


BUILT_IN = {p.kind if isinstance(p, _Kind) else name: p for name, p in (
    ("nothing_saveable", nothing_saveable),
    ("everything_saveable", everything_saveable),
    ("dots_saveable", dots_saveable),
    ("dots_with_no_batch_dims_saveable", dots_with_no_batch_dims_saveable),
    ("masks_saveable", masks_saveable),
    ("dots_and_masks_saveable", dots_and_masks_saveable),
    ("dots_with_no_batch_dims_and_masks_saveable",
     dots_with_no_batch_dims_and_masks_saveable),
    ("softmax_saveable", softmax_saveable),
    ("masks_and_softmax_saveable", masks_and_softmax_saveable),
    ("dots_masks_and_softmax_saveable", dots_masks_and_softmax_saveable),
    ("dots_with_no_batch_dims_masks_and_softmax_saveable",
     dots_with_no_batch_dims_masks_and_softmax_saveable))}

# What the planner chooses among, besides keeping and rematerializing fully
# (everything_saveable is keeping, at a higher cost): the policies on the
# bench's time-memory front. Measured every block on its transformer (CPU),
# keeping masks and softmax outputs as well as dots was faster at equal
# memory than keeping dots alone or dots and masks, and on models without
# softmax or dropout the unions equal their parts.
PLANNED = (dots_masks_and_softmax_saveable,
           dots_with_no_batch_dims_masks_and_softmax_saveable,
           dots_with_no_batch_dims_and_masks_saveable,
           masks_and_softmax_saveable, masks_saveable)


def serialize(policy):
  """A JSON-able form of a policy (for a layer's config): a built-in's name,
  a `Policy`'s recipe, or Keras's serialization of a function (which loads
  where the function is importable or registered with
  `keras.saving.register_keras_serializable`). None stays None."""
  if policy is None or isinstance(policy, str):
    return policy
  return get(policy).get_config()


_RECIPES = {
    "save_only_these_names": lambda v: save_only_these_names(*v),
    "save_anything_except_these_names":
        lambda v: save_anything_except_these_names(*v),
    "any_of": lambda v: functools.reduce(_any_of, map(deserialize, v)),
    # Written by earlier versions for save_from_both_policies(a, b).
    "save_from_both_policies":
        lambda v: functools.reduce(_any_of, map(deserialize, v)),
}


def deserialize(config):
  """The policy `serialize` described."""
  if config is None or isinstance(config, str):
    return get(config) if config is not None else None
  if isinstance(config, dict) and len(config) == 1:
    (key, value), = config.items()
    if key in _RECIPES:
      return _RECIPES[key](value)
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
  """The `Policy` value of a policy, a built-in's name, a plain function of
  an `Op` (wrapped, so that it is compared, named and saved as the others
  are), or None (which is `nothing_saveable`). Raises TypeError or
  ValueError naming the choices."""
  if policy is None:
    return nothing_saveable
  if isinstance(policy, Policy):
    return policy
  if isinstance(policy, str):
    if policy not in BUILT_IN:
      raise errors.InvalidArgumentError(
          f"Unknown policy {policy!r}. The named policies are "
          f"{sorted(BUILT_IN)}; for names given with checkpoint_name use "
          "tfremat.policies.save_only_these_names(...), or pass a function "
          "of a tfremat.policies.Op returning True to keep its outputs.")
    return BUILT_IN[policy]
  if not callable(policy):
    raise errors.InvalidTypeError(
        f"A policy is a function of a tfremat.policies.Op returning True to "
        f"keep the op's outputs, or a built-in policy's name "
        f"({sorted(BUILT_IN)}); got {type(policy).__name__}: {policy!r}.")
  return _Function(policy)


# Short names of the built-in policies, for tables.
_SHORT = {
    "dots_saveable": "dots",
    "dots_with_no_batch_dims_saveable": "dots/nobatch",
    "masks_saveable": "masks",
    "dots_and_masks_saveable": "dots+masks",
    "dots_with_no_batch_dims_and_masks_saveable": "dots/nob+masks",
    "softmax_saveable": "softmax",
    "masks_and_softmax_saveable": "masks+softmax",
    "dots_masks_and_softmax_saveable": "dots+masks+softmax",
    "dots_with_no_batch_dims_masks_and_softmax_saveable":
        "dots/nob+masks+softmax",
}


def short_name(policy):
  """A policy's short name for tables ("dots+masks"); its name (`name_of`)
  where it has none."""
  name = name_of(policy)
  return _SHORT.get(name, name)


def name_of(policy):
  """A policy's name, as printed; None for no policy."""
  if policy is None:
    return None
  if isinstance(policy, str):
    return policy
  if isinstance(policy, Policy):
    return policy.name
  return getattr(policy, "__name__", repr(policy))


def parsed(policy):
  """`get(policy)`, but None stays None (a call that names no policy takes
  its scope's when it runs)."""
  return None if policy is None else get(policy)


def is_nothing(policy):
  """Whether `policy` keeps nothing: full rematerialization."""
  return (policy is None or policy == "nothing_saveable" or
          (isinstance(policy, Policy) and policy == nothing_saveable))
