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
