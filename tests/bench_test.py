"""`python -m tfremat.bench`, run as a user runs it, on tiny sizes."""

import csv
import os
import subprocess
import sys

import pytest

# Small, but big enough that the allocator's peaks are not 0.
_SMALL = ["--blocks=4", "--width=64", "--batch=512", "--steps=2"]


def _bench(*args):
  proc = subprocess.run(
      [sys.executable, "-m", "tfremat.bench", *args], capture_output=True,
      text=True, timeout=900, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"))
  assert proc.returncode == 0, proc.stderr[-3000:]
  return proc.stdout


def _rows(table):
  lines = table.splitlines()
  start = next(i for i, l in enumerate(lines) if set(l) == {"-"}) + 1
  return {l[:20].strip(): l[20:].split() for l in lines[start:] if l.strip()}


# Columns after the method: peak MiB, x none, step ms, x none, max |grad -
# none|, first call ms, trace ms.
_GRAD_ERROR, _FIRST_CALL, _TRACE = -3, -2, -1


@pytest.mark.parametrize("mode", [[], ["--eager"]], ids=["function", "eager"])
def test_methods_table_shows_tfremat_exact_and_recompute_grad_wrong(mode):
  text = _bench(*_SMALL, *mode)
  assert ("eager," if mode else "tf.function,") in text
  rows = _rows(text)
  assert set(rows) == {"none", "tf.recompute_grad", "keras.remat", "tfremat",
                       "tfremat.layer"}
  grad_error = {k: float(v[_GRAD_ERROR]) for k, v in rows.items()}
  assert grad_error["tfremat"] == grad_error["tfremat.layer"] == 0
  assert grad_error["tf.recompute_grad"] > 1e-3  # A new dropout mask.
  assert float(rows["tfremat"][1]) < 1.0  # Peak ratio to none.
  assert all(float(v[_FIRST_CALL]) > 0 for v in rows.values())
  traces = {v[_TRACE] for v in rows.values()}
  assert traces == {"-"} if mode else all(float(t) > 0 for t in traces)


def test_sweep_writes_table_csv_and_plot(tmp_path):
  out_csv, out_png = tmp_path / "s.csv", tmp_path / "s.png"
  text = _bench("--sweep", "--blocks=8", "--width=64", "--batch=1024",
                "--steps=2", f"--csv={out_csv}", f"--plot={out_png}")
  with open(out_csv) as f:
    rows = list(csv.DictReader(f))
  schemes = [r["scheme"] for r in rows]
  assert schemes[:5] == ["none", "every block", "every 2nd block",
                         "every 4th block", "sqrt segments"]
  assert "planner 50%" in schemes and "planner 100%" in schemes
  by = {r["scheme"]: r for r in rows}
  assert int(by["every block"]["peak_bytes"]) < int(by["none"]["peak_bytes"])
  assert "planner at 50%" in text
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    assert "no plot" in text
  else:
    assert out_png.stat().st_size > 10_000


def test_help_and_bad_flags():
  proc = subprocess.run([sys.executable, "-m", "tfremat.bench", "--help"],
                        capture_output=True, text=True, timeout=300)
  assert "--budget_fraction" in proc.stdout and "--sweep" in proc.stdout
  proc = subprocess.run(
      [sys.executable, "-m", "tfremat.bench", "--methods=bogus"],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "Unknown --methods" in proc.stderr
  proc = subprocess.run(
      [sys.executable, "-m", "tfremat.bench", "--eager", "--jit"],
      capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0 and "exclude each other" in proc.stderr
