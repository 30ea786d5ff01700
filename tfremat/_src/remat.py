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

import numpy as np
import tensorflow as tf
from keras.src.backend.common import global_state
from tensorflow.python.autograph.core import ag_ctx
from tensorflow.python.autograph.core import config as autograph_config
from tensorflow.python.autograph.impl import api as autograph
from tensorflow.python import pywrap_tfe
from tensorflow.python.eager import record
from tensorflow.python.ops import control_flow_util
from tensorflow.python.ops import gen_resource_variable_ops

from tfremat import errors
from tfremat import policies
from tfremat._src import selective
from tfremat._src import state
from tfremat._src import step_seed
from tfremat._src import watch

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
# (`saved_residuals` reads what a traced call kept).
_observers = []


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


def _is_differentiable(t):
  return t.dtype.is_floating or t.dtype.is_complex


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


def _gradient_gate(dys, every=False):
  """A float32 zero computed from the incoming gradient (with `every`, from
  each of the gradients `dys`).

  In a graph, the rerun's inputs are offset by this zero, which makes every
  recomputed op depend on the gradient through data. Control dependencies
  would not do: XLA ignores them, and without any dependency the runtime is
  free to run the recompute during the forward pass (keeping its activations
  alive, as Lingvo's version does under tf.function) or
  common-subexpression-eliminate it with the forward ops. `b & ~b` is False
  even when the gradient is NaN or empty, and no optimizer folds it to a
  constant.
  """
  firsts = []
  for dy in dys:
    dy = _dense(dy)
    if dy is not None and _is_differentiable(dy):
      firsts.append(tf.cast(tf.reshape(dy, [-1])[:1], tf.float32))
      if not every:
        break
  if not firsts:
    return None
  b = tf.cast(tf.reduce_sum(tf.concat(firsts, 0) if len(firsts) > 1
                            else firsts[0]), tf.bool)
  return tf.cast(tf.logical_and(b, tf.logical_not(b)), tf.float32)


def _dense(t):
  """The values of an IndexedSlices; any other tensor (or None) itself."""
  return t.values if isinstance(t, tf.IndexedSlices) else t


def _after(x, zero):
  """`x` itself, not copied, but made available only after `zero` (a tensor,
  or a list of them).

  For the graph runtime, which keeps control dependencies (Grappler drops
  one only where a data path already orders the two ops); XLA ignores them.
  """
  with tf.control_dependencies(zero if isinstance(zero, list) else [zero]):
    return tf.identity(x)


def _gate(x, zero):
  """`x` unchanged in value, but computed after `zero` is available."""
  if x.dtype == tf.bool:
    return tf.logical_or(x, tf.cast(zero, tf.bool))
  if x.dtype.is_floating or x.dtype.is_complex or x.dtype.is_integer:
    # Subtracting +0 keeps the sign of a -0.0 input, where adding would not.
    return x - tf.cast(zero, x.dtype)
  return _after(x, zero)


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
  raise state.UnreplayableOpError(
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
    leaves = tuple(_in_current_graph(x) for x in leaves)
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
                   if isinstance(y, tf.Tensor) and _is_differentiable(y))
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
      sources=_find_sources(eager, leaves, run),
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
        with state.RecordingScope() as scope, state.ForwardOps(
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
      return _ForwardRun(outputs, state.ForwardState(scope, ops), ops,
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
  gradient = _Gradient(forward)

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


class _Sources:
  """Collects a call's sources, each tensor or variable once."""

  def __init__(self, eager):
    self.eager = eager
    self.found = []
    self._seen = set()

  def first_time(self, obj):
    if id(obj) in self._seen:
      return False
    self._seen.add(id(obj))
    return True

  def add(self, source):
    """Adds `source` unless it is a tensor already seen or not float."""
    if _is_differentiable(source.tensor) and self.first_time(source.tensor):
      self.add_if_recorded(source)

  def add_if_recorded(self, source):
    """Adds `source` where a gradient may be asked for it: in a graph always
    (`tf.gradients` may ask later), in eager mode when a tape records it."""
    if not self.eager or _is_recorded(source.tensor):
      self.found.append(source)


def _find_sources(eager, leaves, run):
  """Everything the rerun reads whose gradient may be asked for (invariants
  7 and 8): inputs, Keras variables, raw variables, closure captures."""
  if eager and not record.could_possibly_record():
    return ()  # No tape or accumulator: nothing will ask.
  sources = _Sources(eager)
  for i, x in enumerate(leaves):
    if isinstance(x, tf.Tensor):
      sources.add(_InputSource(x, i))
  for i, value in enumerate(run.recorded.before):
    sources.add(_KerasSource(value, i))
  keras_backing = {id(getattr(v, "_value", v))
                   for v in run.recorded.variables}
  keras_backing |= {_handle_id(v) for v in run.recorded.variables}
  raw = _add_raw_variables(sources, leaves, run, keras_backing)
  _add_read_handles(sources, run.ops, keras_backing | raw)
  graph = None if eager else tf.compat.v1.get_default_graph()
  for t in run.ops.external_tensors():
    # Constants too: a small eager tensor that a tf.function captures is
    # inlined as one, and a gradient tape still differentiates it.
    if eager or t.graph is graph:
      sources.add(_ClosureSource(t))
      # A captured tensor is tied to what it captures on the gradient tapes
      # at each use; the forward pass's use was unrecorded.
      state.record_capture(t)
  return tuple(sources.found)


def _add_raw_variables(sources, leaves, run, keras_backing):
  """Adds the tf.Variables passed in or watched; returns their handles' ids."""
  raw = [x for x in leaves if isinstance(x, tf.Variable)]
  raw += [v for v in run.watched if isinstance(v, tf.Variable)]
  for v in raw:
    if id(v) in keras_backing or not sources.first_time(v):
      continue
    if _is_differentiable(v):
      # The rerun reads the forward pass's read (invariant 6); `read`,
      # recorded by gradient tapes, carries the gradient.
      read = v.value()
      sources.add_if_recorded(
          _RawSource(read, value=run.ops.first_read(v), variable=v))
  return {_handle_id(v) for v in raw}


def _add_read_handles(sources, ops, covered):
  """Adds variables read without a tape watching the variable object (a
  non-trainable tf.Variable the caller watched), found by their handles."""
  covered = set(covered)
  for handle, dtype in ops.read_handles():
    if id(handle) in covered or not (dtype.is_floating or dtype.is_complex):
      continue
    covered.add(id(handle))
    if sources.eager and not _is_recorded(handle):
      continue
    read = gen_resource_variable_ops.read_variable_op(
        _in_current_graph(handle), dtype)
    sources.found.append(
        _RawSource(read, value=ops.first_read_of_handle(handle),
                   handle=handle))


class _Gradient:
  """The gradient function attached to a forward pass: it reruns the pass."""

  def __init__(self, forward):
    self.forward = forward
    self.connected = set()  # Outputs a gradient computation reached.
    self.attaching = False

  def backward(self, *dys):
    if self.attaching:
      # A forward accumulator transposes this function as it is recorded;
      # its transposition sees the rerun's gradient as unconnected and would
      # give zero JVPs.
      raise state.UnreplayableOpError(
          "Forward-mode differentiation (tf.autodiff.ForwardAccumulator) of "
          "a rematerialized function is not supported: its JVPs would be "
          "silently zero. Compute JVPs of the function without "
          "rematerialization (forward mode keeps no activations for a "
          "backward pass, so it gains nothing from it).")
    if self.connected:
      # Invariant 10: a traversal from a loss reaches the outputs' markers
      # first, and only the outputs it reached count. (Called directly, e.g.
      # by SavedModel tracing the gradient, every output counts.)
      dys = [dy if i in self.connected else None for i, dy in enumerate(dys)]
      self.connected.clear()
    if all(dy is None for dy in dys):
      return [None] * len(self.forward.sources)
    if self.forward.eager:
      return _eager_backward(self.forward, dys)
    return _GraphRerun(self.forward, dys).gradients(dys)


def _eager_backward(forward, dys):
  """Invariant 1: an eager forward pass is rerun eagerly under a tape."""
  for s in forward.sources:
    s.check_unchanged()
  watched = [s.watched() for s in forward.sources]
  with tf.GradientTape(watch_accessed_variables=False) as tape:
    tape.watch(watched)
    rerun = _rerun(forward, forward.leaves, forward.keras_values,
                   forward.seed, forward.global_step)
  ys, dys = _checked_targets(forward, *rerun, dys)
  return tape.gradient(ys, watched, output_gradients=dys,
                       unconnected_gradients=tf.UnconnectedGradients.NONE)


class _GraphRerun:
  """A traced forward pass's rerun, in the same graph, made to wait for the
  incoming gradient (docs/design.md, "The rerun is the forward pass's own
  program"), and differentiated with a gradient tape (with `tf.gradients`
  where it reads raw tf.Variables)."""

  def __init__(self, forward, dys):
    self.forward = forward
    self.graph = tf.compat.v1.get_default_graph()
    self.gate = _gradient_gate(dys)
    self._rerun_of = {}

  def gated(self, t):
    if self.gate is None or t is None:
      return t
    return _gate(t, self.gate)

  def tensor(self, t, gate_it=True, own=False):
    """The rerun's tensor for the forward pass's `t`: one per forward tensor,
    however often it is passed (f(x, x)), so that the gradient taken at it
    collects every use. Ungated, it is `t` itself or, with `own`, an
    identity of it that only the rerun reads."""
    if id(t) not in self._rerun_of:
      if gate_it:
        self._rerun_of[id(t)] = self.gated(t)
      else:
        self._rerun_of[id(t)] = tf.identity(t) if own else t
    return self._rerun_of[id(t)]

  def gradients(self, dys):
    forward = self.forward
    # The seeds and state are gated too: otherwise XLA common-subexpression
    # eliminates the rerun's random draws (e.g. dropout masks) with the
    # forward pass's and keeps every mask alive until the backward pass. A
    # tape inside the function must see an input it also reads by closure
    # as one tensor, as the forward pass did: the inputs are passed ungated
    # then, and the seeds and state gate the rerun.
    leaves = [self.tensor(x, not forward.inner_tape)
              if isinstance(x, tf.Tensor) else x for x in forward.leaves]
    # Trainable weights need no gate: every op reading them also reads a
    # gated input. They get an identity of their own all the same, so that
    # the gradient is taken at a tensor only the rerun reads: from the
    # forward pass's read, `tf.gradients` would walk the rest of the model.
    values = [self.tensor(v, not variable.trainable, own=True)
              for variable, v in zip(forward.keras_variables,
                                     forward.keras_values)]
    targets = [s.rerun_target(self) for s in forward.sources]
    closure_reads = self._closure_reads(targets)
    seed, global_step = (self.gated(forward.seed),
                         self.gated(forward.global_step))
    before = watch.last_op_id(self.graph)
    reads = [(s.handle(), s.value) for s in forward.sources
             if isinstance(s, _RawSource)]
    if reads:
      # Raw tf.Variables are read at their forward-time reads, which the
      # forward pass made unrecorded (and a loop or branch body captures):
      # only a walk of the graph finds the way from those reads to the
      # variables. What a policy kept goes unused here.
      tape, replacer = None, None
      with _forward_reads(reads):
        rerun = _rerun(forward, leaves, values, seed, global_step)
    else:
      watched = targets + list(closure_reads.values())
      # Asked before this call's own tape exists: whether a tape outside
      # records the rerun (a second-order gradient).
      replacer = self._replacer(leaves,
                                record.should_record_backprop(watched))
      with tf.GradientTape(watch_accessed_variables=False) as tape:
        tape.watch(watched)
        with replacer or contextlib.nullcontext():
          rerun = _rerun(forward, leaves, values, seed, global_step)
    if replacer is not None:
      replacer.check()
    ys, dys = _checked_targets(forward, *rerun, dys)
    grads = self._partials(tape, ys, dys, targets, closure_reads, before)
    return self._handed_on_last(grads)

  def _closure_reads(self, targets):
    """For each input the function also reads by closure (a tensor a
    tf.function captured, passed and closed over): that read, ungated, by
    the input's source index. Its gradient adds to the input's."""
    return {i: selective.in_graph(s.tensor, self.graph)
            for i, s in enumerate(self.forward.sources)
            if isinstance(s, _InputSource) and targets[i] is not s.tensor}

  def _partials(self, tape, ys, dys, targets, closure_reads, before):
    """Invariant 8: every target is a stop, since one may depend on another
    in the outer graph (an input computed from a weight the block also
    reads), and the gradient computation outside adds that path itself.
    `tape` records only the rerun's own ops, so every target is one; and
    unlike `tf.gradients`, it skips the gradients towards what it does not
    watch (a BatchNormalization's stopped mean), which `tf.gradients`
    builds and discards. Without a tape, `tf.gradients` differentiates with
    the targets as stops. A closure read counts only where an op of the
    rerun (made after op id `before`) reads it: `tf.gradients` walks every
    op reachable from what it differentiates, and from an input as the
    forward pass read it, that is the rest of the model."""
    also_read = {i: t for i, t in closure_reads.items()
                 if any(op._id > before for op in t.consumers())}  # pylint: disable=protected-access
    xs = targets + list(also_read.values())
    if tape is None:
      grads = tf.gradients(ys, xs, grad_ys=dys, stop_gradients=xs,
                           unconnected_gradients=tf.UnconnectedGradients.NONE)
    else:
      grads = tape.gradient(ys, xs, output_gradients=dys,
                            unconnected_gradients=tf.UnconnectedGradients.NONE)
    for i, extra in zip(also_read, grads[len(targets):]):
      if extra is not None:
        grads[i] = extra if grads[i] is None else tf.add(grads[i], extra)
    return grads[:len(targets)]

  def _handed_on_last(self, grads):
    """The gradients, those for tensors (which flow on to the calls before
    this one) made available only once those for variables are computed.

    The variables' gradients read this call's recomputed activations. An
    executor with one inter-op thread runs the chain of tensor gradients
    first and queues the rest: the previous call's rerun would start while
    this one's activations wait for its weight gradients, and at the end of
    the backward pass every call's activations would be alive at once
    (tests/remat_memory_test.py). A control edge suffices for the graph
    runtime; XLA ignores those, so there the tensors are offset by a zero
    computed from every variable gradient.
    """
    is_variable = [isinstance(s, (_KerasSource, _RawSource))
                   for s in self.forward.sources]
    after = [_dense(g) for g, v in zip(grads, is_variable)
             if v and g is not None]
    if not after or all(v or g is None for g, v in zip(grads, is_variable)):
      return grads
    if control_flow_util.GraphOrParentsInXlaContext(self.graph):
      zero = _gradient_gate(after, every=True)
      release = lambda t: _gate(t, zero)
    else:
      release = lambda t: _after(t, after)
    return [g if v or g is None else
            tf.IndexedSlices(release(g.values), g.indices, g.dense_shape)
            if isinstance(g, tf.IndexedSlices) else release(g)
            for g, v in zip(grads, is_variable)]

  def _replacer(self, leaves, second_order):
    """What puts a policy's kept tensors in place of the rerun's ops
    (design.md, "Save policies inside"); None where nothing was kept, or a
    tape outside records the rerun, which must see the ops themselves."""
    if self.forward.saver is None or second_order:
      return None
    # Kept tensors are ordered after the gradient too. The runtime needs
    # only a control edge; a subtraction would be a pass over every kept
    # tensor (docs/design.md, "Save policies inside"). XLA ignores control
    # edges and fuses the subtraction into the ops that read it.
    if (self.gate is None or
        control_flow_util.GraphOrParentsInXlaContext(self.graph)):
      gated_kept = self.gated
    else:
      gated_kept = lambda t: _after(t, self.gate)
    return selective.RerunReplacer(
        self.forward.saver, RerunMismatchError, gated_kept,
        [x for x in leaves if isinstance(x, tf.Tensor)])


def _rerun(forward, leaves, keras_values, seed, global_step):
  """Runs `fn` again; returns its outputs, losses and the ops it ran
  (`state.OpTypes`)."""
  debug = forward.op_details is not None
  with forward.context, step_seed.replaying(seed, global_step):
    with state.replaying(forward.keras_variables, keras_values) as losses:
      with state.OpTypes(debug) as ran:
        outputs = forward.call(leaves)
  return outputs, losses, ran


def _checked_targets(forward, outputs, losses, ran, dys):
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
    raise RerunMismatchError(
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


def _handle_id(variable):
  """Identifies a variable by its handle, followed out of captures, as
  `state.ForwardOps.read_handles` names the variables the block read."""
  return id(state.capture_origin(state._handle(variable)))  # pylint: disable=protected-access


def _in_current_graph(x):
  """`x`, or the current graph's capture of it if it is an eager tensor."""
  if isinstance(x, tf.Tensor) and not tf.is_symbolic_tensor(x):
    return tf.convert_to_tensor(x)
  return x


def _is_recorded(tensor):
  """Whether a gradient tape or a forward accumulator watches `tensor`."""
  if record.should_record_backprop([tensor]):
    return True
  indices, _ = pywrap_tfe.TFE_Py_PackJVPs([tensor])
  return bool(indices)


class _Source:
  """Something the rerun reads and the gradient may be asked for."""

  kind = None  # Named in `saved_residuals`' table.

  def __init__(self, tensor, index=None):
    self.tensor = tensor
    self.index = index

  def watched(self):
    """What an eager rerun's tape watches for this source."""
    return self.tensor

  def check_unchanged(self):
    """Raises where an eager rerun would read another value."""

  def rerun_target(self, rerun):
    """What a `_GraphRerun` differentiates for this source."""
    raise NotImplementedError


class _InputSource(_Source):
  """An argument of the function."""

  kind = "input"

  def rerun_target(self, rerun):
    return rerun.tensor(self.tensor)


class _KerasSource(_Source):
  """A Keras variable the call touched; `index` into the record's
  `keras_values`, which the rerun reads (invariant 5)."""

  kind = "keras"

  def rerun_target(self, rerun):
    return rerun.tensor(rerun.forward.keras_values[self.index])


class _ClosureSource(_Source):
  """A tensor the function read without receiving it (invariant 7)."""

  kind = "closure"

  def rerun_target(self, rerun):
    # As the rerun reads it: a gradient graph (a while loop's, say) captures
    # the original tensor anew.
    return selective.in_graph(state.capture_origin(self.tensor), rerun.graph)


class _RawSource(_Source):
  """A raw tf.Variable: the tf.Variable, or (read by a function without a
  tape watching the variable object) only its resource handle. `tensor` is
  a read that gradient tapes record; `value` is what the rerun reads, the
  forward pass's own read where there is one (invariant 6)."""

  kind = "raw"

  def __init__(self, tensor, value=None, variable=None, handle=None):
    super().__init__(tensor)
    self.variable = variable
    self._handle = handle
    self.value = tensor if value is None else value

  def handle(self):
    return self.variable.handle if self.variable is not None else self._handle

  def watched(self):
    return self.variable if self.variable is not None else self._handle

  @property
  def name(self):
    return self.variable.name if self.variable is not None else "(a variable)"

  def read_again(self):
    if self.variable is not None:
      return self.variable.value()
    return gen_resource_variable_ops.read_variable_op(self._handle,
                                                      self.tensor.dtype)

  def check_unchanged(self):
    if not bool(tf.reduce_all(tf.equal(self.read_again(), self.tensor))):
      raise RerunMismatchError(
          f"The tf.Variable '{self.name}' changed between the forward "
          "and the backward pass of a rematerialized call (e.g. an assign "
          "between two gradient calls on a persistent tape). Eager "
          "rematerialization rereads tf.Variables and would differentiate "
          "against the new value. Use a keras.Variable (its forward-time "
          "value is replayed), run the step in a tf.function, or take the "
          "gradients before changing the variable.")

  def rerun_target(self, rerun):
    # The handle: the rerun's dense reads are replaced by the forward read,
    # which the handle feeds, and its sparse reads (ResourceGather) take the
    # handle directly.
    return selective.in_graph(self.handle(), rerun.graph)


class _forward_reads(watch.Handler):  # pylint: disable=invalid-name
  """In a graph, reads of raw tf.Variables give their forward-time values.

  A handler may replace the outputs of an op being added to a graph; here,
  each `ReadVariableOp` of a variable in `reads` ((handle, forward-time
  read) pairs) returns that read instead, so an assignment between the two
  passes changes nothing, as without rematerialization (invariant 5).
  """

  def __init__(self, reads):
    self._reads = reads
    self._handles = {}

  def _handle_ids(self, graph):
    if graph not in self._handles:
      ids = {}
      for handle, read in self._reads:
        ids[id(selective.in_graph(handle, graph))] = read
      self._handles[graph] = ids
    return self._handles[graph]

  def on_op(self, op_type, inputs, outputs, op_name, graph):
    if op_type != "ReadVariableOp" or graph is None:
      return outputs
    read = self._handle_ids(graph).get(id(inputs[0]))
    return outputs if read is None else [selective.in_graph(read, graph)]


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
