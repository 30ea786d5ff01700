"""`remat_model` on models nobody on this project wrote (`--whole_models`):
the original, each mode, and a budget, measured in one process."""

import time
import warnings

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat import models

__all__ = [
    "WHOLE_MODES",
    "measure_whole_model",
]

WHOLE_MODES = ("full", "activations", "larger_than")



def measure_whole_model(name, budget=0.5, rounds=5, modes=WHOLE_MODES):
  """Rows for the model `name` (`models.whole_model`): the original, each
  of `remat_model`'s modes and a plan for `budget`, measured in this
  process: peak, step time, first call; planning time for the budget."""
  model, batch = models.whole_model(name)
  made, notes = {"original": model}, {}
  # Recorded, not shown: a mode that selects nothing is noted in the table,
  # and the rest (a layer whose configuration will not save) do not bear on
  # what is measured.
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    for mode in modes:
      before = len(caught)
      made[f'"{mode}"'] = tfremat.remat_model(
          model, mode=mode,
          sample_input=batch if mode == "larger_than" else None)
      if any("selects no layer" in str(w.message) for w in caught[before:]):
        notes[f'"{mode}"'] = "selects nothing"
    label = f"budget {budget:.0%}"
    start = time.perf_counter()
    try:
      planned = tfremat.remat_model(model, budget=budget, sample_input=batch,
                                    verbose=0)
    except tfremat.errors.BudgetUnreachableError as e:
      notes[label] = (f"refused in {time.perf_counter() - start:.1f} s: "
                      f"lowest bound {e.lowest_fraction:.0%}")
    else:
      made[label] = planned
      plan = planned.get_layer(f"{model.name}_chain").plan
      bound = plan.measured.bound_bytes / plan.predicted_keep
      notes[label] = (f"planned in {time.perf_counter() - start:.1f} s: "
                      f"bound {bound:.0%}")
  measure.wait_for(chain.training_step(model)(batch))  # One-time costs.
  rows, steps = [], []
  for variant, m in made.items():
    step = chain.training_step(m)
    start = time.perf_counter()
    measure.wait_for(step(batch))
    rows.append({"model": name, "variant": variant,
                 "first_call_seconds": time.perf_counter() - start,
                 "peak_bytes": measure.peak_bytes(step, batch, warmup=False),
                 "note": notes.get(variant, "")})
    steps.append(step)
  for row, seconds in zip(rows, measure.median_seconds(steps, batch,
                                                       repeats=rounds)):
    row["step_seconds"] = seconds
  rows += [{"model": name, "variant": v, "note": n} for v, n in notes.items()
           if v not in made]
  return rows

