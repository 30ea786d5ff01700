"""The layers of a chain with chosen rematerialization: `RematSequential` runs
Keras layers in order, each chosen segment rematerialized, optionally in one
op order (`_OpOrder`), and, when a planner's plan says so, segments chosen
for each input shape it is traced for; `ContextUnit` and `ContextSegment`
carry what a model's parts read besides the chain's activation (token ids,
masks). Their public names are `tfremat.chain`'s.
"""

import contextlib
import dataclasses
import os

import keras
import tensorflow as tf
from tensorflow.python.ops import control_flow_util

from tfremat import errors
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import in_place
from tfremat._src.keras_api import layers as layers_lib
from tfremat._src.keras_api import xla_variants
from tfremat._src.keras_api.segments import Segment
from tfremat._src.keras_api.segments import check_segments
from tfremat._src.core import watch
from tfremat._src.keras_api.layers import RematerializationLayer
from tfremat._src.keras_api.xla_variants import gradients as _gradients

__all__ = [
    "ContextUnit",
    "ContextSegment",
    "nest_target",
    "call_link",
    "RematSequential",
    "SOURCE_OPS",
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
        x = call_link(layer, x, context, training)
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


def call_link(layer, x, context, training):
  """One link of a chain on `x`, handed the context if it reads it (a
  ContextUnit, a ContextSegment, or either rematerialized)."""
  body = layer.layer if isinstance(layer, RematerializationLayer) else layer
  if context is not None and isinstance(
      body, (ContextUnit, ContextSegment, RematSequential)):
    return layer(x, context=context, training=training)
  return layer(x, training=training)


@keras.saving.register_keras_serializable(package="tfremat")
class RematSequential(keras.layers.Layer):
  """Runs a chain of layers, rematerializing the chosen segments.

  Made by `tfremat.remat_sequential`. Each rematerialized segment runs as a
  `RematerializationLayer` around its layers called in order; kept
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
      is saved and loaded. Where the plan chooses by the input's shape
      (`Plan.variants`), a call on an input of another shape runs the
      segments it predicts within its budget there (`Plan.segments_at`),
      with no new measurement: chosen as the step is traced where the
      shape is known, and, in a step traced with an unknown dimension (as
      Keras's `fit` traces a last partial batch, or a second sequence
      length), each time the step runs, by the shape it runs at: every
      variant is traced, and a `tf.switch_case` runs the chosen one. Where
      none fits, the call raises (at trace time, or as the step runs,
      before the chain does). Under XLA a step traced for any shape builds
      every variant and selects the chosen one's results by value, which
      XLA's compile for each concrete shape folds; where
      none fits, that compile fails (XLA drops assertions: the error names
      a tensor
      `tfremat_no_rematerialization_plan_is_predicted_to_fit_...`).
    policy: the save policy of rematerialized segments that name none.
    gated: each kept layer hands its input gradient on only after its
      weight gradients are computed, as a rematerialized segment does
      (it runs as a `RematerializationLayer` under
      `everything_saveable`: nothing is recomputed in a graph; an eager
      call recomputes it). Without, the executor's threads may run a
      kept layer's weight-gradient op after the input gradients of the
      layers below it, which holds its incoming gradient meanwhile, so
      a step's peak moves with thread timing (up to 1.7x on a chain of
      six small Dense layers) and with the number of inter-op threads.
      Chains the planner chose for a budget are gated, as it measured
      them (docs/design.md, "Budgets that hold"). In a step traced with an
      unknown dimension kept layers run ungated: there gating held
      activations longer (docs/design.md, "Every shape a step runs at").
    ordered: in a `tf.function` (not XLA, and not with one inter-op
      thread, whose executor keeps one order by itself), run the chain's
      forward and backward ops in the order they are built (`_ordered`), so
      that a step's peak varies less from call to call within a process. It
      costs step time, as independent ops no longer overlap
      (docs/design.md, "Budgets that hold").
      False (the default) lets the executor's threads overlap them. The
      planner orders a chain only where no unordered plan fits.
  """

  def __init__(self, layers, segments, plan=None, policy=None, ordered=False,
               gated=False, **kwargs):
    layers = layers_lib.keras_layers(layers, "RematSequential", chain=True)
    # Each policy parsed once (a name or a function becomes its value).
    segments = [s if isinstance(s, Segment) else Segment(*s)
                for s in segments]
    segments = [dataclasses.replace(s, policy=policies_lib.parsed(s.policy))
                for s in segments]
    check_segments(segments, len(layers))
    policy = (policies_lib.deserialize(policy) if isinstance(policy, dict)
              else policies_lib.parsed(policy))
    super().__init__(**kwargs)
    self.chain = layers
    self.segments = segments
    self.policy = policy
    self.ordered = bool(ordered)
    self.gated = bool(gated)
    if isinstance(plan, dict):
      # The planner registers its Plan with Keras (tfremat>Plan): this
      # layer reads it back without importing the planner, which builds on
      # it.
      plan = keras.saving.get_registered_object("tfremat>Plan").from_config(
          plan)
    self.plan = plan
    self.steps = self._steps_of(segments)
    # The steps of each segments run, gated or not; not tracked by Keras
    # (their layers are this chain's, already tracked in `steps`).
    self._made = _Steps({(tuple(segments), self.gated): self.steps})

  def _steps_of(self, segments, gated=None):
    """The layers that run `segments` of the chain, in order (kept layers
    gated as the chain is, or as `gated` says)."""
    gated = self.gated if gated is None else gated
    steps = []
    for seg in segments:
      part = self.chain[seg.start:seg.stop]
      if seg.nested:
        body = ContextSegment(part, nested=True,
                              policy=seg.policy or self.policy)
      else:
        # Not a keras.Sequential: built by its first call, a Sequential
        # would check each later call against that call's shape, and a
        # step first traced at a larger image than the sample's raised
        # where a unit inside had been built on the sample.
        body = ContextSegment(part)
      if seg.remat:
        steps.append(
            RematerializationLayer(body, policy=seg.policy or self.policy))
      elif gated:
        steps += [RematerializationLayer(
            l, policy="everything_saveable") for l in part]
      else:
        steps += part
    return steps

  def build(self, input_shape=None):
    del input_shape  # Each layer builds itself on its first call.
    self.built = True

  def segments_for(self, x):
    """The segments a call on `x` runs where its shape is known: the plan's
    for that shape (`Plan.segments_at`), where the plan chooses by shape,
    else `segments`. Raises the plan's error where none fits that shape."""
    if not getattr(self.plan, "chooses", False):
      return tuple(self.segments)
    shape = _static_shape(x)
    if shape is None or None in shape:
      return tuple(self.plan.segments)
    return tuple(self.plan.segments_at(shape))

  def call(self, x, context=None, training=None):
    """Runs the chain on `x`; `context` is the list of tensors its
    `ContextUnit`s read (see there), if it has any."""
    shape = _static_shape(x)
    if (getattr(self.plan, "chooses", False) and
        not tf.executing_eagerly() and isinstance(x, tf.Tensor) and
        shape is not None and None in shape[:self.plan.num_axes]):
      return self._chosen_as_it_runs(x, context, training)
    segments = self.segments_for(x)
    # Kept layers gated where the step is traced for known shapes; where a
    # dimension is unknown, as in a variant's branch (below), not.
    gated = self.gated and (shape is None or None not in shape or
                            tf.executing_eagerly())
    return self._run_segments(segments, gated, x, context, training)

  def _chosen_as_it_runs(self, x, context, training):
    """The chain in a graph traced for any size of some axis: each variant
    traced in a branch of a `tf.switch_case` on the plan's choice at the
    shape the step runs at (`Plan.choose_in_graph`), after its check.
    Kept layers run ungated there, as in any step traced for an unknown
    dimension: gated inside a branch, they held their activations until
    the branch's whole backward pass ended. Under XLA the variants are
    selected by value instead (`xla_variants.selected`), gated as planned."""
    xla = control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph())
    index, check = self.plan.choose_in_graph(tf.shape(x), xla)
    with tf.control_dependencies([check]):
      x = tf.identity(x)
    if len(self.plan.variants) == 1:  # A nested or ordered plan.
      return self._run_segments(self.plan.variants[0], xla and self.gated,
                                x, context, training)
    if xla:
      return xla_variants.selected(
          index, self.plan.variants, x, self.add_loss,
          lambda segments, x: self._run_segments(segments, self.gated, x,
                                                 context, training))

    def branch(segments):
      # Each branch reads the input in its own graph, where the saved
      # tensors of its rematerialized calls are found by what they read.
      return lambda: self._run_segments(segments, False, tf.identity(x),
                                        context, training)

    return tf.switch_case(index, [branch(v) for v in self.plan.variants])

  def _run_segments(self, segments, gated, x, context, training):
    steps = self._made.get((tuple(segments), gated),
                           lambda: self._steps_of(segments, gated))
    graph = None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()
    if (not self.ordered or graph is None or
        not (gated or any(s.remat for s in segments)) or
        control_flow_util.GraphOrParentsInXlaContext(graph) or
        _one_executor_thread()):
      # Eager ops, XLA's compiled steps and an executor with one inter-op
      # thread run in one order every time; a chain that rematerializes
      # nothing runs as the layers would.
      return self._run(steps, x, context, training)
    return self._ordered(steps, x, context, training)

  def _run(self, steps, x, context, training):
    for step in steps:
      x = call_link(step, x, context, training)
    return x

  def _ordered(self, steps, x, context, training):
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
        y = self._run(steps, x, context, training)

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
        "gated": self.gated,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    layers = [keras.saving.deserialize_keras_object(
        l, custom_objects=custom_objects) for l in config.pop("layers")]
    return cls(layers, **config)


class _Steps:
  """A chain's steps for each (segments, gated) it has run
  (`RematSequential`). A plain object: Keras tracks what a layer holds in
  lists and dicts, and these steps are made of the chain's own layers."""

  def __init__(self, made):
    self._made = dict(made)

  def get(self, key, make):
    if key not in self._made:
      self._made[key] = make()
    return self._made[key]


def _static_shape(x):
  """`x`'s static shape as a tuple (None for an unknown dimension), or None
  for an input of unknown rank or a nested input."""
  if not isinstance(x, (tf.Tensor, keras.KerasTensor)):
    return None
  try:
    return tuple(None if d is None else int(d) for d in tuple(x.shape))
  except ValueError:  # A shape of unknown rank.
    return None


def _one_executor_thread():
  """Whether TensorFlow's executor runs independent ops on one inter-op
  thread: as configured, or by default, which is the number of CPUs the
  process may run on (or `TF_NUM_INTEROP_THREADS`).

  Its order is then the same on every call, and the order `_ordered` imposes
  only costs memory: on the tests' 10-block MLP, a plan made with the default
  threads peaked at 24.2 MiB ordered and 19.8 MiB unordered in new processes
  with one inter-op thread, and at 19.4 MiB ordered with the default threads
  (docs/design.md, "Budgets that hold").
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


SOURCE_OPS = frozenset(["Placeholder", "Const"])


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
  `forward_ops.ForwardOps`) is left as it is.
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
        op.type in SOURCE_OPS or op.type in _UNORDERED_OPS or
        all(t.op.type in SOURCE_OPS for t in op.inputs) or
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
