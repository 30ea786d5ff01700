"""Generative parity: where a rematerialized call's inputs come from.

Each case crosses one source of the block's inputs (function arguments,
tensors a `tf.function` captures above and below TensorFlow's 128-element
inlining threshold, variables trainable or not and also read outside the
block, an input computed from a weight the block reads, a layer applied
before and inside, the same tensor twice, nested structures, ragged and
sparse inputs made inside the step or captured whole, loops and conds inside the block) with the execution mode,
the nesting depth (1-3 rematerialized calls, each inside the one before),
whether every nested function opens a gradient tape of its own, and the save
policy. Every case is compared with the same computation without
rematerialization: outputs and gradients, against one scale for all tensors
(max |diff| <= RTOL * max |expected|).

Nested inner tapes once freed a gradient tape that was still in use and
crashed the process later: those cases run in a subprocess per mode, so a
crash fails one test, not the suite. Traced, they take minutes, so they run
with TFREMAT_LONG=1 (`pytest -m slow`); eager ones run in the main suite.
"""

import contextlib
import itertools
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from conftest import MODES, assert_one_scale_parity, compile_step, parity_loss

LARGE = (32, 8)  # 256 elements: a tf.function captures it as a placeholder.
SMALL = (2, 8)  # 16 elements: inlined as a constant.


def _normal(shape, seed):
  return tf.random.stateless_normal(shape, seed=[seed, 7])


class Case:
  """One source of inputs.

  `prepare(arguments)` runs under the training step's tape and returns the
  tensors the tape watches and the block's arguments; `fn(*block_args)` is
  the block; `variables` are differentiated too.
  """

  def __init__(self, name, prepare, fn, arguments=(), variables=(),
               xla=True):
    self.name, self.prepare, self.fn = name, prepare, fn
    self.arguments, self.variables, self.xla = arguments, variables, xla


_CASES = []


def _cases():
  """The cases, made once: their variables are read, never trained."""
  if not _CASES:
    _CASES.extend(_make_cases())
  return _CASES


def _make_cases():
  w = tf.Variable(_normal((8, 8), 1) * 0.5, name="w")
  frozen = tf.Variable(_normal((8, 8), 2) * 0.5, trainable=False,
                       name="frozen")
  scale = tf.Variable(_normal((8,), 3), name="scale")
  large, small = _normal(LARGE, 4), _normal(SMALL, 5)
  weight_tensor = _normal((8,), 6)  # A captured weight, watched.
  x = _normal((4, 8), 8)
  keras.utils.set_random_seed(1)
  dense = keras.layers.Dense(8, activation="tanh")
  dense.build((None, 8))

  block = lambda t: tf.tanh(tf.matmul(t, w)) * 2.0
  watch_x = lambda a: ([a[0]], a)

  def loop(t):
    # A variable read in a loop body (XLA needs the loop's maximum).
    return tf.while_loop(lambda i, h: i < 3,
                         lambda i, h: (i + 1, tf.tanh(h * scale)),
                         (0, t), maximum_iterations=3)[1]

  def cond(t):
    return tf.cond(tf.reduce_sum(t) > -1e9, lambda: tf.sin(t * scale),
                   lambda: t)

  def ragged(values):
    # The rows are the captured constant itself, not a tensor computed
    # from it.
    return [values], (tf.RaggedTensor.from_row_lengths(values, [1, 1]),)

  def sparse(values):
    flat = tf.reshape(values, [-1])
    indices = tf.stack([tf.range(16, dtype=tf.int64) // 4,
                        tf.range(16, dtype=tf.int64) % 4], axis=1)
    return [values], (tf.SparseTensor(indices, flat, [4, 4]),)

  # Composite tensors made eagerly, outside the training step, which a
  # tf.function captures whole: the tape watches their components.
  ragged_capture = tf.RaggedTensor.from_row_lengths(small, [1, 1])
  sparse_capture = sparse(large[:2])[1][0]

  return [
      Case("argument", watch_x, block, arguments=(x,), variables=[w]),
      Case("captured_large", lambda a: ([large], (large,)), block,
           variables=[w]),
      Case("captured_small", lambda a: ([small], (small,)), block,
           variables=[w]),
      Case("closure_large", watch_x,
           lambda t: block(t) + tf.reduce_mean(large, 0), arguments=(x,),
           variables=[w]),
      Case("closure_small", watch_x,
           lambda t: block(t) * tf.reduce_mean(small, 0), arguments=(x,),
           variables=[w]),
      Case("captured_argument_and_closure", lambda a: ([large], (large,)),
           lambda t: block(t) * tf.reduce_mean(large, 0), variables=[w]),
      Case("variable_argument", lambda a: ([a[0]], (a[0], w)),
           lambda t, v: tf.tanh(tf.matmul(t, v)), arguments=(x,),
           variables=[w]),
      Case("non_trainable_variable",
           lambda a: ([a[0], frozen], a),
           lambda t: tf.tanh(tf.matmul(t, frozen)), arguments=(x,),
           variables=[frozen]),
      Case("variable_read_outside",
           lambda a: ([a[0]], (tf.matmul(a[0], w),)), block,
           arguments=(x,), variables=[w]),
      Case("input_from_captured_weight",
           lambda a: ([a[0], weight_tensor], (a[0] * weight_tensor,)),
           lambda t: tf.sin(t * weight_tensor), arguments=(x,)),
      Case("layer_applied_before_and_inside",
           lambda a: ([a[0]], (dense(a[0]),)), dense, arguments=(x,),
           variables=dense.trainable_weights),
      Case("same_tensor_twice", lambda a: ([a[0]], (a[0], a[0])),
           lambda s, t: block(s) * t, arguments=(x,), variables=[w]),
      Case("nested_structure",
           lambda a: ([a[0], large], ({"a": a[0], "b": (large, 2)},)),
           lambda d: block(d["a"]) * d["b"][1] + tf.reduce_mean(d["b"][0], 0),
           arguments=(x,), variables=[w]),
      Case("ragged_from_captured_small", lambda a: ragged(small),
           lambda r: tf.reduce_sum(tf.sin(r) * r, axis=1), xla=False),
      Case("sparse_from_captured_large", lambda a: sparse(large[:2]),
           lambda s: tf.sparse.reduce_sum(s.with_values(tf.sin(s.values)),
                                          axis=1), xla=False),
      Case("captured_ragged_small",
           lambda a: ([ragged_capture.flat_values], (ragged_capture,)),
           lambda r: tf.reduce_sum(tf.sin(r) * r, axis=1), xla=False),
      Case("captured_sparse_large",
           lambda a: ([sparse_capture.values], (sparse_capture,)),
           lambda s: tf.sparse.reduce_sum(s.with_values(tf.sin(s.values)),
                                          axis=1), xla=False),
      Case("variable_in_while_loop", watch_x, loop, arguments=(x,),
           variables=[scale]),
      Case("variable_in_cond", watch_x, cond, arguments=(x,),
           variables=[scale]),
  ]


CASE_NAMES = [c.name for c in _cases()]
# Depth 1-3 for every source and mode; inner tapes and the save policy take
# turns, so that each source meets each of them.
POLICIES = [None, "dots_saveable"]
VARIANTS = list(itertools.product([False, True], POLICIES))


def _tape_around(fn):
  """`fn` opening a tape of its own: its result plus a gradient it takes."""

  def f(*args):
    xs = [a for a in tf.nest.flatten(args)
          if isinstance(a, tf.Tensor) and a.dtype.is_floating]
    with tf.GradientTape() as tape:
      tape.watch(xs)
      y = fn(*args)
      inner_loss = tf.reduce_sum(tf.sin(y))
    grads = [g for g in tape.gradient(inner_loss, xs) if g is not None]
    return y + 0.1 * tf.add_n([tf.reduce_sum(g) for g in grads] + [0.0])

  return f


def nested(fn, depth, inner_tapes, remat):
  """`fn` inside `depth` rematerialized calls, each inside the one before;
  with inner tapes, every function that a rematerialized call runs opens a
  tape (PyTorch's TestNestedCheckpoint)."""
  call = _tape_around(fn) if inner_tapes else fn
  for level in range(depth):
    inner = call
    call = ((lambda *a, inner=inner: tfremat.RematerializeFn(inner, *a))
            if remat else inner)
    if inner_tapes and level < depth - 1:
      call = _tape_around(call)
  return call


def _step(case, depth, inner_tapes, remat):
  block = nested(case.fn, depth, inner_tapes, remat)

  def step(*arguments):
    with tf.GradientTape() as tape:
      # Watched before the block's inputs are computed from them.
      tape.watch(case.prepare(arguments)[0])
      watched, block_args = case.prepare(arguments)
      y = block(*block_args)
      loss = parity_loss(y)
    return y, tape.gradient(loss, [watched, list(case.variables)])

  return step


def case_results(name, mode, depth, inner_tapes, policy):
  """The case's outputs and gradients (plain, rematerialized)."""
  case = next(c for c in _cases() if c.name == name)
  results = []
  for remat in (False, True):
    step = compile_step(_step(case, depth, inner_tapes, remat), mode)
    with (tfremat.policies.scope(policy) if policy else
          contextlib.nullcontext()):
      results.append(step(*case.arguments))
  return results


def run_case(name, mode, depth, inner_tapes, policy):
  plain, rematerialized = case_results(name, mode, depth, inner_tapes, policy)
  assert_one_scale_parity(rematerialized, plain)


def _variant(name, depth):
  return VARIANTS[(CASE_NAMES.index(name) + depth) % len(VARIANTS)]


def _all_cases():
  for name, mode, depth in itertools.product(CASE_NAMES, MODES, (1, 2, 3)):
    case = next(c for c in _cases() if c.name == name)
    if mode == "xla" and not case.xla:
      continue
    inner_tapes, policy = _variant(name, depth)
    yield name, mode, depth, inner_tapes, policy


def _id(name, mode, depth, inner_tapes, policy):
  return (f"{name}-{mode}-depth{depth}" + ("-tapes" if inner_tapes else "") +
          (f"-{policy}" if policy else ""))


def _crash_prone(case):
  return case[3] and case[2] > 1  # Inner tapes around nested calls.


SAFE = [c for c in _all_cases() if not _crash_prone(c)]
CRASH_PRONE = [c for c in _all_cases() if _crash_prone(c)]


@pytest.mark.parametrize("name, mode, depth, inner_tapes, policy", SAFE,
                         ids=[_id(*c) for c in SAFE])
def test_gradients_match_plain_whatever_the_inputs_source(
    name, mode, depth, inner_tapes, policy):
  plain, rematerialized = case_results(name, mode, depth, inner_tapes, policy)
  assert_one_scale_parity(rematerialized, plain)


@pytest.mark.parametrize("mode", [
    pytest.param(m, marks=([pytest.mark.slow] if m != "eager" else []) +
                 ([pytest.mark.long] if m == "xla" else []))
    for m in MODES])
def test_nested_inner_tapes_match_plain_and_do_not_crash(mode):
  cases = [c for c in CRASH_PRONE if c[1] == mode]
  assert cases
  code = (
      "import sys\n"
      "import remat_provenance_test as t\n"
      "failed = []\n"
      f"for case in {cases!r}:\n"
      "  try:\n"
      "    t.run_case(*case)\n"
      "  except Exception as e:\n"
      "    failed.append(t._id(*case) + ': ' + str(e)[:300])\n"
      "print('\\n'.join(failed))\n"
      "sys.exit(1 if failed else 0)\n")
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  done = subprocess.run([sys.executable, "-c", code], env=env,
                        cwd=os.path.dirname(__file__), capture_output=True,
                        text=True, check=False)
  assert done.returncode == 0, (
      f"{len(cases)} nested inner-tape cases in a subprocess exited "
      f"{done.returncode}:\n{done.stdout}\n{done.stderr[-2000:]}")


def test_every_source_meets_every_mode_depth_tape_and_policy():
  # The rotation covers the crossings the test promises.
  cases = list(_all_cases())
  for name in CASE_NAMES:
    mine = [c for c in cases if c[0] == name]
    assert {c[2] for c in mine} == {1, 2, 3}
    assert {c[3] for c in mine} == {False, True}
    assert {c[4] for c in mine} == set(POLICIES)
  assert len(CASE_NAMES) == len(set(CASE_NAMES)) == 19
