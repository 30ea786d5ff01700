"""Chains of layers with chosen rematerialization, and measuring them.

  chain = tfremat.remat_sequential(blocks, segments="sqrt")
  chain = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)
  print(chain.plan)

`RematSequential` runs a chain of Keras layers, rematerializing the chosen
segments. `remat_sequential` chooses them: uniformly, or for a memory budget
by measuring the chain (`measure_chain`) and asking the planner
(`tfremat.planner`), whose choice `checked_plan` checks by measurement.
"""

import collections.abc
import contextlib
import dataclasses
import functools
import os

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfremat import errors
from tfremat import measure
from tfremat import planner
from tfremat import policies as policies_lib
from tfremat._src import in_place
from tfremat._src import layers as layers_lib
from tfremat._src import residuals
from tfremat._src import watch
from tfremat._src.layers import RematerializationLayer

__all__ = [
    "ContextUnit",
    "ContextSegment",
    "nest_target",
    "RematSequential",
    "remat_sequential",
    "planned_policies",
    "checked_plan",
    "retracing_quiet",
    "training_step",
    "measure_layer",
    "measure_peak",
    "measure_peaks",
    "structure_key",
    "measure_chain",
    "PLANNED_ORDER",
    "CHECK_CALLS",
    "WAITING_FRACTION",
    "WAITING_PROBE_LAYERS",
]


@keras.saving.register_keras_serializable(package="tfremat")
class ContextUnit(keras.layers.Layer):
  """A unit of a chain that also reads the chain's context.

  A chain passes one tensor from unit to unit; a transformer's blocks also
  read tensors that are live for the whole step anyway, such as a padding
  mask or token ids. These are the chain's context: `RematSequential` takes
  them as `context=` (a list) and hands them to each `ContextUnit`, which
  calls `unit([x, *context[i] for i in context_indices])`. Context tensors
  are never float: they have no gradient, and keeping them costs nothing
  that the model does not already hold.

  Called without context, as when the planner measures the unit on its own,
  it reads `sample_context` (not saved), the context of the sample batch.
  """

  def __init__(self, unit, context_indices, sample_context=None, **kwargs):
    super().__init__(**kwargs)
    self.unit = unit
    self.context_indices = [int(i) for i in context_indices]
    self.sample_context = sample_context

  def build(self, input_shape=None):
    del input_shape  # The unit is a built functional model.
    self.built = True

  def call(self, x, context=None, training=None):
    if context is None:
      context = self.sample_context
    if context is None:
      raise errors.InvalidArgumentError(
          f"{self.name} reads the chain's context (a padding mask, say): "
          "call the RematSequential holding it with context=[...].")
    return self.unit([x] + [context[i] for i in self.context_indices],
                     training=training)

  def get_config(self):
    return {**super().get_config(),
            "unit": keras.saving.serialize_keras_object(self.unit),
            "context_indices": self.context_indices}

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    unit = keras.saving.deserialize_keras_object(
        config.pop("unit"), custom_objects=custom_objects)
    return cls(unit, **config)


class ContextSegment(keras.layers.Layer):
  """A rematerialized segment's layers, run in order with the context.

  With `nested`, each layer's own layers (`nest_target`) are rematerialized
  while it runs, under `policy` (`tfremat.planner.Segment.nested`).
  """

  def __init__(self, layers, nested=False, policy=None, **kwargs):
    super().__init__(**kwargs)
    self.chain = list(layers)
    self.nested = nested
    self.policy = policy

  def build(self, input_shape=None):
    del input_shape
    self.built = True

  def call(self, x, context=None, training=None):
    nesting = (in_place.sublayers_rematerialized(
        [nest_target(l) for l in self.chain], self.policy)
               if self.nested else contextlib.nullcontext())
    with nesting:
      for layer in self.chain:
        x = _call_link(layer, x, context, training)
    return x


def nest_target(layer):
  """The layer whose own layers a nested segment rematerializes for `layer`:
  the layer itself, or for a `ContextUnit` or a model of one layer (a
  transformer layer as `tfremat.remat_model` cuts it out), that layer."""
  if isinstance(layer, ContextUnit):
    layer = layer.unit
  while isinstance(layer, keras.Model):
    inner = in_place.sublayers(layer)
    if len(inner) != 1:
      break
    layer = inner[0]
  return layer


def _call_link(layer, x, context, training):
  """One link of a chain on `x`, handed the context if it reads it (a
  ContextUnit, a ContextSegment, or either rematerialized)."""
  body = layer.layer if isinstance(layer, RematerializationLayer) else layer
  if context is not None and isinstance(body, (ContextUnit, ContextSegment)):
    return layer(x, context=context, training=training)
  return layer(x, training=training)


@keras.saving.register_keras_serializable(package="tfremat")
class RematSequential(keras.layers.Layer):
  """Runs a chain of layers, rematerializing the chosen segments.

  Made by `tfremat.remat_sequential`. Each rematerialized segment runs as a
  `RematerializationLayer` around a `keras.Sequential` of its layers; kept
  segments run their layers directly.

  Args:
    layers: the chain's Keras layers, each taking the previous one's output,
      or a `keras.Sequential` of them.
    segments: `(start, stop, remat)` triples covering the chain in order,
      or `(start, stop, remat, policy)` with a save policy (a built-in's
      name or a `tfremat.policies` value) for a rematerialized segment,
      or `(start, stop, True, policy, True)` (policy may be None) for a
      nested one: its
      layers' own layers are rematerialized inside its rerun
      (`tfremat.planner.Segment`).
    plan: the planner's `Plan` that chose the segments, if it did; kept in
      the layer's config, so `.plan` prints the same after a `.keras` file
      is saved and loaded.
    policy: the save policy of rematerialized segments that name none.
    ordered: in a `tf.function` (not XLA, and not with one inter-op
      thread, whose executor keeps one order by itself), run the chain's
      forward and backward ops in the order they are built (`_ordered`), so
      that a step's peak varies less from call to call within a process. It
      costs step time, as independent ops no longer overlap
      (docs/benchmarks.md, "Measurements behind the defaults").
      False (the default) lets the executor's threads overlap them. Chains
      the planner chose for a budget are ordered, as it measured them.
  """

  def __init__(self, layers, segments, plan=None, policy=None, ordered=False,
               **kwargs):
    layers = layers_lib.keras_layers(layers, "RematSequential", chain=True)
    segments = [s if isinstance(s, planner.Segment) else planner.Segment(*s)
                for s in segments]
    planner.check_segments(segments, len(layers))
    for seg in segments:
      if seg.policy is not None:
        policies_lib.get(seg.policy)
    if isinstance(policy, dict):
      policy = policies_lib.deserialize(policy)
    elif policy is not None:
      policies_lib.get(policy)
    super().__init__(**kwargs)
    self.chain = layers
    self.segments = segments
    self.policy = policy
    self.ordered = bool(ordered)
    if isinstance(plan, dict):
      plan = planner.Plan.from_config(plan)
    self.plan = plan
    self.steps = []
    for seg in segments:
      part = layers[seg.start:seg.stop]
      if seg.nested:
        body = ContextSegment(part, nested=True, policy=seg.policy or policy)
      elif any(isinstance(l, ContextUnit) for l in part):
        body = ContextSegment(part)
      else:
        body = keras.Sequential(part)
      self.steps += ([RematerializationLayer(body, policy=seg.policy or policy)]
                     if seg.remat else part)

  def build(self, input_shape=None):
    del input_shape  # Each layer builds itself on its first call.
    self.built = True

  def call(self, x, context=None, training=None):
    """Runs the chain on `x`; `context` is the list of tensors its
    `ContextUnit`s read (see there), if it has any."""
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if (not self.ordered or graph is None or
        not any(s.remat for s in self.segments) or
        control_flow_util.GraphOrParentsInXlaContext(graph) or
        _one_executor_thread()):
      # Eager ops, XLA's compiled steps and an executor with one inter-op
      # thread run in one order every time; a chain that rematerializes
      # nothing runs as the layers would.
      return self._run(x, context, training)
    return self._ordered(x, context, training)

  def _run(self, x, context, training):
    for step in self.steps:
      x = _call_link(step, x, context, training)
    return x

  def _ordered(self, x, context, training):
    """The chain in a graph, its forward and backward ops run in one order.

    The graph executor runs independent ops in whatever order its threads
    reach them, so a step's peak memory moves from call to call. Here every
    op of the chain's forward pass waits for the one built before it
    (`_OpOrder`), and so does every op of its backward pass, which is built
    here by `tf.gradients` (rematerialized segments' reruns included): one
    schedule for the large ops, the order in which the program builds them.
    Small ops stay free, and the allocator's reuse of free chunks depends on
    what the process did before, so the peak still moves, by less.
    """
    order = _OpOrder()

    @tf.custom_gradient
    def chain(x):
      with order:
        # The context is never float: it needs no gradient.
        y = self._run(x, context, training)

      def grad(dy, variables=None):
        variables = list(variables or [])
        if order.loops:
          # A while loop's gradient adds inputs to the forward loop op, which
          # chained backward ops would then wait on in a circle.
          grads = _gradients(y, [x] + variables, dy)
        else:
          with _OpOrder():
            grads = _gradients(y, [x] + variables, dy)
        return grads[0], grads[1:]

      return y, grad

    return chain(x)

  def compute_output_spec(self, x, context=None, training=None):
    # Called on symbolic inputs, each step makes its own symbolic call.
    return self.call(x, context=context, training=training)

  def get_config(self):
    return {
        **super().get_config(),
        "layers": [keras.saving.serialize_keras_object(l) for l in self.chain],
        "segments": [s.as_list() for s in self.segments],
        "plan": self.plan.get_config() if self.plan else None,
        "policy": policies_lib.serialize(self.policy),
        "ordered": self.ordered,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    layers = [keras.saving.deserialize_keras_object(
        l, custom_objects=custom_objects) for l in config.pop("layers")]
    return cls(layers, **config)


def _gradients(ys, xs, grad_ys):
  """`tf.gradients`, its ops placed as a tape's are: not colocated with the
  forward ops (TF2's `tf.gradients` colocates each, and each rerun's with
  its segment's custom-gradient op, at a cost in tracing and in the first
  call's placement on every planned chain)."""
  return tf.compat.v1.gradients(ys, xs, grad_ys,
                                colocate_gradients_with_ops=False)


def _one_executor_thread():
  """Whether TensorFlow's executor runs independent ops on one inter-op
  thread: as configured, or by default, which is the number of CPUs the
  process may run on (or `TF_NUM_INTEROP_THREADS`).

  Its order is then the same on every call, and the order `_ordered` imposes
  only costs memory: on the tests' 10-block MLP, a plan made with the default
  threads peaked at 24.2 MiB ordered and 19.8 MiB unordered in new processes
  with one inter-op thread, and at 19.4 MiB ordered with the default threads
  (docs/benchmarks.md, "With one inter-op thread").
  """
  threads = tf.config.threading.get_inter_op_parallelism_threads()
  if threads == 0:
    try:
      threads = int(os.environ.get("TF_NUM_INTEROP_THREADS", "0"))
    except ValueError:
      threads = 0
  if threads == 0:
    try:
      threads = len(os.sched_getaffinity(0))
    except AttributeError:  # Not on Linux.
      threads = os.cpu_count() or 0
  return threads == 1


_SOURCE_OPS = frozenset(["Placeholder", "Const"])
# Ops left out of the order. Grappler's arithmetic optimizer rewrites x**3
# (in the tanh approximation of gelu, which GPT-2's, BERT's and Gemma's
# layers use) into products, and fails where the power op waits on another
# op; TensorFlow then runs the whole step unoptimized, saying so only in its
# log ("Ignoring multi-device function optimization failure").
_UNORDERED_OPS = frozenset(["Pow"])
_LOOP_OPS = frozenset(["While", "StatelessWhile"])


# Ops whose outputs are smaller than this are left unordered: they move a
# peak by little, and ordering every small op cost more step time.
_MIN_ORDERED_BYTES = 64 * 2**10


def _static_bytes(outputs):
  """The bytes of `outputs` known from their static shapes; unknown dims
  count as large."""
  total = 0
  for t in outputs:
    if t.shape.rank is None or None in t.shape.as_list():
      return 2**62
    total += t.shape.num_elements() * max(1, t.dtype.size)
  return total


class _OpOrder(watch.Handler):
  """While open, each op added to the graph it was opened in waits for the
  op added before it, by a control edge: the graph executor then runs them
  in the order they were built, whatever its threads do.

  Constants, placeholders, ops reading only those (variable reads, seeds'
  shapes) and ops with outputs under 64 KiB are left free: they hold no
  activation worth ordering. An op a callback hands over that is older than
  the last one chained (a variable read the forward pass shares,
  `state.ForwardOps`) is left as it is.
  """

  def __init__(self):
    self.graph = None
    self.last = None
    self.first_id = 0
    self.loops = False

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    del inputs, op_name
    if op_type in _LOOP_OPS:
      self.loops = True
    if graph is not self.graph or not outputs:
      return outputs
    # pylint: disable=protected-access
    op = outputs[0].op
    newest = self.last._id if self.last is not None else self.first_id
    if (op.graph is not graph or op._id <= newest or
        op.type in _SOURCE_OPS or op.type in _UNORDERED_OPS or
        all(t.op.type in _SOURCE_OPS for t in op.inputs) or
        _static_bytes(outputs) < _MIN_ORDERED_BYTES):
      return outputs
    if self.last is not None:
      op._add_control_input(self.last)
    self.last = op
    return outputs

  def __enter__(self):
    self.graph = tf.compat.v1.get_default_graph()
    self.first_id = watch.last_op_id(self.graph)
    self.last = None
    return super().__enter__()


def remat_sequential(layers, segments=None, budget=None, sample_input=None,
                     verbose=1, policy=None, policies=policies_lib.PLANNED):
  """A Keras layer running `layers` in order, with chosen rematerialization.

  Either uniform segments:

    chain = tfremat.remat_sequential(blocks, segments="sqrt")

  or the planner's choice for a memory budget, measured on a sample batch:

    chain = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)
    print(chain.plan)

  Args:
    layers: Keras layers, each taking the previous one's output, or a
      `keras.Sequential` of them.
    segments: an int, or "sqrt" for about sqrt(len(layers)) equal segments,
      every one rematerialized (Chen et al. 2016).
    budget: instead of `segments`, a budget for a training step's peak
      memory (`tfremat.measure.peak_bytes`): bytes as an int or a string
      with a unit ("200MiB"), or a fraction of the measured peak of keeping
      everything, as a float in (0, 1] or a percentage ("50%"). The chain is
      measured on `sample_input`, and the planner picks the fastest choice
      that fits, checked by measurement (`checked_plan`); when nothing else
      fits, that may be layers rematerialized with their own layers nested
      inside their reruns. Every variable of `layers` is left as it was.
    sample_input: a batch like the ones the chain will train on.
    verbose: 1 shows a progress bar while the chain is measured; 0 shows
      nothing.
    policy: with `segments`, the save policy (`tfremat.policies`) every
      rematerialized segment runs under.
    policies: with `budget`, the save policies the planner may choose for
      each rematerialized segment, besides recomputing everything: built-in
      names or `tfremat.policies` values, your own included (default:
      `tfremat.policies.PLANNED`; () for none). Each is measured on every
      layer.

  Returns:
    A `RematSequential` layer; `.plan` holds the planner's Plan when a budget
    was given (also after saving and loading), else None.

  Raises:
    ValueError, TypeError: bad arguments, before anything is measured.
    tfremat.errors.BudgetUnreachableError (a ValueError): no plan fits the
      budget; its `lowest_fraction` is the lowest bound measured, as a
      fraction of keeping everything's peak (`checked_plan`).
  """
  if (segments is None) == (budget is None):
    raise errors.InvalidArgumentError(
        "remat_sequential: give either segments (an int or \"sqrt\") or "
        "budget with sample_input, not both or neither.")
  layers = layers_lib.keras_layers(layers, "remat_sequential", chain=True)
  if segments is not None:
    return RematSequential(layers,
                           planner.uniform_segments(len(layers), segments),
                           policy=policy)
  budget, policies = planning_arguments("remat_sequential", budget,
                                        sample_input, policies, policy)
  chosen = checked_plan(layers, budget, sample_input, verbose=verbose,
                        policies=policies)
  return RematSequential(layers, segments_with(chosen.segments, policies),
                         plan=chosen,
                         ordered=chosen.ordered)


def planning_arguments(caller, budget, sample_input, policies, policy=None):
  """`(Budget, policies)` for planning, checked before anything is measured
  (`remat_sequential`, `remat_model`, the builder's `_RematerializeSeq`);
  TypeError/ValueError naming the fix."""
  if policy is not None:
    raise errors.InvalidArgumentError(
        f"{caller}: with a budget the planner chooses each segment's "
        "policy; name the ones it may choose with policies=[...], or give "
        "segments= to use one policy everywhere.")
  policies = planned_policies(policies)
  budget = planner.Budget.parse(budget)
  if sample_input is None:
    raise errors.InvalidArgumentError(
        f"{caller}: budget needs sample_input, a batch like those it will "
        "train on, to measure on.")
  return budget, policies


def planned_policies(policies):
  """`policies` as a tuple, each a built-in's name or a policy value
  (`tfremat.policies`), with distinct names (`tfremat.policies.name_of`,
  the key of a layer's costs under it); TypeError/ValueError."""
  if isinstance(policies, str) or callable(policies):
    policies = (policies,)
  policies = tuple(policies)
  bad = [p for p in policies if
         (isinstance(p, str) and p not in policies_lib.BUILT_IN) or
         not (isinstance(p, str) or callable(p)) or policies_lib.is_nothing(p)]
  if bad:
    raise errors.InvalidArgumentError(
        f"The planner chooses among save policies; got {bad!r}. Choose "
        f"from the built-ins' names or tfremat.policies values (your own "
        f"included) other than nothing_saveable (default: "
        f"{list(policies_lib.PLANNED)}); recomputing everything is always "
        "among the choices.")
  names = [policies_lib.name_of(p) for p in policies]
  if len(set(names)) < len(names):
    raise errors.InvalidArgumentError(
        f"The planner's policies need distinct names; got {names}.")
  return policies


def segments_with(segments, policies):
  """`segments` (a Plan's, whose policies are names: the keys of the
  layers' costs) with each name replaced by the policy in `policies` it
  names, so that a user's policy runs as itself."""
  by_name = {policies_lib.name_of(p): p for p in policies}
  return [dataclasses.replace(s, policy=by_name.get(s.policy, s.policy))
          for s in segments]


def checked_plan(layers, budget, sample_input, rounds=4, costs=None,
                 verbose=0, policies=()):
  """The planner's plan for `layers`, checked by measuring training steps on
  `sample_input` (`planner.calibrated_plan`).

  Args:
    layers: the chain: Keras layers or a `keras.Sequential`.
    budget: the budget for a training step's peak, in any form
      `planner.Budget.parse` reads (bytes, "200MiB", 0.5, "50%"); a fraction
      is of the measured peak of keeping everything.
    sample_input: the batch to measure on (in a `tf.distribute` strategy's
      scope, one replica's: every replica steps on all of it).
    rounds: how many plans to measure at most.
    costs: `measure_chain(layers, sample_input)`, if already known.
    verbose: 1 shows a progress bar over the measurements.
    policies: save policies (names or values) the planner may choose for a
      rematerialized segment (measured on each layer unless `costs` is
      given).

  Keeping everything is measured first, before any layer: a budget below
  the weight gradients its step returns plus the allocator margin is
  refused then (`planner.gradients_floor_error`).

  Layers whose own layers are worth rematerializing one at a time inside
  their reruns (`nest_target`: a transformer layer's attention and
  feed-forward layers) may be nested in the lowest plan, measured before a
  budget is refused (`planner.calibrated_plan`, step 5).

  Every variable of `layers` is left as it was: measuring runs training
  steps, which move BatchNormalization statistics and advance dropout seed
  generators, so their values are put back afterwards.

  Raises:
    ValueError: no plan measured fits the budget, or the weight gradients
      put it out of reach: a `tfremat.errors.BudgetUnreachableError`, whose
      message gives the lowest bound and what holds it up, and whose
      `lowest_fraction` is that bound as a fraction of keeping
      everything's peak.
  """
  layers = layers_lib.keras_layers(layers, "checked_plan", chain=True)
  budget = planner.Budget.parse(budget)
  # Each layer, keeping everything, the rounds' plans and, before refusing,
  # the lowest plan (the bar is filled at the end when that is not needed).
  steps = (len(layers) if costs is None else 0) + 1 + rounds + 1
  progress = measure.progress_bar(steps, "measurement", verbose)

  def measured_peak(segments, ordered=PLANNED_ORDER, **kwargs):
    peaks = measure_peaks(RematSequential(
        layers, segments_with(segments, policies), ordered=ordered),
                          sample_input, calls=CHECK_CALLS, **kwargs)
    if progress is not None:
      progress.add(1)
    return peaks

  keep, gradients = planner.keep_all(len(layers)), []
  if costs is None:
    costs = _CostsOnDemand(len(layers), lambda: measure_chain(
        layers, sample_input, progress=progress, policies=policies))
  with _variables_restored(layers, sample_input), retracing_quiet():
    # Keeping everything first, with its weight gradients' bytes: a budget
    # below them is refused before any layer is measured.
    keep_peaks = measured_peak(keep, gradients=gradients)
    chosen = planner.calibrated_plan(
        costs, budget,
        lambda s: keep_peaks if s == keep else measured_peak(s), rounds,
        nestable=[in_place.can_nest(nest_target(l)) for l in layers],
        gradient_bytes=sum(gradients),
        measured_ordered=lambda s: measured_peak(s, ordered=True))
  if progress is not None:
    progress.update(progress.target, finalize=True)
  return chosen


class _CostsOnDemand(collections.abc.Sequence):
  """A chain's LayerCosts, measured when first read (`checked_plan`)."""

  def __init__(self, num_layers, measure_them):
    self._num_layers = num_layers
    self._measured = functools.cache(measure_them)

  def __len__(self):
    return self._num_layers

  def __getitem__(self, index):
    return self._measured()[index]


@contextlib.contextmanager
def retracing_quiet():
  """Silences TensorFlow's retracing warnings while the block runs.

  Planning traces a new training step for every layer, policy and plan it
  measures, on purpose; TensorFlow's warning about frequent retracing ("5
  out of the last 17 calls ... triggered tf.function retracing") would only
  mislead. Other warnings and errors still show.
  """
  logger = tf.get_logger()

  def not_retracing(record):
    return "triggered tf.function retracing" not in record.getMessage()

  logger.addFilter(not_retracing)
  try:
    yield
  finally:
    logger.removeFilter(not_retracing)


def _variables_restored(layers, sample_input):
  """`measure.restoring` every variable of `layers`. Unbuilt layers are
  built first by an inference call, which changes no state, so that their
  variables exist to be restored."""
  x = sample_input
  for layer in layers:
    x = layer(x)
  del x  # Held through the measurements, it would shift their peaks.
  return measure.restoring([v for layer in layers for v in layer.variables])


def _nbytes(tree):
  # Keras variables name their dtype with a string.
  return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size
             for t in tf.nest.flatten(tree) if t is not None)


def _extra_peak_bytes(more, less, x):
  """How far `more(x)`'s peak exceeds `less(x)`'s.

  The median, over `measure.PEAK_CALLS` pairs of calls, of the difference
  of the two calls' peaks: a difference of two maxima over calls is far
  noisier (docs/benchmarks.md, "Measurements behind the defaults").
  """
  more(x)  # Trace outside the measurement.
  less(x)
  return int(np.median([
      measure.peak_bytes(more, x, calls=1, warmup=False) -
      measure.peak_bytes(less, x, calls=1, warmup=False)
      for _ in range(measure.PEAK_CALLS)]))


def training_step(layer, applications=1, jit=False, traced=None):
  """A traced training step of a chain: forward and backward of `layer`
  (applied `applications` times in a row) on a batch, for the loss
  sum(y**2) / 2 summed over its outputs y; returns the input and weight
  gradients (None for an integer input).

  The loss must read y: with an incoming gradient that depends only on y's
  shape (such as ones), TensorFlow prunes the forward ops whose values the
  backward pass does not read, so a rematerialized last segment's forward
  pass would cost nothing and every timing and peak would be too low.

  `traced`, a dict if given, gets on tracing where the step's forward and
  backward ops are in its graph, for `_saved_bytes`.
  """

  def step(x):
    graph = tf.compat.v1.get_default_graph()
    first = watch.last_op_id(graph)
    with tf.GradientTape() as tape:
      tape.watch([t for t in tf.nest.flatten(x) if t.dtype.is_floating])
      y = x
      for _ in range(applications):
        y = layer(y, training=True)
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

  return measure.replicated(step, jit_compile=jit)


# Ops whose outputs a step holds whether or not anything is rematerialized
# (variables' reads, constants, captured tensors), or that hold no
# activation (shapes).
_HELD_ANYWAY_OPS = _SOURCE_OPS | frozenset(["ReadVariableOp", "VarHandleOp",
                                           "Shape", "ShapeN", "Size", "Rank"])


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


def measure_layer(layer, x, repeats=5, policies=()):
  """Measures `layer` on input `x`; returns (LayerCost, its output).

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
  by `tfremat.policies.name_of`), what the layer keeps when
  rematerialized under it is read from one traced forward pass (as
  `tfremat.saved_residuals` lists it), and what rematerializing it costs is
  the measured time of its training step so rematerialized, less that of
  the plain step. Policies that keep the same tensors of this layer (on a
  layer without softmax, `masks_saveable` and `masks_and_softmax_saveable`)
  are timed once and share the measurement, so noise cannot rank equals; one
  that keeps nothing of it runs a full recompute and costs the forward time.
  """

  forward = measure.replicated(lambda x: layer(x, training=True))
  y = forward(x)
  out, inp = _nbytes(y), _nbytes(x)
  grads = _nbytes(layer.trainable_weights)
  traced = {}
  once = training_step(layer, traced=traced)
  peak_once = measure.peak_bytes(once, x)
  saved = _saved_bytes(traced)
  if saved is None and y.shape == x.shape and y.dtype == x.dtype:
    # The second application's weight gradients add to the first's in place.
    saved = _extra_peak_bytes(training_step(layer, 2), once, x) - out
  elif saved is None:
    before = measure.current_bytes()
    with tf.GradientTape() as tape:
      tape.watch(x)
      held = layer(x, training=True)
      saved = measure.current_bytes() - before - out
    del tape, held
  saved = max(0, saved)
  fwd_peak = measure.peak_bytes(forward, x)
  # Keyed by name (`tfremat.policies.name_of`): a Plan's segments name
  # their policies, and its config is JSON.
  by_name = {policies_lib.name_of(p): p for p in policies}
  kept, keeps, first_alike, empty = {}, {}, {}, set()
  for p, found in zip(by_name, residuals.policy_residuals(
      lambda h: layer(h, training=True), x, among=by_name.values())):
    kept[p] = found.total_bytes
    keeps[p] = _kinds_kept(found)
    alike = tuple((r.what.split()[0], r.shape, r.dtype) for r in found)
    first_alike[p] = first_alike.setdefault(alike, p)
    if not found:
      # Keeping nothing of this layer, it runs a full recompute's program:
      # it costs what that costs (the forward time), untimed.
      empty.add(p)
  timed = [p for p in by_name if first_alike[p] == p and p not in empty]
  policy_steps = [training_step(RematerializationLayer(
      layer, policy=by_name[p])) for p in timed]
  fwd_s, both_s, *policy_s = measure.median_seconds(
      [forward, once] + policy_steps, x, repeats=repeats)
  seconds = dict(zip(timed, policy_s))
  policy_costs = {
      p: ([0, fwd_s] if p in empty else
          [kept[p], max(0.0, seconds[first_alike[p]] - both_s)])
      for p in by_name}
  cost = planner.LayerCost(
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
  return cost, y


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


# Planned chains run unordered, as they are measured: ordering every large op
# made a step's peak repeatable within a process, but cost 5-25% of the
# step time on the benchmark's chains, while the bound each plan is held to
# (its largest peak, the spread of its calls, the allocator margin) covers
# what an unordered step's peak moves by (docs/design.md, "Budgets that
# hold"). A budget that no unordered plan meets is tried ordered before it
# is refused (`checked_plan`).
PLANNED_ORDER = False

# A plan's measured bound (`planner.Measured`) comes from this many calls of
# its step: their spread is part of the bound, and what moves between
# processes is covered by the bound's allocator margin, not by more calls.
CHECK_CALLS = measure.PEAK_CALLS


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


# What a layer's recompute costs beyond its forward time when it is not the
# last layer of a rematerialized segment (`LayerCost.waiting_recompute_seconds`),
# as a fraction of its forward time. A model's constant by default: timing
# it on each chain took about as long as measuring a layer, and repeated
# timings of one chain moved by more than the effect itself, so the plan
# changed from run to run (docs/benchmarks.md, "Measurements behind the
# defaults"). `measure_chain(..., measure_waiting=True)` times it instead.
WAITING_FRACTION = 0.2

# With `measure_waiting=True`, the waiting cost is timed on at most this many
# of the chain's first layers (`measure_chain`).
WAITING_PROBE_LAYERS = 4


def measure_chain(layers, sample_input, repeats=5, progress=None,
                  policies=(), measure_waiting=False):
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
  `WAITING_FRACTION` of its forward time; with `measure_waiting`, the
  chain's first `WAITING_PROBE_LAYERS` layers are instead timed both ways,
  `repeats` times round-robin, and the difference, as a fraction of the
  forward time of the layers that waited, is spread over every layer in
  proportion to its forward time.

  `progress`, a Keras Progbar if given, advances by one per layer (and one
  for the timing of waiting recomputes). `policies` are the save policies
  (names or values) to measure each layer under (`measure_layer`).
  """
  advance = progress.add if progress is not None else lambda _: None
  costs, x, measured = [], tf.convert_to_tensor(sample_input), {}
  for layer in layers:
    key = structure_key(layer, x, policies)
    if key is not None and key in measured:
      cost = dataclasses.replace(measured[key], name=layer.name)
      x = layer(x, training=False)  # The next layer's input, as an input.
    else:
      cost, x = measure_layer(layer, x, repeats, policies)
      if key is not None:
        measured[key] = cost
    costs.append(cost)
    advance(1)
  ratio = WAITING_FRACTION
  if measure_waiting and len(costs) > 1:
    ratio = _waiting_ratio(layers, sample_input, costs, repeats)
    advance(1)
  return [dataclasses.replace(
      c, waiting_recompute_seconds=ratio * c.forward_seconds) for c in costs]


def _waiting_ratio(layers, sample_input, costs, repeats):
  """The chain's measured waiting cost as a fraction of forward time."""
  n = min(len(layers), WAITING_PROBE_LAYERS)
  probe, x = layers[:n], tf.convert_to_tensor(sample_input)
  steps = [training_step(RematSequential(probe, segments,
                                         ordered=PLANNED_ORDER))
           for segments in ([planner.Segment(i, i + 1, True)
                             for i in range(n)],
                            [planner.Segment(0, n, True)])]
  singles, whole = measure.median_seconds(steps, x, repeats=repeats)
  waiting = sum(c.forward_seconds for c in costs[:n - 1])
  return max(0.0, whole - singles) / waiting if waiting else 0.0
