"""The largest batch whose training fits a memory size, and the model to
train at it: `tfremat.largest_batch`.

The memory counts the weights, the optimizer's state (for a compiled model
given targets), the batch, and the step's own tensors. The
cost model, scaled by measurements at the sample's batch (every layer
rematerialized; the nested plan by its own, as the cost model counts
nesting as not nested), predicts the largest batch each way fits: every
layer rematerialized, the planner's lowest plan, that plan nested and run
in one op order, keeping everything. Every layer rematerialized is
searched from its prediction, each probe where the line through the two
nearest the memory meets it; each other way predicted to fit clearly more
from one multiple above the best so far. At the largest batch found, the
ways that fit there are timed and checked fastest first by the one rule of
a planned budget (`search.checked_peaks`); the first that fits is returned.
"""

import dataclasses
import time

import keras
import numpy as np
import tensorflow as tf

from tfremat import errors
from tfremat._src import measuring as measure
from tfremat._src import units
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import in_place
from tfremat._src.keras_api import layers as layers_lib
from tfremat._src.keras_api.chain_layers import nest_target
from tfremat._src.keras_api.layers import refuse_keras2
from tfremat._src.keras_api.segments import keep_all
from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning import apply
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning import cost_model
from tfremat._src.planning import proposals
from tfremat._src.planning import search
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.cost_model import predict
from tfremat._src.planning.plan import Measured
from tfremat._src.planning.plan import Plan
from tfremat._src.planning.runner import ChainRunner
from tfremat._src.api import remat_model as remat_model_lib

__all__ = [
    "largest_batch",
    "LargestBatch",
    "BatchTrial",
    "BatchSearch",
    "Ways",
    "ways_of",
    "search_batch",
]


@dataclasses.dataclass(frozen=True)
class BatchTrial:
  """One measurement of `largest_batch`: a way of training ("none",
  "full", the planner's "lowest" plan or that plan "nested") at a batch,
  its step's bound over every call measured there so far (a
  `tfremat.planner.Measured`), what training held besides it, and
  whether the two fit the memory."""
  way: str
  batch: int
  measured: object
  held_bytes: int
  fits: bool


@dataclasses.dataclass(frozen=True)
class LargestBatch:
  """What `largest_batch` found.

  Attributes:
    batch: the largest batch whose training fits the memory (0 when none
      does).
    model: what to train at it: the model (or chain) rematerialized as
      `method` says, compiled as the given model was; None when nothing
      fits.
    method: "none" (no rematerialization is needed), "full" (every layer,
      or every block of a chain), "planner" (the plan the planner predicts
      to peak lowest, nested or not; its chain's `.plan` says which), or
      None when nothing fits (`fits` is then False).
    measured: the step's `tfremat.planner.Measured` at that batch.
    held: what training holds besides the step at that batch
      (`tfremat.planner.Held`: weights, optimizer state, batch).
    memory_bytes: the memory given, in bytes: `held` plus the step's bound
      fit within it.
    step: which training step was measured ("train_on_batch" or
      "stand-in").
    examples_per_second: its measured speed at that batch (None when only
      one method fits and nothing was timed).
    trials: every `BatchTrial`, in the order measured.
    seconds: how long the search took.
    multiple: the batches searched were multiples of this.
  """
  batch: int
  model: object
  method: str
  measured: object
  held: object
  memory_bytes: int
  step: str
  examples_per_second: float = None
  trials: tuple = ()
  seconds: float = 0.0
  multiple: int = 1

  @property
  def fits(self):
    """Whether some batch fits the memory."""
    return self.method is not None

  def __str__(self):
    mib = units.format_bytes
    if not self.fits:
      return (f"no batch of {self.multiple} or more fits "
              f"{mib(self.memory_bytes)}, even with every layer "
              f"rematerialized ({len(self.trials)} measurements, "
              f"{self.seconds:.0f} s)")
    speed = (f", {self.examples_per_second:.1f} examples/s"
             if self.examples_per_second else "")
    how = {"none": "no rematerialization", "full": "every layer "
           "rematerialized", "planner": "the planner's lowest plan"}
    # The way found is the one checked last, a chain's or a whole model's.
    nested = ", nested" if self.trials[-1].way == "nested" else ""
    return (f"batch {self.batch}, {how[self.method]}{nested}: held "
            f"{mib(self.held.total_bytes)} + the step's bound "
            f"{mib(self.measured.bound_bytes)} within "
            f"{mib(self.memory_bytes)} ({self.step} step){speed} "
            f"({len(self.trials)} measurements, {self.seconds:.0f} s)")


def largest_batch(model, memory, sample_input, *, sample_target=None,
                  multiple=None, policies=policies_lib.PLANNED,
                  settings=search.DEFAULT_SETTINGS, verbose=1,
                  timing_rounds=3):
  """The largest batch whose training fits `memory`, and the
  rematerialized model that trains fastest per example at it.

    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((256,))
    for _ in range(6):
      x = x + keras.layers.Dense(256)(keras.layers.Dense(1024, activation="gelu")(x))
    model = keras.Model(inputs, keras.layers.Dense(10)(x))
    model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = tf.random.normal([128, 256]), tf.zeros([128], tf.int32)

    found = tfremat.largest_batch(model, "96MiB", x, sample_target=y, verbose=0)
    print(found)
    data = tf.random.normal([4 * found.batch, 256]), tf.zeros([4 * found.batch], tf.int32)
    found.model.fit(*data, batch_size=found.batch, verbose=0)  # Compiled as model was.

  (docs/guide.md, "The largest batch for your memory: `largest_batch`",
  runs this example and shows what it prints.)

  `memory` counts everything training holds: the weights, the optimizer's
  state (with `sample_target`), the batch and the training step's own
  tensors (`LargestBatch.held` and `.measured` split it). The ways it
  chooses among: every layer rematerialized (every unit of the model's
  chain, as `remat_model(model, "full")` groups them, or every block of a
  chain), the plan the planner predicts to peak lowest on the layers'
  costs measured at the sample's batch, that plan nested where the layers
  have layers of their own, run in one op order (`settings.try_ordered`:
  unordered, a nested plan's peak moved on later calls past every call
  checked), and keeping everything.
  Every layer rematerialized, and the plan with nested layers, are
  measured at the sample's batch; the cost model, scaled by those
  measurements (its own for the nested plan, which the cost model counts
  as not nested), predicts the largest batch each way fits. Every layer
  rematerialized is searched from its prediction, each probe where the
  line through the two probes nearest the memory meets it, to the largest
  multiple of `multiple` it fits; each other way predicted to fit
  `settings.near_batch` more is probed one multiple above the best so far
  and searched further only if it fits there. At the largest batch
  of all, the ways that fit there (and keeping everything, where predicted
  to come within `near_batch` of it) are timed, and checked fastest first:
  the first that fits is returned (where none fits, the same lower down,
  with every way found to fit there).

  Every way is judged as a planned budget is (`tfremat.planner.Settings`:
  `first_calls` steps, then `check_calls` where those fit): the step's
  bound (its largest peak, plus their spread, plus the reserve) plus what
  is held within `memory`, on a step traced for that batch, as a
  `tf.function` called on tensors of one shape is.

  Args:
    model: a built `keras.Sequential` or functional `keras.Model` (a
      KerasHub backbone, a `keras.applications` CNN), or a chain: a list of
      Keras layers, each taking the previous one's output.
    memory: the memory for training: bytes, or a string with a unit
      ("512MiB").
    sample_input: a batch like those it will train on; batches of other
      sizes repeat and cut it along its first axis.
    sample_target: the targets of `sample_input`, for a compiled `model`:
      every way is measured on its own `train_on_batch`, the model's loss
      and its optimizer's update, whose state the memory then counts.
      Without it, on the stand-in step (the gradient of sum(y**2)/2 of the
      outputs, no optimizer).
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
    what is held and the step's measured bound, its examples per second,
    and every measurement.

  Raises:
    TypeError, ValueError: a model it cannot take, a memory that is not
      bytes, a bad multiple, a `sample_target` for a model that is not
      compiled; raised before anything is measured.
  """
  memory_bytes = Budget.parse(memory).num_bytes
  if memory_bytes is None:
    raise errors.InvalidArgumentError(
        f"largest_batch: memory is bytes or a string with a unit "
        f"(\"512MiB\"), not a fraction; got {memory!r}.")
  if multiple is not None and (isinstance(multiple, bool) or
                               not isinstance(multiple, int) or multiple < 1):
    raise errors.InvalidArgumentError(
        f"largest_batch: multiple is a positive int or None; got {multiple!r}.")
  policies = budget_lib.planned_policies(policies)
  ways = ways_of(model, sample_target)
  finder = BatchSearch(ways, budget_lib.sample_batch(sample_input,
                                                      sample_target),
                        memory_bytes, settings, verbose)
  with budget_lib.retracing_quiet():
    return finder.run(multiple, timing_rounds, policies)


@dataclasses.dataclass(frozen=True)
class Ways:
  """What `largest_batch` trains: its units, how a batch reaches them, the
  runner of their steps (`runner.Runner`), and how a plan becomes the
  model returned. `costs` and `nestable`, where given, stand for the
  units' profile and whether each has layers of its own to nest (a test's
  stand-ins); else they are measured and read from the units."""
  units: tuple
  chain: budget_lib.Chain
  runner: object
  model: object = None
  parts: object = None
  costs: tuple = None
  nestable: tuple = None

  def result(self, candidate):
    """The model (or chain) to train, run as `candidate` says, compiled as
    the given model was."""
    layer = apply.apply_plan(list(self.units), candidate,
                             chain=self.parts, **(
                                 {"name": f"{self.model.name}_chain"}
                                 if self.model is not None else {}))
    return (layer if self.model is None else
            apply.compiled_like(layer, self.model))


def ways_of(model, sample_target):
  if isinstance(model, keras.Model):
    refuse_keras2(model, "largest_batch")
    parts, units = remat_model_lib.model_chain_of(model, "largest_batch")
    runner, chain = remat_model_lib.model_runner(
        model, parts, units, sample_target, "largest_batch")
    return Ways(tuple(units), chain, runner, model, parts)
  if sample_target is not None:
    raise errors.InvalidArgumentError(
        "largest_batch: sample_target is for a compiled keras.Model, whose "
        "train_on_batch it measures; a chain of layers is measured on its "
        "stand-in step.")
  layers = layers_lib.keras_layers(model, "largest_batch", chain=True)
  return Ways(tuple(layers), budget_lib.Chain(tuple(layers)),
               ChainRunner(layers))


class BatchSearch:
  """`largest_batch`'s measurements, in the order it makes them."""

  def __init__(self, ways, sample, memory_bytes, settings, verbose):
    self.ways = ways
    self.sample = sample
    self.memory_bytes = memory_bytes
    self.settings = settings
    self.verbose = verbose
    self.progress = measure.progress_bar(12, "measurement", verbose == 1)
    self.trials = []
    self.peaks = {}  # (way, batch) -> the peaks of every call there.
    self.candidates = {}  # Way -> Candidate.
    self.plans = {}  # Way -> the planner's Plan, for "lowest" and "nested".
    self.start = time.perf_counter()

  def note(self, line):
    if self.verbose == 2:
      print(f"largest_batch: {line} "
            f"({time.perf_counter() - self.start:.0f} s)", flush=True)

  def held_at(self, batch):
    return self.ways.runner.held(self.sample.resized(batch))

  def bound_at(self, way, batch, probe=True):
    """The way's `Measured` at `batch`, over every call measured there: a
    probe's first calls, or (not `probe`) checked by the one rule of a
    planned budget (`search.checked_peaks`)."""
    held = self.held_at(batch).total_bytes
    peaks = self.peaks[way, batch] = search.checked_peaks(
        self.ways.runner, self.candidates[way], self.sample.resized(batch),
        self.memory_bytes - held, self.settings,
        done=self.peaks.get((way, batch), ()), probe=probe)
    measured = Measured.of(peaks, self.settings.reserve)
    fits = measured.bound_bytes + held <= self.memory_bytes
    self.trials.append(BatchTrial(way, batch, measured, held, fits))
    self.note(f"{way} at batch {batch}: held {units.format_bytes(held)} + "
              f"bound {units.format_bytes(measured.bound_bytes)} over "
              f"{len(peaks)} call(s), {'fits' if fits else 'over'}")
    if self.progress is not None:
      self.progress.add(1)
    return measured

  def total_at(self, way, batch):
    """Held plus the way's bound at `batch` (a few calls)."""
    return (self.held_at(batch).total_bytes +
            self.bound_at(way, batch).bound_bytes)

  def run(self, multiple, timing_rounds, policies):
    """The `LargestBatch`."""
    first = self.sample.size
    costs = self._add_ways(policies)
    self.note(f"the layers' costs measured at batch {first}")
    # Every layer alone scales each way's prediction; the cost model counts a
    # nested layer as not nested, so a nested way is scaled by its own.
    def scale_of(way):
      segments = list(self.candidates[way].segments)
      return self.bound_at(way, first).bound_bytes / max(
          1, predict(costs, segments)[0])
    scale = scale_of("full")
    scales = {w: scale_of(w) if any(s.nested for s in c.segments) else scale
              for w, c in self.candidates.items()}
    reach = {w: self.predicted(w, costs, first, scales[w])
             for w in self.candidates}
    others = [w for w in self.candidates if w not in ("none", "full")]
    top = max(reach[w] for w in others + ["full"])
    if multiple is None:
      multiple = 1 << max(0, int(np.log2(max(1.0, 0.01 * top))))
    # Every layer rematerialized first, then each other way predicted to
    # fit clearly more than the best so far (by `near_batch`), from one
    # multiple above that best (if over there, it is not better).
    found = {"full": self.largest_of("full", reach["full"], multiple)}
    for way in sorted(others, key=lambda w: -reach[w]):
      best = max(found.values())
      if reach[way] >= (1 + self.settings.near_batch) * best:
        found[way] = self.largest_of(way, reach[way], multiple, best)
    batch = max(found.values())
    # Timed against each other at that batch: the ways measured to fit
    # there, and keeping everything where it is predicted to come within
    # `near_batch` of it.
    near = [w for w in found if self.fits_at(w, batch)]
    if batch and reach["none"] >= (1 - self.settings.near_batch) * batch:
      near.append("none")
    batch, chosen, measured, speed = self.held_ways(near, batch, multiple,
                                                    timing_rounds, found)
    if self.progress is not None:
      self.progress.update(max(self.progress.target,
                               self.progress._seen_so_far),  # pylint: disable=protected-access
                           finalize=True)
    return LargestBatch(
        batch if chosen else 0, self._result(chosen, batch, measured, costs),
        self._method(chosen), measured,
        self.held_at(batch) if chosen else None, self.memory_bytes,
        self.ways.runner.step, speed, tuple(self.trials),
        time.perf_counter() - self.start, multiple)

  def _add_ways(self, policies):
    """Profiles the units at the sample's batch, and adds the ways: keeping
    everything, every unit rematerialized, and the planner's lowest plan
    and that plan nested where they differ from it. Returns the costs."""
    units = list(self.ways.units)
    n = len(units)
    costs = (list(self.ways.costs) if self.ways.costs is not None else
             budget_lib.profiled(self.ways.chain, self.sample, policies,
                                 self.settings))
    alone = uniform_segments(n, n)
    self.candidates = {"none": search.Candidate(keep_all(n)),
                       "full": search.Candidate(alone)}
    lowest = list(proposals.lowest_plan(costs).segments)
    nestable = (list(self.ways.nestable) if self.ways.nestable is not None
                else [in_place.can_nest(nest_target(u)) for u in units])
    nested = cost_model.nested_segments(lowest, nestable)
    for name, segments in (("lowest", lowest), ("nested", nested)):
      if not segments or segments == alone or any(
          c.segments == tuple(segments) for c in self.candidates.values()):
        continue
      candidate = proposals.candidate_for(segments, self.settings)
      self.candidates[name] = candidate
      self.plans[name] = Plan(costs, segments, ordered=candidate.ordered)
    return costs

  def predicted(self, way, costs, first, scale):
    """The largest batch at which the way's step is predicted to fit with
    what is held: the cost model's peak at that batch (its costs grow with
    the batch, its weight gradients do not), times `scale`, every layer
    rematerialized's measured bound at the sample's batch over its
    predicted peak (the part of the step the model does not see, its
    layers outside the chain and its loss, is the same for every way)."""
    segments = list(self.candidates[way].segments)

    def total(batch):
      scaled = [c.scaled(batch / first) for c in costs]
      return (self.held_at(batch).total_bytes +
              scale * predict(scaled, segments)[0])

    if total(1) > self.memory_bytes:
      return 0
    low, high = 1, 2
    while total(high) <= self.memory_bytes and high < 2**24:
      low, high = high, 2 * high
    while high - low > 1:
      middle = (low + high) // 2
      low, high = (middle, high) if total(middle) <= self.memory_bytes else (
          low, middle)
    self.note(f"{way}: predicted to fit batch {low}")
    return low

  def largest_of(self, way, reach, multiple, best=0):
    """The largest multiple of `multiple` at which `way` fits with what is
    held, searched from its predicted batch (`reach`); 0 if even `multiple`
    does not fit. Where another way fits `best`, the first probe is one
    multiple above it, and if that is over, 0 is returned: the way fits no
    more than that best."""
    known = {b: self.held_at(b).total_bytes +
             Measured.of(p, self.settings.reserve).bound_bytes
             for (w, b), p in self.peaks.items() if w == way}
    first = max(multiple, int(reach))
    if best:
      first = best + multiple
      known[first] = self.total_at(way, first)
      if known[first] > self.memory_bytes:
        return 0  # No better than the best: not searched further.
    batch, _ = search_batch(
        lambda b: (known[b] if b == first and best else
                   self.total_at(way, b)),
        self.memory_bytes, first, multiple,
        max_probes=self.settings.batch_probes, known=known)
    return batch

  def fits_at(self, way, batch):
    """Whether `way` was measured at `batch` and fit there."""
    return any(t.way == way and t.batch == batch and t.fits
               for t in self.trials) and not self.over_at_or_below(way, batch)

  def over_at_or_below(self, way, batch):
    """Whether `way` was measured over the memory at or below `batch`."""
    return any(t.way == way and t.batch <= batch and not t.fits
               for t in self.trials)

  def held_ways(self, ways, batch, multiple, timing_rounds, found):
    """(batch, way, its Measured, its examples per second or None): at
    `batch`, or where none fits the largest below it aimed at from their
    bounds or `found` ({way: largest batch}) for another way, the fastest
    per example that fits over `settings.check_calls` calls, of `ways` and
    of each way found to fit that batch. The ways are timed first (when
    there are several) and checked fastest first, so the slower ones are
    not checked when a faster one fits; (0, None, None, None) if none does."""
    for _ in range(4):
      ways = list(ways) + [w for w, b in found.items()
                           if b >= batch and w not in ways]
      candidates = [w for w in ways if batch >= 1 and
                    not self.over_at_or_below(w, batch)]
      if not candidates:
        break
      speeds = self.timed(candidates, batch, timing_rounds)
      checks = {}
      for way in sorted(candidates, key=lambda w: -speeds.get(w, 0)):
        if speeds and way not in speeds:
          continue  # It ran out of memory at this batch.
        checks[way] = self.bound_at(way, batch, probe=False)
        if self.trials[-1].fits:
          return batch, way, checks[way], speeds.get(way)
      if not checks:
        break
      held = self.held_at(batch).total_bytes
      batch = min(max([_aimed(batch, held + m.bound_bytes, self.memory_bytes,
                              multiple) for m in checks.values()] +
                      [b for b in found.values() if b < batch]),
                  batch - multiple)
    return 0, None, None, None

  def timed(self, ways, batch, timing_rounds):
    """{way: examples per second at `batch`} of `ways` when there are
    several (else {}); a way whose step runs out of memory there is left
    out."""
    if len(ways) < 2:
      return {}
    x = self.sample.resized(batch)
    running = []
    for way in ways:
      try:
        self.ways.runner.seconds([self.candidates[way]], x, 1)
        running.append(way)
      except tf.errors.ResourceExhaustedError:
        pass
    times = self.ways.runner.seconds([self.candidates[w] for w in running], x,
                                     timing_rounds)
    self.note(f"timed at batch {batch}: " + ", ".join(
        f"{w} {1000 * t:.0f} ms" for w, t in zip(running, times)))
    return {w: batch / t for w, t in zip(running, times)}

  def _method(self, way):
    return "planner" if way in self.plans else way  # None: nothing fits.

  def _result(self, way, batch, measured, costs):
    """The model to train; a planner's plan is kept on its chain, with its
    costs at `batch`, the memory as its budget and its bound."""
    if way is None:
      return None
    if way not in self.plans:
      return self.ways.result(self.candidates[way])
    plan = Plan([c.scaled(batch / self.sample.size) for c in costs],
                self.plans[way].segments, self.memory_bytes,
                Budget(num_bytes=self.memory_bytes),
                ordered=self.plans[way].ordered, measured=measured,
                held=self.held_at(batch), step=self.ways.runner.step)
    return self.ways.result(plan)


def _aimed(batch, total_bytes, memory_bytes, multiple):
  """The batch (a multiple) at which a total in proportion to
  `total_bytes` at `batch` is a little below the memory."""
  scaled = batch * memory_bytes / max(1, total_bytes) * 0.99
  return max(multiple, int(scaled) // multiple * multiple)


def search_batch(bound_at, memory_bytes, first, multiple=1, max_probes=10,
                 known=None):
  """The largest batch (a multiple of `multiple`) whose bound fits.

  Bounds grow with the batch about linearly, so each probe after the first
  two is where the line through the two probes nearest the memory meets
  it, kept strictly between the largest batch known to fit and the smallest
  known not to (halfway, when the line points outside).

  Args:
    bound_at: batch -> the bound bytes of training at that batch, or None
      where no step is made at that batch (a budget the planner refuses
      there).
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
  """Where the line through the measured probe nearest the memory and the
  one farthest from it in batch (two probes close together give a slope
  of noise) meets the memory, if that lies between `low` and `high`; else
  twice `low` (no batch known not to fit yet) or the middle."""
  measured = [b for b, p in probes.items() if p is not None]
  guess = None
  if len(measured) >= 2:
    b1 = min(measured, key=lambda b: abs(probes[b] - memory_bytes))
    b2 = max(measured, key=lambda b: abs(b - b1))
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
