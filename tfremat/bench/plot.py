"""The sweep's plot: peak memory against step time, with budgets, fits and
the Pareto front (needs matplotlib: `pip install ".[bench]"`)."""

import textwrap

__all__ = [
    "plot_pareto",
    "label_offsets",
]


def label_offsets(boxes, height):
  """Vertical offsets (points) for point labels so that no two overlap.

  `boxes` holds each label's left edge x, its point's height y and its
  width, in points. Each label, in order, takes the first free place among
  its point's height and steps of `height` below and above it.
  """
  placed, offsets = [], []
  for x, y, width in boxes:
    for k in range(60):
      dy = 2 + (k + 1) // 2 * height * (-1 if k % 2 else 1)
      if not any(x < px + pw and px < x + width and abs(y + dy - py) < height
                 for px, py, pw in placed):
        break
    placed.append((x, y + dy, width))
    offsets.append(dy)
  return offsets


def _mib(r):
  return r["peak_bytes"] / 2**20


def _ms(r):
  return 1000 * r["step_seconds"]


def plot_pareto(rows, path, title):
  """Peak memory vs step time, with budgets, fits and the Pareto front;
  False without matplotlib."""
  try:
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot as plt  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False
  fig, ax = plt.subplots(figsize=(8, 5))
  _budgets(ax, rows)
  _points(ax, rows)
  ordered = sorted(rows, key=lambda r: (_mib(r), _ms(r)))
  # Times differ by tens of percent, not from zero: the axis spans them.
  low = min(1000 * r["step_p25_seconds"] for r in rows)
  high = max(1000 * r["step_p75_seconds"] for r in rows)
  ax.set_ylim(low - 0.05 * (high - low), high + 0.05 * (high - low))
  ax.set_xlim(0, 1.2 * max(_mib(r) for r in rows))  # Room for labels.
  ax.set_xlabel("peak memory of a training step (MiB)")
  ax.set_ylabel("median step time (ms); bars: 25th-75th percentile")
  ax.set_title("\n".join(textwrap.wrap(title, 90)), fontsize=9)
  fig.tight_layout()
  _labels(fig, ax, ordered)
  front, best = [], float("inf")
  for r in ordered:
    if r["step_seconds"] < best:
      front.append(r)
      best = r["step_seconds"]
  ax.step([_mib(r) for r in front], [_ms(r) for r in front], where="post",
          color="gray", linestyle="--", label="Pareto front")
  ax.legend(loc="lower left", fontsize=8)  # Fast and small: empty.
  fig.savefig(path, dpi=120)
  return True


def _budgets(ax, rows):
  """A dotted line at each planner row's budget."""
  for r in rows:
    if r["budget_bytes"] is not None:
      ax.axvline(r["budget_bytes"] / 2**20, color="gray", linewidth=0.8,
                 linestyle=":")
      ax.text(r["budget_bytes"] / 2**20, 0.98,
              f"{r['budget_fraction']:.0%} budget ", fontsize=7,
              color="gray", rotation=90, va="top", ha="right",
              transform=ax.get_xaxis_transform())


def _points(ax, rows):
  """Each row's point with its quartiles, by kind and fit; the dominated
  ones ringed."""
  styles = (("uniform", "o", "tab:blue", None),
            ("policy", "D", "tab:purple", None),
            ("planner", "s", "tab:green", True),
            ("planner", "X", "tab:red", False))
  dominated = [r for r in rows if r.get("dominated_by")]
  if dominated:
    ax.scatter([_mib(r) for r in dominated], [_ms(r) for r in dominated],
               s=220, facecolors="none", edgecolors="tab:orange",
               linewidths=1.5, zorder=3,
               label="dominated: another scheme is smaller and faster")
  for kind, marker, color, fits in styles:
    part = [r for r in rows if r["kind"] == kind and r["fits"] == fits]
    if not part:
      continue
    label = {"uniform": "uniform", "policy": "every block under a policy"}.get(
        kind) if fits is None else (
            "planner, fits its budget" if fits else "planner, over its budget")
    ax.errorbar([_mib(r) for r in part], [_ms(r) for r in part],
                yerr=[[_ms(r) - 1000 * r["step_p25_seconds"] for r in part],
                      [1000 * r["step_p75_seconds"] - _ms(r) for r in part]],
                fmt=marker, color=color, capsize=3, label=label)


def _labels(fig, ax, ordered):
  """Each point's name, moved apart where two would overlap."""
  to_points = lambda r: ax.transData.transform((_mib(r), _ms(r))) * 72 / fig.dpi
  fontsize = 7
  offsets = label_offsets(
      [(to_points(r)[0] + 5, to_points(r)[1], 0.55 * fontsize *
        len(r["scheme"])) for r in ordered], height=fontsize + 2)
  for r, dy in zip(ordered, offsets):
    # A label moved away from its point gets a thin line to it.
    ax.annotate(r["scheme"], (_mib(r), _ms(r)), textcoords="offset points",
                xytext=(5, dy), fontsize=fontsize, va="center",
                arrowprops=(dict(arrowstyle="-", color="gray", linewidth=0.5)
                            if abs(dy) > fontsize else None))
