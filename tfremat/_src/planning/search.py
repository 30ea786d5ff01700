"""The planner's settings, as one value (`Settings`), and the record of
what it predicted to choose a plan (`Trial`, `Search`), with the refusal
of a budget that no plan can meet because of what every plan holds
(`floor_error`). The choosing is `choose.py`'s.
"""

import dataclasses
import math

from tfremat import errors
from tfremat._src import units
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.plan import Held
from tfremat._src.planning.plan import Measured
from tfremat._src.planning.proposals import Candidate

__all__ = [
    "Settings",
    "DEFAULT_SETTINGS",
    "Candidate",
    "Trial",
    "Search",
    "floor_error",
]


@dataclasses.dataclass(frozen=True)
class Settings:
  """How the planner searches, as one value; `print` shows every setting.

  The shipped defaults are `DEFAULT_SETTINGS`; give another value to
  `remat_sequential`, `remat_model`, `remat_in_place_for_budget` or
  `largest_batch` (`settings=tfremat.planner.Settings(reserve=0.1)`).

  Attributes:
    reserve: the margin a predicted peak is held to a budget with on
      TensorFlow's executor, as a fraction of it (`Plan.margin`): the
      executor's threads order independent ops differently from call to
      call, which the prediction aims near the largest of, not at (none
      under XLA, whose buffer assignment is the step's peak;
      docs/design.md, "Budgets that hold").
    check_calls: how many training steps the chosen plan runs as a check
      (`Plan.measured`).
    rounds: how many plans the cost model proposes at most, besides keeping
      everything and, before a refusal, the lowest plan and that plan
      nested.
    use_at_least: the proposals stop once the fastest plan predicted to fit
      uses this fraction of what the budget leaves the step.
    waiting_fraction: what a layer's recompute costs beyond its forward time
      when later layers of its segment rerun before its backward pass, as a
      fraction of that forward time (`LayerCost.waiting_recompute_seconds`).
    batch_probes: `largest_batch` predicts at most this many batches.
    variants: how many plans a planned chain chooses between by the input
      shape it runs at, the planned one among them (`Plan.variants`):
      each is traced where a step is traced for any shape.
  """
  reserve: float = 0.05
  check_calls: int = 3
  rounds: int = 4
  use_at_least: float = 0.8
  waiting_fraction: float = 0.2
  batch_probes: int = 6
  variants: int = 3

  def __post_init__(self):
    fractions = ("reserve", "use_at_least", "waiting_fraction")
    counts = ("check_calls", "rounds", "batch_probes", "variants")
    bad = [f"{name}={getattr(self, name)!r}" for name in fractions
           if isinstance(getattr(self, name), bool) or
           not isinstance(getattr(self, name), (int, float)) or
           not 0 <= getattr(self, name) < 1]
    bad += [f"{name}={getattr(self, name)!r}" for name in counts
            if isinstance(getattr(self, name), bool) or
            not isinstance(getattr(self, name), int) or
            getattr(self, name) < 1]
    if bad:
      raise errors.InvalidArgumentError(
          f"Settings: {', '.join(bad)}: {', '.join(fractions)} are "
          f"fractions in [0, 1), {', '.join(counts)} positive ints.")

  def __str__(self):
    return (f"margin {self.reserve:.0%} of a predicted peak on the "
            f"executor, {self.check_calls} calls to check, {self.rounds} "
            f"rounds, stop at {self.use_at_least:.0%} of the room, waiting "
            f"{self.waiting_fraction:.0%} of a rerun's forward time; "
            f"largest_batch: {self.batch_probes} predictions; "
            f"{self.variants} plans at most by input shape")


DEFAULT_SETTINGS = Settings()


@dataclasses.dataclass(frozen=True)
class Trial:
  """One candidate predicted: at which stage and why, its predicted peak
  and bound (`measured`: a `Measured` over no calls, its bound with the
  margin), whether it fits what the budget leaves the step, and the
  predicted peak (`predicted_bytes`)."""
  candidate: Candidate
  stage: str
  why: str
  measured: Measured
  fits: bool
  predicted_bytes: int = None

  @property
  def key(self):
    """The candidate (the name earlier versions gave it)."""
    return self.candidate


@dataclasses.dataclass(frozen=True)
class Search:
  """What the planner predicted, in order, and what it chose.

  Attributes:
    budget: the `Budget` asked for; budget_bytes: the same in bytes, for
      everything training holds (`held`, then the step's tensors).
    held: what training holds besides the step (`Held`).
    step: which training step was predicted ("train_on_batch" or
      "stand-in", `Runner.step`).
    settings: the `Settings` it planned with.
    trials: every `Trial`, in the order predicted; the first is keeping
      everything.
    chosen: the Trial chosen (the fastest that fits), or None when the
      budget was refused.
  """
  budget: Budget
  budget_bytes: int
  held: Held
  step: str
  settings: Settings
  trials: tuple
  chosen: Trial = None

  @property
  def keep(self):
    """Keeping everything's Trial."""
    return self.trials[0]

  @property
  def step_bytes(self):
    """What the budget leaves the step's own tensors."""
    return self.budget_bytes - self.held.total_bytes

  def __str__(self):
    mib = units.format_bytes
    rows = [f"budget {mib(self.budget_bytes)} ({self.budget}): held "
            f"{self.held}; the step's bound within {mib(self.step_bytes)}",
            f"on {self.step}; {self.settings}"]
    for i, t in enumerate(self.trials):
      mark = "chosen" if t is self.chosen else ("fits" if t.fits else "over")
      how = "predicted" if not t.measured.calls else "peak"
      rows.append(f"{i + 1:>3}. {mark:<7}{how} "
                  f"{mib(t.measured.peak_bytes):>11}  bound "
                  f"{mib(t.measured.bound_bytes):>11}  {t.why}")
    if self.chosen is None:
      rows.append("     refused: no candidate fits")
    return "\n".join(rows)


def floor_error(budget, budget_bytes, held, keep, floor_bytes, margin):
  """The ValueError for a budget that no plan can meet, or None: one that
  leaves the step nothing (what training holds is over it), or less than
  the weight gradients plus their reserve.

  Every plan's training step returns (or applies) the same weight
  gradients, so each plan's measured peak is at least their bytes, and its
  bound at least that plus its reserve. A budget below that is out of reach
  whatever is rematerialized, which is known as soon as keeping everything
  has been measured. Keeping everything is still chosen where its own bound
  fits or the budget is 100% of it.
  """
  step_bytes = budget_bytes - held.total_bytes
  reserve = int(margin * floor_bytes)
  lowest = floor_bytes + reserve
  if ((step_bytes > 0 and lowest <= step_bytes) or
      keep.bound_bytes <= step_bytes or budget.fraction == 1.0):
    return None
  mib = units.format_bytes
  asked = (f"{budget.fraction:.0%} of the keep-everything peak, "
           if budget.fraction is not None else "")
  if step_bytes <= 0:
    return errors.BudgetUnreachableError.of(
        f"No rematerialization plan fits a budget of {mib(budget_bytes)}: "
        f"training holds {held} before a step allocates anything. "
        "Rematerializing frees a step's activations, not these: give at "
        f"least {mib(held.total_bytes + lowest)}, or a smaller batch, model "
        "or optimizer.", held.total_bytes + lowest, keep.peak_bytes)
  least = math.ceil(100 * lowest / max(1, keep.peak_bytes))
  need = f"{least}%" if asked else mib(held.total_bytes + lowest)
  return errors.BudgetUnreachableError.of(
      f"No rematerialization plan fits a budget of {asked}{mib(budget_bytes)}:"
      f" the lowest bound any plan can have is {mib(lowest)}, {least}% of "
      f"the keep-everything peak ({mib(keep.peak_bytes)}), and "
      f"training holds {held} besides the step. Every plan's training step "
      f"ends holding the weight gradients, {mib(floor_bytes)}, and every "
      f"plan's bound adds its reserve, at least {mib(reserve)} "
      f"({margin:.0%} of its peak). Rematerializing frees "
      f"activations, not weight gradients: raise the budget to at least "
      f"{need}.", lowest, keep.peak_bytes)
