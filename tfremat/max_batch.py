"""How large a batch trains within a memory budget, by measuring.

  python -m tfremat.bench --max_batch 512MiB
  python -m tfremat.bench --max_batch 1GiB --max_batch_models mlp,ResNet50

For each model and each way of rematerializing it, `largest_batch` finds
the largest batch whose training step peaks within the budget
(`tfremat.measure.peak_bytes`), and the table gives each one's examples per
second at that batch:

  none                no rematerialization
  tf.recompute_grad   TensorFlow's, around each block (chain models only)
  keras.RematScope    the model built inside keras.RematScope(mode="full")
  tfremat full        every block (or `remat_model(model, "full")`)
  tfremat policy      the same under the built-in save policy that fits the
                      largest batch (`tfremat.policies.PLANNED`)
  tfremat planner     the planner's choice for the budget, at each batch

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
from tfremat import errors
from tfremat import measure
from tfremat import models
from tfremat import planner
from tfremat import policies

__all__ = [
    "largest_batch",
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


def largest_batch(peak_at, memory_bytes, first, multiple=1, max_probes=10):
  """The largest batch (a multiple of `multiple`) whose peak fits.

  Peaks grow with the batch about linearly, so each probe after the first
  two is where the line through the two probes nearest the budget meets it,
  kept strictly between the largest batch known to fit and the smallest
  known not to (halfway, when the line points outside).

  Args:
    peak_at: batch -> the peak bytes of a training step at that batch, or
      None where no step is made at that batch (a budget the planner
      refuses there).
    memory_bytes: the budget.
    first: the batch to probe first.
    multiple: batches probed are multiples of it.
    max_probes: at most this many probes.

  Returns:
    (batch, probes): the largest batch found to fit (0 if none did), and
    {batch: peak bytes or None} for every batch probed.
  """
  probes = {}
  low, high = 0, None  # The largest batch that fits; the smallest that not.
  batch = max(multiple, first // multiple * multiple)
  while len(probes) < max_probes:
    probes[batch] = peak_at(batch)
    fits = probes[batch] is not None and probes[batch] <= memory_bytes
    if fits:
      low = max(low, batch)
    else:
      high = batch if high is None else min(high, batch)
    if high is not None and high - low <= multiple:
      break
    batch = _next_probe(probes, low, high, memory_bytes, multiple)
  return low, probes


def _next_probe(probes, low, high, memory_bytes, multiple):
  """Where the line through the two measured probes nearest the budget
  meets it, if that lies between `low` and `high`; else twice `low` (no
  batch known not to fit yet) or the middle. Where the line misleads (a
  planner's peaks do not grow along one; a budget it refuses), the search
  halves the interval instead."""
  measured = sorted((b for b, p in probes.items() if p is not None),
                    key=lambda b: abs(probes[b] - memory_bytes))[:2]
  guess = None
  if len(measured) == 2:
    (b1, b2) = measured
    slope = (probes[b2] - probes[b1]) / (b2 - b1)
    if slope > 0:
      guess = int(b1 + (memory_bytes - probes[b1]) / slope)
  if high is None:
    guess = 2 * low if guess is None else min(guess, 4 * max(low, multiple))
    guess = max(guess // multiple * multiple, low + multiple)
  elif guess is None or not low < guess < high:
    guess = (low + high) // 2
  if high is not None:
    guess = min(max(guess // multiple * multiple, low + multiple),
                high - multiple)
  return max(multiple, guess)


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

  def planned(batch):
    x = inputs(batch)
    try:
      return tfremat.remat_sequential(layers, budget=memory_bytes,
                                      sample_input=x, verbose=0), x
    except errors.BudgetUnreachableError:
      return None

  found = [
      Method("none", lambda b: (tfremat.RematSequential(
          layers, segments(False)), inputs(b))),
      Method("tf.recompute_grad", lambda b: (keras.Sequential(
          [_Recomputed(l) for l in layers]), inputs(b))),
      Method("keras.RematScope", scoped),
      Method("tfremat full", lambda b: (tfremat.RematSequential(
          layers, segments(True)), inputs(b)))]
  for p in policies.PLANNED:
    found.append(Method(f"tfremat policy {planner.short_policy_name(p)}",
                        lambda b, p=p: (tfremat.RematSequential(
                            layers, segments(True, p)), inputs(b))))
  return found + [Method("tfremat planner", planned)]


def _whole_methods(name, memory_bytes):
  build, inputs = _whole_parts(name)
  model = build()

  def scoped(batch):
    with keras.RematScope(mode="full"):
      return build(), inputs(batch)

  def planned(batch):
    x = inputs(batch)
    try:
      return tfremat.remat_model(model, budget=memory_bytes, sample_input=x,
                                 verbose=0), x
    except errors.BudgetUnreachableError:
      return None

  found = [
      Method("none", lambda b: (model, inputs(b))),
      Method("keras.RematScope", scoped),
      Method("tfremat full", lambda b: (tfremat.remat_model(model, "full"),
                                        inputs(b)))]
  for p in policies.PLANNED:
    found.append(Method(
        f"tfremat policy {planner.short_policy_name(p)}",
        lambda b, p=p: (tfremat.remat_model(model, "full", policy=p),
                        inputs(b))))
  return found + [Method("tfremat planner", planned)]


class _Failed(Exception):
  """A method's step failed to build or run (not a budget it refused)."""


def _peak_at(method, cache):
  """batch -> the method's peak at that batch (None where the planner
  refuses the budget); fills `cache` with {batch: (step, inputs)}. A step
  that fails raises `_Failed`: a smaller batch would fail the same way."""

  def peak(batch):
    try:
      made = method.make(batch)
      if made is None:
        return None
      layer, x = made
      step = chain.training_step(layer)
      found = measure.peak_bytes(step, x)
    except tf.errors.ResourceExhaustedError:
      return None
    except (ValueError, TypeError, tf.errors.OpError) as e:
      raise _Failed(f"fails: {_reason(e)}") from e
    cache[batch] = (step, x)
    return found

  return peak


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
                  log=None):
  """Rows for model `name`: each method's largest batch within
  `memory_bytes` and its examples per second there. Of the save policies,
  the one with the largest batch is kept (ties: the fastest). `log`, if
  given, is called with a line as each method's search ends."""
  rows = []
  with chain.retracing_quiet(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for method in methods(name, memory_bytes, blocks, width):
      cache, note = {}, ""
      start = time.perf_counter()
      first = _FIRST.get(name, 8)
      if method.name == "tfremat planner":
        # Each of its probes plans anew: start where full remat ended.
        first = max([r["batch"] for r in rows
                     if r["method"] == "tfremat full"] + [first])
      try:
        batch, probes = largest_batch(_peak_at(method, cache), memory_bytes,
                                      first, _MULTIPLE.get(name, 2))
      except _Failed as e:
        batch, probes, note = 0, {}, str(e)
      row = {"model": name, "method": method.name, "batch": batch,
             "peak_bytes": probes.get(batch), "probes": len(probes),
             "search_seconds": time.perf_counter() - start,
             "note": note if note or batch else "nothing fits"}
      if batch:
        row["step"], row["inputs"] = cache[batch]
      rows.append(row)
      if log is not None:
        log(f"{name}, {method.name}: batch {batch} ({len(probes)} probes, "
            f"{row['search_seconds']:.0f} s) {row['note']}".rstrip())
  _time_rows([r for r in rows if r["batch"]], rounds)
  return _best_policy(rows)


def _time_rows(rows, rounds):
  """Sets each row's median step seconds at its batch, timed round-robin
  in shuffled order (each step traced and run before)."""
  times = [[] for _ in rows]
  order = np.random.default_rng(0)
  for _ in range(rounds):
    for i in order.permutation(len(rows)):
      start = time.perf_counter()
      measure._wait(rows[i]["step"](rows[i]["inputs"]))  # pylint: disable=protected-access
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
  the squared outputs) peaked within the memory, searched in multiples of
  the model's step; x none: its ratio to the `none` row's. examples/s: the
  batch over the median step time at it ({rounds} rounds, every row once per
  round, in shuffled order); x none: per example, against `none`'s.
keras.RematScope: the model built inside keras.RematScope(mode="full"),
  which runs each layer through tf.recompute_grad. tfremat policy: every
  block (or remat_model(model, "full", policy=...)) under the built-in
  policy that fit the largest batch. tfremat planner:
  remat_sequential(..., budget=memory) or remat_model(..., budget=memory),
  planned at each batch tried; a batch whose budget it refuses does not
  fit."""


def format_table(rows, memory_bytes):
  """The rows as a text table, each model's ratios against its `none`."""
  header = (f"{'model':<14}{'method':<30}{'batch':>7}{'x none':>8}"
            f"{'peak MiB':>10}{'examples/s':>12}{'x none':>8}  note")
  lines = [f"memory: {measure.format_bytes(memory_bytes)}", header,
           "-" * (len(header) + 20)]
  base = {}
  for r in rows:
    if r["method"] == "none":
      base = r
    if not r["batch"]:
      lines.append(f"{r['model']:<14}{r['method']:<30}{0:>7}{'':>38}  "
                   f"{r['note']}")
      continue
    x_batch = r["batch"] / base["batch"] if base.get("batch") else float("nan")
    x_rate = (r["examples_per_second"] / base["examples_per_second"]
              if base.get("batch") else float("nan"))
    lines.append(
        f"{r['model']:<14}{r['method']:<30}{r['batch']:>7}{x_batch:>8.2f}"
        f"{r['peak_bytes'] / 2**20:>10.1f}{r['examples_per_second']:>12.1f}"
        f"{x_rate:>8.2f}  {r['note']}")
  return "\n".join(lines)
