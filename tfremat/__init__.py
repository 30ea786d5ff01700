"""tfremat: activation rematerialization for TensorFlow 2 and Keras 3."""

import os

# The planner and the benchmark measure a step's peak with the allocator's
# statistics, which TensorFlow keeps on the CPU only with its BFC allocator.
# It takes effect if TensorFlow has not run an op yet;
# `measure.peak_bytes` says what to do otherwise.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

# pylint: disable=g-import-not-at-top,wrong-import-position

from tfremat import builder
from tfremat import hyperparams
from tfremat import measure
from tfremat import planner
from tfremat.layers import RematerializationLayer
from tfremat.layers import RematSequential
from tfremat.layers import remat_sequential
from tfremat.remat import RematerializeFn
from tfremat.remat import RerunMismatchError
from tfremat.remat import rematerialize
from tfremat.state import UnreplayableOpError
from tfremat.step_seed import DeterministicDropout
from tfremat.step_seed import GenerateStepSeedPair
from tfremat.step_seed import GetGlobalStep
from tfremat.step_seed import GetIncStepSeed
from tfremat.step_seed import GetStepSeed
from tfremat.step_seed import ResetStepSeed
from tfremat.step_seed import SetGlobalStep

__version__ = "0.1.0"
