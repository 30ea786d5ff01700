"""Choose what to rematerialize in a chain of layers for a memory budget.

  costs = tfremat.planner.measure_chain(blocks, sample_input)
  plan = tfremat.planner.plan(costs, budget_bytes=200 * 2**20)
  print(plan)                 # per-layer decisions, predicted peak and time
  layer = tfremat.remat_sequential(blocks, budget_bytes=..., sample_input=x)

The budget bounds what `tfremat.bench` measures: the allocator's peak during
one training step (forward, loss, backward) above what was allocated just
before it. Weights and the input batch are not counted; activations,
temporaries and weight gradients are.

A plan splits the chain into consecutive segments, each either kept (its
layers' activations are stored for the backward pass) or rematerialized (only
the segment's output is stored; the segment reruns in the backward pass). The
cost model below predicts a plan's peak and step time from per-layer
measurements; `plan` finds the fastest plan whose predicted peak fits the
budget, exactly, by dynamic programming over (retained bytes, time) Pareto
fronts. Recursive schedules (rematerializing inside a rematerialized segment)
are not searched.
"""

import dataclasses
import math
import time

import numpy as np
import tensorflow as tf


# A measured peak may exceed a budget by this factor and still count as
# within it: allocator rounding and the order in which the executor runs
# independent ops move a step's peak from one call to the next.
MEASUREMENT_SLACK = 1.05

# A measured peak is the largest of this many calls of a traced step: one
# step's peak varies from call to call (on the benchmark's MLP, 97-107 MiB
# over 18 calls of one plan).
PEAK_CALLS = 5


@dataclasses.dataclass(frozen=True)
class LayerCost:
  """What one layer of a chain costs in a training step.

  Attributes:
    name: the layer's name.
    forward_seconds: one forward call, training mode.
    backward_seconds: the gradient computation alone (forward + backward
      minus forward).
    input_bytes: its input (the previous layer's output).
    output_bytes: its output.
    saved_bytes: what its forward pass keeps for its backward pass beyond its
      output, when it is not rematerialized.
    forward_transient_bytes: the forward pass's peak above its inputs,
      output and saved tensors.
    backward_transient_bytes: the backward pass's peak above what it holds
      (saved tensors, output, incoming and outgoing gradients, weight
      gradients).
    weight_grad_bytes: its weight gradients (held until the step ends).
    waiting_recompute_seconds: what its recompute costs beyond
      `forward_seconds` when it is not the last layer of a rematerialized
      segment, so that its recomputed tensors wait while the later layers'
      are recomputed (measured chain-wide by `measure_chain`).
  """
  name: str
  forward_seconds: float
  backward_seconds: float
  input_bytes: int
  output_bytes: int
  saved_bytes: int
  forward_transient_bytes: int
  backward_transient_bytes: int
  weight_grad_bytes: int
  waiting_recompute_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class Segment:
  """Layers [start, stop) of the chain, rematerialized or kept."""
  start: int
  stop: int
  remat: bool


def _nbytes(tree):
  # Keras variables name their dtype with a string.
  return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size
             for t in tf.nest.flatten(tree) if t is not None)


def median_seconds(fns, x, repeats):
  """Median seconds of each fn(x) over `repeats` rounds.

  Each round calls every fn once, in a shuffled order: drift in the
  machine's speed then touches all alike (timed one after another, two
  functions doing the same work differed by 6%), and no fn always follows
  the same one (and inherits, say, its allocator state). Each fn is called
  once untimed first, to trace it.
  """
  for fn in fns:
    fn(x)
  times = [[] for _ in fns]
  order = np.random.default_rng(0)
  for _ in range(repeats):
    for i in order.permutation(len(fns)):
      start = time.perf_counter()
      tf.nest.map_structure(np.asarray, fns[i](x))
      times[i].append(time.perf_counter() - start)
  return [float(np.median(t)) for t in times]


def _peak_bytes(fn, x):
  from tfremat import bench  # pylint: disable=g-import-not-at-top
  fn(x)  # Trace outside the measurement.
  return bench.peak_step_bytes(fn, x, calls=PEAK_CALLS)


def _extra_peak_bytes(more, less, x):
  """How far `more(x)`'s peak exceeds `less(x)`'s.

  The median, over PEAK_CALLS pairs of calls, of the difference of the two
  calls' peaks. A difference of two maxima over calls was far noisier: for
  one two-layer block it ranged over 0.5x-2.1x of the tensor it estimates,
  this median over 1.0x-1.25x.
  """
  from tfremat import bench  # pylint: disable=g-import-not-at-top
  more(x)  # Trace outside the measurement.
  less(x)
  return int(np.median([
      bench.peak_step_bytes(more, x) - bench.peak_step_bytes(less, x)
      for _ in range(PEAK_CALLS)]))


def _current_bytes():
  from tfremat import bench  # pylint: disable=g-import-not-at-top
  return tf.config.experimental.get_memory_info(
      bench.memory_device())["current"]


def training_step(layer, applications=1, jit=False):
  """A traced training step of a chain: forward and backward of `layer`
  (applied `applications` times in a row) on a batch, for the loss
  sum(y**2) / 2 of its output y; returns the input and weight gradients.

  The loss must read y: with an incoming gradient that depends only on y's
  shape (such as ones), TensorFlow prunes the forward ops whose values the
  backward pass does not read, so a rematerialized last segment's forward
  pass would cost nothing and every timing and peak would be too low.
  """
  weights = layer.trainable_weights

  @tf.function(jit_compile=jit)
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = x
      for _ in range(applications):
        y = layer(y, training=True)
    # d(sum(y**2) / 2)/dy = y: the loss's gradient, without the loss's ops.
    return tape.gradient(y, [x] + weights,
                         output_gradients=tf.stop_gradient(y))

  return step


def measure_layer(layer, x, repeats=5):
  """Measures `layer` on input `x`; returns (LayerCost, its output).

  Times are medians of `repeats` calls of traced functions. Bytes come from
  the allocator's statistics around traced calls (`bench.peak_step_bytes`).
  What the layer keeps for its backward pass is estimated as what a second
  application adds to the peak: while the second one runs its backward pass,
  the first one's saved tensors and output are held (an estimate: the two
  peaks need not fall at corresponding points). For a layer whose output shape
  differs from its input's, it is what an eager GradientTape holds instead
  (usually more than a traced function keeps).
  """

  @tf.function
  def forward(x):
    return layer(x, training=True)

  y = forward(x)
  out, inp = _nbytes(y), _nbytes(x)
  grads = _nbytes(layer.trainable_weights)
  once = training_step(layer)
  peak_once = _peak_bytes(once, x)
  if y.shape == x.shape and y.dtype == x.dtype:
    # The second application's weight gradients add to the first's in place.
    saved = _extra_peak_bytes(training_step(layer, 2), once, x) - out
  else:
    before = _current_bytes()
    with tf.GradientTape() as tape:
      tape.watch(x)
      held = layer(x, training=True)
      saved = _current_bytes() - before - out
    del tape, held
  saved = max(0, saved)
  fwd_peak = _peak_bytes(forward, x)
  fwd_s, both_s = median_seconds([forward, once], x, repeats)
  cost = LayerCost(
      name=layer.name,
      forward_seconds=fwd_s,
      backward_seconds=max(0.0, both_s - fwd_s),
      input_bytes=inp,
      output_bytes=out,
      saved_bytes=saved,
      forward_transient_bytes=max(0, fwd_peak - out),
      backward_transient_bytes=max(
          0, peak_once - (saved + out + out + inp + grads)),
      weight_grad_bytes=grads)
  return cost, y


def measure_peak(layer, x):
  """Measured peak bytes of one training step (forward + backward) of
  `layer` on `x`, the quantity a budget bounds."""
  return _peak_bytes(training_step(layer), x)


def measure_chain(layers, sample_input, repeats=5):
  """Measures each layer of a chain in turn; returns a list of LayerCost.

  Then measures what long rematerialized segments cost beyond their layers'
  forward times. Recomputing a segment of k layers and then running its
  backward pass took longer than doing the same for k one-layer segments (on
  the benchmark's models on a 2-core CPU machine: 3-6% of the whole step for
  one segment over the chain), presumably because each layer's recomputed
  tensors are no longer fresh in cache when its backward pass reads them. So
  the chain is timed both ways, `repeats` times round-robin, and the
  difference is spread over the layers that wait, in proportion to their
  forward time, as `waiting_recompute_seconds`.
  """
  costs, x = [], tf.convert_to_tensor(sample_input)
  for layer in layers:
    cost, x = measure_layer(layer, x, repeats)
    costs.append(cost)
  if len(costs) < 2:
    return costs
  from tfremat import layers as layers_lib  # pylint: disable=g-import-not-at-top
  n, x = len(layers), tf.convert_to_tensor(sample_input)
  steps = [training_step(layers_lib.RematSequential(layers, segments))
           for segments in ([Segment(i, i + 1, True) for i in range(n)],
                            [Segment(0, n, True)])]
  singles, whole = median_seconds(steps, x, repeats)
  waiting = sum(c.forward_seconds for c in costs[:-1])
  ratio = max(0.0, whole - singles) / waiting if waiting else 0.0
  return [dataclasses.replace(
      c, waiting_recompute_seconds=ratio * c.forward_seconds) for c in costs]


def _segment_terms(costs, seg):
  """(peak above retained-before, retained after, seconds) of one segment.

  The peak term excludes the bytes retained by earlier segments and the
  weight gradients of later layers, which `predict` adds.
  """
  layers = costs[seg.start:seg.stop]
  peak, held = 0, 0
  # Forward.
  for i, c in enumerate(layers):
    if seg.remat:
      # Only the previous in-segment output is live while this layer runs.
      prev = layers[i - 1].output_bytes if i else 0
      peak = max(peak, prev + c.output_bytes + c.saved_bytes +
                 c.forward_transient_bytes)
    else:
      peak = max(peak, held + c.output_bytes + c.saved_bytes +
                 c.forward_transient_bytes)
      held += c.output_bytes + c.saved_bytes
  retained = held if not seg.remat else layers[-1].output_bytes
  # Backward: recompute first when rematerialized; the segment's incoming
  # gradient is live from then on.
  dy = layers[-1].output_bytes
  held = 0
  for c in layers:
    if seg.remat:
      peak = max(peak, dy + held + c.output_bytes + c.saved_bytes +
                 c.forward_transient_bytes)
    held += c.output_bytes + c.saved_bytes
  grads = 0
  for c in reversed(layers):
    peak = max(peak, held + c.output_bytes + c.input_bytes + grads +
               c.weight_grad_bytes + c.backward_transient_bytes)
    held -= c.output_bytes + c.saved_bytes
    grads += c.weight_grad_bytes
  seconds = sum(c.forward_seconds + c.backward_seconds for c in layers)
  if seg.remat:
    seconds += sum(c.forward_seconds for c in layers)
    seconds += sum(c.waiting_recompute_seconds for c in layers[:-1])
  return peak, retained, seconds


def _grads_after(costs):
  after, total = [0] * len(costs), 0
  for i in range(len(costs) - 1, -1, -1):
    after[i] = total
    total += costs[i].weight_grad_bytes
  return after


def predict(costs, segments):
  """The cost model: (peak bytes, seconds) of a training step under a plan."""
  check_segments(segments, len(costs))
  after = _grads_after(costs)
  peak, retained, seconds = 0, 0, 0.0
  for seg in segments:
    seg_peak, seg_retained, seg_seconds = _segment_terms(costs, seg)
    peak = max(peak, retained + after[seg.stop - 1] + seg_peak)
    retained += seg_retained
    seconds += seg_seconds
  # The loss's gradient arrives while everything retained is still held.
  peak = max(peak, retained + costs[-1].output_bytes)
  return peak, seconds


def check_segments(segments, n):
  """Raises ValueError unless `segments` cover layers [0, n) in order."""
  stops = [s.start for s in segments[1:]]
  if (not segments or segments[0].start != 0 or segments[-1].stop != n or
      [s.stop for s in segments[:-1]] != stops or
      any(s.stop <= s.start for s in segments)):
    raise ValueError(
        f"segments must cover layers 0..{n} in order without gaps; got "
        f"{segments}.")


def _candidates(n):
  """Segments worth considering: kept single layers, any remat range."""
  for start in range(n):
    yield Segment(start, start + 1, False)
    for stop in range(start + 1, n + 1):
      yield Segment(start, stop, True)


def _fastest(costs, budget):
  """The fastest plan with predicted peak <= budget, or None."""
  n = len(costs)
  after = _grads_after(costs)
  terms = {s: _segment_terms(costs, s) for s in _candidates(n)}
  # fronts[i]: Pareto-optimal (retained, seconds, segments) at position i.
  fronts = [[] for _ in range(n + 1)]
  fronts[0] = [(0, 0.0, ())]
  for start in range(n):
    front = sorted(fronts[start], key=lambda s: (s[0], s[1]))
    pruned, best = [], math.inf
    for state in front:  # Keep states that are faster than any with less R.
      if state[1] < best:
        pruned.append(state)
        best = state[1]
    for retained, seconds, segs in pruned:
      for seg in (s for s in terms if s.start == start):
        seg_peak, seg_retained, seg_seconds = terms[seg]
        if retained + after[seg.stop - 1] + seg_peak > budget:
          continue
        fronts[seg.stop].append((retained + seg_retained,
                                 seconds + seg_seconds, segs + (seg,)))
  finals = [(seconds, segs) for retained, seconds, segs in fronts[n]
            if retained + costs[-1].output_bytes <= budget]
  return min(finals, key=lambda f: f[0])[1] if finals else None


def smallest_budget(costs):
  """The smallest budget (bytes) for which some plan fits."""
  lo, hi = 0, predict(costs, [Segment(0, len(costs), False)])[0]
  hi = max(hi, predict(costs, uniform_segments(len(costs), len(costs)))[0])
  while lo < hi:
    mid = (lo + hi) // 2
    if _fastest(costs, mid) is None:
      lo = mid + 1
    else:
      hi = mid
  return lo


class Plan:
  """Which layers to rematerialize, with the cost model's predictions."""

  def __init__(self, costs, segments, budget_bytes=None):
    self.costs = list(costs)
    self.segments = list(segments)
    self.budget_bytes = budget_bytes
    self.peak_bytes, self.seconds = predict(costs, segments)
    self.measured_peak_bytes = None  # Set by remat_sequential's check.
    self.baseline_peak_bytes, self.baseline_seconds = predict(
        costs, keep_all(len(costs)))

  @property
  def rematerialized(self):
    """Per layer: whether it is rematerialized."""
    return [s.remat for s in self.segments for _ in range(s.start, s.stop)]

  def __str__(self):
    mib = lambda b: f"{b / 2**20:.1f} MiB"
    lines = [f"{'layer':<24}{'decision':<18}{'saved':>11}{'output':>11}"
             f"{'fwd ms':>9}{'wait ms':>9}"]
    for k, seg in enumerate(self.segments):
      for i in range(seg.start, seg.stop):
        c = self.costs[i]
        what = f"remat segment {k}" if seg.remat else "keep"
        lines.append(f"{c.name[:23]:<24}{what:<18}{mib(c.saved_bytes):>11}"
                     f"{mib(c.output_bytes):>11}"
                     f"{1000 * c.forward_seconds:>9.2f}"
                     f"{1000 * c.waiting_recompute_seconds:>9.2f}")
    extra = self.seconds / self.baseline_seconds - 1
    budget = (f" (budget {mib(self.budget_bytes)})"
              if self.budget_bytes is not None else "")
    measured = (f"measured peak {mib(self.measured_peak_bytes)}; "
                if self.measured_peak_bytes is not None else "")
    lines.append(
        f"{measured}predicted peak {mib(self.peak_bytes)}{budget}, "
        f"{self.peak_bytes / self.baseline_peak_bytes:.2f}x of no remat "
        f"({mib(self.baseline_peak_bytes)}); predicted step time "
        f"{1000 * self.seconds:.1f} ms, {100 * extra:+.1f}% over no remat")
    return "\n".join(lines)


def plan(costs, budget_bytes):
  """The fastest plan whose predicted peak fits `budget_bytes`.

  Raises:
    ValueError: no plan fits; the message gives the smallest budget that does.
  """
  segments = _fastest(costs, budget_bytes)
  if segments is None:
    raise infeasible_budget_error(budget_bytes, smallest_budget(costs))
  return Plan(costs, segments, budget_bytes)


def infeasible_budget_error(budget_bytes, need, estimated_by=None):
  """The ValueError for a budget below `need`, the smallest that works
  (`estimated_by`: how `need` was estimated, if not by the model alone)."""
  about, how = ("about ", f", {estimated_by}") if estimated_by else ("", "")
  return ValueError(
      f"No rematerialization plan fits a budget of {budget_bytes} bytes "
      f"({budget_bytes / 2**20:.1f} MiB); the smallest budget that works for "
      f"this chain is {about}{need} bytes ({need / 2**20:.1f} MiB){how}. "
      "Raise the budget, or shrink the batch or the layers.")


def keep_all(num_layers):
  """The plan that rematerializes nothing."""
  return [Segment(i, i + 1, False) for i in range(num_layers)]


def uniform_segments(num_layers, segments):
  """`segments` (an int, or "sqrt") equal rematerialized segments."""
  if segments == "sqrt":
    segments = max(1, round(math.sqrt(num_layers)))
  if (not isinstance(segments, int) or isinstance(segments, bool) or
      not 1 <= segments <= max(1, num_layers)):
    raise ValueError(
        f"segments must be an int from 1 to the number of layers "
        f"({num_layers}) or \"sqrt\"; got {segments!r}.")
  bounds = [round(i * num_layers / segments) for i in range(segments + 1)]
  return [Segment(lo, hi, True) for lo, hi in zip(bounds, bounds[1:])]
