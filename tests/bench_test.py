"""`python -m tfremat.bench`, run as a user runs it, on tiny sizes."""

import csv
import os
import subprocess
import sys

import pytest

from tfremat import models
from tfremat import planner
from tfremat._src.api.largest_batch import search_batch
from tfremat.bench import plot
from tfremat.bench import schemes
from tfremat.bench import tables

# Small, but big enough that the allocator's peaks are not 0.
_SMALL = ["--blocks=4", "--width=64", "--batch=512", "--steps=2"]


def _bench(*args, cwd=None):
  env = dict(os.environ)
  env.pop("TF_CPP_MIN_LOG_LEVEL", None)  # The bench's own default.
  proc = subprocess.run(
      [sys.executable, "-m", "tfremat.bench", *args], capture_output=True,
      text=True, timeout=900, env=env, cwd=cwd)
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The tables alone on stdout, without a terminal's escape codes and
  # carriage returns; TensorFlow's own start-up lines go to stderr, as in
  # any TensorFlow program (importing tfremat quiets nothing), but not the
  # profiler's lines from each of the planner's measurements.
  assert "I0000" not in proc.stdout and "cuInit" not in proc.stdout
  assert "Profiler session" not in proc.stderr, proc.stderr[-3000:]
  assert "\x1b" not in proc.stdout and "\r" not in proc.stdout
  return proc.stdout


def _rows(table):
  lines = table.splitlines()
  start = next(i for i, l in enumerate(lines) if set(l) == {"-"}) + 1
  stop = next(i for i, l in enumerate(lines) if l.startswith("peak MiB:"))
  return {l[:20].strip(): l[20:].split() for l in lines[start:stop]
          if l.strip()}


# Columns after the method: peak MiB, x none, step ms, IQR ms, x none,
# grad error, first call ms, trace ms, alloc x.
_GRAD_ERROR, _FIRST_CALL, _TRACE, _ALLOC = -4, -3, -2, -1


@pytest.mark.parametrize("mode", [
    pytest.param([], id="function"), pytest.param(["--eager"], id="eager"),
    pytest.param(["--policy=dots_saveable"], id="policy")])
def test_methods_table_shows_tfremat_exact_and_recompute_grad_wrong(mode):
  text = _bench(*_SMALL, *mode)
  assert ("eager," if mode == ["--eager"] else "tf.function,") in text
  assert ("under dots_saveable" in text) == (mode == ["--policy=dots_saveable"])
  rows = _rows(text)
  assert set(rows) == {"none", "tf.recompute_grad", "keras.remat", "tfremat",
                       "tfremat.layer"}
  grad_error = {k: float(v[_GRAD_ERROR]) for k, v in rows.items()}
  assert grad_error["tfremat"] == grad_error["tfremat.layer"] == 0
  assert grad_error["tf.recompute_grad"] > 1e-3  # A new dropout mask.
  assert float(rows["tfremat"][1]) < 1.0  # Peak ratio to none.
  assert all(float(v[_FIRST_CALL]) > 0 for v in rows.values())
  # The allocator's chunks hold at least the tensors' requested bytes.
  assert all(float(v[_ALLOC]) >= 1.0 for v in rows.values()), rows
  traces = {v[_TRACE] for v in rows.values()}
  eager = mode == ["--eager"]
  assert traces == {"-"} if eager else all(float(t) > 0 for t in traces)
  # [7]: the spread of step times, a legend, the machine and versions.
  for v in rows.values():
    low, high = (float(t) for t in v[3].split("-"))
    assert low <= high
  assert "grad error: max |gradient - the `none` row's|" in text
  assert "TensorFlow 2." in text and "Keras 3." in text and "CPUs" in text


@pytest.mark.slow
def test_sweep_writes_table_csv_and_plot(tmp_path):
  # [5]: a bare --plot (as documented) draws to its default file.
  out_csv, out_png = tmp_path / "s.csv", tmp_path / "sweep.png"
  text = _bench("--sweep", "--blocks=8", "--width=64", "--batch=1024",
                "--steps=2", f"--csv={out_csv}", "--plot",
                "--planner_policies=dots_saveable", cwd=tmp_path)
  with open(out_csv) as f:
    rows = list(csv.DictReader(f))
  # [8]: the CSV carries the table's columns, budget and fits included.
  assert list(rows[0]) == ["scheme", "kind", "rematerialized", "policies",
                           "peak_bytes",
                           "peak_x_none", "step_seconds", "step_p25_seconds",
                           "step_p75_seconds", "step_x_none",
                           "budget_fraction", "budget_bytes", "fits",
                           "plan_seconds", "dominated_by"]
  planned = [r for r in rows if r["kind"] == "planner"]
  assert planned and all(r["fits"] in ("True", "False") for r in planned)
  # The planner's rows say how long planning took; the others leave it out.
  assert all(float(r["plan_seconds"]) > 0 for r in planned)
  assert all(r["plan_seconds"] == "" for r in rows if r not in planned)
  assert "plan s: seconds the planner took" in text
  assert all(int(r["budget_bytes"]) > 0 for r in planned)
  assert "fits: whether the measured peak" in text
  schemes = [r["scheme"] for r in rows]
  assert schemes[:5] == ["none", "every block", "every 2nd block",
                         "every 4th block", "sqrt segments"]
  assert "planner 50%" in schemes and "planner 100%" in schemes
  by = {r["scheme"]: r for r in rows}
  # The policy scheme, and the planner choosing among that policy too.
  assert by["every block, dots"]["kind"] == "policy"
  assert by["every block, dots"]["policies"] == "dots"
  assert "dots_saveable" not in by["none"]["policies"]
  assert int(by["every block"]["peak_bytes"]) < int(by["none"]["peak_bytes"])
  assert "planner at 50%" in text
  # [4] of the planner's issue: a scheme beaten on both axes says by what.
  assert "dominated by: a scheme with a lower peak" in text
  names = set(schemes)
  assert all(r["dominated_by"] in names | {""} for r in rows)
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    assert "no plot" in text
  else:
    assert out_png.stat().st_size > 10_000


@pytest.mark.slow
def test_help_and_bad_flags():
  # The runs are independent: started together, their TensorFlow imports
  # overlap (24-28 s one after another in CI).
  runs = {
      "help": ["--help"],
      "methods": ["--methods=bogus"],
      "eager_jit": ["--eager", "--jit"],
      # [5]: the documented dash spelling reaches the flag, in both forms; a
      # bad value fails before anything is measured.
      "dash_equals": ["--budget-fraction=-1"],
      "dash_space": ["--budget-fraction", "-1"],
      "not_a_number": ["--budget-fraction=half"],
      "whole_unknown": ["--whole_models=ResNet50,Bogus"],
      "whole_jit": ["--whole_models=ResNet50", "--jit"],
      "plan_cost_rounds": ["--plan_cost", "--rounds", "0"],
  }
  procs = {k: subprocess.Popen([sys.executable, "-m", "tfremat.bench", *args],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
           for k, args in runs.items()}
  done = {}
  try:
    for k, proc in procs.items():
      stdout, stderr = proc.communicate(timeout=300)
      done[k] = (proc.returncode, stdout, stderr)
  finally:
    for proc in procs.values():
      proc.kill()
  _, stdout, _ = done["help"]  # absl's --help exits with 1.
  assert "--budget_fraction" in stdout and "--sweep" in stdout
  code, _, stderr = done["methods"]
  assert code != 0 and "Unknown --methods" in stderr
  code, _, stderr = done["eager_jit"]
  assert code != 0 and "exclude each other" in stderr
  for k in ("dash_equals", "dash_space"):
    code, _, stderr = done[k]
    assert code != 0, k
    assert "--budget-fraction must be positive" in stderr, stderr
  code, _, stderr = done["not_a_number"]
  assert code != 0 and "budget_fraction" in stderr
  code, _, stderr = done["whole_unknown"]
  assert code != 0 and "Unknown --whole_models ['Bogus']" in stderr, stderr
  code, _, stderr = done["whole_jit"]
  assert code != 0 and "leave out --sweep, --eager, --jit" in stderr, stderr
  assert "--whole_models" in done["help"][1]
  code, _, stderr = done["plan_cost_rounds"]
  assert code != 0 and "--rounds takes a positive" in stderr, stderr


def test_plan_cost_times_planning_and_steps_each_in_a_new_process():
  from tfremat.bench import plan_cost  # pylint: disable=g-import-not-at-top
  logged = []
  costs = plan_cost.plan_costs(blocks=2, batch=16, length=64, rounds=1,
                               jit=(False,), largest=False, log=logged.append)
  assert [c.jit for c in costs] == [False]
  assert sorted(costs[0].seconds) == ["plan", "steps"]
  assert all(costs[0].median(j) > 0 for j in ("plan", "steps"))
  assert len(logged) == 2
  table = plan_cost.format_table(costs, 1).splitlines()
  assert table[0].split()[:3] == ["step", "planning", "s"]
  row = table[2].split()
  assert row[0] == "tf.function" and row[-1] == "-"
  assert row[3] == f"{costs[0].median('plan') / costs[0].median('steps'):.2f}x"
  assert "medians of 1 rounds" in table[-1]


def test_whole_model_table_gives_ratios_to_each_models_original():
  rows = [
      dict(model="A", variant="original", peak_bytes=100 * 2**20,
           step_seconds=0.1, first_call_seconds=2.0, note=""),
      dict(model="A", variant='"full"', peak_bytes=50 * 2**20,
           step_seconds=0.15, first_call_seconds=3.0, note=""),
      dict(model="A", variant="budget 50%", note="refused in 3.0 s: lowest "
           "bound 61%"),
      dict(model="B", variant="original", peak_bytes=10 * 2**20,
           step_seconds=1.0, first_call_seconds=1.0, note=""),
      dict(model="B", variant="budget 50%", peak_bytes=4 * 2**20,
           step_seconds=1.2, first_call_seconds=1.5,
           note="planned in 9.0 s: bound 48%"),
  ]
  lines = tables.format_whole_table(rows).splitlines()
  assert lines[0].split()[:4] == ["model", "variant", "peak", "MiB"]
  assert lines[2].split() == ["A", "original", "100.0", "1.00", "100.0",
                              "1.00", "2.00", "1.00"]
  assert lines[3].split() == ["A", '"full"', "50.0", "0.50", "150.0", "1.50",
                              "3.00", "1.50"]
  assert lines[4].split() == ["A", "budget", "50%", "refused", "in", "3.0",
                              "s:", "lowest", "bound", "61%"]
  assert lines[6].split()[2:] == ["50%", "4.0", "0.40", "1200.0", "1.20",
                                  "1.50", "1.50", "planned", "in", "9.0",
                                  "s:", "bound", "48%"]


def test_an_unknown_whole_model_is_named():
  with pytest.raises(ValueError, match="Unknown model 'Bogus'; choose from "
                     "ResNet50, .*GemmaBackbone"):
    models.whole_model("Bogus")


@pytest.mark.slow
def test_whole_models_runs_every_mode_and_a_budget_on_a_cnn():
  rows = {}
  for line in _bench("--whole_models=MobileNetV2", "--steps=2").splitlines():
    if line.startswith("MobileNetV2 "):
      rows[line[16:32].strip()] = line[32:].split()
  assert list(rows) == ["original", '"full"', '"activations"',
                        '"larger_than"', "budget 50%"], rows
  # Peak x original: 0.51 with oneDNN's convolution kernels, 0.85 with
  # Eigen's, whose scratch buffer stays in every step (docs/benchmarks.md,
  # "CNNs and the convolution kernels").
  assert float(rows['"full"'][1]) < 0.92, rows
  assert rows['"activations"'][-2:] == ["selects", "nothing"], rows
  budget = " ".join(rows["budget 50%"])
  assert ("refused in" in budget and "lowest bound" in budget or
          "planned in" in budget), budget


def test_plot_labels_that_would_overlap_are_moved_apart():
  # Two labels side by side at nearly one height, a third far to the right.
  boxes = [(0, 100, 50), (10, 101, 50), (200, 100, 50)]
  offsets = plot.label_offsets(boxes, height=9)
  assert offsets[0] == offsets[2] == 2  # Free places are kept.
  assert abs((101 + offsets[1]) - (100 + offsets[0])) >= 9


def test_a_scheme_beaten_on_both_axes_beyond_the_iqr_is_marked():
  def row(name, peak, p25, p75):
    return {"scheme": name, "peak_bytes": peak, "step_p25_seconds": p25,
            "step_p75_seconds": p75}
  rows = schemes.mark_dominated([
      row("a", 100, 1.0, 1.1), row("b", 50, 1.2, 1.3),
      row("c", 80, 1.25, 1.4), row("d", 60, 1.05, 1.15),
      row("e", 90, 1.12, 1.2)])
  by = {r["scheme"]: r["dominated_by"] for r in rows}
  # c: d is smaller and faster beyond both IQRs; e: d too (1.15 < 1.12 is
  # false, so only within noise: not dominated).
  assert by == {"a": "", "b": "", "c": "d", "d": "", "e": ""}


@pytest.mark.slow
def test_max_batch_finds_each_methods_largest_batch_on_a_small_mlp():
  text = _bench("--max_batch=24MiB", "--max_batch_models=mlp", "--blocks=4",
                "--width=64", "--steps=2")
  rows = {}
  for line in text.splitlines():
    if line.startswith("mlp "):  # Table rows; progress lines read "mlp, ".
      parts = line[14:44].strip(), line[44:].split()
      if parts[1] and parts[1][0].isdigit():
        rows[parts[0]] = parts[1]
  assert {"none", "tf.recompute_grad", "tfremat full",
          "tfremat.largest_batch"} <= set(rows), text
  assert any(m.startswith("tfremat policy") for m in rows), text
  batch = {m: int(r[0]) for m, r in rows.items()}
  peak = {m: float(r[2]) for m, r in rows.items() if batch[m]}
  # Every batch found peaks within the budget, and rematerializing every
  # block fits more than keeping everything.
  assert all(p <= 24.0 for p in peak.values()), rows
  assert batch["tfremat full"] > batch["none"] > 0, rows
  # The call users make fits every other way's batch, to within the margin
  # it holds predictions to on the executor (`Settings.reserve`: the other
  # ways' batches are searched on measured peaks) and a few percent more.
  near = planner.DEFAULT_SETTINGS.reserve + 0.04
  assert batch["tfremat.largest_batch"] >= (1 - near) * max(
      batch.values()), rows
  assert "keras.RematScope" in text  # A row, or why it fails.
  assert "examples/s" in text


def test_largest_batch_searches_to_one_multiple():
  # A step's peak grows along a line; the planner's (here: refusing above
  # 700) need not. The search ends at the largest multiple that fits.
  linear = lambda b: 1000 + 10 * b
  batch, probes = search_batch(linear, 6000, 64, multiple=8)
  assert batch == 496 and linear(batch) <= 6000 < linear(batch + 8)
  assert len(probes) <= 5, probes
  refusing = lambda b: None if b > 700 else 1000 + b
  batch, probes = search_batch(refusing, 10**6, 64, multiple=8,
                                         max_probes=20)
  assert batch == 696 and len(probes) <= 12, probes
