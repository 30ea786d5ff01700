"""remat_in_place: layers rematerialized inside the user's own model."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat import planner
from tfremat._src.keras_api import chain_layers
from conftest import DEVICE_MODES, assert_parity, load_example


def _model(blocks=3, width=32, dropout=0.3):
  """A functional model of residual blocks with dropout and batch norm,
  whose blocks take a mask by keyword, as a transformer's do."""
  keras.utils.set_random_seed(0)
  x = keras.Input((8, width))
  mask = keras.Input((8, 1))
  h, parts = x, []
  for i in range(blocks):
    inp = keras.Input((8, width))
    m = keras.Input((8, 1))
    y = keras.layers.Dense(4 * width, activation="gelu")(inp)
    y = keras.layers.Dropout(dropout, seed=10 + i)(y)
    y = keras.layers.BatchNormalization()(y)
    y = keras.layers.Dense(width)(y) * m
    block = keras.Model([inp, m], inp + y, name=f"block{i}")
    parts.append(block)
    h = block([h, mask])
  return keras.Model([x, mask], h, name="stack"), parts


@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_gradients_and_state_equal_the_plain_model(device, mode):
  model, blocks = _model()
  x = tf.random.stateless_normal([4, 8, 32], seed=[1, 2])
  mask = tf.cast(tf.random.stateless_uniform([4, 8, 1], seed=[3, 4]) > 0.3,
                 tf.float32)

  def call(remat, x, mask):
    if remat:
      tfremat.remat_in_place(blocks)
    else:
      tfremat.undo_remat_in_place(blocks)
    return model([x, mask], training=True)

  assert_parity(call, (x, mask), model.trainable_variables, mode, device,
                state=model.variables)
  assert all(tfremat.is_remat_in_place(b) for b in blocks)


@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_nested_sublayers_give_the_plain_gradients_and_state(device, mode):
  model, blocks = _model()
  x = tf.random.stateless_normal([4, 8, 32], seed=[1, 2])
  mask = tf.cast(tf.random.stateless_uniform([4, 8, 1], seed=[3, 4]) > 0.3,
                 tf.float32)

  def call(remat, x, mask):
    if remat:
      tfremat.remat_in_place(blocks, nested=True)
    else:
      tfremat.undo_remat_in_place(blocks)
    return model([x, mask], training=True)

  assert_parity(call, (x, mask), model.trainable_variables, mode, device,
                state=model.variables)
  inside = [l for b in blocks for l in b.layers
            if not isinstance(l, keras.layers.InputLayer)]
  # Dense, Dropout, BatchNormalization and Dense in each block.
  assert len(inside) == 4 * len(blocks)
  assert all(tfremat.is_remat_in_place(l) for l in blocks + inside)
  tfremat.undo_remat_in_place(blocks)
  assert not any(tfremat.is_remat_in_place(l) for l in blocks + inside)


def test_the_planner_nests_layers_with_composite_layers_of_their_own():
  # A block of MLPs is worth nesting (so is a transformer layer, whose
  # attention has layers of its own: keras_hub_test). A chain of single
  # layers (a convolution, its normalization, its activation) keeps little
  # inside each beyond its input, which the plain rerun holds anyway.
  from tfremat._src.keras_api import in_place  # pylint: disable=g-import-not-at-top
  mlp = lambda: keras.Sequential([keras.layers.Dense(8, activation="gelu"),
                                  keras.layers.Dense(4)])
  assert in_place.can_nest(keras.Sequential([mlp(), mlp()]))
  assert not in_place.can_nest(keras.Sequential([
      keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
      keras.layers.ReLU()]))
  assert not in_place.can_nest(keras.Sequential([mlp()]))  # One: no gain.
  # A remat_model unit around one layer (a transformer layer cut out of a
  # backbone) nests that layer's own layers.
  x = keras.Input((16,))
  block = keras.Sequential([mlp(), mlp()])
  unit = keras.Model(x, block(x))
  assert chain_layers.nest_target(unit) is block
  assert chain_layers.nest_target(chain.ContextUnit(unit, [])) is block


def test_nested_leaves_layers_named_themselves_to_their_own_undo():
  _, blocks = _model(blocks=1)
  dense, dropout = [l for l in blocks[0].layers
                    if not isinstance(l, keras.layers.InputLayer)][:2]
  tfremat.remat_in_place([blocks[0], dense], nested=True)
  assert tfremat.is_remat_in_place(dropout)
  tfremat.undo_remat_in_place(blocks[0])
  assert tfremat.is_remat_in_place(dense)
  assert not tfremat.is_remat_in_place(dropout)
  with pytest.raises(TypeError, match="nested is True or False"):
    tfremat.remat_in_place(blocks, nested="yes")
  assert not tfremat.is_remat_in_place(blocks[0])


def test_model_keeps_its_class_config_and_inference():
  class Stack(keras.Model):  # A model class of the user's own.
    pass

  inner, blocks = _model()
  model = Stack(inner.inputs, inner.outputs)
  config = model.get_config()
  x = tf.random.stateless_normal([4, 8, 32], seed=[1, 2])
  mask = tf.ones([4, 8, 1])
  before = model.predict([x, mask], verbose=0)
  assert tfremat.remat_in_place(blocks, policy="dots_saveable") == blocks
  assert type(model) is Stack and model.get_config() == config
  np.testing.assert_array_equal(model.predict([x, mask], verbose=0), before)
  tfremat.undo_remat_in_place(blocks)
  assert not any(tfremat.is_remat_in_place(b) for b in blocks)


def test_undo_restores_the_mode_a_keras_remat_scope_gave():
  with keras.RematScope(mode="larger_than", output_size_threshold=7):
    dense = keras.layers.Dense(4)
  given = dense._remat_mode  # pylint: disable=protected-access
  tfremat.remat_in_place(dense)
  tfremat.remat_in_place(dense, policy="dots_saveable")  # Twice: still once.
  tfremat.undo_remat_in_place(dense)
  assert dense._remat_mode == given  # pylint: disable=protected-access
  assert "rematerialized_call" not in vars(dense)
  assert not tfremat.is_remat_in_place(dense)


def test_fit_trains_through_the_rematerialized_blocks():
  model, blocks = _model(dropout=0.0)
  tfremat.remat_in_place(blocks)
  x = tf.random.stateless_normal([16, 8, 32], seed=[1, 2])
  mask = tf.ones([16, 8, 1])
  model.compile(optimizer="sgd", loss="mse")
  history = model.fit([x, mask], tf.zeros_like(x), epochs=3, batch_size=8,
                      verbose=0)
  assert history.history["loss"][-1] < history.history["loss"][0]


def _dense_stack(dropout=None):
  """Eight residual Dense(512) -> Dense(64) blocks, with Dropout between
  when given, as a compiled functional model; and the blocks."""
  keras.utils.set_random_seed(0)
  blocks = []
  for _ in range(8):
    layers = [keras.layers.Dense(512, activation="relu")]
    if dropout is not None:
      layers.append(keras.layers.Dropout(dropout))
    blocks.append(keras.Sequential(layers + [keras.layers.Dense(64)]))
  return _residual_model(blocks), blocks


def _mlp_blocks_stack(count, mlps):
  """`count` residual blocks, each `mlps` MLPs in a row (Dense(256, gelu),
  Dropout, Dense(64)), as a compiled functional model; and the blocks."""
  keras.utils.set_random_seed(0)
  blocks = [keras.Sequential([keras.Sequential([
      keras.layers.Dense(256, activation="gelu"),
      keras.layers.Dropout(0.2, seed=mlps * i + j), keras.layers.Dense(64)])
                              for j in range(mlps)]) for i in range(count)]
  return _residual_model(blocks), blocks


def _residual_model(blocks):
  """x + block(x) through `blocks` (width 64), compiled with Adam and MSE."""
  x = keras.Input((64,))
  h = x
  for block in blocks:
    h = h + block(h)
  model = keras.Model(x, h)
  model.compile(optimizer="adam", loss="mse")
  return model


def test_rematerialized_blocks_peak_lower():
  model, blocks = _dense_stack()
  data = tf.random.stateless_normal([2048, 64], seed=[1, 2])

  def peak():  # A new trace: the blocks' call is chosen while tracing.
    return min(measure.peaks(chain.training_step(model), data, calls=3))

  plain = peak()
  tfremat.remat_in_place(blocks)
  rematerialized = peak()
  # Each block keeps a 4 MiB hidden activation without remat.
  assert rematerialized <= 0.5 * plain, (rematerialized, plain)


def test_nested_sublayers_peak_lower_than_the_blocks_alone():
  # Each block is three MLPs (Dense(256, gelu), Dropout, Dense(64)): its
  # rerun alone keeps all three working sets of 4 MiB tensors; nested, it
  # keeps their narrow outputs, and each MLP's own rerun one at a time.
  # Measured: 71-75 MiB alone, 36-41 MiB nested (0.49x-0.57x; keeping
  # everything 333 MiB).
  model, blocks = _mlp_blocks_stack(count=6, mlps=3)
  data = tf.random.stateless_normal([4096, 64], seed=[1, 2])

  def peak():  # A new trace: the blocks' call is chosen while tracing.
    return min(measure.peaks(chain.training_step(model), data, calls=3))

  tfremat.remat_in_place(blocks)
  alone = peak()
  tfremat.remat_in_place(blocks, nested=True)
  nested = peak()
  assert nested <= 0.75 * alone, (nested, alone)


def test_budget_in_place_rematerializes_the_fewest_that_fit():
  model, blocks = _dense_stack(dropout=0.1)
  data = tf.random.stateless_normal([2048, 64], seed=[1, 2])
  before = [w.numpy() for w in model.weights]
  chosen = tfremat.remat_in_place_for_budget(
      model, blocks, 0.7, data, data,
      settings=planner.Settings(check_calls=3))
  assert 0 < len(chosen.layers) < len(blocks), str(chosen)
  assert all(tfremat.is_remat_in_place(b) == (b in chosen.layers)
             for b in blocks)
  assert chosen.measured.peak_bytes <= chosen.step_budget_bytes, str(chosen)
  # Checking trained nothing: every weight and optimizer slot is back.
  assert all(np.array_equal(w.numpy(), b)
             for w, b in zip(model.weights, before))
  assert int(model.optimizer.iterations.numpy()) == 0
  # Later steps stay within what it measured.
  later = measure.peaks(model.train_on_batch, data, data, calls=5)
  assert max(later) <= chosen.budget_bytes, (later, str(chosen))


@pytest.mark.slow
def test_budget_in_place_nests_the_layers_when_they_alone_are_over():
  # Four blocks of four MLPs (Dense(256, gelu), Dropout, Dense(64)), batch
  # 2048. Measured, of the step's peak without remat: the blocks alone
  # 0.29x-0.31x (bound about 33%), nested 0.12x-0.13x (about 15%). It nests
  # only when all the blocks alone measured over the budget.
  model, blocks = _mlp_blocks_stack(count=4, mlps=4)
  data = tf.random.stateless_normal([2048, 64], seed=[1, 2])
  chosen = tfremat.remat_in_place_for_budget(
      model, blocks, "25%", data, data,
      settings=planner.Settings(check_calls=3))
  assert chosen.nested and list(chosen.layers) == blocks, str(chosen)
  assert "4 layer(s), nested, rematerialized" in str(chosen)
  assert all(tfremat.is_remat_in_place(l) for b in blocks for l in b.layers)
  later = measure.peaks(model.train_on_batch, data, data, calls=5)
  assert max(later) <= chosen.budget_bytes, (later, str(chosen))


def test_budget_in_place_below_every_layer_says_so_and_changes_nothing():
  model, blocks = _dense_stack(dropout=0.1)
  data = tf.random.stateless_normal([256, 64], seed=[1, 2])
  with pytest.raises(ValueError, match=r"with all 8 layer\(s\) "
                     r"rematerialized, and nested, nothing fits a budget of "
                     r"1% of the keep-everything peak, .* MiB: the lowest "
                     r"predicted peak of a training step is .* \d+% of "
                     r"keeping everything's") as caught:
    tfremat.remat_in_place_for_budget(
        model, blocks, "1%", data, data,
        settings=planner.Settings(check_calls=2))
  assert isinstance(caught.value, tfremat.errors.BudgetUnreachableError)
  assert (f"{caught.value.lowest_fraction:.0%} of keeping "
          "everything's") in str(caught.value)
  assert not any(tfremat.is_remat_in_place(b) for b in blocks)
  assert not any(tfremat.is_remat_in_place(l) for b in blocks
                 for l in b.layers)
  with pytest.raises(ValueError, match=r"with all 8 layer\(s\) "
                     r"rematerialized, nothing fits a budget"):
    tfremat.remat_in_place_for_budget(
        model, blocks, "1%", data, data,
        settings=planner.Settings(check_calls=2), nested=False)
  assert not any(tfremat.is_remat_in_place(b) for b in blocks)
  # A budget in bytes counts the weights, Adam's two slots and the batch:
  # below them, it is refused once keeping everything is predicted.
  with pytest.raises(ValueError, match=r"training holds .* MiB: weights .* "
                     r"optimizer .* batch .* before a step allocates"):
    tfremat.remat_in_place_for_budget(
        model, blocks, "1KiB", data, data,
        settings=planner.Settings(check_calls=2))
  assert not any(tfremat.is_remat_in_place(b) for b in blocks)
  with pytest.raises(TypeError, match="nested is True or False"):
    tfremat.remat_in_place_for_budget(model, blocks, "1KiB", data, data,
                                      nested=1)
  uncompiled, blocks = _dense_stack(dropout=0.1)
  uncompiled.optimizer = None
  with pytest.raises(ValueError, match="compile the model first"):
    tfremat.remat_in_place_for_budget(uncompiled, blocks, 0.5, data, data)


@pytest.mark.parametrize("given, error, match", [
    ("dense", TypeError, "takes Keras layers"),
    (keras.layers.InputLayer(shape=(3,)), TypeError, "takes Keras layers"),
])
def test_bad_layers_are_refused(given, error, match):
  with pytest.raises(error, match=match):
    tfremat.remat_in_place(given)


def test_keras2_layers_and_bad_policies_are_refused_before_any_change():
  tf_keras = pytest.importorskip("tf_keras")
  with pytest.raises(TypeError, match="Keras 2"):
    tfremat.remat_in_place([tf_keras.layers.Dense(3)])
  dense = keras.layers.Dense(3)
  with pytest.raises(ValueError):
    tfremat.remat_in_place([dense], policy="no_such_policy")
  assert not tfremat.is_remat_in_place(dense)


def _assert_continues_the_prompt(lm):
  # Text after the prompt: generate() stops at the end token, which the
  # padding after a prompt must not be.
  generated = lm.generate("the quick", max_length=16)
  assert generated.startswith("the quick"), generated
  assert len(generated) > len("the quick"), generated


# Minutes on 2 cores, and needs keras-hub (pip install ".[hub]"): with
# TFREMAT_LONG=1.
@pytest.mark.slow
@pytest.mark.long
def test_keras_hub_causal_lm_keeps_its_class_trains_and_generates(tmp_path):
  keras_hub = pytest.importorskip("keras_hub")
  example = load_example("keras_hub_lm")
  lm = example.small_gpt2(keras_hub)
  lm.compile(optimizer="adam", sampler="greedy")
  plain = example.peak_train_bytes(lm, 8)
  tfremat.remat_in_place(lm.backbone.transformer_layers)
  assert type(lm) is keras_hub.models.GPT2CausalLM
  assert example.peak_train_bytes(lm, 8) < 0.8 * plain
  text = example.text(16)
  history = lm.fit(text, batch_size=8, epochs=2, verbose=0)
  assert np.isfinite(history.history["loss"][-1])
  _assert_continues_the_prompt(lm)
  lm.save(tmp_path / "lm.keras")
  again = keras.models.load_model(tmp_path / "lm.keras")
  assert type(again) is keras_hub.models.GPT2CausalLM


# Minutes on 2 cores, and needs keras-hub: with TFREMAT_LONG=1.
@pytest.mark.slow
@pytest.mark.long
def test_keras_hub_causal_lm_nested_peaks_lower_and_still_generates():
  keras_hub = pytest.importorskip("keras_hub")
  example = load_example("keras_hub_lm")
  lm = example.small_gpt2(keras_hub, layers=4, hidden=128, seq_len=128)
  lm.compile(optimizer="adam", sampler="greedy")
  blocks = lm.backbone.transformer_layers
  tfremat.remat_in_place(blocks)
  alone = example.peak_train_bytes(lm, 8)
  tfremat.remat_in_place(blocks, nested=True)
  nested = example.peak_train_bytes(lm, 8)
  # Measured: 19.8 MiB nested against 30.8 MiB alone (86.3 MiB without).
  assert nested <= 0.8 * alone, (nested, alone)
  assert type(lm) is keras_hub.models.GPT2CausalLM
  history = lm.fit(example.text(16), batch_size=8, epochs=1, verbose=0)
  assert np.isfinite(history.history["loss"][-1])
  _assert_continues_the_prompt(lm)


# Minutes on 2 cores, and needs keras-hub: with TFREMAT_LONG=1.
@pytest.mark.slow
@pytest.mark.long
def test_keras_hub_causal_lm_under_a_budget_stays_a_task():
  keras_hub = pytest.importorskip("keras_hub")
  example = load_example("keras_hub_lm")
  lm = example.small_gpt2(keras_hub, layers=4, hidden=128, seq_len=128)
  lm.compile(optimizer="adam", sampler="greedy")
  chosen = tfremat.remat_in_place_for_budget(
      lm, lm.backbone.transformer_layers, 0.6, example.text(8),
      settings=planner.Settings(check_calls=3))
  assert type(lm) is keras_hub.models.GPT2CausalLM
  assert chosen.layers and (
      chosen.measured.peak_bytes <= chosen.step_budget_bytes)
  later = measure.peaks(lm.train_on_batch, example.text(8), calls=5)
  assert max(later) <= chosen.budget_bytes, (later, str(chosen))
  lm.fit(example.text(16), batch_size=8, epochs=1, verbose=0)
  _assert_continues_the_prompt(lm)
