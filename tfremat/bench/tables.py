"""The bench's tables: each mode's rows as text, their legends, the sweep's
CSV, and the line naming the machine and versions."""

import csv
import os
import platform

import keras
import tensorflow as tf

from tfremat import measure
from tfremat.bench import methods as methods_lib

__all__ = [
    "environment",
    "LEGEND",
    "METHOD_LEGEND",
    "SCHEME_LEGEND",
    "WHOLE_LEGEND",
    "BATCH_LEGEND",
    "format_table",
    "format_scheme_table",
    "format_whole_table",
    "format_batch_table",
    "FIT_LEGEND",
    "format_fit_table",
    "FAMILY_LEGEND",
    "format_family_table",
    "CSV_COLUMNS",
    "write_csv",
]


def environment():
  """One line: the machine, Python, TensorFlow and Keras versions."""
  return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
          f"measured on {measure.memory_device()}; Python "
          f"{platform.python_version()}, TensorFlow {tf.__version__}, Keras "
          f"{keras.__version__}")


def _ratio(value, base):
  """value / base; nan when a tiny run's base measured 0."""
  return value / base if base else float("nan")


def _spread(r):
  return (f"{1000 * r['step_p25_seconds']:.1f}-"
          f"{1000 * r['step_p75_seconds']:.1f}")


def _ms(seconds):
  return "-" if seconds is None else f"{1000 * seconds:.1f}"


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
      diff = f"{methods_lib.gradient_error(r['grads'], base['grads']):.3g}"
    lines.append(f"{method:<20}{peak:>10.1f}{ratios[0]:>8}{ms:>10.1f}"
                 f"{_spread(r):>14}{ratios[1]:>8}{diff:>12}"
                 f"{1000 * r['first_call_seconds']:>15.1f}"
                 f"{_ms(r.get('trace_seconds')):>10}"
                 f"{_ratio(r['allocated_bytes'], r['peak_bytes']):>9.2f}")
  return "\n".join(lines)


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


BATCH_LEGEND = """\
batch: the largest batch whose training fits the memory, searched in
  multiples of the model's step; x none: its ratio to the `none` row's. The
  memory counts everything training holds: held MiB (the weights, Adam's
  two slots for the compiled models, the batch) plus the step's bound
  (bound MiB: the largest peak of {check_calls} steps, plus their spread,
  plus the {reserve:.0%} reserve), every row but tfremat.largest_batch's
  (which plans on predictions and checks its plan) judged on a step traced
  for that batch ({first_calls} steps a probe, then {check_calls}).
  peak MiB: the largest of those peaks (the tensors' bytes, as
  tfremat.measure.peak_bytes counts them). The chains (mlp,
  transformer) run their stand-in step, the gradient of the sum of their
  squared outputs; the whole models their own train_on_batch (Adam; sparse
  cross-entropy on ResNet50's 10 classes, mean squared error on
  GPT2Backbone's features). examples/s: the batch over the median step time
  at it ({rounds} rounds, every row once per round, in shuffled order); x
  none: per example, against `none`'s.
keras.RematScope: the model built inside keras.RematScope(mode="full"),
  which runs each layer through tf.recompute_grad. tfremat policy: every
  block (or remat_model(model, "full", policy=...)) under the built-in
  policy that fit the largest batch. tfremat.largest_batch: what the call
  returns for the memory (the note says which way it chose: full, the
  planner's plan or none), at the batch it found."""


def format_batch_table(rows, memory_bytes):
  """`max_batch.BatchRow`s as a text table, each model's ratios against
  its `none` row; a method that fit nothing gets one line after it, with
  the models it failed on and why."""
  header = (f"{'model':<14}{'method':<30}{'batch':>7}{'x none':>8}"
            f"{'held MiB':>10}{'peak MiB':>10}{'bound MiB':>11}"
            f"{'examples/s':>12}{'x none':>8}  note")
  lines = [f"memory: {measure.format_bytes(memory_bytes)}", header,
           "-" * (len(header) + 20)]
  base, failed = None, {}
  for r in rows:
    if r.method == "none":
      base = r
    if not r.batch:
      failed.setdefault((r.method, r.note), []).append(r.model)
      continue
    x_batch = r.batch / base.batch if base and base.batch else float("nan")
    x_rate = (r.examples_per_second / base.examples_per_second
              if base and base.batch else float("nan"))
    lines.append(
        f"{r.model:<14}{r.method:<30}{r.batch:>7}{x_batch:>8.2f}"
        f"{r.held_bytes / 2**20:>10.1f}{r.peak_bytes / 2**20:>10.1f}"
        f"{r.bound_bytes / 2**20:>11.1f}{r.examples_per_second:>12.1f}"
        f"{x_rate:>8.2f}  {r.note}".rstrip())
  for (method, note), models in failed.items():
    lines.append(f"{method}: batch 0 on {', '.join(models)}: {note}")
  return "\n".join(lines)


FIT_LEGEND = """\
batch, sequence: one step's batch, padded to its longest row (the last
  batch is partial). remat: how many of the chain's units the plan runs
  there (Plan.segments_at, chosen in the step by its shape). held MiB: the
  weights, Adam's state and the batch. predicted and measured MiB: the
  step's peak, by the plan (Plan.predicted_peak_at) and measured in fit
  (tfremat.measure.fit_peaks); error: predicted over measured, less 1.
  total MiB: held plus the measured peak, within the budget where it says
  yes."""


def format_fit_table(rows):
  """`shapes.FitRow`s as a text table."""
  header = (f"{'batch':>6}{'sequence':>10}{'remat':>7}{'held MiB':>10}"
            f"{'predicted':>11}{'measured':>10}{'error':>8}{'total MiB':>11}"
            f"{'fits':>6}")
  lines = [header, "-" * len(header)]
  for r in rows:
    total = r.held_bytes + r.measured_bytes
    lines.append(
        f"{r.batch:>6}{r.seq_len:>10}{r.rematerialized:>7}"
        f"{r.held_bytes / 2**20:>10.1f}{r.predicted_bytes / 2**20:>11.1f}"
        f"{r.measured_bytes / 2**20:>10.1f}{r.peak_error:>+8.1%}"
        f"{total / 2**20:>11.1f}"
        f"{'yes' if total <= r.budget_bytes else 'NO':>6}")
  within = sum(abs(r.peak_error) <= 0.05 for r in rows)
  lines.append(f"{within} of {len(rows)} steps' peaks predicted within 5%; "
               f"budget {rows[0].budget_bytes / 2**20:.1f} MiB")
  return "\n".join(lines)


FAMILY_LEGEND = """\
shape: the batch, then the sequence or image size (the first row of a
  model is its sample). remat: how many of its chain's units the plan runs
  there. predicted MiB: the step's peak by the plan (Plan.predicted_peak_at).
  static and any-shape MiB: measured (the largest of 3 calls) in a step
  traced for that shape, as fit's first, and in one traced for any shape,
  as every later; error: predicted over the larger, less 1."""


def format_family_table(rows):
  """`shapes.FamilyRow`s as a text table."""
  header = (f"{'model':<16}{'shape':<12}{'remat':>6}{'predicted':>11}"
            f"{'static':>9}{'any-shape':>11}{'error':>8}")
  lines = [header, "-" * len(header)]
  for r in rows:
    lines.append(
        f"{r.model:<16}{'x'.join(map(str, r.shape)):<12}"
        f"{r.rematerialized:>6}{r.predicted_bytes / 2**20:>11.1f}"
        f"{r.static_bytes / 2**20:>9.1f}{r.relaxed_bytes / 2**20:>11.1f}"
        f"{r.peak_error:>+8.1%}")
  within = sum(abs(r.peak_error) <= 0.05 for r in rows)
  lines.append(f"{within} of {len(rows)} peaks predicted within 5% of "
               "the larger measured")
  return "\n".join(lines)
