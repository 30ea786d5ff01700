"""tfremat: activation rematerialization for TensorFlow 2 and Keras 3."""

import os
import sys

# A step's memory is read from the allocator's records of each allocation,
# which TensorFlow's profiler receives on the CPU from its BFC allocator only
# (the default one, with oneDNN, reports tensors above 256 KiB; without
# oneDNN, none): docs/design.md, "What importing tfremat does". It takes
# effect if TensorFlow has not run an op yet; `measure.peak_bytes` says what
# to do otherwise.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

# pylint: disable=g-import-not-at-top,wrong-import-position

from tfremat import chain
from tfremat import errors
from tfremat import lingvo
from tfremat import measure
from tfremat import models
from tfremat import planner
from tfremat import policies
from tfremat._src.api.in_place_budget import remat_in_place_for_budget
from tfremat._src.api.largest_batch import LargestBatch
from tfremat._src.api.largest_batch import largest_batch
from tfremat._src.api.remat_model import remat_model
from tfremat._src.keras_api.in_place import is_remat_in_place
from tfremat._src.keras_api.in_place import remat_in_place
from tfremat._src.keras_api.in_place import undo_remat_in_place
from tfremat._src.keras_api.layers import RematerializationLayer
from tfremat._src.core.remat import RematerializeFn
from tfremat._src.core.remat import debug_reruns
from tfremat._src.core.remat import rematerialize
from tfremat._src.keras_api.remat_model import chain_units
from tfremat._src.core.residuals import saved_residuals
from tfremat._src.keras_api.scope import RematScope
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
from tfremat._src.core import hyperparams
from tfremat._src import moved as _moved
from tfremat.lingvo import builder

_moved.install(sys.modules[__name__])


def __getattr__(name):
  return _moved.attribute(name)


__version__ = "0.2.0.dev0"

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
    "models",
    "planner",
    "policies",
]
