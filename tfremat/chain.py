"""Chains of layers with chosen rematerialization, and measuring them.

  chain = tfremat.remat_sequential(blocks, segments="sqrt")
  chain = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)
  print(chain.plan)

`RematSequential` runs a chain of Keras layers, rematerializing the chosen
segments. `remat_sequential` chooses them: uniformly, or for a memory budget
by reading the chain's costs from its traced programs (`measure_chain`) and
asking the planner (`tfremat.planner`), whose choice `checked_plan` holds
to the budget by its predicted training step and checks by running it.
"""

from tfremat._src.api.sequential import checked_plan
from tfremat._src.api.sequential import remat_sequential
from tfremat._src.keras_api.chain_layers import ContextUnit
from tfremat._src.keras_api.chain_layers import RematSequential
from tfremat._src.planning.apply import apply_plan
from tfremat._src.planning.budget import retracing_quiet
from tfremat._src.planning.profile import measure_chain
from tfremat._src.planning.profile import measure_layer
from tfremat._src.planning.profile import measure_peak
from tfremat._src.planning.profile import measure_peaks
from tfremat._src.planning.profile import training_step

__all__ = [
    "RematSequential",
    "remat_sequential",
    "apply_plan",
    "checked_plan",
    "measure_chain",
    "measure_layer",
    "measure_peak",
    "measure_peaks",
    "training_step",
    "retracing_quiet",
    "ContextUnit",
]
