"""Profiling a chain for the planner: one training step's peak
(`measure_peaks`), what each layer costs alone and under each save policy
(`measure_layer`), and the whole chain's `planner.LayerCost`s
(`measure_chain`), structurally identical layers measured once. A model's
units that read the chain's context (a padding mask) are called with the
sample's, handed in as `context`. Their public names are `tfremat.chain`'s.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from tfremat._src import measuring as measure
from tfremat._src import predicting
from tfremat._src.core import policies as policies_lib
from tfremat._src.core import residuals
from tfremat._src.core import watch
from tfremat._src.keras_api import chain_layers
from tfremat._src.keras_api.chain_layers import call_link
from tfremat._src.keras_api.layers import RematerializationLayer
from tfremat._src.keras_api.segments import Segment
from tfremat._src.planning import growth
from tfremat._src.planning.cost_model import LayerCost

__all__ = [
    "training_step",
    "measure_layer",
    "measure_peak",
    "measure_peaks",
    "structure_key",
    "measure_chain",
    "Perturbed",
    "WAITING_PROBE_LAYERS",
]


def _nbytes(tree):
  # Keras variables name their dtype with a string.
  return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size
             for t in tf.nest.flatten(tree) if t is not None)


def _extra_peak_bytes(more, less, x):
  """How far `more(x)`'s peak exceeds `less(x)`'s.

  The median, over `measure.PEAK_CALLS` pairs of calls, of the difference
  of the two calls' peaks: a difference of two maxima over calls is far
  noisier.
  """
  more(x)  # Trace outside the measurement.
  less(x)
  return int(np.median([
      measure.peak_bytes(more, x, calls=1, warmup=False) -
      measure.peak_bytes(less, x, calls=1, warmup=False)
      for _ in range(measure.PEAK_CALLS)]))


def training_step(layer, applications=1, jit=False, traced=None,
                  relaxed=False, context=None):
  """A traced training step of a chain: forward and backward of `layer`
  (applied `applications` times in a row) on a batch, for the loss
  sum(y**2) / 2 summed over its outputs y; returns the input and weight
  gradients (None for an integer input). `context`: the chain's context
  tensors, for a layer that reads them (`tfremat.chain.ContextUnit`).

  The loss must read y: with an incoming gradient that depends only on y's
  shape (such as ones), TensorFlow prunes the forward ops whose values the
  backward pass does not read, so a rematerialized last segment's forward
  pass would cost nothing and every timing and peak would be too low.

  `traced`, a dict if given, gets on tracing where the step's forward and
  backward ops are in its graph, for `_saved_bytes`. `relaxed`: traced
  once for any size of the input's axes that may change
  (`measure.RelaxedFunction`; under a `tf.distribute` strategy, after a
  second shape), as Keras's `fit` traces a step once shapes vary.
  """

  def step(x):
    graph = tf.compat.v1.get_default_graph()
    first = watch.last_op_id(graph)
    with tf.GradientTape() as tape:
      tape.watch([t for t in tf.nest.flatten(x) if t.dtype.is_floating])
      y = x
      for _ in range(applications):
        y = call_link(layer, y, context, True)
    forward_end = watch.last_op_id(graph)
    # Read after the call: an unbuilt layer makes its weights in it.
    weights = layer.trainable_weights
    # d(sum(y**2) / 2)/dy = y: the loss's gradient, without the loss's ops.
    grads = tape.gradient(
        y, [x] + weights,
        output_gradients=tf.nest.map_structure(tf.stop_gradient, y))
    if traced is not None:
      traced.update(graph=graph, ends=tf.nest.flatten([x, y]),
                    forward=(first, forward_end),
                    backward=(forward_end, watch.last_op_id(graph)))
    return grads

  if relaxed and not tf.distribute.has_strategy():
    return measure.RelaxedFunction(step, jit_compile=jit)
  return measure.replicated(step, jit_compile=jit, reduce_retracing=relaxed)


# Ops whose outputs a step holds whether or not anything is rematerialized
# (variables' reads, constants, captured tensors), or that hold no
# activation (shapes).
_HELD_ANYWAY_OPS = chain_layers.SOURCE_OPS | frozenset([
    "ReadVariableOp", "VarHandleOp", "Shape", "ShapeN", "Size", "Rank"])


def _saved_bytes(traced):
  """The bytes of the forward pass's tensors that the backward pass of a
  traced `training_step` reads, besides the step's input and output, or
  None where a tensor's size is not known from the graph: an unknown
  dimension, a string, or a TensorList (a while loop's accumulated tensors).

  These are what the step keeps from its forward pass for its backward
  pass. Weights (their reads), constants, captured tensors and shapes are
  not counted: every plan holds them, or they are tiny.
  """
  # pylint: disable=protected-access
  (first, forward_end), (_, backward_end) = traced["forward"], traced["backward"]
  ends = {t.ref() for t in traced["ends"] if isinstance(t, tf.Tensor)}
  seen, total = set(), 0
  for op in traced["graph"].get_operations():
    if not forward_end < op._id <= backward_end:
      continue
    for t in op.inputs:
      producer = t.op
      if (not first < producer._id <= forward_end or
          t.ref() in ends or t.ref() in seen):
        continue
      seen.add(t.ref())
      if producer.type in _HELD_ANYWAY_OPS or t.dtype == tf.resource:
        continue  # A resource is a handle to a variable, held anyway.
      if t.dtype in (tf.variant, tf.string) or not t.shape.is_fully_defined():
        return None
      total += t.shape.num_elements() * t.dtype.size
  return total


def measure_layer(layer, x, repeats=5, policies=(), context=None,
                  clock=measure.median_seconds, perturbed=(),
                  peak_of=measure.peak_bytes):
  """Measures `layer` on input `x`; returns (LayerCost, its output).
  `context`: the chain's context tensors, for a layer that reads them.
  `clock`: what times its steps (`tfremat.measure.median_seconds`'s
  arguments and result). `perturbed`: `Perturbed` inputs (one axis of `x`
  resized), where the layer's step is traced again for how its costs grow
  (`LayerCost.growth`, `_growth`).

  Times are medians of `repeats` calls of traced functions. Bytes come from
  the allocator's statistics around traced calls (`measure.peak_bytes`).
  What the layer keeps for its backward pass (besides its input and output)
  is read from its traced training step: the forward pass's tensors that the
  backward pass reads (`_saved_bytes`), exact and the same on every run.
  Where a tensor's size is not in the graph (a while loop's accumulators, an
  unknown dimension), it is measured instead: as what a second application
  adds to the peak (while the second one runs its backward pass, the first
  one's saved tensors and output are held; an estimate, as the two peaks
  need not fall at corresponding points), or, for a layer whose output
  shape differs from its input's, as what an eager GradientTape holds
  (usually more than a traced function keeps: 3x on a Conv2D,
  BatchNormalization and ReLU block).

  For each save policy in `policies` (names or values; the costs are keyed
  by the policies' values), what the layer keeps when
  rematerialized under it is read from one traced forward pass (as
  `tfremat.saved_residuals` lists it), and what rematerializing it costs is
  the measured time of its training step so rematerialized, less that of
  the plain step. Policies that keep the same tensors of this layer (on a
  layer without softmax, `masks_saveable` and `masks_and_softmax_saveable`)
  are timed once and share the measurement, so noise cannot rank equals; one
  that keeps nothing of it runs a full recompute and costs the forward time.
  """

  def run(h):
    return call_link(layer, h, context, True)

  forward = measure.replicated(run)
  y = run(x)  # Eager: traced, it would be traced again to be read.
  out, inp = _nbytes(y), _nbytes(x)
  grads = _nbytes(layer.trainable_weights)
  traced = {}
  once = training_step(layer, traced=traced, context=context)
  peak_once = peak_of(once, x)
  saved = _saved(layer, traced, once, run, x, y, context)
  fwd_peak = peak_of(forward, x)
  # Keyed by the policies' values: a plan's segments run them.
  policies = tuple(policies_lib.get(p) for p in policies)
  kept, keeps, first_alike, empty = {}, {}, {}, set()
  for p, found in zip(policies, residuals.policy_residuals(
      run, x, among=policies)):
    kept[p] = found.total_bytes
    keeps[p] = _kinds_kept(found)
    alike = tuple((r.what.split()[0], r.shape, r.dtype) for r in found)
    first_alike[p] = first_alike.setdefault(alike, p)
    if not found:
      # Keeping nothing of this layer, it runs a full recompute's program:
      # it costs what that costs (the forward time), untimed.
      empty.add(p)
  timed = [p for p in policies if first_alike[p] == p and p not in empty]
  policy_steps = [training_step(RematerializationLayer(
      layer, policy=p), context=context) for p in timed]
  fwd_s, both_s, *policy_s = clock(
      [forward, once] + policy_steps, x, repeats=repeats)
  seconds = dict(zip(timed, policy_s))
  policy_costs = {
      p: ([0, fwd_s] if p in empty else
          [kept[p], max(0.0, seconds[first_alike[p]] - both_s)])
      for p in policies}
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
      weight_grad_bytes=grads,
      policy_costs=policy_costs,
      policy_keeps=keeps)
  if perturbed:
    cost = dataclasses.replace(cost, growth=_growth(
        layer, cost, traced, (fwd_peak, peak_once), perturbed))
  return cost, y


@dataclasses.dataclass(frozen=True)
class Perturbed:
  """A unit's input with one axis resized: `ratio` times the sample's size
  along `axis`; `context`, the chain's context there; `batch`, the batch
  cut so (a `runner.Batch`), where known."""
  axis: int
  ratio: float
  x: object
  context: object = None
  batch: object = None

  @property
  def ratios(self):
    """Each axis's size over the sample's, up to this one's."""
    return tuple(self.ratio if i == self.axis else 1.0
                 for i in range(self.axis + 1))


def _growth(layer, cost, traced, peaks, perturbed):
  """`LayerCost.growth` of `layer` from its step `traced` at the sample and
  traced again at each `Perturbed` input: each tensor's bytes as a monomial
  of the axes' ratios (`growth.tensor_terms`); the input, output and saved
  tensors exactly; the forward and the whole step's peaks at the sample
  (`peaks`) growing as the step's live bytes over its ops
  (`growth.step_growth`), scaled to equal them there. The transients are
  those less what the cost model counts besides them."""
  graphs = []
  for p in perturbed:
    found = {}
    training_step(layer, traced=found, context=p.context
                  ).get_concrete_function(p.x)
    graphs.append((p.axis, p.ratio, found["graph"]))
  terms = growth.tensor_terms(traced["graph"], graphs)
  live = growth.step_growth(traced, terms)

  def term(tensor, value):
    return growth.Rows.monomial(terms.get(tensor.name, (0, ()))[1], value)

  x_end, y_end = traced["ends"][0], traced["ends"][-1]
  inp, out = term(x_end, cost.input_bytes), term(y_end, cost.output_bytes)
  saved = live["saved"].normalized() * cost.saved_bytes
  whole = growth.maximum(live["forward"], live["backward"])
  forward = live["forward"].normalized() * peaks[0]
  step = whole.normalized() * peaks[1]
  return {
      "input_bytes": inp,
      "output_bytes": out,
      "saved_bytes": saved,
      "forward_transient_bytes": forward - out,
      "backward_transient_bytes": (step - saved - out - out - inp -
                                   cost.weight_grad_bytes),
      "saved_share": live["saved"].normalized(),
      "work": live["work"].normalized(),
  }


def _saved(layer, traced, once, run, x, y, context):
  """What `layer` keeps for its backward pass besides its input and output
  (`measure_layer`): read from its traced step, else measured."""
  saved = _saved_bytes(traced)
  out = _nbytes(y)
  if saved is None and y.shape == x.shape and y.dtype == x.dtype:
    # The second application's weight gradients add to the first's in place.
    saved = _extra_peak_bytes(training_step(layer, 2, context=context), once,
                              x) - out
  elif saved is None:
    saved = measure.held_bytes(_taped, run, x)[1] - out
  return max(0, saved)


def _taped(run, x):
  """A forward pass `run(x)` under an eager tape: (the tape, the output),
  for what the tape holds (`measure_layer`)."""
  with tf.GradientTape() as tape:
    tape.watch(x)
    y = run(x)
  return tape, y


def _kinds_kept(residuals_kept):
  """What a policy keeps of a layer, by kind, for the plan's printout."""
  kinds = []
  for r in residuals_kept:
    op = r.what.split()[0]
    kind = ("masks" if "bool" in str(r.dtype) else
            "dots" if policies_lib.is_dot_type(op) else
            "softmax" if op == "Softmax" else op)
    if kind not in kinds:
      kinds.append(kind)
  order = {"dots": 0, "masks": 1, "softmax": 2}
  return "+".join(sorted(kinds, key=lambda k: order.get(k, 3))) or "nothing"


def measure_peak(layer, x, calls=measure.PEAK_CALLS):
  """Measured peak bytes of one training step (forward + backward) of
  `layer` on `x`, the quantity a budget bounds: the largest of `calls`."""
  return max(measure_peaks(layer, x, calls))


def measure_peaks(layer, x, calls=measure.PEAK_CALLS, gradients=None):
  """Every call's peak bytes of `calls` training steps of `layer` on `x`.

  `gradients`, a list if given, gets the bytes of the weight gradients the
  step returns, as it returns them: none for a weight the loss does not
  reach, only the rows read for an embedding table (a dimension unknown
  when traced counts as 0)."""
  step = training_step(layer)
  peaks = measure.peaks(step, x, calls=calls)
  if gradients is not None:
    returned = step.get_concrete_function(x).structured_outputs[1:]
    parts = [t for g in returned if g is not None
             for t in ([g.values, g.indices]
                       if isinstance(g, tf.IndexedSlices) else [g])]
    gradients.append(sum((t.shape.num_elements() or 0) * t.dtype.size
                         for t in parts))
  return peaks


def structure_key(layer, x, policies=()):
  """A key that structurally identical layers share, or None.

  Two layers share it when they are of the same class, with the same
  configuration apart from names and random seeds (which change no cost), the
  same weight shapes and dtypes, on inputs of the same shape and dtype, and
  measured under the same save policies: a transformer's or a ResNet
  stage's repeated blocks. `measure_chain` measures one of them and reuses
  its costs for the rest. A layer whose configuration Keras cannot give
  (a custom layer without `get_config`) has none, and is always measured.
  """
  try:
    config = layer.get_config()
  except (NotImplementedError, TypeError, ValueError, AttributeError):
    return None
  # pylint: disable-next=protected-access
  found = list(layer._flatten_layers(include_self=True))
  for l in found:  # A functional model's operation layers (`x + y`) too.
    found += [m for m in getattr(l, "operations", getattr(l, "layers", ()))
              if m not in found]
  names = {l.name: f"<layer {i}>" for i, l in enumerate(found)}

  def scrub(value):
    if isinstance(value, dict):
      return tuple(sorted((k, scrub(v)) for k, v in value.items()
                          if k != "seed"))
    if isinstance(value, (list, tuple)):
      return tuple(scrub(v) for v in value)
    if isinstance(value, str):
      return names.get(value, value)
    return value if isinstance(value, (int, float, bool, type(None))) else (
        repr(value))

  weights = tuple((tuple(w.shape), str(w.dtype), w.trainable)
                  for w in layer.weights)
  inputs = tuple((tuple(t.shape), str(t.dtype)) for t in tf.nest.flatten(x))
  return (type(layer).__module__, type(layer).__qualname__, scrub(config),
          weights, inputs, tuple(policies_lib.name_of(p) for p in policies))


# With `measure_waiting=True`, the waiting cost is timed on at most this many
# of the chain's first layers (`measure_chain`).
WAITING_PROBE_LAYERS = 4


# The rate at which `_Reader` turns the bytes a program's ops read and
# write into seconds: it ranks plans by their work, and only ratios of its
# figures matter to the planner.
WORK_BYTES_PER_SECOND = 5e9


class _Reader:
  """One layer's peaks and seconds read from its traced programs
  (`predicting.read_program`), each function traced once at an input for
  both: `measure_layer`'s `peak_of` and `clock`. Nothing runs."""

  def __init__(self):
    self._read = {}

  def _of(self, fn, x):
    key = (id(fn), id(x))
    if key not in self._read:  # fn and x are kept: the ids stay theirs.
      self._read[key] = (fn, x, predicting.read_program(fn, x))
    return self._read[key][2]

  def peak(self, fn, x):
    return self._of(fn, x)[0]

  def seconds(self, fns, x, repeats=None):
    del repeats
    return [self._of(fn, x)[1] / WORK_BYTES_PER_SECOND for fn in fns]


def measure_chain(layers, sample_input, repeats=5, progress=None,
                  policies=(), measure_waiting=False, waiting_fraction=0.2,
                  context=None, perturbed=(), read=False):
  """Measures each layer of a chain in turn; returns a list of LayerCost.

  Structurally identical layers (`structure_key`) are measured once: the
  others get the first one's costs under their own names, so the planner
  sees them as equal (noise cannot rank equals) and a chain of many repeated
  blocks plans in about the time of its distinct ones.

  Long rematerialized segments cost more than their layers' forward times:
  recomputing a segment of k layers and then running its backward pass
  takes longer than doing the same for k one-layer segments, presumably
  because each layer's recomputed tensors are no longer fresh in cache when
  its backward pass reads them. Each layer's `waiting_recompute_seconds` is
  `waiting_fraction` of its forward time (the planner passes
  `tfremat.planner.Settings.waiting_fraction`: timing it on each chain took
  about as long as measuring a layer, and moved by more than the effect
  itself between runs); with `measure_waiting`, the
  chain's first `WAITING_PROBE_LAYERS` layers are instead timed both ways,
  `repeats` times round-robin, and the difference, as a fraction of the
  forward time of the layers that waited, is spread over every layer in
  proportion to its forward time.

  `progress`, a Keras Progbar if given, advances by one per layer (and one
  for the timing of waiting recomputes). `policies` are the save policies
  (names or values) to measure each layer under (`measure_layer`).
  `context`: the chain's context tensors on the sample, for the layers that
  read them (a model's units that read a padding mask). `perturbed`: the
  chain's `Perturbed` inputs, each walked through the chain beside the
  sample for how each layer's costs grow (`measure_layer`). `read`: every
  peak and time is read from the layers' traced programs (`_Reader`) and
  no training step runs; only a forward pass of each structurally distinct
  layer runs (eagerly, at each input), for the next one's input: a
  repeated layer's inputs are the first one's outputs, of the same
  shapes.
  """
  advance = progress.add if progress is not None else lambda _: None
  costs, x, measured = [], tf.convert_to_tensor(sample_input), {}
  perturbed = list(perturbed)
  outputs = {}  # Reading, a key's first layer's outputs, as the next inputs.
  for layer in layers:
    key, y = structure_key(layer, x, policies), None
    if key is not None and key in measured:
      cost = dataclasses.replace(measured[key], name=layer.name)
    else:
      reader = _Reader()
      cost, y = measure_layer(
          layer, x, repeats, policies, context, perturbed=perturbed,
          **(dict(peak_of=reader.peak, clock=reader.seconds) if read else {}))
      if key is not None:
        measured[key] = cost
    if read and key in outputs:
      # Its inputs' shapes are the first one's: read from programs, its
      # outputs' values count for nothing.
      x, cuts = outputs[key]
    else:
      # The next layer's input, as an input.
      x = call_link(layer, x, context, False) if y is None else y
      cuts = [call_link(layer, p.x, p.context, False) for p in perturbed]
      if key is not None:
        outputs[key] = x, cuts
    perturbed = [dataclasses.replace(p, x=c) for p, c in zip(perturbed, cuts)]
    costs.append(cost)
    advance(1)
  ratio = waiting_fraction
  if measure_waiting and len(costs) > 1 and not read:
    ratio = _waiting_ratio(layers, sample_input, costs, repeats, context)
    advance(1)
  return [dataclasses.replace(
      c, waiting_recompute_seconds=ratio * c.forward_seconds) for c in costs]


def _waiting_ratio(layers, sample_input, costs, repeats, context):
  """The chain's measured waiting cost as a fraction of forward time."""
  n = min(len(layers), WAITING_PROBE_LAYERS)
  probe, x = layers[:n], tf.convert_to_tensor(sample_input)
  steps = [training_step(chain_layers.RematSequential(probe, segments),
                         context=context)
           for segments in ([Segment(i, i + 1, True) for i in range(n)],
                            [Segment(0, n, True)])]
  singles, whole = measure.median_seconds(steps, x, repeats=repeats)
  waiting = sum(c.forward_seconds for c in costs[:n - 1])
  return max(0.0, whole - singles) / waiting if waiting else 0.0
