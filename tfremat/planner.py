"""Choose what to rematerialize in a chain of layers for a memory budget.

  layer = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)
  print(layer.plan)           # per-layer decisions, predicted and measured peaks
  print(layer.plan.search)    # what was predicted to choose it, and why

  costs = tfremat.chain.measure_chain(blocks, sample_input)
  plan = tfremat.planner.plan(costs, budget_bytes=200 * 2**20)  # model only

A budget in bytes bounds what training holds besides the step (`Held`:
the weights, the optimizer's state, the batch) plus the step's peak, what
`tfremat.measure.peak_bytes` measures: the largest total size of the
tensors a training step (forward, loss, backward) has allocated and not
yet freed. A fraction is of that peak keeping everything. A plan also
carries what it runs at other input shapes (`Plan.variants`,
`Plan.segments_at`).

A plan splits the chain into consecutive segments, each either kept (its
layers' activations are stored for the backward pass) or rematerialized (only
the segment's output is stored; the segment reruns in the backward pass). A
cost model predicts a plan's peak and step time from per-layer costs read
from the layers' traced programs, and `plan` finds the fastest plan whose
predicted peak fits, exactly, by dynamic programming. A budget's planner
holds the plans the model proposes to the budget by their whole training
steps' predicted peaks (`tfremat.measure.predict_peak`, plus
`Plan.margin`) and takes the fastest that fits; its `Settings` are one
value, and its `Search` record says what it predicted and why
(docs/design.md, "How the planner chooses").
"""

from tfremat._src import moved
from tfremat._src.keras_api.segments import Segment
from tfremat._src.keras_api.segments import keep_all
from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import LayerCost
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.plan import Held
from tfremat._src.planning.plan import Measured
from tfremat._src.planning.plan import Plan
from tfremat._src.planning.plan import plan
from tfremat._src.planning.plan_text import LEGEND
from tfremat._src.planning.search import DEFAULT_SETTINGS
from tfremat._src.planning.search import Search
from tfremat._src.planning.search import Settings
from tfremat._src.planning.search import Trial

__all__ = [
    "Plan",
    "plan",
    "Budget",
    "Segment",
    "LayerCost",
    "Settings",
    "DEFAULT_SETTINGS",
    "Measured",
    "Held",
    "Search",
    "Trial",
    "predict",
    "keep_all",
    "uniform_segments",
    "LEGEND",
]


# tfremat 0.1.0's planner.measure_chain and siblings, with a warning.
__getattr__ = moved.planner_attribute
