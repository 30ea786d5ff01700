"""Writes docs/api.md, tfremat's API reference, from the docstrings.

  python tests/api_reference.py      # rewrites docs/api.md

Every name in `tfremat.__all__` and `tfremat.lingvo.__all__` gets its
signature and docstring; a module named there gets its summary and the
first line of each name in its own `__all__`. `tests/docs_test.py` checks
that the page is what this writes, so a docstring or a public name changed
without the page fails the tests.
"""

import inspect
import pathlib
import sys

PAGE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"

_HEADER = """\
# API reference

Generated from the docstrings by `python tests/api_reference.py`;
`tests/docs_test.py` checks that it is current. The guide
([guide.md](guide.md)) shows how the pieces fit together.
"""


def _doc(obj):
  return inspect.cleandoc(getattr(obj, "__doc__", None) or "(no docstring)")


def _first_line(obj):
  return _doc(obj).split("\n\n")[0].replace("\n", " ")


def _signature(name, obj):
  target = obj.__init__ if inspect.isclass(obj) else obj
  try:
    sig = inspect.signature(target)
  except (TypeError, ValueError):
    return name
  params = [p for p in sig.parameters.values() if p.name != "self"]
  text = f"{name}{sig.replace(parameters=params, return_annotation=sig.empty)}"
  # Defaults that are the package's named values, by their names.
  from tfremat import planner, policies  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  return (text.replace(repr(policies.PLANNED), "tfremat.policies.PLANNED")
          .replace(repr(planner.DEFAULT_SETTINGS),
                   "tfremat.planner.DEFAULT_SETTINGS"))


def _summary(member):
  """A module member's line: a policy's description, a function's or
  class's first paragraph, or a constant's value (its first line, for
  text)."""
  from tfremat import policies  # pylint: disable=g-import-not-at-top,import-outside-toplevel
  if isinstance(member, policies.Policy):
    return member.description
  if callable(member) or inspect.ismodule(member):
    return _first_line(member)
  if isinstance(member, str):
    return f"the text `{member.splitlines()[0]}` ..."
  return f"a constant, `{member!r}`"


def _entry(prefix, name, obj):
  if inspect.ismodule(obj):
    lines = [f"### `{prefix}{name}` (module)", "", _first_line(obj), ""]
    for inner in getattr(obj, "__all__", ()):
      member = getattr(obj, inner)
      summary = _summary(member)
      lines.append(f"- `{prefix}{name}.{inner}`: {summary}")
    return lines + [""]
  if not callable(obj):
    return [f"### `{prefix}{name}`", "", f"A constant: `{obj!r}`.", ""]
  kind = "class" if inspect.isclass(obj) else "function"
  return [f"### `{prefix}{name}` ({kind})", "", "```",
          _signature(prefix + name, obj), "```", "", _doc(obj), ""]


def page():
  """The reference page's text."""
  import tfremat  # pylint: disable=import-outside-toplevel
  from tfremat import lingvo  # pylint: disable=import-outside-toplevel
  lines, documented = [_HEADER], {}
  for title, module, prefix in (("`tfremat`", tfremat, "tfremat."),
                                ("`tfremat.lingvo`", lingvo,
                                 "tfremat.lingvo.")):
    lines += [f"## {title}", "", _first_line(module), ""]
    for name in module.__all__:
      obj = getattr(module, name)
      if id(obj) in documented:
        lines += [f"### `{prefix}{name}`", "",
                  f"The same object as `{documented[id(obj)]}`.", ""]
        continue
      documented[id(obj)] = prefix + name
      lines += _entry(prefix, name, obj)
  return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
  PAGE.write_text(page())
  sys.stdout.write(f"wrote {PAGE}\n")
