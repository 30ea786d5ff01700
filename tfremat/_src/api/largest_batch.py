"""The largest batch whose training fits a memory size, and the model to
train at it: `tfremat.largest_batch`, from predictions.

The memory counts the weights, the optimizer's state (for a compiled model
given targets), the batch, and the step's own tensors. The units' costs
are read from their traced programs at the sample's batch; the plan the
cost model predicts to peak lowest is predicted
(`tfremat.measure.predict_peak`) at batches chosen where the line through
the predictions nearest the memory meets it (`search_batch`); at the
largest that fits, the planner plans for the memory there
(`budget.plan_budget`, on the costs carried to that batch: the fastest plan
predicted to fit, checked by running it).
"""

import dataclasses
import math
import time

import keras

from tfremat import errors
from tfremat._src import measuring as measure
from tfremat._src import units
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api import layers as layers_lib
from tfremat._src.keras_api.layers import refuse_keras2
from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning import apply
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning import choose
from tfremat._src.planning import profile
from tfremat._src.planning import proposals
from tfremat._src.planning import search
from tfremat._src.planning.cost_model import Budget
from tfremat._src.planning.runner import ChainRunner
from tfremat._src.api import remat_model as remat_model_lib

__all__ = [
    "largest_batch",
    "LargestBatch",
    "BatchTrial",
    "Ways",
    "ways_of",
    "search_batch",
]


@dataclasses.dataclass(frozen=True)
class BatchTrial:
  """One prediction of `largest_batch`: the lowest plan's step at a batch
  (its predicted peak and bound, a `tfremat.planner.Measured` over no
  calls), what training holds besides it there, and whether the two fit
  the memory."""
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
      `plan` says, compiled as the given model was; None when nothing
      fits.
    method: "none" (no rematerialization is needed), "full" (every layer,
      or every block of a chain, rematerialized alone), "planner" (another
      plan of the planner's), or None when nothing fits (`fits` is then
      False).
    measured: the step's `tfremat.planner.Measured` at that batch, from
      the planner's check (a few steps run).
    held: what training holds besides the step at that batch
      (`tfremat.planner.Held`: weights, optimizer state, batch).
    memory_bytes: the memory given, in bytes.
    step: which training step was predicted ("train_on_batch" or
      "stand-in").
    plan: the planner's `tfremat.planner.Plan` at that batch, or None.
    trials: every `BatchTrial`, in the order predicted.
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
  plan: object = None
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
              f"{mib(self.memory_bytes)}, even with the lowest plan "
              f"({len(self.trials)} predictions, {self.seconds:.0f} s)")
    how = {"none": "no rematerialization", "full": "every layer "
           "rematerialized", "planner": "the planner's plan"}
    return (f"batch {self.batch}, {how[self.method]}: held "
            f"{mib(self.held.total_bytes)} + the step's predicted peak "
            f"{mib(self.plan.predicted_peak_at(self.plan.shape))} within "
            f"{mib(self.memory_bytes)}, measured "
            f"{mib(self.measured.peak_bytes)} ({self.step} step; "
            f"{len(self.trials)} predictions, {self.seconds:.0f} s)")


def largest_batch(model, memory, sample_input, *, sample_target=None,
                  multiple=None, policies=policies_lib.PLANNED,
                  settings=search.DEFAULT_SETTINGS, verbose=1):
  """The largest batch whose training fits `memory`, and the
  rematerialized model that trains fastest at it, as the planner predicts.

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
  tensors (`LargestBatch.held` and `.plan` split it). The units' costs are
  read from their traced programs at the sample's batch, and the plan the
  cost model predicts to peak lowest (every unit rematerialized alone,
  where that is lowest) is predicted at batches chosen where the line
  through the two predictions nearest the memory meets it, up to
  `settings.batch_probes` of them, to the largest multiple of `multiple`
  whose held bytes plus predicted peak (with `Plan.margin`) fit. At that
  batch the planner plans for the memory (as `remat_model(model,
  budget=memory)` does there), and its plan's step runs a few times as a
  check.

  Args:
    model: a built `keras.Sequential` or functional `keras.Model` (a
      KerasHub backbone, a `keras.applications` CNN), or a chain: a list of
      Keras layers, each taking the previous one's output.
    memory: the memory for training: bytes, or a string with a unit
      ("512MiB").
    sample_input: a batch like those it will train on; batches of other
      sizes repeat and cut it along its first axis.
    sample_target: the targets of `sample_input`, for a compiled `model`:
      every step is predicted on its own `train_on_batch`, the model's
      loss and its optimizer's update, whose state the memory then counts.
      Without it, on the stand-in step (the gradient of sum(y**2)/2 of the
      outputs, no optimizer).
    multiple: batches are multiples of this; None: about 1% of the largest
      batch first predicted, rounded down to a power of two.
    policies: the save policies the planner may choose (as for
      `remat_model`).
    settings: the planner's `tfremat.planner.Settings`.
    verbose: 1 shows a progress bar while the units are read; 0 nothing.

  Returns:
    A `LargestBatch`: `batch`, `model` (train this at `batch`), `method`,
    `plan`, what is held and the check's measured peak, and every
    prediction.

  Raises:
    TypeError, ValueError: a model it cannot take, a memory that is not
      bytes, a bad multiple, a `sample_target` for a model that is not
      compiled; raised before anything is traced.
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
  sample = budget_lib.sample_batch(sample_input, sample_target)
  start = time.perf_counter()
  with budget_lib.retracing_quiet():
    costs = ways.costs
    if costs is None:
      progress = measure.progress_bar(len(ways.units), "unit", verbose == 1)
      costs = profile.measure_chain(
          list(ways.units), ways.chain.input_of(sample), policies=policies,
          context=ways.chain.context_of(sample), progress=progress,
          perturbed=budget_lib.perturbed(ways.chain, sample), read=True)
    lowest = search.Candidate(proposals.lowest_plan(costs).segments)
    trials = []
    bound_at = _bound_at(ways.runner, sample, lowest,
                         choose.margin_of(ways.runner, settings),
                         memory_bytes, trials)
    known = {sample.size: bound_at(sample.size)}
    if multiple is None:
      aimed = _aimed(sample.size, known[sample.size], memory_bytes, 1)
      multiple = max(1, 2 ** int(math.log2(max(1, aimed // 100))))
    first = _aimed(sample.size, known[sample.size], memory_bytes, multiple)
    batch, _ = search_batch(bound_at, memory_bytes, first, multiple,
                            settings.batch_probes, known=known)
    found = None
    while batch > 0 and found is None:
      ratio = batch / sample.size
      try:
        found = budget_lib.plan_budget(
            ways.chain, ways.runner, sample.resized(batch), memory_bytes,
            policies=policies, settings=settings,
            costs=[c.at((ratio,)) for c in costs])
      except errors.BudgetUnreachableError:
        batch -= multiple  # Its check ran over: the next lower multiple.
  seconds = time.perf_counter() - start
  if found is None:
    return LargestBatch(0, None, None, None, None, memory_bytes,
                        ways.runner.step, None, tuple(trials), seconds,
                        multiple)
  n = len(ways.units)
  method = ("none" if not any(found.rematerialized) else
            "full" if tuple(found.segments) == tuple(uniform_segments(n, n))
            else "planner")
  return LargestBatch(batch, ways.result(found), method, found.measured,
                      found.held, memory_bytes, ways.runner.step, found,
                      tuple(trials), seconds, multiple)


def _bound_at(runner, sample, lowest, margin, memory_bytes, trials):
  """batch -> what training holds there plus the lowest plan's predicted
  peak with the margin; each appended to `trials`."""

  def bound_at(batch):
    at = sample.resized(batch)
    held = runner.held(at).total_bytes
    predicted = choose.predicted_measured(runner.predicted(lowest, at),
                                          margin)
    total = held + predicted.bound_bytes
    trials.append(BatchTrial("lowest", batch, predicted, held,
                             total <= memory_bytes))
    return total
  return bound_at


@dataclasses.dataclass(frozen=True)
class Ways:
  """What `largest_batch` trains: its units, how a batch reaches them, the
  runner of their steps (`runner.Runner`), and how a plan becomes the
  model returned. `costs`, where given, stands for the units' costs (a
  test's stand-ins); else they are read from the units' programs."""
  units: tuple
  chain: budget_lib.Chain
  runner: object
  model: object = None
  parts: object = None
  costs: tuple = None

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
