"""The Lingvo-compatible API in one place.

  from tfremat import lingvo

  p = lingvo.Base.Params()              # a builder's hyperparameters
  seed = lingvo.GetStepSeed()

For code written against Lingvo: `Params` and `InstantiableParams`
(`tfremat.lingvo.hyperparams`), the layer builder `Base` with `_Rematerialize`
(`tfremat.lingvo.builder`), its layers (`tfremat.lingvo.builder_layers`, as
`layers`), the step seeds (`tfremat.lingvo.step_seed`) and `RematerializeFn`.
`tfremat.hyperparams` and `tfremat.builder` name the same modules; the older
paths `tfremat.builder_layers` and `tfremat.step_seed` still work, with a
DeprecationWarning.
"""

from tfremat._src.core.remat import RematerializeFn
from tfremat.lingvo import builder_layers as layers
from tfremat.lingvo.builder import Base
from tfremat.lingvo.hyperparams import InstantiableParams
from tfremat.lingvo.hyperparams import IsInstantiable
from tfremat.lingvo.hyperparams import Params
from tfremat.lingvo.step_seed import DeterministicDropout
from tfremat.lingvo.step_seed import GenerateStepSeedPair
from tfremat.lingvo.step_seed import GetGlobalStep
from tfremat.lingvo.step_seed import GetIncStepSeed
from tfremat.lingvo.step_seed import GetStepSeed
from tfremat.lingvo.step_seed import HasGlobalStep
from tfremat.lingvo.step_seed import ResetStepSeed
from tfremat.lingvo.step_seed import SetGlobalStep

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
