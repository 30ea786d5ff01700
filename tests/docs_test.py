"""Every Python snippet in the README and docs runs as written.

Each runs in fresh globals, in an empty directory of its own, as a reader
would paste it: a snippet that relies on a name it never defines fails
here. The snippets of a page run one after another in one Python, a few at
a time (importing TensorFlow for each took a fifth of the main suite's
time on 2 cores), with Keras's global state cleared between them. A
snippet followed by a ```text block must print that text; `...` in it
stands for any text (a measured size, a time).
"""

import importlib.util
import json
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


# The snippets of a page, in runs of at most this many: the runs balance
# over pytest's workers.
_PER_RUN = 5
# A snippet that plans (measures a model's steps for tens of seconds) runs
# in the slow stage.
_PLANS = re.compile(r"budget=|_for_budget\(|largest_batch\(")


def _snippet_runs():
  runs, snippets = [], _snippets()
  for page in PAGES:
    for plans in (False, True):
      mine = [s for s in snippets if s.id.startswith(f"{page.name}-") and
              bool(_PLANS.search(s.values[0])) == plans]
      for start in range(0, len(mine), _PER_RUN):
        part = mine[start:start + _PER_RUN]
        runs.append(pytest.param(
            part, id=f"{page.name}-" + ",".join(
                p.id.rsplit("-", 1)[1] for p in part),
            marks=[pytest.mark.slow] if plans else []))
  return runs


# Runs each snippet (a JSON list on stdin) in fresh globals and an empty
# directory, and writes {stdout, error} for each to the file named by argv.
_RUNNER = """
import contextlib, io, json, os, sys, tempfile, traceback
results = []
for code in json.load(sys.stdin):
  out, error = io.StringIO(), None
  os.chdir(tempfile.mkdtemp())
  try:
    with contextlib.redirect_stdout(out):
      exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
  except BaseException:  # pylint: disable=broad-except
    error = traceback.format_exc()
  if "keras" in sys.modules:
    sys.modules["keras"].backend.clear_session()
  results.append({"stdout": out.getvalue(), "error": error})
  with open(sys.argv[1], "w") as f:
    json.dump(results, f)
"""


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


@pytest.mark.parametrize("snippets", _snippet_runs())
def test_snippets_run_as_written(snippets, tmp_path):
  results = tmp_path / "results.json"
  done = subprocess.run(
      [sys.executable, "-c", _RUNNER, str(results)], cwd=tmp_path,
      input=json.dumps([s.values[0] for s in snippets]), capture_output=True,
      text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"), check=False)
  ran = json.loads(results.read_text()) if results.exists() else []
  assert done.returncode == 0 and len(ran) == len(snippets), (
      f"the snippets' Python failed after {len(ran)} of them:\n"
      f"{done.stderr[-3000:]}")
  for snippet, result in zip(snippets, ran):
    (_, output), printed = snippet.values, result["stdout"]
    assert result["error"] is None, f"{snippet.id}:\n{result['error']}"
    if output is not None:
      assert _prints(output, printed), (
          f"{snippet.id} printed:\n{printed}\nthe page shows:\n{output}")


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
  missing = [f"{page.name}: {name}"
             for page in PAGES + [ROOT / "CONTRIBUTING.md"]
             for name in sorted(set(_CITED.findall(page.read_text())))
             if not _resolves(f"tfremat.{name}")]
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


def _figures(prose):
  """The measured figures of prose outside code: a number with a unit (2.5x,
  35%, 512 MiB, 92 s) or with a decimal point (off by 6.4), but not a
  library's or Python's version (TensorFlow 2.21, Python 3.10)."""
  prose = re.sub(r"```.*?```", "", prose, flags=re.S)
  prose = re.sub(r"`[^`\n]*`", "", prose)  # A setting (`budget=0.5`).
  prose = re.sub(r"\]\([^)]*\)", "]", prose)  # A link's target.
  for match in _MEASURED.finditer(prose):
    if match.group(3) and _VERSION.search(prose[:match.start()][-40:]):
      continue
    yield match.group(0), match.group(1) or match.group(3)


_MEASURED = re.compile(
    r"(?<![\w.\-])(\d+(?:\.\d+)?)(x\b|%| [KMG]iB\b| s\b| ms\b| minutes?\b)"
    r"|(?<![\w.\-])(\d+\.\d+)(?![\w.])")
_VERSION = re.compile(r"(Python|TensorFlow|Keras|keras-hub|tf-keras|TF)\b")


def _numbers(text):
  """The numbers in `text`, each also rounded as prose may give it."""
  found = set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?", text))
  return found | {f"{float(v):.1f}" for v in found} | {
      f"{float(v):.0f}" for v in found}


def test_the_readmes_and_guides_figures_are_in_the_tables():
  # Every number the README and the guide give as measured comes from a
  # table a reader can rerun, rounded as printed (2.5x from 2.53 counts),
  # or from what one of the page's snippets prints (the snippet test runs
  # it and checks that it prints that).
  tables = _numbers("\n".join(t for _, _, t in _tables_with_labels()))
  missing = []
  for page in ("README.md", "docs/guide.md"):
    text = (ROOT / page).read_text()
    printed = _numbers("\n".join(m.group(2) or ""
                                 for m in _SNIPPET.finditer(text)))
    missing += [f"{page}: {figure}" for figure, number in _figures(text)
                if number not in tables | printed]
  assert not missing, missing
  assert list(_figures("2.53x, off by 6.4, on TensorFlow 2.21 `0.5`")) == [
      ("2.53x", "2.53"), ("6.4", "6.4")]


def _public_names():
  """Every name a user can reach: the attributes of tfremat's public
  modules and of their classes, Keras's and TensorFlow's, and Python's
  built-ins."""
  import builtins  # pylint: disable=import-outside-toplevel
  import inspect  # pylint: disable=import-outside-toplevel
  import keras  # pylint: disable=import-outside-toplevel
  import tensorflow as tf  # pylint: disable=import-outside-toplevel
  import tfremat  # pylint: disable=import-outside-toplevel
  from tfremat import lingvo, measure, models, planner, policies  # pylint: disable=import-outside-toplevel,g-multiple-import
  names = set(dir(builtins)) | set(dir(dict))
  for owner in (keras, keras.Model, keras.layers, tf, tf.constant(0.0),
                tf.distribute.Strategy):
    names.update(dir(owner))
  for module in (tfremat, lingvo, measure, models, planner, policies):
    for name in dir(module):
      names.add(name)
      value = getattr(module, name)
      if inspect.isclass(value) and value.__module__.startswith("tfremat"):
        names.update(dir(value))
  return names


def _resolves(dotted):
  """Whether `tfremat.x.y` (or `tf.`, `keras.`) imports and has each
  attribute."""
  import importlib  # pylint: disable=import-outside-toplevel
  parts = dotted.split(".")
  parts[0] = {"tf": "tensorflow"}.get(parts[0], parts[0])
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    try:
      for part in parts[i:]:
        obj = getattr(obj, part)
    except AttributeError:
      return False
    return True
  return False


# Functions of other libraries and of the user that the docs call by name:
# PyTorch's checkpoint, KerasHub's generate, a user's fn or body.
_NOT_OURS = {"checkpoint", "checkpoint_sequential", "generate", "fn", "body"}


def test_every_name_and_call_the_docs_give_exists():
  # `tfremat.a.b` anywhere on a page imports; a call in backticks in prose
  # (`held_bytes()`, `model.save()`) names a function of tfremat, Keras,
  # TensorFlow, Python, a test (a table's command) or a snippet on the page.
  import warnings  # pylint: disable=import-outside-toplevel
  from tfremat.bench import methods  # pylint: disable=import-outside-toplevel
  known = _public_names() | _NOT_OURS | {
      name for path in (ROOT / "tests").glob("*.py")
      for name in re.findall(r"^def (\w+)\(", path.read_text(), re.M)}
  missing = []
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Earlier paths.
    for page in PAGES + [ROOT / "CONTRIBUTING.md"]:
      text = page.read_text()
      for name in sorted(set(re.findall(r"\btfremat(?:\.\w+)+", text))):
        if name not in methods.METHODS and not _resolves(name):
          missing.append(f"{page.name}: {name}")
      defined = set(re.findall(r"\bdef (\w+)\(", text))
      prose = re.sub(r"```.*?```", "", text, flags=re.S)
      for code in re.findall(r"`([^`\n]+)`", prose):
        for call in re.findall(r"([A-Za-z_][\w.]*)\(", code):
          if call.startswith(("tf.", "keras.", "tfremat.")):
            if not _resolves(call):
              missing.append(f"{page.name}: {call}()")
          elif call.split(".")[-1] not in known | defined:
            missing.append(f"{page.name}: {call}()")
  assert not missing, missing


def _example_claims(text):
  """(example, what the page says of it): in each sentence that names an
  example file, the text from its name to the next example's name (the
  whole sentence for one)."""
  text = re.sub(r"```.*?```", "", text, flags=re.S)
  text = re.sub(r"\]\([^)]*\)", "]", text)
  for paragraph in re.split(r"\n\s*\n|\n(?=- )", text):
    for sentence in re.split(r"(?<=[.:;])\s+(?=[A-Z`(\[])", paragraph):
      marks = [m for m in re.finditer(r"\b(\w+)\.py\b", sentence)
               if (ROOT / "examples" / f"{m.group(1)}.py").exists()]
      for i, mark in enumerate(marks):
        start = 0 if i == 0 else mark.start()
        end = marks[i + 1].start() if i + 1 < len(marks) else len(sentence)
        yield mark.group(1), sentence[start:end]


def test_what_the_docs_say_an_example_does_is_in_its_source():
  # A name in backticks said of an example (`remat_in_place_for_budget`,
  # `fit`, `tfremat.remat_model(...)`) is in its source, and what it is said
  # to print (every word of four letters or more after "prints") is in its
  # source or docstring.
  wrong = []
  for page in PAGES:
    for name, claim in _example_claims(page.read_text()):
      source = (ROOT / "examples" / f"{name}.py").read_text()
      for ident in set(re.findall(
          r"`(?:tfremat\.)?([A-Za-z_]\w*)(?:\([^`]*\))?`", claim)):
        if not re.search(rf"\b{ident}\b", source):
          wrong.append(f"{page.name}: {name}.py has no {ident}")
      for said in re.findall(r"\bprint(?:s|ing)\b(.*)", claim, re.S):
        for word in re.findall(r"[A-Za-z]\w{3,}", said):
          if word.lower().rstrip("s") not in source.lower():
            wrong.append(f"{page.name}: {name}.py prints no {word}")
  assert not wrong, wrong


# Pages whose promises must each name their test.
_PROMISING = [ROOT / "README.md", ROOT / "docs" / "guide.md",
              ROOT / "docs" / "design.md"]
# A sentence with one of these words promises behaviour (a budget that
# holds, an error a call raises, what is always or never so).
_PROMISE = re.compile(r"\b(holds|never|always|every|raises)\b", re.I)
_TEST_CITED = re.compile(r"tests/(\w+\.py)(?:::(\w+))?")
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.\s+(?=[A-Z`(\[*\"])")


def _prose_sentences(page):
  """(line, sentence) for every sentence of `page`'s prose: not code
  blocks, tables, headings or HTML comments; a list item or a paragraph
  split into sentences."""
  text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"),
                page.read_text(), flags=re.S)
  text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
  blocks, start, lines = [], 0, text.splitlines()
  current = []
  for i, line in enumerate(lines + [""]):
    item = re.match(r"\s*(?:[-*]|\d+\.)\s", line)
    if not line.strip() or line.lstrip().startswith(("|", "#")) or item:
      if current:
        blocks.append((start, " ".join(current)))
      current = []
      if item:
        start, current = i + 1, [line.strip()]
      continue
    if not current:
      start = i + 1
    current.append(line.strip())
  for line, block in blocks:
    for sentence in _SENTENCE_END.split(block):
      yield line, sentence


def _unchecked_promises(pages):
  """Each `page:line: sentence` that promises (`_PROMISE`) and names no
  test that exists: `tests/FILE.py` or `tests/FILE.py::test_name`."""
  found = []
  for page in pages:
    for line, sentence in _prose_sentences(page):
      if not _PROMISE.search(sentence):
        continue
      cited = _TEST_CITED.findall(sentence)
      ok = bool(cited) and all(
          (ROOT / "tests" / f).exists() and (
              not name or re.search(rf"^def {name}\(",
                                    (ROOT / "tests" / f).read_text(), re.M))
          for f, name in cited)
      if not ok:
        found.append(f"{page.name}:{line}: {sentence}")
  return found


def test_every_promise_in_the_docs_names_the_test_that_checks_it():
  # A sentence that says what always holds, never happens, or raises
  # names a test in tests/ that checks it; one that cannot is rewritten
  # to promise less.
  unchecked = _unchecked_promises(_PROMISING)
  assert not unchecked, "\n".join(unchecked)
