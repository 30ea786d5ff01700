"""Lingvo-style step seeds: deterministic seeds for stateless random ops.

  from tfremat.lingvo import step_seed

  seed = step_seed.GenerateStepSeedPair()

The implementation lives in `tfremat._src.core.step_seed`, beside the core that
replays step seeds in the rerun; this module is its public name.
"""

from tfremat._src.core.step_seed import DeterministicDropout
from tfremat._src.core.step_seed import GenerateStepSeedPair
from tfremat._src.core.step_seed import GetGlobalStep
from tfremat._src.core.step_seed import GetIncStepSeed
from tfremat._src.core.step_seed import GetStepSeed
from tfremat._src.core.step_seed import HasGlobalStep
from tfremat._src.core.step_seed import ResetStepSeed
from tfremat._src.core.step_seed import SeedPair
from tfremat._src.core.step_seed import SetGlobalStep

__all__ = [
    "DeterministicDropout",
    "GenerateStepSeedPair",
    "GetGlobalStep",
    "GetIncStepSeed",
    "GetStepSeed",
    "HasGlobalStep",
    "ResetStepSeed",
    "SeedPair",
    "SetGlobalStep",
]
