"""Every plan's peak from one traced program: the keep-everything step's.

A chain the planner plans runs each kept layer as a `RematerializationLayer`
under `everything_saveable` (gated, `RematSequential`): in its backward
pass the layer's rerun is built, and each of its tensors is replaced by the
forward pass's (an `Identity` reading it), so the rerun's own ops are dead
and pruned. Rematerializing a segment changes only that: the backward
pass's reads of the segment's forward tensors become reads of a rerun of
the ops that made them, which starts once the gradient reaches the
segment's last layer; the forward tensors are then freed after their last
forward reader. `KeepProgram.peak` makes that change in the flattened
program (`predicting._Program`) and simulates it on the executor's rules
(`predicting._Schedule`), in well under a second, where tracing a
candidate's Keras training step takes seconds (the optimizer's update
alone, hundreds of variables, is most of it). A save policy's kept ops are
read from the forward pass, as its rerun reads them.

What it reads is op names: a kept layer's forward ops under
`remat_<unit>/`, its rerun under the scope that follows, its gradient under
`gradient_tape/` and that scope. A unit it cannot find raises
`NotReadable`; callers then trace the candidate (`predict_peak`).
"""

import collections
import re

from tfremat._src import predicting

__all__ = ["KeepProgram", "NotReadable"]

# Ops a rerun does not make anew, nor waits for: variables' reads,
# constants, inputs.
_NOT_RERUN = frozenset(["ReadVariableOp", "Const", "VarHandleOp",
                        "Placeholder"])


class NotReadable(Exception):
  """The keep-everything program does not show a unit's rerun."""


class _NamedProgram(predicting._Program):  # pylint: disable=protected-access
  """A `predicting._Program` that keeps each node's op name."""

  def __init__(self):
    super().__init__()
    self.names = []

  def _append(self, node, op_name, prefix):
    super()._append(node, op_name, prefix)
    self.names.append(prefix + op_name)


class KeepProgram:
  """The keep-everything training step's program (a traced graph of a
  chain whose kept layers are gated), read for any plan of the chain."""

  def __init__(self, graph, held, units):
    self.graph = graph
    self.held = held
    self.program = _NamedProgram.of(graph)
    # Each unit's forward ops and the scope of its rerun and gradient.
    self.units = _unit_scopes(self.program, units)
    # Each tensor's (and op name's) node.
    self.producer = self.program._producer  # pylint: disable=protected-access
    self._users = None

  @classmethod
  def of(cls, step, units):
    """From a `predicting.Step` on TensorFlow's executor, of a chain whose
    kept units run as the `RematerializationLayer`s named `units`, in
    chain order."""
    concrete = step.function.get_concrete_function(*step.args, **step.kwargs)
    return cls(concrete.graph, {t.name for t in concrete.graph.outputs},
               units)

  def peak(self, segments=()):
    """The simulated peak with `segments` rematerialized: each a pair of
    (its units' indices in the chain, None or a function of a graph op
    that says whether its save policy keeps it); `()` is keeping
    everything, `predict_peak`'s figure for this program."""
    program = predicting._Program()  # pylint: disable=protected-access
    for node, name in zip(*self._rewritten(segments)):
      program._append(node, name, "")  # pylint: disable=protected-access
    schedule = predicting._Schedule(  # pylint: disable=protected-access
        program, self.held, predicting.executor_lanes())
    return schedule.peak()

  def _rewritten(self, segments):
    # A rerun replaces nodes and appends its own; it changes none.
    nodes = list(self.program.nodes)
    names = list(self.program.names)
    producer = dict(self.producer)
    # Where each node is built: a rerun's copies just before the first
    # backward read they serve, as a rerun is built before its gradient
    # (the executor runs ready ops in the order they became ready, the
    # ones an op readies in build order).
    places = [float(i) for i in range(len(nodes))]
    for units, policy in segments:
      _Rerun(self, nodes, names, producer, units, policy, places).apply()
    order = sorted(range(len(nodes)), key=places.__getitem__)
    return [nodes[i] for i in order], [names[i] for i in order]

  def users(self):
    """Each node's readers (by index), data and control."""
    if self._users is None:
      self._users = collections.defaultdict(list)
      for i, deps in enumerate(self.program.dependencies()):
        for j in deps:
          self._users[j].append(i)
    return self._users


class _Rerun:
  """One rematerialized segment's change to the program (`apply`)."""

  def __init__(self, keep, nodes, names, producer, units, policy, places):
    self.keep, self.nodes, self.names = keep, nodes, names
    self.places = places
    self.producer, self.policy = producer, policy
    found = [keep.units[i] for i in units]
    if not all(ops for ops, _ in found):
      raise NotReadable(f"no forward ops of units {list(units)}")
    self.forward = set().union(*(ops for ops, _ in found))
    # A unit without a rerun scope has no rerun: its backward pass reads
    # nothing of its forward pass's own (a Dense head reads its input and
    # weights).
    self.scopes = [scope for _, scope in found if scope is not None]
    own, scopes = keep.program.names, tuple(self.scopes)
    self.reruns = {i for i, n in enumerate(own) if n.startswith(scopes)}
    scopes = tuple("gradient_tape/" + s for s in scopes)
    self.grads = {i for i, n in enumerate(own) if n.startswith(scopes)}
    self.made = {}

  def apply(self):
    if not self.scopes:
      return
    if not self.grads:
      raise NotReadable(f"no gradient ops under {self.scopes}")
    gate = None
    for i in sorted(self.reruns):
      node = self.nodes[i]
      if node.type != "Identity" or len(node.inputs) != 1:
        continue
      key = node.inputs[0]
      j = self.producer.get(key)
      if j not in self.forward or not self._recomputed(j):
        continue
      gate = self._gate() if gate is None else gate
      new = self._copy(key, gate, i)
      self.nodes[i] = predicting._Node(  # pylint: disable=protected-access
          "Identity", [new], [(node.outputs[0][0], 0, new)], node.after)
    # Replacing nothing, the segment's backward pass reads nothing of its
    # forward pass's own (a Dense layer's reads its input and weights):
    # its rerun is pruned, and its step is keeping everything's.

  def _recomputed(self, j):
    """Whether the rerun makes node `j`'s outputs anew: a buffer of the
    step's that the segment's policy does not keep."""
    if self.nodes[j].type in _NOT_RERUN:
      return False
    if self.policy is None:
      return True
    try:
      op = self.keep.graph.get_operation_by_name(self.names[j])
    except (KeyError, ValueError):
      return True  # Inside a function call: not an op of the graph's own.
    return not self.policy(op)

  def _gate(self):
    """What the rerun waits for: the tensors the gradient hands the
    segment's last unit, made outside its own backward pass and rerun."""
    last = "gradient_tape/" + self.scopes[-1]
    keep = self.keep
    below, stack = set(), list(self.grads | self.reruns)
    users = keep.users()
    while stack:
      i = stack.pop()
      if i not in below:
        below.add(i)
        stack.extend(users[i])
    gate = set()
    for i in self.grads:
      if not keep.program.names[i].startswith(last):
        continue
      for key in keep.program.nodes[i].inputs:
        j = keep.producer.get(key)
        if (j is None or j in below or j in self.forward or
            keep.program.nodes[j].type in _NOT_RERUN):
          continue
        gate.add(key)
    if not gate:
      raise NotReadable(f"no gradient reaching {self.scopes[-1]}")
    return sorted(gate)

  def _copy(self, key, gate, before):
    """The rerun's tensor for the forward tensor `key`: a copy of the op
    that made it, on the rerun's copies of its forward inputs."""
    j = self.producer[key]
    if j not in self.made:
      node = self.nodes[j]
      inputs = [self._copy(k, gate, before)
                if self.producer.get(k) in self.forward and
                self._recomputed(self.producer[k]) else k
                for k in node.inputs]
      outputs = [("rerun:" + k, n,
                  "rerun:" + a if a is not None and
                  self.producer.get(a) in self.forward and
                  self._recomputed(self.producer[a]) else a)
                 for k, n, a in node.outputs]
      self.nodes.append(predicting._Node(  # pylint: disable=protected-access
          node.type, inputs, outputs, list(node.after) + gate,
          node.transient))
      self.names.append("rerun:" + self.names[j])
      self.places.append(before - 1 + len(self.places) * 1e-9)
      for k, _, _ in outputs:
        self.producer[k] = len(self.nodes) - 1
      self.made[j] = True
    return "rerun:" + key


def _unit_scopes(program, units):
  """(forward op indices, rerun scope) of each of `units` (the chain's
  `RematerializationLayer` names, in order). The scope a unit's forward
  ops are under is its name, or as TensorFlow makes it unique (`dense_1`
  for `dense`, where a unit `dense_1` follows under `dense_1_2`): scopes
  are given out in the order they first appear, each to the first unit
  not yet given one whose name it can be, as the chain calls its units in
  order. Its rerun's scope is that of the `Identity`s outside any forward
  pass that read its forward tensors (its gradient's, the same under
  `gradient_tape/`); None where there are none."""
  names = program.names
  patterns = [re.compile(re.escape(u) + r"(_\d+)?") for u in units]
  owner, taken = {}, set()
  forward = [set() for _ in units]
  for i, name in enumerate(names):
    if name.startswith("gradient_tape/"):
      continue
    for part in name.split("/")[:-1]:
      if part not in owner:
        k = next((k for k, p in enumerate(patterns)
                  if k not in taken and p.fullmatch(part)), None)
        owner[part] = k
        if k is not None:
          taken.add(k)
      if owner[part] is not None:
        forward[owner[part]].add(i)
        break
  unit_of = {key: k for k, ops in enumerate(forward) for i in ops
             for key, _, _ in program.nodes[i].outputs}
  everywhere = set().union(*forward)
  votes = [collections.Counter() for _ in units]
  for i, node in enumerate(program.nodes):
    if (node.type != "Identity" or i in everywhere or len(node.inputs) != 1
        or "/" not in names[i] or names[i].startswith("gradient_tape/")):
      continue
    k = unit_of.get(node.inputs[0])
    if k is not None:
      votes[k][names[i].split("/")[0] + "/"] += 1
  return [(ops, vote.most_common(1)[0][0] if vote else None)
          for ops, vote in zip(forward, votes)]
