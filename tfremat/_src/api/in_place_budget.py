"""`remat_in_place_for_budget`: as few of a compiled model's layers
rematerialized in place as keep its training step within a budget, chosen
by the planner's one budget search on the model's own `train_on_batch`."""

import dataclasses

from tfremat import errors
from tfremat._src import units
from tfremat._src.core import policies
from tfremat._src.keras_api.layers import keras_layers
from tfremat._src.keras_api.segments import Segment
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning import choose
from tfremat._src.planning import search
from tfremat._src.planning.plan import Measured
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.runner import InPlaceRunner

__all__ = [
    "InPlaceBudget",
    "remat_in_place_for_budget",
]


@dataclasses.dataclass(frozen=True)
class InPlaceBudget:
  """What `remat_in_place_for_budget` chose and measured, as a value.

  Attributes:
    layers: the layers it left rematerialized (the first `len(layers)` of
      those it was given), a tuple.
    measured: the training step's `tfremat.planner.Measured` peaks so,
      over the check's calls.
    measured_keep: the step's predicted peak with none rematerialized (a
      `Measured` over no calls, its bound with the margin).
    budget_bytes: the budget in bytes: what training holds (`held`) and the
      step's tensors.
    nested: whether their own layers are rematerialized too
      (`remat_in_place(layers, nested=True)`).
    search: what was predicted to choose it (`tfremat.planner.Search`).
    held: what training holds besides the step (`tfremat.planner.Held`).
  """
  layers: tuple
  measured: object
  measured_keep: object
  budget_bytes: int
  nested: bool = False
  search: object = dataclasses.field(default=None, compare=False, repr=False)
  held: object = None

  def __post_init__(self):
    object.__setattr__(self, "layers", tuple(self.layers))

  @property
  def step_budget_bytes(self):
    """What the budget leaves the step's own tensors."""
    return self.budget_bytes - (self.held.total_bytes if self.held else 0)

  def __str__(self):
    mib, keep = units.format_bytes, self.measured_keep.peak_bytes
    nested = ", nested," if self.nested else ""
    held = f"; training holds {self.held} besides" if self.held else ""
    return (f"{len(self.layers)} layer(s){nested} rematerialized in place: "
            f"training step peak {mib(self.measured.peak_bytes)} measured "
            f"({self.measured.peak_bytes / keep:.2f}x of {mib(keep)} "
            f"predicted without) within {mib(self.step_budget_bytes)} of "
            f"the budget of {mib(self.budget_bytes)}{held}")


def remat_in_place_for_budget(model, layers, budget, x, y=None, policy=None,
                              nested=True, settings=search.DEFAULT_SETTINGS):
  """`remat_in_place` on as few of `layers` as keep training within
  `budget`, measured on `model.train_on_batch(x, y)`.

  For a compiled model whose class must stay (a KerasHub task): it
  predicts the step (`tfremat.measure.predict_peak`) with none of `layers`
  rematerialized, with all, and then searches (by halving) for the fewest,
  taken from the front of `layers` (for a chain of repeated blocks, which
  ones matters little), predicted to fit with the margin
  (`tfremat.planner.Settings.reserve` on TensorFlow's executor, none under
  XLA). If even all of them do not fit, it predicts them nested
  (`remat_in_place(layers, nested=True)`: slower, lower), unless `nested`
  is False. The choice's step then runs `settings.check_calls` times as a
  check. Every variable of the model and of its optimizer is put back
  after the check, and the model's train function is traced anew.

  Args:
    model: a compiled Keras model that `layers` belong to.
    layers: Keras 3 layers of `model`, e.g. a KerasHub backbone's
      `transformer_layers`.
    budget: bytes or a string with a unit ("200MiB"), which count the
      model's weights, its optimizer's state and the batch besides the
      step's tensors; or a fraction of the step's predicted peak with none
      rematerialized (0.6, "60%").
    x, y: a batch, as `model.train_on_batch` takes it (a KerasHub task
      takes strings and no `y`).
    policy: the save policy of every rematerialized layer.
    nested: whether it may rematerialize the layers' own layers too, when
      the layers alone do not fit.
    settings: the planner's `tfremat.planner.Settings`.

  Returns:
    An `InPlaceBudget`; its `layers` are left rematerialized.

  Raises:
    ValueError: the budget cannot be met even with every layer
      rematerialized (a `tfremat.errors.BudgetUnreachableError`: the
      message and its `lowest_fraction` give the lowest fraction predicted),
      or the model is not compiled.
  """
  layers = keras_layers(layers, "remat_in_place_for_budget")
  budget = Budget.parse(budget)
  if not isinstance(nested, bool):
    raise errors.InvalidTypeError(
        f"remat_in_place_for_budget: nested is True or False; got "
        f"{nested!r}.")
  if policy is not None:
    policy = policies.get(policy)
  if getattr(model, "optimizer", None) is None:
    raise errors.InvalidArgumentError(
        "remat_in_place_for_budget measures model.train_on_batch: compile "
        "the model first (model.compile(optimizer=..., loss=...)).")
  n = len(layers)
  runner = InPlaceRunner(model, layers)
  tried = "rematerialized, and nested," if nested else "rematerialized,"
  with budget_lib.retracing_quiet():
    try:
      batch = budget_lib.sample_batch(x, y)
      found = choose.choose_among(
          budget, runner, batch,
          lambda trials, room: _fewest_that_fit(n, policy, nested, trials),
          # Unnested, then fewest.
          rank=lambda c: (c.segments[0].nested, _count(c)),
          settings=settings,
          refusal=dict(
              subject=(f"remat_in_place_for_budget: with all {n} layer(s) "
                       f"{tried} nothing fits"),
              fix=("give more of the model's layers, a save policy that "
                   "keeps less, or a smaller batch")))
      chosen = found.chosen.candidate
      # The check's largest peak, as a planned chain's (`budget.checked`).
      measured = Measured.largest(
          runner.peaks(chosen, batch, settings.check_calls))
    finally:
      runner.apply(_first(n, 0, policy, False))
  runner.apply(chosen)
  count = _count(chosen)
  return InPlaceBudget(layers[:count], measured, found.keep.measured,
                       found.budget_bytes,
                       nested=chosen.segments[0].nested and count > 0,
                       search=found, held=found.held)


def _first(n, count, policy, nested):
  """The candidate that rematerializes the first `count` of `n` layers."""
  return search.Candidate(tuple(
      Segment(i, i + 1, True, policy, nested) if i < count else
      Segment(i, i + 1, False) for i in range(n)))


def _count(candidate):
  return sum(1 for s in candidate.segments if s.remat)


def _fewest_that_fit(n, policy, nested, trials):
  """`remat_in_place_for_budget`'s next candidate (`search_budget`'s
  `propose`) after `trials`: none first (keeping everything); then all n;
  if they fit, the fewest that fit, by halving; if not and `nested`, all
  n nested."""
  if not trials:
    return _first(n, 0, policy, False), "keep", "keeping everything"
  if len(trials) == 1:
    return _first(n, n, policy, False), "all", f"all {n} layers rematerialized"
  every = trials[1]
  if not every.fits:
    if nested and len(trials) == 2:
      # Every layer alone is over: each layer's rerun holds all of its own
      # layers' working sets at once; nested, one at a time.
      return (_first(n, n, policy, True), "all",
              f"all {n} layers rematerialized, nested")
    return None
  fit = [_count(t.candidate) for t in trials[1:] if t.fits]
  over = [_count(t.candidate) for t in trials if not t.fits] + [0]
  low, high = max(over), min(fit)  # low does not fit; high does.
  if high - low <= 1:
    return None
  middle = (low + high) // 2
  return (_first(n, middle, policy, False), "fewest",
          f"the first {middle} rematerialized")
