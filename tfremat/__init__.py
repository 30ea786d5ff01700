"""tfremat: activation rematerialization for TensorFlow 2 and Keras 3."""

import contextlib
import os
import sys

# A step's memory is read from the allocator's records of each allocation,
# which TensorFlow's profiler receives on the CPU from its BFC allocator only
# (the default one, with oneDNN, reports tensors above 256 KiB; without
# oneDNN, none): docs/design.md, "What importing tfremat does". It takes
# effect if TensorFlow has not run an op yet; `measure.peak_bytes` says what
# to do otherwise.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

def _own_program():
  """Whether Python is running tfremat's benchmark or one of its examples,
  without --verbosity.

  Those print their results only. TensorFlow prints its start-up lines (CUDA
  stubs, CPU features, a failed cuInit on a CPU-only machine) when it is
  imported, which for `python -m tfremat.bench` is here, before the
  benchmark's own code runs.
  """
  argv = list(getattr(sys, "orig_argv", sys.argv))
  if any(a == "-v" or a.startswith("--verbosity") for a in argv):
    return False
  if "-m" in argv and argv[argv.index("-m") + 1:][:1] == ["tfremat.bench"]:
    return True
  examples = os.path.join(os.path.dirname(os.path.dirname(
      os.path.abspath(__file__))), "examples")
  main = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else ""
  return os.path.dirname(main) == examples


@contextlib.contextmanager
def _stderr_silenced():
  """Sends file descriptor 2 to /dev/null: TensorFlow's C++ start-up lines
  are written there before its log level applies."""
  sys.stderr.flush()
  saved = os.dup(2)
  with open(os.devnull, "w", encoding="utf-8") as null:
    os.dup2(null.fileno(), 2)
  try:
    yield
  finally:
    os.dup2(saved, 2)
    os.close(saved)


if "TF_CPP_MIN_LOG_LEVEL" not in os.environ and _own_program():
  os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
  with _stderr_silenced():
    import tensorflow  # pylint: disable=unused-import

# pylint: disable=g-import-not-at-top,wrong-import-position

from tfremat import chain
from tfremat import errors
from tfremat import lingvo
from tfremat import measure
from tfremat import planner
from tfremat import policies
from tfremat._src.batch_fit import LargestBatch
from tfremat._src.batch_fit import largest_batch
from tfremat._src.in_place import is_remat_in_place
from tfremat._src.in_place import remat_in_place
from tfremat._src.in_place import remat_in_place_for_budget
from tfremat._src.in_place import undo_remat_in_place
from tfremat._src.layers import RematerializationLayer
from tfremat._src.remat import RematerializeFn
from tfremat._src.remat import debug_reruns
from tfremat._src.remat import rematerialize
from tfremat._src.remat_model import chain_units
from tfremat._src.remat_model import remat_model
from tfremat._src.residuals import saved_residuals
from tfremat._src.scope import RematScope
from tfremat.chain import RematSequential
from tfremat.chain import remat_sequential
from tfremat.errors import RerunMismatchError
from tfremat.errors import UnreplayableOpError
from tfremat.lingvo import DeterministicDropout
from tfremat.lingvo import GenerateStepSeedPair
from tfremat.lingvo import GetGlobalStep
from tfremat.lingvo import GetIncStepSeed
from tfremat.lingvo import GetStepSeed
from tfremat.lingvo import ResetStepSeed
from tfremat.lingvo import SetGlobalStep
from tfremat.policies import checkpoint_name


# The public module names `tfremat.builder` and `tfremat.hyperparams`; the
# module paths of earlier versions (`tfremat.remat`, `tfremat.step_seed`, ...)
# work through `__getattr__` below and an import finder, with a
# DeprecationWarning (tfremat/_src/moved.py).
from tfremat._src import hyperparams
from tfremat._src import moved as _moved
from tfremat.lingvo import builder

_moved.install(sys.modules[__name__])


def __getattr__(name):
  return _moved.attribute(name)


__version__ = "0.1.0"

__all__ = [
    # Rematerializing a function, a layer, a chain, a model.
    "RematerializeFn",
    "rematerialize",
    "RematerializationLayer",
    "RematSequential",
    "remat_sequential",
    "remat_model",
    "chain_units",
    "remat_in_place",
    "remat_in_place_for_budget",
    "undo_remat_in_place",
    "is_remat_in_place",
    "RematScope",
    # The largest batch for a memory.
    "largest_batch",
    "LargestBatch",
    # What is kept, and errors.
    "checkpoint_name",
    "saved_residuals",
    "RerunMismatchError",
    "UnreplayableOpError",
    "debug_reruns",
    # Lingvo's step seeds (also in tfremat.lingvo).
    "DeterministicDropout",
    "GenerateStepSeedPair",
    "GetGlobalStep",
    "GetIncStepSeed",
    "GetStepSeed",
    "ResetStepSeed",
    "SetGlobalStep",
    # Modules.
    "builder",
    "chain",
    "errors",
    "hyperparams",
    "lingvo",
    "measure",
    "planner",
    "policies",
]
