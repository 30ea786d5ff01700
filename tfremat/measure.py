"""Measure what a training step costs: its peak memory and its time.

  step = tf.function(train_step)          # or model.train_on_batch, or eager
  peak = tfremat.measure.peak_bytes(step, x, y)
  print(tfremat.measure.format_bytes(peak))         # e.g. "79.0 MiB"
  saved = 1 - peak_with_remat / peak_without_remat  # what remat saved
  ahead = tfremat.measure.predict_peak(step, tf.TensorSpec([4096, 512]), y)

A step's peak is the largest total size of the tensors it has allocated and
not yet freed, at any moment of one call: their requested sizes, as
TensorFlow's allocator reports each allocation and deallocation to its
profiler. Weights, optimizer slots and the batch, allocated before the call,
are not counted; activations, temporaries and gradients are. That is what
rematerialization changes and what the planner's budgets bound. It is the
same in every process, whatever the allocator did before: XLA's and
PyTorch's planners count memory the same way, from tensor sizes.

What the allocator takes for those tensors is more: TensorFlow's BFC
allocator (the GPU's, and the CPU's with TF_CPU_ALLOCATOR_USE_BFC=true) puts
a tensor in a chunk of up to twice its size, and which chunks are free
depends on what the process did before. `step_peaks` gives both, and the
benchmark reports the allocator's overhead over the tensors' bytes
(docs/design.md, "What a budget bounds"). `fit_peaks` measures every step
of a `model.fit` call.

`predict_peak` gives the figure `peak_bytes` would measure without running
the step: read from XLA's buffer assignment when the step compiles with XLA
(to the byte on the steps tested), from the traced graph's tensors and
their lifetimes on TensorFlow's executor. It takes shapes that would not fit
in memory.

It measures the first GPU when there is one, else the CPU. On the CPU the
allocator's records reach the profiler from TensorFlow's BFC allocator only,
which importing tfremat turns on (TF_CPU_ALLOCATOR_USE_BFC=true) if
TensorFlow has not run an op yet. The benchmark, the planner and the
examples all measure with this module.
"""

from tfremat._src.measuring import PEAK_CALLS
from tfremat._src.measuring import StepPeak
from tfremat._src.measuring import fit_peaks
from tfremat._src.measuring import format_bytes
from tfremat._src.measuring import held_bytes
from tfremat._src.measuring import median_seconds
from tfremat._src.measuring import memory_device
from tfremat._src.measuring import peak_bytes
from tfremat._src.measuring import peaks
from tfremat._src.measuring import progress_bar
from tfremat._src.measuring import replicated
from tfremat._src.measuring import restoring
from tfremat._src.measuring import seconds
from tfremat._src.measuring import step_peaks
from tfremat._src.measuring import wait_for
from tfremat._src.predicting import predict_peak

__all__ = [
    "memory_device",
    "peak_bytes",
    "predict_peak",
    "peaks",
    "step_peaks",
    "fit_peaks",
    "StepPeak",
    "held_bytes",
    "replicated",
    "median_seconds",
    "seconds",
    "format_bytes",
    "progress_bar",
    "restoring",
    "PEAK_CALLS",
    "wait_for",
]
