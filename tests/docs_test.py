"""Every Python snippet in the README and docs runs as written.

Each runs in a fresh Python, as a reader would paste it: a snippet that
relies on a name it never defines fails here. A snippet followed by a
```text block must print that text; `...` in it stands for any text (a
measured size, a time).
"""

import importlib.util
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


def test_largest_batchs_docstring_example_is_the_guides_run_snippet():
  # The docstring's example runs, as the guide's snippet (run above); this
  # keeps the two the same code.
  import textwrap  # pylint: disable=import-outside-toplevel
  import tfremat  # pylint: disable=import-outside-toplevel
  doc = tfremat.largest_batch.__doc__
  example = textwrap.dedent(
      doc[doc.index("\n\n") + 2:doc.index("\n\n  (docs/guide.md")]).strip()
  guide = _section(ROOT / "docs" / "guide.md",
                   "The largest batch for your memory: `largest_batch`")
  code = _SNIPPET.search(guide).group(1)
  assert example in code, (example, code)


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


# Pages whose links and headings are checked; CHANGELOG.md and
# CONTRIBUTING.md are read on GitHub as the others are.
_LINKED_PAGES = PAGES + [ROOT / "CHANGELOG.md", ROOT / "CONTRIBUTING.md"]


def _anchor(heading):
  """GitHub's anchor for a heading: lower case, punctuation but `-` and `_`
  dropped, spaces made `-`."""
  text = re.sub(r"[`*]", "", heading.strip()).lower()
  text = re.sub(r"[^\w\- ]", "", text)
  return text.replace(" ", "-")


def _headings(page):
  """The headings of a Markdown page, outside its code blocks."""
  text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
  return [m.group(1) for m in re.finditer(r"^#+ (.+)$", text, re.M)]


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_and_anchor_resolves():
  broken = []
  for page in _LINKED_PAGES:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in _LINK.findall(text):
      if re.match(r"[a-z]+:", target):  # https:, mailto:
        continue
      path, _, anchor = target.partition("#")
      linked = (page.parent / path).resolve() if path else page
      if not linked.exists():
        broken.append(f"{page.name}: {target} (no such file)")
      elif anchor and anchor not in {_anchor(h) for h in _headings(linked)}:
        broken.append(f"{page.name}: {target} (no such heading)")
  assert not broken, broken


# `docs/design.md, "Budgets that hold"`, across a line break and the comment
# marks of code.
_CITED_SECTION = re.compile(
    r"((?:docs/)?[a-z_]+\.md)(?:'s)?,?\s+(?:#\s*)?\"([^\"]+)\"")


def _citing_files():
  for folder, pattern in (("tfremat", "**/*.py"), ("tests", "*.py"),
                          ("examples", "*.py")):
    yield from sorted((ROOT / folder).glob(pattern))
  yield from _LINKED_PAGES


def test_every_cited_section_exists():
  # A section cited as the evidence for a default that was later renamed or
  # removed leaves the citation pointing nowhere.
  missing = []
  for path in _citing_files():
    if path.name == "docs_test.py":
      continue
    text = re.sub(r"\n\s*#?\s*", " ", path.read_text())
    for page, section in _CITED_SECTION.findall(text):
      target = ROOT / page if page.startswith("docs/") else next(
          (p for p in _LINKED_PAGES if p.name == page), None)
      if target is None or not target.exists():
        missing.append(f"{path.name}: {page} (no such page)")
      elif section not in _headings(target):
        missing.append(f'{path.name}: {page}, "{section}"')
  assert not missing, missing


def _section(page, heading):
  text = page.read_text()
  start = text.index(f"## {heading}\n")
  end = text.find("\n## ", start + 1)
  return text[start:end if end >= 0 else None]


# A figure: a ratio (2.5x), a percentage (35%), a size (512 MiB) or a time
# (92 s); ranges give both ends.
_FIGURE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)(x|%| MiB| s\b)")


def _tables_with_labels():
  """The evidence tables: each of docs/benchmarks.md's and docs/design.md's
  tables, with the text between its heading and the table (where
  its command, commit and date are given)."""
  tables = []
  for page in (ROOT / "docs" / "benchmarks.md", ROOT / "docs" / "design.md"):
    for block in re.split(r"\n(?=#+ )", page.read_text()):
      # Markdown tables, and the bench's own printed tables in plain code
      # blocks.
      for match in re.finditer(r"((?:^\|.*\|\n)+)|^```\n(.*?)^```", block,
                               re.M | re.S):
        tables.append((page.name, block[:match.start()],
                       match.group(1) or match.group(2)))
  return tables


def test_every_table_says_its_command_commit_and_date():
  unlabelled = []
  for page, before, table in _tables_with_labels():
    if not re.search(r"\b(peak|step|batch|bound|MiB|x none)\b", table):
      continue  # A table of names, not of measurements.
    label = before[-1500:]
    if not (re.search(r"python\s+(-[mc]\s+)?\S+", label) and
            re.search(r"\bcommit\s+[0-9a-f]{7,}", label) and
            re.search(r"\b20\d\d-\d\d-\d\d\b", label)):
      unlabelled.append(f"{page}: {table.splitlines()[0][:60]}")
  assert not unlabelled, unlabelled


def test_the_cpu_tables_measure_one_state_of_the_package():
  # docs/benchmarks.py writes every CPU table between its markers, naming
  # the git tree of the tfremat/ it measured: one tree for the whole page,
  # so no table is left from older code.
  page = (ROOT / "docs" / "benchmarks.md").read_text()
  blocks = dict(re.findall(r"<!-- table (\S+) -->\n(.*?)\n<!-- end table -->",
                           page, re.S))
  spec = importlib.util.spec_from_file_location(
      "docs_benchmarks", ROOT / "docs" / "benchmarks.py")
  script = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(script)
  assert sorted(blocks) == sorted(script.TABLES)
  trees = {name: re.findall(r"\(tfremat/ tree ([0-9a-f]{7,})\)", body)
           for name, body in blocks.items()}
  assert all(len(found) == 1 for found in trees.values()), trees
  assert len({found[0] for found in trees.values()}) == 1, trees


def test_the_readmes_figures_are_in_the_tables():
  # The headline's and "Costs and limits"' numbers each come from a table
  # a reader can rerun.
  readme = ROOT / "README.md"
  text = readme.read_text()
  headline = text[:text.index("\n## ")]
  limits = _section(readme, "Costs and limits")
  tables = "\n".join(table for _, _, table in _tables_with_labels())
  found_in = set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?", tables))
  # Round figures a reader rounds to (2.5x from 2.53) count too.
  for value in list(found_in):
    found_in.add(f"{float(value):.1f}")
    found_in.add(f"{float(value):.0f}")
  missing = []
  for part in (headline, limits):
    prose = re.sub(r"```.*?```", "", part, flags=re.S)
    for number, unit in _FIGURE.findall(prose):
      if unit.strip() in ("MiB", "s") or unit in ("x", "%"):
        if number not in found_in:
          missing.append(f"{number}{unit}")
  assert not missing, missing
