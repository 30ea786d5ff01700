"""Module paths of earlier versions, served with a DeprecationWarning.

The internals moved to `tfremat._src` and the Lingvo API to `tfremat.lingvo`.
Code and Params text written against the flat paths (`tfremat.remat`,
`from tfremat import step_seed`, `type/tfremat.builder_layers/...`) keep
working: each old path names the same module object as its new one, so the
private names it held resolve too, and the first use of each warns once,
naming where to import it from now.

Two hooks serve them, both in the package's own namespace only:
`attribute` (the package's module `__getattr__`, for `tfremat.remat` and
`from tfremat import remat`) and `Finder` (on `sys.meta_path`, for the
statement `import tfremat.remat` and `importlib.import_module`, which look
for a submodule and never read the package's attributes). Nothing is put in
`sys.modules` until an old path is used.
"""

import importlib
import importlib.abc
import importlib.util
import os
import sys
import warnings

from tfremat import errors

__all__ = ["ALIASES", "MOVED", "Finder", "attribute", "install", "target",
           "planner_attribute"]

_PACKAGE = "tfremat"

# old name -> (the module it names now, what to import instead).
MOVED = {
    "builder_layers": ("lingvo.builder_layers", "tfremat.lingvo.builder_layers"
                       " (or tfremat.lingvo.layers)"),
    "in_place": ("_src.keras_api.in_place", "tfremat.remat_in_place and its siblings"),
    "layers": ("_src.keras_api.layers", "tfremat.RematerializationLayer"),
    "max_batch": ("bench.max_batch", "tfremat.bench.max_batch (the bench's "
                  "rows; tfremat.largest_batch is the call to make)"),
    "remat": ("_src.core.remat", "tfremat.RematerializeFn, tfremat.rematerialize"
              " and tfremat.debug_reruns"),
    "remat_model": ("_src.keras_api.remat_model", "tfremat.remat_model and "
                    "tfremat.chain_units"),
    "residuals": ("_src.core.residuals", "tfremat.saved_residuals"),
    "selective": ("_src.core.selective", "tfremat.policies"),
    "state": ("_src.core.keras_state", "tfremat.RematerializeFn (the state it replays "
              "is internal)"),
    "step_seed": ("_src.core.step_seed", "tfremat.lingvo.step_seed"),
    "watch": ("_src.core.watch", "tfremat.RematerializeFn (how it watches "
              "variables is internal)"),
}
# Public module names of the package that live elsewhere (tfremat.__all__
# lists them): served without a warning.
ALIASES = {"builder": "lingvo.builder", "hyperparams": "_src.core.hyperparams"}

_warned = set()
_IMPORT_MACHINERY = (os.path.dirname(importlib.__file__), "<frozen ")


def _caller_stacklevel():
  """The `stacklevel` that points a warning at the first frame outside this
  module, the package's __init__ and Python's import machinery: the line
  that used the old path."""
  here = (__file__, os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                 "__init__.py"))
  # Level 1 is the function that calls warnings.warn (_warn), our caller;
  # `warnings` itself does not count the import system's frozen frames.
  frame, level = sys._getframe(1), 1  # pylint: disable=protected-access
  while frame is not None:
    name = frame.f_code.co_filename
    frozen = "importlib" in name and "_bootstrap" in name
    if name not in here and not frozen and not name.startswith(
        _IMPORT_MACHINERY):
      return level
    frame, level = frame.f_back, level + (not frozen)
  return 1


def _warn(old):
  if old in _warned:
    return
  _warned.add(old)
  warnings.warn(
      f"{_PACKAGE}.{old} is a module path of an earlier version of tfremat; "
      f"it still works but will be removed. Use {MOVED[old][1]} instead.",
      DeprecationWarning, stacklevel=_caller_stacklevel())


def target(old):
  """The module path `tfremat.<old>` names now, or None if it is not an
  old or alias path."""
  if old in MOVED:
    return f"{_PACKAGE}.{MOVED[old][0]}"
  if old in ALIASES:
    return f"{_PACKAGE}.{ALIASES[old]}"
  return None


def attribute(old):
  """The package's module `__getattr__`: the module an old path names,
  after its warning; AttributeError for any other name."""
  if old not in MOVED:  # An alias is set on the package: never asked for.
    raise errors.MissingAttributeError(
        f"module {_PACKAGE!r} has no attribute {old!r}")
  _warn(old)
  return importlib.import_module(target(old))


# tfremat 0.1.0 measured chains in tfremat.planner; these are tfremat.chain's.
_PLANNER_TO_CHAIN = ("measure_chain", "measure_layer", "measure_peak",
                     "training_step")


def planner_attribute(name):
  """`tfremat.planner`'s module `__getattr__`: 0.1.0's measuring functions,
  after a warning that names `tfremat.chain`'s."""
  if name not in _PLANNER_TO_CHAIN:
    raise errors.MissingAttributeError(
        f"module 'tfremat.planner' has no attribute {name!r}")
  warnings.warn(f"tfremat.planner.{name} is tfremat.chain.{name} since "
                "tfremat 0.2; use that name.", DeprecationWarning,
                stacklevel=2)
  return getattr(importlib.import_module(
      f"{_PACKAGE}._src.planning.profile"), name)


class _Loader(importlib.abc.Loader):
  """Loads an old path as the module it names now: the import system puts
  the placeholder it made in `sys.modules`, and takes back whatever module
  is there after `exec_module`."""

  def __init__(self, new):
    self._new = new

  def create_module(self, spec):
    return None  # The import system's default: an empty placeholder.

  def exec_module(self, module):
    sys.modules[module.__name__] = importlib.import_module(self._new)


class Finder(importlib.abc.MetaPathFinder):
  """Finds `tfremat.<old>` for the statement `import tfremat.<old>`."""

  def find_spec(self, fullname, path, target_module=None):
    del path, target_module  # Unused.
    package, _, old = fullname.rpartition(".")
    new = target(old) if package == _PACKAGE else None
    if new is None:
      return None
    if old in MOVED:
      _warn(old)
    return importlib.util.spec_from_loader(fullname, _Loader(new))


def install(package):
  """Lets `package` (tfremat's module object) serve the paths above: adds
  the finder once, and keeps `tfremat.remat_model` the function when the
  statement `import tfremat.remat_model` sets the module of that name on
  the package."""
  if not any(isinstance(f, Finder) for f in sys.meta_path):
    sys.meta_path.append(Finder())
  package.__class__ = _Package


class _Package(type(sys)):
  """tfremat's module type: the import system sets each submodule it loads
  as an attribute of its package, which for the old path
  `tfremat.remat_model` would replace the function of that name."""

  def __setattr__(self, name, value):
    if name in MOVED and name in self.__dict__ and isinstance(value, type(sys)):
      return  # The package's own name (the function remat_model) stays.
    super().__setattr__(name, value)
