"""Measure what a training step costs: its peak memory and its time.

  step = tf.function(train_step)          # or model.train_on_batch, or eager
  peak = tfremat.measure.peak_bytes(step, x, y)
  print(tfremat.measure.format_bytes(peak))         # e.g. "79.0 MiB"
  saved = 1 - peak_with_remat / peak_without_remat  # what remat saved

A step's peak is the allocator's peak during one call above what was
allocated just before it: weights, optimizer slots and the batch are not
counted; activations, temporaries and gradients are. That is what
rematerialization changes and what the planner's budgets bound. The benchmark,
the planner and the examples all measure with this module.

It measures the first GPU when there is one, else the CPU. On the CPU,
TensorFlow keeps allocator statistics only with its BFC allocator, which
importing tfremat turns on (TF_CPU_ALLOCATOR_USE_BFC=true) if TensorFlow has
not run an op yet.
"""

import contextlib
import sys
import time

import numpy as np
import tensorflow as tf

from tfremat import errors

__all__ = [
    "memory_device",
    "current_bytes",
    "peak_bytes",
    "peaks",
    "replicated",
    "median_seconds",
    "seconds",
    "format_bytes",
    "progress_bar",
    "restoring",
    "PEAK_CALLS",
]

# The peak of one traced step varies from call to call (the executor's
# threads order independent ops differently; docs/benchmarks.md,
# "Measurements behind the defaults"), so `peak_bytes` takes the largest
# over this many calls by default.
PEAK_CALLS = 5


def memory_device():
  """The device whose allocator is measured: the first GPU if there is one,
  else the CPU."""
  return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


_PROBE_ELEMENTS = 2**16  # A 256 KiB tensor that the statistics must see.


def _check_statistics(device):
  """Raises unless `device`'s allocator keeps real statistics.

  Some allocators report statistics that are always zero (TensorFlow's
  default CPU allocator does on some builds) where others raise: a tensor
  held while reading them tells a real count from a meaningless one.
  """
  problem = None
  try:
    with tf.device(device):
      probe = tf.fill([_PROBE_ELEMENTS], 1.0)
      info = tf.config.experimental.get_memory_info(device)
      del probe
    if info["current"] < 4 * _PROBE_ELEMENTS:
      problem = "reports no allocation while a tensor is held"
  except ValueError as e:
    problem = f"keeps none ({e})"
  if problem is not None:
    raise errors.UnsupportedError(
        f"TensorFlow's allocator statistics for {device} are not usable (it "
        f"{problem}), so a step's peak cannot be measured. On the CPU they "
        "need the BFC allocator: set TF_CPU_ALLOCATOR_USE_BFC=true in the "
        "environment, or import tfremat before TensorFlow runs its first op.")


def current_bytes():
  """Bytes the measured device's allocator holds now."""
  device = memory_device()
  _check_statistics(device)
  return tf.config.experimental.get_memory_info(device)["current"]


def peak_bytes(step, *args, calls=PEAK_CALLS, warmup=True, **kwargs):
  """The peak memory of calling `step(*args, **kwargs)`, in bytes.

  The allocator's peak during a call above its level just before the call;
  the largest over `calls` calls. Every call's result is waited for, so
  asynchronous execution does not hide part of the step.

  Args:
    step: a training step: a `tf.function`, an eager function, or a Keras
      model's `train_on_batch`. Each call must leave the model in a state
      that the next call can run from (it trains: weights change).
    *args: the step's arguments.
    calls: how many calls to measure; the largest peak is returned.
    warmup: call `step` once first, unmeasured, so that tracing and XLA
      compilation (and creating optimizer slots) are not counted. Pass False
      only for a step already called with arguments of these shapes.
    **kwargs: the step's keyword arguments.

  Returns:
    An int, bytes.

  Raises:
    RuntimeError: TensorFlow keeps no allocator statistics for the device
      (the message says how to turn them on).
    ValueError: `calls` is not a positive int.
  """
  return max(peaks(step, *args, calls=calls, warmup=warmup, **kwargs))


def peaks(step, *args, calls=PEAK_CALLS, warmup=True, **kwargs):
  """Every call's peak, as `peak_bytes` measures them: a list of ints."""
  if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
    raise errors.InvalidArgumentError(f"calls must be a positive int; got {calls!r}.")
  device = memory_device()
  _check_statistics(device)
  if warmup:
    _wait(step(*args, **kwargs))
  found = []
  for _ in range(calls):
    tf.config.experimental.reset_memory_stats(device)
    baseline = tf.config.experimental.get_memory_info(device)["current"]
    _wait(step(*args, **kwargs))
    found.append(int(
        tf.config.experimental.get_memory_info(device)["peak"] - baseline))
  return found


def replicated(fn, jit_compile=False):
  """`fn` as a `tf.function` to measure; under a `tf.distribute` strategy's
  scope, one that runs `fn` in every replica, each on the same arguments.

  A strategy's variables (a model built for `MirroredStrategy`, say) can be
  differentiated only in a replica context, so a step measured in its scope
  runs as training under it would: each replica a step on the whole
  arguments, which are then one replica's batch. The function returns the
  first replica's results, once every replica's are computed.
  """
  if not (tf.distribute.has_strategy() and
          tf.distribute.in_cross_replica_context()):
    return tf.function(fn, jit_compile=jit_compile)
  strategy = tf.distribute.get_strategy()
  body = tf.function(fn, jit_compile=True) if jit_compile else fn

  def in_replicas(*args):
    results = strategy.experimental_local_results(strategy.run(body, args))
    # Every replica's work feeds the result, so none of it is pruned.
    with tf.control_dependencies(tf.nest.flatten(results)):
      return tf.nest.map_structure(tf.identity, results[0])

  return tf.function(in_replicas)


def _wait(result):
  # Converting every tensor to numpy waits for the values.
  tf.nest.map_structure(
      lambda t: np.asarray(t) if tf.is_tensor(t) else t, result)


def median_seconds(fns, *args, repeats=5):
  """Median seconds of each `fn(*args)` over `repeats` rounds; a list.

  Each round calls every fn once, in a shuffled order: drift in the
  machine's speed then touches all alike (timed one after another, two
  functions doing the same work differ), and no fn always follows
  the same one (and inherits, say, its allocator state). Each fn is called
  once untimed first, to trace it.
  """
  return [float(np.median(t)) for t in seconds(fns, *args, repeats=repeats)]


def seconds(fns, *args, repeats=5):
  """Every timed call of `median_seconds`: per fn, a list of `repeats`
  seconds."""
  for fn in fns:
    _wait(fn(*args))
  times = [[] for _ in fns]
  order = np.random.default_rng(0)
  for _ in range(repeats):
    for i in order.permutation(len(fns)):
      start = time.perf_counter()
      _wait(fns[i](*args))
      times[i].append(time.perf_counter() - start)
  return times


def format_bytes(num_bytes):
  """Bytes as MiB with one decimal, e.g. '79.0 MiB'."""
  return f"{num_bytes / 2**20:.1f} MiB"


def progress_bar(target, unit_name, verbose=1):
  """A Keras `Progbar` for `target` measurements, or None when `verbose` is 0.

  On a terminal it redraws one line; elsewhere (a log file, CI) it prints a
  single summary line at the end, without the escape codes and carriage
  returns that a redrawn bar leaves in a log.
  """
  if not verbose:
    return None
  import keras  # pylint: disable=g-import-not-at-top
  interactive = hasattr(sys.stdout, "isatty") and sys.stdout.isatty()
  return keras.utils.Progbar(target, unit_name=unit_name,
                             verbose=1 if interactive else 2)


class _Snapshot:
  """Variables' values, taken once; `restore` puts them back."""

  def __init__(self, variables):
    self.variables = list(variables)
    self.values = [np.array(v.numpy()) for v in self.variables]

  def restore(self):
    for variable, value in zip(self.variables, self.values):
      variable.assign(value)


@contextlib.contextmanager
def restoring(variables):
  """Puts `variables` back as they were when the block ends.

  Measuring a training step moves what it trains: weights and optimizer
  slots (`model.train_on_batch`), BatchNormalization statistics, dropout
  seed generators. The values are copied to host memory, which the peaks
  measured inside the block do not count. The block gets the snapshot:
  its `restore()` puts them back at any time (between measurements).
  """
  snapshot = _Snapshot(variables)
  try:
    yield snapshot
  finally:
    snapshot.restore()

