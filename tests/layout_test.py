"""tfremat's modules import downward only: no cycles, measuring at the
bottom, the planner pure, the bench and the reference models at the top."""

import ast
import json
import os
import pathlib
import subprocess
import sys
import textwrap

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "tfremat"


def _module_name(path):
  """"_src.remat" for tfremat/_src/core/remat.py; "lingvo" for its __init__; the
  package's own __init__ is "__init__"."""
  parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
  if parts[-1] == "__init__" and len(parts) > 1:
    parts.pop()
  return ".".join(parts)


def _modules():
  return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imported(node, modules):
  """The tfremat modules one import statement names."""
  if isinstance(node, ast.Import):
    names = [a.name for a in node.names if a.name.split(".")[0] == "tfremat"]
    return {n[len("tfremat."):] if n != "tfremat" else "__init__"
            for n in names}
  if not (isinstance(node, ast.ImportFrom) and node.module and
          node.module.split(".")[0] == "tfremat"):
    return set()
  base = node.module[len("tfremat."):] if node.module != "tfremat" else ""
  found = set()
  for alias in node.names:
    # `from tfremat._src import remat` names a module; `from tfremat import
    # RematerializeFn` the package that holds the name.
    full = f"{base}.{alias.name}" if base else alias.name
    found.add(full if full in modules else (base or "__init__"))
  return found


def _imports():
  """module -> the tfremat modules it imports, lazily imported ones too."""
  modules = _modules()
  graph = {}
  for name, path in modules.items():
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
      found |= _imported(node, modules)
    graph[name] = found - {name}
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


# The public modules users import; each is a thin re-export of _src.
PUBLIC = {"chain", "measure", "planner", "policies"}
# Programs and the Lingvo-style API built on the library (they may import
# the public modules); errors is the leaf every module may raise from.
TOP = {"models"}


def _top(module):
  """Whether `module` is a program or the reference models (the bench)."""
  return module in TOP or module.split(".")[0] == "bench"


def test_each_idea_sits_at_its_level():
  graph = _imports()
  assert graph["errors"] == set()  # Every module may raise them.
  deps = {m: found - {"errors"} for m, found in graph.items()}
  internal = {m for m in graph if m.startswith("_src.")}
  # _src imports no public module: the folders show the layers.
  leaks = {m: sorted(deps[m] - internal) for m in internal
           if deps[m] - internal}
  assert not leaks, leaks
  # Four floors, each importing only those below it: the rerun core;
  # Keras integration (wrappers, a model's chain of units); planning
  # (profile, costs, plan, check, apply); the entry points that plan. The
  # profiler reading (`measuring`) and units are leaves every floor may use.
  floors = ["core", "keras_api", "planning", "api"]
  leaves = {"_src.measuring", "_src.predicting", "_src.predicting_reruns",
            "_src.units", "_src.moved", "_src"}
  group = lambda m: m.split(".")[1]
  for module in internal - leaves:
    floor = floors.index(group(module))
    above = [d for d in deps[module] if d not in leaves and
             floors.index(group(d)) > floor]
    assert not above, (module, above)
  for leaf in ("_src.measuring", "_src.predicting", "_src.units"):
    assert deps[leaf] <= {"_src.units"}, (leaf, deps[leaf])
  # Plans' peaks read from one program build on predict_peak's reading.
  assert deps["_src.predicting_reruns"] <= {"_src.predicting"}
  # The cost model and the search are pure: they measure only through the
  # runner they are given.
  pure = {"_src.planning.cost_model", "_src.planning.plan",
          "_src.planning.plan_text", "_src.planning.search",
          "_src.planning.proposals", "_src.planning.growth", "_src.units",
          "_src.core.policies", "_src.keras_api.segments"}
  for module in pure - {"_src.core.policies"}:
    assert deps[module] <= pure, (module, deps[module])
  assert deps["_src.core.policies"] == set()  # Functions of an op's record.
  assert deps["_src.core.watch"] == set()  # The one op callback.
  lingvo = {m for m in graph if m.split(".")[0] == "lingvo"}
  library = {m for m in graph if not _top(m)} - lingvo - {"__init__"}
  assert not [m for m in library if any(_top(d) or d in lingvo
                                        for d in graph[m])], graph


def test_public_modules_are_thin_and_export_only_what_users_call():
  for name in PUBLIC:
    tree = ast.parse((PACKAGE / f"{name}.py").read_text())
    defined = [n.name for n in tree.body
               if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not defined, (name, defined)
  import tfremat  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  for name, most in (("chain", 12), ("planner", 15), ("measure", 16)):
    assert len(getattr(tfremat, name).__all__) <= most, name


def _function_imports(path):
  """(line, module) of each import of a tfremat module inside a function
  of `path` with no comment on the line before or on it saying why."""
  lines = path.read_text().splitlines()
  found = []
  for node in ast.walk(ast.parse(path.read_text())):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    for inner in ast.walk(node):
      names = (_imported(inner, _modules())
               if isinstance(inner, (ast.Import, ast.ImportFrom)) else ())
      if names:
        said = " ".join(lines[max(0, inner.lineno - 2):inner.lineno])
        if "#" not in said.replace("# pylint:", ""):
          found.append((inner.lineno, sorted(names)))
  return found


def test_no_module_imports_tfremat_inside_a_function_without_saying_why():
  # An import inside a function dodges a circle at load time: the folders
  # say which way imports go, and one that has to run late says why.
  found = {m: _function_imports(p) for m, p in _modules().items()
           if m.startswith("_src") and _function_imports(p)}
  assert not found, found


def test_no_module_is_over_600_lines():
  long = {m: len(p.read_text().splitlines()) for m, p in _modules().items()
          if len(p.read_text().splitlines()) > 600}
  assert not long, long


def test_users_never_need_the_internals():
  # The public modules export what users call; README, docs and examples
  # reach nothing under tfremat._src.
  root = PACKAGE.parent
  pages = [root / "README.md", *sorted((root / "docs").glob("*.md")),
           *sorted((root / "examples").glob("*.py"))]
  assert not [p.name for p in pages if "tfremat._src" in p.read_text()]
  internal = {m for m in _modules() if m.split(".")[0] == "_src"}
  assert {"_src.core.remat", "_src.core.keras_state",
          "_src.core.selective", "_src.core.watch"} <= internal


def test_every_module_says_what_it_exports():
  # `__all__` in the package and every module, and each name in it exists.
  import importlib  # pylint: disable=g-import-not-at-top
  for name in _modules():
    name = "tfremat" if name == "__init__" else f"tfremat.{name}"
    module = importlib.import_module(name)
    assert isinstance(getattr(module, "__all__", None), list), name
    missing = [n for n in module.__all__ if not hasattr(module, n)]
    assert not missing, (name, missing)


def test_the_lingvo_api_is_gathered_under_its_public_names():
  import tfremat  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  from tfremat import builder, hyperparams, lingvo  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  assert lingvo.Params is hyperparams.Params is lingvo.hyperparams.Params
  assert lingvo.Base is builder.Base
  assert lingvo.layers is lingvo.builder_layers
  assert lingvo.GetStepSeed is lingvo.step_seed.GetStepSeed
  assert callable(tfremat.remat_model)


_OLD_PATHS = textwrap.dedent("""
    import importlib, json, sys, warnings
    warnings.simplefilter("always")
    import tfremat
    found = {"in_sys_modules": sorted(
        m for m in sys.modules if m.split(".")[1:2] in (
            ["remat"], ["state"], ["step_seed"], ["remat_model"]))}
    with warnings.catch_warnings(record=True) as caught:
      warnings.simplefilter("always")
      import tfremat.remat_model
      from tfremat.remat_model import chain_units
      found["function_stays"] = callable(tfremat.remat_model)
      import tfremat.remat
      again = tfremat.remat
      from tfremat import state, step_seed
      found["same"] = [
          tfremat.remat is tfremat._src.core.remat is again,
          chain_units is tfremat.chain_units,
          state is tfremat._src.core.keras_state,
          step_seed.GetStepSeed is tfremat.lingvo.GetStepSeed,
          importlib.import_module("tfremat.builder_layers")
          is tfremat.lingvo.builder_layers,
          tfremat.hyperparams is importlib.import_module("tfremat.hyperparams"),
          tfremat.builder is tfremat.lingvo.builder]
    found["warnings"] = [(w.category.__name__, str(w.message),
                          w.filename == __file__) for w in caught]
    print(json.dumps(found))
""")


def test_old_module_paths_work_and_each_warns_once_naming_the_new_one(
    tmp_path):
  # In a new process: each old path warns on its first use only.
  script = tmp_path / "old_paths.py"
  script.write_text(_OLD_PATHS)
  done = subprocess.run([sys.executable, str(script)], check=True,
                        capture_output=True, text=True,
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
  found = json.loads(done.stdout.strip().splitlines()[-1])
  assert found["in_sys_modules"] == []  # Nothing until a path is used.
  assert found["function_stays"] and all(found["same"]), found
  warned = {message.split()[0]: (category, here)
            for category, message, here in found["warnings"]}
  assert len(found["warnings"]) == len(warned) == 5, found["warnings"]
  assert warned == {f"tfremat.{old}": ("DeprecationWarning", True) for old in
                    ("remat_model", "remat", "state", "step_seed",
                     "builder_layers")}, found["warnings"]
  for _, message, _ in found["warnings"]:
    assert "Use tfremat." in message, message


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
  for module, path in _modules().items():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        limit = functions
      elif isinstance(node, ast.ClassDef):
        limit = classes
      else:
        continue
      if _code_lines(node) > limit:
        found.append(f"{module}.{node.name}: {_code_lines(node)} lines")
  return found


def test_functions_and_classes_stay_short_enough_to_read():
  # Docstrings aside: at most 60 lines a function, 250 a class.
  assert not _too_long(), _too_long()
  assert _too_long(functions=5)  # The check itself finds long ones.


_BUILT_IN_ERRORS = {"AttributeError", "Exception", "IndexError", "KeyError",
                    "NotImplementedError", "RuntimeError", "TypeError",
                    "ValueError"}


def _plain_errors():
  """Built-in exceptions made with a message in the package: their text
  would not start with tfremat's prefix (tfremat.errors)."""
  found = []
  for module, path in _modules().items():
    if module == "bench.cli":  # Its errors are absl's UsageError.
      continue
    for node in ast.walk(ast.parse(path.read_text())):
      if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and
          node.func.id in _BUILT_IN_ERRORS and node.args and
          isinstance(node.args[0], (ast.Constant, ast.JoinedStr))):
        found.append(f"{module}:{node.lineno} {node.func.id}")
  return found


def test_every_error_tfremat_raises_is_one_of_its_own():
  # A message users read starts with "tfremat: " (see tests/errors_test.py);
  # bare NotImplementedError in abstract methods and AttributeError(name) in
  # __getattr__ carry no message for users and are left alone.
  assert not _plain_errors(), _plain_errors()


def _self_attributes(function):
  """The names `function` assigns as `self.name`."""
  names = set()
  for node in ast.walk(function):
    targets = (node.targets if isinstance(node, ast.Assign) else
               [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign))
               else [])
    for target in targets:
      for t in target.elts if isinstance(target, ast.Tuple) else [target]:
        if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
            and t.value.id == "self"):
          names.add(t.attr)
  return names


def _attributes_set_late():
  """`module.Class.attribute` for attributes first set outside __init__."""
  found = []
  for module, path in _modules().items():
    for cls in ast.walk(ast.parse(path.read_text())):
      if not isinstance(cls, ast.ClassDef):
        continue
      methods = [f for f in cls.body if isinstance(f, ast.FunctionDef)]
      early = set().union(*[_self_attributes(f) for f in methods
                            if f.name == "__init__"])
      late = set().union(*[_self_attributes(f) for f in methods
                           if f.name != "__init__"])
      # Keras sets `built` in Layer.__init__; a layer's build sets it again.
      found += [f"{module}.{cls.name}.{a}" for a in late - early - {"built"}]
  return sorted(found)


def test_every_attribute_is_set_in_init():
  # A reader sees in __init__ everything an object holds.
  assert not _attributes_set_late(), _attributes_set_late()


# A module a newcomer can read at one sitting: each holds one responsibility
# (the forward pass, the reruns, the rerun checks, a chain's layers, its
# measuring, ...). The benchmark, a script of many tables, is the exception.
MAX_MODULE_LINES = 650


def test_no_module_is_too_long_to_read():
  lines = {name: len(path.read_text().splitlines())
           for name, path in _modules().items()}
  long = {n: k for n, k in lines.items() if k > MAX_MODULE_LINES}
  assert not long, long
