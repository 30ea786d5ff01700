"""Benchmark: peak memory, step time and gradient error of remat methods.

  python -m tfremat.bench                      # residual MLP, tf.function
  python -m tfremat.bench --jit                # tf.function(jit_compile=True)
  python -m tfremat.bench --eager              # no tf.function: eager mode
  python -m tfremat.bench --model transformer  # causal transformer LM
  python -m tfremat.bench --budget-fraction 0.5  # the planner at 50% peak
  python -m tfremat.bench --sweep --csv sweep.csv --plot sweep.png
  python -m tfremat.bench --sweep --plot     # the default file, sweep.png
  python -m tfremat.bench --policy dots_saveable  # tfremat under a policy
  python -m tfremat.bench --whole_models all   # remat_model on real models
  python -m tfremat.bench --max_batch 512MiB   # the largest batch that fits

The tables go to standard output; TensorFlow's start-up lines (CPU
features, CUDA drivers looked for) go to standard error, and
TF_CPP_MIN_LOG_LEVEL=2 in the environment silences them.

Every method runs in one process on the same model, weights, batch and
dropout seeds:

  none               no rematerialization
  tf.recompute_grad  TensorFlow's built-in
  keras.remat        Keras 3's (on TensorFlow: tf.recompute_grad again)
  tfremat            tfremat.RematerializeFn around each block's call
  tfremat.layer      tfremat.RematerializationLayer around each block

Peak memory is the largest total of the tensors one training step allocates
and has not yet freed, above what was allocated just before it (weights and
the batch are not counted; activations, temporaries and gradients are), the
largest over 5 calls: what a budget bounds. The methods table also gives the
allocator's overhead over it (alloc x). Step time is the
median over --steps rounds, each calling every method once in shuffled order;
the first call, which traces (and compiles, with --jit), is timed apart, and
so is tracing alone (median of 3 shuffled rounds; not in eager mode).
The gradient error is the largest absolute difference from the `none`
method's gradients over the largest of those gradients, with dropout active.

--policy runs the tfremat methods under a save policy (`tfremat.policies`).

--budget-fraction and --sweep compare ways of choosing what to
rematerialize, on the model's blocks as a chain (`tfremat.RematSequential`),
in one process: uniform schemes (every block, every 2nd or 4th block, about
sqrt(n) segments, and, in the sweep, every block under each save policy the
planner chooses among) and the planner, choosing per segment among keeping,
rematerializing fully and rematerializing under each of those policies, at
fractions of the measured no-remat peak.

--whole_models runs `tfremat.remat_model` on models nobody on this project
wrote (`keras.applications` CNNs and, with keras-hub installed, KerasHub
backbones; `tfremat.models.whole_model` has their sizes): the original, each
mode, and the planner at --budget-fraction (default 0.5), one model after
another in this process.
"""

import csv
import os
import platform
import textwrap
import time
import warnings

from absl import app
from absl import flags
import keras
import numpy as np
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import max_batch
from tfremat import measure
from tfremat import models
from tfremat import planner
from tfremat import policies
from tfremat._src.planning import chain_plan
from tfremat._src.planning import measure as measure_impl

__all__ = [
    "main",
    "define_flags",
    "chain_and_batch",
    "measure_methods",
    "format_table",
    "gradient_error",
    "format_scheme_table",
    "measure_whole_model",
    "format_whole_table",
    "uniform_schemes",
    "policy_schemes",
    "mark_dominated",
    "METHODS",
]

METHODS = ("none", "tf.recompute_grad", "keras.remat", "tfremat",
           "tfremat.layer")

# Per-model default sizes; flags override them.
DEFAULTS = {
    "mlp": dict(blocks=16, width=256, batch=2048),
    "transformer": dict(blocks=8, width=128, batch=32, seq_len=128, heads=4,
                        vocab=256),
}

FLAGS = flags.FLAGS


def define_flags():
  """The command line's flags; defined only when run as a program, so that
  importing the helpers below adds no flags to the importer's."""
  flags.DEFINE_enum("model", "mlp", sorted(DEFAULTS),
                    "mlp: residual MLP blocks; transformer: causal LM blocks.")
  flags.DEFINE_bool("jit", False, "Compile the training step with XLA.")
  flags.DEFINE_bool("eager", False,
                    "Run the training step eagerly, without tf.function.")
  flags.DEFINE_integer("blocks", None, "Blocks (default: per model).")
  flags.DEFINE_integer("width", None, "Model width (default: per model).")
  flags.DEFINE_integer("batch", None, "Batch size (default: per model).")
  flags.DEFINE_integer("seq_len", None, "Transformer sequence length.")
  flags.DEFINE_integer("heads", None, "Transformer attention heads.")
  flags.DEFINE_integer("vocab", None, "Transformer vocabulary size.")
  flags.DEFINE_float("dropout", 0.1, "Dropout rate inside every block.")
  flags.DEFINE_integer("steps", 10, "Timed rounds (one step per method).")
  flags.DEFINE_list("methods", list(METHODS), "Methods to run.")
  flags.DEFINE_enum("policy", None, sorted(policies.BUILT_IN),
                    "The save policy of the tfremat methods (default: "
                    "none, everything is recomputed).")
  flags.DEFINE_list("planner_policies", [p.name for p in policies.PLANNED],
                    "The save policies the planner may choose per segment "
                    "(empty: recompute fully or keep).")
  flags.DEFINE_float("budget_fraction", None,
                     "Run the planner at this fraction of the measured "
                     "no-remat peak, beside rematerializing nothing and "
                     "every block.")
  flags.DEFINE_bool("sweep", False,
                    "Run every uniform scheme and the planner at 30%, 50%, "
                    "80% and 100% of the no-remat peak.")
  flags.DEFINE_list("whole_models", [],
                    "Models to run remat_model's modes and a budget on "
                    "(all: every one available): " +
                    ", ".join(list(models.APPLICATIONS) +
                              list(models.HUB_BACKBONES)) + ".")
  flags.DEFINE_string("max_batch", None,
                      "A memory budget (\"512MiB\", \"1GiB\"): find, by "
                      "measuring, the largest batch each method trains "
                      "within it, and its examples per second.")
  flags.DEFINE_list("max_batch_models", list(max_batch.MODELS),
                    "The models --max_batch runs (--blocks and --width size "
                    "mlp and transformer).")
  flags.DEFINE_string("csv", "sweep.csv", "Where --sweep writes its CSV.")
  flags.DEFINE_string("plot", "sweep.png",
                      "Where --sweep draws its plot (needs matplotlib: "
                      "pip install .[bench]).")

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
  raise ValueError(
      f"Unknown method {method!r}; choose from {', '.join(METHODS)}.")


def _compiled(step, jit, eager):
  """`step` as a tf.function (XLA-compiled with `jit`), or eager."""
  if eager:
    if jit:
      raise ValueError("--eager and --jit exclude each other.")
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


def uniform_schemes(num_blocks):
  """The classic choices: name -> segments."""
  schemes = {"none": planner.keep_all(num_blocks)}
  for k, name in ((1, "every block"), (2, "every 2nd block"),
                  (4, "every 4th block")):
    if k <= num_blocks:
      schemes[name] = [planner.Segment(i, i + 1, i % k == 0)
                       for i in range(num_blocks)]
  schemes["sqrt segments"] = planner.uniform_segments(num_blocks, "sqrt")
  return schemes


def policy_schemes(num_blocks, names):
  """Every block rematerialized under each save policy: name -> segments."""
  return {f"every block, {policies.short_name(p)}":
          [planner.Segment(i, i + 1, True, p) for i in range(num_blocks)]
          for p in names}


def _schemes_and_plans(fractions, progress):
  """Measures uniform schemes and planner choices; returns result rows."""
  blocks, x = chain_and_batch(FLAGS.model, _sizes(), FLAGS.dropout)
  rows, steps = [], []

  def run(name, kind, segments, fraction=None, plan_seconds=None,
          layer=None):
    # The planner's rows run as remat_sequential(budget=...) returns them.
    layer = layer or tfremat.RematSequential(blocks, segments)
    step = chain.training_step(layer, jit=FLAGS.jit)
    used = sorted({policies.short_name(s.policy) for s in segments
                   if s.remat and s.policy})
    rows.append({"scheme": name, "kind": kind,
                 "rematerialized": sum(s.stop - s.start for s in segments
                                       if s.remat),
                 "policies": " ".join(used),
                 "peak_bytes": measure.peak_bytes(step, x),
                 "budget_fraction": fraction, "plan_seconds": plan_seconds})
    steps.append(step)
    progress.add(1)

  names = _planner_policies()
  schemes = uniform_schemes(len(blocks))
  if FLAGS.sweep:
    schemes.update(policy_schemes(len(blocks), names))
  else:
    schemes = {k: schemes[k] for k in ("none", "every block")}
  for name, segments in schemes.items():
    run(name, "policy" if any(s.policy for s in segments) else "uniform",
        segments)
  full = rows[0]["peak_bytes"]
  start = time.perf_counter()
  with chain.retracing_quiet():
    costs = chain.measure_chain(blocks, x, policies=names)
  costs_seconds = time.perf_counter() - start
  for fraction in fractions:
    start = time.perf_counter()
    try:
      chosen = chain.checked_plan(blocks, int(fraction * full), x,
                                  costs=costs)
    except ValueError as e:
      print(f"\nplanner at {fraction:.0%}: {e}")
      progress.add(1)
      continue
    print(f"\nplanner at {fraction:.0%} of {full / 2**20:.1f} MiB:\n{chosen}")
    # What remat_sequential(budget=...) would take: the chain's measurement
    # (shared by the fractions here) and this fraction's checked plan.
    run(f"planner {fraction:.0%}", "planner", chosen.segments, fraction,
        costs_seconds + time.perf_counter() - start,
        chain.apply_plan(blocks, chosen))
  _add_times(rows, steps, x)
  mark_dominated(rows)
  for r in rows:
    r["peak_x_none"] = _ratio(r["peak_bytes"], full)
    r["step_x_none"] = _ratio(r["step_seconds"], rows[0]["step_seconds"])
    r["budget_bytes"] = (None if r["budget_fraction"] is None else
                         int(r["budget_fraction"] * full))
    r["fits"] = (None if r["budget_bytes"] is None else
                 r["peak_bytes"] <= r["budget_bytes"])
  return rows


def mark_dominated(rows):
  """Sets each row's "dominated_by": the name of a row that beats it on both
  axes (a lower peak, and a step time whose 75th percentile is below this
  row's 25th), the one with the lowest peak of those; "" where none does.
  A dominated row is a choice no user should make, and a dominated planner
  row is a regression."""
  for r in rows:
    better = [s for s in rows
              if s["peak_bytes"] < r["peak_bytes"] and
              s["step_p75_seconds"] < r["step_p25_seconds"]]
    r["dominated_by"] = (min(better, key=lambda s: s["peak_bytes"])["scheme"]
                         if better else "")
  return rows


def _planner_policies():
  try:
    return chain_plan.planned_policies(n for n in FLAGS.planner_policies if n)
  except ValueError as e:
    raise app.UsageError(f"--planner_policies: {e}") from e


def _add_times(rows, steps, *args):
  """Times `steps` round-robin in shuffled order (`measure.seconds`); sets
  each row's median and quartiles of step seconds."""
  for row, times in zip(rows, measure.seconds(steps, *args,
                                              repeats=FLAGS.steps)):
    row["step_seconds"] = float(np.median(times))
    row["step_p25_seconds"], row["step_p75_seconds"] = (
        float(q) for q in np.percentile(times, [25, 75]))


def _ratio(value, base):
  """value / base; nan when a tiny run's base measured 0."""
  return value / base if base else float("nan")


def _spread(r):
  return (f"{1000 * r['step_p25_seconds']:.1f}-"
          f"{1000 * r['step_p75_seconds']:.1f}")


LEGEND = """\
peak MiB: the largest total of the tensors one training step allocates and
  has not yet freed, above what was allocated just before it (weights and
  the batch are not counted), the largest of 5 calls
  (tfremat.measure.peak_bytes). x none: the ratio to the `none` row.
step ms: the median over {steps} rounds, each calling every row's step once,
  in shuffled order; IQR: the 25th-75th percentiles of those times, so a
  difference inside them is noise."""

METHOD_LEGEND = LEGEND + """
grad error: max |gradient - the `none` row's| / max |the `none` row's|, over
  all gradients, with dropout active (0: exact; the tests' one scale).
first call ms: the first call, which traces (and compiles, with --jit);
  trace ms: tracing alone, the median of 3.
alloc x: the allocator's overhead over the peak: the largest total of the
  chunks it gave the step's tensors, over their requested bytes (the peak
  counts those; a budget bounds them)."""

SCHEME_LEGEND = LEGEND + """
remat: how many blocks are rematerialized; policies: the save policies the
  rematerialized blocks run under (none: everything is recomputed; dots:
  dots_saveable; dots/nobatch, or dots/nob in a union:
  dots_with_no_batch_dims_saveable; masks: masks_saveable; softmax:
  softmax_saveable; +: together). budget MiB: the planner's budget, a
  fraction of the `none` row's peak; fits: whether the measured peak is
  within it; plan s: seconds the planner took for it (measuring the chain,
  then checking plans), as remat_sequential(budget=...) would.
dominated by: a scheme with a lower peak whose step time's 75th percentile
  is below this one's 25th: faster and smaller, beyond the timing's noise."""


def format_scheme_table(rows):
  """Scheme rows as a table; ratios relative to the `none` row."""
  wide = max([28] + [len(r["scheme"]) + 1 for r in rows])
  policies_wide = max([34] + [len(r["policies"]) + 1 for r in rows])
  header = (f"{'scheme':<{wide}}{'remat':>6}  {'policies':<{policies_wide}}"
            f"{'peak MiB':>9}{'x none':>8}{'step ms':>10}{'IQR ms':>14}"
            f"{'x none':>8}{'budget MiB':>12}{'fits':>6}{'plan s':>8}"
            "  dominated by")
  lines = [header, "-" * len(header)]
  for r in rows:
    budget = ("" if r["budget_bytes"] is None else
              f"{r['budget_bytes'] / 2**20:.1f}")
    fits = "" if r["fits"] is None else "yes" if r["fits"] else "NO"
    plan_s = ("" if r.get("plan_seconds") is None else
              f"{r['plan_seconds']:.1f}")
    lines.append(
        f"{r['scheme']:<{wide}}{r['rematerialized']:>6}  "
        f"{r['policies']:<{policies_wide}}"
        f"{r['peak_bytes'] / 2**20:>9.1f}{r['peak_x_none']:>8.2f}"
        f"{1000 * r['step_seconds']:>10.1f}{_spread(r):>14}"
        f"{r['step_x_none']:>8.2f}{budget:>12}{fits:>6}{plan_s:>8}"
        f"  {r.get('dominated_by', '')}".rstrip())
  return "\n".join(lines)


# The CSV's columns: the printed table's, in bytes and seconds.
CSV_COLUMNS = ("scheme", "kind", "rematerialized", "policies", "peak_bytes",
               "peak_x_none", "step_seconds", "step_p25_seconds",
               "step_p75_seconds", "step_x_none", "budget_fraction",
               "budget_bytes", "fits", "plan_seconds", "dominated_by")


def write_csv(rows, path):
  with open(path, "w", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows({k: r.get(k) for k in CSV_COLUMNS} for r in rows)


def _label_offsets(boxes, height):
  """Vertical offsets (points) for point labels so that no two overlap.

  `boxes` holds each label's left edge x, its point's height y and its
  width, in points. Each label, in order, takes the first free place among
  its point's height and steps of `height` below and above it.
  """
  placed, offsets = [], []
  for x, y, width in boxes:
    for k in range(60):
      dy = 2 + (k + 1) // 2 * height * (-1 if k % 2 else 1)
      if not any(x < px + pw and px < x + width and abs(y + dy - py) < height
                 for px, py, pw in placed):
        break
    placed.append((x, y + dy, width))
    offsets.append(dy)
  return offsets


def plot_pareto(rows, path, title):
  """Peak memory vs step time, with budgets, fits and the Pareto front;
  False without matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(8, 5))
  mib = lambda r: r["peak_bytes"] / 2**20
  ms = lambda r: 1000 * r["step_seconds"]
  for r in rows:
    if r["budget_bytes"] is not None:
      ax.axvline(r["budget_bytes"] / 2**20, color="gray", linewidth=0.8,
                 linestyle=":")
      ax.text(r["budget_bytes"] / 2**20, 0.98,
              f"{r['budget_fraction']:.0%} budget ", fontsize=7,
              color="gray", rotation=90, va="top", ha="right",
              transform=ax.get_xaxis_transform())
  styles = (("uniform", "o", "tab:blue", None),
            ("policy", "D", "tab:purple", None),
            ("planner", "s", "tab:green", True),
            ("planner", "X", "tab:red", False))
  dominated = [r for r in rows if r.get("dominated_by")]
  if dominated:
    ax.scatter([mib(r) for r in dominated], [ms(r) for r in dominated],
               s=220, facecolors="none", edgecolors="tab:orange",
               linewidths=1.5, zorder=3,
               label="dominated: another scheme is smaller and faster")
  for kind, marker, color, fits in styles:
    part = [r for r in rows if r["kind"] == kind and r["fits"] == fits]
    if not part:
      continue
    label = {"uniform": "uniform", "policy": "every block under a policy"}.get(
        kind) if fits is None else (
            "planner, fits its budget" if fits else "planner, over its budget")
    ax.errorbar([mib(r) for r in part], [ms(r) for r in part],
                yerr=[[ms(r) - 1000 * r["step_p25_seconds"] for r in part],
                      [1000 * r["step_p75_seconds"] - ms(r) for r in part]],
                fmt=marker, color=color, capsize=3, label=label)
  ordered = sorted(rows, key=lambda r: (mib(r), ms(r)))
  # Times differ by tens of percent, not from zero: the axis spans them.
  low = min(1000 * r["step_p25_seconds"] for r in rows)
  high = max(1000 * r["step_p75_seconds"] for r in rows)
  ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
  ax.set_xlim(0, 1.2 * max(mib(r) for r in rows))  # Room for labels.
  ax.set_xlabel("peak memory of a training step (MiB)")
  ax.set_ylabel("median step time (ms); bars: 25th-75th percentile")
  ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
  fig.tight_layout()
  to_points = lambda r: ax.transData.transform((mib(r), ms(r))) * 72 / fig.dpi
  fontsize = 7
  offsets = _label_offsets(
      [(to_points(r)[0] + 5, to_points(r)[1], 0.55 * fontsize *
        len(r["scheme"])) for r in ordered], height=fontsize + 2)
  for r, dy in zip(ordered, offsets):
    # A label moved away from its point gets a thin line to it.
    ax.annotate(r["scheme"], (mib(r), ms(r)), textcoords="offset points",
                xytext=(5, dy), fontsize=fontsize, va="center",
                arrowprops=(dict(arrowstyle="-", color="gray", linewidth=0.5)
                            if abs(dy) > fontsize else None))
  front, best = [], float("inf")
  for r in ordered:
    if r["step_seconds"] < best:
      front.append(r)
      best = r["step_seconds"]
  ax.step([mib(r) for r in front], [ms(r) for r in front], where="post",
          color="gray", linestyle="--", label="Pareto front")
  ax.legend(loc="lower left", fontsize=8)  # Fast and small: empty.
  fig.savefig(path, dpi=120)
  return True


def environment():
  """One line: the machine, Python, TensorFlow and Keras versions."""
  return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"measured on {measure.memory_device()}; Python "
          f"{platform.python_version()}, TensorFlow {tf.__version__}, Keras "
          f"{keras.__version__}")


def _mode_name():
  return "eager" if FLAGS.eager else "XLA" if FLAGS.jit else "tf.function"


def _sizes():
  return {k: (getattr(FLAGS, k) if getattr(FLAGS, k) is not None else v)
          for k, v in DEFAULTS[FLAGS.model].items()}


def measure_methods(methods, progress=None):
  """Peak, first call, gradients and step times of each method, in this
  process.

  Every method builds the same model (same weights and dropout seeds). A
  throwaway step runs first, so that TensorFlow's one-time start-up costs
  fall on no method's first call. Step times are medians (and quartiles) over
  rounds that call every method once, in shuffled order (`measure.seconds`),
  so a drift in the machine's speed touches all methods alike.
  """
  make = lambda method: make_step(FLAGS.model, method, FLAGS.jit, _sizes(),
                                  FLAGS.dropout, FLAGS.eager, FLAGS.policy)
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
  _add_times(list(results.values()), steps, batch)
  if not FLAGS.eager:
    traces = _median_trace_seconds(make, methods, batch, TRACE_ROUNDS)
    for method, trace_seconds in zip(methods, traces):
      results[method]["trace_seconds"] = trace_seconds
  return results


TRACE_ROUNDS = 3


def _median_trace_seconds(make, methods, batch, rounds):
  """Median seconds to trace each method's step, over shuffled rounds.

  A first call's time is one sample (and includes running the step); on a
  shared machine one sample of the same work varied by 30%.
  """
  times = [[] for _ in methods]
  order = np.random.default_rng(1)
  for _ in range(rounds):
    for i in order.permutation(len(methods)):
      step, _ = make(methods[i])
      start = time.perf_counter()
      step.get_concrete_function(batch)
      times[i].append(time.perf_counter() - start)
  return [float(np.median(t)) for t in times]


def _ms(seconds):
  return "-" if seconds is None else f"{1000 * seconds:.1f}"


def gradient_error(grads, expected):
  """max |grads - expected| / max |expected| over all the gradients: the
  tests' one scale for all tensors."""
  scale = max((float(np.abs(e).max()) for e in expected if e.size),
              default=0.0)
  worst = max((float(np.abs(a - e).max()) for a, e in zip(grads, expected)
               if e.size), default=0.0)
  return worst / scale if scale else worst


def format_table(results):
  """The results as a text table, ratios relative to the `none` method."""
  base = results.get("none")
  header = (f"{'method':<20}{'peak MiB':>10}{'x none':>8}{'step ms':>10}"
            f"{'IQR ms':>14}{'x none':>8}{'grad error':>12}"
            f"{'first call ms':>15}{'trace ms':>10}{'alloc x':>9}")
  lines = [header, "-" * len(header)]
  for method, r in results.items():
    peak = r["peak_bytes"] / 2**20
    ms = 1000 * r["step_seconds"]
    if base is None:
      ratios, diff = ("", ""), ""
    else:
      base_ms = 1000 * base["step_seconds"]
      ratios = (f"{_ratio(r['peak_bytes'], base['peak_bytes']):.2f}",
                f"{_ratio(ms, base_ms):.2f}")
      diff = f"{gradient_error(r['grads'], base['grads']):.3g}"
    lines.append(f"{method:<20}{peak:>10.1f}{ratios[0]:>8}{ms:>10.1f}"
                 f"{_spread(r):>14}{ratios[1]:>8}{diff:>12}"
                 f"{1000 * r['first_call_seconds']:>15.1f}"
                 f"{_ms(r.get('trace_seconds')):>10}"
                 f"{_ratio(r['allocated_bytes'], r['peak_bytes']):>9.2f}")
  return "\n".join(lines)


WHOLE_MODES = ("full", "activations", "larger_than")

WHOLE_LEGEND = """\
peak MiB: the largest total of the tensors one training step (the gradient
  of the sum of the squared float outputs) allocates and has not yet freed,
  above what was allocated just before it, the largest of 5 calls. x: the ratio to the original's row.
step ms: the median over {steps} rounds, each calling every row's step once,
  in shuffled order. first call s: tracing and running the first step,
  after a throwaway step of the original has run.
"full", "activations", "larger_than": remat_model(model, mode=...),
  "larger_than" sizing outputs on the batch; "selects nothing": the mode
  chose no layer, and the step is the original's.
budget: remat_model(model, budget=..., sample_input=batch); the note gives
  the seconds that call took, and its plan's measured bound as a fraction
  of the original's peak (its largest peak, plus the spread of its calls,
  plus the reserve), or the lowest bound it found when it refused."""


def measure_whole_model(name, budget=0.5, rounds=5):
  """Rows for the model `name` (`models.whole_model`): the original, each
  of `remat_model`'s modes and a plan for `budget`, measured in this
  process: peak, step time, first call; planning time for the budget."""
  model, batch = models.whole_model(name)
  made, notes = {"original": model}, {}
  # Recorded, not shown: a mode that selects nothing is noted in the table,
  # and the rest (a layer whose configuration will not save) do not bear on
  # what is measured.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for mode in WHOLE_MODES:
      before = len(caught)
      made[f'"{mode}"'] = tfremat.remat_model(
          model, mode=mode,
          sample_input=batch if mode == "larger_than" else None)
      if any("selects no layer" in str(w.message) for w in caught[before:]):
        notes[f'"{mode}"'] = "selects nothing"
    label = f"budget {budget:.0%}"
    start = time.perf_counter()
    try:
      planned = tfremat.remat_model(model, budget=budget, sample_input=batch,
                                    verbose=0)
    except tfremat.errors.BudgetUnreachableError as e:
      notes[label] = (f"refused in {time.perf_counter() - start:.1f} s: "
                      f"lowest bound {e.lowest_fraction:.0%}")
    else:
      made[label] = planned
      plan = planned.get_layer(f"{model.name}_chain").plan
      bound = plan.measured.bound_bytes / plan.measured_keep.peak_bytes
      notes[label] = (f"planned in {time.perf_counter() - start:.1f} s: "
                      f"bound {bound:.0%}")
  # pylint: disable=protected-access
  measure_impl.wait_for(chain.training_step(model)(batch))  # One-time costs.
  rows, steps = [], []
  for variant, m in made.items():
    step = chain.training_step(m)
    start = time.perf_counter()
    measure_impl.wait_for(step(batch))
    rows.append({"model": name, "variant": variant,
                 "first_call_seconds": time.perf_counter() - start,
                 "peak_bytes": measure.peak_bytes(step, batch, warmup=False),
                 "note": notes.get(variant, "")})
    steps.append(step)
  for row, seconds in zip(rows, measure.median_seconds(steps, batch,
                                                       repeats=rounds)):
    row["step_seconds"] = seconds
  rows += [{"model": name, "variant": v, "note": n} for v, n in notes.items()
           if v not in made]
  return rows


def format_whole_table(rows):
  """`measure_whole_model`'s rows as a table, ratios to each model's
  original."""
  header = (f"{'model':<16}{'variant':<16}{'peak MiB':>10}{'x':>7}"
            f"{'step ms':>10}{'x':>7}{'first call s':>14}{'x':>7}  note")
  lines, base = [header, "-" * (len(header) + 30)], {}
  for r in rows:
    if r["variant"] == "original":
      base = r
    if "peak_bytes" not in r:
      lines.append(f"{r['model']:<16}{r['variant']:<16}{'':>55}  {r['note']}")
      continue
    lines.append(
        f"{r['model']:<16}{r['variant']:<16}{r['peak_bytes'] / 2**20:>10.1f}"
        f"{_ratio(r['peak_bytes'], base['peak_bytes']):>7.2f}"
        f"{1000 * r['step_seconds']:>10.1f}"
        f"{_ratio(r['step_seconds'], base['step_seconds']):>7.2f}"
        f"{r['first_call_seconds']:>14.2f}"
        f"{_ratio(r['first_call_seconds'], base['first_call_seconds']):>7.2f}"
        f"  {r['note']}")
  return "\n".join(lines)


def _whole_model_names():
  """--whole_models as names; "all": every model this install can build."""
  names = [n for n in FLAGS.whole_models if n]
  if names == ["all"]:
    names = list(models.APPLICATIONS)
    try:
      import keras_hub  # pylint: disable=import-outside-toplevel,unused-import
      names += list(models.HUB_BACKBONES)
    except ImportError:
      print("(no KerasHub backbones: pip install \".[hub]\" for them)")
  known = list(models.APPLICATIONS) + list(models.HUB_BACKBONES)
  unknown = [n for n in names if n not in known]
  if unknown:
    raise app.UsageError(f"Unknown --whole_models {unknown}; choose from "
                         f"{', '.join(known)}, or all.")
  return names


def _run_max_batch():
  """--max_batch: each model's largest batch per method, and its speed."""
  try:
    memory = planner.Budget.parse(FLAGS.max_batch).num_bytes
  except ValueError as e:
    raise app.UsageError(f"--max_batch: {e}") from e
  if memory is None:
    raise app.UsageError("--max_batch takes bytes (\"512MiB\"), not a "
                         "fraction.")
  names = [n for n in FLAGS.max_batch_models if n]
  known = list(max_batch.MODELS) + list(models.APPLICATIONS)
  unknown = [n for n in names if n not in known]
  if unknown or FLAGS.sweep or FLAGS.eager or FLAGS.jit or FLAGS.whole_models:
    raise app.UsageError(
        f"--max_batch runs in tf.function on {', '.join(known)}"
        + (f"; unknown: {unknown}" if unknown else "") +
        "; leave out --sweep, --eager, --jit and --whole_models.")
  print(environment())
  print(f"largest batch within {measure.format_bytes(memory)}, tf.function, "
        f"{FLAGS.steps} timed rounds")
  rows = []
  for name in names:
    rows += max_batch.measure_model(
        name, memory, FLAGS.steps, FLAGS.blocks, FLAGS.width,
        log=lambda line: print(line, flush=True))
  print(max_batch.format_table(rows, memory))
  print(max_batch.LEGEND.format(
      rounds=FLAGS.steps, check_calls=planner.DEFAULT_SETTINGS.check_calls,
      reserve=planner.DEFAULT_SETTINGS.reserve))


def normalized_argv(argv):
  """`argv` with every documented spelling made one absl reads.

  --budget-fraction (dashes, as in the docs) becomes --budget_fraction, and a
  bare --plot or --csv (no value) takes the flag's default file name.
  """
  names, out = set(FLAGS), [argv[0]]
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg.startswith("--") and "-" in arg[2:].split("=", 1)[0]:
      name, eq, value = arg[2:].partition("=")
      underscored = name.replace("-", "_")
      if underscored in names:
        arg = f"--{underscored}{eq}{value}"
    if arg in ("--plot", "--csv"):
      following = args[i + 1] if i + 1 < len(args) else None
      if following is None or following.startswith("-"):
        arg = f"{arg}={FLAGS[arg[2:]].default}"
    out.append(arg)
  return out


def _parse_flags(argv):
  return app.parse_flags_with_usage(normalized_argv(argv))


def main(argv):
  del argv
  if FLAGS.eager and FLAGS.jit:
    raise app.UsageError("--eager and --jit exclude each other: pick one.")
  unknown = set(FLAGS.methods) - set(METHODS)
  if unknown:
    raise app.UsageError(
        f"Unknown --methods {sorted(unknown)}; choose from {', '.join(METHODS)}.")
  if FLAGS.max_batch:
    _run_max_batch()
    return
  if FLAGS.whole_models:
    names = _whole_model_names()
    budget = (0.5 if FLAGS.budget_fraction is None else
              FLAGS.budget_fraction)
    if FLAGS.sweep or FLAGS.eager or FLAGS.jit or not 0 < budget <= 1:
      raise app.UsageError("--whole_models measures traced steps in "
                           "tf.function, with --budget-fraction in (0, 1] "
                           "and --steps; leave out --sweep, --eager, --jit.")
    print(environment())
    print(f"whole models, tf.function, {FLAGS.steps} timed rounds")
    progress = measure.progress_bar(len(names), "model")
    rows = []
    # Every row traces a new step on purpose (and ConvNeXtTiny's
    # convolutions retrace one of Keras's functions each time).
    with chain.retracing_quiet():
      for name in names:
        rows += measure_whole_model(name, budget, FLAGS.steps)
        if progress is not None:
          progress.add(1)
    print(format_whole_table(rows))
    print(WHOLE_LEGEND.format(steps=FLAGS.steps))
    return
  sizes = ", ".join(f"{k} {v}" for k, v in _sizes().items())
  if FLAGS.sweep or FLAGS.budget_fraction is not None:
    if FLAGS.eager:
      raise app.UsageError("--eager is for the per-method table; the sweep "
                           "and the planner measure traced steps.")
    if FLAGS.budget_fraction is not None and not 0 < FLAGS.budget_fraction:
      raise app.UsageError("--budget-fraction must be positive, e.g. 0.5.")
    fractions = ([0.3, 0.5, 0.8, 1.0] if FLAGS.sweep else
                 [FLAGS.budget_fraction])
    schemes = (len(uniform_schemes(_sizes()["blocks"])) +
               len(_planner_policies()) if FLAGS.sweep else 2)
    print(environment())
    progress = measure.progress_bar(schemes + len(fractions), "scheme")
    rows = _schemes_and_plans(fractions, progress)
    mode = "XLA" if FLAGS.jit else "tf.function"
    title = (f"{FLAGS.model} ({sizes}, dropout {FLAGS.dropout}), {mode}: "
             "memory vs time")
    print(f"\n{title}, {FLAGS.steps} timed rounds")
    print(format_scheme_table(rows))
    print(SCHEME_LEGEND.format(steps=FLAGS.steps))
    if FLAGS.sweep:
      write_csv(rows, FLAGS.csv)
      drawn = plot_pareto(rows, FLAGS.plot, title)
      print(f"wrote {FLAGS.csv}" + (f" and {FLAGS.plot}" if drawn else
                                    " (no plot: pip install .[bench])"))
    return
  methods = [m for m in METHODS if m in FLAGS.methods]
  print(environment())
  policy = (f", tfremat methods under {FLAGS.policy}" if FLAGS.policy else "")
  print(f"{FLAGS.model}: {sizes}, dropout {FLAGS.dropout}, "
        f"{_mode_name()}, {FLAGS.steps} timed rounds{policy}")
  progress = measure.progress_bar(len(methods), "method")
  print(format_table(measure_methods(methods, progress)))
  print(METHOD_LEGEND.format(steps=FLAGS.steps))


if __name__ == "__main__":
  define_flags()
  app.run(main, flags_parser=_parse_flags)
