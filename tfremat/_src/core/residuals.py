"""What a rematerialized call keeps for its backward pass, under a policy.

  print(tfremat.saved_residuals(block, x, policy="dots_saveable"))

`saved_residuals` traces `RematerializeFn(fn, *xs, policy=policy)` once (in
a `tf.function`; nothing runs) and lists the tensors its forward pass keeps
until the backward pass: the arguments and captured tensors the rerun reads,
and the op outputs the policy keeps, each with its shape, dtype and bytes.
Weights are not listed: they are held whether or not anything is
rematerialized.
"""

import dataclasses

import numpy as np
import tensorflow as tf

from tfremat._src import units
from tfremat._src.core import policies
from tfremat._src.core import remat
from tfremat._src.core import selective

__all__ = [
    "saved_residuals",
    "Residual",
    "Residuals",
]


@dataclasses.dataclass(frozen=True)
class Residual:
  """One tensor kept from the forward pass for the backward pass.

  Attributes:
    source: "argument" (passed to the function), "captured" (read by it from
      outside) or "policy" (an op output the policy keeps).
    what: the argument's position, or the op's type and name.
    shape: a tuple of ints (None where unknown).
    dtype: the dtype's name.
    num_bytes: its bytes (0 if the shape is not fully known).
  """
  source: str
  what: str
  shape: tuple
  dtype: str
  num_bytes: int


class Residuals(list):
  """A list of `Residual`s that prints as a table with a total."""

  def __init__(self, items, policy_name):
    super().__init__(items)
    self.policy_name = policy_name

  @property
  def total_bytes(self):
    return sum(r.num_bytes for r in self)

  def bytes_from(self, source):
    return sum(r.num_bytes for r in self if r.source == source)

  def __str__(self):
    fmt = _format_bytes
    lines = [f"Kept for the backward pass under "
             f"{self.policy_name or 'no policy'}:",
             f"{'source':<9} {'op or tensor':<52} {'shape':<20} "
             f"{'dtype':<9} {'bytes':>10}"]
    for r in self:
      shape = "(" + ", ".join("?" if d is None else str(d)
                              for d in r.shape) + ")"
      what = r.what if len(r.what) <= 52 else "..." + r.what[-49:]
      lines.append(f"{r.source:<9} {what:<52} {shape:<20} "
                   f"{r.dtype:<9} {fmt(r.num_bytes):>10}")
    labels = {"argument": "arguments", "captured": "captured",
              "policy": "kept by the policy"}
    parts = ", ".join(f"{labels[s]} {fmt(self.bytes_from(s))}"
                      for s in labels if any(r.source == s for r in self))
    lines.append(f"total: {len(self)} tensors, {fmt(self.total_bytes)}"
                 + (f" ({parts})" if parts else ""))
    lines.append("(Weights are not listed: they are held with or without "
                 "rematerialization.)")
    return "\n".join(lines)


def _short_name(name):
  """An op name without the outermost scope (the traced function's)."""
  return name.split("/", 1)[1] if "/" in name else name


def _format_bytes(n):
  if n >= 2**20:
    return units.format_bytes(n)
  return f"{n / 2**10:.1f} KiB"


def _entry(source, what, tensor):
  shape = tuple(tensor.shape.as_list()) if tensor.shape.rank is not None else ()
  known = tensor.shape.is_fully_defined()
  num = (int(np.prod(shape, dtype=np.int64)) * tensor.dtype.size
         if known else 0)
  return Residual(source, what, shape, tensor.dtype.name, num)


def saved_residuals(fn, *xs, policy=None):
  """Lists what `RematerializeFn(fn, *xs, policy=policy)` keeps for the
  backward pass (like JAX's `print_saved_residuals`).

  Args:
    fn, *xs: as for `RematerializeFn`; tensors among `xs` give the traced
      shapes.
    policy: a save policy (see `tfremat.policies`), or None (an enclosing
      `policies.scope`'s, else none).

  Returns:
    A `Residuals` list of `Residual`s; `print` it for a table with the
    total, or read `.total_bytes`.
  """
  if policy is None:
    policy = policies.current()  # An enclosing policies.scope's.
  policy_fn = policies.get(policy)
  call, positions = _traced_call(fn, xs, policy_fn)
  found = []
  for n, i in enumerate(positions):
    found.append(_entry("argument", f"argument {n}", call.leaves[i]))
  for s in getattr(call, "sources", ()):
    if s.kind == "closure":
      found.append(_entry("captured", s.tensor.name, s.tensor))
  if call.saver is not None:
    found += _kept(call.saver.saved.values())
  return Residuals(found, policies.name_of(policy))


def policy_residuals(fn, *xs, among=()):
  """What each policy in `among` keeps of `fn(*xs)`: for each, a
  `Residuals` of its "policy" entries, as `saved_residuals` lists them.

  One trace answers for all: the forward pass is traced once keeping every
  candidate op, and each policy's choice among them is read off. A policy
  that recomputes a named tensor's producer with it
  (`save_anything_except_these_names`) gets a trace of its own.
  """
  fns = [policies.get(p) for p in among]
  together = [not getattr(p, "unsave_named_inputs", False) for p in fns]
  everything = []
  if any(together):
    call, _ = _traced_call(fn, xs, lambda op: True)
    everything = list(call.saver.saved.values()) if call.saver else []
  found = []
  for policy, one_trace in zip(fns, together):
    if one_trace:
      kept = _kept(s for s in everything
                   if selective.keeps(policy, s.info))
    else:
      kept = [r for r in saved_residuals(fn, *xs, policy=policy)
              if r.source == "policy"]
    found.append(Residuals(kept, policies.name_of(policy)))
  return found


def _traced_call(fn, xs, policy_fn):
  """Traces `RematerializeFn(fn, *xs, policy=policy_fn)` (without running
  it); returns the call's record and the positions of the tensors among
  `xs`' leaves."""
  leaves = tf.nest.flatten(xs)
  positions = [i for i, leaf in enumerate(leaves)
               if isinstance(leaf, (tf.Tensor, np.ndarray))]
  specs = [tf.TensorSpec.from_tensor(tf.convert_to_tensor(leaves[i]))
           for i in positions]
  @tf.function(autograph=False)
  def traced(*tensors):
    args = list(leaves)
    for i, t in zip(positions, tensors):
      args[i] = t
    args = tf.nest.pack_sequence_as(xs, args)
    # Traced, not run: the policy acts here as in any tf.function.
    return remat.RematerializeFn(fn, *args, policy=policy_fn)

  with remat.observed_calls() as calls:
    traced.get_concrete_function(*specs)
  return calls[0], positions


def _kept(saved_ops):
  """The "policy" entries of the kept ops (`selective.Saved`), in order."""
  found = []
  for saved in saved_ops:
    name = _short_name(saved.info.name)
    room = 51 - len(saved.info.type)
    if len(name) > room:
      name = "..." + name[-(room - 3):]
    what = f"{saved.info.type} {name}"
    if saved.info.checkpoint_name:
      what = f"checkpoint_name {saved.info.checkpoint_name!r}"
    for t in saved.outputs:
      found.append(_entry("policy", what, t))
  return found

