"""Predicting a step's peak from its program (`tfremat.measure.predict_peak`),
without running it: what `measure.peak_bytes` would report.

Under XLA the figure is the compiler's own: the step is compiled (not run)
at the arguments' shapes, and its buffer assignment, which XLA's heap
simulator packs over the scheduled program, gives the bytes each call
allocates. On TensorFlow's executor it is read from the traced graph: each
tensor's bytes from its static shape, allocated when the op making it runs
and freed after its last reader, over a schedule of the graph's ops
(`_Schedule`). A leaf like `measuring`: it imports nothing of tfremat's but
its errors."""

import collections
import dataclasses
import heapq
import os

import numpy as np
import tensorflow as tf

from tfremat import errors

__all__ = ["predict_peak", "peak_of", "Step", "step_of", "executor_lanes",
           "read_program"]


def executor_lanes():
  """How many ops the executor runs at once: one per inter-op thread (as
  many as the cores unless set) and the caller's (docs/design.md)."""
  threads = tf.config.threading.get_inter_op_parallelism_threads()
  return (threads or os.cpu_count() or 1) + 1


# Grappler folds an op whose inputs are all constants into a constant of up
# to this many bytes before the graph runs (its constant folding's limit):
# such a tensor is made once, not on each call.
_FOLDED_BYTES = 10 * 2**20


def predict_peak(step, *args, **kwargs):
  """The peak `measure.peak_bytes(step, *args, **kwargs)` would report, in
  bytes, read from the step's program without running it.

  The step is traced (on TensorFlow's executor) or compiled (under XLA) at
  the arguments' shapes, once; nothing is allocated for its tensors, so a
  shape that would not fit in memory can be asked about. An argument may be
  a `tf.TensorSpec` in place of a tensor of that shape.

  Under XLA (`jit_compile=True`, or a Keras model whose `jit_compile`
  resolves to True, as `"auto"` does on a machine with a GPU) the figure is
  XLA's buffer assignment for the compiled step: the bytes it allocates
  beside its arguments, which is what `peak_bytes` measures, to the byte on
  the steps tested. On the executor the figure is the tensors live while
  the graph's ops run as the executor runs them, simulated: ops start when
  their inputs are ready, `executor_lanes()` at once (its inter-op threads
  and the caller's), each for a time of the bytes it reads and writes. The
  executor's threads order independent ops differently from call to call,
  so the measured peak itself moves; the figure is near its largest, not a
  measurement of one call (docs/design.md, "A peak read from the
  program").

  Args:
    step: a `tf.function` (with or without `jit_compile=True`), or a
      compiled Keras model's `train_on_batch`.
    *args: the step's arguments, or `tf.TensorSpec`s of them. A numpy
      array (or a list of numbers) is converted during the call, so its
      bytes count, as `peak_bytes` counts them; a tensor or a spec is
      already allocated before the call.
    **kwargs: the step's keyword arguments.

  Returns:
    An int, bytes.

  Raises:
    tfremat.errors.InvalidArgumentError: `step` is neither a `tf.function`
      nor a Keras model's `train_on_batch` (wrap an eager step in
      `tf.function`), or the model runs eagerly.
    TypeError, ValueError: the arguments do not match the step's signature
      (the error calling the step raises).
    tf.errors.InvalidArgumentError: XLA cannot compile the step (XLA's
      reason; so would the step's first call).
  """
  return peak_of(step_of(step, args, kwargs))


def peak_of(step):
  """`predict_peak`'s figure for a `step_of` Step, left traced (`call`)."""
  peak = _xla_peak(step) if step.jit_compile else _executor_schedule(
      step).top
  return int(peak + step.converted_bytes)


@dataclasses.dataclass(frozen=True)
class Step:
  """A step as its program is traced: a fresh `function` traced for `args`
  and `kwargs` (specs in place of arrays) alone, the bytes of the arrays
  the call converts, and `call`, which runs it on the arguments given."""
  function: object
  args: tuple
  kwargs: dict
  jit_compile: bool
  converted_bytes: int
  call: object


def step_of(step, args, kwargs):
  """The `Step` that calling `step(*args, **kwargs)` runs."""
  model = getattr(step, "__self__", None)
  if getattr(step, "__name__", None) == "train_on_batch" and _is_keras_model(
      model):
    return _keras_step(model, *args, **kwargs)
  python_function = getattr(step, "python_function", None)
  if python_function is None or not hasattr(step, "get_concrete_function"):
    raise errors.InvalidArgumentError(
        f"predict_peak takes a tf.function or a compiled Keras model's "
        f"train_on_batch; got {step!r}. An eager step's peak depends on "
        "when Python frees each tensor: wrap it in tf.function to predict "
        "the traced step's.")
  signature = getattr(step, "input_signature", None)
  if signature is not None:
    # The step's own binding raises what a call with these would.
    step.get_concrete_function(*args, **kwargs)
  jit = bool(getattr(step, "_jit_compile", False))
  function = tf.function(python_function, jit_compile=jit,
                         autograph=getattr(step, "_autograph", True))
  specs, kw_specs = _specs(args), _specs(kwargs)
  return Step(function, specs, kw_specs, jit, _converted(args, kwargs),
              lambda: function(*args, **kwargs))


def _is_keras_model(obj):
  try:
    import keras  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover
    return False
  return isinstance(obj, keras.Model)


def _keras_step(model, x, y=None, sample_weight=None, class_weight=None,
                return_dict=False):
  """The step `model.train_on_batch(x, y, ...)` runs: Keras's
  `one_step_on_data` (the model's `train_step` in its distribution
  strategy), traced afresh for these shapes."""
  del return_dict
  if getattr(model, "optimizer", None) is None or not getattr(
      model, "compiled", True):
    raise errors.InvalidArgumentError(
        "predict_peak takes a compiled Keras model's train_on_batch: call "
        "model.compile(optimizer=..., loss=...) first.")
  if model.run_eagerly:
    raise errors.InvalidArgumentError(
        "The model runs eagerly (run_eagerly=True): its step is no program "
        "to read. Compile it with run_eagerly=False to predict its peak.")
  preprocess = getattr(model, "preprocess_samples", None)
  if preprocess is not None:
    # A KerasHub task's train_on_batch preprocesses its samples (strings
    # to token ids) before Keras's step, outside it.
    import keras  # pylint: disable=g-import-not-at-top
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
        preprocess(x, y, sample_weight))
    x = tf.nest.map_structure(tf.convert_to_tensor, x)
    y, sample_weight = (None if t is None else tf.convert_to_tensor(t)
                        for t in (y, sample_weight))
  if class_weight is not None:
    # pylint: disable-next=g-import-not-at-top
    from keras.src.trainers.data_adapters import data_adapter_utils
    sample_weight = data_adapter_utils.class_weight_to_sample_weights(
        y, class_weight)
  data = (x, y, sample_weight)
  build = getattr(model, "_maybe_symbolic_build", None) or getattr(
      model, "_symbolic_build")
  # Slots and metrics are built as train_on_batch builds them (no trace
  # creates variables).
  build(data_batch=tf.nest.map_structure(_spec_or_value, data))

  jit = bool(model.jit_compile)
  function = _keras_function(model) if jit else None
  if function is None:
    # On the executor a step is read at the arguments' own shapes: a
    # fresh trace, where Keras's, once relaxed, knows no batch size.
    def one_step_on_data(batch):
      return model.distribute_strategy.run(model.train_step, args=(batch,))
    function = tf.function(one_step_on_data, jit_compile=jit)
  return Step(function, (_specs(data),), {}, jit, _converted((data,), {}),
              lambda: function(data))


def _keras_function(model):
  """Keras's own `one_step_on_data`, the `tf.function` train_on_batch calls:
  once it has seen another shape it traces for any (`reduce_retracing`),
  and XLA compiles that trace at each shape, which can assign other
  buffers than a trace for one shape. None where this Keras builds its
  train function otherwise."""
  model.make_train_function()
  for cell in getattr(model.train_function, "__closure__", None) or ():
    inner = getattr(cell.cell_contents, "__wrapped__", None)
    if (getattr(inner, "__name__", None) == "one_step_on_data" and
        hasattr(inner, "get_concrete_function")):
      return inner
  return None


def _spec_or_value(value):
  """A one-row tensor in place of a spec: building needs its shape alone,
  and the spec's batch may not fit in memory."""
  if isinstance(value, tf.TensorSpec):
    return tf.zeros([1] + [d or 1 for d in value.shape[1:]], value.dtype)
  return value


def _is_array(value):
  return isinstance(value, np.ndarray) or (
      isinstance(value, (list, tuple)) and value and
      all(isinstance(v, (int, float)) for v in value))


def _specs(tree):
  """`tree` with each tensor or array a `tf.TensorSpec` of it."""
  def spec(value):
    if isinstance(value, tf.TensorSpec):
      return value
    if tf.is_tensor(value) and not isinstance(value, tf.Variable) and (
        not isinstance(value, tf.SparseTensor | tf.RaggedTensor)):
      return tf.TensorSpec(value.shape, value.dtype)
    if isinstance(value, np.ndarray):
      return tf.TensorSpec(value.shape, tf.as_dtype(value.dtype))
    return value
  return tf.nest.map_structure(spec, tree)


def _converted(args, kwargs):
  """The bytes of the arrays among the arguments (converted to tensors
  during the call)."""
  found = 0
  for value in tf.nest.flatten((args, kwargs)):
    if isinstance(value, np.ndarray):
      dtype = tf.as_dtype(value.dtype)
      found += value.size * (dtype.size if dtype != tf.string else 0)
  return found


# Under XLA.


def _xla_peak(step):
  """The bytes XLA's buffer assignment gives the compiled step beside its
  arguments: every allocation that is not an entry parameter (weights,
  optimizer slots and the batch, updated in place where they are outputs
  too), a constant (made once) or thread-local."""
  # pylint: disable=g-import-not-at-top
  from tensorflow.compiler.xla.service import hlo_pb2
  from tensorflow.python.eager.polymorphic_function import compiler_ir
  # pylint: enable=g-import-not-at-top
  concrete = step.function.get_concrete_function(*step.args, **step.kwargs)
  # Compiled at the arguments' shapes, as XLA compiles a step traced for
  # any shape at each shape it is called with.
  specs = [s for s in tf.nest.flatten((step.args, step.kwargs))
           if isinstance(s, tf.TensorSpec)]
  compiled = compiler_ir.from_concrete_function(concrete, specs)
  proto = hlo_pb2.HloProto()
  try:
    proto.ParseFromString(compiled(stage="optimized_hlo_proto_serialized"))
  except ValueError as e:
    # What the step's first call raises, with XLA's reason.
    raise tf.errors.InvalidArgumentError(None, None, str(e)) from None
  if not proto.HasField("buffer_assignment"):
    raise errors.UnsupportedError(
        "This TensorFlow build's XLA returned no buffer assignment for the "
        "compiled step, so its peak cannot be read from the program.")
  return sum(a.size for a in proto.buffer_assignment.buffer_allocations
             if not (a.is_entry_computation_parameter or a.is_constant or
                     a.is_thread_local))


# On TensorFlow's executor.


def _executor_schedule(step):
  """The `_Schedule` of `step`'s traced program, run."""
  graph = step.function.get_concrete_function(*step.args,
                                              **step.kwargs).graph
  schedule = _Schedule(_Program.of(graph), {t.name for t in graph.outputs},
                       executor_lanes())
  schedule.peak()
  return schedule


def read_program(function, *args):
  """(peak, work) of `function`'s program at `args` (a `tf.function`;
  tensors or specs), traced once and not run: `predict_peak`'s figure on
  the executor, and the bytes its ops read and write, summed (the simulated
  executor's measure of an op's time; the planner ranks plans by it)."""
  step = step_of(function, args, {})
  schedule = _executor_schedule(step)
  return int(schedule.top + step.converted_bytes), schedule.work


# Ops whose outputs are no new buffer of the step's: an input, a constant, a
# variable's value (read without a copy), a shape, or an alias of an input
# (`_ALIASES`).
_NO_ALLOCATION = frozenset([
    "Placeholder", "Const", "ReadVariableOp", "VarHandleOp", "Shape",
    "ShapeN", "Size", "Rank", "NoOp", "BroadcastGradientArgs",
    "_Arg", "_Retval"])
_ALIASES = frozenset([
    "Identity", "IdentityN", "Reshape", "StopGradient", "Squeeze",
    "ExpandDims", "Snapshot", "EnsureShape", "PreventGradient", "Bitcast"])
# Elementwise ops whose kernels write into an input's buffer when nothing
# else reads it (TensorFlow's `forward_input_or_allocate_output`).
_FORWARDING = frozenset([
    "Add", "AddV2", "Sub", "Mul", "RealDiv", "Div", "DivNoNan", "Maximum",
    "Minimum", "Neg", "Exp", "Log", "Log1p", "Tanh", "Sigmoid", "Relu",
    "Relu6", "Elu", "Selu", "Softplus", "Square", "Sqrt", "Rsqrt", "Erf",
    "Erfc", "Reciprocal", "TanhGrad", "SigmoidGrad", "ReluGrad", "Relu6Grad",
    "EluGrad", "SeluGrad", "SoftplusGrad", "SqrtGrad", "RsqrtGrad",
    "SquaredDifference", "Abs", "Sign", "Floor", "Ceil", "Round", "BiasAdd",
    "LeakyRelu", "LeakyReluGrad", "Select", "SelectV2", "AddN", "Pow",
    "Cast"])
# Kernels that write another output than their first into an input's
# buffer: softmax cross-entropy's gradient (its second output) into the
# logits.
_FORWARDED_OUTPUT = {"SparseSoftmaxCrossEntropyWithLogits": 1,
                     "SoftmaxCrossEntropyWithLogits": 1}
_CALLS = frozenset(["PartitionedCall", "StatefulPartitionedCall"])
_BRANCHES = {"If": ("then_branch", "else_branch"),
             "StatelessIf": ("then_branch", "else_branch"),
             "While": ("body", "cond"), "StatelessWhile": ("body", "cond"),
             "Case": ("branches",), "StatelessCase": ("branches",)}


def _bytes(tensor):
  """A tensor's bytes from its static shape; 0 for handles and strings."""
  if tensor.dtype in (tf.resource, tf.variant, tf.string):
    return 0
  if not tensor.shape.is_fully_defined():
    raise errors.UnsupportedError(
        f"The traced step's tensor {tensor.name} ({tensor.op.type}) has the "
        f"shape {tensor.shape}, not fully known at the arguments' shapes, "
        "so its bytes cannot be read from the program. Compile the step "
        "with jit_compile=True (XLA knows every buffer's size), or measure "
        "it with tfremat.measure.peak_bytes.")
  return tensor.shape.num_elements() * tensor.dtype.size


@dataclasses.dataclass
class _Node:
  """One op of the flattened program: the tensors it reads (`inputs`),
  those it makes as (name, bytes, the name of the input whose buffer it
  shares or None), the ops it waits for, and the bytes it holds only while
  it runs (a branch's or a loop body's own peak)."""
  type: str
  inputs: list
  outputs: list
  after: list
  transient: int = 0


class _Program:
  """A traced graph's ops in build order, with function calls inlined and
  pruned to what the call runs (what its outputs and stateful ops need)."""

  def __init__(self):
    self.nodes = []
    self._producer = {}

  @classmethod
  def of(cls, graph, renamed=None, prefix=""):
    program = cls()
    program.add(graph, renamed or {}, prefix)
    return program

  def add(self, graph, renamed, prefix):
    """Appends `graph`'s ops, its tensors named `prefix` + name, but those
    in `renamed` (a body's inputs, as the caller's tensors)."""
    needed = _needed(graph)
    folded = set()
    name = lambda t: renamed.get(t.name, prefix + t.name)
    for op in graph.get_operations():
      if op.name not in needed or (op.type == "Placeholder" and renamed):
        continue
      after = [prefix + c.name for c in op.control_inputs]
      if op.type in _CALLS:
        body = graph._get_function(op.get_attr("f").name).graph  # pylint: disable=protected-access
        inner = f"{prefix}{op.name}/"
        mapping = {p.name: name(t) for p, t in zip(body.inputs, op.inputs)}
        self.add(body, mapping, inner)
        for t, out in zip(op.outputs, body.outputs):
          self._append(_Node("Identity", [mapping.get(out.name,
                                                       inner + out.name)],
                             [(name(t), 0, mapping.get(out.name,
                                                        inner + out.name))],
                             after), op.name, prefix)
        continue
      if op.type == "IdentityN":
        # Grappler removes the barrier: each output waits for its input
        # alone (Keras passes every gradient through one IdentityN).
        for t, source in zip(op.outputs, op.inputs):
          self._append(_Node("Identity", [name(source)],
                             [(name(t), 0, name(source))], after),
                       op.name, prefix)
        continue
      if _is_folded(op, folded):
        folded.add(op.name)
      outputs = []
      for i, t in enumerate(op.outputs):
        alias = None
        if op.type in _ALIASES and op.inputs:
          alias = name(op.inputs[i if op.type == "IdentityN" else 0])
        free = (op.type in _NO_ALLOCATION or alias is not None or
                op.name in folded)
        outputs.append((name(t), 0 if free else _bytes(t), alias))
      node = _Node(op.type, [name(t) for t in op.inputs], outputs, after,
                   _branch_peak(graph, op))
      self._append(node, op.name, prefix)

  def _append(self, node, op_name, prefix):
    self._producer[prefix + op_name] = len(self.nodes)
    for key, _, _ in node.outputs:
      self._producer[key] = len(self.nodes)
    self.nodes.append(node)

  def dependencies(self):
    """Each node's earlier nodes it waits for (by index)."""
    found = []
    for node in self.nodes:
      deps = {self._producer[k] for k in node.inputs + node.after
              if k in self._producer}
      found.append(sorted(deps))
    return found


def _needed(graph):
  """The names of the ops a call of `graph` runs: those its outputs and its
  stateful ops (the function's control outputs) need."""
  stack = [t.op for t in graph.outputs] + list(
      getattr(graph, "control_outputs", ()))
  found = set()
  while stack:
    op = stack.pop()
    if op.name in found:
      continue
    found.add(op.name)
    stack.extend(t.op for t in op.inputs)
    stack.extend(op.control_inputs)
  return found


def _is_folded(op, folded):
  """Whether Grappler makes `op` a constant: a constant, or a stateless op
  of constants whose outputs are small enough."""
  if op.type == "Const":
    return True
  if not op.inputs or op.control_inputs or op._is_stateful:  # pylint: disable=protected-access
    return False
  if op.type in ("Placeholder", "ReadVariableOp", "VarHandleOp"):
    return False
  if not all(t.op.name in folded for t in op.inputs):
    return False
  try:
    return all(_bytes(t) <= _FOLDED_BYTES for t in op.outputs)
  except errors.UnsupportedError:
    return False


def _branch_peak(graph, op):
  """The largest own peak of a control-flow op's branches or loop body:
  bytes held only while it runs."""
  attrs = _BRANCHES.get(op.type)
  if not attrs:
    return 0
  bodies = []
  for attr in attrs:
    value = op.get_attr(attr)
    for f in value if isinstance(value, list) else [value]:
      bodies.append(graph._get_function(f.name).graph)  # pylint: disable=protected-access
  peaks = []
  for body in bodies:
    outer = {p.name: f"^outer/{p.name}" for p in body.inputs}
    program = _Program.of(body, outer, prefix=f"{op.name}/")
    held = {outer.get(t.name, f"{op.name}/{t.name}") for t in body.outputs}
    peaks.append(_Schedule(program, held, executor_lanes()).peak())
  return max(peaks, default=0)


class _Schedule:
  """Live bytes over a program's ops as the executor runs them, simulated:
  `lanes` threads each run one op at a time, taking the ready op that
  became ready first (what the thread that readied it runs next, first);
  ops that allocate nothing run at once. An op's outputs are allocated when
  it starts and its inputs freed when it ends, after a time of the bytes
  it reads and writes (the executor's kernels are mostly memory-bound). A
  tensor is freed after its last reader, or at once if nothing reads it,
  but for those `held` (the call's outputs), which stay."""

  def __init__(self, program, held, lanes):
    self.program = program
    self.held = held
    self.lanes = lanes
    self.readers = collections.Counter(
        k for node in program.nodes for k in node.inputs)
    self.buffer_of, self.size, self.refs = {}, {}, collections.Counter()
    self.live = 0
    self.top = 0
    self.work = 0  # The bytes every op read and wrote, summed.
    deps = program.dependencies()
    self._allocating = [any(n for _, n, _ in node.outputs) or
                        node.transient > 0 for node in program.nodes]
    self._waiting = [len(d) for d in deps]
    self._users = [[] for _ in deps]
    for i, d in enumerate(deps):
      for j in d:
        self._users[j].append(i)

  def peak(self):
    """The largest live bytes; call once."""
    nodes = self.program.nodes
    ready = collections.deque(i for i, w in enumerate(self._waiting)
                              if not w)
    running = []  # (end time, order, node index)
    now, top, order, busy = 0, 0, 0, 0
    while ready or running:
      ready = self._run_free(ready)
      top = max(top, self.live)
      while ready and busy < self.lanes:
        i = ready.popleft()
        self._allocate(nodes[i])
        top = max(top, self.live + nodes[i].transient)
        order += 1
        cost = self._cost(nodes[i])
        self.work += cost
        heapq.heappush(running, (now + 1 + cost, order, i))
        busy += 1
      if running:
        now, _, i = heapq.heappop(running)
        busy -= 1
        ready.extendleft(reversed(self._finish(i)))
    self.top = top
    return top

  def _run_free(self, ready):
    """`ready` after running every op in it that allocates nothing (and
    those they make ready), in order."""
    left = collections.deque()
    while ready:
      i = ready.popleft()
      if self._allocating[i]:
        left.append(i)
        continue
      self._allocate(self.program.nodes[i])
      ready.extendleft(reversed(self._finish(i)))
    return left

  def _finish(self, i):
    """Frees what op `i` was the last to read; the ops it made ready."""
    self._release(self.program.nodes[i])
    made = []
    for j in self._users[i]:
      self._waiting[j] -= 1
      if not self._waiting[j]:
        made.append(j)
    return sorted(made)

  def _cost(self, node):
    return sum(n for _, n, _ in node.outputs) + sum(
        self.size.get(self.buffer_of.get(k), 0) for k in node.inputs)

  def _allocate(self, node):
    lent, into = None, _FORWARDED_OUTPUT.get(node.type, 0)
    if (node.type in _FORWARDING or node.type in _FORWARDED_OUTPUT) and (
        len(node.outputs) > into and node.outputs[into][1]):
      lent = next((b for b in (self.buffer_of.get(k) for k in node.inputs)
                   if b is not None and self.refs[b] == 1 and
                   self.size.get(b) == node.outputs[into][1]), None)
    for j, (key, n, alias) in enumerate(node.outputs):
      if j == into and lent is not None:
        buffer = lent
      elif alias is not None and alias in self.buffer_of:
        buffer = self.buffer_of[alias]
      else:
        buffer = key
        self.size[buffer] = n
        self.live += n
      self.buffer_of[key] = buffer
      self.refs[buffer] += self.readers[key] + (key in self.held)

  def _release(self, node):
    for key in node.inputs:
      self._drop(key)
    for key, _, _ in node.outputs:
      buffer = self.buffer_of[key]
      if not self.refs[buffer] and buffer in self.size:
        self.live -= self.size.pop(buffer)

  def _drop(self, key):
    buffer = self.buffer_of.get(key)
    if buffer is None:
      return
    self.refs[buffer] -= 1
    if not self.refs[buffer] and buffer in self.size:
      self.live -= self.size.pop(buffer)
