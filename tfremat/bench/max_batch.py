"""How large a batch trains within a memory size, by measuring
(`--max_batch`).

  python -m tfremat.bench --max_batch 512MiB
  python -m tfremat.bench --max_batch 1GiB --max_batch_models mlp,ResNet50

For each model and each way of rematerializing it, the largest batch whose
training fits the memory, and each one's examples per second at that batch:

  none                  no rematerialization
  tf.recompute_grad     TensorFlow's, around each block (chain models only)
  keras.RematScope      the model built inside keras.RematScope(mode="full")
  tfremat full          every block (or `remat_model(model, "full")`)
  tfremat policy        the same under the built-in save policy that fits
                        the largest batch (`tfremat.policies.PLANNED`)
  tfremat.largest_batch the call users make: the largest batch the
                        lowest plan is predicted to fit, and the
                        planner's plan there

The memory counts everything training holds: the weights, the optimizer's
state, the batch and the training step's tensors. Every row but
largest_batch's is searched on measurements (`_checked_peaks`): the step's
bound (the largest peak of its calls, plus their spread, plus the reserve)
plus what is held, within the memory, on a step traced for that batch.

Models: the benchmark's MLP and transformer blocks (as a chain, as the sweep
runs them, on the chain's stand-in step: no optimizer), a 4-layer KerasHub
GPT2Backbone (random weights) and keras.applications ResNet50 at 64x64,
each compiled with Adam and trained with `train_on_batch`.
"""

import dataclasses
import functools
import re
import time
import warnings

import keras
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat import models
from tfremat import planner
from tfremat import policies
from tfremat._src.api.largest_batch import search_batch
from tfremat._src.planning.runner import Batch
from tfremat._src.planning.runner import fit_step
from tfremat._src.planning.runner import nbytes

__all__ = [
    "MODELS",
    "Method",
    "BatchRow",
    "methods",
    "measure_model",
    "needs",
    "FIRST_CALLS",
    "CHECK_CALLS",
]

MODELS = ("mlp", "transformer", "GPT2Backbone", "ResNet50")

# Batches are searched in multiples of this, per model: a tenth of a step's
# memory is resolved, in a handful of probes.
_MULTIPLE = {"mlp": 64, "transformer": 2, "GPT2Backbone": 2, "ResNet50": 2}
# The batch the search starts from.
_FIRST = {"mlp": 1024, "transformer": 16, "GPT2Backbone": 8, "ResNet50": 8}


def needs(name):
  """The `pip install` a model needs, or None where this install has it."""
  if name in models.HUB_BACKBONES:
    try:
      import keras_hub  # pylint: disable=import-outside-toplevel,unused-import
    except ImportError:
      return 'pip install ".[hub]"'
  return None


@dataclasses.dataclass(frozen=True)
class Method:
  """One way of training a model: `make(batch)` returns the Keras layer or
  model trained, whose step `_Step` runs, and the batch of that size."""
  name: str
  make: object


@dataclasses.dataclass(frozen=True)
class BatchRow:
  """One method's largest batch on one model, as a value.

  Attributes:
    model, method: what was measured.
    batch: the largest batch that fits (0 when none does).
    probes: how many batches were measured.
    search_seconds: how long the search took.
    note: why nothing fits, or which way largest_batch chose.
    peak_bytes, bound_bytes: the step's largest peak at `batch`, and its
      bound (plus spread and reserve).
    held_bytes: what training holds besides the step there.
    step_seconds: the median step time at `batch`.
  """
  model: str
  method: str
  batch: int
  probes: int
  search_seconds: float
  note: str = ""
  peak_bytes: int = None
  bound_bytes: int = None
  held_bytes: int = None
  step_seconds: float = None

  @property
  def examples_per_second(self):
    return self.batch / self.step_seconds if self.step_seconds else None


class _Step:
  """A method's training step at one batch, as the search's runner: the
  chain's stand-in step, or a compiled model's `train_on_batch`, traced
  for that batch (as `fit` traces a step for data that divides into
  batches: one traced for any batch size can peak lower)."""

  def __init__(self, layer, batch):
    self.batch = batch
    self._warm = False
    if isinstance(layer, keras.Model) and layer.compiled:
      self.run = functools.partial(fit_step, layer, batch)
      optimizer = layer.optimizer
      if not optimizer.built:
        optimizer.build(layer.trainable_variables)
      state = nbytes(list(optimizer.variables))
    else:
      step = chain.training_step(layer)
      self.run = lambda: step(batch.x)
      state = 0
    self.held_bytes = nbytes(list(layer.variables)) + state + batch.nbytes

  def peaks(self, candidate, batch, calls, every_program=False):
    # One program: the step traced for this batch.
    del candidate, batch, every_program
    found = measure.peaks(self.run, calls=calls, warmup=not self._warm)
    self._warm = True
    return found


def _chain_parts(name, blocks, width):
  """The blocks of a chain model and batch -> the chain's input."""
  if name == "mlp":
    sizes = dict(blocks=blocks or 16, width=width or 256)
    layers = models.residual_mlp(sizes["blocks"], sizes["width"], 0.1,
                                 residual_inside=True)
    return layers, lambda b: Batch(tf.random.stateless_normal(
        [b, sizes["width"]], seed=[1, 2]))
  sizes = dict(blocks=blocks or 8, width=width or 128)
  embed, layers, _ = models.transformer_parts(256, 128, sizes["width"], 4,
                                              sizes["blocks"], 0.1)

  def inputs(b):
    tokens = tf.random.stateless_uniform([b, 128], seed=[1, 2], maxval=256,
                                         dtype=tf.int32)
    return Batch(embed(tokens))

  return layers, inputs


class _Recomputed(keras.layers.Layer):
  """A block called through `tf.recompute_grad`."""

  def __init__(self, block, **kwargs):
    super().__init__(**kwargs)
    self.block = block

  def call(self, x, training=None):
    return tf.recompute_grad(lambda h: self.block(h, training=training))(x)


def _whole_parts(name):
  """(build, inputs) for a whole model: build() makes the model (inside
  whatever scope is open), compiled with Adam and its loss (sparse
  cross-entropy on ResNet50's 10 classes, mean squared error on the
  backbone's features); inputs(b) a batch of b, with targets."""
  if name == "ResNet50":
    def build():
      keras.utils.set_random_seed(0)
      model = keras.applications.ResNet50(
          weights=None, input_shape=(64, 64, 3), classes=10)
      model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
      return model
    return build, lambda b: Batch(
        tf.random.stateless_normal([b, 64, 64, 3], seed=[1, 2]),
        tf.zeros([b], tf.int32))

  def build():
    keras.utils.set_random_seed(0)
    model = models.hub_backbone(name)
    model.compile(optimizer="adam", loss="mse")
    return model

  def inputs(b):
    return Batch({"token_ids": tf.random.stateless_uniform(
        [b, 128], seed=[1, 2], maxval=models.HUB_SIZES["vocabulary_size"],
        dtype=tf.int32), "padding_mask": tf.ones([b, 128], tf.int32)},
                 tf.zeros([b, 128, models.HUB_SIZES["hidden_dim"]]))

  return build, inputs


def methods(name, blocks=None, width=None):
  """The `Method`s measured on model `name` (one of MODELS, or any
  `models.whole_model` name), one per policy for "tfremat policy"."""
  if name in ("mlp", "transformer"):
    return _chain_methods(name, blocks, width)
  return _whole_methods(name)


def _chain_methods(name, blocks, width):
  layers, inputs = _chain_parts(name, blocks, width)
  n = len(layers)

  def every(policy=None):
    return tfremat.RematSequential(
        layers, [planner.Segment(i, i + 1, True, policy) for i in range(n)])

  def scoped(batch):
    with keras.RematScope(mode="full"):
      scope_layers, _ = _chain_parts(name, blocks, width)
    return keras.Sequential(scope_layers), inputs(batch)

  found = [
      Method("none", lambda b: (tfremat.RematSequential(
          layers, planner.keep_all(n)), inputs(b))),
      Method("tf.recompute_grad", lambda b: (keras.Sequential(
          [_Recomputed(l) for l in layers]), inputs(b))),
      Method("keras.RematScope", scoped),
      Method("tfremat full", lambda b: (every(), inputs(b)))]
  # The policy that keeps least first: it fits the largest batch, and the
  # others are searched only where they fit that too.
  for p in reversed(policies.PLANNED):
    found.append(Method(f"tfremat policy {policies.short_name(p)}",
                        lambda b, p=p: (every(p), inputs(b))))
  return found


def _whole_methods(name):
  build, inputs = _whole_parts(name)
  model = build()
  made = {}

  def once(key, make):
    if key not in made:  # Each model made once: its step takes any batch.
      made[key] = make()
    return made[key]

  def scoped(batch):
    with keras.RematScope(mode="full"):
      return once("scope", build), inputs(batch)

  found = [
      Method("none", lambda b: (model, inputs(b))),
      Method("keras.RematScope", scoped),
      Method("tfremat full", lambda b: (once("full", lambda: (
          tfremat.remat_model(model, "full"))), inputs(b)))]
  for p in reversed(policies.PLANNED):  # As for a chain.
    found.append(Method(
        f"tfremat policy {policies.short_name(p)}",
        lambda b, p=p: (once(p.name, lambda: tfremat.remat_model(
            model, "full", policy=p)), inputs(b))))
  return found


# The bench's rule for a method at a batch, on measurements: this many
# calls a probe, and up to `CHECK_CALLS` where their bound fits
# (`largest_batch`'s row is its own, on predictions).
FIRST_CALLS, CHECK_CALLS = 3, 10


def _checked_peaks(step, limit_bytes, settings, done, probe):
  """`FIRST_CALLS` calls of `step`, then up to `CHECK_CALLS` where their
  bound (largest, plus spread, plus `settings.reserve`) fits (not while
  probing). Returns every peak, `done` (already measured) first."""
  peaks = list(done)
  if len(peaks) < FIRST_CALLS:
    peaks += step.peaks(None, None, FIRST_CALLS - len(peaks))
  if probe or len(peaks) >= CHECK_CALLS:
    return peaks
  if planner.Measured.of(peaks, settings.reserve).bound_bytes <= limit_bytes:
    peaks += step.peaks(None, None, CHECK_CALLS - len(peaks))
  return peaks


class _Failed(Exception):
  """A method's step failed to build or run (not a budget it refused)."""


def _search(method, memory_bytes, first, multiple, settings, only_at=None):
  """(batch, {batch: (step, Measured)}): the largest multiple at which the
  method's step plus what is held fits, probed with `FIRST_CALLS`
  calls each and checked at the end over `settings.check_calls`
  (`_checked_peaks`); with `only_at`, that batch alone is tried. A
  step that fails raises `_Failed`: a smaller batch would fail the same
  way."""
  cache = {}

  def measured(batch, probe=True):
    done = cache.get(batch)
    try:
      step = done[0] if done else _Step(*method.make(batch))
      peaks = _checked_peaks(step, memory_bytes - step.held_bytes, settings,
                             done[2] if done else (), probe)
    except tf.errors.ResourceExhaustedError:
      return None
    except (ValueError, TypeError, tf.errors.OpError) as e:
      raise _Failed(f"fails: {_reason(e)}") from e
    cache[batch] = (step, planner.Measured.of(peaks, settings.reserve), peaks)
    return cache[batch][1].bound_bytes + step.held_bytes

  if only_at is not None:
    total = measured(only_at)
    if total is None or total > memory_bytes:
      raise _Failed(f"does not fit {only_at}")
    first = only_at
  batch, _ = search_batch(measured, memory_bytes, first, multiple)
  while batch > 0:  # The batch found, checked by the planner's rule.
    total = measured(batch, probe=False)
    if total is not None and total <= memory_bytes:
      break
    batch -= multiple
  return batch, cache


def _reason(error):
  """The line of an error's message that says what went wrong: Keras puts
  it after "Exception encountered when calling ..."."""
  lines = [re.sub(r"\x1b\[[0-9;]*m", "", l).strip()
           for l in str(error).splitlines()]
  lines = [l for l in lines if l]
  for i, line in enumerate(lines[:-1]):
    if "Exception encountered" in line:
      return lines[i + 1][:100]
  return (lines or [type(error).__name__])[0][:100]


def measure_model(name, memory_bytes, rounds=5, blocks=None, width=None,
                  log=None, settings=planner.DEFAULT_SETTINGS):
  """`BatchRow`s for model `name`: each method's largest batch within
  `memory_bytes` and its examples per second there, and what
  `tfremat.largest_batch` returns. Of the save policies, the one with the
  largest batch is kept (ties: the fastest). `log`, if given, is called
  with a line as each method's search ends."""
  rows, steps = [], []
  multiple, first = _MULTIPLE.get(name, 2), _FIRST.get(name, 8)
  with chain.retracing_quiet(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    best_policy = 0  # The largest batch a policy's row fit so far.
    for method in methods(name, blocks, width):
      start = time.perf_counter()
      policy = method.name.startswith("tfremat policy")
      note, cache = "", {}
      try:
        # Only the policy that fits the largest batch is shown: one that
        # does not fit the best so far is not searched further.
        batch, cache = _search(method, memory_bytes, first, multiple,
                               settings,
                               best_policy if policy and best_policy else None)
        if policy:
          best_policy = max(best_policy, batch)
      except _Failed as e:
        batch, note = 0, str(e)
      rows.append(_row(name, method.name, batch, cache, start, note))
      steps.append(cache[batch][0].run if batch else None)
      _log(log, rows[-1])
    row, step = _largest(name, memory_bytes, blocks, width, settings)
    rows.append(row)
    steps.append(step)
    _log(log, rows[-1])
  timed = [i for i, s in enumerate(steps) if s is not None]
  for i, seconds in zip(timed, measure.median_seconds(
      [steps[i] for i in timed], repeats=rounds)):
    rows[i] = dataclasses.replace(rows[i], step_seconds=seconds)
  return _best_policy(rows)


def _row(model, method, batch, cache, start, note):
  found = cache[batch] if batch else None
  return BatchRow(
      model, method, batch, len(cache), time.perf_counter() - start,
      note if note or batch else "nothing fits",
      found[1].peak_bytes if found else None,
      found[1].bound_bytes if found else None,
      found[0].held_bytes if found else None)


def _largest(name, memory_bytes, blocks, width, settings):
  """The row of `tfremat.largest_batch` on model `name`, and its step."""
  if name in ("mlp", "transformer"):
    model, inputs = _chain_parts(name, blocks, width)
  else:
    build, inputs = _whole_parts(name)
    model = build()
  sample = inputs(_FIRST.get(name, 8))
  start = time.perf_counter()
  found = tfremat.largest_batch(
      model, memory_bytes, sample.x, sample_target=sample.y,
      multiple=_MULTIPLE.get(name, 2), settings=settings, verbose=0)
  row = BatchRow(name, "tfremat.largest_batch", found.batch,
                 len(found.trials), time.perf_counter() - start,
                 f"chose {found.method}" if found.fits else "nothing fits")
  if not found.fits:
    return row, None
  step = _Step(found.model, sample.resized(found.batch))
  return dataclasses.replace(
      row, peak_bytes=found.measured.peak_bytes,
      bound_bytes=found.measured.bound_bytes,
      held_bytes=found.held.total_bytes), step.run


def _log(log, row):
  if log is not None:
    log(f"{row.model}, {row.method}: batch {row.batch} "
        f"({row.probes} probes, {row.search_seconds:.0f} s) "
        f"{row.note}".rstrip())


def _best_policy(rows):
  """The rows with only the best of the "tfremat policy ..." ones."""
  named = [r for r in rows if r.method.startswith("tfremat policy")]
  if not named:
    return rows
  best = max(named, key=lambda r: (r.batch, r.examples_per_second or 0))
  return [r for r in rows if r not in named or r is best]
