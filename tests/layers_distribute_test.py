"""RematerializationLayer under tf.distribute equals one device without remat.

The scenarios run in tests/distribute_worker.py, in subprocesses: the CPU is
split into two logical devices for MirroredStrategy, and MultiWorkerMirrored
runs two worker processes talking over 127.0.0.1.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import assert_trees_close

TESTS = pathlib.Path(__file__).resolve().parent
WORKER = TESTS / "distribute_worker.py"


def _env(**extra):
  path = os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")])
  return dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="2", **extra)


def _weights(path, key):
  with np.load(path) as data:
    count = len([f for f in data.files if f.startswith(key + "/")])
    return [data[f"{key}/{i}"] for i in range(count)]


def _assert_trained_like_reference(path, key, initial="initial", blocks=2):
  trained, reference = _weights(path, key), _weights(path, key + "_reference")
  initial = _weights(path, initial)
  # Each block: two Dense layers and a LayerNormalization; then the head.
  assert len(trained) == len(reference) == len(initial) == 6 * blocks + 2
  assert_trees_close(trained, reference)
  # Training moved the weights, so the comparison above means something.
  assert max(np.abs(a - b).max() for a, b in zip(trained, initial)) > 1e-3


@pytest.mark.slow
def test_mirrored_strategy_custom_step_and_fit(tmp_path):
  out = tmp_path / "mirrored.npz"
  done = subprocess.run([sys.executable, str(WORKER), "mirrored", str(out)],
                        env=_env(), timeout=600, stderr=subprocess.PIPE,
                        text=True, check=False)
  # The end of the worker's own error, not the head of TensorFlow's logs.
  assert done.returncode == 0, done.stderr[-3000:]
  _assert_trained_like_reference(out, "custom")
  _assert_trained_like_reference(out, "fit")
  # Issue "Rematerialize a whole Keras model in one call": remat_model's
  # result trains under MirroredStrategy, in both kinds of wrapper.
  _assert_trained_like_reference(out, "remat_model_full")
  _assert_trained_like_reference(out, "remat_model_activations")
  # A budget's plan, measured in the strategy's scope, rematerializes a part
  # and trains the same.
  assert _weights(out, "remat_model_budget_plan")[0].any()
  _assert_trained_like_reference(out, "remat_model_budget", "initial_wide",
                                 blocks=4)  # distribute_worker.WIDE_BLOCKS
  # Planned on its train_on_batch with one replica's batch: trains the same,
  # and one replica's later steps (the total over the two logical devices,
  # which share the CPU's memory, halved) peak within its budget.
  _assert_trained_like_reference(out, "remat_model_fit_budget",
                                 "initial_wide", blocks=4)
  peak, budget, keep = _weights(out, "fit_budget_peaks")[0]
  assert peak <= budget < keep, (peak, budget, keep)


def _free_ports(count):
  sockets = [socket.socket() for _ in range(count)]
  for s in sockets:
    s.bind(("127.0.0.1", 0))
  ports = [s.getsockname()[1] for s in sockets]
  for s in sockets:
    s.close()
  return ports


def test_multi_worker_mirrored_strategy_two_processes(tmp_path):
  # A custom training step only: on Keras 3.15 / TF 2.21, model.fit under
  # MultiWorkerMirroredStrategy fails inside Keras's trainer
  # (_maybe_symbolic_build's strategy.reduce) with or without tfremat.
  workers = [f"127.0.0.1:{port}" for port in _free_ports(2)]
  out = tmp_path / "multi_worker.npz"
  procs = []
  for index in range(2):
    tf_config = json.dumps({"cluster": {"worker": workers},
                            "task": {"type": "worker", "index": index}})
    procs.append(subprocess.Popen(
        [sys.executable, str(WORKER), "multi_worker", str(out)],
        env=_env(TF_CONFIG=tf_config), stderr=subprocess.PIPE, text=True))
  try:
    for proc in procs:
      _, stderr = proc.communicate(timeout=600)
      assert proc.returncode == 0, stderr[-3000:]
  finally:
    for proc in procs:
      proc.kill()
  _assert_trained_like_reference(out, "custom")
