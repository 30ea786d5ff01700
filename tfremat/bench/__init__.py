"""Benchmark: peak memory, step time and gradient error of remat methods.

  python -m tfremat.bench                      # residual MLP, tf.function
  python -m tfremat.bench --jit                # tf.function(jit_compile=True)
  python -m tfremat.bench --eager              # no tf.function: eager mode
  python -m tfremat.bench --model transformer  # causal transformer LM
  python -m tfremat.bench --budget-fraction 0.5  # the planner at 50% peak
  python -m tfremat.bench --sweep --csv sweep.csv --plot sweep.png
  python -m tfremat.bench --sweep --plot     # the default file, sweep.png
  python -m tfremat.bench --policy dots_saveable  # tfremat under a policy
  python -m tfremat.bench --whole_models all   # remat_model on real models
  python -m tfremat.bench --max_batch 512MiB   # the largest batch that fits
  python -m tfremat.bench --shapes 96MiB       # a plan at other shapes
  python -m tfremat.bench --plan_cost          # what planning costs

The tables go to standard output; TensorFlow's start-up lines (CPU
features, CUDA drivers looked for) go to standard error, and
TF_CPP_MIN_LOG_LEVEL=2 in the environment silences them.

The package is split by job: `cli` (flags and modes), `methods` (the
methods compared block by block), `schemes` (uniform schemes and the
planner on a chain), `whole` (`remat_model` on real models), `max_batch`
(the largest batch per method), `shapes` (a plan predicted and measured at
other shapes), `predict` (`predict_peak` beside `peak_bytes`), `plan_cost`
(seconds to plan, beside 10 training steps), `tables` and `plot`.

Every method runs in one process on the same model, weights, batch and
dropout seeds:

  none               no rematerialization
  tf.recompute_grad  TensorFlow's built-in
  keras.remat        Keras 3's (on TensorFlow: tf.recompute_grad again)
  tfremat            tfremat.RematerializeFn around each block's call
  tfremat.layer      tfremat.RematerializationLayer around each block

Peak memory is the largest total of the tensors one training step allocates
and has not yet freed, above what was allocated just before it (weights and
the batch are not counted; activations, temporaries and gradients are), the
largest over 5 calls. The methods table also gives the allocator's overhead
over it (alloc x). Step time is the median over --steps rounds, each calling
every method once in shuffled order; the first call, which traces (and
compiles, with --jit), is timed apart, and so is tracing alone (median of 3
shuffled rounds; not in eager mode). The gradient error is the largest
absolute difference from the `none` method's gradients over the largest of
those gradients, with dropout active.

--budget-fraction and --sweep compare ways of choosing what to
rematerialize, on the model's blocks as a chain (`tfremat.RematSequential`),
in one process: uniform schemes (every block, every 2nd or 4th block, about
sqrt(n) segments, and, in the sweep, every block under each save policy the
planner chooses among) and the planner, choosing per segment among keeping,
rematerializing fully and rematerializing under each of those policies, at
fractions of the measured no-remat peak.

--whole_models runs `tfremat.remat_model` on models nobody on this project
wrote (`keras.applications` CNNs and, with keras-hub installed, KerasHub
backbones; `tfremat.models.whole_model` has their sizes).
"""

__all__ = []
