"""Lingvo-style step seeds: deterministic seeds for stateless random ops.

A *step seed* is an int64 counter that every `GenerateStepSeedPair` call reads
and increments. Ops seeded from it (`tf.random.stateless_*`,
`DeterministicDropout`) are pure functions of their seed, so re-running the
same code from the same step seed draws the same numbers. `RematerializeFn`
relies on this: it resets the step seed to its forward-time value before the
backward-pass rerun.

As in Lingvo, the counter lives per graph: every `tf.function` trace starts
from 0 (or from what `ResetStepSeed` set), and eager code keeps one counter per
thread. The first element of a seed pair is the global step (see
`SetGlobalStep`), so masks differ from one training step to the next even
though a traced function replays the same step-seed sequence on every call.
Drawing seeds in a tf.function with no global step set is an error, since
every step would repeat the same masks.
"""

import contextlib
import threading
import weakref

import tensorflow as tf

from tfremat import errors

__all__ = [
    "ResetStepSeed",
    "GetStepSeed",
    "GetIncStepSeed",
    "SetGlobalStep",
    "HasGlobalStep",
    "GetGlobalStep",
    "GenerateStepSeedPair",
    "SeedPair",
    "DeterministicDropout",
    "replaying",
]

_eager_state = threading.local()


# Graph -> its seed state. Not a graph collection: a function graph (a
# tf.cond branch, a loop body, a nested tf.function) shares its outer
# graph's collections, and a seed tensor of one branch cannot be read in
# another.
_graph_states = weakref.WeakKeyDictionary()


def _state():
  """The mutable per-graph (or, in eager mode, per-thread) seed state.

  A function graph inside another (a `tf.cond` branch, a loop body, a
  nested `tf.function`) starts from a copy of its outer graph's state, so
  its seeds continue the outer ones (their tensors captured), and its draws
  advance only its own counter: every branch of a cond starts from the same
  seed, and nothing of one branch is read in another or after it."""
  if tf.executing_eagerly():
    if not hasattr(_eager_state, "value"):
      _eager_state.value = {}
    return _eager_state.value
  graph = tf.compat.v1.get_default_graph()
  if graph not in _graph_states:
    outer = getattr(graph, "outer_graph", None)
    while outer is not None and outer not in _graph_states:
      outer = getattr(outer, "outer_graph", None)
    _graph_states[graph] = dict(_graph_states[outer]) if outer else {}
  return _graph_states[graph]


def ResetStepSeed(seed=0):
  """Sets the step seed of the current graph (or eager thread) to `seed`."""
  _state()["seed"] = tf.cast(tf.convert_to_tensor(seed), tf.int64)


def GetStepSeed():
  """Returns the current step seed, an int64 scalar tensor."""
  state = _state()
  if "seed" not in state:
    ResetStepSeed()
  return state["seed"]


def GetIncStepSeed():
  """Returns the current step seed and advances it by one."""
  seed = GetStepSeed()
  ResetStepSeed(seed + 1)
  return seed


# Process-wide, not per thread: tf.distribute runs replicas in threads of
# their own, and they must all see the training step.
_global_step = None


def SetGlobalStep(step):
  """Uses `step` as the first element of every seed pair.

  Args:
    step: a scalar integer variable that advances once per training step, such
      as a Keras `optimizer.iterations`, or None to go back to a constant 0.
  """
  if step is not None and (
      not hasattr(step, "dtype") or not tf.as_dtype(step.dtype).is_integer or
      tuple(getattr(step, "shape", None) or (None,)) != ()):
    raise errors.InvalidTypeError(
        "SetGlobalStep expects a scalar integer variable such as "
        f"optimizer.iterations, or None; got {step!r}. Seed pairs are "
        "[global step, seed], so the step must be one integer.")
  global _global_step
  _global_step = step


def HasGlobalStep():
  """Whether seed pairs read a global step (set, or replayed by a rerun)."""
  return "global_step" in _state() or _global_step is not None


def GetGlobalStep():
  """Returns the global step used in seed pairs, an int64 scalar tensor: the
  one `SetGlobalStep` set, else a constant 0."""
  state = _state()
  if "global_step" in state:
    return state["global_step"]
  if _global_step is None:
    return tf.constant(0, tf.int64)
  return tf.cast(tf.convert_to_tensor(_global_step), tf.int64)


_NO_GLOBAL_STEP = (
    "GenerateStepSeedPair was called in a tf.function (or Keras fit) with no "
    "global step set. Seeds are [global step, step seed], and the step seed "
    "restarts at "
    "every call of a traced function, so without a global step every "
    "training step would draw the same dropout masks. Call "
    "tfremat.SetGlobalStep(optimizer.iterations) (or any integer variable "
    "advanced once per step) before the function is first traced or fit "
    "starts; Lingvo always has one. Builder layers (_Dropout with "
    "deterministic_dropout=True) need no call: without a global step they "
    "count their own steps.")


def GenerateStepSeedPair(random_seed=None, op_seed=None):
  """Returns a new shape-[2] int64 seed for a stateless random op.

  The pair is `[global_step, step_seed]` (plus `random_seed` and `op_seed` when
  given) and the step seed advances on every call, so two calls in one step
  give different seeds, while a replay from the same step seed gives the same
  ones.

  In eager mode the step seed never restarts, so the global step may be
  unset (it is then 0). In a tf.function it must be set (`SetGlobalStep`):
  the step seed restarts at every call, and a missing global step would
  repeat the same seeds at every training step.

  Args:
    random_seed: optional int, added to both elements (a per-layer seed).
    op_seed: optional int, added to both elements (a per-op seed).

  Raises:
    RuntimeError: in a tf.function with no global step set.
  """
  if not tf.executing_eagerly() and not HasGlobalStep():
    raise errors.UnsupportedError(_NO_GLOBAL_STEP)
  return SeedPair(GetGlobalStep(), random_seed, op_seed)


def SeedPair(global_step, random_seed=None, op_seed=None):
  """`GenerateStepSeedPair` with `global_step` in place of the global one:
  `[global_step, step_seed]` plus the seeds given; advances the step seed."""
  seeds = tf.stack([tf.cast(global_step, tf.int64), GetIncStepSeed()])
  for extra in (random_seed, op_seed):
    if extra is not None:
      seeds += tf.cast(extra, tf.int64)
  return seeds


def DeterministicDropout(x, keep_prob, seeds, noise_shape=None, name=None):
  """Dropout whose mask is a pure function of `seeds`, as Lingvo's.

  Keeps an element where `floor(keep_prob + u) == 1`, with `u` drawn by
  `tf.random.stateless_uniform(noise_shape, seeds)` in float32, and divides
  the result by `keep_prob`: for the same seeds, the same mask as Lingvo's
  `py_utils.DeterministicDropout`. The same `seeds` always give the same
  mask, so the op can be recomputed in a backward pass.

  Args:
    x: a floating point tensor.
    keep_prob: the probability to keep an element: a Python float in
      (0, 1], or a scalar float tensor.
    seeds: a shape-[2] integer tensor, e.g. from `GenerateStepSeedPair()`.
    noise_shape: optional shape of the mask, broadcastable to `x`.
    name: optional name scope.
  """
  if not tf.is_tensor(keep_prob) and (
      not isinstance(keep_prob, (int, float)) or not 0.0 < keep_prob <= 1.0):
    raise errors.InvalidArgumentError(
        f"DeterministicDropout: keep_prob must be a float in (0, 1] or a "
        f"scalar tensor, got {keep_prob!r}. Note that it is the probability "
        "to KEEP an element (Lingvo's convention), i.e. 1 - rate.")
  with tf.name_scope(name or "deterministic_dropout"):
    x = tf.convert_to_tensor(x)
    if not x.dtype.is_floating:
      raise errors.InvalidArgumentError(
          f"DeterministicDropout: x must be a floating point tensor, got "
          f"{x.dtype.name}. Cast it first, e.g. tf.cast(x, tf.float32).")
    if not tf.is_tensor(keep_prob) and keep_prob == 1.0:
      return x
    keep_prob = tf.cast(keep_prob, tf.float32)
    shape = tf.shape(x) if noise_shape is None else noise_shape
    # float32 draws whatever x's dtype: bfloat16/float16 uniforms are too
    # coarse to give the requested keep probability.
    uniform = tf.random.stateless_uniform(shape, seed=seeds, dtype=tf.float32)
    keep = tf.cast(tf.floor(keep_prob + uniform), x.dtype)
    return x / tf.cast(keep_prob, x.dtype) * keep


@contextlib.contextmanager
def replaying(seed, global_step):
  """Runs a block from a recorded step seed and global step, then restores.

  Used for the backward-pass rerun: the block sees the same seeds as the
  forward pass did, and the caller's own step seed is left as it was.
  """
  state = _state()
  saved = dict(state)
  state["seed"] = seed
  if global_step is not None:
    state["global_step"] = global_step
  try:
    yield
  finally:
    state.clear()
    state.update(saved)
