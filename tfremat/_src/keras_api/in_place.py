"""Rematerialize layers where they are, so that the model keeps its class.

  lm = keras_hub.models.GPT2CausalLM(backbone, preprocessor)
  tfremat.remat_in_place(lm.backbone.transformer_layers)
  lm.fit(strings)          # the same object: fit, generate, save, presets

`remat_model` builds a new functional model around the chosen layers, which
loses a model's own class (a KerasHub task's `generate()`, its preprocessor,
its presets). Here nothing is rebuilt: each chosen layer is given Keras's own
rematerialization hook (the one `keras.RematScope` sets, which on TensorFlow
runs `tf.recompute_grad`), routed to `RematerializeFn` instead, so its
gradients are exact under dropout and its state updates once.
"""

import contextlib
import dataclasses
import functools

import keras
from keras.src.backend.common import global_state
from keras.src.backend.common import remat as keras_remat

from tfremat import errors
from tfremat._src.planning import measure
from tfremat._src.core import policies
from tfremat._src.core import remat
from tfremat._src.planning import search
from tfremat._src import units
from tfremat._src.planning.cost_model import Budget
from tfremat._src.keras_api.layers import keras_layers

__all__ = [
    "remat_in_place",
    "remat_in_place_for_budget",
    "InPlaceBudget",
    "undo_remat_in_place",
    "is_remat_in_place",
]

# Set on a layer remat_in_place rematerializes: its remat mode before.
_MARK = "_tfremat_remat_mode_before"
# Set on a layer rematerialized with nested=True: the sublayers it nested.
_NESTED = "_tfremat_nested_sublayers"


def _hook_missing():
  return not hasattr(keras.layers.Layer, "rematerialized_call")


def sublayers(layer):
  """`layer`'s own layers, one level down, that `remat_in_place` can
  rematerialize (a functional block's layers, a transformer layer's
  attention, feed-forward and normalization layers), in Keras's order."""
  return [l for l in layer._flatten_layers(  # pylint: disable=protected-access
      include_self=False, recursive=False)
          if isinstance(l, keras.layers.Layer) and
          not isinstance(l, keras.layers.InputLayer)]


def remat_in_place(layers, policy=None, nested=False):
  """Rematerializes each of `layers` in its model, without rebuilding it.

  Each layer's call then runs through `RematerializeFn` whenever it trains
  (`training=True`, as in `fit`): its activations are recomputed in the
  backward pass, exactly. Called otherwise (`predict`, `generate()`), it runs
  as before. The model object, its class, its config and its saved file are
  unchanged: a model saved and loaded again is not rematerialized until this
  is called on it again.

  Choose the repeated blocks, whose outputs are small beside what they keep:
  a transformer's blocks (a KerasHub backbone's `transformer_layers`), a
  CNN's stages. Rematerializing a whole model as one layer saves nothing.

  With `nested=True`, each layer's own sublayers (one level down: a
  transformer layer's attention, feed-forward and normalization layers) are
  rematerialized too, inside its rerun. The layer's rerun then keeps only
  their outputs, and each sublayer's activations are recomputed once more
  when its own backward pass comes: a lower peak where a layer holds several
  large working sets, for one more forward pass of its sublayers.

  Args:
    layers: a Keras 3 layer or an iterable of them.
    policy: what each layer keeps from the forward pass instead of
      recomputing it (`tfremat.policies`), or None to keep nothing but its
      inputs (or follow an enclosing `tfremat.policies.scope`).
    nested: also rematerialize each layer's own layers (one level down;
      not Keras input layers), with the same policy.

  Returns:
    The list of layers, now rematerialized.

  Raises:
    TypeError: something other than Keras 3 layers; Keras 2 (tf_keras)
      layers are named as such; `nested` not a bool.
    ValueError: an unknown policy.
    RuntimeError: a Keras without the layer hook this relies on (Keras
      3.9 added it).
  """
  layers = keras_layers(layers, "remat_in_place")
  policy = policies.parsed(policy)
  if _hook_missing():
    raise errors.UnsupportedError(
        f"remat_in_place needs Keras's layer rematerialization hook "
        f"(Layer.rematerialized_call, Keras 3.9 and later); this is Keras "
        f"{keras.__version__}. Upgrade Keras, or use tfremat.remat_model.")
  if not isinstance(nested, bool):
    raise errors.InvalidTypeError(
        f"remat_in_place: nested is True or False; got {nested!r}.")
  for layer in layers:
    _mark(layer, policy)
    if nested:
      inner = [l for l in sublayers(layer) if l not in layers]
      for sublayer in inner:
        _mark(sublayer, policy)
      object.__setattr__(layer, _NESTED, tuple(
          dict.fromkeys(getattr(layer, _NESTED, ()) + tuple(inner))))
  return layers


@contextlib.contextmanager
def sublayers_rematerialized(layers, policy=None):
  """While the block runs, each of `layers`' own layers (`sublayers`) is
  rematerialized as `remat_in_place` does it, unless it already is; after
  it, they run as before. A nested segment of a planned chain
  (`tfremat.planner.Segment.nested`) runs its layers so, in its forward
  pass and again in its rerun. Without Keras's layer hook (before Keras
  3.9), nothing is nested."""
  marked = []
  if not _hook_missing():
    for layer in layers:
      for sublayer in sublayers(layer):
        if not is_remat_in_place(sublayer) and sublayer not in marked:
          _mark(sublayer, policy)
          marked.append(sublayer)
  try:
    yield
  finally:
    for sublayer in marked:
      _unmark(sublayer)


def can_nest(layer):
  """Whether nesting `layer` can lower its rerun's peak: it has at least two
  layers of its own, and one of them has layers of its own (a transformer
  layer's attention, a block's MLP). Nested, a layer reruns keeping its
  input, the output of the layer before it, which the plain rerun holds
  anyway; only what a layer keeps inside it is saved. A chain of single
  layers (a CNN block's convolutions, normalizations and activations)
  keeps little inside each, so nesting it would cost a forward pass for
  next to nothing."""
  own = sublayers(layer)
  return (not _hook_missing() and len(own) >= 2 and
          any(sublayers(l) for l in own))


def _mark(layer, policy):
  """Gives `layer` the hook that rematerializes it."""
  # Attributes of this object only, set past Keras's attribute tracking: the
  # layer's class, config and weights stay as they are. The remat mode a
  # keras.RematScope gave the layer is kept for undo_remat_in_place.
  if not hasattr(layer, _MARK):
    object.__setattr__(layer, _MARK, getattr(layer, "_remat_mode", None))
  object.__setattr__(layer, "_remat_mode",
                     keras_remat.RematMode("full", None, None))
  object.__setattr__(layer, "rematerialized_call",
                     functools.partial(_rematerialized_call, layer, policy))


def undo_remat_in_place(layers):
  """Undoes `remat_in_place` on `layers` (and on the sublayers it nested in
  them): they run as they did before."""
  for layer in keras_layers(layers, "undo_remat_in_place"):
    for sublayer in getattr(layer, _NESTED, ()):
      _unmark(sublayer)
    if hasattr(layer, _NESTED):
      object.__delattr__(layer, _NESTED)
    _unmark(layer)
  return None


def _unmark(layer):
  if hasattr(layer, _MARK):
    object.__delattr__(layer, "rematerialized_call")
    object.__setattr__(layer, "_remat_mode", getattr(layer, _MARK))
    object.__delattr__(layer, _MARK)


def is_remat_in_place(layer):
  """Whether `remat_in_place` rematerializes `layer`."""
  return hasattr(layer, _MARK)


def _training(kwargs):
  """Whether this call trains: its `training` argument, or else the one
  Keras's call context carries for layers whose call takes none."""
  training = kwargs.get("training")
  if training is None:
    context = global_state.get_global_attribute("current_call_ctx")
    training = getattr(context, "training", None)
  return training is not None and training is not False


def _rematerialized_call(layer, policy, call, *args, **kwargs):
  """Keras's hook: returns the function Keras calls in place of `call`."""
  del args, kwargs  # Keras passes them to size outputs; all are chosen here.

  def rematerialized(*args, **kwargs):
    if not _training(kwargs):
      return call(*args, **kwargs)
    outputs, losses = remat.rematerialize_with_losses(
        lambda args, kwargs: call(*args, **kwargs), (args, kwargs),
        on_losses=lambda losses: None, policy=policy)
    for _, loss in losses:  # Sublayers' activity regularizers, as outputs.
      layer.add_loss(loss)
    return outputs

  return rematerialized


@dataclasses.dataclass(frozen=True)
class InPlaceBudget:
  """What `remat_in_place_for_budget` chose and measured, as a value.

  Attributes:
    layers: the layers it left rematerialized (the first `len(layers)` of
      those it was given), a tuple.
    measured: the training step's `tfremat.planner.Measured` peaks so.
    measured_keep: the same with none rematerialized.
    budget_bytes: the budget in bytes.
    nested: whether their own layers are rematerialized too
      (`remat_in_place(layers, nested=True)`).
    search: what was measured to choose it (`tfremat.planner.Search`).
  """
  layers: tuple
  measured: object
  measured_keep: object
  budget_bytes: int
  nested: bool = False
  search: object = dataclasses.field(default=None, compare=False, repr=False)

  def __post_init__(self):
    object.__setattr__(self, "layers", tuple(self.layers))

  def __str__(self):
    mib, keep = units.format_bytes, self.measured_keep.peak_bytes
    nested = ", nested," if self.nested else ""
    return (f"{len(self.layers)} layer(s){nested} rematerialized in place: "
            f"training step peak {mib(self.measured.peak_bytes)} "
            f"({self.measured.peak_bytes / keep:.2f}x of {mib(keep)} "
            f"without), bound {mib(self.measured.bound_bytes)} within the "
            f"budget of {mib(self.budget_bytes)}")


def _state(model):
  """The variables a training step changes: the model's and its optimizer's
  (built first, so that its slots exist before they are saved)."""
  optimizer = model.optimizer
  if not optimizer.built:
    optimizer.build(model.trainable_variables)
  return list(model.variables) + list(optimizer.variables)


def remat_in_place_for_budget(model, layers, budget, x, y=None, policy=None,
                              nested=True, settings=search.DEFAULT_SETTINGS):
  """`remat_in_place` on as few of `layers` as keep a training step within
  `budget`, measured on `model.train_on_batch(x, y)`.

  For a compiled model whose class must stay (a KerasHub task): it measures
  the step with none of `layers` rematerialized, with all, and then searches
  (by halving) for the fewest, taken from the front of `layers` (for a
  chain of repeated blocks, which ones matters little), whose bound fits.
  If even all of them do not fit, it measures them nested
  (`remat_in_place(layers, nested=True)`: slower, lower), unless `nested`
  is False. It chooses through the planner's one budget search: a choice's
  bound (`tfremat.planner.Measured`) is the largest peak of
  `settings.check_calls` steps, plus their spread, plus the reserve. Every
  variable of the model and of its optimizer is put back after measuring,
  and the model's train function is traced anew.

  Args:
    model: a compiled Keras model that `layers` belong to.
    layers: Keras 3 layers of `model`, e.g. a KerasHub backbone's
      `transformer_layers`.
    budget: bytes, a string with a unit ("200MiB"), or a fraction of the
      measured peak with none rematerialized (0.6, "60%").
    x, y: a batch, as `model.train_on_batch` takes it (a KerasHub task
      takes strings and no `y`).
    policy: the save policy of every rematerialized layer.
    nested: whether it may rematerialize the layers' own layers too, when
      the layers alone do not fit.
    settings: the planner's `tfremat.planner.Settings`.

  Returns:
    An `InPlaceBudget`; its `layers` are left rematerialized.

  Raises:
    ValueError: the budget cannot be met even with every layer
      rematerialized (a `tfremat.errors.BudgetUnreachableError`: the
      message and its `lowest_fraction` give the lowest fraction measured),
      or the model is not compiled.
  """
  layers = keras_layers(layers, "remat_in_place_for_budget")
  budget = Budget.parse(budget)
  if not isinstance(nested, bool):
    raise errors.InvalidTypeError(
        f"remat_in_place_for_budget: nested is True or False; got "
        f"{nested!r}.")
  if policy is not None:
    policy = policies.get(policy)
  if getattr(model, "optimizer", None) is None:
    raise errors.InvalidArgumentError(
        "remat_in_place_for_budget measures model.train_on_batch: compile "
        "the model first (model.compile(optimizer=..., loss=...)).")
  n = len(layers)

  def peaks(key):
    count, nest = key
    undo_remat_in_place(layers)
    if count:
      remat_in_place(layers[:count], policy=policy, nested=nest)
    model.make_train_function(force=True)
    try:
      return measure.peaks(model.train_on_batch, x, y,
                           calls=settings.check_calls)
    finally:
      snapshot.restore()
      model.reset_metrics()

  tried = "rematerialized, and nested," if nested else "rematerialized,"
  with measure.restoring(_state(model)) as snapshot:
    try:
      found = search.fit_budget(
          budget, peaks, (0, False),
          lambda budget_bytes, keep: _fewest_that_fit(n, nested),
          rank=lambda key: (key[1], key[0]),  # Unnested, then fewest.
          settings=settings,
          refusal=dict(
              subject=(f"remat_in_place_for_budget: with all {n} layer(s) "
                       f"{tried} nothing fits"),
              fix=("give more of the model's layers, a save policy that "
                   "keeps less, or a smaller batch")))
    finally:
      undo_remat_in_place(layers)
  count, nest = found.chosen.key
  if count:
    remat_in_place(layers[:count], policy=policy, nested=nest)
  model.make_train_function(force=True)
  return InPlaceBudget(layers[:count], found.chosen.measured,
                       found.keep.measured, found.budget_bytes, nested=nest,
                       search=found)


def _fewest_that_fit(n, nested):
  """`remat_in_place_for_budget`'s candidates, for `search.fit_budget`: a
  generator of `((k, nested), why)` for the first k of n layers, sent each
  one's Trial. All n; if they fit, the fewest that fit, by halving; if not
  and `nested`, all n nested."""
  trial = yield (n, False), f"all {n} layers rematerialized"
  if not trial.fits:
    if nested:
      # Every layer alone is over: each layer's rerun holds all of its own
      # layers' working sets at once; nested, one at a time.
      yield (n, True), f"all {n} layers rematerialized, nested"
    return
  low, high = 0, n  # low does not fit; high does.
  while high - low > 1:
    middle = (low + high) // 2
    trial = yield (middle, False), f"the first {middle} rematerialized"
    if trial.fits:
      high = middle
    else:
      low = middle
