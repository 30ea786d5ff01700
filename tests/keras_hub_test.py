"""KerasHub backbones under a budget (the padding mask every transformer
layer reads is the chain's context, so the layers become the chain's units),
in each remat_model mode, and made inside tfremat.RematScope.

Slow on 2 cores and needs keras-hub (pip install ".[hub]"): CI installs it
and runs these in its second stage.
"""

import warnings

import keras
import pytest
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat import models
from tfremat import planner
from conftest import assert_parity, planned_chain, remat_modes_off
from conftest import scoped_or_plain

keras_hub = pytest.importorskip("keras_hub")

_SIZES = models.HUB_SIZES
_CLASSES = {"gpt2": "GPT2Backbone", "bert": "BertBackbone",
            "llama": "LlamaBackbone", "gemma": "GemmaBackbone"}


def _backbone(name, num_layers=_SIZES["num_layers"]):
  return models.hub_backbone(_CLASSES[name], num_layers)


def _batch(name):
  return models.hub_batch(_CLASSES[name])


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    # 85-114 s each here: with TFREMAT_LONG=1. CI's slow stage runs every
    # mode on GPT-2's (below) and plans budgets on smaller models.
    pytest.param(n, marks=pytest.mark.long)
    for n in ("gpt2", "bert", "llama", "gemma")])
def test_budget_plans_keras_hub_backbones_exactly_and_within_budget(name):
  keras.utils.set_random_seed(0)
  # The plan that peaks lowest with each transformer layer rerun whole (one
  # per segment) holds one layer's working set: with 4 layers its bound
  # (peak, spread and reserve) measured 42%-50.5%
  # of keeping everything. Nested (each layer's attention and feed-forward
  # rerun one at a time), which the planner measures before refusing, about
  # 35%.
  model, batch = _backbone(name), _batch(name)
  planned = tfremat.remat_model(model, budget=0.5, sample_input=batch,
                                verbose=0)
  chain = planned_chain(planned)
  # Each transformer layer is a unit of its own (reading the mask).
  inside = lambda u: (u.unit.layers if isinstance(u, tfremat.chain.ContextUnit)
                      else [u])
  units = {next(i for i, u in enumerate(chain.chain) if layer in inside(u))
           for layer in model.transformer_layers}
  assert len(units) == _SIZES["num_layers"], [u.name for u in chain.chain]
  plan = chain.plan
  assert plan.measured.bound_bytes <= plan.budget_bytes
  assert any(plan.rematerialized), str(plan)
  for mode in ("function", "xla"):
    assert_parity(lambda remat, inputs: (planned if remat else model)(
        inputs, training=True), (batch,), model.trainable_weights, mode,
                  "/CPU:0", state=model.variables)

  @tf.function
  def step(batch):
    with tf.GradientTape() as tape:
      loss = tf.add_n([tf.reduce_sum(y ** 2) for y in tf.nest.flatten(
          planned(batch, training=True))])
    return tape.gradient(loss, planned.trainable_weights)

  peaks = measure.peaks(step, batch, calls=10)
  assert max(peaks) <= plan.budget_bytes, (peaks, str(plan))


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    # TFREMAT_LONG=1 only (92 s for GPT-2 here): nesting below a layer's own
    # floor is planned in CI on a chain (chain_test).
    pytest.param("gpt2", marks=pytest.mark.long),
    pytest.param("gemma", marks=pytest.mark.long)])
def test_a_budget_below_each_layer_alone_plans_nested_exactly(name):
  # 30% is below the lowest plan rerunning whole transformer layers (its
  # peak measured 0.31x-0.36x of keeping everything, and its bound adds the
  # calls' spread and the reserve) and above it nested (0.23x-0.26x): the
  # planner nests the layers' own layers, and the gradients and state stay
  # the original's.
  keras.utils.set_random_seed(0)
  model, batch = _backbone(name), _batch(name)
  planned = tfremat.remat_model(model, budget=0.3, sample_input=batch,
                                verbose=0)
  plan = planned_chain(planned).plan
  assert any(s.nested for s in plan.segments), str(plan)
  assert plan.measured.bound_bytes <= plan.budget_bytes, str(plan)
  for mode in ("function", "xla"):
    assert_parity(lambda remat, inputs: (planned if remat else model)(
        inputs, training=True), (batch,), model.trainable_weights, mode,
                  "/CPU:0", state=model.variables)
  # Nested only while the chain runs: the backbone's layers are as they were.
  everything = model._flatten_layers()  # pylint: disable=protected-access
  assert not any(tfremat.is_remat_in_place(l) for l in everything)


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    # GPT-2's in CI; BERT's, Llama's and Gemma's (61-110 s each here) with
    # TFREMAT_LONG=1.
    "gpt2", pytest.param("bert", marks=pytest.mark.long),
    pytest.param("llama", marks=pytest.mark.long),
    pytest.param("gemma", marks=pytest.mark.long)])
def test_every_mode_is_exact_and_peaks_at_most_the_original(name):
  keras.utils.set_random_seed(0)
  model, batch = _backbone(name), _batch(name)
  modes = {"full": {}, "larger_than": dict(sample_input=batch),
           "activations": {}}
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    remat = {mode: tfremat.remat_model(model, mode, **kwargs)
             for mode, kwargs in modes.items()}
  selected_nothing = {m for m in modes
                      for w in caught if f"mode={m!r} selects no" in str(
                          w.message)}
  # Llama's and Gemma's feed-forward activations (silu, gelu through their
  # own functions) free nothing recomputed; "activations" says so.
  assert selected_nothing == ({"activations"} if name in ("llama", "gemma")
                              else set()), [str(w.message) for w in caught]
  # Where one of the backbone's layers cannot give its configuration (in
  # keras-hub 0.32, Llama's), the results cannot be saved, and say so.
  unsaveable = {str(w.message) for w in caught
                if "cannot be saved" in str(w.message)}
  assert bool(unsaveable) == _config_fails(model.transformer_layers[0]), (
      unsaveable)
  for mode in ("function", "xla"):
    assert_parity(lambda remat_, inputs: (remat["full"] if remat_ else model)(
        inputs, training=True), (batch,), model.trainable_weights, mode,
                  "/CPU:0", state=model.variables)
  steps = {m: chain.training_step(r) for m, r in
           [("original", model)] + sorted(remat.items())}
  peaks = {m: [] for m in steps}
  for _ in range(2):  # Alternated: none always runs on another's leftovers.
    for m, step in steps.items():
      peaks[m] += measure.peaks(step, batch, calls=3)
  # The original's peak moves between calls (83-89 MiB on GPT2 with 4
  # layers: executor orderings); a mode that keeps the same tensors moves
  # within that range. (A mode that selects nothing runs the original's
  # program: its peaks say nothing more.)
  original = max(peaks["original"])
  noise = original - min(peaks["original"])
  for m in set(modes) - selected_nothing:
    assert max(peaks[m]) <= original + noise, (m, peaks)
  # Measured: "full" and "larger_than" 0.34x-0.40x with 4 layers;
  # "activations" on GPT2 and BERT 0.73x with 8 layers (0.77x with 4): their
  # blocks hand their gelu to the feed-forward Dense they make (recomputing
  # the blocks' own attribute alone recomputed nothing: 1.00x).
  for m in ("full", "larger_than"):
    assert max(peaks[m]) <= 0.5 * original, (m, peaks)
  if name in ("gpt2", "bert"):
    assert max(peaks["activations"]) <= 0.85 * original, peaks


def _config_fails(layer):
  try:
    layer.get_config()
    return False
  except AttributeError:
    return True


@pytest.mark.slow
def test_a_backbone_rematerialized_in_place_keeps_its_own_saving(tmp_path):
  keras.utils.set_random_seed(0)
  model, batch = _backbone("llama"), _batch("llama")
  model.save(tmp_path / "original.keras")
  expected = model(batch)
  tfremat.remat_in_place(model.transformer_layers)
  model.save(tmp_path / "in_place.keras")
  loaded = keras.models.load_model(tmp_path / "in_place.keras")
  assert type(loaded) is type(model)
  loaded.set_weights(model.get_weights())
  assert float(tf.reduce_max(tf.abs(loaded(batch) - expected))) == 0.0


@pytest.mark.slow
def test_a_backbone_made_in_remat_scope_is_exact_and_peaks_lower():
  keras.utils.set_random_seed(0)
  names = [f"transformer_layer_{i}" for i in range(_SIZES["num_layers"])]
  with tfremat.RematScope(mode="list_of_layers", layer_names=names):
    model = _backbone("gpt2")
  assert [l.name for l in model.transformer_layers] == names
  batch = _batch("gpt2")
  for mode in ("function", "xla"):
    assert_parity(scoped_or_plain(model), (batch,), model.trainable_weights,
                  mode, "/CPU:0", state=model.variables)
  step = chain.training_step(model)
  scoped = measure.peaks(step, batch, calls=3)
  with remat_modes_off(model):
    original = measure.peaks(chain.training_step(model), batch, calls=3)
  # Measured with 4 layers: 29-31 MiB against 85-87 MiB.
  assert max(scoped) <= 0.6 * min(original), (scoped, original)


@pytest.mark.slow
def test_a_gemma_backbone_is_planned_on_the_executor():
  # The plan's check runs in a step traced for any shape, its variants in a
  # tf.switch_case. Where a rerun recomputed the shapes it read rather than
  # keeping them (as it does under XLA), a Gemma layer's rerun in a branch
  # captured an eager tensor, and TensorFlow's cond gradient raised
  # "Tensor.graph is undefined when eager execution is enabled".
  keras.utils.set_random_seed(0)
  model, batch = _backbone("gemma"), _batch("gemma")
  planned = tfremat.remat_model(model, budget=0.5, sample_input=batch,
                                verbose=0)
  plan = planned_chain(planned).plan
  assert plan.measured.peak_bytes <= plan.budget_bytes, str(plan)
