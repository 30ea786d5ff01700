"""Benchmark: peak memory, step time and gradient error of remat methods.

  python -m tfremat.bench          # tf.function
  python -m tfremat.bench --jit    # tf.function(jit_compile=True)

Each method runs in its own process (allocator statistics and XLA caches are
per process) on the same model, weights, batch and dropout seeds:

  none               no rematerialization
  tf.recompute_grad  TensorFlow's built-in
  keras.remat        Keras 3's (on TensorFlow: tf.recompute_grad again)
  tfremat            tfremat.RematerializeFn

Peak memory is the allocator's peak during one training step above what was
allocated just before it (weights and the batch are not counted; activations,
temporaries and gradients are). Step time is the median over --steps calls.
The gradient error is the largest absolute difference from the `none`
method's gradients, with dropout active.
"""

import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app
from absl import flags
import numpy as np

METHODS = ("none", "tf.recompute_grad", "keras.remat", "tfremat")

FLAGS = flags.FLAGS


def define_flags():
  """The command line's flags; defined only when run as a program, so that
  importing the helpers below adds no flags to the importer's."""
  flags.DEFINE_bool("jit", False, "Compile the training step with XLA.")
  flags.DEFINE_integer("blocks", 16, "Residual MLP blocks.")
  flags.DEFINE_integer("width", 256, "Residual width; the hidden layer is 4x.")
  flags.DEFINE_integer("batch", 2048, "Batch size.")
  flags.DEFINE_float("dropout", 0.1, "Dropout rate inside every block.")
  flags.DEFINE_integer("steps", 10, "Timed steps per method.")
  flags.DEFINE_list("methods", list(METHODS), "Methods to run.")
  flags.DEFINE_string("worker", None, "Internal: run one method, write JSON.")
  flags.DEFINE_string("out", None, "Internal: the worker's output path.")

def residual_mlp(blocks, width, dropout, seed=0):
  """`blocks` Keras blocks h -> Dense(4w, relu) -> Dropout -> Dense(w)."""
  import keras  # pylint: disable=g-import-not-at-top
  keras.utils.set_random_seed(seed)
  model = []
  for i in range(blocks):
    block = keras.Sequential([
        keras.layers.Dense(4 * width, activation="relu"),
        keras.layers.Dropout(dropout, seed=1000 + i),
        keras.layers.Dense(width),
    ], name=f"block{i}")
    block.build((None, width))
    model.append(block)
  return model


def wrap(method, fn):
  """`fn` rematerialized by `method` (one of METHODS)."""
  import keras  # pylint: disable=g-import-not-at-top
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import tfremat  # pylint: disable=g-import-not-at-top
  wrappers = {
      "none": lambda f: f,
      "tf.recompute_grad": tf.recompute_grad,
      "keras.remat": keras.remat,
      "tfremat": lambda f: lambda *xs: tfremat.RematerializeFn(f, *xs),
  }
  if method not in wrappers:
    raise ValueError(
        f"Unknown method {method!r}; choose from {', '.join(METHODS)}.")
  return wrappers[method](fn)


def residual_step(blocks, method, jit):
  """A tf.function training step over a residual stack: loss gradients."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  calls = [wrap(method, lambda h, b=b: b(h, training=True)) for b in blocks]
  variables = [v for b in blocks for v in b.trainable_weights]

  @tf.function(jit_compile=jit)
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      h = x
      for call in calls:
        h = h + call(h)
      loss = tf.reduce_mean(h * h)
    return tape.gradient(loss, [x] + variables)

  return step


def peak_step_bytes(step, *args):
  """Peak allocator bytes of one `step(*args)` call above the prior level.

  `step` must already be traced (call it once first), so that tracing and
  compilation are not measured.
  """
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  device = "GPU:0" if tf.config.list_logical_devices("GPU") else "CPU:0"
  tf.config.experimental.reset_memory_stats(device)
  baseline = tf.config.experimental.get_memory_info(device)["current"]
  result = step(*args)
  tf.nest.map_structure(lambda t: t.numpy(), result)  # Wait for the step.
  return tf.config.experimental.get_memory_info(device)["peak"] - baseline


def _run_worker(method, out):
  """Measures one method in this process and writes the results to `out`."""
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  blocks = residual_mlp(FLAGS.blocks, FLAGS.width, FLAGS.dropout)
  x = tf.random.stateless_normal([FLAGS.batch, FLAGS.width], seed=[1, 2])
  step = residual_step(blocks, method, FLAGS.jit)
  # The first call traces; its gradients (same weights and seed states in
  # every process) are the ones compared across methods.
  grads = [g.numpy() for g in step(x)]
  peak = peak_step_bytes(step, x)
  times = []
  for _ in range(FLAGS.steps):
    start = time.perf_counter()
    step(x)[0].numpy()
    times.append(time.perf_counter() - start)
  np.savez(out + ".npz", *grads)
  with open(out, "w") as f:
    json.dump({"peak_bytes": int(peak), "step_seconds": times}, f)


def _run_method(method, out):
  args = [sys.executable, "-m", "tfremat.bench", f"--worker={method}",
          f"--out={out}", f"--blocks={FLAGS.blocks}", f"--width={FLAGS.width}",
          f"--batch={FLAGS.batch}", f"--dropout={FLAGS.dropout}",
          f"--steps={FLAGS.steps}", f"--jit={FLAGS.jit}"]
  env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
  proc = subprocess.run(args, env=env, capture_output=True, text=True,
                        check=False)
  if proc.returncode != 0:
    raise RuntimeError(f"Method {method} failed:\n{proc.stderr[-3000:]}")
  with open(out) as f:
    result = json.load(f)
  with np.load(out + ".npz") as grads:
    result["grads"] = [grads[k] for k in sorted(grads.files,
                                               key=lambda k: int(k[4:]))]
  return result


def format_table(results):
  """The results as a text table, ratios relative to the `none` method."""
  base = results.get("none")
  header = (f"{'method':<20}{'peak MiB':>10}{'x none':>8}{'step ms':>10}"
            f"{'x none':>8}{'max |grad - none|':>20}")
  lines = [header, "-" * len(header)]
  for method, r in results.items():
    peak = r["peak_bytes"] / 2**20
    ms = 1000 * float(np.median(r["step_seconds"]))
    if base is None:
      ratios, diff = ("", ""), ""
    else:
      base_ms = 1000 * float(np.median(base["step_seconds"]))
      ratios = (f"{r['peak_bytes'] / base['peak_bytes']:.2f}",
                f"{ms / base_ms:.2f}")
      diff = max(float(np.abs(a - b).max())
                 for a, b in zip(r["grads"], base["grads"]))
      diff = f"{diff:.3g}"
    lines.append(f"{method:<20}{peak:>10.1f}{ratios[0]:>8}{ms:>10.1f}"
                 f"{ratios[1]:>8}{diff:>20}")
  return "\n".join(lines)


def main(argv):
  del argv
  if FLAGS.worker:
    _run_worker(FLAGS.worker, FLAGS.out)
    return
  unknown = set(FLAGS.methods) - set(METHODS)
  if unknown:
    raise app.UsageError(
        f"Unknown --methods {sorted(unknown)}; choose from {', '.join(METHODS)}.")
  methods = [m for m in METHODS if m in FLAGS.methods]
  import keras  # pylint: disable=g-import-not-at-top
  progress = keras.utils.Progbar(len(methods), unit_name="method")
  print(f"Residual MLP: {FLAGS.blocks} blocks, width {FLAGS.width} "
        f"(hidden {4 * FLAGS.width}), batch {FLAGS.batch}, dropout "
        f"{FLAGS.dropout}, {'XLA' if FLAGS.jit else 'tf.function'}, "
        f"{FLAGS.steps} timed steps")
  results = {}
  with tempfile.TemporaryDirectory() as tmp:
    for i, method in enumerate(methods):
      results[method] = _run_method(method, os.path.join(tmp, f"{i}.json"))
      progress.add(1)
  print(format_table(results))


if __name__ == "__main__":
  define_flags()
  app.run(main)
