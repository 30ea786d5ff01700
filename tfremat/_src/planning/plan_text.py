"""How a `tfremat.planner.Plan` prints: a table of its layers' decisions,
then its budget, measured bound and the cost model's predictions, then a
legend (`LEGEND`, also `tfremat.planner.LEGEND`)."""

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
  """The budget, measured and predicted lines of `plan`'s printout."""
  # Measured figures are compared with measured ones, the cost model's with
  # the cost model's, and every line says which it is.
  mib, rows = units.format_bytes, []
  keep = plan.measured_keep_peak_bytes
  if plan.budget_bytes is not None:
    given = ""
    if plan.budget is not None and plan.budget.fraction is not None:
      given = ((f"held + " if plan.held is not None else "") +
               f"{plan.budget.fraction:.0%} of the measured peak of keeping "
               "everything" + (f" ({mib(keep)})" if keep else ""))
    rows.append(("budget", mib(plan.budget_bytes), given))
    if plan.held is not None:
      rows.append(("held", mib(plan.held.total_bytes),
                   f"weights {mib(plan.held.weights_bytes)}, optimizer "
                   f"{mib(plan.held.optimizer_bytes)}, batch "
                   f"{mib(plan.held.batch_bytes)}; the step's bound must "
                   f"fit {mib(plan.step_budget_bytes)}"))
  if plan.step is not None:
    rows.append(("measured on", plan.step, _STEPS.get(plan.step, "")))
  if plan.measured is not None:
    m = plan.measured
    versus = (f"; {m.peak_bytes / keep:.2f}x of keeping everything's"
              if keep else "")
    rows.append(("measured peak", mib(m.peak_bytes),
                 f"the largest of {m.calls} calls{versus}"))
    verdict = ""
    if plan.budget_bytes is not None:
      verdict = ("; within the budget"
                 if m.bound_bytes <= plan.step_budget_bytes
                 else "; over the budget")
    margin = (f" + reserve ({mib(m.reserve_bytes)})"
              if m.reserve_bytes else "")
    rows.append(("bound", mib(m.bound_bytes),
                 f"for every later call: largest + spread of the {m.calls} "
                 f"calls{margin}{verdict}"))
  if plan.ordered:
    rows.append(("order", "ordered", "the chain's ops run in one order "
                 "(no unordered plan measured fits the budget)"))
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
  layers of its segment to rerun. Structurally identical layers are measured
  once and share their figures. The cost model's figures are estimates; a
  plan is chosen on its measured bound."""
