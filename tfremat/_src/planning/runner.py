"""What traces and runs a candidate's training step: the one thing in
planning that touches a model's step. The planner hands a runner
candidates (segments, ordered) and batches; it applies each through
`apply_plan` and predicts its step's peak from the program (`predicted`,
`tfremat.measure.predict_peak`), runs the chosen plan's step to check it
(`peaks`, in the step its prediction traced for the batch's shapes), and
says what training holds besides the step; everything a check trains is
put back. Tests hand the planner a stand-in runner instead.

  ChainRunner    a chain of layers (`remat_sequential`, the builder): the
                 stand-in step, the gradient of sum(y**2)/2 of its output
  ModelRunner    a functional model rebuilt around its planned chain
                 (`remat_model`, `largest_batch`): a compiled model's own
                 training step (its `train_step`: its loss, its
                 optimizer's update) given targets, else the stand-in step
                 of the whole model
  InPlaceRunner  a compiled model whose layers are rematerialized where
                 they are (`remat_in_place_for_budget`): `train_on_batch`
"""

import dataclasses
import functools

import numpy as np
import tensorflow as tf

from tfremat._src import measuring as measure
from tfremat._src import predicting
from tfremat._src import predicting_reruns
from tfremat._src.core import selective
from tfremat._src.planning import apply
from tfremat._src.planning import profile
from tfremat._src.planning.plan import Held

__all__ = [
    "Batch",
    "Runner",
    "ChainRunner",
    "ModelRunner",
    "InPlaceRunner",
    "STAND_IN",
    "TRAIN_ON_BATCH",
    "nbytes",
    "fit_step",
    "train_step",
]

# What `Runner.step` names.
STAND_IN = "stand-in"
TRAIN_ON_BATCH = "train_on_batch"


def nbytes(tree):
  """The bytes of the tensors or variables in `tree` (each variable once)."""
  seen, total = set(), 0
  for t in tf.nest.flatten(tree):
    if t is None or id(t) in seen:
      continue
    seen.add(id(t))
    # Keras variables name their dtype with a string.
    total += int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size
  return total


@dataclasses.dataclass(frozen=True)
class Batch:
  """A batch as a training step takes it: inputs `x` (a tensor or a
  structure of them, batched along axis 0) and, for a compiled model's
  `train_on_batch`, targets `y`."""
  x: object
  y: object = None

  @property
  def size(self):
    return int(tf.nest.flatten(self.x)[0].shape[0])

  def resized(self, size):
    """The batch with `size` examples: its own repeated and cut."""
    def one(t):
      t = tf.convert_to_tensor(t)
      repeats = -(-size // int(t.shape[0]))
      return tf.tile(t, [repeats] + [1] * (t.shape.rank - 1))[:size]
    return Batch(tf.nest.map_structure(one, self.x),
                 None if self.y is None else tf.nest.map_structure(one, self.y))

  def cut(self, axis, to):
    """The batch with every tensor as long as its first input along `axis`
    (>= 1: a sequence's token ids, their targets, a padding mask; an
    image's height) cut to its first `to` there; None where its first
    input has no such axis."""
    first = tf.convert_to_tensor(tf.nest.flatten(self.x)[0])
    if first.shape.rank is None or first.shape.rank <= axis:
      return None
    length = first.shape[axis]

    def one(t):
      t = tf.convert_to_tensor(t)
      if t.shape.rank is not None and t.shape.rank > axis and (
          t.shape[axis] == length):
        return tf.gather(t, tf.range(to), axis=axis)
      return t
    return Batch(tf.nest.map_structure(one, self.x),
                 None if self.y is None else tf.nest.map_structure(one, self.y))

  @property
  def nbytes(self):
    return nbytes([self.x, self.y])


class Runner:
  """Runs candidates' training steps (see the module). `step` names the
  step it measures (`STAND_IN` or `TRAIN_ON_BATCH`)."""

  step = STAND_IN
  jit = False  # Whether its steps are compiled by XLA.

  def __init__(self):
    self._built = {}  # Candidate -> what runs its step.
    # The batch's shapes -> (the keep-everything step's KeepProgram on the
    # executor, the bytes its call converts).
    self._keep = {}
    # Under XLA, the batch's shapes -> XLA's figure over the executor's
    # read for the last candidate compiled (`simulated`).
    self._scale = {}
    # (Candidate, the batch's shapes) -> (the `predicting.Step` its own
    # prediction traced, which `peaks` runs instead of tracing it again,
    # and that prediction); the last batch's shapes only (a Step holds its
    # batch).
    self._traced = {}
    # Under a tf.distribute strategy, a budget is one replica's: the
    # replicas that share the measured memory are divided out, and
    # train_on_batch takes a batch for every replica.
    self.replicas = measure.replicas_measured()
    self.in_sync = tf.distribute.get_strategy().num_replicas_in_sync

  def step_batch(self, batch):
    """What the step runs on for one replica's `batch`: the batch itself
    (each replica of a strategy runs a stand-in step on all of it)."""
    return batch

  def state(self):
    """The variables a step changes, put back after each measurement."""
    raise NotImplementedError

  def held(self, batch):
    """What training holds besides the step on `batch` (a `Held`)."""
    raise NotImplementedError

  def build(self, candidate, relaxed=False):
    """The function of a `Batch` that runs `candidate`'s training step,
    traced for the batch's shapes, or with `relaxed` for any size of the
    axes that may change (a Plan's: its chain chooses its variant in the
    step)."""
    raise NotImplementedError

  def predicted(self, candidate, batch):
    """`candidate`'s training step's peak on `batch` (one replica's),
    read from its program (`tfremat.measure.predict_peak`): nothing runs.
    Keeping everything, its program on the executor is kept for
    `simulated` (under XLA traced for that alone: nothing compiles it)."""
    batch = self.step_batch(batch)
    shapes = _shapes(batch)
    self._traced = {k: v for k, v in self._traced.items() if k[1] == shapes}
    if (candidate, shapes) in self._traced:  # Predicted already.
      return self._traced[(candidate, shapes)][1] // self.replicas
    step, *args = self.predictable(candidate, batch)
    resolved = predicting.step_of(step, args, {})
    units = self.unit_names()
    # Under a tf.distribute strategy each replica's ops are scoped apart:
    # every candidate is predicted from its own program there (and its
    # check runs as `fit` runs it).
    if tf.distribute.has_strategy():
      return predicting.peak_of(resolved) // self.replicas
    if units is None or candidate.ordered or any(
        s.remat for s in candidate.segments):
      peak = predicting.peak_of(resolved)
      self._traced[(candidate, shapes)] = resolved, peak
      read = self._read(candidate, shapes) if resolved.jit_compile else None
      if read:
        self._scale[shapes] = peak / read
      return peak // self.replicas
    program = resolved if not resolved.jit_compile else (
        _on_executor(resolved))
    keep = predicting_reruns.KeepProgram.of(program, units)
    self._keep[shapes] = keep, resolved.converted_bytes
    peak = read = keep.peak() + resolved.converted_bytes
    if resolved.jit_compile:
      peak = predicting.peak_of(resolved)
      self._scale[shapes] = peak / max(1, read)
    self._traced[(candidate, shapes)] = resolved, peak
    return peak // self.replicas

  def simulated(self, candidate, batch):
    """`candidate`'s step's peak on `batch` read from the keep-everything
    step's program on the executor (`predicting_reruns`), predicted on
    this batch's shapes first. Under XLA that read is an estimate, which
    chooses what to compile (a plan is taken on XLA's own figure): times
    the ratio of XLA's figure to the read for the last candidate compiled
    (keeping everything's first: 0.82 on an LM whose plans' were
    1.11-1.28; on a small LM, read unscaled, its first plan was passed
    over at 147% of the room and the plan chosen used 75%). None where it
    cannot be read so (a nested or ordered plan, units whose reruns it
    does not find): `predicted` then reads the candidate's own step."""
    shapes = _shapes(self.step_batch(batch))
    read = self._read(candidate, shapes)
    if read is None:
      return None
    return int(read * self._scale.get(shapes, 1.0)) // self.replicas

  def _read(self, candidate, shapes):
    """`candidate`'s peak read from the keep-everything program on the
    executor for `shapes`, or None."""
    found = self._keep.get(shapes)
    if found is None or candidate.ordered or any(
        s.nested for s in candidate.segments):
      return None
    keep, converted = found
    try:
      return keep.peak([(range(s.start, s.stop), _keeps(s.policy))
                        for s in candidate.segments if s.remat]) + converted
    except predicting_reruns.NotReadable:
      return None

  def unit_names(self):
    """The names of the gated layers a planned chain runs its units as
    (`RematSequential`'s kept layers), or None where the runner's
    candidates are not such chains."""
    return None

  def predictable(self, candidate, batch):
    """(step, *args): what `predict_peak` reads for `candidate` on
    `batch`: the same step `build` runs."""
    raise NotImplementedError

  def _run(self, candidate):
    if candidate not in self._built:
      self._built[candidate] = self.build(candidate)
    return self._built[candidate]

  def peaks(self, candidate, batch, calls):
    """Every call's peak of `calls` training steps of `candidate` on
    `batch` (one replica's, under a strategy), in a step traced for the
    batch's shapes: the one its prediction traced, where there is one (the
    first call, unmeasured, traces or starts it). What they trained is put
    back."""
    batch = self.step_batch(batch)
    traced = self._traced.get((candidate, _shapes(batch)))
    run = (self._run(candidate) if traced is None else
           lambda unused_batch: traced[0].call())
    with measure.restoring(self.state()):
      return [p // self.replicas for p in measure.peaks(
          run, batch, calls=calls)]


def _on_executor(step):
  """A `predicting.Step` compiled by XLA traced afresh for TensorFlow's
  executor, for its program."""
  function = tf.function(step.function.python_function, jit_compile=False,
                         autograph=getattr(step.function, "_autograph", True))
  return dataclasses.replace(step, function=function, jit_compile=False)


def _keeps(policy):
  """None (a full rerun), or whether `policy` keeps a graph op."""
  if policy is None:
    return None
  return lambda op: selective.keeps(policy, selective.describe(op))


def _shapes(batch):
  return tuple(tuple(t.shape) for t in tf.nest.flatten([batch.x, batch.y])
               if t is not None)


def _stand_in(layer, relaxed=False):
  """A `Batch` -> the stand-in training step of `layer` on its inputs
  (`relaxed`: traced for any size of their axes)."""
  step = profile.training_step(layer, relaxed=relaxed)
  return lambda batch: step(batch.x)


class ChainRunner(Runner):
  """A chain of layers under the stand-in step."""

  def __init__(self, layers):
    super().__init__()
    self.layers = layers

  def state(self):
    return [v for l in self.layers for v in l.variables]

  def held(self, batch):
    return Held(weights_bytes=nbytes([l.variables for l in self.layers]),
                batch_bytes=batch.nbytes)

  def build(self, candidate, relaxed=False):
    return _stand_in(apply.apply_plan(self.layers, candidate), relaxed)

  def predictable(self, candidate, batch):
    return (profile.training_step(apply.apply_plan(self.layers, candidate)),
            batch.x)

  def unit_names(self):
    return [f"remat_{l.name}" for l in self.layers]


def fit_step(model, batch):
  """`model.train_on_batch` on `batch`, its train function traced for
  `batch`'s shapes: made anew where the last call was on other shapes. Keras
  traces it with `reduce_retracing`, so after a second shape it runs one
  traced for any batch size, which can peak lower than `fit` on data that
  divides into batches (a step traced for that batch)."""
  shapes = tuple(tuple(t.shape) for t in tf.nest.flatten([batch.x, batch.y])
                 if t is not None)
  # Held on the model object: the train function it belongs to is there.
  if getattr(model, "_tfremat_traced_for", None) != shapes:
    model.make_train_function(force=True)
    object.__setattr__(model, "_tfremat_traced_for", shapes)
  return model.train_on_batch(batch.x, batch.y)


def train_step(model, relaxed=False):
  """A `Batch` -> the compiled `model`'s training step: the `train_step` its
  `fit` and `train_on_batch` run, as a `tf.function` traced for each
  batch's shapes, or with `relaxed` once for any size of the axes that may
  change (`measure.RelaxedFunction`). Under a `tf.distribute` strategy,
  `fit_step`, Keras's own."""
  if tf.distribute.has_strategy():
    return functools.partial(fit_step, model)
  step = (measure.RelaxedFunction if relaxed else tf.function)(
      lambda x, y: model.train_step((x, y, None)),
      jit_compile=model.jit_compile is True)

  def run(batch):
    # pylint: disable-next=protected-access
    model._maybe_symbolic_build(data_batch=(batch.x, batch.y, None))
    return step(batch.x, batch.y)
  return run


def _optimizer_variables(model):
  """A compiled model's optimizer's variables (built first, so that its
  slots exist)."""
  optimizer = model.optimizer
  if not optimizer.built:
    optimizer.build(model.trainable_variables)
  return list(optimizer.variables)


def _state(model):
  """A compiled model's variables and its optimizer's."""
  return list(model.variables) + _optimizer_variables(model)


def _global(batch, replicas):
  """One replica's `batch` as `train_on_batch` takes it under a strategy of
  `replicas` replicas: each gets as many rows."""
  return batch if replicas == 1 else batch.resized(replicas * batch.size)


def _held(model, batch, fit):
  return Held(
      weights_bytes=nbytes(list(model.variables)),
      optimizer_bytes=nbytes(_optimizer_variables(model)) if fit else 0,
      batch_bytes=batch.nbytes)


class ModelRunner(Runner):
  """A functional model whose chain (`ModelChain`, cut into `units`) runs
  each candidate: with `fit`, the compiled model's `train_on_batch`, the
  candidate model compiled as the original (`compiled_like`, sharing its
  optimizer); else the stand-in step of the whole model."""

  def __init__(self, model, chain, units, fit):
    super().__init__()
    self.model, self.chain, self.units, self.fit = model, chain, units, fit
    self.step = TRAIN_ON_BATCH if fit else STAND_IN
    self.jit = fit and model.jit_compile is True

  def state(self):
    return _state(self.model) if self.fit else list(self.model.variables)

  def held(self, batch):
    return _held(self.model, batch, self.fit)

  def step_batch(self, batch):
    return _global(batch, self.in_sync) if self.fit else batch

  def _planned(self, candidate):
    """The model rebuilt around `candidate`'s chain, compiled as the
    original where its own step runs."""
    planned = apply.apply_plan(self.units, candidate, chain=self.chain,
                               name=f"{self.model.name}_chain")
    return apply.compiled_like(planned, self.model) if self.fit else planned

  def build(self, candidate, relaxed=False):
    planned = self._planned(candidate)
    return (train_step(planned, relaxed) if self.fit else
            _stand_in(planned, relaxed))

  def unit_names(self):
    return [f"remat_{u.name}" for u in self.units]

  def predictable(self, candidate, batch):
    planned = self._planned(candidate)
    if not self.fit:
      return profile.training_step(planned), batch.x
    return planned.train_on_batch, batch.x, batch.y


class InPlaceRunner(Runner):
  """A compiled model whose `layers` each candidate rematerializes in
  place (one candidate at a time), measured on `train_on_batch`."""

  step = TRAIN_ON_BATCH

  def __init__(self, model, layers):
    super().__init__()
    self.model, self.layers = model, layers
    self._current = None

  def state(self):
    return _state(self.model)

  def held(self, batch):
    return _held(self.model, batch, True)

  def step_batch(self, batch):
    return _global(batch, self.in_sync)

  def build(self, candidate, relaxed=False):
    del relaxed  # Rematerialized in place: one plan, no variants.

    def run(batch):
      if self._current != candidate:
        self.apply(candidate)
      return fit_step(self.model, batch)
    return run

  def predictable(self, candidate, batch):
    if self._current != candidate:
      self.apply(candidate)
    return self.model.train_on_batch, batch.x, batch.y

  def apply(self, candidate):
    """Leaves the model's layers rematerialized as `candidate` says."""
    apply.apply_plan(self.layers, candidate, place=True)
    self.model.make_train_function(force=True)
    object.__setattr__(self.model, "_tfremat_traced_for", None)
    self._current = candidate
