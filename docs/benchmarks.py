"""Regenerates the CPU tables of docs/benchmarks.md at the checked-out commit.

  python docs/benchmarks.py                 # every table (about 90 minutes here)
  python docs/benchmarks.py max_batch shapes  # some of them, by name (TABLES)
  python docs/benchmarks.py --list          # the names and their commands

BENCHMARKS_LOG_DIR=DIR keeps all each command printed in DIR/NAME.log: the
max-batch searches say there how long each took.

Run it from the repository's root, on an idle machine, with the package
installed (`pip install ".[bench,hub]"`). Each table on the page sits between
`<!-- table NAME -->` and `<!-- end table -->`: its command runs in a new
process, and its printed table replaces what is there, under a line naming
the command, the commit (with the git tree of its `tfremat/`, the code
measured) and the date. The page's machine line (`<!-- machine
-->`) is rewritten from this machine, so the page names it once.
"""

import datetime
import os
import pathlib
import platform
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "benchmarks.md"

_BENCH = [sys.executable, "-m", "tfremat.bench"]
_CNN_PEAKS = [sys.executable, "-c",
              "import remat_model_test as t; print({k: f'{v / 2**20:.1f} MiB' "
              "for k, v in t.cnn_peaks().items()})"]

# name -> (command, environment changes, working directory).
TABLES = {
    "methods": (_BENCH + ["--steps", "20"], {}, ROOT),
    "eager": (_BENCH + ["--eager", "--steps", "10"], {}, ROOT),
    "jit": (_BENCH + ["--jit", "--steps", "10"], {}, ROOT),
    "sweep_mlp": (_BENCH + ["--sweep", "--steps", "10", "--csv",
                            "docs/sweep_mlp.csv", "--plot",
                            "docs/sweep_mlp.png"], {}, ROOT),
    "sweep_transformer": (_BENCH + [
        "--model", "transformer", "--sweep", "--steps", "15", "--csv",
        "docs/sweep_transformer.csv", "--plot", "docs/sweep_transformer.png"],
                          {}, ROOT),
    "whole_models": (_BENCH + [
        "--whole_models", "ResNet50,MobileNetV2,GPT2Backbone,BertBackbone,"
        "LlamaBackbone,GemmaBackbone", "--whole_modes", "full", "--steps",
        "5"], {}, ROOT),
    "max_batch": (_BENCH + ["--max_batch", "512MiB", "--max_batch_models",
                            "transformer,GPT2Backbone", "--steps", "5"], {},
                  ROOT),
    "shapes": (_BENCH + ["--shapes", "208MiB"], {}, ROOT),
    "predict": (_BENCH + ["--predict"], {}, ROOT),
    "cnn_onednn": (_CNN_PEAKS, {"TF_ENABLE_ONEDNN_OPTS": "1"}, ROOT / "tests"),
    "cnn_eigen": (_CNN_PEAKS, {"TF_ENABLE_ONEDNN_OPTS": "0"}, ROOT / "tests"),
}


def _shown(name):
  """The command as a reader types it, from the repository's root."""
  command, env, folder = TABLES[name]
  words = ["python" if w == sys.executable else w for w in command]
  words = [f'"{w}"' if " " in w else w for w in words]
  prefix = "".join(f"{k}={v} " for k, v in env.items())
  cd = "cd tests && " if folder != ROOT else ""
  return f"{cd}{prefix}{' '.join(words)}"


def _table(output):
  """The last table a command printed: from its header (the line above a
  line of dashes, and a "memory: " line above that) to the first blank or
  legend line, with the lines right after it that start with a method's
  name (a method that fit nothing); or, without one, the last line (a
  Python value). What the command logged before it stays in its log."""
  lines = output.rstrip().splitlines()
  dashes = [i for i, line in enumerate(lines[1:], 1)
            if re.fullmatch(r"-{20,}", line)]
  if not dashes:
    return lines[-1]
  i = dashes[-1]
  start = i - 1
  if start > 0 and lines[start - 1].startswith("memory: "):
    start -= 1
  end = i + 1
  while (end < len(lines) and lines[end].strip() and
         (not re.match(r"^\S[^:]{0,24}: \S", lines[end]) or
          re.match(r"^\S.*: batch 0 on ", lines[end]))):
    end += 1
  return "\n".join(lines[start:end])


def _commit():
  """The checked-out commit, and the git tree of its `tfremat/` (the code
  measured): tables from commits that differ only in docs and tests name
  the same tree."""
  def rev(name):
    return subprocess.run(["git", "rev-parse", "--short", name], cwd=ROOT,
                          check=True, capture_output=True,
                          text=True).stdout.strip()
  return rev("HEAD"), rev("HEAD:tfremat")


def _machine():
  """One line naming this machine and the library versions."""
  done = subprocess.run(
      [sys.executable, "-c",
       "import tensorflow as tf, keras\n"
       "try:\n  import keras_hub; hub = keras_hub.__version__\n"
       "except ImportError:\n  hub = 'not-installed'\n"
       "print(tf.__version__, keras.__version__, hub)"],
      capture_output=True, text=True, check=True,
      env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0"))
  tf_version, keras_version, hub = done.stdout.split()
  # TensorFlow says at import whether it uses oneDNN's kernels.
  onednn = "oneDNN custom operations are on" in done.stderr
  cpu = next((line.split(":", 1)[1].strip() for line in
              pathlib.Path("/proc/cpuinfo").read_text().splitlines()
              if line.startswith("model name")), platform.processor())
  return (f"{os.cpu_count()} cores ({cpu}), {platform.system()} "
          f"{platform.machine()}, CPU only, oneDNN "
          f"{'on' if onednn else 'off'}; Python "
          f"{platform.python_version()}, TensorFlow {tf_version}, Keras "
          f"{keras_version}, keras-hub {hub}")


def _replace(text, marker, body):
  # The block's old lines, if any (an empty block ends at its own marker).
  end = f"<!-- end {marker.split()[0]} -->"
  pattern = re.compile(rf"(<!-- {marker} -->\n)(?:(?!{end}).*\n)*({end})")
  if not pattern.search(text):
    raise SystemExit(f"docs/benchmarks.md has no <!-- {marker} --> block")
  return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main(names):
  if names == ["--list"]:
    for name in TABLES:
      print(f"{name:<26}{_shown(name)}")
    return
  unknown = set(names) - set(TABLES)
  if unknown:
    raise SystemExit(f"no such table: {sorted(unknown)}; --list names them")
  (commit, tree), today = _commit(), datetime.date.today().isoformat()
  text = _replace(PAGE.read_text(), "machine", _machine() + ".")
  for name in names or TABLES:
    command, env, folder = TABLES[name]
    print(f"{name}: {_shown(name)}", flush=True)
    done = subprocess.run(command, cwd=folder, capture_output=True,
                          text=True, env=dict(os.environ, **env))
    if os.environ.get("BENCHMARKS_LOG_DIR"):  # What each command logged.
      pathlib.Path(os.environ["BENCHMARKS_LOG_DIR"], f"{name}.log").write_text(
          done.stdout + done.stderr)
    if done.returncode:
      raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    body = (f"{today}, commit {commit} (tfremat/ tree {tree}), "
            f"`{_shown(name)}`:\n\n```\n"
            f"{_table(done.stdout)}\n```")
    text = _replace(text, f"table {name}", body)
    PAGE.write_text(text)  # Each table as it is measured.


if __name__ == "__main__":
  main(sys.argv[1:])
