"""The largest batch whose training step fits a memory size, and the model to
train at it: `tfremat.largest_batch`.

A step's peak grows about linearly with the batch. The ways that peak lowest
(every layer rematerialized; the planner's lowest plan, nested too) are each
measured at two batches, and probes of a few calls from where each one's
line meets the memory find its largest batch (to a multiple); every layer
rematerialized first, and each way after it starts one multiple above the
best batch so far. At
the largest batch found, the ways that came near it are timed, and checked
fastest first as a planned budget is (lower, where none fits): the first
that fits is returned.
Every way is judged by the same rule as a planned budget: its bound
(`tfremat.planner.Measured`: the largest peak of `Settings.check_calls`
steps, plus their spread, plus the reserve) within the memory, on a step
traced for that batch, as a step called on tensors of one shape is (a step
traced for any batch size can peak lower).
"""

import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

from tfremat import errors
from tfremat._src.planning import measure
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import chain_layers
from tfremat._src.planning import chain_measure
from tfremat._src.planning import cost_model
from tfremat._src.keras_api import in_place
from tfremat._src.keras_api import layers as layers_lib
from tfremat._src.planning import search
from tfremat._src import units
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import keep_all
from tfremat._src.planning.cost_model import uniform_segments
from tfremat._src.planning.plan import Plan

__all__ = [
    "largest_batch",
    "LargestBatch",
    "BatchTrial",
    "search_batch",
    "resized",
]


@dataclasses.dataclass(frozen=True)
class BatchTrial:
  """One measurement of `largest_batch`: a way of training ("none",
  "full", the planner's "lowest" plan or that plan "nested") at a batch,
  its bound over every call measured there so far (a
  `tfremat.planner.Measured`), and whether it fits."""
  way: str
  batch: int
  measured: object
  fits: bool


@dataclasses.dataclass(frozen=True)
class LargestBatch:
  """What `largest_batch` found.

  Attributes:
    batch: the largest batch whose training step fits the memory (0 when
      none does).
    model: what to train at it: the model (or chain) rematerialized as
      `method` says; None when nothing fits.
    method: "none" (no rematerialization fits), "full" (every layer, as
      `remat_model(model, "full")` or every block of a chain), or
      "planner" (the plan the planner predicts to peak lowest, nested or
      not; its chain's `.plan` says which).
    measured: its `tfremat.planner.Measured` at that batch.
    memory_bytes: the memory given, in bytes.
    examples_per_second: its measured speed at that batch (None when only
      one method fits and nothing was timed).
    trials: every `BatchTrial`, in the order measured.
    seconds: how long the search took.
  """
  batch: int
  model: object
  method: str
  measured: object
  memory_bytes: int
  examples_per_second: float = None
  trials: tuple = ()
  seconds: float = 0.0

  def __str__(self):
    mib = units.format_bytes
    if not self.batch:
      return (f"no batch fits {mib(self.memory_bytes)}, even of 1 with every "
              "layer rematerialized")
    speed = (f", {self.examples_per_second:.1f} examples/s"
             if self.examples_per_second else "")
    how = {"none": "no rematerialization", "full": "every layer "
           "rematerialized", "planner": "the planner's lowest plan"}
    return (f"batch {self.batch}, {how[self.method]}: bound "
            f"{mib(self.measured.bound_bytes)} within "
            f"{mib(self.memory_bytes)}{speed} ({len(self.trials)} "
            f"measurements, {self.seconds:.0f} s)")


def resized(sample, batch):
  """`sample` (a tensor, or a structure of them, batched along axis 0) with
  `batch` examples: its own repeated and cut."""
  def one(t):
    t = tf.convert_to_tensor(t)
    repeats = -(-batch // int(t.shape[0]))
    tiled = tf.tile(t, [repeats] + [1] * (t.shape.rank - 1))
    return tiled[:batch]
  return tf.nest.map_structure(one, sample)


def largest_batch(model, memory, sample_input, *, multiple=None,
                  policies=policies_lib.PLANNED,
                  settings=search.DEFAULT_SETTINGS, verbose=1,
                  timing_rounds=3):
  """The largest batch whose training step fits `memory`, and the
  rematerialized model that trains fastest per example at it.

    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((256,))
    for _ in range(6):
      x = x + keras.layers.Dense(256)(keras.layers.Dense(1024, activation="gelu")(x))
    model = keras.Model(inputs, keras.layers.Dense(10)(x))

    found = tfremat.largest_batch(model, "64MiB", tf.random.normal([128, 256]),
                                  verbose=0)
    print(found)
    found.model.compile(optimizer="adam", loss="mse")  # Train this at found.batch.

  (docs/guide.md, "The largest batch for your memory: `largest_batch`",
  runs this example and shows what it prints.)

  A step's peak grows about linearly with the batch. The ways that peak
  lowest are each measured at the sample's batch and twice it: every layer
  rematerialized (`remat_model(model, "full")`, or every block of a chain),
  and the plan the planner predicts to peak lowest, on the layers' costs
  measured at the sample's batch, nested too where the layers have layers
  of their own (`tfremat.planner`). From where each one's line meets
  `memory`, probes of a few calls find the largest batch it fits (each
  where the line through the two probes nearest the memory meets it):
  every layer rematerialized first, and each way after it first one
  multiple above the largest batch found so far, and not further if it is
  over there. At the
  largest batch of all, every way whose search came within 4% of it
  (keeping everything too, where its line nearly reaches it) is timed, and
  checked fastest first as a planned budget is: the first that fits is
  returned (where none fits, the same at a batch a little lower). At that
  batch the memory leaves no room for a plan that keeps more: the planner
  would choose among the same lowest plans. The batch is the largest
  multiple of `multiple` that fits.

  Every way is judged as a planned budget is: its bound (the largest peak
  of `settings.check_calls` steps, plus their spread, plus the reserve)
  within `memory`, on a step traced for that batch, as a `tf.function`
  called on tensors of one shape is (one traced for any batch size peaked
  0.88x of that on the bench's MLP). A step's peak is what
  `tfremat.measure.peak_bytes` counts: the tensors a training step
  allocates, beyond the weights and the batch.

  Args:
    model: a built `keras.Sequential` or functional `keras.Model` (a
      KerasHub backbone, a `keras.applications` CNN), or a chain: a list of
      Keras layers, each taking the previous one's output.
    memory: the memory for a training step's peak: bytes, or a string with
      a unit ("512MiB").
    sample_input: a batch like those it will train on; batches of other
      sizes repeat and cut it along its first axis.
    multiple: batches are multiples of this; None: about 1% of the largest
      batch first predicted, rounded down to a power of two.
    policies: the save policies the planner's costs are measured under
      (as for `remat_model`).
    settings: the planner's `tfremat.planner.Settings`.
    verbose: 1 shows a progress bar; 2 a line per measurement; 0 nothing.
    timing_rounds: rounds of timing at the batch found, each calling every
      way that fits there once.

  Returns:
    A `LargestBatch`: `batch`, `model` (train this at `batch`), `method`,
    its measured bound, its examples per second, and every measurement.

  Raises:
    TypeError, ValueError: a model it cannot take, a memory that is not
      bytes, a bad multiple; raised before anything is measured.
  """
  memory_bytes = Budget.parse(memory).num_bytes
  if memory_bytes is None:
    raise errors.InvalidArgumentError(
        f"largest_batch: memory is bytes or a string with a unit "
        f"(\"512MiB\"), not a fraction; got {memory!r}.")
  if multiple is not None and (isinstance(multiple, bool) or
                               not isinstance(multiple, int) or multiple < 1):
    raise errors.InvalidArgumentError(
        f"largest_batch: multiple is a positive int or None; got "
        f"{multiple!r}.")
  policies = _chain().planned_policies(policies)
  finder = _BatchSearch(_Ways(model, policies, settings), sample_input,
                        memory_bytes, settings, verbose)
  with _chain().retracing_quiet():
    return finder.run(multiple, timing_rounds)


class _BatchSearch:
  """`largest_batch`'s measurements, in the order it makes them."""

  def __init__(self, ways, sample_input, memory_bytes, settings, verbose):
    self.ways = ways
    self.sample_input = sample_input
    self.memory_bytes = memory_bytes
    self.settings = settings
    self.verbose = verbose
    self.first = int(tf.nest.flatten(sample_input)[0].shape[0])
    self.progress = measure.progress_bar(12, "measurement", verbose == 1)
    self.trials = []
    self.peaks = {}  # (way, batch) -> the peaks of every call there.
    self.start = time.perf_counter()

  def note(self, line):
    if self.verbose == 2:
      print(f"largest_batch: {line} "
            f"({time.perf_counter() - self.start:.0f} s)", flush=True)

  def bound_at(self, way, batch, calls=1):
    """The way's `Measured` at `batch` after `calls` more calls there: over
    every call measured at that batch."""
    peaks = self.peaks.setdefault((way, batch), [])
    peaks += self.ways.peaks(way, resized(self.sample_input, batch), calls)
    measured = search.Measured.of(peaks, self.settings.reserve)
    fits = measured.bound_bytes <= self.memory_bytes
    self.trials.append(BatchTrial(way, batch, measured, fits))
    self.note(f"{way} at batch {batch}: bound "
              f"{units.format_bytes(measured.bound_bytes)} over "
              f"{len(peaks)} call(s), {'fits' if fits else 'over'}")
    _advance(self.progress)
    return measured

  def checked(self, way, batch):
    """The way's `Measured` at `batch` over `settings.check_calls` calls,
    as a planned budget is checked: a few first, and the rest only if
    those fit."""
    calls = self.settings.check_calls
    done = self.peaks.get((way, batch), [])
    if len(done) < min(3, calls):
      measured = self.bound_at(way, batch, calls=min(3, calls) - len(done))
    else:
      measured = search.Measured.of(done, self.settings.reserve)
    if measured.bound_bytes <= self.memory_bytes and len(done) < calls:
      measured = self.bound_at(way, batch,
                               calls=calls - len(self.peaks[(way, batch)]))
    return measured

  def run(self, multiple, timing_rounds):
    """The `LargestBatch`."""
    self.ways.add_planned(self.sample_input)
    self.note(f"the layers' costs measured at batch {self.first}")
    lines = {}
    for way in self.ways.names:
      lines[way] = _line(self.bound_at, way, self.first)
      if way not in ("none", "full") and lines[way] == lines["full"]:
        del lines[way]  # The same peaks as "full" (a CNN's groups nested).
    reach = {w: _meets(line, self.memory_bytes, default=0)
             for w, line in lines.items()}
    lowest = [w for w in lines if w != "none"]
    top = max(reach[w] for w in lowest)
    if multiple is None:
      multiple = 1 << max(0, int(np.log2(max(1.0, 0.01 * top))))
    found = {}  # Way -> the largest batch found to fit (or, for a way
    # over one multiple above the best so far, that best: checked later).
    # Every layer rematerialized first (it fits the most where no plan does
    # better, and the lines of ways that peak alike can rank them wrongly),
    # then the others, each from one multiple above the best so far.
    for way in sorted(lowest, key=lambda w: (w != "full", -reach[w])):
      if reach[way] >= 0.9 * top:  # Else its line meets the memory well
        found[way] = self.largest_of(  # below another's.
            way, reach[way], multiple, max(found.values(), default=0))
    batch = max(found.values(), default=0)
    # The ways that came near `batch` (and keeping everything, where its
    # line nearly reaches it) are timed there, and checked fastest first
    # as a planned budget is: the first that fits is returned.
    near = [w for w, b in found.items() if batch and b >= 0.96 * batch]
    if batch and reach["none"] >= 0.95 * batch:
      near.append("none")
    batch, chosen, measured, speed = self.held(near, batch, multiple,
                                               timing_rounds)
    _finish(self.progress)
    return LargestBatch(
        batch if chosen else 0,
        self.ways.result(chosen, batch, self.memory_bytes, measured)
        if chosen else None, self.ways.method(chosen) if chosen else "none",
        measured, self.memory_bytes, speed, tuple(self.trials),
        time.perf_counter() - self.start)

  def largest_of(self, way, reach, multiple, best=0):
    """The largest multiple of `multiple` at which `way`'s bound over a few
    calls fits, searched from where its line meets the memory (`reach`),
    each probe where the line through the two nearest the memory meets it;
    0 if even `multiple` does not fit. Where another way fits `best`, the
    first probe is one multiple above it, and if that is over, `best` is
    returned unmeasured: whether the way fits there is for `held`."""
    known = {b: search.Measured.of(p, self.settings.reserve).bound_bytes
             for (w, b), p in self.peaks.items() if w == way}
    first = max(multiple, int(reach))
    if best:
      first = best + multiple
      known[first] = self.bound_at(way, first, calls=3).bound_bytes
      if known[first] > self.memory_bytes:
        return best
    batch, _ = search_batch(
        lambda b: (known[b] if b == first and best else
                   self.bound_at(way, b, calls=3).bound_bytes),
        self.memory_bytes, first, multiple, max_probes=6, known=known)
    return batch

  def over_at_or_below(self, way, batch):
    """Whether `way` was measured over the memory at `batch` or below it
    (and so does not fit `batch`)."""
    return any(w == way and b <= batch and
               search.Measured.of(p, self.settings.reserve).bound_bytes >
               self.memory_bytes for (w, b), p in self.peaks.items())

  def held(self, ways, batch, multiple, timing_rounds):
    """(batch, way, its Measured, its examples per second or None): at
    `batch`, or where none fits the largest below it aimed at from their
    bounds, the fastest per example of `ways` that fits over
    `settings.check_calls` calls. The ways are timed first (when there are
    several) and checked fastest first, so the slower ones are not checked
    when a faster one fits. (0, None, None, None) if none fits."""
    for _ in range(4):
      if batch < 1 or not ways:
        break
      candidates = [w for w in ways if not self.over_at_or_below(w, batch)]
      if not candidates:
        break
      speeds = self.timed(candidates, batch, timing_rounds)
      checks = {}
      for way in sorted(candidates, key=lambda w: -speeds.get(w, 0)):
        if speeds and way not in speeds:
          continue  # It ran out of memory at this batch.
        checks[way] = self.checked(way, batch)
        if checks[way].bound_bytes <= self.memory_bytes:
          return batch, way, checks[way], speeds.get(way)
      if not checks:
        break
      batch = min(max(_aimed(batch, m, self.memory_bytes, multiple)
                      for m in checks.values()), batch - multiple)
    return 0, None, None, None

  def timed(self, ways, batch, timing_rounds):
    """{way: examples per second at `batch`} of `ways` when there are
    several (else {}); a way whose step runs out of memory there is left
    out."""
    if len(ways) < 2:
      return {}
    x = resized(self.sample_input, batch)
    running = []
    for way in ways:
      try:
        self.ways.warm(way, x)
        running.append(way)
      except tf.errors.ResourceExhaustedError:
        pass
    times = measure.median_seconds(
        [self.ways.step(w) for w in running], x, repeats=timing_rounds,
        warmup=False)
    self.note(f"timed at batch {batch}: " + ", ".join(
        f"{w} {1000 * t:.0f} ms" for w, t in zip(running, times)))
    return {w: batch / t for w, t in zip(running, times)}


def _aimed(batch, measured, memory_bytes, multiple):
  """The batch (a multiple) at which a bound in proportion to `measured`'s
  at `batch` is a little below the memory."""
  scaled = batch * memory_bytes / max(1, measured.bound_bytes) * 0.99
  return max(multiple, int(scaled) // multiple * multiple)


def _line(bound_at, way, first):
  """(slope, intercept) of the way's bound over the batch, from the
  sample's batch and twice it."""
  low, high = bound_at(way, first), bound_at(way, 2 * first)
  slope = (high.bound_bytes - low.bound_bytes) / first
  return slope, low.bound_bytes - slope * first


def _meets(line, memory_bytes, default=None):
  """The batch at which the line meets the memory, or `default`."""
  slope, intercept = line
  if slope <= 0:
    return default
  return (memory_bytes - intercept) / slope


def _advance(progress):
  if progress is not None:
    progress.add(1)


def _finish(progress):
  if progress is not None:
    progress.update(max(progress.target, progress._seen_so_far),  # pylint: disable=protected-access
                    finalize=True)


def _bound(measured):
  return None if measured is None else measured.bound_bytes


class _Ways:
  """The ways `largest_batch` trains a model, each made once (its step
  takes any batch): "none", "full", and the planner's lowest plan
  ("lowest") and that plan nested ("nested") where they differ from
  "full"."""

  def __init__(self, model, policies, settings):
    # pylint: disable-next=g-import-not-at-top
    from tfremat._src.keras_api import remat_model as remat_model_lib
    self.policies = policies
    self.settings = settings
    if isinstance(model, keras.Model):
      layers_lib.refuse_keras2(model, "largest_batch")
      self.planning = remat_model_lib.ModelPlanning(model)
      self.layers = self.planning.units
      self.made = {"none": model,
                   "full": remat_model_lib.remat_model(model, "full")}
    else:
      self.planning = None
      self.layers = layers_lib.keras_layers(model, "largest_batch",
                                            chain=True)
      n = len(self.layers)
      self.made = {
          "none": chain_layers.RematSequential(self.layers, keep_all(n)),
          "full": chain_layers.RematSequential(self.layers,
                                               uniform_segments(n, n))}
    self.names = ["none", "full"]
    self.plans = {}
    self.costs = None
    self._first = None
    self._steps = {}
    self._sizes = {}

  def add_planned(self, sample_input):
    """Measures the layers' costs at the sample's batch, and adds the
    planner's lowest plan, and that plan nested, where they are not what
    "full" runs."""
    self._first = int(tf.nest.flatten(sample_input)[0].shape[0])
    if self.planning is not None:
      self.costs = self.planning.measure_costs(sample_input, self.policies,
                                               self.settings)
    else:
      self.costs = _chain().measure_chain(
          self.layers, sample_input, policies=self.policies,
          waiting_fraction=self.settings.waiting_fraction)
    n = len(self.layers)
    lowest = list(search.lowest_plan(self.costs).segments)
    nestable = [in_place.can_nest(chain_layers.nest_target(l))
                for l in self.layers]
    nested = cost_model.nested_segments(lowest, nestable)
    alone = uniform_segments(n, n)
    for name, segments in (("lowest", lowest), ("nested", nested)):
      if not segments or segments == alone:
        continue  # What "full" runs.
      if any(segments == p.segments for p in self.plans.values()):
        continue
      plan = Plan(self.costs, segments)
      self.plans[name] = plan
      layer = chain_layers.apply_plan(self.layers, plan)
      self.made[name] = (layer if self.planning is None else
                         self.planning.parts.model_with(layer))
      self.names.append(name)

  def step(self, way):
    """A training step of the way, traced for each batch size it is called
    with, as a step called on tensors of one shape is."""
    if way not in self._steps:
      self._steps[way] = chain_measure.training_step(self.made[way])
    return self._steps[way]

  def peaks(self, way, x, calls):
    """The step's peaks over `calls` calls on `x` (none for 0), after one
    call unmeasured at a batch size new to it, which traces it."""
    if not calls:
      return []
    self.warm(way, x)
    return measure.peaks(self.step(way), x, calls=calls, warmup=False)

  def warm(self, way, x):
    """Calls the way's step on `x` once, unmeasured, if its batch size is
    new to the step (which traces it for that size)."""
    batch = int(tf.nest.flatten(x)[0].shape[0])
    sizes = self._sizes.setdefault(way, set())
    if batch not in sizes:
      measure.wait_for(self.step(way)(x))
      sizes.add(batch)

  def method(self, way):
    return "planner" if way in self.plans else way

  def result(self, way, batch, memory_bytes, measured):
    """The model to train; a planner's plan is kept on its chain, with its
    costs at `batch`, the memory as its budget and its bound."""
    if way not in self.plans:
      return self.made[way]
    plan = Plan([c.scaled(batch / self._first) for c in self.costs],
                self.plans[way].segments, memory_bytes,
                Budget(num_bytes=memory_bytes), measured=measured)
    layer = chain_layers.apply_plan(self.layers, plan)
    if self.planning is None:
      return layer
    return self.planning.parts.model_with(layer)


def _chain():
  # pylint: disable-next=g-import-not-at-top
  from tfremat._src.planning import chain_plan as chain
  return chain


def search_batch(bound_at, memory_bytes, first, multiple=1, max_probes=10,
                 known=None):
  """The largest batch (a multiple of `multiple`) whose bound fits.

  Bounds grow with the batch about linearly, so each probe after the first
  two is where the line through the two probes nearest the memory meets
  it, kept strictly between the largest batch known to fit and the smallest
  known not to (halfway, when the line points outside).

  Args:
    bound_at: batch -> the bound bytes of a training step at that batch, or
      None where no step is made at that batch (a budget the planner
      refuses there).
    memory_bytes: the memory.
    first: the batch to probe first.
    multiple: batches probed are multiples of it.
    max_probes: at most this many probes.
    known: {batch: bound or None} already measured (not multiples, say),
      used for the line but not as answers.

  Returns:
    (batch, probes): the largest batch found to fit (0 if none did), and
    {batch: bound bytes or None} for every batch probed.
  """
  probes = {}
  line = dict(known or {})
  low, high = 0, None  # The largest batch that fits; the smallest that not.
  batch = max(multiple, first // multiple * multiple)
  while len(probes) < max_probes:
    probes[batch] = line[batch] = bound_at(batch)
    fits = probes[batch] is not None and probes[batch] <= memory_bytes
    if fits:
      low = max(low, batch)
    else:
      high = batch if high is None else min(high, batch)
    if high is not None and high - low <= multiple:
      break
    batch = _next_probe(line, low, high, memory_bytes, multiple)
  return low, probes


def _next_probe(probes, low, high, memory_bytes, multiple):
  """Where the line through the two measured probes nearest the memory
  meets it, if that lies between `low` and `high`; else twice `low` (no
  batch known not to fit yet) or the middle."""
  measured = sorted((b for b, p in probes.items() if p is not None),
                    key=lambda b: abs(probes[b] - memory_bytes))[:2]
  guess = None
  if len(measured) == 2:
    (b1, b2) = measured
    slope = (probes[b2] - probes[b1]) / (b2 - b1)
    if slope > 0:
      guess = int(b1 + (memory_bytes - probes[b1]) / slope)
  if high is None:
    guess = 2 * low if guess is None else min(guess, 4 * max(low, multiple))
    guess = max(guess // multiple * multiple, low + multiple)
  elif guess is None or not low < guess < high:
    guess = (low + high) // 2
  if high is not None:
    guess = min(max(guess // multiple * multiple, low + multiple),
                high - multiple)
  return max(multiple, guess)
