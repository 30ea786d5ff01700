"""BUILD lists every module, test and example file, and nothing missing."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _listed_files():
  """Every "*.py" file BUILD names, with its list comprehensions expanded.

  Returns the files and the names of the py_test targets.
  """
  tree = ast.parse((ROOT / "BUILD").read_text())
  listed = {n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and n.value.endswith(".py") and "%" not in n.value}
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
  for folder in ("tfremat", "tests", "examples"):
    found |= {str(p.relative_to(ROOT)) for p in (ROOT / folder).glob("*.py")}
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
