"""The Lingvo-style builder: helpers, and rematerialized stacks' parity."""

import functools
import pydoc

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import measure
from tfremat import builder
from conftest import DEVICE_MODES, assert_trees_close, compile_step


class _Builder(builder.Base):

  def _Block(self, name, dims):
    """Residual: x + Linear(Dropout(relu(Linear(LN(x)) + b)))."""
    return self._Residual(
        name, self._LN("ln", dims), self._Linear("up", dims, 2 * dims),
        self._Bias("bias", 2 * dims), self._Fn("relu", tf.nn.relu),
        self._Dropout("drop", 0.6), self._Linear("down", 2 * dims, dims))

  def _Stack(self, name, dims, blocks, remat):
    subs = [self._Block(f"block{i}", dims) for i in range(blocks)]
    if remat:
      subs = [self._Rematerialize(f"remat{i}", s) for i, s in enumerate(subs)]
    return self._Seq(name, *subs)


def _b(**kwargs):
  return _Builder.Params().Set(random_seed=5, **kwargs).Instantiate()


def _x(*shape):
  return tf.random.stateless_normal(shape, seed=[3, 4])


def test_basic_helpers_compute_what_they_say():
  b = _b()
  x, y = _x(2, 3), _x(2, 3) * 2
  linear = b._Linear("w", 3, 4).Instantiate()
  np.testing.assert_allclose(linear(x), x.numpy() @ linear.w.numpy(),
                             rtol=1e-6)
  assert [w.name for w in linear.weights] == ["w"]
  bias = b._Bias("b", 3).Instantiate()
  bias.b.assign([1.0, 2.0, 3.0])
  np.testing.assert_allclose(bias(x), x.numpy() + [1, 2, 3], rtol=1e-6)
  ln = b._LN("ln", 3).Instantiate()(x).numpy()
  np.testing.assert_allclose(ln.mean(-1), 0, atol=1e-5)
  np.testing.assert_allclose(b._Fn("f", lambda a, c: a * c).Instantiate()(
      x, y), x * y)
  ident = b._Id("i").Instantiate()(x, y)
  assert isinstance(ident, tuple) and ident[1] is y
  assert b._Arg("a", 1).Instantiate()(x, y) is y
  # As Lingvo's: the same inputs to every sub-layer, their output tuples
  # concatenated (issue "Keras and Lingvo users' first hour" [7]).
  par = b._Par("p", b._Id("i"), b._Fn("d", lambda a: 2 * a)).Instantiate()
  one = tf.constant(1.0)
  np.testing.assert_allclose(par(one), (1.0, 2.0))
  pair = b._Par("q", b._Id("i"), b._Fn("s", lambda a, c: a + c)).Instantiate()
  np.testing.assert_allclose(pair(x, y), (x, y, x + y), rtol=1e-6)
  residual = b._Residual("r", b._Fn("d", lambda a: 2 * a)).Instantiate()
  np.testing.assert_allclose(residual(x), 3 * x, rtol=1e-6)
  seq = b._Seq("s", b._Fn("f", lambda a: (a, a + 1)),
               b._Fn("g", lambda a, c: a * c)).Instantiate()
  np.testing.assert_allclose(seq(x), x * (x + 1), rtol=1e-6)


def test_dropout_helper_follows_deterministic_dropout():
  x = tf.ones([50, 50])
  det = _b(deterministic_dropout=True)._Dropout("d", 0.7).Instantiate()
  ker = _b()._Dropout("d", 0.7).Instantiate()
  assert isinstance(det, tfremat.lingvo.builder_layers.DeterministicDropoutLayer)
  assert isinstance(ker, tfremat.lingvo.builder_layers.KerasDropoutLayer)
  for layer in (det, ker):
    assert layer(x, training=False) is x
    kept = layer(x, training=True).numpy() != 0
    assert abs(kept.mean() - 0.7) < 0.05


def _dropout_in_front_of_ten_weights():
  drop = _b(deterministic_dropout=True)._Dropout("d", 0.5).Instantiate()
  dense = keras.layers.Dense(1, use_bias=False, kernel_initializer="zeros")
  inputs = keras.Input((10,))
  return drop, dense, keras.Model(inputs, dense(drop(inputs)))


def test_deterministic_dropout_masks_change_every_fit_step_without_calls():
  # Issue "Keras and Lingvo users' first hour" [9]: with no SetGlobalStep
  # call (the README's snippet), one mask was drawn for all of training and
  # only 3 of these 10 weights ever moved in 20 fit steps.
  tfremat.SetGlobalStep(None)
  _, dense, model = _dropout_in_front_of_ten_weights()
  model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
  model.fit(np.ones([1, 10], "float32"), np.ones([1, 1], "float32"),
            batch_size=1, epochs=20, verbose=0)
  moved = np.count_nonzero(dense.kernel.numpy())
  assert moved == 10, dense.kernel.numpy().ravel()


def test_deterministic_dropout_masks_change_every_call_of_a_custom_loop():
  # [9] also: a tf.function traced before SetGlobalStep kept the constant.
  tfremat.SetGlobalStep(None)
  drop, _, _ = _dropout_in_front_of_ten_weights()
  step = tf.function(lambda x: drop(x, training=True))
  x = tf.ones([4, 10])
  masks = [step(x).numpy() != 0 for _ in range(3)]
  assert not np.array_equal(masks[0], masks[1])
  assert not np.array_equal(masks[1], masks[2])
  assert int(drop.calls.numpy()) == 3
  # With a global step the layer draws Lingvo's seeds from it.
  global_step = tf.Variable(5, dtype=tf.int64)
  tfremat.SetGlobalStep(global_step)
  try:
    tfremat.ResetStepSeed(0)
    expected = tfremat.DeterministicDropout(
        x, 0.5, tfremat.GenerateStepSeedPair(random_seed=5))
    tfremat.ResetStepSeed(0)
    np.testing.assert_array_equal(drop(x, training=True), expected)
  finally:
    tfremat.SetGlobalStep(None)


def test_rep_repeats_with_independent_weights():
  b = _b()
  rep = b._Rep("rep", 3, b._Linear("w", 4, 4), b._Bias("b", 4)).Instantiate()
  assert len(rep.weights) == 6
  w0, w1 = rep.reps[0].subs[0].w, rep.reps[1].subs[0].w
  assert not np.allclose(w0.numpy(), w1.numpy())
  w0.assign(tf.zeros_like(w0))
  assert np.abs(w1.numpy()).sum() > 0
  x = _x(2, 4)
  expected = x
  for r in rep.reps:
    expected = expected @ r.subs[0].w + r.subs[1].b
  np.testing.assert_allclose(rep(x), expected, rtol=1e-5)


def _parity(deterministic, mode, device, make_remat, x):
  """A plain 3-block stack vs `make_remat(builder)`: outputs and gradients."""
  with tf.device(device):
    b = _b(deterministic_dropout=deterministic)
    plain = b._Stack("stack", 8, 3, remat=False).Instantiate()
    remat = make_remat(b).Instantiate()
    # Same weights, in the same order, wrapped or not.
    assert len(remat.weights) == len(plain.weights)
    assert len(remat.trainable_weights) == 15
    remat.set_weights(plain.get_weights())

  def step(layer, x):
    tfremat.ResetStepSeed(0)
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = layer(x, training=True)
      loss = tf.reduce_sum(y * tf.sin(y))
    return y, tape.gradient(loss, [x] + layer.trainable_weights)

  with tf.device(device):
    expected = compile_step(functools.partial(step, plain), mode)(x)
    actual = compile_step(functools.partial(step, remat), mode)(x)
  assert_trees_close(actual, expected)
  return actual


@pytest.mark.parametrize("deterministic", [True, False],
                         ids=["deterministic_dropout", "keras_dropout"])
@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_rematerialized_stack_matches_plain(device, mode, deterministic):
  y, _ = _parity(deterministic, mode, device,
                 lambda b: b._Stack("stack", 8, 3, remat=True), _x(4, 8))
  # Dropout was active: some activations of the last block's body are 0.
  assert np.isfinite(y.numpy()).all()


@pytest.mark.parametrize("segments", [1, 2, "sqrt"])
def test_rematerialize_seq_matches_plain(segments):

  def make(b):
    return b._RematerializeSeq(
        "stack", segments, *[b._Block(f"block{i}", 8) for i in range(3)])

  _parity(True, "function", "/CPU:0", make, _x(4, 8))
  b = _b()
  stack = make(b)
  expected = {1: 1, 2: 2, "sqrt": 2}[segments]
  assert len(stack.sub) == expected
  assert all(s.cls is tfremat.RematerializationLayer for s in stack.sub)


def test_rematerialize_seq_rejects_bad_segments():
  b = _b()
  for bad in (0, 4, "half", 1.5, True):
    with pytest.raises(ValueError, match="segments must be"):
      b._RematerializeSeq("s", bad, b._Id("a"), b._Id("b"), b._Id("c"))


def test_rematerialization_layer_params_wraps_the_instantiated_body():
  b = _b()
  layer = b._Rematerialize("r", b._Linear("w", 3, 2)).Instantiate()
  assert isinstance(layer, tfremat.RematerializationLayer)
  assert isinstance(layer.layer, tfremat.lingvo.builder_layers.LinearLayer)
  assert "body" in tfremat.RematerializationLayer.Params()
  with pytest.raises(ValueError, match="body must be instantiable"):
    tfremat.RematerializationLayer.Params().Set(body=3).Instantiate()


@pytest.mark.parametrize("jit", [False, True], ids=["function", "xla"])
def test_builder_stack_trains_with_fit(jit):

  def model(remat):
    stack = _b(deterministic_dropout=True)._Stack(
        "stack", 8, 2, remat=remat).Instantiate()
    inputs = keras.Input((8,))
    return keras.Model(inputs, keras.layers.Dense(1)(stack(inputs)))

  plain, remat = model(False), model(True)
  remat.set_weights(plain.get_weights())
  initial = plain.get_weights()
  x, y = _x(16, 8).numpy(), _x(16, 1).numpy()
  for m in (plain, remat):
    m.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse",
              jit_compile=jit)
    m.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
  assert_trees_close(remat.get_weights(), plain.get_weights())
  assert not np.allclose(plain.get_weights()[0], initial[0])


@pytest.mark.slow
def test_sqrt_segments_save_memory_on_a_16_layer_stack():
  b = _b(deterministic_dropout=True)
  layers = [b._Block(f"block{i}", 256) for i in range(16)]
  x = tf.random.stateless_normal([2048, 256], seed=[1, 1])
  peaks = {}
  for segments in (None, "sqrt", 16):
    p = (b._Seq("stack", *layers) if segments is None else
         b._RematerializeSeq("stack", segments, *layers))
    stack = p.Instantiate()

    @tf.function
    def step(x, stack=stack):
      with tf.GradientTape() as tape:
        loss = tf.reduce_sum(stack(x, training=True) ** 2)
      return tape.gradient(loss, stack.trainable_weights)

    peaks[segments] = measure.peak_bytes(step, x, calls=1)
  print({k: f"{v / 2**20:.1f} MiB" for k, v in peaks.items()})
  assert peaks["sqrt"] < 0.5 * peaks[None], peaks
  assert peaks[16] < 0.5 * peaks[None], peaks


def test_help_shows_every_helper():
  # [10]: pydoc, and so help(), hides underscore names such as _Seq.
  text = pydoc.render_doc(builder.Base, renderer=pydoc.plaintext)
  helpers = [n for n in vars(builder.Base)
             if n.startswith("_") and not n.startswith("__") and n != "_Layer"]
  assert len(helpers) == 15
  for name in helpers:
    assert f"{name}(name" in text, name
  assert "Connects sub-layers sequentially." in text


def test_a_budget_stack_runs_the_plan_as_it_was_measured():
  # The builder used to rebuild a budget plan from its segments' ranges
  # and policy names: a plan that fit only ordered or nested ran unordered
  # and whole, and a user's own policy ran as the built-in of its name, or
  # not at all. It now runs the plan itself (tfremat.chain.apply_plan).
  own = tfremat.policies.save_only_these_names("hidden")
  costs = [tfremat.planner.LayerCost(
      f"l{i}", forward_seconds=1.0, backward_seconds=2.0, input_bytes=8,
      output_bytes=8, saved_bytes=8, forward_transient_bytes=0,
      backward_transient_bytes=0, weight_grad_bytes=8) for i in range(3)]
  Segment = tfremat.planner.Segment  # pylint: disable=invalid-name
  chosen = tfremat.planner.Plan(costs, [
      Segment(0, 1, True, None, True), Segment(1, 2, False),
      Segment(2, 3, True, own)], ordered=True)
  b = _b()
  # The Params _RematerializeSeq(budget=...) makes once it has planned.
  stack = b._Layer(  # pylint: disable=protected-access
      tfremat.lingvo.layers.PlannedSeqLayer, "stack",
      sub=[b._Block(f"block{i}", 8) for i in range(3)],
      plan=chosen).Instantiate()
  assert stack.plan is chosen
  layer = stack.chain
  assert layer.ordered and layer.gated
  assert [s.nested for s in layer.segments] == [True, False, False]
  assert layer.segments[2].policy is own
  y = stack(_x(4, 8), training=True)
  assert y.shape == (4, 8)
