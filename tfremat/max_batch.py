"""How large a batch trains within a memory size, by measuring.

  python -m tfremat.bench --max_batch 512MiB
  python -m tfremat.bench --max_batch 1GiB --max_batch_models mlp,ResNet50

For each model and each way of rematerializing it, the largest batch whose
training step fits the memory, and each one's examples per second at that
batch:

  none                  no rematerialization
  tf.recompute_grad     TensorFlow's, around each block (chain models only)
  keras.RematScope      the model built inside keras.RematScope(mode="full")
  tfremat full          every block (or `remat_model(model, "full")`)
  tfremat policy        the same under the built-in save policy that fits
                        the largest batch (`tfremat.policies.PLANNED`)
  tfremat.largest_batch the call users make: the largest batch of those
                        three ways (full, the planner's plan, none) and the
                        fastest of them there

Every row's batch is judged by one rule, a planned budget's: its bound (the
largest peak of `Settings.check_calls` steps, plus their spread, plus the
reserve) within the memory, on a step traced for that batch.

Models: the benchmark's MLP and transformer blocks (as a chain, as the sweep
runs them), a 4-layer KerasHub GPT2Backbone (random weights) and
keras.applications ResNet50 at 64x64.
"""

import dataclasses
import re
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat import models
from tfremat import planner
from tfremat import policies
from tfremat._src.planning import batch_fit
from tfremat._src.planning import measure as measure_impl

__all__ = [
    "Method",
    "methods",
    "measure_model",
    "format_table",
    "MODELS",
    "LEGEND",
]

MODELS = ("mlp", "transformer", "GPT2Backbone", "ResNet50")

# Batches are searched in multiples of this, per model: a tenth of a step's
# memory is resolved, in a handful of probes.
_MULTIPLE = {"mlp": 64, "transformer": 2, "GPT2Backbone": 2, "ResNet50": 2}
# The batch the search starts from.
_FIRST = {"mlp": 1024, "transformer": 16, "GPT2Backbone": 8, "ResNet50": 8}


@dataclasses.dataclass
class Method:
  """One way of training a model: `make(batch)` returns (layer, inputs),
  the Keras layer or model whose training step (`chain.training_step`) is
  measured and the batch of that size, or None where no such step is
  made (a budget refused)."""
  name: str
  make: object


def _chain_parts(name, blocks, width):
  """The blocks of a chain model and batch -> the chain's input."""
  if name == "mlp":
    sizes = dict(blocks=blocks or 16, width=width or 256)
    layers = models.residual_mlp(sizes["blocks"], sizes["width"], 0.1,
                                 residual_inside=True)
    return layers, lambda b: tf.random.stateless_normal(
        [b, sizes["width"]], seed=[1, 2])
  sizes = dict(blocks=blocks or 8, width=width or 128)
  embed, layers, _ = models.transformer_parts(256, 128, sizes["width"], 4,
                                              sizes["blocks"], 0.1)

  def inputs(b):
    tokens = tf.random.stateless_uniform([b, 128], seed=[1, 2], maxval=256,
                                         dtype=tf.int32)
    return embed(tokens)

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
  whatever scope is open), inputs(b) a batch of b."""
  if name == "ResNet50":
    def build():
      keras.utils.set_random_seed(0)
      return keras.applications.ResNet50(weights=None,
                                         input_shape=(64, 64, 3), classes=10)
    return build, lambda b: tf.random.stateless_normal([b, 64, 64, 3],
                                                       seed=[1, 2])

  def build():
    keras.utils.set_random_seed(0)
    return models.hub_backbone(name)

  def inputs(b):
    return {"token_ids": tf.random.stateless_uniform(
        [b, 128], seed=[1, 2], maxval=models.HUB_SIZES["vocabulary_size"],
        dtype=tf.int32), "padding_mask": tf.ones([b, 128], tf.int32)}

  return build, inputs


def methods(name, memory_bytes, blocks=None, width=None):
  """The `Method`s measured on model `name` (one of MODELS, or any
  `models.whole_model` name), one per policy for "tfremat policy"."""
  if name in ("mlp", "transformer"):
    return _chain_methods(name, memory_bytes, blocks, width)
  return _whole_methods(name, memory_bytes)


def _chain_methods(name, memory_bytes, blocks, width):
  layers, inputs = _chain_parts(name, blocks, width)
  n = len(layers)

  def segments(remat, policy=None):
    return [planner.Segment(i, i + 1, remat, policy) for i in range(n)]

  def scoped(batch):
    with keras.RematScope(mode="full"):
      scope_layers, _ = _chain_parts(name, blocks, width)
    return keras.Sequential(scope_layers), inputs(batch)

  found = [
      Method("none", lambda b: (tfremat.RematSequential(
          layers, segments(False)), inputs(b))),
      Method("tf.recompute_grad", lambda b: (keras.Sequential(
          [_Recomputed(l) for l in layers]), inputs(b))),
      Method("keras.RematScope", scoped),
      Method("tfremat full", lambda b: (tfremat.RematSequential(
          layers, segments(True)), inputs(b)))]
  # The policy that keeps least first: it fits the largest batch, and the
  # others are searched only where they fit that too.
  for p in reversed(policies.PLANNED):
    found.append(Method(f"tfremat policy {policies.short_name(p)}",
                        lambda b, p=p: (tfremat.RematSequential(
                            layers, segments(True, p)), inputs(b))))
  return found


def _whole_methods(name, memory_bytes):
  build, inputs = _whole_parts(name)
  model = build()

  def scoped(batch):
    with keras.RematScope(mode="full"):
      return build(), inputs(batch)

  found = [
      Method("none", lambda b: (model, inputs(b))),
      Method("keras.RematScope", scoped),
      Method("tfremat full", lambda b: (tfremat.remat_model(model, "full"),
                                        inputs(b)))]
  for p in reversed(policies.PLANNED):  # As for a chain.
    found.append(Method(
        f"tfremat policy {policies.short_name(p)}",
        lambda b, p=p: (tfremat.remat_model(model, "full", policy=p),
                        inputs(b))))
  return found


class _Failed(Exception):
  """A method's step failed to build or run (not a budget it refused)."""


def _bound_at(method, cache, memory_bytes, settings):
  """batch -> the method's bound at that batch, as a planned budget is held
  to (a few calls where it is clearly in or out, else `check_calls`); fills
  `cache` with {batch: (step, inputs, Measured)}. A step that fails raises
  `_Failed`: a smaller batch would fail the same way."""

  def bound(batch):
    if batch in cache:
      return cache[batch][2].bound_bytes
    try:
      layer, x = method.make(batch)
      step = chain.training_step(layer)
      peaks = measure.peaks(step, x, calls=3)
      found = planner.Measured.of(peaks, settings.reserve)
      if abs(found.bound_bytes - memory_bytes) < 0.1 * memory_bytes:
        peaks += measure.peaks(step, x, calls=settings.check_calls - 3,
                               warmup=False)
        found = planner.Measured.of(peaks, settings.reserve)
    except tf.errors.ResourceExhaustedError:
      return None
    except (ValueError, TypeError, tf.errors.OpError) as e:
      raise _Failed(f"fails: {_reason(e)}") from e
    cache[batch] = (step, x, found)
    return found.bound_bytes

  return bound


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
  """Rows for model `name`: each method's largest batch within
  `memory_bytes` and its examples per second there, and what
  `tfremat.largest_batch` returns. Of the save policies, the one with the
  largest batch is kept (ties: the fastest). `log`, if given, is called
  with a line as each method's search ends."""
  rows = []
  with chain.retracing_quiet(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    best_policy = 0  # The largest batch a policy's row fit so far.
    for method in methods(name, memory_bytes, blocks, width):
      cache, note = {}, ""
      start = time.perf_counter()
      bound = _bound_at(method, cache, memory_bytes, settings)
      first = _FIRST.get(name, 8)
      policy = method.name.startswith("tfremat policy")
      try:
        if policy and best_policy:
          # Only the policy that fits the largest batch is shown: one that
          # does not fit the best so far is not searched further.
          first = best_policy
          at_best = bound(best_policy)
          if at_best is None or at_best > memory_bytes:
            raise _Failed(f"does not fit {best_policy}")
        batch, probes = batch_fit.search_batch(
            bound, memory_bytes, first, _MULTIPLE.get(name, 2))
        if policy:
          best_policy = max(best_policy, batch)
      except _Failed as e:
        batch, probes, note = 0, dict.fromkeys(cache), str(e)
      row = {"model": name, "method": method.name, "batch": batch,
             "probes": len(probes),
             "search_seconds": time.perf_counter() - start,
             "note": note if note or batch else "nothing fits"}
      if batch:
        row["step"], row["inputs"], measured = cache[batch]
        row["peak_bytes"], row["bound_bytes"] = (measured.peak_bytes,
                                                 measured.bound_bytes)
      rows.append(row)
      _log(log, row)
    rows.append(_largest(name, memory_bytes, blocks, width, settings))
    _log(log, rows[-1])
  _time_rows([r for r in rows if r["batch"]], rounds)
  return _best_policy(rows)


def _largest(name, memory_bytes, blocks, width, settings):
  """The row of `tfremat.largest_batch` on model `name`."""
  if name in ("mlp", "transformer"):
    model, inputs = _chain_parts(name, blocks, width)
  else:
    build, inputs = _whole_parts(name)
    model = build()
  start = time.perf_counter()
  found = tfremat.largest_batch(
      model, memory_bytes, inputs(_FIRST.get(name, 8)),
      multiple=_MULTIPLE.get(name, 2), settings=settings, verbose=0)
  row = {"model": name, "method": "tfremat.largest_batch",
         "batch": found.batch, "probes": len(found.trials),
         "search_seconds": time.perf_counter() - start,
         "note": f"chose {found.method}" if found.batch else "nothing fits"}
  if found.batch:
    row["step"] = chain.training_step(found.model)
    row["inputs"] = batch_fit.resized(inputs(_FIRST.get(name, 8)),
                                      found.batch)
    row["peak_bytes"] = found.measured.peak_bytes
    row["bound_bytes"] = found.measured.bound_bytes
  return row


def _log(log, row):
  if log is not None:
    log(f"{row['model']}, {row['method']}: batch {row['batch']} "
        f"({row['probes']} probes, {row['search_seconds']:.0f} s) "
        f"{row['note']}".rstrip())


def _time_rows(rows, rounds):
  """Sets each row's median step seconds at its batch, timed round-robin
  in shuffled order (each step traced and run before)."""
  times = [[] for _ in rows]
  order = np.random.default_rng(0)
  for _ in range(rounds):
    for i in order.permutation(len(rows)):
      start = time.perf_counter()
      measure_impl.wait_for(rows[i]["step"](rows[i]["inputs"]))
      times[i].append(time.perf_counter() - start)
  for row, t in zip(rows, times):
    row["step_seconds"] = float(np.median(t))
    row["examples_per_second"] = row["batch"] / row["step_seconds"]
    del row["step"], row["inputs"]


def _best_policy(rows):
  """The rows with only the best of the "tfremat policy ..." ones."""
  named = [r for r in rows if r["method"].startswith("tfremat policy")]
  if not named:
    return rows
  best = max(named, key=lambda r: (r["batch"],
                                   r.get("examples_per_second", 0)))
  return [r for r in rows if r not in named or r is best]


LEGEND = """\
batch: the largest batch whose training step (the gradient of the sum of
  the squared outputs) fits the memory, searched in multiples of the
  model's step; x none: its ratio to the `none` row's. Every row is judged
  as a planned budget is, on a step traced for that batch: its bound
  (bound MiB: the largest peak of {check_calls} steps, plus their spread,
  plus the {reserve:.0%} reserve) within the memory. peak MiB: the largest
  of those peaks (the tensors' bytes, as tfremat.measure.peak_bytes counts
  them). examples/s: the batch over the median step time at it ({rounds}
  rounds, every row once per round, in shuffled order); x none: per
  example, against `none`'s.
keras.RematScope: the model built inside keras.RematScope(mode="full"),
  which runs each layer through tf.recompute_grad. tfremat policy: every
  block (or remat_model(model, "full", policy=...)) under the built-in
  policy that fit the largest batch. tfremat.largest_batch: what the call
  returns for the memory (the note says which way it chose: full, the
  planner's plan or none), at the batch it found."""


def format_table(rows, memory_bytes):
  """The rows as a text table, each model's ratios against its `none`."""
  header = (f"{'model':<14}{'method':<30}{'batch':>7}{'x none':>8}"
            f"{'peak MiB':>10}{'bound MiB':>11}{'examples/s':>12}"
            f"{'x none':>8}  note")
  lines = [f"memory: {measure.format_bytes(memory_bytes)}", header,
           "-" * (len(header) + 20)]
  base = {}
  for r in rows:
    if r["method"] == "none":
      base = r
    if not r["batch"]:
      lines.append(f"{r['model']:<14}{r['method']:<30}{0:>7}{'':>49}  "
                   f"{r['note']}")
      continue
    x_batch = r["batch"] / base["batch"] if base.get("batch") else float("nan")
    x_rate = (r["examples_per_second"] / base["examples_per_second"]
              if base.get("batch") else float("nan"))
    lines.append(
        f"{r['model']:<14}{r['method']:<30}{r['batch']:>7}{x_batch:>8.2f}"
        f"{r['peak_bytes'] / 2**20:>10.1f}{r['bound_bytes'] / 2**20:>11.1f}"
        f"{r['examples_per_second']:>12.1f}"
        f"{x_rate:>8.2f}  {r['note']}")
  return "\n".join(lines)
