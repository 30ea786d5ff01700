"""remat_model: a whole Keras model rematerialized in one call, exactly.

Issue "Rematerialize a whole Keras model in one call": the modes of
`keras.RematScope` ("full", "activations", "larger_than", "list_of_layers")
on a functional transformer LM, a ResNet-style CNN with BatchNormalization
and a model with two inputs; the same layer objects, `fit`, `.keras` files.
"""

import functools
import json
import os
import subprocess
import sys
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import measure
from tfremat import models
from tfremat._src.keras_api.remat_model import RematerializeActivation
from tfremat._src.keras_api.remat_model import chain_units
from tfremat._src.api.remat_model import remat_model
from conftest import DEVICES, FeedForward, assert_parity
from conftest import assert_serves_without_tfremat
from conftest import assert_trees_close, planned_chain


def _resnet():
  keras.utils.set_random_seed(4)
  inputs = keras.Input((8, 8, 3))
  h = keras.layers.Conv2D(8, 3, padding="same", name="stem")(inputs)
  for i in range(2):
    body = keras.layers.Conv2D(8, 3, padding="same", name=f"conv{i}")(h)
    body = keras.layers.BatchNormalization(name=f"bn{i}")(body)
    body = keras.layers.Dropout(0.3, seed=i, name=f"drop{i}")(body)
    h = keras.layers.ReLU()(keras.layers.Add()([h, body]))
  outputs = keras.layers.Dense(
      2, activation="gelu", name="head")(keras.layers.GlobalAveragePooling2D()(h))
  return keras.Model(inputs, outputs), tf.random.stateless_normal(
      [4, 8, 8, 3], seed=[1, 2])


def _two_inputs():
  keras.utils.set_random_seed(5)
  a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
  h = keras.layers.Concatenate()([
      keras.layers.Dense(8, activation="relu", name="da")(a),
      keras.layers.Dense(8, activation="gelu", name="db")(b)])
  h = keras.layers.Dropout(0.5, seed=3)(h)
  # A plain operation on symbolic tensors, recorded beside the layers; it
  # is not a layer to wrap.
  h = h + keras.layers.Dense(16, name="residual")(h)
  model = keras.Model([a, b], keras.layers.Dense(3, name="out")(h))
  return model, [tf.random.stateless_normal([5, 6], seed=[1, 1]),
                 tf.random.stateless_normal([5, 4], seed=[1, 2])]


def _transformer():
  model = models.transformer_lm(32, 8, 16, 2, 2, dropout=0.1, remat=False,
                                seed=6)
  tokens = tf.random.stateless_uniform([2, 8], seed=[3, 4], maxval=32,
                                       dtype=tf.int32)
  return model, tokens


def _wrapped(model):
  """The wrappers in `model`, nested models included."""
  found = []
  for layer in model.layers:
    if isinstance(layer, (tfremat.RematerializationLayer,
                          RematerializeActivation, tfremat.RematSequential)):
      found.append(layer)
    elif isinstance(layer, keras.Model):
      found += _wrapped(layer)
  return found


MODELS = {"resnet": _resnet, "two_inputs": _two_inputs,
          "transformer": _transformer}
MODES = [("full", {}), ("activations", {}),
         ("larger_than", {"output_size_threshold": 10}),
         ("list_of_layers", None)]


def _mode_args(model, mode, kwargs):
  if kwargs is not None:
    return kwargs
  names = [l.name for l in model.layers
           if not isinstance(l, keras.layers.InputLayer)]
  return {"layer_names": names[1::2]}


# Every model in every mode in tf.function; under XLA, each mode once, on a
# different model (the suite's time is bounded).
CASES = ([("function", name, mode) for name in sorted(MODELS)
          for mode in range(len(MODES))] +
         [("xla", "transformer", 0), ("xla", "resnet", 1),
          ("xla", "two_inputs", 2), ("xla", "resnet", 3)])


@pytest.mark.parametrize(
    "step_mode,name,mode,kwargs",
    [(step, name, *MODES[m]) for step, name, m in CASES],
    ids=[f"{step}-{name}-{MODES[m][0]}" for step, name, m in CASES])
@pytest.mark.parametrize("device", DEVICES)
def test_gradients_and_state_equal_the_original_models(
    device, step_mode, name, mode, kwargs):
  with tf.device(device):
    model, x = MODELS[name]()
    rematerialized = remat_model(model, mode, **_mode_args(model, mode, kwargs))
  assert _wrapped(rematerialized), rematerialized.summary()

  def call(remat, inputs):
    return (rematerialized if remat else model)(inputs, training=True)

  # Dropout seed states and BatchNormalization statistics move once, as in
  # the original model.
  assert_parity(call, (x,), model.trainable_weights, step_mode, device,
                state=model.variables)


@pytest.mark.parametrize("name", ["transformer", "resnet"])
def test_a_policy_applies_to_every_unit_and_stays_exact(name):
  model, x = MODELS[name]()
  rematerialized = remat_model(model, "full", policy="dots_saveable")
  units = [l for l in rematerialized.layers
           if isinstance(l, tfremat.RematerializationLayer)]
  # The CNN's layers are grouped into segments of one RematSequential.
  units += [step for l in rematerialized.layers
            if isinstance(l, tfremat.RematSequential) for step in l.steps]
  assert units and all(u.policy == tfremat.policies.dots_saveable
                       for u in units)
  assert_parity(lambda remat, inputs: (rematerialized if remat else model)(
      inputs, training=True), (x,), model.trainable_weights, "function",
                "/CPU:0", state=model.variables)


def test_eager_gradients_equal_the_original_models():
  model, x = _resnet()
  rematerialized = remat_model(model, "full")
  assert_parity(lambda remat, inputs: (rematerialized if remat else model)(
      inputs, training=True), (x,), model.trainable_weights, "eager",
                "/CPU:0", state=model.variables)


def test_modes_choose_what_keras_remat_scope_would():
  model, _ = _resnet()
  kinds = lambda m: [type(l).__name__ for l in m.layers[1:]]
  full = remat_model(model, "full")
  # A chain of single layers is grouped into rematerialized segments (each
  # layer alone would keep its input, the previous layer's output: no
  # memory saved); every layer is in one.
  (chain,) = full.layers[1:]
  assert isinstance(chain, tfremat.RematSequential)
  assert all(s.remat for s in chain.segments) and len(chain.segments) > 1
  inside = [m for u in chain.chain
            for m in (u.layers[1:] if isinstance(u, keras.Model) else [u])]
  assert sorted(l.name for l in inside) == sorted(
      l.name for l in model.layers[1:])
  activations = remat_model(model, "activations")
  # Of the layers with an `activation` (the convolutions' linear one and the
  # head's gelu), the one whose recomputation frees memory.
  assert {l.layer.name for l in activations.layers
          if isinstance(l, RematerializeActivation)} == {"head"}
  with pytest.warns(UserWarning, match="selects no layer"):
    larger = remat_model(model, "larger_than", output_size_threshold=8 * 8 * 8)
  # Outputs of 8x8x8 = 512 elements are not larger than 512; none is.
  assert kinds(larger) == kinds(model)
  larger = remat_model(model, "larger_than", output_size_threshold=511)
  # Grouped as "full" groups them, the units whose outputs are larger; the
  # pooling and the head, smaller, are kept.
  (chain,) = larger.layers[1:]
  names = lambda u: [l.name for l in (
      u.layers[1:] if isinstance(u, keras.Model) else [u])]
  rematerialized = {n for seg in chain.segments if seg.remat
                    for u in chain.chain[seg.start:seg.stop] for n in names(u)}
  assert rematerialized == {l.name for l in model.layers[1:]
                            if np.prod(l.output.shape[1:]) == 512}
  assert not chain.segments[-1].remat
  assert [n for u in chain.chain[chain.segments[-1].start:]
          for n in names(u)] == [l.name for l in model.layers[-2:]]
  listed = remat_model(model, "list_of_layers", layer_names=["conv0", "bn1"])
  assert sorted(l.layer.name for l in listed.layers
                if isinstance(l, tfremat.RematerializationLayer)) == [
                    "bn1", "conv0"]


def test_activations_leaves_activation_layers_as_they_are():
  # Conv2D -> BatchNormalization -> Activation, as ResNet50 and DenseNet121
  # are built. The Activation layer's function recomputed would keep its
  # input, the normalization's output, which the plain step frees: those
  # models peaked at 1.14x and 1.37x. The head's gelu is still recomputed,
  # as keras.RematScope would.
  keras.utils.set_random_seed(3)
  inputs = keras.Input((8, 8, 3))
  h = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
  h = keras.layers.BatchNormalization(name="bn")(h)
  h = keras.layers.Activation("relu", name="relu")(h)
  outputs = keras.layers.Dense(2, activation="gelu", name="head")(
      keras.layers.GlobalAveragePooling2D()(h))
  model = keras.Model(inputs, outputs)
  activations = remat_model(model, "activations")
  assert {l.layer.name for l in activations.layers
          if isinstance(l, RematerializeActivation)} == {"head"}
  x = tf.random.stateless_normal([4, 8, 8, 3], seed=[1, 2])
  assert_parity(lambda remat, h: (activations if remat else model)(
      h, training=True), (x,), model.trainable_weights, "function",
                "/CPU:0", state=model.variables)


def _dense_pairs(activation, blocks=4):
  """Dense(1024, activation) -> Dense(128) blocks at batch 1024: each
  activation's input and output are 4 MiB."""
  keras.utils.set_random_seed(7)
  inputs = keras.Input((128,))
  h = inputs
  for i in range(blocks):
    h = keras.layers.Dense(1024, activation=activation, name=f"up{i}")(h)
    h = keras.layers.Dense(128, name=f"down{i}")(h)
  return keras.Model(inputs, h), tf.random.stateless_normal([1024, 128],
                                                            seed=[1, 2])


def _alternated_peaks(model, rematerialized, x):
  """Peaks of both models' training steps on `x`, 4 calls each, alternated
  so that neither always runs on the other's allocator state."""
  steps = [tfremat.chain.training_step(m) for m in (model, rematerialized)]
  peaks = [[], []]
  for _ in range(2):
    for i, step in enumerate(steps):
      peaks[i] += measure.peaks(step, x, calls=2)
  return peaks


@pytest.mark.parametrize("activation", ["relu", "tanh", "sigmoid", "softmax",
                                        "elu", "linear", "silu", "softplus"])
def test_activations_leaves_functions_whose_gradient_keeps_no_more(
    activation):
  # The gradient of each of these reads only the function's output or only
  # its input. Recomputed, the function keeps its input while the next
  # layer keeps its output: relu and tanh chains peaked at 1.4x of the
  # original's. So "activations" leaves them, and says it selects nothing.
  model, _ = _dense_pairs(activation)
  with pytest.warns(UserWarning, match="selects no layer"):
    rematerialized = remat_model(model, "activations")
  assert not _wrapped(rematerialized)


@pytest.mark.parametrize("activation", ["gelu", "mish"])
def test_activations_recomputes_functions_whose_gradient_keeps_more(
    activation):
  # gelu's and mish's gradients keep intermediates beside the input: those
  # are what recomputing frees.
  model, x = _dense_pairs(activation)
  rematerialized = remat_model(model, "activations")
  assert sorted(l.layer.name for l in _wrapped(rematerialized)) == [
      f"up{i}" for i in range(4)]
  original, remat = _alternated_peaks(model, rematerialized, x)
  # Measured: gelu 49 MiB against 73.5 MiB.
  assert max(remat) < 0.9 * min(original), (original, remat)


@pytest.mark.parametrize("own_activation", [True, False],
                         ids=["block_has_activation", "only_inside"])
def test_activations_recomputes_the_activation_of_layers_inside_a_block(
    own_activation):
  # The block's own `activation` attribute, if it has one, is not what its
  # call runs: swapping it alone recomputed nothing, and GPT2's and BERT's
  # blocks peaked as the original's.
  keras.utils.set_random_seed(8)
  inputs = keras.Input((128,))
  h = inputs
  for i in range(4):
    h = FeedForward(own_activation=own_activation, name=f"ffn{i}")(h)
  model = keras.Model(inputs, h)
  x = tf.random.stateless_normal([1024, 128], seed=[1, 2])
  rematerialized = remat_model(model, "activations")
  assert sorted(l.layer.name for l in _wrapped(rematerialized)) == [
      f"ffn{i}" for i in range(4)]
  assert_parity(lambda remat, h: (rematerialized if remat else model)(
      h, training=True), (x,), model.trainable_weights, "function",
                "/CPU:0")
  original, remat = _alternated_peaks(model, rematerialized, x)
  assert max(remat) < 0.9 * min(original), (original, remat)
  # The blocks' layers are as they were after the calls.
  for i in range(4):
    block = model.get_layer(f"ffn{i}")
    assert block.up.activation is block._function


class _LayerActivation(keras.layers.Layer):
  """A block whose `activation` is a layer with weights, which it calls."""

  def __init__(self, **kwargs):
    super().__init__(**kwargs)
    self.dense = keras.layers.Dense(16)
    self.activation = keras.layers.PReLU()

  def call(self, x):
    return self.activation(self.dense(x))


def test_activations_leaves_an_activation_that_is_a_layer():
  # Swapping it for a function would untrack the layer and its weights;
  # "full" mode rematerializes such a block.
  inputs = keras.Input((8,))
  model = keras.Model(inputs, _LayerActivation(name="block")(inputs))
  weights = len(model.weights)
  with pytest.warns(UserWarning, match="selects no layer"):
    rematerialized = remat_model(model, "activations")
  assert not _wrapped(rematerialized)
  assert len(model.weights) == weights == 3


def test_the_result_trains_the_original_weights_and_saves(tmp_path):
  model, x = _two_inputs()
  rematerialized = remat_model(model, "full")
  assert len(rematerialized.weights) == len(model.weights)
  for a, b in zip(rematerialized.trainable_weights, model.trainable_weights):
    assert a is b
  before = model.get_weights()
  rematerialized.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
  y = np.ones([5, 3], "float32")
  rematerialized.fit(x, y, epochs=2, verbose=0)
  assert not np.allclose(model.get_weights()[0], before[0])
  path = tmp_path / "m.keras"
  rematerialized.save(path)
  loaded = keras.models.load_model(path)  # No custom objects.
  assert_trees_close(loaded.predict(x, verbose=0),
                     model.predict(x, verbose=0))


class _UnconfigurableDense(keras.layers.Dense):
  """A layer whose get_config fails, as keras-hub 0.32's
  LlamaTransformerDecoder's does (it names an attribute it never sets)."""

  def get_config(self):
    return {"units": self.missing_attribute}


class _OwnConfigModel(keras.Model):
  """A functional model that writes its own configuration, as a KerasHub
  backbone does: saving it never asks its layers for theirs."""

  def __init__(self, units=8, **kwargs):
    inputs = keras.Input((4,))
    h = _UnconfigurableDense(units, activation="relu")(inputs)
    super().__init__(inputs, keras.layers.Dense(2)(h), **kwargs)
    self.units = units

  def get_config(self):
    return {"units": self.units, "name": self.name}


def test_a_result_that_cannot_save_says_so_and_names_the_way_out(tmp_path):
  model = _OwnConfigModel()
  model.save(tmp_path / "original.keras")  # The original saves.
  with pytest.warns(UserWarning) as caught:
    rematerialized = remat_model(model, "full")
  message = next((str(w.message) for w in caught
                  if "cannot be saved" in str(w.message)), "")
  for part in ("cannot be saved", "_UnconfigurableDense", "missing_attribute",
               "_OwnConfigModel", "remat_in_place"):
    assert part in message, message
  with pytest.raises(AttributeError):
    rematerialized.save(tmp_path / "rematerialized.keras")
  # A model whose own configuration fails the same way gets no warning:
  # saving it fails without tfremat too.
  inputs = keras.Input((4,))
  plain = keras.Model(inputs, _UnconfigurableDense(2)(inputs))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    remat_model(plain, "full")


def test_activations_wrapper_round_trips_through_a_keras_file(tmp_path):
  model, x = _two_inputs()
  rematerialized = remat_model(model, "activations")
  rematerialized.save(tmp_path / "m.keras")
  loaded = keras.models.load_model(tmp_path / "m.keras")
  assert any(isinstance(l, RematerializeActivation) for l in loaded.layers)
  assert_trees_close(loaded.predict(x, verbose=0),
                     model.predict(x, verbose=0))


@pytest.mark.parametrize("mode", ["full", "activations"])
def test_the_result_exports_and_serves_without_tfremat(tmp_path, mode):
  model, x = _resnet()
  assert_serves_without_tfremat(remat_model(model, mode), x.numpy(), tmp_path)


class _Subclassed(keras.Model):

  def __init__(self):
    super().__init__()
    self.dense = keras.layers.Dense(2)

  def call(self, x):
    return self.dense(x)


def test_bad_arguments_fail_before_anything_is_built():
  model, _ = _resnet()
  layers_before = len(model.layers)
  with pytest.raises(TypeError, match="subclassed model"):
    remat_model(_Subclassed(), "full")
  with pytest.raises(ValueError, match="mode must be one of"):
    remat_model(model, "everything")
  with pytest.raises(ValueError, match=r"no layers named \['conv9'\].*conv0"):
    remat_model(model, "list_of_layers", layer_names=["conv0", "conv9"])
  with pytest.raises(ValueError, match="needs layer_names"):
    remat_model(model, "list_of_layers")
  with pytest.raises(ValueError, match="output_size_threshold must be"):
    remat_model(model, "larger_than", output_size_threshold=-1)
  with pytest.raises(ValueError, match="layer_names is for"):
    remat_model(model, "full", layer_names=["conv0"])
  with pytest.raises(ValueError, match="built model"):
    remat_model(keras.Sequential([keras.layers.Dense(2)]), "full")
  with pytest.raises(ValueError, match="Unknown policy"):
    remat_model(model, "full", policy="dots")
  with pytest.raises(ValueError, match="activation functions only"):
    remat_model(model, "activations", policy="dots_saveable")
  assert len(model.layers) == layers_before


def _flat_transformer_lm(blocks=3, seq_len=8, width=16, vocab=32, batch=4):
  """A transformer LM as one functional model: its blocks' layers inline,
  residual connections and all (no nested block models)."""
  keras.utils.set_random_seed(7)
  tokens = keras.Input((seq_len,), dtype="int32")
  h = keras.layers.Embedding(vocab, width)(tokens)
  streams = [h]
  for i in range(blocks):
    a = keras.layers.LayerNormalization()(h)
    a = keras.layers.MultiHeadAttention(2, width // 2, dropout=0.1,
                                        seed=10 + i)(a, a, use_causal_mask=True)
    h = keras.layers.Add()([h, a])
    f = keras.layers.Dense(2 * width, activation="gelu")(
        keras.layers.LayerNormalization()(h))
    f = keras.layers.Dropout(0.2, seed=20 + i)(keras.layers.Dense(width)(f))
    h = keras.layers.Add()([h, f])
    streams.append(h)
  logits = keras.layers.Dense(vocab)(keras.layers.LayerNormalization()(h))
  model = keras.Model(tokens, logits)
  x = tf.random.stateless_uniform([batch, seq_len], seed=[5, 6],
                                  maxval=vocab, dtype=tf.int32)
  return model, x, streams


def test_chain_units_cut_where_every_path_passes():
  model, _, streams = _flat_transformer_lm()
  cuts, units = chain_units(model)
  # Input, the residual stream after the embedding and after each
  # half-block, the final norm and the logits; never inside an attention or
  # MLP half-block, where the stream and the branch are both live.
  for stream in streams:
    assert any(c is stream for c in cuts)
  assert cuts[0] is model.inputs[0] and cuts[-1] is model.outputs[0]
  assert len(units) == len(cuts) - 1
  resnet, _ = _resnet()
  cuts, units = chain_units(resnet)
  names = [getattr(u, "name", "") for u in units]
  assert names[0] == "stem"  # One layer between two cuts: the layer itself.
  # The two residual blocks are parts (conv, bn, dropout, add, relu each).
  assert sum(isinstance(u, keras.Model) for u in units) == 2


@pytest.mark.slow
def test_budget_plans_a_functional_transformer_with_exact_gradients(tmp_path):
  # Large enough that half its peak is well above allocator granularity.
  # 70%: the lowest bound measured, reserve included,
  # was 62% on a loaded machine.
  model, x, _ = _flat_transformer_lm(blocks=2, seq_len=32, width=32, batch=64)
  planned = remat_model(model, budget="70%", sample_input=x, verbose=0,
                        policies=("dots_with_no_batch_dims_and_masks_saveable",))
  chain = planned_chain(planned)
  plan = chain.plan
  assert plan.measured_peak_bytes <= plan.budget_bytes
  assert any(plan.rematerialized)
  # The key projections' biases have zero gradients up to rounding (softmax
  # ignores a shift shared by a query's scores); their noise is not compared.
  weights = [w for w in model.trainable_weights
             if not w.path.endswith("key/bias")]
  assert len(weights) == len(model.trainable_weights) - 2
  assert_parity(lambda remat, inputs: (planned if remat else model)(
      inputs, training=True), (x,), weights, "function", "/CPU:0",
                state=model.variables)
  # The same layer objects: no copies.
  assert {id(w) for w in planned.trainable_weights} == {
      id(w) for w in model.trainable_weights}
  # It trains with fit, and training it trains the original's weights.
  before = [w.numpy() for w in model.trainable_weights]
  planned.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(
      from_logits=True))
  planned.fit(x, x, epochs=1, verbose=0)
  assert all(np.any(w.numpy() != b)
             for w, b in zip(model.trainable_weights, before)
             if not w.path.endswith("key/bias"))
  path = str(tmp_path / "planned.keras")
  planned.save(path)
  loaded = keras.models.load_model(path)
  np.testing.assert_allclose(loaded(x), planned(x), rtol=1e-5, atol=1e-6)
  assert_serves_without_tfremat(planned, x.numpy(), tmp_path)


def test_two_input_model_plans_after_the_inputs_merge():
  model, x = _two_inputs()
  cuts, _ = chain_units(model)
  assert all(c is not t for c in cuts for t in model.inputs)  # Merged first.
  planned = remat_model(model, budget=1.0, sample_input=x, verbose=0,
                        policies=())
  assert_parity(lambda remat, inputs: (planned if remat else model)(
      inputs, training=True), (x,), model.trainable_weights, "function",
                "/CPU:0", state=model.variables)


def _masked_transformer(blocks=3, seq_len=8, width=16):
  """Token ids and a padding mask in; every block reads the mask, as a
  KerasHub backbone's transformer layers do."""
  keras.utils.set_random_seed(7)
  tokens = keras.Input((seq_len,), dtype="int32", name="token_ids")
  mask = keras.Input((seq_len,), dtype="bool", name="padding_mask")
  h = keras.layers.Embedding(32, width)(tokens)
  for i in range(blocks):
    x, m = keras.Input((seq_len, width)), keras.Input((seq_len,), dtype="bool")
    a = keras.layers.LayerNormalization()(x)
    a = keras.layers.MultiHeadAttention(2, width // 2, dropout=0.2, seed=i)(
        a, a, attention_mask=keras.ops.logical_and(m[:, None, :],
                                                   m[:, :, None]))
    y = x + a
    y = y + keras.layers.Dense(width)(
        keras.layers.Dense(4 * width, activation="gelu")(y))
    h = keras.Model([x, m], y, name=f"block{i}")([h, mask])
  model = keras.Model([tokens, mask], keras.layers.Dense(32)(h))
  data = [tf.random.stateless_uniform([4, seq_len], seed=[1, 2], maxval=32,
                                      dtype=tf.int32),
          tf.sequence_mask([seq_len, 5, 3, seq_len], seq_len)]
  return model, data


def test_a_padding_mask_every_block_reads_does_not_break_the_chain():
  model, _ = _masked_transformer()
  cuts, units = chain_units(model)
  context = [u for u in units if isinstance(u, tfremat.chain.ContextUnit)]
  # Each block is a unit reading the mask: the chain's context.
  assert len(context) == 3 and all(u.context_indices == [0] for u in context)
  with pytest.raises(ValueError, match="call the RematSequential holding it "
                     "with context="):
    context[0](tf.zeros([4, 8, 16]))


@pytest.mark.slow
@pytest.mark.parametrize("step_mode", ["function", "xla"])
def test_budget_plans_blocks_that_read_a_padding_mask_exactly(
    step_mode, tmp_path):
  model, data = _masked_transformer()
  planned = remat_model(model, budget=1.0, sample_input=data, verbose=0,
                        policies=())
  chain = planned_chain(planned)
  assert len(chain.chain) == 4  # Three blocks and the head.
  assert_parity(lambda remat, inputs: (planned if remat else model)(
      inputs, training=True), (data,), model.trainable_weights, step_mode,
                "/CPU:0", state=model.variables)
  # Every unit rematerialized, two blocks in one segment: exact too.
  every = tfremat.RematSequential(chain.chain, [(0, 2, True), (2, 3, True),
                                                (3, 4, True)])
  tokens, mask = (keras.Input(t.shape[1:], dtype=t.dtype) for t in data)
  embed = next(l for l in model.layers
               if isinstance(l, keras.layers.Embedding))
  rematerialized = keras.Model(
      [tokens, mask], every(embed(tokens), context=[mask]))
  assert_parity(lambda remat, inputs: (rematerialized if remat else model)(
      inputs, training=True), (data,), model.trainable_weights, step_mode,
                "/CPU:0", state=model.variables)
  path = str(tmp_path / "planned.keras")
  planned.save(path)
  loaded = keras.models.load_model(path)
  np.testing.assert_allclose(loaded(data), planned(data), rtol=1e-5,
                             atol=1e-6)


def test_budget_errors_name_the_fix():
  model, x, _ = _flat_transformer_lm(blocks=1)
  with pytest.raises(ValueError, match="needs sample_input"):
    remat_model(model, budget="50%")
  with pytest.raises(ValueError, match="leave mode, policy"):
    remat_model(model, "activations", budget="50%", sample_input=x)
  with pytest.raises(ValueError, match="A budget is"):
    remat_model(model, budget="5 parsecs", sample_input=x)
  # A skip from the input to the output: no tensor every path passes.
  inputs = keras.Input((4,))
  skip = keras.Model(inputs, inputs + keras.layers.Dense(4)(
      keras.layers.Dense(4)(inputs)))
  with pytest.raises(ValueError, match="nothing for a budget to choose"):
    remat_model(skip, budget="50%", sample_input=tf.ones([2, 4]))


def _keras2_dense():
  tf_keras = pytest.importorskip("tf_keras")
  model = tf_keras.Sequential([tf_keras.layers.Dense(4, input_shape=(3,))])
  return model, model.layers[0]


def test_keras2_models_and_layers_are_refused_naming_keras2_and_the_way_out():
  model, dense = _keras2_dense()
  calls = [lambda: remat_model(model),
           lambda: remat_model(model, budget=0.5, sample_input=np.ones([2, 3])),
           lambda: tfremat.RematerializationLayer(dense),
           lambda: tfremat.remat_sequential([dense], segments=1)]
  for call in calls:
    with pytest.raises(TypeError, match=r"Keras 2 .*tf_keras.*Keras 3.*"
                       r"RematerializeFn"):
      call()


@pytest.mark.parametrize("mode", ["eager", "function"])
def test_keras2_layers_are_exact_under_rematerialize_fn(mode):
  # What the error above offers instead.
  _, dense = _keras2_dense()
  x = tf.random.stateless_normal([5, 3], seed=[1, 2])
  assert_parity(lambda remat, h: tfremat.RematerializeFn(dense, h)
                if remat else dense(h), (x,), dense.trainable_weights, mode,
                "/CPU:0")


def test_chain_units_is_reachable_from_the_package():
  assert tfremat.chain_units is chain_units


def _unknown_length_model():
  # A sequence model whose length is unknown, as KerasHub backbones are.
  tokens = keras.Input((None,), dtype="int32")
  h = keras.layers.Embedding(50, 16, name="embed")(tokens)
  h = keras.layers.Dense(64, activation="relu", name="up")(h)
  return keras.Model(tokens, keras.layers.Dense(16, name="down")(h))


def test_larger_than_warns_when_it_selects_nothing():
  model = _unknown_length_model()
  # Unknown dimensions count as 1: the largest output has 64 elements.
  with pytest.warns(UserWarning, match=r"selects no layer.*sample_input"):
    same = remat_model(model, "larger_than", output_size_threshold=100)
  assert not _wrapped(same)


def test_larger_than_sizes_outputs_from_a_sample_input():
  model = _unknown_length_model()
  batch = np.zeros([4, 32], "int32")
  # Sized on the batch: embed and down 4*32*16 = 2048, up 8192 elements.
  larger = remat_model(model, "larger_than", output_size_threshold=4000,
                       sample_input=batch)
  kinds = {l.name: type(l).__name__ for l in larger.layers}
  assert kinds["remat_up"] == "RematerializationLayer", kinds
  assert "remat_embed" not in kinds and "remat_down" not in kinds, kinds
  assert_parity(lambda remat, t: (larger if remat else model)(t, training=True),
                (batch,), model.trainable_weights, "function", "/CPU:0")


def test_sample_input_with_a_mode_that_does_not_use_it_is_refused():
  model = _unknown_length_model()
  with pytest.raises(ValueError, match="sample_input is for budget= or"):
    remat_model(model, "full", sample_input=np.zeros([4, 32], "int32"))


def _conv_chain(blocks=10):
  # A CNN as keras.applications builds them: one flat functional model of
  # single layers, each cut a tensor only the next layer reads.
  keras.utils.set_random_seed(7)
  inputs = keras.Input((32, 32, 3))
  h = keras.layers.Conv2D(16, 3, padding="same")(inputs)
  for _ in range(blocks):
    h = keras.layers.Conv2D(16, 3, padding="same")(h)
    h = keras.layers.BatchNormalization()(h)
    h = keras.layers.ReLU()(h)
  outputs = keras.layers.Dense(10)(keras.layers.GlobalAveragePooling2D()(h))
  return keras.Model(inputs, outputs)


def _cnn_modes(model, x):
  """`mode="full"` and `"larger_than"` on the conv chain."""
  return {"full": remat_model(model, "full"),
          "larger_than": remat_model(model, "larger_than", sample_input=x,
                                     output_size_threshold=1000)}


def test_full_mode_groups_a_cnns_layers_exactly():
  # Each layer rematerialized alone keeps its input, which is the previous
  # layer's output: nothing is saved and the reruns cost memory (1.13x-1.37x
  # on keras.applications CNNs). Grouped into segments, the step holds the
  # segments' inputs and one segment's activations.
  model = _conv_chain()
  x = tf.random.stateless_normal([4, 32, 32, 3], seed=[1, 2])
  full = _cnn_modes(model, x)["full"]
  (chain,) = full.layers[1:]
  assert 4 <= len(chain.segments) <= 12, chain.segments
  _assert_exact(model, full, x)


def test_larger_than_groups_a_cnns_selected_layers_exactly():
  # larger_than selected every conv, normalization and activation, and each
  # rematerialized alone raised the peak (1.30x on this chain, 1.22x on
  # MobileNetV2). The selected layers are grouped as "full" groups them; the
  # small layers at the end (pooling, the head) stay kept.
  model = _conv_chain()
  x = tf.random.stateless_normal([4, 32, 32, 3], seed=[1, 2])
  larger = _cnn_modes(model, x)["larger_than"]
  (chain,) = larger.layers[1:]
  assert isinstance(chain, tfremat.RematSequential)
  last = chain.segments[-1]
  assert not last.remat and last.stop - last.start == 2, chain.segments
  assert any(s.stop - s.start > 1 for s in chain.segments if s.remat)
  _assert_exact(model, larger, x)


@pytest.mark.parametrize("given", ["value", "user"])
def test_a_policy_value_groups_a_cnn_as_its_name_does(given, tmp_path):
  # A policy is a value wherever it is given: tfremat.policies.dots_saveable
  # groups as "dots_saveable" does, and so does a user's policy (a `|`
  # combination with save_only_these_names); the model saves and loads.
  model = _conv_chain()
  x = tf.random.stateless_normal([4, 32, 32, 3], seed=[1, 2])
  by_name = remat_model(model, "full", policy="dots_saveable")
  policy = (tfremat.policies.dots_saveable if given == "value" else
            tfremat.policies.dots_saveable |
            tfremat.policies.save_only_these_names("unused"))
  by_value = remat_model(model, "full", policy=policy)
  (named,), (valued,) = by_name.layers[1:], by_value.layers[1:]
  assert isinstance(valued, tfremat.RematSequential)
  assert valued.segments == named.segments
  assert all(tfremat.policies.get(step.policy) == policy
             for step in valued.steps
             if isinstance(step, tfremat.RematerializationLayer))
  _assert_exact(model, by_value, x)
  path = tmp_path / "m.keras"
  by_value.save(path)
  loaded = keras.models.load_model(path)
  assert tfremat.policies.get(loaded.layers[1].policy) == policy
  assert_trees_close(loaded(x), model(x))


def _assert_exact(model, rematerialized, x):
  assert_parity(
      lambda remat, h: (rematerialized if remat else model)(h, training=True),
      (x,), model.trainable_weights, "function", "/CPU:0",
      state=model.variables)


def cnn_peaks():
  """The conv chain's training-step peaks at batch 64, kept and under each
  grouping mode, alternated so that none always runs on another's allocator
  state: {name: bytes}."""
  model = _conv_chain()
  x = tf.random.stateless_normal([64, 32, 32, 3], seed=[1, 2])
  steps = {"kept": model, **_cnn_modes(model, x)}
  steps = {k: tfremat.chain.training_step(m) for k, m in steps.items()}
  peaks = {k: [] for k in steps}
  for _ in range(2):
    for k, step in steps.items():
      peaks[k] += measure.peaks(step, x, calls=2)
  return {k: max(p) for k, p in peaks.items()}


@functools.lru_cache(maxsize=None)
def _cnn_peaks_in_a_new_process(onednn):
  code = ("import json, remat_model_test as t\n"
          "print('PEAKS', json.dumps(t.cnn_peaks()))\n")
  env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=onednn,
             TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  done = subprocess.run([sys.executable, "-c", code], env=env,
                        cwd=os.path.dirname(__file__), capture_output=True,
                        text=True, check=False)
  assert done.returncode == 0, done.stderr[-3000:]
  line = next(l for l in done.stdout.splitlines() if l.startswith("PEAKS "))
  return json.loads(line[len("PEAKS "):])


# What grouping saves on a CNN depends on the convolution kernels: without
# oneDNN (TensorFlow leaves it off on AMD CPUs), Conv2DBackpropFilter takes a
# 32 MiB scratch buffer whatever its size, which at batch 16 was 60% of this
# chain's peak, and grouping saved 2-4% of it. At batch 64 the activations
# dominate on both kernels. Each kernel is measured in a new process, so
# that the result depends neither on the machine's CPU nor on what the
# process ran before.
@pytest.mark.slow
@pytest.mark.parametrize("onednn", ["1", "0"], ids=["onednn", "eigen"])
@pytest.mark.parametrize("mode", ["full", "larger_than"])
def test_grouping_saves_a_quarter_of_a_cnns_peak_on_either_kernel(mode,
                                                                 onednn):
  peaks = _cnn_peaks_in_a_new_process(onednn)
  assert peaks[mode] <= 0.75 * peaks["kept"], peaks


@pytest.mark.slow
def test_budget_on_a_cnn_plans_over_the_groups_exactly(tmp_path):
  # Single layers measured one by one saved nothing alone and took minutes on
  # keras.applications CNNs; the planner chooses between mode="full"'s groups.
  # Batch 64, as cnn_peaks: at 16, with Eigen's kernels, their scratch
  # buffer is most of the step, and beside another test process every plan
  # measured at the keep-everything peak (the lowest bound 105% of it).
  model = _conv_chain()
  x = tf.random.stateless_normal([64, 32, 32, 3], seed=[1, 2])
  planned = remat_model(model, budget=0.9, sample_input=x, verbose=0)
  (chain,) = [l for l in planned.layers
              if isinstance(l, tfremat.RematSequential)]
  assert len(chain.chain) < len(model.layers) - 3
  assert any(isinstance(u, keras.Sequential) and len(u.layers) > 1
             for u in chain.chain)
  plan = chain.plan
  assert any(plan.rematerialized)
  assert plan.measured_peak_bytes <= plan.budget_bytes, str(plan)
  assert_parity(lambda remat, h: (planned if remat else model)(
      h, training=True), (x[:4],), model.trainable_weights, "function",
                "/CPU:0", state=model.variables)
  path = str(tmp_path / "planned_cnn.keras")
  planned.save(path)
  loaded = keras.models.load_model(path)
  np.testing.assert_allclose(loaded(x[:4]), planned(x[:4]), rtol=1e-5,
                             atol=1e-6)


def test_budget_plans_without_keras_warnings():
  # Planning runs parts of the user's model on their batch; a Keras warning
  # there ("The structure of `inputs` doesn't match ...") reads like a
  # mistake of the user's.
  # The benchmark's LM: an embedding model before the blocks, and position
  # ids (a constant) that the chain reads as context.
  model = models.transformer_lm(32, 8, 16, 2, 2, 0.1, remat=False)
  x = np.random.RandomState(0).randint(0, 32, (4, 8)).astype("int32")
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    remat_model(model, budget=1.0, sample_input=x, verbose=0, policies=())
  assert not [str(w.message) for w in caught]
