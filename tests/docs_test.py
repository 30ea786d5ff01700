"""Every Python snippet in the README and docs runs as written.

Each runs in a fresh Python, as a reader would paste it: a snippet that
relies on a name it never defines fails here. A snippet followed by a
```text block must print that text; `...` in it stands for any text (a
measured size, a time).
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import api_reference

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


_SNIPPET = re.compile(r"```python\n(.*?)```\n(?:\n*```text\n(.*?)```)?", re.S)


def _snippets():
  found = []
  for page in PAGES:
    text = page.read_text()
    for i, match in enumerate(_SNIPPET.finditer(text)):
      found.append(pytest.param(*match.groups(), id=f"{page.name}-{i}"))
  return found


def _prints(expected, printed):
  """Whether `printed` is `expected`, `...` matching anything, trailing
  spaces aside."""
  def lines(text):
    return "\n".join(line.rstrip() for line in text.strip().splitlines())
  pattern = re.escape(lines(expected)).replace(re.escape("..."), ".*?")
  return re.fullmatch(pattern, lines(printed), re.S) is not None


def test_the_pages_have_snippets_and_show_what_they_print():
  assert len(_snippets()) >= 10
  assert sum(1 for s in _snippets() if s.values[1] is not None) >= 6
  assert _prints("peak: ... MiB\nok", "peak: 5.0 MiB  \nok")
  assert not _prints("peak: ... MiB\nok", "peak: 5.0 MiB\nnot ok")


@pytest.mark.parametrize("code, output", _snippets())
def test_snippet_runs_as_written(code, output, tmp_path):
  done = subprocess.run(
      [sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
      text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  if output is not None:
    assert _prints(output, done.stdout), (
        f"printed:\n{done.stdout}\nthe page shows:\n{output}")


def test_the_api_reference_is_current():
  # docs/api.md is written from the docstrings by tests/api_reference.py;
  # a public name or docstring changed without it fails here.
  assert api_reference.PAGE.read_text() == api_reference.page(), (
      "docs/api.md is out of date: run python tests/api_reference.py")


def test_the_api_reference_lists_every_public_name():
  import tfremat  # pylint: disable=import-outside-toplevel
  from tfremat import lingvo  # pylint: disable=import-outside-toplevel
  text = api_reference.PAGE.read_text()
  for prefix, module in (("tfremat.", tfremat), ("tfremat.lingvo.", lingvo)):
    missing = [n for n in module.__all__ if f"### `{prefix}{n}`" not in text]
    assert not missing, missing


_CITED = re.compile(
    r"`(?:tfremat\.)?((?:planner|chain|measure|policies|errors|lingvo|models|"
    r"max_batch|bench)(?:\.[A-Za-z_]\w*)+)")


def test_every_code_name_the_docs_cite_exists():
  # A renamed or removed function, constant or module named in the docs
  # (`planner.DEFAULT_SETTINGS`, `tfremat.chain.measure_chain`) fails here.
  import importlib  # pylint: disable=import-outside-toplevel
  missing = []
  for page in PAGES + [ROOT / "CONTRIBUTING.md"]:
    for name in sorted(set(_CITED.findall(page.read_text()))):
      parts = name.split(".")
      obj = importlib.import_module(f"tfremat.{parts[0]}")
      try:
        for part in parts[1:]:
          obj = getattr(obj, part)
      except AttributeError:
        missing.append(f"{page.name}: {name}")
  assert not missing, missing
