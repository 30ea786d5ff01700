"""The methods the bench compares, block by block, on one model: each
method's training step, and its peak, first call, gradients and step time
measured in one process (`measure_methods`)."""

import time

import keras
import numpy as np
import tensorflow as tf

import tfremat
from tfremat import errors
from tfremat import measure
from tfremat import models

__all__ = [
    "METHODS",
    "DEFAULTS",
    "TRACE_ROUNDS",
    "wrap",
    "residual_step",
    "transformer_step",
    "make_step",
    "chain_and_batch",
    "measure_methods",
    "gradient_error",
    "add_times",
]

METHODS = ("none", "tf.recompute_grad", "keras.remat", "tfremat",
           "tfremat.layer")

# Per-model default sizes; the command line's flags override them.
DEFAULTS = {
    "mlp": dict(blocks=16, width=256, batch=2048),
    "transformer": dict(blocks=8, width=128, batch=32, seq_len=128, heads=4,
                        vocab=256),
}

# Rounds of tracing timed per method (`measure_methods`).
TRACE_ROUNDS = 3


def wrap(method, block, policy=None):
  """`block`'s training-mode call, rematerialized by `method` (see METHODS);
  the tfremat methods under the save policy `policy`."""
  call = lambda h: block(h, training=True)
  if method == "none":
    return call
  if method == "tf.recompute_grad":
    return tf.recompute_grad(call)
  if method == "keras.remat":
    return keras.remat(call)
  if method == "tfremat":
    return lambda h: tfremat.RematerializeFn(call, h, policy=policy)
  if method == "tfremat.layer":
    layer = tfremat.RematerializationLayer(block, policy=policy)
    return lambda h: layer(h, training=True)
  raise errors.InvalidArgumentError(
      f"Unknown method {method!r}; choose from {', '.join(METHODS)}.")


def _compiled(step, jit, eager):
  """`step` as a tf.function (XLA-compiled with `jit`), or eager."""
  if eager:
    if jit:
      raise errors.InvalidArgumentError(
          "--eager and --jit exclude each other.")
    return step
  return tf.function(step, jit_compile=jit)


def residual_step(blocks, method, jit, eager=False, policy=None):
  """A training step over residual MLP blocks: the loss gradients."""
  calls = [wrap(method, b, policy) for b in blocks]
  variables = [v for b in blocks for v in b.trainable_weights]

  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      h = x
      for call in calls:
        h = h + call(h)
      loss = tf.reduce_mean(h * h)
    return tape.gradient(loss, [x] + variables)

  return _compiled(step, jit, eager)


def transformer_step(parts, method, jit, eager=False, policy=None):
  """A language-model training step over transformer blocks: the gradients."""
  embed, blocks, head = parts
  calls = [wrap(method, b, policy) for b in blocks]
  variables = [v for m in [embed] + blocks + [head]
               for v in m.trainable_weights]
  loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

  def step(tokens):
    with tf.GradientTape() as tape:
      h = embed(tokens[:, :-1])
      for call in calls:
        h = call(h)
      loss = loss_fn(tokens[:, 1:], head(h))
    return tape.gradient(loss, variables)

  return _compiled(step, jit, eager)


def make_step(model, method, jit, sizes, dropout, eager=False, policy=None):
  """The model's training step under `method`, and its input batch."""
  if model == "mlp":
    blocks = models.residual_mlp(sizes["blocks"], sizes["width"], dropout)
    x = tf.random.stateless_normal([sizes["batch"], sizes["width"]],
                                   seed=[1, 2])
    return residual_step(blocks, method, jit, eager, policy), x
  parts = models.transformer_parts(
      sizes["vocab"], sizes["seq_len"] - 1, sizes["width"], sizes["heads"],
      sizes["blocks"], dropout)
  return transformer_step(parts, method, jit, eager, policy), _tokens(sizes)


def _tokens(sizes):
  """The transformer's batch of token ids, the same in every process."""
  return tf.random.stateless_uniform(
      [sizes["batch"], sizes["seq_len"]], seed=[1, 2], maxval=sizes["vocab"],
      dtype=tf.int32)


def chain_and_batch(model, sizes, dropout):
  """The model's blocks as a chain of layers, and the chain's input batch."""
  if model == "mlp":
    blocks = models.residual_mlp(sizes["blocks"], sizes["width"], dropout,
                                 residual_inside=True)
    return blocks, tf.random.stateless_normal(
        [sizes["batch"], sizes["width"]], seed=[1, 2])
  embed, blocks, _ = models.transformer_parts(
      sizes["vocab"], sizes["seq_len"], sizes["width"], sizes["heads"],
      sizes["blocks"], dropout)
  return blocks, embed(_tokens(sizes))


def add_times(rows, steps, *args, rounds):
  """Times `steps` round-robin in shuffled order (`measure.seconds`); sets
  each row's median and quartiles of step seconds."""
  for row, times in zip(rows, measure.seconds(steps, *args, repeats=rounds)):
    row["step_seconds"] = float(np.median(times))
    row["step_p25_seconds"], row["step_p75_seconds"] = (
        float(q) for q in np.percentile(times, [25, 75]))


def measure_methods(model, methods, sizes, dropout, *, jit=False,
                    eager=False, policy=None, rounds=10, progress=None):
  """Peak, first call, gradients and step times of each of `methods` on
  `model` ("mlp" or "transformer", at `sizes`), in this process.

  Every method builds the same model (same weights and dropout seeds). A
  throwaway step runs first, so that TensorFlow's one-time start-up costs
  fall on no method's first call. Step times are medians (and quartiles)
  over `rounds` rounds that call every method once, in shuffled order
  (`measure.seconds`), so a drift in the machine's speed touches all
  methods alike; tracing alone is timed the same way over `TRACE_ROUNDS`
  (not in eager mode).
  """
  make = lambda method: make_step(model, method, jit, sizes, dropout, eager,
                                  policy)
  warm_step, batch = make("none")
  warm_step(batch)
  results, steps = {}, []
  for method in methods:
    step, batch = make(method)
    start = time.perf_counter()
    grads = [np.asarray(tf.convert_to_tensor(g)) for g in step(batch)]
    first_call = time.perf_counter() - start
    calls = measure.step_peaks(step, batch, warmup=False)
    results[method] = {
        "peak_bytes": max(c.requested_bytes for c in calls),
        "allocated_bytes": max(c.allocated_bytes for c in calls),
        "first_call_seconds": first_call, "grads": grads}
    steps.append(step)
    if progress is not None:
      progress.add(1)
  add_times(list(results.values()), steps, batch, rounds=rounds)
  if not eager:
    # A first call's time is one sample (and includes running the step); on
    # a shared machine one sample of the same work varied by 30%.
    traces = measure.median_seconds(
        [lambda m=m: make(m)[0].get_concrete_function(batch)
         for m in methods], repeats=TRACE_ROUNDS, warmup=False)
    for method, trace_seconds in zip(methods, traces):
      results[method]["trace_seconds"] = trace_seconds
  return results


def gradient_error(grads, expected):
  """max |grads - expected| / max |expected| over all the gradients: the
  tests' one scale for all tensors."""
  scale = max((float(np.abs(e).max()) for e in expected if e.size),
              default=0.0)
  worst = max((float(np.abs(a - e).max()) for a, e in zip(grads, expected)
               if e.size), default=0.0)
  return worst / scale if scale else worst
