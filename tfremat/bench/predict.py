"""A step's peak read from its program beside the peak measured
(`--predict`): `tfremat.measure.predict_peak` against
`tfremat.measure.peak_bytes` (largest of 10 calls), over the four families
of `--shape_families`, each at its sample shape, a larger batch and a
longer sequence (or larger image), kept whole and with
`remat_model(model, "full")`, compiled with and without XLA, trained with
`train_on_batch` on tensors."""

import dataclasses
import time

import keras

import tfremat
from tfremat import measure
from tfremat.bench import shapes

__all__ = ["PredictRow", "predict_rows", "MODES", "CALLS"]

# How the model is trained: kept whole, or every layer rematerialized.
MODES = ("whole", "full")
# The measured peak is the largest of this many calls.
CALLS = 10


@dataclasses.dataclass(frozen=True)
class PredictRow:
  """One (family, shape, mode, XLA or not): the prediction, the seconds it
  took, and the measured peak."""
  model: str
  shape: tuple
  mode: str
  jit_compile: bool
  predicted_bytes: int
  seconds: float
  measured_bytes: int

  @property
  def error(self):
    return self.predicted_bytes / max(1, self.measured_bytes) - 1


def _shapes(sample, others):
  """The sample, the first larger batch, and the first longer or larger
  one (for a batch of vectors, the next larger batch)."""
  batch = next(s for s in others if s[0] > sample[0])
  longer = next(s for s in others if s != batch and (
      s[1] > sample[1] if len(s) > 1 else s[0] > sample[0]))
  return [sample, batch, longer]


def predict_rows(families=shapes.FAMILIES, modes=MODES, jit=(False, True),
                 calls=CALLS, log=print):
  """`PredictRow`s, each family built afresh for each mode and XLA or
  not."""
  found = []
  for name in families:
    for mode in modes:
      for jit_compile in jit:
        model, loss, batch_of, sample, others = shapes._family(name)  # pylint: disable=protected-access
        if mode == "full":
          model = tfremat.remat_model(model, "full")
        model.compile(optimizer="adam", loss=loss, jit_compile=jit_compile)
        for shape in _shapes(sample, others):
          x, y = batch_of(*shape)
          start = time.perf_counter()
          predicted = measure.predict_peak(model.train_on_batch, x, y)
          took = time.perf_counter() - start
          measured = measure.peak_bytes(model.train_on_batch, x, y,
                                        calls=calls)
          found.append(PredictRow(name, shape, mode, jit_compile, predicted,
                                  took, measured))
          log(f"{name} {shape} {mode} jit={jit_compile}: predicted "
              f"{predicted} in {took:.1f} s, measured {measured} "
              f"({found[-1].error:+.2%})")
        keras.backend.clear_session()
  return found


def format_table(rows):
  """A table of `rows`, one line per model and shape: for each mode and
  program the measured peak (MiB) and the prediction's error; then a line
  per program: how many land within its bound, the lowest and highest
  error, the seconds."""
  cells = {(r.model, r.shape, r.mode, r.jit_compile): r for r in rows}
  keys = list(dict.fromkeys((r.model, r.shape) for r in rows))
  columns = [(m, j) for m in MODES for j in (False, True)
             if any((r.mode, r.jit_compile) == (m, j) for r in rows)]
  lines = [f"{'model':<15} {'shape':<8}" + "".join(
      f"{m + (' XLA' if j else ' exec') + ' MiB':>15}{'error':>9}"
      for m, j in columns), "-" * (24 + 24 * len(columns))]
  for model, shape in keys:
    line = f"{model:<15} {'x'.join(map(str, shape)):<8}"
    for m, j in columns:
      r = cells.get((model, shape, m, j))
      line += (" " * 24 if r is None else
               f"{r.measured_bytes / 2**20:>15.1f}{r.error:>+9.2%}")
    lines.append(line)
  for jit_compile, bound in ((False, 0.10), (True, 0.01)):
    these = [r for r in rows if r.jit_compile == jit_compile]
    if these:
      errors_ = [r.error for r in these]
      lines.append(
          f"{'under XLA' if jit_compile else 'on the executor'} "
          f"{sum(-bound <= e <= bound for e in errors_)} of {len(these)} "
          f"within {bound:.0%} ({min(errors_):+.2%} to "
          f"{max(errors_):+.2%}), {sum(e < -0.05 for e in errors_)} more "
          f"than 5% below; predictions "
          f"{min(r.seconds for r in these):.1f}-"
          f"{max(r.seconds for r in these):.1f} s")
  return "\n".join(lines)
