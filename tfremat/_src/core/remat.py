"""RematerializeFn: recompute a function's activations in the backward pass.

Example:

  import tensorflow as tf, keras, tfremat

  block = keras.Sequential([keras.layers.Dense(512, activation="relu"),
                            keras.layers.Dropout(0.1),
                            keras.layers.Dense(512)])

  @tf.function(jit_compile=True)
  def step(x):
    with tf.GradientTape() as tape:
      y = tfremat.RematerializeFn(lambda h: block(h, training=True), x)
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, [x] + block.trainable_weights)

The forward pass keeps only what `fn` reads; the backward pass reruns `fn` as
the forward pass ran it and differentiates the rerun, so the gradients equal
those without rematerialization. "As the forward pass ran it" means:

- in the same mode: an eager forward pass is rerun eagerly under a
  `tf.GradientTape` (no tracing, so `.numpy()` and Python control flow on
  tensor values work); a traced one is rerun in the same graph, as in
  Lingvo, under a gradient tape that records only the rerun (or, where it
  reads raw `tf.Variable`s, differentiated with `tf.gradients`);
- in the same context: the Keras call context (`training` inherited from an
  enclosing layer call), the autocast dtype of mixed precision, and AutoGraph
  conversion are those of the forward pass;
- from the same state: step seeds, the global step and every Keras variable
  the forward pass touched are replayed at their forward-time values, and raw
  `tf.Variable`s are read at their forward-time values in graphs (in eager
  mode, a changed one raises);
- with the same inputs: tensors the function captured by closure (not passed
  as arguments) are found while the forward pass runs and differentiated like
  the arguments.

Each input, closure capture and variable gets its partial derivative: the
gradient computation outside the call adds the paths between them
(docs/design.md, invariant 8).
"""

import collections
import contextlib
import copy
import dataclasses
import functools
import threading

import tensorflow as tf
from keras.src.backend.common import global_state
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python.eager import record
from tensorflow.python.ops import control_flow_util

from tfremat import errors
from tfremat._src.core import policies
from tfremat._src.core import forward_ops
from tfremat._src.core import rerun
from tfremat._src.core import selective
from tfremat._src.core import sources
from tfremat._src.core import keras_state
from tfremat._src.core import step_seed

__all__ = [
    "RematerializeFn",
    "rematerialize",
    "RerunMismatchError",
    "rematerialize_with_losses",
    "debug_reruns",
    "DETERMINISM_CHECKS",
]

DETERMINISM_CHECKS = ("default", "values", "none")

# AutoGraph converts the source of every function a converted function calls,
# unless its module is listed as TensorFlow's and Keras's are. Converting
# tfremat's own code would cost trace time and change nothing: it decides
# what to convert itself (`_ForwardContext.convert`), so it is listed too.
autograph_config.CONVERSION_RULES = (
    (autograph_config.DoNotConvert("tfremat"),) +
    autograph_config.CONVERSION_RULES)


# Lists that every rematerialized call made while one is open is appended to
# (`saved_residuals` reads what a traced call kept): `observed_calls`.
_observers = []


@contextlib.contextmanager
def observed_calls():
  """While open, every rematerialized call made appends its forward pass's
  record (`_Forward`) to the list this yields, an outer call before the
  calls nested in it: what `saved_residuals` reads a traced call's kept
  tensors from."""
  calls = []
  _observers.append(calls)
  try:
    yield calls
  finally:
    _observers.remove(calls)


RerunMismatchError = errors.RerunMismatchError


_debug_state = threading.local()


def _debugging():
  return getattr(_debug_state, "on", False)


@contextlib.contextmanager
def debug_reruns(enabled=True):
  """Calls made inside get `debug=enabled` unless they set it themselves.

  For models whose rematerialized calls you do not make yourself
  (`RematerializationLayer`, `remat_model`, `remat_sequential`): trace or
  run the training step inside it, and a `RerunMismatchError` shows both
  passes' whole op sequences with the line of code behind each op. It holds
  for the thread it is entered in.
  """
  saved = _debugging()
  _debug_state.on = bool(enabled)
  try:
    yield
  finally:
    _debug_state.on = saved


class _ForwardContext:
  """The Python-side context a forward pass ran in, to rerun it there."""

  def __init__(self):
    call_context = global_state.get_global_attribute("current_call_ctx")
    # A copy: the entry layer changes its context object as the call goes on.
    self._call_context = copy.copy(call_context)
    self._autocast = global_state.get_global_attribute("autocast_scope")
    self._autograph = ag_ctx.control_status_ctx()
    self._saved = None  # The attributes replaced while it is entered.

  def convert(self, fn):
    """`fn` with the forward pass's AutoGraph conversion, for both passes.

    Converted only where the caller's own code is (inside a tf.function
    with AutoGraph on), as a plain call of `fn` there would be.
    """
    if self._autograph.status != ag_ctx.Status.ENABLED:
      return fn
    return autograph.tf_convert(fn, self._autograph)

  _ATTRIBUTES = ("current_call_ctx", "autocast_scope")

  def __enter__(self):
    self._saved = [global_state.get_global_attribute(name)
                   for name in self._ATTRIBUTES]
    self._set((self._call_context, self._autocast))

  def __exit__(self, *args):
    self._set(self._saved)

  def _set(self, values):
    for name, value in zip(self._ATTRIBUTES, values):
      global_state.set_global_attribute(name, value)


def _mark_connected(y, index, connected):
  """`y`, noting in `connected` when a gradient computation reaches it.

  For an output the loss does not use, gradient tapes and `tf.gradients`
  pass zeros rather than None. Differentiating the rerun against those zeros
  would give a zero gradient, where the plain computation gives None, to
  variables only that output uses (and an optimizer treats the two
  differently: Adam moves a weight on a zero gradient). A gradient
  computation calls this identity's gradient only when the output is used,
  and always before the rematerialized call's own gradient.
  """

  @tf.custom_gradient
  def mark(t):

    def grad(dy):
      connected.add(index)
      return dy

    return tf.identity(t), grad

  return mark(y)


def RematerializeFn(fn, *xs, determinism_check="default", policy=None,
                    debug=None):
  """Returns `fn(*xs)`, recomputing its activations in the backward pass.

  Args:
    fn: a callable. It may call Keras layers, read variables and tensors it
      captures, and use Python control flow; gradients flow to every input,
      captured tensor and variable it reads, as without rematerialization.
      Its random numbers must come from seeds (Keras random layers and
      `keras.random` ops with a `SeedGenerator`, `GenerateStepSeedPair`,
      `DeterministicDropout`); a stateful random op raises
      `UnreplayableOpError`. Keras variable updates (BatchNormalization
      statistics, seed generators) are applied once.
    *xs: the arguments of `fn`: tensors, variables, other Python values, or
      nested tuples/lists/dicts of them. Floating point tensors and
      variables are differentiated; everything else is passed to `fn` as it
      is.
    determinism_check: how the rerun is checked against the forward pass.
      "default" raises `RerunMismatchError` when the rerun returns a
      different structure, dtype or shape, or runs other ops (compared by
      type, in order, constants, identities, casts and variable reads left
      out); "values" also compares the values
      (it keeps the outputs for the backward pass, so it costs memory; not
      under XLA); "none" checks nothing.
    policy: what to keep from the forward pass instead of recomputing it: a
      function from `tfremat.policies` (e.g. `policies.dots_saveable`), a
      built-in policy's name ("dots_saveable"), or your own function of a
      `tfremat.policies.Op`. None keeps nothing but the inputs (or follows
      an enclosing `tfremat.policies.scope`). Policies act
      in graphs (`tf.function`, XLA); an eager call recomputes everything.
    debug: when the rerun runs other ops than the forward pass, show both
      passes' whole op sequences in the `RerunMismatchError`, each op with
      its name and the line of your code that made it, instead of the few
      ops around the first difference. It costs a stack walk per op while
      the forward pass and the rerun are run or traced. None follows
      `tfremat.debug_reruns()`.

  Returns:
    What `fn(*xs)` returns.
  """
  if not callable(fn):
    raise errors.InvalidTypeError(
        f"RematerializeFn expects a callable as its first argument, got "
        f"{type(fn).__name__}. Usage: RematerializeFn(fn, *inputs).")
  # The default on_losses refuses losses, so none come back here.
  outputs, _ = rematerialize_with_losses(
      fn, xs, determinism_check=determinism_check, policy=policy, debug=debug)
  return outputs


def _refuse_losses(losses):
  raise errors.UnreplayableOpError(
      f"The rematerialized function added {len(losses)} loss(es) with "
      "add_loss (e.g. an activity_regularizer). RematerializeFn returns only "
      "what the function returns and cannot hand them back to the layer that "
      "added them: wrap the layer with tfremat.RematerializationLayer, which "
      "does, or compute the loss outside the rematerialized function.")


def rematerialize_with_losses(fn, xs, on_losses=_refuse_losses,
                              determinism_check="default", policy=None,
                              debug=None):
  """`RematerializeFn(fn, *xs)` that also returns the losses `fn` added.

  Returns `(outputs, losses)`, where `losses` pairs each loss tensor that `fn`
  passed to `add_loss` in the forward pass with its differentiable
  counterpart: add the latter to the training loss so that its gradient
  reaches the variables. `on_losses(original_losses)` is called before any
  variable update is applied and may raise to refuse them. `policy` is
  `RematerializeFn`'s; None takes the innermost `policies.scope`'s.
  """
  policy = policies.get(policy if policy is not None else policies.current())
  if determinism_check not in DETERMINISM_CHECKS:
    raise errors.InvalidArgumentError(
        f"determinism_check must be one of {DETERMINISM_CHECKS}, got "
        f"{determinism_check!r}.")
  if _in_keras_symbolic_call():
    # Keras builds a layer by calling it on placeholders in a scratch graph
    # (`compute_output_spec`) where variables have no values yet and no
    # gradient is ever taken: only the output's shape is wanted.
    return fn(*xs), []
  if _under_xla():
    _refuse_under_xla(xs, determinism_check)
  debug = _debugging() if debug is None else bool(debug)
  return _forward(fn, xs, determinism_check, policy, on_losses, debug)


def _under_xla():
  return (not tf.executing_eagerly() and
          control_flow_util.GraphOrParentsInXlaContext(
              tf.compat.v1.get_default_graph()))


def _refuse_under_xla(xs, determinism_check):
  """Raises where XLA (jit_compile) cannot compile the call."""
  if determinism_check == "values":
    raise errors.InvalidArgumentError(
        "determinism_check='values' cannot run under XLA (jit_compile), which "
        "drops assertions. Check values with the same step run eagerly or in "
        "a tf.function without jit_compile.")
  for x in tf.nest.flatten(xs):
    if isinstance(x, (tf.RaggedTensor, tf.SparseTensor)):
      raise errors.UnsupportedError(
          f"RematerializeFn got a {type(x).__name__} argument under XLA "
          "(jit_compile=True), which cannot compile ragged and sparse "
          "tensors' ops, with or without rematerialization. Run the step in "
          "a tf.function without jit_compile, or pass a dense tensor "
          "(`.to_tensor()`, `tf.sparse.to_dense`).")


def _in_keras_symbolic_call():
  """Whether Keras is calling a layer symbolically, to build it or to find
  its output spec (Keras 3's `SymbolicScope`)."""
  try:
    from keras.src.backend.common import symbolic_scope  # pylint: disable=g-import-not-at-top
  except ImportError:  # A Keras without it calls layers on real tensors.
    return False
  return symbolic_scope.in_symbolic_scope()


def _announce():
  """Reserves the next slot in every open observer list (`_observers`), so
  that an outer call is listed before the calls nested in it; returns a
  function that fills the slots with the call's `_Forward`."""
  slots = []
  for observer in _observers:
    slots.append((observer, len(observer)))
    observer.append(None)

  def fill(forward):
    for observer, index in slots:
      observer[index] = forward

  return fill


@dataclasses.dataclass(frozen=True, eq=False)
class _Forward:
  """What one rematerialized call's forward pass leaves for its backward pass.

  Built once the forward pass has run and never changed: the backward pass
  reads only this record (docs/design.md, "The rerun is the forward pass's
  own program").
  """

  fn: object  # As both passes call it (invariant 4, AutoGraph).
  context: _ForwardContext  # Invariants 2 and 3.
  xs: object  # The arguments' structure; their leaves are `leaves`.
  leaves: tuple
  eager: bool  # Invariant 1: the backward pass runs in the same mode.
  determinism_check: str
  seed: object  # Step seed and global step, replayed (invariant 5).
  global_step: object
  # A tape the function opens itself differentiates variables in the forward
  # pass and replayed values in the rerun, which build different gradient
  # ops: the op types are not compared then (invariant 9).
  inner_tape: bool
  op_types: tuple
  op_details: object  # Under debug, each counted op described; else None.
  # The outputs' structure alone: holding the outputs would keep them alive
  # until the backward pass.
  structure: object
  attached: tuple  # Positions of the differentiable outputs.
  specs: tuple  # Their (dtype, shape).
  losses: tuple  # What `fn` passed to add_loss.
  forward_values: object  # The attached outputs under "values", else None.
  sources: tuple  # `_Source`s: what the gradient is computed for.
  keras_variables: tuple  # Replayed at `keras_values` (invariant 5).
  keras_values: tuple
  saver: object  # What a policy kept (`selective.ForwardSaver`), or None.

  def call(self, leaves):
    return _apply(self.fn, self.xs, leaves)


def _apply(fn, xs, leaves):
  """`fn` called on `leaves` (composite arguments' components included)
  packed as the arguments `xs` are."""
  return fn(*tf.nest.pack_sequence_as(xs, leaves, expand_composites=True))


class _ForwardRun(collections.namedtuple(
    "_ForwardRun", "outputs recorded ops watched saver")):
  """The results of running a function's forward pass (`_run_forward`)."""


def _forward(fn, xs, determinism_check, policy, on_losses, debug):
  """Runs a rematerialized call's forward pass and attaches its rerun."""
  fill = _announce()
  context = _ForwardContext()
  fn = context.convert(fn)
  eager = tf.executing_eagerly()
  # A composite argument (a tf.RaggedTensor, tf.SparseTensor, ...) is its
  # component tensors: each is an input, differentiated and gated like a
  # tensor argument. As a closure, an eager one that a tf.function inlines
  # as a constant would be cut from the tape watching it (invariant 7).
  leaves = tuple(tf.nest.flatten(xs, expand_composites=True))
  if not eager:
    # An eager tensor passed in a graph is the graph's capture of it, as
    # every op that reads it sees it: one source, not an input and a closure
    # that are the same tensor (invariant 7).
    leaves = tuple(sources.in_current_graph(x) for x in leaves)
  # Eager ops run as they are called: nothing could be skipped.
  policy = None if eager or policies.is_nothing(policy) else policy
  seed = step_seed.GetStepSeed()
  # None: no global step; the rerun then sees none either.
  global_step = (step_seed.GetGlobalStep()
                 if step_seed.HasGlobalStep() else None)
  run = _run_forward(functools.partial(_apply, fn, xs), context, leaves,
                     policy, seed, debug)
  flat = tf.nest.flatten(run.outputs)
  attached = tuple(i for i, y in enumerate(flat)
                   if isinstance(y, tf.Tensor) and sources.is_differentiable(y))
  if run.recorded.losses:
    # May refuse them: before any source is read or any update applied.
    on_losses(list(run.recorded.losses))
  forward = _Forward(
      fn=fn, context=context, xs=xs, leaves=leaves, eager=eager,
      determinism_check=determinism_check, seed=seed,
      global_step=global_step, inner_tape=run.ops.inner_tape_used,
      op_types=tuple(run.ops.op_types),
      op_details=(None if run.ops.op_details is None
                  else tuple(run.ops.op_details)),
      structure=tf.nest.map_structure(lambda _: None, run.outputs),
      attached=attached,
      specs=tuple((flat[i].dtype, flat[i].shape) for i in attached),
      losses=tuple(run.recorded.losses),
      forward_values=(tuple(flat[i] for i in attached)
                      if determinism_check == "values" else None),
      sources=sources.find_sources(eager, leaves, run),
      keras_variables=tuple(run.recorded.variables),
      keras_values=tuple(run.recorded.values),
      saver=run.saver)
  fill(forward)
  if (not attached and not forward.losses) or not forward.sources:
    # Nothing to differentiate, or nothing the gradient could reach.
    run.recorded.apply_updates()
    return run.outputs, [(loss, loss) for loss in forward.losses]
  return _attach(forward, run)


def _run_forward(call, context, leaves, policy, seed, debug):
  """Runs the forward pass, keeping nothing for the backward pass.

  Layers built on this call create their variables inside the recording
  scope, where Keras only initializes them on exit; the outputs of that run
  used placeholder weights, so the pass runs again, from the same step seed,
  once the variables exist.
  """
  inputs = [x for x in leaves if isinstance(x, tf.Tensor)]
  for _ in range(2):
    with record.stop_recording(), context:
      with record.VariableWatcher() as watcher:
        with keras_state.RecordingScope() as scope, forward_ops.ForwardOps(
            inputs, debug) as ops:
          with _saving(policy, inputs) as saver:
            outputs = call(leaves)
    if not scope.created_variables:
      # Kept tensors cannot be matched across the different gradient ops an
      # inner tape builds in the two passes (invariant 9): such a function is
      # recomputed fully.
      if saver is None or not saver.saved or ops.inner_tape_used:
        saver = None
      watched = watcher.watched_variables()
      ops.record_reads(watched)
      return _ForwardRun(outputs, keras_state.ForwardState(scope, ops), ops,
                         watched, saver)
    step_seed.ResetStepSeed(seed)
  raise errors.UnsupportedError(
      "RematerializeFn: the function keeps creating variables on every "
      "call. Create layers and variables once, outside the function, and "
      "call them inside it.")


def _saving(policy, inputs):
  """The policy's `selective.ForwardSaver`, or a null context."""
  if policy is None:
    return contextlib.nullcontext()
  return selective.ForwardSaver(policy, inputs)


def _attach(forward, run):
  """The outputs and losses, with the rerun attached as their gradient."""
  flat = tf.nest.flatten(run.outputs)
  gradient = rerun.Gradient(forward)

  @tf.custom_gradient
  def attach(*unused_sources):
    return ([flat[i] for i in forward.attached] + list(forward.losses),
            gradient.backward)

  # A forward accumulator calls the gradient function while the call is
  # being recorded; that raises, so before any update is applied.
  gradient.attaching = True
  try:
    results = attach(*[s.tensor for s in forward.sources])
  finally:
    gradient.attaching = False
  run.recorded.apply_updates()
  results = [_mark_connected(y, i, gradient.connected)
             for i, y in enumerate(results)]
  for i, y in zip(forward.attached, results):
    flat[i] = y
  outputs = tf.nest.pack_sequence_as(run.outputs, flat)
  return outputs, list(zip(forward.losses, results[len(forward.attached):]))


def rematerialize(fn=None, *, policy=None, debug=None):
  """Decorator form of `RematerializeFn`.

  Arguments are passed as they are: tensors, positional or keyword, are
  differentiated, and Python values such as `training=True` or `mask=None`
  reach `fn` unchanged, in eager mode and inside `tf.function` alike.

  Example:

    @tfremat.rematerialize
    def block(x, training=False):
      return dense2(dropout(dense1(x), training=training))

    @tfremat.rematerialize(policy=tfremat.policies.dots_saveable)
    def cheaper_block(x):
      return dense2(tf.nn.gelu(dense1(x)))

    y = block(x, training=True)
  """
  if fn is None:
    policies.get(policy)  # A bad policy is refused here, not at the call.
    return functools.partial(rematerialize, policy=policy, debug=debug)
  if not callable(fn):
    raise errors.InvalidTypeError(
        f"rematerialize expects a callable, got {type(fn).__name__}.")

  @functools.wraps(fn)
  def wrapper(*args, **kwargs):
    return RematerializeFn(lambda a, k: fn(*a, **k), args, kwargs,
                           policy=policy, debug=debug)

  return wrapper
