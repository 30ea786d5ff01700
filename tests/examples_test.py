"""The examples train: loss goes down, and rematerialization saves memory."""

import importlib.util
import pathlib

import numpy as np

EXAMPLES = pathlib.Path(__file__).resolve().parent.parent / "examples"


def _load(name):
  spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_quickstart_trains_and_remat_matches_and_saves_memory():
  quickstart = _load("quickstart")
  sizes = dict(steps=40, blocks=4, width=64, batch=512)
  plain_losses, plain_peak = quickstart.train(False, **sizes)
  remat_losses, remat_peak = quickstart.train(True, **sizes)
  assert remat_losses[-1] < 0.7 * remat_losses[0]
  # Same weights, data and dropout seeds: the same training trajectory.
  np.testing.assert_allclose(remat_losses, plain_losses, rtol=1e-4)
  assert remat_peak < 0.6 * plain_peak


def test_keras_transformer_learns_and_wrapping_saves_memory():
  example = _load("keras_transformer")
  sizes = dict(batch=16, seq_len=32, blocks=2, width=32, vocab=32)
  losses = example.train(steps=100, **sizes)
  assert losses[-1] < 0.5 * losses[0], losses
  plain = example.peak_train_bytes(False, **sizes)
  wrapped = example.peak_train_bytes(True, **sizes)
  assert wrapped < 0.8 * plain, (wrapped, plain)
