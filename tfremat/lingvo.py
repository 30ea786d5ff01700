"""The Lingvo-compatible API in one place.

  from tfremat import lingvo

  p = lingvo.Base.Params()              # a builder's hyperparameters
  seed = lingvo.GetStepSeed()

For code written against Lingvo: `Params` and `InstantiableParams`
(`tfremat.hyperparams`), the layer builder `Base` with `_Rematerialize`
(`tfremat.builder`), its layers (`tfremat.builder_layers`, as `layers`), the
step seeds (`tfremat.step_seed`) and `RematerializeFn`. The modules named
keep working as import paths; this module only gathers their names.
"""

from tfremat import builder_layers as layers
from tfremat.builder import Base
from tfremat.hyperparams import InstantiableParams
from tfremat.hyperparams import IsInstantiable
from tfremat.hyperparams import Params
from tfremat.remat import RematerializeFn
from tfremat.step_seed import DeterministicDropout
from tfremat.step_seed import GenerateStepSeedPair
from tfremat.step_seed import GetGlobalStep
from tfremat.step_seed import GetIncStepSeed
from tfremat.step_seed import GetStepSeed
from tfremat.step_seed import HasGlobalStep
from tfremat.step_seed import ResetStepSeed
from tfremat.step_seed import SetGlobalStep

__all__ = [
    "Base",
    "DeterministicDropout",
    "GenerateStepSeedPair",
    "GetGlobalStep",
    "GetIncStepSeed",
    "GetStepSeed",
    "HasGlobalStep",
    "InstantiableParams",
    "IsInstantiable",
    "Params",
    "RematerializeFn",
    "ResetStepSeed",
    "SetGlobalStep",
    "layers",
]
