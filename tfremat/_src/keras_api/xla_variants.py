"""Under XLA, a chain's variants in a step traced for any size of some
axis, selected by value: XLA compiles such a step for each concrete shape,
where the choice of variant is a constant, folds the selections and removes
the variants not chosen, so each shape compiles the chosen variant alone.
(A `tf.switch_case` of the variants crashed XLA's compile, resolving the
branches' constant arguments; nested `tf.cond`s failed it: a transpose's
permutation was no constant in the gradient's branch.)"""

import tensorflow as tf

from tfremat._src.core import keras_state

__all__ = ["selected", "gradients"]


def selected(index, variants, x, add_loss, run):
  """The chain's output on `x`, of the `index`-th of `variants` (each a
  tuple of segments, `run(segments, x)` building it): every variant is
  built side by side, each in a `keras.StatelessScope` of its own
  (`_Deferring`), and the chosen one's output, gradients, variable updates
  (dropout's seeds, BatchNormalization's statistics) and losses (handed
  to `add_loss`) are selected by `index`."""

  @tf.custom_gradient
  def chain(x):
    outputs, scopes = [], []
    for segments in variants:
      with _Deferring() as scope:
        outputs.append(run(segments, x))
      scopes.append(scope)
    _apply_selected(index, scopes, add_loss)

    def grad(dy, variables=None):
      sources = [x] + list(variables or [])
      grads = _select(index, [gradients(y, sources, dy) for y in outputs],
                      sources)
      return grads[0], grads[1:]

    return _select(index, [[y] for y in outputs], [x])[0], grad

  return chain(x)


def _select(index, options, like):
  """Elementwise, the `index`-th of `options` (lists of tensors alike, each
  a tensor, `tf.IndexedSlices` or None where `like`'s element gets none):
  a chain of `tf.where`s, which XLA folds where `index` is a constant."""
  chosen = []
  for k, source in enumerate(like):
    values = [o[k] for o in options]
    if all(v is None for v in values):
      chosen.append(None)
      continue
    if all(isinstance(v, tf.IndexedSlices) for v in values):
      chosen.append(tf.IndexedSlices(
          _where(index, [v.values for v in values]),
          _where(index, [v.indices for v in values]), values[0].dense_shape))
      continue
    values = [tf.zeros(source.shape, source.dtype) if v is None
              else tf.convert_to_tensor(v) for v in values]
    chosen.append(_where(index, values))
  return chosen


def _where(index, values):
  out = values[-1]
  for i in range(len(values) - 2, -1, -1):
    out = tf.where(tf.equal(index, i), values[i], out)
  return out


def _apply_selected(index, scopes, add_loss):
  """Applies, once, the variable updates the variants' scopes deferred
  (`_Deferring`), each variable's chosen by `index`, and adds the chosen
  variant's losses."""
  updated = {}
  for scope in scopes:
    updated.update(scope.updated)
  for variable in updated.values():
    values = [scope.get_current_value(variable) for scope in scopes]
    values = [variable.value if v is None else v for v in values]
    variable.assign(_where(index, values))
  losses = [list(scope.losses) for scope in scopes]
  for k in range(min(len(l) for l in losses)):
    add_loss(_where(index, [l[k] for l in losses]))


class _Deferring(keras_state.NestedScope):
  """A `keras.StatelessScope` that defers the block's variable updates,
  noting which variables they are (`updated`), and collects its losses."""

  def __init__(self):
    super().__init__(collect_losses=True, initialize_variables=False)
    self.updated = {}

  def add_update(self, update):
    self.updated.setdefault(id(update[0]), update[0])
    super().add_update(update)


def gradients(ys, xs, grad_ys):
  """`tf.gradients`, its ops placed as a tape's are: not colocated with the
  forward ops (TF2's `tf.gradients` colocates each, and each rerun's with
  its segment's custom-gradient op, at a cost in tracing and in the first
  call's placement on every planned chain)."""
  return tf.compat.v1.gradients(ys, xs, grad_ys,
                                colocate_gradients_with_ops=False)
