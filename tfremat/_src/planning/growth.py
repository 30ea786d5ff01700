"""How a chain's costs grow with its input's shape, read from its units'
traced training steps, as XLA's rematerialization pass counts memory: each
tensor's bytes, and when it is freed, over the order the step's ops are
built.

A unit's step is traced (not run) at the sample's shape and once more for
each axis of its input but the last, that axis halved. Matching each op's
outputs between the traces gives each tensor's bytes as a monomial of the
axes' ratios to the sample's (`b*s*d` grows as batch x sequence, attention's
scores `b*h*s*s` as batch x sequence squared, a weight's gradient not at
all). A quantity that is a sum of tensors (what the backward pass reads, an
output) is then a polynomial in the ratios, and a peak over the step's ops,
the largest of such sums: a `Rows`, evaluated at any run-time shape, in
Python or in a TensorFlow graph (`Rows.in_graph`).
"""

import dataclasses
import math

import numpy as np
import tensorflow as tf

__all__ = [
    "Rows",
    "maximum",
    "axes_of",
    "ratios",
    "perturbed_sizes",
    "tensor_terms",
    "step_growth",
    "PROPORTIONAL",
]


def _key(exponents):
  """A monomial's exponents, with () for a constant."""
  exponents = tuple(float(e) for e in exponents)
  return () if not any(exponents) else exponents


@dataclasses.dataclass(frozen=True)
class Rows:
  """The largest of several polynomials in the input's axis ratios.

  Each row is a tuple of (exponents, coefficient) terms: the sum over its
  terms of coefficient x prod(ratio[i] ** exponents[i]); () exponents are a
  constant. A value is its largest row. The ratios are positive, so a row
  whose every coefficient is at most another's is never the largest, and is
  dropped.
  """
  rows: tuple = ((),)

  @classmethod
  def constant(cls, value):
    return cls(((((), float(value)),),))

  @classmethod
  def monomial(cls, exponents, coefficient=1.0):
    return cls((((_key(exponents), float(coefficient)),),))

  @classmethod
  def of(cls, value):
    """`value` as Rows (a number becomes a constant)."""
    return value if isinstance(value, Rows) else cls.constant(value)

  def __add__(self, other):
    other = Rows.of(other)
    return Rows(tuple(_sum(a, b) for a in self.rows for b in other.rows)
                ).pruned()

  __radd__ = __add__

  def __sub__(self, other):
    return self + Rows.of(other) * -1.0

  def __rsub__(self, other):
    return Rows.of(other) + self * -1.0

  def __mul__(self, factor):
    return Rows(tuple(tuple((e, c * float(factor)) for e, c in row)
                      for row in self.rows))

  __rmul__ = __mul__

  def pruned(self):
    """Without rows another row bounds term by term, duplicates included."""
    rows = [{e: c for e, c in row if c} for row in self.rows]
    kept = []
    for i, row in enumerate(rows):
      dominated = False
      for j, other in enumerate(rows):
        keys = set(row) | set(other)
        if i != j and all(row.get(k, 0.0) <= other.get(k, 0.0)
                          for k in keys) and (
                              j < i or row != other):
          dominated = True
          break
      if not dominated:
        kept.append(tuple(sorted(row.items())))
    return Rows(tuple(kept) or ((),))

  def at(self, ratios):
    """The value at `ratios` (one per axis), a float."""
    ratios = np.asarray(ratios, dtype=np.float64)
    return max(sum(c * _monomial(e, ratios) for e, c in row)
               for row in self.rows)

  def normalized(self):
    """These rows divided by their value at the sample's shape (ratios of
    1), so that a quantity measured there grows as they do; constant 1
    where that value is 0."""
    value = max(sum(c for _, c in row) for row in self.rows)
    if value <= 0:
      return Rows.constant(1.0)
    return self * (1.0 / value)

  @property
  def exponents(self):
    """Every monomial's exponents, in a fixed order."""
    return sorted({e for row in self.rows for e, _ in row})

  def in_graph(self, ratios):
    """The value at `ratios`, a float64 tensor of one per axis, in the
    graph being built."""
    keys = self.exponents
    if not keys:
      return tf.constant(0.0, tf.float64)
    matrix = np.array([[dict(row).get(k, 0.0) for k in keys]
                       for row in self.rows], dtype=np.float64)
    logs = tf.math.log(tf.cast(ratios, tf.float64))
    monomials = tf.stack([
        tf.exp(tf.reduce_sum(tf.constant(k, tf.float64) * logs[:len(k)]))
        if k else tf.constant(1.0, tf.float64) for k in keys])
    # A product and a sum rather than a matvec: under XLA, where the shape
    # is a constant, the value stays one (`Plan.choose_in_graph`).
    return tf.reduce_max(tf.reduce_sum(tf.constant(matrix) * monomials,
                                       axis=1))

  def get_config(self):
    return [[[list(e), c] for e, c in row] for row in self.rows]

  @classmethod
  def from_config(cls, config):
    return cls(tuple(tuple((_key(e), float(c)) for e, c in row)
                     for row in config))


def _sum(a, b):
  terms = dict(a)
  for e, c in b:
    terms[e] = terms.get(e, 0.0) + c
  return tuple(sorted((e, c) for e, c in terms.items() if c != 0.0))


def _monomial(exponents, ratios):
  if not exponents:
    return 1.0
  ratios = np.concatenate([ratios[:len(exponents)],
                           np.ones(max(0, len(exponents) - len(ratios)))])
  return float(np.prod(ratios ** np.asarray(exponents)))


def maximum(a, b):
  """The larger of two costs: numbers, or `Rows` (their rows together)."""
  if isinstance(a, Rows) or isinstance(b, Rows):
    a, b = Rows.of(a), Rows.of(b)
    return Rows(a.rows + b.rows).pruned()
  return max(a, b)


# A quantity of which nothing was traced grows with the input's size.
def PROPORTIONAL(num_axes):  # pylint: disable=invalid-name
  """Rows of a quantity in proportion to the input's size over `num_axes`
  axes."""
  return Rows.monomial((1.0,) * num_axes)


def axes_of(shape):
  """The axes of a chain input of `shape` whose size may change between
  steps: all but the last (features), or the only one."""
  return max(1, len(shape) - 1)


def ratios(shape, sample_shape):
  """Each of `shape`'s axes (`axes_of`) over the sample's."""
  n = axes_of(sample_shape)
  return tuple(float(d) / float(s) if s else 1.0
               for d, s in zip(tuple(shape)[:n], tuple(sample_shape)[:n]))


def perturbed_sizes(shape):
  """(axis, size) for each axis `axes_of` counts: the size halved, or
  doubled where it is 1."""
  return [(i, shape[i] // 2 if shape[i] >= 2 else 2)
          for i in range(axes_of(shape)) if shape[i] is not None]


# Ops whose outputs allocate nothing of the step's own (a variable's read, a
# constant, an input, an identity or reshape sharing its input's buffer) or
# hold no activation (shapes).
_NO_ALLOCATION = frozenset([
    "Placeholder", "Const", "ReadVariableOp", "VarHandleOp", "Identity",
    "IdentityN", "Reshape", "Shape", "ShapeN", "Size", "Rank", "NoOp",
    "StopGradient", "Squeeze", "ExpandDims", "Snapshot"])


# Elementwise ops whose kernels write into an input's buffer when nothing
# else reads it (TensorFlow's `forward_input_or_allocate_output`).
_FORWARDING = frozenset([
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum",
    "Minimum", "Neg", "Exp", "Log", "Log1p", "Tanh", "Sigmoid", "Relu",
    "Relu6", "Elu", "Selu", "Softplus", "Square", "Sqrt", "Rsqrt", "Erf",
    "Erfc", "Reciprocal", "TanhGrad", "SigmoidGrad", "ReluGrad", "Relu6Grad",
    "EluGrad", "SeluGrad", "SoftplusGrad", "SqrtGrad", "RsqrtGrad",
    "SquaredDifference", "Abs", "Sign", "Floor", "Ceil", "Round",
    "BiasAdd", "FusedBatchNormV3", "LeakyRelu", "LeakyReluGrad", "Gelu",
    "Select", "SelectV2"])


def _bytes(tensor):
  """A tensor's bytes from its static shape, or None."""
  if tensor.dtype in (tf.resource, tf.variant, tf.string):
    return None
  if not tensor.shape.is_fully_defined():
    return None
  return tensor.shape.num_elements() * tensor.dtype.size


def tensor_terms(sample_graph, perturbed):
  """{tensor name: (bytes at the sample, exponents)} for every tensor of
  `sample_graph` whose size its static shape gives.

  `perturbed` is a list of (axis, ratio, graph): the same step traced with
  that axis's size `ratio` times the sample's. A tensor's exponent on an
  axis is log(its bytes there over at the sample) / log(ratio), from the
  tensor of the same name; a tensor with no match grows on no axis."""
  found = {}
  sizes = [{t.name: _bytes(t) for op in g.get_operations()
            for t in op.outputs} for _, _, g in perturbed]
  num_axes = max([a + 1 for a, _, _ in perturbed] + [1])
  for op in sample_graph.get_operations():
    for t in op.outputs:
      n = _bytes(t)
      if n is None:
        continue
      exponents = [0.0] * num_axes
      for (axis, ratio, _), other in zip(perturbed, sizes):
        m = other.get(t.name)
        if n and m and ratio != 1:
          e = math.log(m / n) / math.log(ratio)
          exponents[axis] = round(e) if abs(e - round(e)) < 0.05 else e
      found[t.name] = (n, _key(exponents))
  return found


def step_growth(traced, terms):
  """The rows of a traced training step's quantities (see
  `profile.training_step`'s `traced`), from `tensor_terms`: a dict of
  "saved" (the forward tensors the backward pass reads), "forward" and
  "backward" (the largest live bytes while each runs, in the order their
  ops are built, each tensor allocated by the op making it and freed after
  the last op reading it) and "work" (every tensor the forward pass makes:
  how its time grows), each in bytes."""
  # pylint: disable=protected-access
  graph = traced["graph"]
  (first, forward_end), (_, backward_end) = (traced["forward"],
                                             traced["backward"])
  ops = [op for op in graph.get_operations()
         if first < op._id <= backward_end]
  last_use = {}
  for i, op in enumerate(ops):
    for t in op.inputs:
      last_use[t.name] = i
  ends = {t.name for t in traced["ends"] if isinstance(t, tf.Tensor)}
  end = len(ops)

  def poly(t):
    n, e = terms.get(t.name, (None, ()))
    return None if n is None else ((e, float(n)),)

  live, total, rows = {}, {}, {"forward": [], "backward": []}
  saved, work = {}, {}
  for i, op in enumerate(ops):
    forward = op._id <= forward_end
    if not forward:
      for t in op.inputs:
        if (t.op._id <= forward_end and t.name in live and
            t.name not in ends):
          saved[t.name] = live[t.name][0]
    # An input an elementwise op reads last, of an output's shape and type,
    # lends that output its buffer (TensorFlow forwards it): nothing more is
    # allocated.
    lenders = [t for t in op.inputs if t.name in live and
               last_use.get(t.name) == i and t.name not in ends
               ] if op.type in _FORWARDING else []
    for t in op.outputs:
      p = poly(t)
      if p is None or op.type in _NO_ALLOCATION:
        continue
      if forward:
        work = _added(work, p)
      lender = next((l for l in lenders if l.shape == t.shape and
                     l.dtype == t.dtype), None)
      if lender is not None:
        lenders = [l for l in lenders if l is not lender]
        total = _added(total, live.pop(lender.name)[0], -1.0)
      # An output read by no op is freed at once, but for the step's ends.
      if last_use.get(t.name, -1) >= i or t.name in ends:
        live[t.name] = (p, end if t.name in ends else last_use[t.name])
        total = _added(total, p)
    rows["forward" if forward else "backward"].append(
        tuple(sorted((e, c) for e, c in total.items() if c)))
    for name in [k for k, (_, last) in live.items() if last <= i]:
      total = _added(total, live.pop(name)[0], -1.0)
  summed = {}
  for p in saved.values():
    summed = _added(summed, p)
  num_axes = max([len(e) for n, e in terms.values()] + [1])
  found = {name: _reduced(r, num_axes) for name, r in rows.items()}
  found["saved"] = Rows((tuple(sorted(summed.items())),))
  found["work"] = Rows((tuple(sorted(work.items())),))
  return found


def _added(total, poly, sign=1.0):
  """`total` (a dict of exponents to coefficients) plus `poly` x `sign`."""
  total = dict(total)
  for e, c in poly:
    total[e] = total.get(e, 0.0) + sign * c
  return total


# Each axis's ratios at which `_reduced` keeps the largest rows.
_PROBES = (1 / 16, 1 / 4, 1 / 2, 1.0, 2.0, 4.0, 16.0)


def _reduced(rows, num_axes):
  """The rows of `rows` that are the largest at some probe of the axes'
  ratios (`_PROBES` on each axis), then `Rows.pruned`: the few rows that
  make a step's peak over shapes from a sixteenth to 16 times the
  sample's, of the hundreds of its ops."""
  rows = list(dict.fromkeys(rows)) or [()]
  keys = sorted({e for row in rows for e, _ in row})
  if not keys:
    return Rows(((),))
  matrix = np.array([[dict(row).get(k, 0.0) for k in keys] for row in rows])
  grid = np.array(np.meshgrid(*[_PROBES] * num_axes)).reshape(num_axes, -1)
  monomials = np.array([
      np.prod(grid[:len(k)] ** np.asarray(k)[:, None], axis=0) if k else
      np.ones(grid.shape[1]) for k in keys])
  best = set(np.argmax(matrix @ monomials, axis=0).tolist())
  return Rows(tuple(rows[i] for i in sorted(best))).pruned()
