"""How a `tfremat.planner.Plan` prints: a table of its layers' decisions,
then its budget, its step's predicted and measured peaks and the cost
model's figures, then a legend (`LEGEND`, also `tfremat.planner.LEGEND`)."""

from tfremat._src import units
from tfremat._src.core import policies

__all__ = [
    "layer_rows",
    "summary_rows",
    "LEGEND",
]


def layer_rows(plan):
  """The per-layer table of `plan`'s printout."""
  mib = units.format_bytes
  rows = [f"{'layer':<24}{'decision':<36}{'stored':>11}{'output':>11}"
          f"{'fwd ms':>9}{'wait ms':>9}"]
  for k, seg in enumerate(plan.segments):
    for i in range(seg.start, seg.stop):
      c = plan.costs[i]
      if not seg.remat:
        what, stored = "keep", c.saved_bytes
      else:
        what = f"remat {k}" + (", nested" if seg.nested else "")
        if seg.policy:
          keeps = c.policy_keeps.get(seg.policy)
          what += (f", keeps {keeps}" if keeps else
                   f", {policies.short_name(seg.policy)}")
        stored = c.kept_bytes(seg.policy)
      rows.append(f"{c.name[:23]:<24}{what:<36}{mib(stored):>11}"
                  f"{mib(c.output_bytes):>11}"
                  f"{1000 * c.forward_seconds:>9.2f}"
                  f"{1000 * c.waiting_recompute_seconds:>9.2f}")
  return rows

def summary_rows(plan):
  """The budget, predicted and measured lines of `plan`'s printout."""
  # Predicted figures are compared with predicted ones, the cost model's
  # with the cost model's, and every line says which it is.
  mib, rows = units.format_bytes, []
  keep = plan.predicted_keep
  if plan.budget_bytes is not None:
    given = ""
    if plan.budget is not None and plan.budget.fraction is not None:
      given = ((f"held + " if plan.held is not None else "") +
               f"{plan.budget.fraction:.0%} of the predicted peak of keeping "
               "everything" + (f" ({mib(keep)})" if keep else ""))
    rows.append(("budget", mib(plan.budget_bytes), given))
    if plan.held is not None:
      rows.append(("held", mib(plan.held.total_bytes),
                   f"weights {mib(plan.held.weights_bytes)}, optimizer "
                   f"{mib(plan.held.optimizer_bytes)}, batch "
                   f"{mib(plan.held.batch_bytes)}; the step must fit "
                   f"{mib(plan.step_budget_bytes)}"))
  if plan.step is not None:
    rows.append(("predicted on", plan.step, _STEPS.get(plan.step, "")))
  if plan.shape is not None and plan.budget is not None:
    peak = plan.predicted_peak_at(plan.shape)
    versus = f"; {peak / keep:.2f}x of keeping everything's" if keep else ""
    margin = (f", held to the budget with a {plan.margin:.0%} margin"
              if plan.margin else "")
    rows.append(("predicted peak", mib(peak),
                 f"read from the step's program{margin}{versus}"))
  if plan.measured is not None:
    m = plan.measured
    verdict = ""
    if plan.budget_bytes is not None:
      verdict = ("; within the budget"
                 if m.peak_bytes <= plan.step_budget_bytes
                 else "; over the budget")
    rows.append(("measured peak", mib(m.peak_bytes),
                 f"the largest of {m.calls} calls run to check it{verdict}"))
  if plan.ordered:
    rows.append(("order", "ordered", "the chain's ops run in one order"))
  rows.append(("cost model's peak", mib(plan.peak_bytes),
               f"{plan.peak_bytes / plan.baseline_peak_bytes:.2f}x of "
               f"keeping everything, by the model "
               f"({mib(plan.baseline_peak_bytes)})"))
  rows.append(("cost model's time", f"{1000 * plan.seconds:.1f} ms",
               f"{100 * (plan.seconds / plan.baseline_seconds - 1):+.1f}% "
               "over keeping everything, by the model"))
  return [f"{name:<19}{value:>11}  {note}".rstrip()
          for name, value, note in rows]


# What `Plan.step` names, for the printout.
_STEPS = {
    "train_on_batch": ("the compiled model's own training step: its loss "
                       "and its optimizer's update"),
    "stand-in": ("the gradient of sum(y**2)/2 of the outputs, no loss, no "
                 "optimizer"),
}


LEGEND = """\
decision: keep (the layer's activations are stored for the backward pass) or
  remat k (segment k's layers rerun in the backward pass; only its last
  output is stored, and what its save policy keeps, if one is named: "keeps
  dots" are matrix products and convolutions, "masks" dropout masks;
  "nested": the layer's own layers are rematerialized inside its rerun, one
  working set at a time; the cost model counts it as not nested).
stored: what the layer stores for the backward pass under this decision,
  beyond its output. output: its output. fwd ms: one forward call (what
  rerunning it costs). wait ms: what its rerun adds when it waits for later
  layers of its segment to rerun. Read from each layer's traced program
  (times from the bytes its ops read and write); structurally identical
  layers are read once and share their figures. The cost model proposes; a
  plan is chosen on its whole step's predicted peak."""
