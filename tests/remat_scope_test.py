"""tfremat.RematScope: keras.RematScope's API, with exact rematerialization.

Layers made inside `keras.RematScope` run through `tf.recompute_grad` on
TensorFlow, whose rerun draws new dropout masks. The same layers made inside
`tfremat.RematScope` run through `RematerializeFn`: gradients and state as
without rematerialization, and layers made elsewhere are left alone.
"""

import keras
import pytest
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat._src.core import remat as remat_lib
from conftest import DEVICE_MODES, FeedForward, assert_parity
from conftest import assert_trees_close, remat_modes_off
from conftest import scoped_or_plain


def _blocks(count=3, width=32, dropout=0.3, activation="gelu"):
  """Residual blocks with dropout and batch norm, as keras.Sequential."""
  return [keras.Sequential([
      keras.layers.Dense(4 * width, activation=activation),
      keras.layers.Dropout(dropout, seed=10 + i),
      keras.layers.BatchNormalization(),
      keras.layers.Dense(width)], name=f"block{i}") for i in range(count)]


def _model(blocks, width=32):
  x = keras.Input((width,))
  h = x
  for block in blocks:
    h = h + block(h)
  return keras.Model(x, h)


@pytest.mark.parametrize("scope_mode, kwargs", [
    ("full", {}), ("larger_than", {"output_size_threshold": 8 * 32}),
    ("activations", {}), ("list_of_layers", {"layer_names": ["block1"]}),
    ("list_of_layers", {"layer_names": ["block0", "block2"],
                        "policy": "dots_saveable"})])
@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_gradients_and_state_equal_the_plain_model(device, mode, scope_mode,
                                                   kwargs):
  keras.utils.set_random_seed(0)
  with tf.device(device):
    with tfremat.RematScope(mode=scope_mode, **kwargs):
      blocks = _blocks()
    model = _model(blocks)
  x = tf.random.stateless_normal([8, 32], seed=[1, 2])
  assert_parity(scoped_or_plain(model), (x,), model.trainable_variables, mode,
                device, state=model.variables)


def test_each_mode_chooses_what_keras_remat_scope_would():
  x = tf.random.stateless_normal([8, 32], seed=[1, 2])

  def count(activation="gelu", **kwargs):
    """How many calls the forward pass rematerializes."""
    keras.utils.set_random_seed(0)
    with tfremat.RematScope(**kwargs):
      blocks = _blocks(count=1, activation=activation)
    with remat_lib.observed_calls() as calls:
      with tf.GradientTape() as tape:
        y = _model(blocks)(x, training=True)
    tape.gradient(y, blocks[0].trainable_variables)
    return len(calls)

  # The block, and inside it each of its four layers.
  assert count(mode="full") == 5
  # Outputs of more than 8 x 32 elements: the three 8 x 128 ones.
  assert count(mode="larger_than", output_size_threshold=8 * 32) == 3
  assert count(mode="list_of_layers", layer_names=["block0"]) == 1
  # gelu's gradient keeps intermediates (recomputing frees them); relu's
  # reads only its output, and the last Dense's is linear.
  assert count(mode="activations") == 1
  assert count(mode="activations", activation="relu") == 0
  assert count(mode=None) == 0


@pytest.mark.parametrize("built_in_scope", [True, False])
def test_activations_reach_a_dense_the_block_makes_in_build(built_in_scope):
  # KerasHub's transformer layers hand their activation to the Dense they
  # make in `build`. Built inside the scope, that Dense has the mode itself;
  # built outside it, the block recomputes the Dense's function. Either way
  # it is recomputed once, not nested.
  x = tf.random.stateless_normal([8, 32], seed=[1, 2])
  keras.utils.set_random_seed(0)
  with tfremat.RematScope(mode="activations"):
    block = FeedForward(name="ffn")
    if built_in_scope:
      block.build(x.shape)
  with remat_lib.observed_calls() as calls:
    with tf.GradientTape() as tape:
      y = block(x, training=True)
  assert len(calls) == 1
  assert tape.gradient(y, block.trainable_variables)[0] is not None
  assert block.up.activation is block.activation


def test_the_innermost_scope_decides_and_keeps_its_policy():
  keras.utils.set_random_seed(0)
  with tfremat.RematScope(mode="full"):
    with keras.RematScope(mode=None):
      plain = _blocks(count=1)
    with tfremat.RematScope(mode="list_of_layers", layer_names=["block0"],
                            policy="dots_saveable"):
      scoped = _blocks(count=1)
  x = tf.random.stateless_normal([8, 32], seed=[1, 2])
  models = _model(plain), _model(scoped)

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      y = models[0](x, training=True) + models[1](x, training=True)
    return tape.gradient(y, scoped[0].trainable_variables)

  with remat_lib.observed_calls() as kept:
    step.get_concrete_function(x)
  # One rematerialized call: the named block, keeping its two products.
  assert len(kept) == 1 and len(kept[0].saver.saved) == 2, kept


def test_layers_made_elsewhere_are_left_to_keras():
  keras.utils.set_random_seed(0)
  with keras.RematScope(mode="full"):
    keras_blocks = _blocks(count=1)
  plain = _blocks(count=1)
  x = tf.random.stateless_normal([8, 32], seed=[1, 2])
  with remat_lib.observed_calls() as calls:
    for blocks in (keras_blocks, plain):
      with tf.GradientTape() as tape:
        y = _model(blocks)(x, training=True)
      tape.gradient(y, blocks[0].trainable_variables)
  assert not calls


def test_inference_runs_plain_and_a_saved_model_loads(tmp_path):
  keras.utils.set_random_seed(0)
  with tfremat.RematScope(mode="full"):
    blocks = _blocks()
  model = _model(blocks)
  x = tf.random.stateless_normal([8, 32], seed=[1, 2])
  with remat_lib.observed_calls() as calls:
    expected = model(x, training=False)
  assert not calls
  model.save(tmp_path / "m.keras")
  loaded = keras.models.load_model(tmp_path / "m.keras")
  assert_trees_close(loaded(x, training=False), expected)


def test_a_scoped_chain_peaks_below_the_plain_one():
  keras.utils.set_random_seed(0)
  with tfremat.RematScope(mode="list_of_layers",
                          layer_names=[f"block{i}" for i in range(8)]):
    blocks = _blocks(count=8, width=64, dropout=0.1)
  model = _model(blocks, width=64)
  x = tf.random.stateless_normal([1024, 64], seed=[1, 2])
  remat = measure.peaks(chain.training_step(model), x, calls=3)
  with remat_modes_off(model):
    plain = measure.peaks(chain.training_step(model), x, calls=3)
  # Each block holds four 1 MiB activations plain, its 256 KiB input
  # rematerialized.
  assert max(remat) < 0.6 * min(plain), (remat, plain)


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="some"), "mode must be one of"),
    (dict(mode="list_of_layers"), "layer_names"),
    (dict(mode="full", layer_names=["a"]), "layer_names is for"),
    (dict(mode="larger_than", output_size_threshold=-1), "output_size"),
    (dict(mode="full", policy="no_such_policy"), "no_such_policy"),
])
def test_bad_arguments_fail_before_any_scope_is_entered(kwargs, match):
  with pytest.raises(ValueError, match=match):
    tfremat.RematScope(**kwargs)
  assert keras.layers.Dense(2)._remat_mode is None  # pylint: disable=protected-access


def test_keras_scopes_eager_gradients_are_another_networks_and_ours_not():
  # keras.RematScope reruns through tf.recompute_grad, which draws new
  # dropout masks: its eager gradients differ from the plain model's by
  # more than rounding. tfremat.RematScope's equal them.
  x = tf.random.stateless_normal([8, 32], seed=[1, 2])

  def gradients(scope):
    keras.utils.set_random_seed(0)
    with scope:
      blocks = _blocks()
    model = _model(blocks)
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(model(x, training=True) ** 2)
    return [g.numpy() for g in tape.gradient(loss, model.trainable_weights)]

  plain = gradients(keras.RematScope(mode=None))
  scale = max(abs(g).max() for g in plain)

  def error(grads):
    return max(abs(a - b).max() for a, b in zip(grads, plain)) / scale

  assert error(gradients(keras.RematScope(mode="full"))) > 0.01
  assert error(gradients(tfremat.RematScope(mode="full"))) < 1e-5
