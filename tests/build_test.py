"""BUILD lists every module, test and example file, and nothing missing."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _listed_files():
  """Every "*.py" string literal in BUILD, with the "%s" test pattern expanded."""
  tree = ast.parse((ROOT / "BUILD").read_text())
  strings = [n.value for n in ast.walk(tree)
             if isinstance(n, ast.Constant) and isinstance(n.value, str)]
  tests = [elt.elts[0].value for n in ast.walk(tree)
           if isinstance(n, ast.comprehension)
           for elt in n.iter.elts]
  listed = {s for s in strings if s.endswith(".py") and "%" not in s}
  listed |= {f"tests/{name}.py" for name in tests}
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
