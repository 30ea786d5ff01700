"""What the planner proposes besides the cost model's fastest plan within
a room (`cost_model.fastest`): a plan to predict (`Candidate`), and the
plan the cost model predicts to peak lowest (`lowest_plan`), predicted
before a budget is refused."""

import dataclasses

from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning import cost_model
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.plan import Plan

__all__ = [
    "Candidate",
    "lowest_plan",
]


@dataclasses.dataclass(frozen=True)
class Candidate:
  """A plan to predict: its segments, run unordered or in one op order."""
  segments: tuple
  ordered: bool = False

  def __post_init__(self):
    object.__setattr__(self, "segments", tuple(self.segments))


def lowest_plan(costs):
  """The plan the model predicts to peak lowest: every layer rematerialized
  alone if that is among them, else the one among them that retains the
  least elsewhere.

  Several plans often share the model's lowest peak, set by one layer's
  working set, but measured steps do not: layers kept where the model sees
  room raise the peak, and so do long rematerialized segments, which rerun
  more at once. So this plan is measured before a refusal.
  """
  table = cost_model.segment_table(costs)
  need = cost_model.smallest_budget(costs, table)
  alone = uniform_segments(len(costs), len(costs))
  if predict(costs, alone)[0] <= need:
    return Plan(costs, alone, need)
  return Plan(costs, cost_model.least_retained(costs, need, table), need)
