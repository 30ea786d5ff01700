"""The backward pass of a rematerialized call: it reruns the forward pass as
the forward pass ran it (eagerly under a tape, or in the forward pass's own
graph, gated on the incoming gradient) and differentiates the rerun.
"""

import contextlib

import tensorflow as tf
from tensorflow.python.eager import record
from tensorflow.python.ops import control_flow_util

from tfremat import errors
from tfremat._src.core import forward_ops
from tfremat._src.core import rerun_checks
from tfremat._src.core import selective
from tfremat._src.core import sources
from tfremat._src.core import keras_state
from tfremat._src.core import op_types
from tfremat._src.core import step_seed
from tfremat._src.core import watch

__all__ = [
    "Gradient",
]


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
    if dy is not None and sources.is_differentiable(dy):
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


class Gradient:
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
      raise errors.UnreplayableOpError(
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
  ys, dys = rerun_checks.checked_targets(forward, *rerun, dys)
  return tape.gradient(ys, watched, output_gradients=dys,
                       unconnected_gradients=tf.UnconnectedGradients.NONE)


class _GraphRerun:
  """A traced forward pass's rerun, in the same graph, made to wait for the
  incoming gradient (docs/design.md, "The rerun is the forward pass's own
  program"), and differentiated `_ByTape` (`_ByGradientsOfGraph` where it
  reads raw tf.Variables)."""

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
    reads = [r for r in (s.raw_read() for s in forward.sources)
             if r is not None]
    if reads:
      by = _ByGradientsOfGraph(reads)
    else:
      # Asked before this call's own tape exists: whether a tape outside
      # records the rerun (a second-order gradient).
      watched = targets + list(closure_reads.values())
      by = _ByTape(watched, self._replacer(
          leaves, record.should_record_backprop(watched)))
    rerun = by.run(lambda: _rerun(forward, leaves, values, seed, global_step))
    ys, dys = rerun_checks.checked_targets(forward, *rerun, dys)
    grads = self._partials(by, ys, dys, targets, closure_reads, before)
    return self._handed_on_last(grads)

  def _closure_reads(self, targets):
    """For each input the function also reads by closure (a tensor a
    tf.function captured, passed and closed over): that read, ungated, by
    the input's source index. Its gradient adds to the input's."""
    reads = {i: s.closure_read(target, self.graph)
             for i, (s, target) in enumerate(zip(self.forward.sources,
                                                 targets))}
    return {i: read for i, read in reads.items() if read is not None}

  def _partials(self, by, ys, dys, targets, closure_reads, before):
    """Invariant 8: every target is a stop, since one may depend on another
    in the outer graph (an input computed from a weight the block also
    reads), and the gradient computation outside adds that path itself
    (`by` differentiates: `_ByTape` or `_ByGradientsOfGraph`). A closure
    read counts only where an op of the rerun (made after op id `before`)
    reads it: `tf.gradients` walks every op reachable from what it
    differentiates, and from an input as the forward pass read it, that is
    the rest of the model."""
    also_read = {i: t for i, t in closure_reads.items()
                 if any(op._id > before for op in t.consumers())}  # pylint: disable=protected-access
    grads = by.gradients(ys, targets + list(also_read.values()), dys)
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
    is_variable = [s.is_variable for s in self.forward.sources]
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
        self.forward.saver, errors.RerunMismatchError, gated_kept,
        [x for x in leaves if isinstance(x, tf.Tensor)])


class _ByTape:
  """A graph rerun differentiated by a gradient tape of its own, which
  records only the rerun's ops: every target is one of them, and unlike
  `tf.gradients` it skips the gradients towards what it does not watch (a
  BatchNormalization's stopped mean), which `tf.gradients` builds and
  discards. With a `replacer`, a policy's kept tensors stand in for the
  rerun's ops that made them."""

  def __init__(self, watched, replacer):
    self.watched = watched
    self.replacer = replacer
    self.tape = None

  def run(self, rerun):
    with tf.GradientTape(watch_accessed_variables=False) as self.tape:
      self.tape.watch(self.watched)
      with self.replacer or contextlib.nullcontext():
        ran = rerun()
    if self.replacer is not None:
      self.replacer.check()
    return ran

  def gradients(self, ys, xs, dys):
    return self.tape.gradient(
        ys, xs, output_gradients=dys,
        unconnected_gradients=tf.UnconnectedGradients.NONE)


class _ByGradientsOfGraph:
  """A graph rerun that reads raw tf.Variables, differentiated with
  `tf.gradients`: the variables are read at their forward-time reads, which
  the forward pass made unrecorded (and a loop or branch body captures), so
  only a walk of the graph finds the way from those reads to the
  variables. What a policy kept goes unused here."""

  def __init__(self, reads):
    self.reads = reads

  def run(self, rerun):
    with sources.forward_reads(self.reads):
      return rerun()

  def gradients(self, ys, xs, dys):
    return tf.gradients(ys, xs, grad_ys=dys, stop_gradients=xs,
                        unconnected_gradients=tf.UnconnectedGradients.NONE)


def _rerun(forward, leaves, keras_values, seed, global_step):
  """Runs `fn` again; returns its outputs, losses and the ops it ran
  (`op_types.OpTypes`)."""
  debug = forward.op_details is not None
  with forward.context, step_seed.replaying(seed, global_step):
    with keras_state.replaying(forward.keras_variables, keras_values) as losses:
      with op_types.OpTypes(debug) as ran, forward_ops.RandomAfterInputs(
          [x for x in leaves if isinstance(x, tf.Tensor)]):
        outputs = forward.call(leaves)
  return outputs, losses, ran
