"""BUILD lists every module, test and example file, nothing missing, and
passes buildifier's checks."""

import ast
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _listed_files():
  """Every "*.py" file BUILD names, with its list comprehensions expanded.

  Returns the files and the names of the py_test targets.
  """
  tree = ast.parse((ROOT / "BUILD").read_text())
  listed = {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.endswith(".py") and "%" not in n.value
            and "*" not in n.value  # Globs in `data` name no one file.
            and "/" in n.value}  # Top-level files (setup.py) are data.
  tests = []
  for comp in ast.walk(tree):
    if not isinstance(comp, ast.ListComp):
      continue
    rule = comp.elt.func.id
    names = [e.elts[0].value if isinstance(e, ast.Tuple) else e.value
             for e in comp.generators[0].iter.elts]
    folder = {"py_test": "tests", "py_binary": "examples"}[rule]
    listed |= {f"{folder}/{name}.py" for name in names}
    if rule == "py_test":
      tests += names
  return listed, tests


def _repository_files():
  found = set()
  for folder, pattern in (("tfremat", "**/*.py"), ("tests", "*.py"),
                          ("examples", "*.py")):
    found |= {str(p.relative_to(ROOT)) for p in (ROOT / folder).glob(pattern)}
  return found


def test_every_python_file_is_listed_in_build():
  listed, _ = _listed_files()
  assert sorted(_repository_files() - listed) == []


def test_build_lists_no_missing_file():
  listed, _ = _listed_files()
  assert sorted(listed - _repository_files()) == []


def test_every_test_file_has_a_py_test():
  _, tests = _listed_files()
  test_files = {p.stem for p in (ROOT / "tests").glob("*_test.py")}
  assert sorted(tests) == sorted(test_files)


def test_buildifier_finds_nothing_to_fix():
  # Bazel's own formatter and linter (npm install @bazel/buildifier); CI
  # installs it. A Bazel build cannot run here: its rules are downloaded.
  buildifier = shutil.which("buildifier")
  if buildifier is None:
    pytest.skip("buildifier is not installed (npm install @bazel/buildifier)")
  proc = subprocess.run([buildifier, "--mode=check", "--lint=warn",
                         str(ROOT / "BUILD")], capture_output=True, text=True)
  assert proc.returncode == 0 and not proc.stdout + proc.stderr, (
      proc.stdout + proc.stderr)
