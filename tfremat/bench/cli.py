"""The bench's command line: its flags, and one mode per run, each handing
the flags' values to the functions that measure (`methods`, `schemes`,
`whole`, `max_batch`, `shapes`, `predict`, `plan_cost`) and printing their
tables as soon as they are measured. `python -m tfremat.bench` runs
`main`."""

from absl import app
from absl import flags

from tfremat import chain
from tfremat._src.planning.budget import planned_policies
from tfremat import measure
from tfremat import models
from tfremat import planner
from tfremat import policies
from tfremat.bench import max_batch
from tfremat.bench import methods as methods_lib
from tfremat.bench import plan_cost
from tfremat.bench import plot
from tfremat.bench import predict
from tfremat.bench import schemes
from tfremat.bench import shapes
from tfremat.bench import tables
from tfremat.bench import whole

__all__ = [
    "main",
    "define_flags",
    "parse_flags",
    "normalized_argv",
]

FLAGS = flags.FLAGS


def define_flags():
  """The command line's flags; defined only when run as a program, so that
  importing the bench adds no flags to the importer's."""
  flags.DEFINE_enum("model", "mlp", sorted(methods_lib.DEFAULTS),
                    "mlp: residual MLP blocks; transformer: causal LM blocks.")
  flags.DEFINE_bool("jit", False, "Compile the training step with XLA.")
  flags.DEFINE_bool("eager", False,
                    "Run the training step eagerly, without tf.function.")
  flags.DEFINE_integer("blocks", None, "Blocks (default: per model).")
  flags.DEFINE_integer("width", None, "Model width (default: per model).")
  flags.DEFINE_integer("batch", None, "Batch size (default: per model).")
  flags.DEFINE_integer("seq_len", None, "Transformer sequence length.")
  flags.DEFINE_integer("heads", None, "Transformer attention heads.")
  flags.DEFINE_integer("vocab", None, "Transformer vocabulary size.")
  flags.DEFINE_float("dropout", 0.1, "Dropout rate inside every block.")
  flags.DEFINE_integer("steps", 10, "Timed rounds (one step per method).")
  flags.DEFINE_list("methods", list(methods_lib.METHODS), "Methods to run.")
  flags.DEFINE_enum("policy", None, sorted(policies.BUILT_IN),
                    "The save policy of the tfremat methods (default: "
                    "none, everything is recomputed).")
  flags.DEFINE_list("planner_policies", [p.name for p in policies.PLANNED],
                    "The save policies the planner may choose per segment "
                    "(empty: recompute fully or keep).")
  flags.DEFINE_float("budget_fraction", None,
                     "Run the planner at this fraction of the measured "
                     "no-remat peak, beside rematerializing nothing and "
                     "every block.")
  flags.DEFINE_bool("sweep", False,
                    "Run every uniform scheme and the planner at 30%, 50%, "
                    "80% and 100% of the no-remat peak.")
  flags.DEFINE_list("whole_models", [],
                    "Models to run remat_model's modes and a budget on "
                    "(all: every one available): " +
                    ", ".join(list(models.APPLICATIONS) +
                              list(models.HUB_BACKBONES)) + ".")
  flags.DEFINE_list("whole_modes", list(whole.WHOLE_MODES),
                    "The remat_model modes --whole_models runs beside the "
                    "original and a budget.")
  flags.DEFINE_string("max_batch", None,
                      "A memory size (\"512MiB\", \"1GiB\"): find, by "
                      "measuring, the largest batch each method trains "
                      "within it (weights, optimizer state, batch and the "
                      "step's tensors), and its examples per second.")
  flags.DEFINE_list("max_batch_models", list(max_batch.MODELS),
                    "The models --max_batch runs (--blocks and --width size "
                    "mlp and transformer).")
  flags.DEFINE_string("shapes", None,
                      "A memory budget (\"160MiB\"): plan a transformer LM "
                      "for it at one sequence length, train it with fit "
                      "over batches of other lengths and sizes, and set "
                      "each step's measured peak beside its prediction.")
  flags.DEFINE_bool("shape_families", False,
                    "Plan four kinds of model at 60% on a sample, and set "
                    "each one's predicted peak at three other shapes beside "
                    "the peaks measured there.")
  flags.DEFINE_bool("predict", False, "The four families' steps: "
                    "measure.predict_peak beside peak_bytes.")
  plan_cost.define_flags()
  flags.DEFINE_string("csv", "sweep.csv", "Where --sweep writes its CSV.")
  flags.DEFINE_string("plot", "sweep.png",
                      "Where --sweep draws its plot (needs matplotlib: "
                      "pip install .[bench]).")


def _sizes():
  return {k: (getattr(FLAGS, k) if getattr(FLAGS, k) is not None else v)
          for k, v in methods_lib.DEFAULTS[FLAGS.model].items()}


def _mode_name():
  return "eager" if FLAGS.eager else "XLA" if FLAGS.jit else "tf.function"


def _planner_policies():
  try:
    return planned_policies(n for n in FLAGS.planner_policies if n)
  except ValueError as e:
    raise app.UsageError(f"--planner_policies: {e}") from e


def _memory(flag, value):
  """A flag's memory size in bytes; UsageError for anything else."""
  try:
    memory = planner.Budget.parse(value).num_bytes
  except ValueError as e:
    raise app.UsageError(f"--{flag}: {e}") from e
  if memory is None:
    raise app.UsageError(f"--{flag} takes bytes (\"512MiB\"), not a "
                         "fraction.")
  return memory


def _run_max_batch():
  """--max_batch: each model's largest batch per method, and its speed,
  each model's rows printed as soon as they are measured."""
  memory = _memory("max_batch", FLAGS.max_batch)
  names = [n for n in FLAGS.max_batch_models if n]
  known = list(max_batch.MODELS) + list(models.APPLICATIONS)
  unknown = [n for n in names if n not in known]
  if unknown or FLAGS.sweep or FLAGS.eager or FLAGS.jit or FLAGS.whole_models:
    raise app.UsageError(
        f"--max_batch runs in tf.function on {', '.join(known)}"
        + (f"; unknown: {unknown}" if unknown else "") +
        "; leave out --sweep, --eager, --jit and --whole_models.")
  print(tables.environment())
  print(f"largest batch within {measure.format_bytes(memory)} for "
        f"everything training holds, tf.function, {FLAGS.steps} timed rounds")
  rows = []
  for name in names:
    missing = max_batch.needs(name)
    if missing:
      print(f"{name}: skipped, it needs {missing}", flush=True)
      continue
    found = max_batch.measure_model(
        name, memory, FLAGS.steps, FLAGS.blocks, FLAGS.width,
        log=lambda line: print(line, flush=True))
    # Each model's rows as soon as they are measured, then all of them.
    print(tables.format_batch_table(found, memory) + "\n", flush=True)
    rows += found
  if len(names) > 1 and rows:
    print(f"all models:\n{tables.format_batch_table(rows, memory)}")
  print(tables.BATCH_LEGEND.format(
      rounds=FLAGS.steps, check_calls=max_batch.CHECK_CALLS,
      first_calls=max_batch.FIRST_CALLS,
      reserve=planner.DEFAULT_SETTINGS.reserve))


def _whole_model_names():
  """--whole_models as names; "all": every model this install can build."""
  names = [n for n in FLAGS.whole_models if n]
  if names == ["all"]:
    names = list(models.APPLICATIONS)
    if max_batch.needs(models.HUB_BACKBONES[0]):
      print("(no KerasHub backbones: pip install \".[hub]\" for them)")
    else:
      names += list(models.HUB_BACKBONES)
  known = list(models.APPLICATIONS) + list(models.HUB_BACKBONES)
  unknown = [n for n in names if n not in known]
  if unknown:
    raise app.UsageError(f"Unknown --whole_models {unknown}; choose from "
                         f"{', '.join(known)}, or all.")
  return names


def _whole_modes():
  modes = [m for m in FLAGS.whole_modes if m]
  unknown = [m for m in modes if m not in whole.WHOLE_MODES]
  if unknown:
    raise app.UsageError(f"Unknown --whole_modes {unknown}; choose from "
                         f"{', '.join(whole.WHOLE_MODES)}.")
  return modes


def _run_whole_models():
  """--whole_models: remat_model's modes and a budget on each model."""
  names = _whole_model_names()
  budget = 0.5 if FLAGS.budget_fraction is None else FLAGS.budget_fraction
  if FLAGS.sweep or FLAGS.eager or FLAGS.jit or not 0 < budget <= 1:
    raise app.UsageError("--whole_models measures traced steps in "
                         "tf.function, with --budget-fraction in (0, 1] "
                         "and --steps; leave out --sweep, --eager, --jit.")
  print(tables.environment())
  print(f"whole models, tf.function, {FLAGS.steps} timed rounds")
  progress = measure.progress_bar(len(names), "model")
  rows = []
  # Every row traces a new step on purpose (and ConvNeXtTiny's convolutions
  # retrace one of Keras's functions each time).
  with chain.retracing_quiet():
    for name in names:
      rows += whole.measure_whole_model(name, budget, FLAGS.steps,
                                        _whole_modes())
      if progress is not None:
        progress.add(1)
  print(tables.format_whole_table(rows))
  print(tables.WHOLE_LEGEND.format(steps=FLAGS.steps))


def _run_schemes():
  """--sweep or --budget-fraction: schemes and the planner on a chain."""
  if FLAGS.eager:
    raise app.UsageError("--eager is for the per-method table; the sweep "
                         "and the planner measure traced steps.")
  if FLAGS.budget_fraction is not None and not 0 < FLAGS.budget_fraction:
    raise app.UsageError("--budget-fraction must be positive, e.g. 0.5.")
  fractions = ([0.3, 0.5, 0.8, 1.0] if FLAGS.sweep else
               [FLAGS.budget_fraction])
  names = _planner_policies()
  count = (len(schemes.uniform_schemes(_sizes()["blocks"])) + len(names)
           if FLAGS.sweep else 2)
  print(tables.environment())
  progress = measure.progress_bar(count + len(fractions), "scheme")
  rows = schemes.measure_schemes(
      FLAGS.model, _sizes(), FLAGS.dropout, fractions, names,
      sweep=FLAGS.sweep, jit=FLAGS.jit, rounds=FLAGS.steps, progress=progress)
  sizes = ", ".join(f"{k} {v}" for k, v in _sizes().items())
  title = (f"{FLAGS.model} ({sizes}, dropout {FLAGS.dropout}), "
           f"{_mode_name()}: memory vs time")
  print(f"\n{title}, {FLAGS.steps} timed rounds")
  print(tables.format_scheme_table(rows))
  print(tables.SCHEME_LEGEND.format(steps=FLAGS.steps))
  if FLAGS.sweep:
    tables.write_csv(rows, FLAGS.csv)
    drawn = plot.plot_pareto(rows, FLAGS.plot, title)
    print(f"wrote {FLAGS.csv}" + (f" and {FLAGS.plot}" if drawn else
                                  " (no plot: pip install .[bench])"))


def _run_shapes():
  """--shapes: a planned LM's fit over batches of other shapes, each step's
  peak predicted and measured."""
  memory = _memory("shapes", FLAGS.shapes)
  print(tables.environment())
  print(f"a transformer LM planned within {measure.format_bytes(memory)} "
        "at one sequence length, then trained with fit over batches of "
        "other lengths and sizes")
  rows = shapes.fit_rows(memory, log=lambda line: print(line, flush=True))
  print(tables.format_fit_table(rows))
  print(tables.FIT_LEGEND)


def _run_shape_families():
  """--shape_families: four kinds of model, each planned on a sample, then
  predicted and measured at other shapes."""
  print(tables.environment())
  rows = shapes.family_rows(log=lambda line: print(line, flush=True))
  print(tables.format_family_table(rows))
  print(tables.FAMILY_LEGEND)


def _run_predict():
  """--predict: predict_peak beside peak_bytes over the four families."""
  print(tables.environment())
  rows = predict.predict_rows(log=lambda line: print(line, flush=True))
  print(predict.format_table(rows))


def _run_plan_cost():
  """--plan_cost: what planning costs, beside 10 training steps."""
  if FLAGS.rounds < 1:
    raise app.UsageError("--rounds takes a positive number of rounds.")
  print(tables.environment())
  costs = plan_cost.plan_costs(rounds=FLAGS.rounds,
                               log=lambda line: print(line, flush=True))
  print(plan_cost.format_table(costs, FLAGS.rounds))


def _run_methods():
  """The default: every method block by block, on one model."""
  methods = [m for m in methods_lib.METHODS if m in FLAGS.methods]
  print(tables.environment())
  policy = (f", tfremat methods under {FLAGS.policy}" if FLAGS.policy else "")
  sizes = ", ".join(f"{k} {v}" for k, v in _sizes().items())
  print(f"{FLAGS.model}: {sizes}, dropout {FLAGS.dropout}, "
        f"{_mode_name()}, {FLAGS.steps} timed rounds{policy}")
  progress = measure.progress_bar(len(methods), "method")
  print(tables.format_table(methods_lib.measure_methods(
      FLAGS.model, methods, _sizes(), FLAGS.dropout, jit=FLAGS.jit,
      eager=FLAGS.eager, policy=FLAGS.policy, rounds=FLAGS.steps,
      progress=progress)))
  print(tables.METHOD_LEGEND.format(steps=FLAGS.steps))


def normalized_argv(argv):
  """`argv` with every documented spelling made one absl reads.

  --budget-fraction (dashes, as in the docs) becomes --budget_fraction, and a
  bare --plot or --csv (no value) takes the flag's default file name.
  """
  names, out = set(FLAGS), [argv[0]]
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg.startswith("--") and "-" in arg[2:].split("=", 1)[0]:
      name, eq, value = arg[2:].partition("=")
      underscored = name.replace("-", "_")
      if underscored in names:
        arg = f"--{underscored}{eq}{value}"
    if arg in ("--plot", "--csv"):
      following = args[i + 1] if i + 1 < len(args) else None
      if following is None or following.startswith("-"):
        arg = f"{arg}={FLAGS[arg[2:]].default}"
    out.append(arg)
  return out


def parse_flags(argv):
  return app.parse_flags_with_usage(normalized_argv(argv))


def main(argv):
  """Runs the one mode the flags name: --max_batch, --shapes,
  --shape_families, --predict, --plan_cost, --whole_models, --sweep or
  --budget-fraction, else the methods table."""
  del argv
  if FLAGS.eager and FLAGS.jit:
    raise app.UsageError("--eager and --jit exclude each other: pick one.")
  unknown = set(FLAGS.methods) - set(methods_lib.METHODS)
  if unknown:
    raise app.UsageError(
        f"Unknown --methods {sorted(unknown)}; choose from "
        f"{', '.join(methods_lib.METHODS)}.")
  modes = [name for name, given in (
      ("--max_batch", FLAGS.max_batch), ("--shapes", FLAGS.shapes),
      ("--shape_families", FLAGS.shape_families),
      ("--predict", FLAGS.predict), ("--plan_cost", FLAGS.plan_cost),
      ("--whole_models", FLAGS.whole_models)) if given]
  if len(modes) > 1:
    raise app.UsageError(f"{' and '.join(modes)} are separate runs: give "
                         "one.")
  if FLAGS.max_batch:
    _run_max_batch()
  elif FLAGS.shapes:
    _run_shapes()
  elif FLAGS.shape_families:
    _run_shape_families()
  elif FLAGS.predict:
    _run_predict()
  elif FLAGS.plan_cost:
    _run_plan_cost()
  elif FLAGS.whole_models:
    _run_whole_models()
  elif FLAGS.sweep or FLAGS.budget_fraction is not None:
    _run_schemes()
  else:
    _run_methods()
