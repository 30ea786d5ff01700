"""Lingvo-style hierarchical hyperparameters.

  p = Params()
  p.Define("dims", 512, "Model width.")
  p.Define("dropout", Params(), "Dropout settings.")
  p.dropout.Define("keep_prob", 0.9, "Probability to keep an activation.")
  p.Set(dims=1024)
  print(p)            # dims : 1024
                      # dropout.keep_prob : 0.9

Every knob is defined once with a default and a one-line description, so the
text form of a model's params is a complete, reviewable description of it, and
`FromText` sets the values back from that text.
"""

import ast
import copy
import difflib
import importlib
import os
import re
import sys

from tfremat import errors

__all__ = [
    "Params",
    "InstantiableParams",
    "IsInstantiable",
]


class _Param:
  """One defined parameter: its name, value and description."""

  def __init__(self, name, default, description):
    self.name = name
    self.value = default
    self.description = description


def _IsParamsList(value):
  return (isinstance(value, (list, tuple)) and value and
          all(isinstance(v, Params) for v in value))


def _ModuleName(module):
  """The name another program imports `module` by.

  A class defined in a script run as `python path/to/script.py` or
  `python -m package.script` lives in `__main__`, a name that means the other
  program itself there. Such a script is importable as `script` (its
  directory on sys.path) or `package.script`.
  """
  if module != "__main__":
    return module
  main = sys.modules["__main__"]
  spec = getattr(main, "__spec__", None)
  if spec is not None and spec.name:
    return spec.name
  path = getattr(main, "__file__", None)
  return os.path.splitext(os.path.basename(path))[0] if path else module


def _Module(name):
  """The module `name`: in the program whose `__main__` `_ModuleName`
  writes as `name` (a script run as `python my_experiment.py`), `__main__`
  itself, unless the script was also imported under that name. Importing
  it again would run its top-level code a second time and make second
  copies of its classes."""
  if name not in sys.modules and _ModuleName("__main__") == name != "__main__":
    return sys.modules["__main__"]
  return importlib.import_module(name)


def _ValueToText(value):
  if isinstance(value, type):
    return f"type/{_ModuleName(value.__module__)}/{value.__qualname__}"
  if callable(value) and hasattr(value, "__qualname__"):
    return f"callable/{_ModuleName(value.__module__)}/{value.__qualname__}"
  return repr(value)


def _TextToValue(text, key):
  match = re.fullmatch(r"(type|callable)/([\w.]+)/([\w.<>]+)", text)
  if match:
    kind, module, name = match.groups()
    if "<locals>" in name.split("."):
      raise errors.InvalidArgumentError(
          f"FromText: {key} names a local {kind} ({text}), which cannot be "
          "looked up again; define it at module level.")
    try:
      obj = _Module(module)
      for part in name.split("."):
        obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
      raise errors.InvalidArgumentError(
          f"FromText: {key} names {kind} {name} in module {module}, which "
          f"cannot be imported here ({e}). Put the module's directory on "
          "sys.path (PYTHONPATH) or install its package.") from e
    return obj
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError) as e:
    raise errors.InvalidArgumentError(
        f"FromText: cannot parse the value of {key}: {text!r}. Values are "
        "Python literals, type/module/Name or callable/module/name.") from e


class Params:
  """A set of named, documented hyperparameters; values may be Params too."""

  def __init__(self):
    object.__setattr__(self, "_params", {})

  def Define(self, name, default_value, description):
    """Defines a parameter `name` with a default value and a description."""
    if not isinstance(name, str) or not re.fullmatch(r"[a-z_][a-z0-9_]*",
                                                      name):
      raise errors.InvalidArgumentError(
          f"Params.Define: {name!r} is not a valid parameter name; use "
          "lower_case_with_underscores.")
    if name in self._params:
      raise errors.MissingAttributeError(f"Params.Define: {name!r} is already defined.")
    self._params[name] = _Param(name, default_value, description)

  def _Lookup(self, name):
    try:
      return self._params[name]
    except KeyError:
      close = difflib.get_close_matches(name, list(self._params), n=3)
      hint = (f" Did you mean: {', '.join(close)}?" if close else
              f" Defined: {', '.join(sorted(self._params)) or 'none'}.")
      raise errors.MissingAttributeError(
          f"{name!r} is not defined in these Params.{hint}") from None

  def __getattr__(self, name):
    if name.startswith("__"):
      raise AttributeError(name)
    return self._Lookup(name).value

  def __setattr__(self, name, value):
    self._Lookup(name).value = value

  def __contains__(self, name):
    return name in self._params

  def __iter__(self):
    return iter(sorted(self._params))

  def __eq__(self, other):
    return isinstance(other, Params) and self._Items() == other._Items()

  def _Items(self):
    return {k: p.value for k, p in self._params.items()}

  def Get(self, name):
    """The value of `name`, in the form `ToText` prints: dotted names reach
    into nested Params and `sub[0]` into a list of them ("sub[0].name")."""
    node, last = self._Resolve(name)
    return node._Lookup(last).value

  def Set(self, **kwargs):
    """Sets the given parameters; returns self, so calls chain. Names may be
    dotted, as in Get: `p.Set(**{"sub[0].name": "x"})`."""
    # Every name is checked before anything changes.
    targets = [(self._Resolve(name), value) for name, value in kwargs.items()]
    for (node, last), _ in targets:
      node._Lookup(last)
    for (node, last), value in targets:
      node._params[last].value = value
    return self

  def Delete(self, *names):
    """Removes the named parameters (dotted names allowed); returns self."""
    targets = [self._Resolve(name) for name in names]
    for node, last in targets:
      node._Lookup(last)  # Every name is checked before any is deleted.
    for node, last in targets:
      del node._params[last]
    return self

  def IterParams(self):
    """Yields (name, value) of each parameter at this level, sorted by name."""
    for name in sorted(self._params):
      yield name, self._params[name].value

  def Description(self, name):
    """The one-line description `name` was defined with (dotted allowed)."""
    node, last = self._Resolve(name)
    return node._Lookup(last).description

  def Copy(self):
    """A deep copy: nested Params and lists are copied; classes are not."""
    return copy.deepcopy(self)

  def __deepcopy__(self, memo):
    new = type(self).__new__(type(self))
    object.__setattr__(new, "_params", {})
    for name, p in self._params.items():
      value = p.value
      if not callable(value):  # Classes and functions are shared, not copied.
        value = copy.deepcopy(value, memo)
      new._params[name] = _Param(name, value, p.description)
    return new

  def _TextLines(self, prefix):
    lines = []
    for name in sorted(self._params):
      value = self._params[name].value
      key = prefix + name
      if isinstance(value, Params):
        lines += value._TextLines(key + ".")
      elif _IsParamsList(value):
        for i, item in enumerate(value):
          lines += item._TextLines(f"{key}[{i}].")
      else:
        lines.append(f"{key} : {_ValueToText(value)}")
    return lines

  def ToText(self):
    """One `dotted.name : value` line per parameter, sorted."""
    return "\n".join(self._TextLines("")) + "\n"

  def __str__(self):
    return self.ToText()

  def __repr__(self):
    return f"Params({self._Items()!r})"

  def _Resolve(self, key):
    """The Params holding dotted `key`, and the last name in it."""
    node, parts = self, key.split(".")
    for part in parts[:-1]:
      match = re.fullmatch(r"(\w+)\[(\d+)\]", part)
      if match:
        items = node._Lookup(match.group(1)).value
        index = int(match.group(2))
        if not _IsParamsList(items) or index >= len(items):
          raise errors.MissingAttributeError(
              f"{key}: {part} is not an item of a list of Params.")
        node = items[index]
      else:
        node = node._Lookup(part).value
      if not isinstance(node, Params):
        raise errors.MissingAttributeError(f"{key}: {part} is not a Params.")
    return node, parts[-1]

  def FromText(self, text):
    """Sets values from `ToText` output (the structure must already exist)."""
    updates = {}
    for number, line in enumerate(text.splitlines(), 1):
      line = line.strip()
      if not line or line.startswith("#"):
        continue
      key, sep, value = line.partition(" : ")
      if not sep:
        raise errors.InvalidArgumentError(
            f"FromText line {number}: expected 'name : value', got {line!r}.")
      updates[key.strip()] = _TextToValue(value.strip(), key)
    # All lines parse before Set, which checks every name before setting any.
    return self.Set(**updates)


class InstantiableParams(Params):
  """Params for a class: `Instantiate()` builds the object they describe."""

  def __init__(self, cls=None):
    super().__init__()
    self.Define("cls", cls, "The class that these params instantiate.")
    self.Define("name", None, "Name of the instantiated object.")

  def Instantiate(self):
    """`cls.FromParams(self)` when the class defines it, else `cls(self)`."""
    if self.cls is None:
      raise errors.InvalidArgumentError("Instantiate: these params have no cls set.")
    factory = getattr(self.cls, "FromParams", None)
    return factory(self) if factory is not None else self.cls(self)


def IsInstantiable(params):
  """Whether `params` are `InstantiableParams` (have `Instantiate()`)."""
  return isinstance(params, InstantiableParams)


# Users import these from `tfremat.lingvo.hyperparams`, the name their text
# form (`cls : type/...`) and their repr give.
Params.__module__ = InstantiableParams.__module__ = "tfremat.lingvo.hyperparams"
