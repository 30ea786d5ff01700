"""tfremat's modules import downward only: no cycles, measuring at the
bottom, the planner pure, the bench and the reference models at the top."""

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfremat"


def _imports():
  """module -> the tfremat modules it imports, lazily imported ones too."""
  modules = {path.stem for path in PACKAGE.glob("*.py")}
  graph = {}
  for path in PACKAGE.glob("*.py"):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.ImportFrom) and node.module == "tfremat":
        # `from tfremat import chain` names a module; `from tfremat import
        # RematerializeFn` the package's __init__.
        found |= {a.name if a.name in modules else "__init__"
                  for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and (
          node.module.startswith("tfremat.")):
        found.add(node.module.split(".")[1])
      elif isinstance(node, ast.Import):
        for alias in node.names:
          if alias.name == "tfremat":
            found.add("__init__")
          elif alias.name.startswith("tfremat."):
            found.add(alias.name.split(".")[1])
    graph[path.stem] = found - {path.stem}
  return graph


def _cycle(graph):
  """A cycle among the modules as a list, or None."""
  state = {}

  def visit(module, path):
    state[module] = "open"
    for dep in sorted(graph.get(module, ())):
      if state.get(dep) == "open":
        return path[path.index(dep):] + [dep]
      if dep not in state:
        found = visit(dep, path + [dep])
        if found:
          return found
    state[module] = "done"
    return None

  for module in sorted(graph):
    if module not in state:
      found = visit(module, [module])
      if found:
        return found
  return None


def test_no_module_imports_in_a_circle():
  # The package's __init__ is a node too: a module that it imports and that
  # does `import tfremat` (even inside a function) closes a circle.
  graph = _imports()
  assert _cycle(graph) is None, _cycle(graph)


def test_a_cycle_is_found():
  # The check itself: a planted cycle is reported.
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
  assert _cycle({"a": {"b"}, "b": set()}) is None


def test_each_idea_sits_at_its_level():
  graph = _imports()
  assert graph["measure"] == set()  # The bottom: used by all who measure.
  assert graph["planner"] <= {"measure"}  # Pure: computes, never measures.
  assert graph["policies"] == set()  # Pure functions of an op's description.
  assert graph["watch"] == set()  # The one op callback, below all who use it.
  assert graph["selective"] <= {"policies", "watch"}  # Keeping, replacing.
  assert "selective" in graph["remat"]
  assert graph["layers"] <= {"hyperparams", "policies", "remat"}  # The wrapper.
  assert "chain" not in graph["layers"] | graph["planner"]
  top = {"bench", "models"}
  library = set(graph) - top - {"__init__"}
  assert not any(graph[m] & {"bench"} for m in graph), graph
  assert not any(graph[m] & top for m in library), graph


def test_every_module_says_what_it_exports():
  # `__all__` in the package and every module, and each name in it exists.
  import importlib  # pylint: disable=g-import-not-at-top
  for path in sorted(PACKAGE.glob("*.py")):
    name = "tfremat" if path.stem == "__init__" else f"tfremat.{path.stem}"
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), name
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, (name, missing)


def test_the_lingvo_api_is_gathered_and_old_paths_still_work():
  from tfremat import builder, builder_layers, hyperparams, lingvo, step_seed  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  assert lingvo.Params is hyperparams.Params
  assert lingvo.Base is builder.Base
  assert lingvo.layers is builder_layers
  assert lingvo.GetStepSeed is step_seed.GetStepSeed


def _code_lines(node):
  """A definition's lines, its docstring left out."""
  lines = node.end_lineno - node.lineno + 1
  first = node.body[0] if node.body else None
  if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
      and isinstance(first.value.value, str)):
    lines -= first.end_lineno - first.lineno + 1
  return lines


def _too_long(functions=60, classes=250):
  found = []
  for path in sorted(PACKAGE.glob("*.py")):
    if path.stem == "bench":  # A script of tables, read top to bottom.
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        limit = functions
      elif isinstance(node, ast.ClassDef):
        limit = classes
      else:
        continue
      if _code_lines(node) > limit:
        found.append(f"{path.stem}.{node.name}: {_code_lines(node)} lines")
  return found


def test_functions_and_classes_stay_short_enough_to_read():
  # Docstrings aside: at most 60 lines a function, 250 a class.
  assert not _too_long(), _too_long()
  assert _too_long(functions=5)  # The check itself finds long ones.
