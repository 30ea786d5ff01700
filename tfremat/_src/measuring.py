"""Measuring a step (`tfremat.measure`): its peak from the allocator's
profiler records, what it leaves allocated, and its time.

A leaf: every layer of the package may measure through it, and it imports
nothing of tfremat's but its errors and units."""

import contextlib
import dataclasses
import functools
import os
import pathlib
import re
import sys
import tempfile
import time

import numpy as np
import tensorflow as tf

from tfremat import errors
from tfremat._src import units

__all__ = [
    "memory_device",
    "replicas_measured",
    "peak_bytes",
    "peaks",
    "step_peaks",
    "fit_peaks",
    "StepPeak",
    "held_bytes",
    "replicated",
    "relaxed_spec",
    "RelaxedFunction",
    "median_seconds",
    "seconds",
    "format_bytes",
    "progress_bar",
    "restoring",
    "PEAK_CALLS",
    "wait_for",
]

# A traced step's peak can move from call to call where the executor's
# threads order independent ops differently, so `peak_bytes` takes the
# largest over this many calls by default.
PEAK_CALLS = 5


def replicas_measured():
  """How many replicas of the `tf.distribute` strategy in scope share the
  measured device's memory (`memory_device`): the logical devices of one
  CPU share its allocator, each GPU has its own. 1 outside a strategy. A
  step measured in the strategy's scope counts every replica that shares
  it: a planner divides by this for one replica's peak."""
  if not tf.distribute.has_strategy():
    return 1
  devices = [d.upper() for d in
             tf.distribute.get_strategy().extended.worker_devices]
  kind, index = memory_device().split(":")
  if kind == "CPU":
    return max(1, sum("CPU:" in d for d in devices))
  return max(1, sum(d.endswith(f"GPU:{index}") for d in devices))


def memory_device():
  """The device whose allocator is measured: the first GPU if there is one,
  else the CPU."""
  return "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"


@dataclasses.dataclass(frozen=True)
class StepPeak:
  """One call's memory, from the allocator's records of its allocations.

  Attributes:
    requested_bytes: the largest total of the tensors allocated during the
      call and not yet freed (their requested sizes): the step's peak.
    allocated_bytes: the largest total of what the allocator took for them
      (its chunks: 256-byte multiples, up to twice a tensor's size).
    held_bytes: the requested bytes still allocated when the call returned
      (its results, and what it keeps alive).
  """
  requested_bytes: int
  allocated_bytes: int
  held_bytes: int


@functools.cache
def _check_allocator(device):
  """Raises unless the profiler sees `device`'s allocator allocate a 1 KiB
  tensor (once per device and process). TensorFlow's BFC allocator reports
  every allocation; its default CPU allocator reports only tensors above
  256 KiB (with oneDNN) or none at all (without)."""
  with _Allocations(device) as recorded:
    with recorded.call():
      with tf.device(device):
        probe = tf.fill([256], 1.0)
        wait_for(probe)
        del probe
  if recorded.peaks[0].requested_bytes < 1024:
    raise errors.UnsupportedError(
        f"TensorFlow's allocator for {device} does not report every "
        "allocation to its profiler (only its BFC allocator does), so a "
        "step's memory cannot be measured. On the CPU set "
        "TF_CPU_ALLOCATOR_USE_BFC=true in the environment, or import "
        "tfremat before TensorFlow runs its first op.")


def peak_bytes(step, *args, calls=PEAK_CALLS, warmup=True, **kwargs):
  """The peak memory of calling `step(*args, **kwargs)`, in bytes.

  The largest total size of the tensors the call has allocated and not yet
  freed, at any moment of the call; the largest over `calls` calls. Every
  call's result is waited for, so asynchronous execution does not hide part
  of the step.

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
    RuntimeError: the device's allocator is not TensorFlow's BFC allocator
      (the message says how to turn it on), TensorFlow's profiler is running
      already (it runs one session at a time), or it did not record the
      calls.
    ValueError: `calls` is not a positive int.
  """
  return max(peaks(step, *args, calls=calls, warmup=warmup, **kwargs))


def peaks(step, *args, calls=PEAK_CALLS, warmup=True, **kwargs):
  """Every call's peak, as `peak_bytes` measures them: a list of ints."""
  return [p.requested_bytes for p in step_peaks(
      step, *args, calls=calls, warmup=warmup, **kwargs)]


def step_peaks(step, *args, calls=PEAK_CALLS, warmup=True, **kwargs):
  """Every call's `StepPeak`: the tensors' peak, the allocator's, and what
  the call left allocated. Arguments as for `peak_bytes`."""
  if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
    raise errors.InvalidArgumentError(
        f"calls must be a positive int; got {calls!r}.")
  device = memory_device()
  _check_allocator(device)
  if warmup:
    wait_for(step(*args, **kwargs))
  with _Allocations(device) as recorded:
    for _ in range(calls):
      with recorded.call():
        wait_for(step(*args, **kwargs))
  return recorded.peaks


def fit_peaks(model, data, **fit_kwargs):
  """Every training step's `StepPeak` in `model.fit(data, **fit_kwargs)`,
  in order: each step measured as `step_peaks` measures a call, from when
  Keras starts it (`on_train_batch_begin`) to when it ends. What `fit`'s
  data pipeline allocates meanwhile (the next batches) counts too."""
  import keras  # pylint: disable=g-import-not-at-top
  device = memory_device()
  _check_allocator(device)

  windows = []

  class Windows(keras.callbacks.Callback):

    def on_train_batch_begin(self, batch, logs=None):
      windows.append(recorded.call())
      windows[-1].__enter__()

    def on_train_batch_end(self, batch, logs=None):
      windows.pop().__exit__(None, None, None)

  with _Allocations(device) as recorded:
    model.fit(data, callbacks=[Windows()], **fit_kwargs)
    # Over data of unknown length, Keras begins a step that finds the data
    # ended, and does not end it: that window is no step's.
    unfinished = len(windows)
    for window in windows:
      window.__exit__(None, None, None)
  return recorded.peaks[:len(recorded.peaks) - unfinished]


def held_bytes(fn, *args, **kwargs):
  """`(fn(*args, **kwargs), bytes)`: the call's result and the bytes of the
  tensors it allocated that are still allocated when it returns (held by
  its result, or by a `tf.GradientTape` it returns, say)."""
  device = memory_device()
  _check_allocator(device)
  with _Allocations(device) as recorded:
    with recorded.call():
      result = fn(*args, **kwargs)
      wait_for(result)
  return result, recorded.peaks[0].held_bytes


# The name of the profiler event around each measured call.
_CALL = "tfremat.measure.call"

# The INFO lines TensorFlow's profiler logs as a session starts and stops.
_PROFILER_LINE = re.compile(
    rb"(profiler_session|save_profile|session_manager)\.cc:\d+\] ")


@contextlib.contextmanager
def _profiler_lines_held_back():
  """Drops the INFO lines a profiler session logs as it starts and stops.

  TensorFlow's C++ code logs five or six of them per session to file descriptor 2
  unless TF_CPP_MIN_LOG_LEVEL is set, and a planner measures hundreds of
  times, which would bury what the user's own program prints. Only while the
  session starts or stops, what is written to descriptor 2 goes to a file,
  and everything but those lines is then written on, in order."""
  if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "0").strip() not in ("", "0"):
    yield
    return
  try:
    sys.stderr.flush()
    saved = os.dup(2)
  except (OSError, ValueError):  # No descriptor 2 to hold.
    yield
    return
  with tempfile.TemporaryFile() as held:
    os.dup2(held.fileno(), 2)
    try:
      yield
    finally:
      try:
        sys.stderr.flush()
      except ValueError:
        pass
      os.dup2(saved, 2)
      os.close(saved)
      held.seek(0)
      rest = [line for line in held.read().splitlines(keepends=True)
              if not _PROFILER_LINE.search(line)]
      if rest:
        os.write(2, b"".join(rest))


class _Allocations:
  """Records the allocator's allocations and deallocations on `device`
  during the calls made inside `call()`, through TensorFlow's profiler
  (its host tracer records each one, with the requested and the allocated
  size, whichever allocator is in use); `peaks` holds a `StepPeak` per
  call once the block ends."""

  def __init__(self, device):
    self.device = device
    self.peaks = []
    self._folder = None
    self._count = 0

  def __enter__(self):
    self._folder = tempfile.TemporaryDirectory(prefix="tfremat_measure_")
    try:
      with _profiler_lines_held_back():
        tf.profiler.experimental.start(
            self._folder.name, tf.profiler.experimental.ProfilerOptions(
                host_tracer_level=2, python_tracer_level=0,
                device_tracer_level=0))
    except tf.errors.AlreadyExistsError:
      self._folder.cleanup()
      raise errors.UnsupportedError(
          "A step's memory is measured through TensorFlow's profiler, which "
          "runs one session at a time, and another is running. Stop it "
          "(tf.profiler.experimental.stop()) before measuring, or measure "
          "outside it.") from None
    return self

  def call(self):
    """A block around one measured call."""
    self._count += 1
    return tf.profiler.experimental.Trace(_CALL, step_num=self._count, _r=1)

  def __exit__(self, *exc_info):
    try:
      with _profiler_lines_held_back():
        tf.profiler.experimental.stop()
      if exc_info[0] is None:
        written = sorted(pathlib.Path(self._folder.name).glob(
            "plugins/profile/*/*.xplane.pb"))
        if not written:
          raise errors.UnsupportedError(
              "TensorFlow's profiler wrote no trace, so a step's memory "
              "cannot be measured in this process.")
        self.peaks = _parse(written[-1].read_bytes(), self.device,
                            self._count)
    finally:
      self._folder.cleanup()
    return False


def _parse(data, device, calls):
  """A StepPeak per measured call, from a serialized XSpace."""
  # pylint: disable-next=g-import-not-at-top
  from tensorflow.tsl.profiler.protobuf import xplane_pb2
  space = xplane_pb2.XSpace()
  space.ParseFromString(data)
  windows, events = [], []
  for plane in space.planes:
    if not plane.name.startswith("/host:"):
      continue
    names = {k: v.name for k, v in plane.event_metadata.items()}
    stat_names = {k: v.name for k, v in plane.stat_metadata.items()}
    for line in plane.lines:
      for event in line.events:
        name = names.get(event.metadata_id)
        begin = line.timestamp_ns * 1000 + event.offset_ps
        if name == _CALL:
          windows.append((begin, begin + event.duration_ps))
        elif name in ("MemoryAllocation", "MemoryDeallocation"):
          stats = {stat_names.get(s.metadata_id): s for s in event.stats}
          allocator = stats.get("allocator_name")
          allocator = (stat_names.get(allocator.ref_value, allocator.str_value)
                       if allocator is not None else "")
          if not _on_device(allocator, device):
            continue
          sign = 1 if name == "MemoryAllocation" else -1
          # At the same instant, an allocation counts before a release.
          events.append((begin, -sign, sign * _int(stats, "requested_bytes"),
                         sign * _int(stats, "allocation_bytes")))
  if len(windows) != calls:
    raise errors.UnsupportedError(
        f"TensorFlow's profiler recorded {len(windows)} of the {calls} "
        "measured calls: a step's memory cannot be measured in this process "
        "(is TensorFlow's profiler available in this build?).")
  events.sort()
  found = []
  for begin, end in sorted(windows):
    requested = allocated = top_requested = top_allocated = 0
    for when, _, req, alloc in events:
      if when < begin:
        continue
      if when > end:
        break
      requested += req
      allocated += alloc
      top_requested = max(top_requested, requested)
      top_allocated = max(top_allocated, allocated)
    found.append(StepPeak(top_requested, top_allocated, max(0, requested)))
  return found


def _int(stats, name):
  stat = stats.get(name)
  if stat is None:
    return 0
  return int(stat.int64_value or stat.uint64_value)


def _on_device(allocator, device):
  """Whether the allocator named `allocator` serves `device` ("GPU:0",
  "CPU:0"): a GPU's is "GPU_0_bfc" (or "gpu_async_0"); pinned host memory
  for copies ("cuda_host_bfc", "gpu_host_bfc") serves neither; the CPU's
  has any other name ("mklcpu", "cpu", "bfc_cpu_allocator_for_gpu")."""
  name = allocator.lower()
  gpu = re.match(r"gpu_(?:async_)?(\d+)", name)
  if device.startswith("GPU"):
    return gpu is not None and gpu.group(1) == device.split(":")[1]
  return gpu is None and "host" not in name


def replicated(fn, jit_compile=False, reduce_retracing=False):
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
    return tf.function(fn, jit_compile=jit_compile,
                       reduce_retracing=reduce_retracing)
  strategy = tf.distribute.get_strategy()
  body = tf.function(fn, jit_compile=True) if jit_compile else fn

  def in_replicas(*args):
    results = strategy.experimental_local_results(strategy.run(body, args))
    # Every replica's work feeds the result, so none of it is pruned.
    with tf.control_dependencies(tf.nest.flatten(results)):
      return tf.nest.map_structure(tf.identity, results[0])

  return tf.function(in_replicas, reduce_retracing=reduce_retracing)


def relaxed_spec(tensor, batch_only=False):
  """A `tf.TensorSpec` of `tensor` with each axis that may change size
  between steps unknown, as Keras's `fit` traces its step once a second
  shape arrives: every axis but a float tensor's last (its features), or
  with `batch_only` the first alone."""
  tensor = tf.convert_to_tensor(tensor)
  dims = list(tensor.shape)
  for i in range(len(dims)):
    if i == 0 or not batch_only and not (
        i == len(dims) - 1 and len(dims) >= 2 and tensor.dtype.is_floating):
      dims[i] = None
  return tf.TensorSpec(dims, tensor.dtype)


class RelaxedFunction:
  """`fn` as a `tf.function` traced once, on its first call, for any size
  of its arguments' axes that may change between steps (`relaxed_spec`):
  the program a step runs after Keras has seen a second shape, which can
  hold more than one traced for static shapes (a reduction or reshape that
  is free at a known shape copies at an unknown one). Where `fn` cannot be
  traced so (a model that flattens an image needs its height), only the
  batch axis is unknown, or none is."""

  def __init__(self, fn, jit_compile=False):
    self._fn = fn
    self._jit_compile = jit_compile
    self._traced = None

  def __call__(self, *args):
    if self._traced is None:
      self._traced = self._trace(args)
    return self._traced(*args)

  def _trace(self, args):
    for batch_only in (False, True):
      signature = tf.nest.map_structure(
          lambda t, b=batch_only: relaxed_spec(t, b), list(args))
      traced = tf.function(self._fn, input_signature=signature,
                           jit_compile=self._jit_compile)
      try:
        traced.get_concrete_function(*signature)
        return traced
      except errors.Error:
        raise  # tfremat's own, such as a rerun that differs: not a shape.
      except (ValueError, TypeError):
        continue
    return tf.function(self._fn, jit_compile=self._jit_compile)


def wait_for(result):
  """Waits for every tensor in `result` to be computed (by converting it to
  numpy)."""
  tf.nest.map_structure(
      lambda t: np.asarray(t) if tf.is_tensor(t) else t, result)


def median_seconds(fns, *args, repeats=5, warmup=True):
  """Median seconds of each `fn(*args)` over `repeats` rounds; a list.
  (With no `args`, each fn is called with none: `functools.partial` binds
  each its own.)

  Each round calls every fn once, in a shuffled order: drift in the
  machine's speed then touches all alike (timed one after another, two
  functions doing the same work differ), and no fn always follows
  the same one (and inherits, say, its allocator state). Each fn is called
  once untimed first, to trace it (with `warmup`: pass False only for fns
  already called with arguments of these shapes).
  """
  return [float(np.median(t))
          for t in seconds(fns, *args, repeats=repeats, warmup=warmup)]


def seconds(fns, *args, repeats=5, warmup=True):
  """Every timed call of `median_seconds`: per fn, a list of `repeats`
  seconds."""
  for fn in fns if warmup else ():
    wait_for(fn(*args))
  times = [[] for _ in fns]
  order = np.random.default_rng(0)
  for _ in range(repeats):
    for i in order.permutation(len(fns)):
      start = time.perf_counter()
      wait_for(fns[i](*args))
      times[i].append(time.perf_counter() - start)
  return times


format_bytes = units.format_bytes


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

