"""How a chain of layers runs: consecutive segments, each kept or
rematerialized (under a save policy, nested or not), as values.
`RematSequential` runs them; the planner chooses them. Their public names
are `tfremat.planner`'s."""

import dataclasses
import math

from tfremat import errors
from tfremat._src.core import policies as policies_lib

__all__ = [
    "Segment",
    "check_segments",
    "keep_all",
    "uniform_segments",
    "policy_of",
]


def policy_of(config):
  """The policy a built-in's name or a saved config names; a name that is
  no longer a policy (a user's, not importable here) stays a name, for
  printouts."""
  try:
    return policies_lib.deserialize(config)
  except (ValueError, TypeError):
    return config if isinstance(config, str) else str(config)


@dataclasses.dataclass(frozen=True)
class Segment:
  """Layers [start, stop) of the chain, rematerialized or kept.

  `policy` is the save policy a rematerialized segment runs under
  (`tfremat.policies`: a built-in's name, or a policy value such as
  `save_only_these_names(...)`), or None: everything is recomputed.
  `nested`, for a rematerialized segment: each of its layers' own layers
  (one level down, as `tfremat.remat_in_place(..., nested=True)` takes them;
  for a unit that wraps one layer, that layer's: `tfremat.chain.nest_target`)
  are rematerialized too, inside the segment's rerun, under the same policy.
  The cost model does not model nesting: it predicts a nested segment as
  the same segment not nested.
  """
  start: int
  stop: int
  remat: bool
  policy: object = None
  nested: bool = False

  def __post_init__(self):
    # A built-in's name or a policy's saved config: its value.
    if isinstance(self.policy, (str, dict)):
      object.__setattr__(self, "policy", policy_of(self.policy))

  def as_list(self):
    """[start, stop, remat], then the policy (`tfremat.policies.serialize`)
    if there is one, and True if nested (after the policy, None if there
    is none): JSON-able."""
    items = [self.start, self.stop, self.remat]
    policy = policies_lib.serialize(self.policy)
    if self.nested:
      return items + [policy, True]
    return items + [policy] if policy is not None else items


def check_segments(segments, n):
  """Raises ValueError unless `segments` cover layers [0, n) in order."""
  stops = [s.start for s in segments[1:]]
  if (not segments or segments[0].start != 0 or segments[-1].stop != n or
      [s.stop for s in segments[:-1]] != stops or
      any(s.stop <= s.start for s in segments)):
    raise errors.InvalidArgumentError(
        f"segments must cover layers 0..{n} in order without gaps; got "
        f"{segments}.")
  kept_nested = [s for s in segments if s.nested and not s.remat]
  if kept_nested:
    raise errors.InvalidArgumentError(
        f"Only a rematerialized segment can be nested (its layers' own "
        f"layers rematerialized inside its rerun); got {kept_nested}. Give "
        "remat=True, or nested=False.")


def keep_all(num_layers):
  """The plan that rematerializes nothing."""
  return [Segment(i, i + 1, False) for i in range(num_layers)]


def uniform_segments(num_layers, segments):
  """`segments` (an int, or "sqrt") equal rematerialized segments."""
  if segments == "sqrt":
    segments = max(1, round(math.sqrt(num_layers)))
  if (not isinstance(segments, int) or isinstance(segments, bool) or
      not 1 <= segments <= max(1, num_layers)):
    raise errors.InvalidArgumentError(
        f"segments must be an int from 1 to the number of layers "
        f"({num_layers}) or \"sqrt\"; got {segments!r}.")
  bounds = [round(i * num_layers / segments) for i in range(segments + 1)]
  return [Segment(lo, hi, True) for lo, hi in zip(bounds, bounds[1:])]
