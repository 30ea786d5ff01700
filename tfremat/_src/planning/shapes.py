"""A chain's costs at input shapes it was not measured at, from two that it
was: the sample's, and the sample cut in half along one axis (the sequence
where the chain's input has one, else the batch). Pure: it computes with
measured costs.

Each cost of a layer (bytes of a kind of tensor, seconds of a pass) is
fitted along that axis through its two measurements, as `size` grows from
the half to the whole: a constant plus a linear term where it grew less than
in proportion (a scratch buffer of fixed size), a linear plus a quadratic
term where it grew more (attention's scores: quadratic in the sequence).
Along the batch axis, when the sequence was the one measured, every cost
but the weight gradients grows in proportion. What the step holds beyond
the chain by the cost model (a model's head and loss, the optimizer's
update; `ShapeFit.overheads`) is fitted as a constant plus a term in
proportion to the input's size.
"""

import dataclasses

from tfremat._src.planning.cost_model import LayerCost

__all__ = [
    "ShapeFit",
    "fitted",
]

# LayerCost's fields that change with the input's shape: all but its name,
# weight gradients and save policies' keys.
_BYTES = ("input_bytes", "output_bytes", "saved_bytes",
          "forward_transient_bytes", "backward_transient_bytes")
_SECONDS = ("forward_seconds", "backward_seconds",
            "waiting_recompute_seconds")


def fitted(whole, half, half_ratio, ratio):
  """A cost at `ratio` times the measured size, from its value at the size
  (`whole`) and at `half_ratio` times it (`half`): through both points, a
  constant plus a linear term if it grew less than in proportion, else a
  linear plus a quadratic term (see the module's docstring). Never below 0.
  """
  if whole <= 0 or half_ratio >= 1:
    return max(0.0, whole * ratio)
  share = half / whole  # What the half kept of the whole.
  if share >= half_ratio:  # Less than in proportion: c + l * r.
    linear = (1 - share) / (1 - half_ratio)
    value = whole * ((1 - linear) + linear * ratio)
  else:  # More than in proportion: l * r + q * r**2.
    quadratic = (half_ratio - share) / (half_ratio - half_ratio**2)
    value = whole * ((1 - quadratic) * ratio + quadratic * ratio**2)
  return max(0.0, value)


@dataclasses.dataclass(frozen=True)
class ShapeFit:
  """How a chain's costs change with its input's shape (see the module).

  Attributes:
    shape: the sample's input shape (of the chain's first layer).
    axis: the axis measured a second time (1: the sequence, 0: the batch),
      or None where only the sample was measured (costs then grow in
      proportion to the batch, and the sample's other axes hold).
    half: the size along `axis` of the second measurement.
    half_costs: the chain's LayerCosts there.
    overheads: (bytes at the sample, bytes at the half): the measured peak
      of keeping everything less the cost model's, what the measured step
      holds beyond the chain (a model's layers before and after it, its
      loss, the optimizer's update).
    aim_below: a plan for another shape is aimed this fraction below the
      room the budget leaves there (`tfremat.planner.Settings.aim_below`):
      it is predicted, not measured.
  """
  shape: tuple
  axis: int = None
  half: int = None
  half_costs: tuple = ()
  overheads: tuple = (0, 0)
  aim_below: float = 0.03

  def __post_init__(self):
    object.__setattr__(self, "shape", tuple(self.shape))
    object.__setattr__(self, "half_costs", tuple(
        c if isinstance(c, LayerCost) else LayerCost.from_config(c)
        for c in self.half_costs))
    object.__setattr__(self, "overheads", tuple(self.overheads))

  def resolved(self, shape):
    """`shape` with each unknown dimension (None) the sample's."""
    if len(shape) != len(self.shape):
      return self.shape
    return tuple(s if d is None else int(d) for d, s in zip(shape, self.shape))

  def _ratios(self, shape):
    """(batch ratio, ratio along `axis`, ratio of the other axes)."""
    rest = 1.0
    for i, (d, s) in enumerate(zip(shape, self.shape)):
      if i not in (0, self.axis) and s:
        rest *= d / s
    batch = shape[0] / self.shape[0] if self.shape[0] else 1.0
    along = (shape[self.axis] / self.shape[self.axis]
             if self.axis not in (None, 0) else batch)
    return batch, along, rest

  def costs_at(self, costs, shape):
    """`costs` (measured at the sample) at input shape `shape`."""
    batch, along, rest = self._ratios(shape)
    # Along the batch: in proportion, unless the batch is the axis fitted.
    scale = rest * (1.0 if self.axis in (None, 0) else batch)
    half_ratio = (self.half / self.shape[self.axis] if self.axis is not None
                  else 1.0)

    def at(whole, half):
      if self.axis is None:
        return scale * whole * along
      return scale * fitted(whole, half, half_ratio, along)

    found = []
    for i, c in enumerate(costs):
      h = self.half_costs[i] if self.half_costs else c
      changes = {f: int(at(getattr(c, f), getattr(h, f))) for f in _BYTES}
      changes.update({f: at(getattr(c, f), getattr(h, f)) for f in _SECONDS})
      # The half was profiled without save policies: what a policy keeps
      # is fitted as the layer's saved tensors, its time as the forward's.
      kept_share = h.saved_bytes / max(1, c.saved_bytes)
      time_share = h.forward_seconds / max(1e-12, c.forward_seconds)
      changes["policy_costs"] = {
          p: [int(at(kept, kept * kept_share)), at(sec, sec * time_share)]
          for p, (kept, sec) in c.policy_costs.items()}
      found.append(dataclasses.replace(c, **changes))
    return found

  def size_ratio(self, shape):
    """The input's size at `shape` over the sample's (elements)."""
    batch, along, rest = self._ratios(shape)
    return batch * rest * (along if self.axis not in (None, 0) else 1.0)

  def overhead_at(self, shape):
    """What the step holds beyond the chain at `shape`: a constant plus a
    term in proportion to the input's size, through the two measured."""
    whole, half = self.overheads
    size = self.size_ratio(shape)
    if self.axis is None:
      return int(whole * size)
    half_ratio = self.half / self.shape[self.axis]
    linear = (whole - half) / (1 - half_ratio)
    return int(whole - linear + linear * size)

  def get_config(self):
    return {"shape": list(self.shape), "axis": self.axis, "half": self.half,
            "half_costs": [c.get_config() for c in self.half_costs],
            "overheads": list(self.overheads), "aim_below": self.aim_below}

  @classmethod
  def from_config(cls, config):
    return cls(**config)
