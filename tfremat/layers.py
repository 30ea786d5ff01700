"""RematerializationLayer: a Keras 3 layer that rematerializes another layer.

  block = tfremat.RematerializationLayer(keras.Sequential([...]))
  y = block(x, training=True)    # same as the wrapped layer's call

The wrapped layer's call runs through `RematerializeFn`: its activations are
recomputed in the backward pass, with the same dropout masks and with
BatchNormalization statistics updated once. Everything else is the wrapped
layer's: weights, output shapes, dtypes, masks, losses.
"""

import contextlib
import math

import keras
import numpy as np

from tfremat import hyperparams
from tfremat import measure
from tfremat import planner
from tfremat import remat


def _unquantized(policy):
  """The wrapper's dtype policy: the wrapped layer's, without quantization.

  The wrapper only casts inputs as the wrapped layer does; with a quantized
  policy Keras would route the wrapper's own call to a quantized call it
  does not have. The wrapped layer still runs its quantized call.
  """
  if getattr(policy, "quantization_mode", None) is None:
    return policy
  return keras.DTypePolicy(policy._source_name)  # pylint: disable=protected-access


@keras.saving.register_keras_serializable(package="tfremat")
class RematerializationLayer(keras.layers.Wrapper):
  """Wraps a Keras layer so that its activations are recomputed on backward.

  Calling the wrapper is calling the wrapped layer: the same positional inputs
  (tensors or nested structures), `training=`, `mask=` and other keyword
  arguments, the same outputs and masks. Tensor arguments, positional or
  keyword, are differentiated; other keyword arguments are passed as they are.

  Args:
    layer: the Keras layer to rematerialize: a built-in layer, a custom
      layer, a `Sequential` or a functional model.
    **kwargs: base `keras.layers.Layer` arguments (`name`, `trainable`, ...).
      `dtype` defaults to the wrapped layer's dtype policy, so that inputs are
      cast exactly as the wrapped layer casts them.
  """

  def __init__(self, layer, **kwargs):
    if not isinstance(layer, keras.layers.Layer):
      raise TypeError(
          "RematerializationLayer wraps a Keras layer (keras.layers.Layer, "
          f"including Sequential and functional models); got "
          f"{type(layer).__name__}: {layer!r}. To rematerialize a plain "
          "function, use tfremat.RematerializeFn(fn, *inputs) or the "
          "@tfremat.rematerialize decorator.")
    if isinstance(layer, keras.layers.InputLayer):
      raise TypeError(
          "RematerializationLayer cannot wrap an InputLayer: it holds no "
          "computation. Wrap the layers that follow the input.")
    kwargs.setdefault("dtype", _unquantized(layer.dtype_policy))
    kwargs.setdefault("name", f"remat_{layer.name}")
    super().__init__(layer, **kwargs)
    self.supports_masking = layer.supports_masking
    # Keras binds a call's arguments to `call`'s signature and refuses a
    # nested argument that mixes tensors and Python values, which the
    # wrapper's `**kwargs` would be (value=kv, use_causal_mask=True). Bound
    # to the wrapped layer's signature, each argument stands alone, as in a
    # call of the wrapped layer.
    self._call_signature = layer._call_signature  # pylint: disable=protected-access
    self.call_signature_parameters = layer.call_signature_parameters
    if not self.trainable:
      # Keras propagates `trainable` to sublayers only when it is set later.
      layer.trainable = False

  @classmethod
  def Params(cls):
    """Lingvo-style Params: `body` is the Params of the layer to wrap."""
    p = hyperparams.InstantiableParams(cls)
    p.Define("body", None, "Params of the layer to rematerialize.")
    return p

  @classmethod
  def FromParams(cls, params):
    if not hyperparams.IsInstantiable(params.body):
      raise ValueError(
          f"RematerializationLayer {params.name}: body must be instantiable "
          f"Params (e.g. from a builder helper); got {params.body!r}.")
    return cls(params.body.Instantiate(), name=params.name)

  @classmethod
  def from_config(cls, config, custom_objects=None):
    # keras.layers.Wrapper.from_config pops "layer" from the caller's dict.
    return super().from_config(dict(config), custom_objects=custom_objects)

  def build(self, input_shape=None):
    # The wrapped layer builds itself from its own call signature on its first
    # call (symbolic in a functional model, or real); a wrapper that knows
    # only the first input's shape could not build, e.g., MultiHeadAttention.
    del input_shape
    self.built = True

  def get_build_config(self):
    return self.layer.get_build_config()

  def build_from_config(self, config):
    if config:
      self.layer.build_from_config(config)
    self.built = True

  def _layer_kwargs(self, training, mask, kwargs):
    kwargs = dict(kwargs)
    if training is not None and self.layer._call_has_training_arg:  # pylint: disable=protected-access
      kwargs["training"] = training
    if mask is not None and self.layer._call_has_mask_arg:  # pylint: disable=protected-access
      kwargs["mask"] = mask
    return kwargs

  def call(self, inputs, *args, training=None, mask=None, **kwargs):
    kwargs = self._layer_kwargs(training, mask, kwargs)

    def fn(inputs, args, kwargs):
      return self.layer(inputs, *args, **kwargs)

    # Tensors anywhere in the arguments are differentiated; Python values
    # pass through as they are.
    outputs, losses = remat.rematerialize_with_losses(
        fn, (inputs, args, kwargs), on_losses=lambda losses: None)
    # Losses the wrapped layer added (activity regularizers) come back as
    # outputs of the rematerialized call, so their gradients flow; they are
    # this layer's now.
    for _, loss in losses:
      self.add_loss(loss)
    return outputs

  def compute_output_spec(self, inputs, *args, training=None, mask=None,
                          **kwargs):
    # A symbolic call of the wrapped layer: gives its exact output spec and
    # builds it as an unwrapped call would.
    return self.layer(inputs, *args, **self._layer_kwargs(training, mask,
                                                          kwargs))

  def compute_output_shape(self, *args, **kwargs):
    return self.layer.compute_output_shape(*args, **kwargs)

  def compute_mask(self, inputs, mask=None):
    return self.layer.compute_mask(inputs, mask)


@keras.saving.register_keras_serializable(package="tfremat")
class RematSequential(keras.layers.Layer):
  """Runs a chain of layers, rematerializing the chosen segments.

  Made by `tfremat.remat_sequential`. Each rematerialized segment runs as a
  `RematerializationLayer` around a `keras.Sequential` of its layers; kept
  segments run their layers directly.

  Args:
    layers: the chain's Keras layers, each taking the previous one's output,
      or a `keras.Sequential` of them.
    segments: `(start, stop, remat)` triples covering the chain in order.
    plan: the planner's `Plan` that chose the segments, if it did; kept in
      the layer's config, so `.plan` prints the same after a `.keras` file
      is saved and loaded.
  """

  def __init__(self, layers, segments, plan=None, **kwargs):
    layers = _chain_layers(layers, "RematSequential")
    segments = [s if isinstance(s, planner.Segment) else planner.Segment(*s)
                for s in segments]
    planner.check_segments(segments, len(layers))
    super().__init__(**kwargs)
    self.chain = layers
    self.segments = segments
    if isinstance(plan, dict):
      plan = planner.Plan.from_config(plan)
    self.plan = plan
    self.steps = []
    for seg in segments:
      part = layers[seg.start:seg.stop]
      self.steps += ([RematerializationLayer(keras.Sequential(part))]
                     if seg.remat else part)

  def build(self, input_shape=None):
    del input_shape  # Each layer builds itself on its first call.
    self.built = True

  def call(self, x, training=None):
    for step in self.steps:
      x = step(x, training=training)
    return x

  def compute_output_spec(self, x, training=None):
    # Called on symbolic inputs, each step makes its own symbolic call.
    return self.call(x, training=training)

  def get_config(self):
    return {
        **super().get_config(),
        "layers": [keras.saving.serialize_keras_object(l) for l in self.chain],
        "segments": [[s.start, s.stop, s.remat] for s in self.segments],
        "plan": self.plan.get_config() if self.plan else None,
    }

  @classmethod
  def from_config(cls, config, custom_objects=None):
    config = dict(config)
    layers = [keras.saving.deserialize_keras_object(
        l, custom_objects=custom_objects) for l in config.pop("layers")]
    return cls(layers, **config)


def _chain_layers(layers, caller):
  """`layers` as a list of Keras layers: a `keras.Sequential`'s own, or the
  given iterable's; TypeError otherwise."""
  if isinstance(layers, keras.Sequential):
    layers = layers.layers
  elif isinstance(layers, keras.layers.Layer):
    raise TypeError(
        f"{caller} needs a list of Keras layers or a keras.Sequential; got "
        f"one {type(layers).__name__}. Pass [layer] for a chain of one.")
  layers = list(layers)
  bad = [l for l in layers if not isinstance(l, keras.layers.Layer)]
  if not layers or bad:
    raise TypeError(
        f"{caller} needs a non-empty list of Keras layers or a "
        f"keras.Sequential; got "
        f"{[type(l).__name__ for l in bad] or 'an empty list'}.")
  return layers


def remat_sequential(layers, segments=None, budget=None, sample_input=None,
                     verbose=1, budget_bytes=None):
  """A Keras layer running `layers` in order, with chosen rematerialization.

  Either uniform segments:

    chain = tfremat.remat_sequential(blocks, segments="sqrt")

  or the planner's choice for a memory budget, measured on a sample batch:

    chain = tfremat.remat_sequential(blocks, budget="50%", sample_input=x)
    print(chain.plan)

  Args:
    layers: Keras layers, each taking the previous one's output, or a
      `keras.Sequential` of them.
    segments: an int, or "sqrt" for about sqrt(len(layers)) equal segments,
      every one rematerialized (Chen et al. 2016).
    budget: instead of `segments`, a budget for a training step's peak
      memory (`tfremat.measure.peak_bytes`): bytes as an int or a string
      with a unit ("200MiB"), or a fraction of the measured peak of keeping
      everything, as a float in (0, 1] or a percentage ("50%"). The chain is
      measured on `sample_input`, and the planner picks the fastest choice
      that fits, checked by measurement (`checked_plan`). Every variable of
      `layers` is left as it was.
    sample_input: a batch like the ones the chain will train on.
    verbose: 1 shows a progress bar while the chain is measured; 0 shows
      nothing.
    budget_bytes: the older name of `budget`.

  Returns:
    A `RematSequential` layer; `.plan` holds the planner's Plan when a budget
    was given (also after saving and loading), else None.

  Raises:
    ValueError, TypeError: bad arguments, before anything is measured.
  """
  if budget_bytes is not None:
    if budget is not None:
      raise ValueError("remat_sequential: give budget or budget_bytes (its "
                       "older name), not both.")
    budget = budget_bytes
  if (segments is None) == (budget is None):
    raise ValueError(
        "remat_sequential: give either segments (an int or \"sqrt\") or "
        "budget with sample_input, not both or neither.")
  layers = _chain_layers(layers, "remat_sequential")
  if segments is not None:
    return RematSequential(layers,
                           planner.uniform_segments(len(layers), segments))
  budget = planner.Budget.parse(budget)
  if sample_input is None:
    raise ValueError(
        "remat_sequential: budget needs sample_input, a batch to measure the "
        "layers on.")
  chosen = checked_plan(layers, budget, sample_input, verbose=verbose)
  return RematSequential(layers, chosen.segments, plan=chosen)


def checked_plan(layers, budget, sample_input, rounds=4, costs=None,
                 verbose=0):
  """The planner's plan for `layers`, checked against measurements.

  The cost model's peaks are estimates: on the benchmark's models they were
  8-14% above (residual MLP blocks) and from 4% below to 5% above
  (transformer blocks) the measured ones. A model that is too high costs time (more is
  rematerialized than needed); one that is too low breaks the budget. So:

  1. Keeping everything is measured and chosen if it fits (within
     `planner.MEASUREMENT_SLACK`, for a peak's call-to-call variation).
  2. That measurement calibrates the model: plans are made for the budget
     times (predicted / measured peak of keeping everything).
  3. Each plan's training step is measured on `sample_input`, and the model
     is recalibrated on it: the next target is that plan's predicted peak
     times budget / its measured peak (below its predicted peak if it did
     not fit). This stops after `rounds` plans, when a plan fits and no
     faster one is predicted to, or when a target gives a plan already
     measured.

  The result is the fastest (by the model) plan measured within the budget,
  else the lowest one within the slack. It carries `measured_peak_bytes` and
  `measured_keep_peak_bytes`.

  Args:
    layers: the chain: Keras layers or a `keras.Sequential`.
    budget: the budget for a training step's peak, in any form
      `planner.Budget.parse` reads (bytes, "200MiB", 0.5, "50%"); a fraction
      is of the measured peak of keeping everything.
    sample_input: the batch to measure on.
    rounds: how many plans to measure at most.
    costs: `planner.measure_chain(layers, sample_input)`, if already known.
    verbose: 1 shows a progress bar over the measurements.

  Every variable of `layers` is left as it was: measuring runs training
  steps, which move BatchNormalization statistics and advance dropout seed
  generators, so their values are put back afterwards.

  Raises:
    ValueError: no plan fits (the message gives the smallest budget that
      the calibrated model predicts to fit), or none measured within the
      budget.
  """
  layers = _chain_layers(layers, "checked_plan")
  budget = planner.Budget.parse(budget)
  steps = (len(layers) + (len(layers) > 1) if costs is None else 0) + 1
  progress = measure.progress_bar(steps + rounds, "measurement", verbose)
  with _variables_restored(layers, sample_input):
    chosen, keep_peak = _measured_plan(layers, budget, sample_input, rounds,
                                       costs, progress)
  chosen.budget, chosen.budget_bytes = budget, budget.bytes_given(keep_peak)
  chosen.measured_keep_peak_bytes = keep_peak
  if progress is not None:
    progress.update(progress.target, finalize=True)
  return chosen


@contextlib.contextmanager
def _variables_restored(layers, sample_input):
  """Puts every variable of `layers` back as it was when the block ends.

  Unbuilt layers are built first by an inference call, which changes no
  state, so that their variables exist to be restored.
  """
  x = sample_input
  for layer in layers:
    x = layer(x)
  del x  # Held through the measurements, it would shift their peaks.
  variables = [v for layer in layers for v in layer.variables]
  values = [np.array(v.numpy()) for v in variables]
  try:
    yield
  finally:
    for variable, value in zip(variables, values):
      variable.assign(value)


def _measured_plan(layers, budget, sample_input, rounds, costs, progress):
  """`checked_plan`'s measuring and planning: (the plan, the measured peak of
  keeping everything)."""
  if costs is None:
    costs = planner.measure_chain(layers, sample_input, progress=progress)

  def measured(plan):
    plan.measured_peak_bytes = planner.measure_peak(
        RematSequential(layers, plan.segments), sample_input)
    if progress is not None:
      progress.add(1)
    return plan

  # Keeping everything is the fastest plan; use it whenever it really fits,
  # whatever the model predicts.
  keep = measured(planner.Plan(costs, planner.keep_all(len(layers))))
  budget_bytes = budget.bytes_given(keep.measured_peak_bytes)
  limit = budget_bytes * planner.MEASUREMENT_SLACK
  if keep.measured_peak_bytes <= limit:
    return keep, keep.measured_peak_bytes
  scale = keep.peak_bytes / max(1, keep.measured_peak_bytes)
  target, tried = int(budget_bytes * scale), {}
  for _ in range(rounds):
    try:
      chosen = planner.plan(costs, target)
    except ValueError:
      if tried:
        break  # The model has no smaller plan; use what was measured.
      raise planner.infeasible_budget_error(
          budget_bytes, math.ceil(planner.smallest_budget(costs) / scale),
          "by the cost model calibrated on keeping everything") from None
    key = tuple(chosen.segments)
    if key in tried:
      break  # Converged: this target gives a plan already measured.
    tried[key] = measured(chosen)
    # Recalibrate on this plan: the target at which the model's peak, scaled
    # by this plan's measured / predicted ratio, meets the budget.
    scaled = int(chosen.peak_bytes * budget_bytes /
                 max(1, chosen.measured_peak_bytes))
    if chosen.measured_peak_bytes > budget_bytes:
      target = min(scaled, chosen.peak_bytes - 1)  # Below this plan.
    elif scaled > target:
      target = scaled  # Room left: try a faster plan.
    else:
      break  # It fits, and no faster plan is predicted to.
  # A plan should fit as measured; the slack is for measuring it again.
  fitting = [p for p in tried.values()
             if p.measured_peak_bytes <= budget_bytes]
  if fitting:
    return min(fitting, key=lambda p: p.seconds), keep.measured_peak_bytes
  lowest = min(tried.values(), key=lambda p: p.measured_peak_bytes)
  if lowest.measured_peak_bytes <= limit:
    return lowest, keep.measured_peak_bytes
  raise ValueError(
      f"No plan measured within {budget_bytes / 2**20:.1f} MiB (lowest: "
      f"{lowest.measured_peak_bytes / 2**20:.1f} MiB). Raise the budget.")
