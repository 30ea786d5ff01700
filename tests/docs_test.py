"""Every Python snippet in the README and docs runs as written.

Each runs in a fresh Python, as a reader would paste it: a snippet that
relies on a name it never defines fails here.
"""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))


def _snippets():
  found = []
  for page in PAGES:
    text = page.read_text()
    for i, code in enumerate(re.findall(r"```python\n(.*?)```", text, re.S)):
      found.append(pytest.param(code, id=f"{page.name}-{i}"))
  return found


def test_the_pages_have_snippets():
  assert len(_snippets()) >= 10


@pytest.mark.parametrize("code", _snippets())
def test_snippet_runs_as_written(code, tmp_path):
  done = subprocess.run(
      [sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
      text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), check=False)
  assert done.returncode == 0, done.stderr[-3000:]
