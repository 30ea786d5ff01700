"""Checks that a rerun ran as its forward pass did: the same ops in the same
order and, where asked (`determinism_check="values"`), the same values;
`tfremat.errors.RerunMismatchError` naming the first difference otherwise.
"""

import numpy as np
import tensorflow as tf

from tfremat import errors

__all__ = [
    "checked_targets",
]


def checked_targets(forward, outputs, losses, ran, dys):
  """The rerun's differentiable outputs paired with their gradients."""
  flat = tf.nest.flatten(outputs)
  if forward.determinism_check != "none":
    _check_rerun(forward, outputs, flat, losses, ran)
  ys = [flat[i] for i in forward.attached] + list(losses)
  pairs = [(y, dy) for y, dy in zip(ys, dys) if dy is not None]
  return [y for y, _ in pairs], [dy for _, dy in pairs]


def _check_rerun(forward, outputs, flat, losses, ran):
  """Raises `RerunMismatchError` where the rerun parts from the forward pass."""
  problem = _output_difference(forward, outputs, flat, losses)
  if (problem is None and not forward.inner_tape and
      list(ran.op_types) != list(forward.op_types)):
    problem = _describe_op_difference(forward.op_types, ran.op_types,
                                      forward.op_details, ran.details)
  if problem is not None:
    summary, _, table = problem.partition("\n")
    raise errors.RerunMismatchError(
        f"The backward-pass rerun of a rematerialized function returned "
        f"{summary}. The function must compute the same thing every time "
        "it is called with the same inputs, state and seeds (no Python-side "
        "randomness, counters or caches deciding what it computes); "
        "otherwise its gradients would be silently wrong." +
        (f"\n{table}" if table else ""))


def _output_difference(forward, outputs, flat, losses):
  """How the rerun's outputs differ from the forward pass's, or None."""
  try:
    tf.nest.assert_same_structure(outputs, forward.structure)
  except (TypeError, ValueError) as e:
    return f"a different structure ({e})"
  if len(losses) != len(forward.losses):
    return (f"{len(losses)} add_loss loss(es) where the forward pass "
            f"added {len(forward.losses)}")
  for n, (i, (dtype, shape)) in enumerate(zip(forward.attached,
                                              forward.specs)):
    y = flat[i]
    if not isinstance(y, tf.Tensor) or y.dtype != dtype:
      return (f"output {i} as {getattr(y, 'dtype', type(y).__name__)} "
              f"where the forward pass gave {dtype.name}")
    if not y.shape.is_compatible_with(shape):
      return (f"output {i} with shape {y.shape} where the forward pass "
              f"gave {shape}")
    if forward.forward_values is not None:
      problem = _compare_values(i, y, forward.forward_values[n])
      if problem is not None:
        return problem
  return None


def _describe_op_difference(forward, rerun, forward_details=None,
                            rerun_details=None, context=3):
  """Where two op type sequences part, side by side: the few ops around the
  first difference, or, given each op's details (debug), all of them."""
  first = next((i for i, (a, b) in enumerate(zip(forward, rerun)) if a != b),
               min(len(forward), len(rerun)))
  debug = forward_details is not None and rerun_details is not None
  if debug:
    forward, rerun, shown = forward_details, rerun_details, range(
        max(len(forward), len(rerun)))
  else:
    shown = range(max(0, first - context),
                  min(max(len(forward), len(rerun)), first + context + 1))
  width = max([len(a) for a in forward] + [30])
  lines = [f"  {'op':>5s}  {'forward':{width}s} rerun"]
  for i in shown:
    a = forward[i] if i < len(forward) else "-"
    b = rerun[i] if i < len(rerun) else "-"
    mark = "   <--- the first difference" if i == first else ""
    lines.append(f"  {i:5d}  {a:{width}s} {b}{mark}")
  hint = ("" if debug else "; pass debug=True (or run under "
          "tfremat.debug_reruns()) to see every op and the line that made "
          "it")
  return (f"after running other ops than the forward pass: {len(rerun)} "
          f"op(s) where the forward pass ran {len(forward)} (Placeholder, "
          "Const, Identity, Cast and variable reads not counted; the ops "
          "are listed below" + hint + ")\n" + "\n".join(lines))


def _compare_values(index, rerun, forward):
  """A mismatch description when the rerun's values differ, else None."""
  # Kernels may fuse the rerun differently from the forward pass, so equal
  # means equal to float rounding, relative to the tensor's scale.
  if tf.executing_eagerly():
    a, b = rerun.numpy(), forward.numpy()
    scale = float(np.max(np.abs(b))) if b.size else 0.0
    if not np.allclose(a, b, rtol=1e-5, atol=1e-6 + 1e-5 * scale,
                       equal_nan=True):
      return f"output {index} with different values"
    return None
  a, b = tf.cast(rerun, tf.float64), tf.cast(forward, tf.float64)
  scale = tf.reduce_max(tf.abs(b)) if b.shape.num_elements() else 0.0
  tf.debugging.assert_less_equal(
      tf.abs(a - b), 1e-6 + 1e-5 * scale + 1e-5 * tf.abs(b),
      message=(f"The backward-pass rerun of a rematerialized function returned "
               f"output {index} with different values (determinism_check="
               "'values')."))
  return None
