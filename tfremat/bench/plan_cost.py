"""What planning costs (`--plan_cost`): `remat_model(model, budget="50%",
sample_input=x, sample_target=y)` on the transformer LM of
`tfremat.models.flat_lm` compiled with Adam, beside tracing (under XLA,
compiling) and running 10 of its training steps, and `largest_batch(model,
"256MiB", x, sample_target=y)`. Each job runs in a new process, as a user's
first plan does (nothing traced or converted before it), the jobs in turn
in each round; the table gives each one's median over the rounds."""

import dataclasses
import os
import statistics
import subprocess
import sys

from absl import flags

from tfremat import errors

__all__ = ["PlanCost", "plan_costs", "format_table", "define_flags", "JOBS",
           "LEGEND"]


def define_flags():
  """`--plan_cost` and its `--rounds` (`cli.define_flags`)."""
  flags.DEFINE_bool("plan_cost", False, "Seconds to plan the 8-block "
                    "transformer LM at 50% and find its largest batch in "
                    "256MiB, beside tracing and running 10 of its steps, "
                    "each in a new process, with and without XLA.")
  flags.DEFINE_integer("rounds", 2, "--plan_cost: rounds of new processes.")


# A job's program: the model and batch, then the job timed alone.
_PROGRAM = """
import time
import keras
import tensorflow as tf
import tfremat
from tfremat import models
model = models.flat_lm({blocks}, seq_len={length})
model.compile(optimizer="adam", jit_compile={jit},
              loss=keras.losses.SparseCategoricalCrossentropy(
                  from_logits=True))
tokens = tf.random.stateless_uniform([{batch}, {length} + 1], seed=[1, 2],
                                     maxval=64, dtype=tf.int32)
x, y = tokens[:, :-1], tokens[:, 1:]
start = time.perf_counter()
{job}
print("seconds", time.perf_counter() - start)
"""

# What each job times.
JOBS = {
    "steps": "for _ in range(10):\n  model.train_on_batch(x, y)",
    "plan": ("tfremat.remat_model(model, budget='50%', sample_input=x, "
             "sample_target=y, verbose=0)"),
    "largest_batch": ("tfremat.largest_batch(model, '256MiB', x, "
                      "sample_target=y, verbose=0)"),
}

LEGEND = (
    "planning: remat_model(model, budget=\"50%\", sample_input=x, "
    "sample_target=y); 10 steps: train_on_batch 10 times, the first "
    "tracing (under XLA, compiling) the step; largest_batch: "
    "largest_batch(model, \"256MiB\", x, sample_target=y), on the executor "
    "only. Each a new process; medians of {rounds} rounds.")


@dataclasses.dataclass(frozen=True)
class PlanCost:
  """One way the step is compiled: each job's seconds, one per round."""
  jit: bool
  seconds: dict

  def median(self, job):
    found = self.seconds.get(job)
    return statistics.median(found) if found else None


def _timed(job, jit, blocks, batch, length):
  """Seconds the job took in a new process."""
  program = _PROGRAM.format(blocks=blocks, length=length, batch=batch,
                            jit=jit, job=JOBS[job])
  done = subprocess.run([sys.executable, "-c", program], capture_output=True,
                        text=True, env=dict(os.environ,
                                            TF_CPP_MIN_LOG_LEVEL="2"))
  if done.returncode:
    raise errors.Error(f"--plan_cost's {job} job failed:\n"
                       f"{done.stderr[-3000:]}")
  return float(done.stdout.split()[-1])


def plan_costs(blocks=8, batch=32, length=128, rounds=2, jit=(False, True),
               largest=True, log=print):
  """A `PlanCost` per compilation (`jit`), the jobs of each run in turn in
  each round; `largest`: with `largest_batch` on the executor."""
  found = {j: {} for j in jit}
  for r in range(rounds):
    for j in jit:
      jobs = ["plan", "steps"] + (["largest_batch"] if largest and not j
                                  else [])
      for job in jobs:
        seconds = _timed(job, j, blocks, batch, length)
        found[j].setdefault(job, []).append(seconds)
        log(f"round {r + 1}, {'XLA' if j else 'tf.function'}, {job}: "
            f"{seconds:.1f} s")
  return [PlanCost(j, s) for j, s in found.items()]


def format_table(costs, rounds):
  """The table, its legend after a blank line."""
  header = (f"{'step':<12}{'planning s':>12}{'10 steps s':>12}{'ratio':>8}"
            f"{'largest_batch s':>17}")
  lines = [header, "-" * len(header)]
  for c in costs:
    plan, steps, largest = (c.median(j) for j in ("plan", "steps",
                                                   "largest_batch"))
    lines.append(
        f"{'XLA' if c.jit else 'tf.function':<12}{plan:>12.1f}{steps:>12.1f}"
        f"{plan / steps:>7.2f}x"
        f"{'-' if largest is None else f'{largest:.1f}':>17}")
  return "\n".join(lines + ["", LEGEND.format(rounds=rounds)])
