"""The package as installed: its metadata, its files, the tested range."""

import importlib.metadata
import json
import pathlib
import re
import sys

import keras
import pytest
import tensorflow as tf

import tfremat

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _distribution():
  try:
    return importlib.metadata.distribution("tfremat")
  except importlib.metadata.PackageNotFoundError:
    pytest.skip("tfremat is not installed (pip install .)")


def _source_tree(dist):
  """Whether `dist` imports from this repository: an editable install, or
  the source tree's own metadata found through sys.path."""
  direct = dist.read_text("direct_url.json")
  editable = bool(direct and json.loads(direct).get("dir_info", {}).get(
      "editable"))
  here = pathlib.Path(str(dist.locate_file(""))).resolve()
  return editable or here == ROOT or ROOT in here.parents


def test_version_has_one_source():
  dist = _distribution()
  assert dist.version == tfremat.__version__
  assert "version" not in (ROOT / "setup.py").read_text()
  assert 'dynamic = ["version"]' in (ROOT / "pyproject.toml").read_text()


def test_tests_import_the_installed_package_when_it_is_not_editable():
  # `python -m pytest` from the repository root would import the source tree
  # and hide a module missing from the wheel; the README runs `pytest`.
  dist = _distribution()
  if _source_tree(dist):
    pytest.skip("an editable install or the source tree's metadata: the "
                "source tree is imported by design")
  installed = pathlib.Path(str(dist.locate_file("tfremat/__init__.py")))
  assert pathlib.Path(tfremat.__file__).resolve() == installed.resolve()
  shipped = {pathlib.PurePath(f).as_posix() for f in dist.files
             if str(f).startswith("tfremat/") and str(f).endswith(".py")}
  source = {p.relative_to(ROOT).as_posix()
            for p in (ROOT / "tfremat").rglob("*.py")}
  assert source <= shipped, sorted(source - shipped)


def _requirement(dist, name):
  for req in dist.requires or []:
    match = re.fullmatch(rf"{name}([^;]*)", req.strip())
    if match:
      return match.group(1)
  raise AssertionError(f"{name} is not declared: {dist.requires}")


def _version(text):
  return tuple(int(p) for p in re.findall(r"\d+", text)[:2])


def test_running_versions_are_in_the_declared_range():
  dist = _distribution()
  running = {"tensorflow": tf.__version__, "keras": keras.__version__}
  for name, version in running.items():
    spec = _requirement(dist, name)
    low = re.search(r">=\s*([\d.]+)", spec).group(1)
    high = re.search(r"<\s*([\d.]+)", spec).group(1)
    assert _version(low) <= _version(version) < _version(high), (name, spec)
  python = re.search(r">=\s*([\d.]+)", dist.metadata["Requires-Python"])
  assert sys.version_info[:2] >= _version(python.group(1))
  assert _requirement(dist, "numpy") and _requirement(dist, "absl-py")


def test_license_is_shipped():
  dist = _distribution()
  assert dist.metadata["License-Expression"] == "Apache-2.0" or (
      dist.metadata["License"] == "Apache-2.0")
  assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")
