"""Lingvo-style hierarchical hyperparameters: `Params`, `InstantiableParams`.

  from tfremat.lingvo.hyperparams import Params

  p = Params()
  p.Define("dims", 512, "Model width.")

The implementation lives in `tfremat._src.core.hyperparams`, beside the core that
configures `RematerializationLayer` with it; this module is its public name.
"""

from tfremat._src.core.hyperparams import InstantiableParams
from tfremat._src.core.hyperparams import IsInstantiable
from tfremat._src.core.hyperparams import Params

__all__ = [
    "InstantiableParams",
    "IsInstantiable",
    "Params",
]
