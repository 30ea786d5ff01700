"""Chains: RematSequential, remat_sequential, measuring a chain, and the
planner's budgets checked against measured peaks."""


import dataclasses
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat import models
from tfremat import planner
from tfremat import policies
from tfremat._src.keras_api import chain_layers
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning import cost_model
from tfremat._src.planning import profile
from tfremat._src.planning.runner import Batch
from conftest import DEVICE_MODES, assert_parity, assert_trees_close
from conftest import StandInRunner, random_costs, sample_chain


@pytest.mark.parametrize("timed", [False, True], ids=["modelled", "timed"])
def test_measure_chain_spreads_the_waiting_cost_by_forward_time(timed):
  blocks = models.residual_mlp(3, 64, dropout=0.0, residual_inside=True)
  x = tf.random.stateless_normal([1024, 64], seed=[1, 4])
  costs = chain.measure_chain(blocks, x, repeats=3, measure_waiting=timed)
  ratios = {round(c.waiting_recompute_seconds / c.forward_seconds, 12)
            for c in costs}
  assert len(ratios) == 1 and min(ratios) >= 0, costs
  if not timed:  # The model's constant: no timing, the same in every run.
    assert ratios == {round(planner.DEFAULT_SETTINGS.waiting_fraction, 12)}

@pytest.mark.parametrize("width_in", [64, 32])
def test_measure_layer_counts_bytes_exactly(width_in):
  # Output shaped as the input (64) or not (32: a CNN's stages and most of
  # its groups change shape).
  keras.utils.set_random_seed(0)
  block = keras.Sequential([keras.layers.Dense(256, activation="relu"),
                            keras.layers.Dense(64)])
  x = tf.random.stateless_normal([512, width_in], seed=[1, 1])
  block(x)
  cost, y = chain.measure_layer(block, x, repeats=2)
  assert cost.input_bytes == 512 * width_in * 4
  assert cost.output_bytes == 512 * 64 * 4
  assert cost.weight_grad_bytes == (width_in * 256 + 256 + 256 * 64 + 64) * 4
  # What the traced backward pass reads of the forward pass's tensors: the
  # hidden relu output (read by both backward matmuls). The input and the
  # output are counted as such, not as saved.
  assert cost.saved_bytes == 512 * 256 * 4, cost
  assert cost.forward_seconds > 0 and cost.backward_seconds >= 0
  assert y.shape == (512, 64)

@pytest.mark.parametrize("channels_in, use_bias",
                         [(32, True), (16, True), (16, False)])
def test_measure_layer_counts_what_a_conv_blocks_backward_pass_reads(
    channels_in, use_bias):
  # Conv2D -> BatchNormalization -> ReLU, its output shaped as its input
  # (32 channels) or not (16). The backward pass reads the convolution's
  # output (BatchNormalization's input) and the batch statistics; the
  # block's input and output are counted as such. Counted from an eager
  # tape, the block changing shape measured 3x that; from the extra peak of
  # a second application, the other measured 1.04x. Without a bias, the
  # convolution's output is computed from the input and a weight alone.
  keras.utils.set_random_seed(0)
  block = keras.Sequential([keras.layers.Conv2D(32, 3, padding="same",
                                                use_bias=use_bias),
                            keras.layers.BatchNormalization(),
                            keras.layers.ReLU()])
  x = tf.random.stateless_normal([8, 32, 32, channels_in], seed=[1, 1])
  block(x)
  cost, _ = chain.measure_layer(block, x, repeats=2)
  conv_output = 8 * 32 * 32 * 32 * 4
  assert conv_output <= cost.saved_bytes <= conv_output + 2**10, cost

def test_measure_layer_counts_a_dropout_mask():
  # Dense(256, relu) -> Dropout -> Dense(64): the backward pass reads the
  # relu output, the dropout's output (the second matmul's input) and its
  # boolean mask, which is computed from a seed and a shape alone.
  keras.utils.set_random_seed(0)
  block = keras.Sequential([keras.layers.Dense(256, activation="relu"),
                            keras.layers.Dropout(0.5),
                            keras.layers.Dense(64)])
  x = tf.random.stateless_normal([512, 64], seed=[1, 1])
  block(x)
  cost, _ = chain.measure_layer(block, x, repeats=1)
  assert cost.saved_bytes == 512 * 256 * (4 + 4 + 1), cost

def test_measure_layer_measures_what_a_loop_keeps():
  # An LSTM's backward pass reads its loop's accumulated tensors, whose
  # size the graph does not give: what it keeps is measured instead.
  keras.utils.set_random_seed(0)
  lstm = keras.layers.LSTM(32, return_sequences=True)
  x = tf.random.stateless_normal([64, 16, 32], seed=[1, 1])
  lstm(x)
  traced = {}
  chain.training_step(lstm, traced=traced).get_concrete_function(x)
  assert profile._saved_bytes(traced) is None  # pylint: disable=protected-access
  cost, _ = chain.measure_layer(lstm, x, repeats=1)
  # Per step at least the gates' activations (4 x 64 x 32 floats).
  assert cost.saved_bytes >= 16 * 4 * 64 * 32 * 4, cost

def test_measure_layer_of_identical_layers_gives_identical_bytes():
  # Read from the traced step, not measured: the same on every run.
  keras.utils.set_random_seed(0)
  blocks = models.residual_mlp(2, 64, dropout=0.1, residual_inside=True)
  x = tf.random.stateless_normal([512, 64], seed=[1, 1])
  first, second = (chain.measure_layer(b, x, repeats=1)[0] for b in blocks)
  assert first.saved_bytes == second.saved_bytes > 0

def test_training_step_loss_reads_the_output():
  # With an incoming gradient built from the output's shape alone, TF prunes
  # the forward ops the backward pass does not read (a rematerialized last
  # segment's whole forward pass), and times and peaks come out too low.
  keras.utils.set_random_seed(0)
  dense = keras.layers.Dense(8)
  x = tf.random.stateless_normal([4, 8], seed=[1, 3])
  y = dense(x)
  grads = chain.training_step(dense)(x)
  # The loss is sum(y**2) / 2, so dL/dx = y W^T and dL/dW = x^T y.
  assert_trees_close(grads[0], tf.matmul(y, dense.kernel, transpose_b=True))
  assert_trees_close(grads[1], tf.matmul(x, y, transpose_a=True))

def test_training_step_of_an_unbuilt_layer_differentiates_its_weights():
  # A layer first built inside the traced step has no weights when the step
  # is made: measured without its weight gradients, an unbuilt chain kept
  # whole peaked below the same chain rematerialized.
  keras.utils.set_random_seed(0)
  dense = keras.layers.Dense(8)
  x = tf.random.stateless_normal([4, 8], seed=[1, 3])
  grads = chain.training_step(dense)(x)
  assert [g.shape for g in grads] == [(4, 8), (8, 8), (8,)]

def test_training_step_takes_a_model_with_several_outputs_and_inputs():
  # KerasHub's BertBackbone takes a dict and returns one: the loss is the
  # sum over every output, and integer inputs get no gradient.
  keras.utils.set_random_seed(0)
  a, b = keras.Input((8,), name="a"), keras.Input((8,), name="b",
                                                  dtype="int32")
  dense = keras.layers.Dense(8)
  h = dense(a + keras.ops.cast(b, "float32"))
  model = keras.Model({"a": a, "b": b}, {"h": h, "twice": 2 * h})
  x = {"a": tf.random.stateless_normal([4, 8], seed=[1, 3]),
       "b": tf.ones([4, 8], tf.int32)}
  y = dense(x["a"] + 1)
  grads = chain.training_step(model)(x)
  # sum(h**2) / 2 + sum((2h)**2) / 2: dL/dh = 5h.
  assert grads[0]["b"] is None
  assert_trees_close(grads[0]["a"],
                     tf.matmul(5 * y, dense.kernel, transpose_b=True))
  assert_trees_close(grads[1], tf.matmul(x["a"] + 1, 5 * y, transpose_a=True))


@pytest.mark.parametrize("segments", [1, 2, "sqrt"])
def test_remat_sequential_segments_match_plain(segments):
  blocks = models.residual_mlp(4, 16, dropout=0.3, residual_inside=True)
  layer = tfremat.remat_sequential(blocks, segments=segments)
  x = tf.random.stateless_normal([8, 16], seed=[2, 2])

  def grads(f):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = f(x)
      loss = tf.reduce_sum(y * tf.sin(y))
    return y, tape.gradient(loss, [x] + layer.trainable_weights)

  def plain(h):
    for b in blocks:
      h = b(h, training=True)
    return h

  state = [v.numpy() for v in layer.variables]
  expected = grads(plain)
  for v, value in zip(layer.variables, state):
    v.assign(value)
  assert_trees_close(grads(lambda h: layer(h, training=True)), expected)

def test_remat_sequential_round_trips_through_a_keras_file(tmp_path):
  blocks = models.residual_mlp(3, 8, dropout=0.0, residual_inside=True)
  layer = tfremat.remat_sequential(blocks, segments=2)
  inputs = keras.Input((8,))
  model = keras.Model(inputs, layer(inputs))
  model.save(tmp_path / "m.keras")
  loaded = keras.models.load_model(tmp_path / "m.keras")
  x = np.ones([2, 8], "float32")
  assert_trees_close(loaded.predict(x, verbose=0), model.predict(x, verbose=0))
  assert loaded.layers[1].segments == layer.segments

def test_remat_sequential_argument_errors():
  blocks = models.residual_mlp(2, 4, dropout=0.0, residual_inside=True)
  with pytest.raises(ValueError, match="either segments"):
    tfremat.remat_sequential(blocks)
  with pytest.raises(ValueError, match="either segments"):
    tfremat.remat_sequential(blocks, segments=1, budget=10)
  with pytest.raises(ValueError, match="needs sample_input"):
    tfremat.remat_sequential(blocks, budget=10)
  with pytest.raises(TypeError, match="takes Keras layers"):
    tfremat.RematSequential([lambda x: x], [(0, 1, True)])
  with pytest.raises(ValueError, match="cover layers"):
    tfremat.RematSequential(blocks, [(0, 1, True)])

def _chain(name):
  if name == "mlp":
    blocks = models.residual_mlp(10, 64, dropout=0.1, residual_inside=True)
    x = tf.random.stateless_normal([2048, 64], seed=[1, 2])
  else:
    embed, blocks, _ = models.transformer_parts(
        128, 64, 64, 4, 4, dropout=0.1)
    x = embed(tf.random.stateless_uniform([16, 64], seed=[1, 2], maxval=128,
                                          dtype=tf.int32))
  return blocks, x

@pytest.mark.parametrize("name", ["tanh", "wide_hidden", "residual_mlp"])
def test_rematerializing_every_layer_peaks_at_most_keeping_everything(name):
  blocks, x = sample_chain(name)
  n = len(blocks)
  keep = tfremat.RematSequential(blocks, planner.keep_all(n))
  every = tfremat.RematSequential(blocks, planner.uniform_segments(n, n))
  peaks = {keep: [], every: []}
  for _ in range(2):  # Alternated, so that neither runs on a cleaner heap.
    for layer in peaks:
      peaks[layer] += chain.measure_peaks(layer, x, calls=5)
  # The allocator counts a free chunk less than twice a request as wholly
  # in use, so one step's peak varies from call to call with what the heap
  # held before; the least of its calls is the closest to the bytes its
  # tensors need. Keeping everything runs unordered, and while another
  # process loads the machine its peak ranged over 1.6x of its least
  # (wide_hidden: 4.88-7.87 MiB, rematerializing every block 5.12-6.49):
  # the least of the rematerialized calls is held to the kept step's
  # typical call, within one block's output: what one recomputed output
  # costs where a layer keeps nothing else (tanh), and what the allocator's
  # rounding moved these near-equal steps by (wide_hidden, whose weight
  # gradients dominate: 4.96 against 4.92 MiB once, under load). The steps
  # this test was written for peaked 1.5-1.8 MiB (1.44x, 1.47x) above.
  slack = x.shape.num_elements() * x.dtype.size
  assert min(peaks[every]) <= np.median(peaks[keep]) + slack, {
      ("every" if l is every else "keep"): [round(p / 2**20, 2) for p in v]
      for l, v in peaks.items()}
  if name == "residual_mlp":  # Here activations dominate: it saves much.
    assert max(peaks[every]) <= 0.5 * min(peaks[keep]), peaks

def test_an_unreachable_fraction_names_the_lowest_and_what_dominates_it():
  # Six blocks whose weight gradients (3 MiB) are half of what keeping
  # everything peaks at or more: every plan's step ends holding them, and
  # every bound adds its reserve, so no plan's bound reaches 35% of that
  # peak. That is known once keeping everything is measured, before any
  # layer is (the costs, asked for only after that, would raise).
  blocks, x = sample_chain("wide_hidden")

  def costs():
    raise AssertionError("a layer was measured for a budget out of reach")

  with pytest.raises(ValueError, match=(
      r"(?s)budget of 35% of the keep-everything peak.*the lowest bound any "
      r"plan can have is .* MiB, \d+% of the keep-everything peak"
      r".*the weight gradients, 3.0 MiB")) as refused:
    chain.checked_plan(blocks, 0.35, x, costs=costs)
  assert [t.candidate.segments for t in refused.value.search.trials] == [
      tuple(planner.keep_all(len(blocks)))]
  # Where the gradients leave room (here they and the reserve are 13% of the
  # peak), the plans are predicted before refusing, and the error gives the
  # lowest predicted peak: rematerializing these layers saves nothing.
  blocks, x = sample_chain("tanh")
  with pytest.raises(ValueError, match=(
      r"(?s)budget of 20% of the keep-everything peak.*the lowest "
      r"predicted peak of a training step is .* MiB plus the executor's "
      r"margin, 5%.*, \d+% of keeping everything's.*"
      r"What every plan holds, by the cost model: ")):
    tfremat.remat_sequential(blocks, budget=0.2, sample_input=x, verbose=0)

def _measured_on_a_fake_clock(dropout, names):
  """measure_layer's cost of a residual MLP block under the policies
  `names`, with a clock that gives the forward pass 1 s, the plain step 2 s
  and the policies' steps 10 s, 20 s, ... in order; and the steps timed."""
  timed = []

  def fake_median_seconds(fns, *args, repeats=5):
    del args, repeats
    timed.extend(fns)
    return [1.0, 2.0] + [10.0 * (i + 1) for i in range(len(fns) - 2)]

  block = models.residual_mlp(1, 16, dropout=dropout, residual_inside=True)[0]
  x = tf.random.stateless_normal([8, 16], seed=[4, 4])
  cost, _ = chain.measure_layer(block, x, repeats=3, policies=names,
                                clock=fake_median_seconds)
  return cost, timed


def test_policies_keeping_the_same_tensors_share_one_timing(monkeypatch):
  # On a layer without softmax, masks_and_softmax_saveable keeps what
  # masks_saveable keeps: timed once, they cannot be told apart by noise.
  # dots_and_masks_saveable keeps more, and is timed on its own. The clock
  # is replaced, so the test reads which steps were timed, not noise (on a
  # layer this small real times clamp to 0 and two can be equal by chance).
  names = ("masks_saveable", "masks_and_softmax_saveable",
           "dots_and_masks_saveable")
  cost, timed = _measured_on_a_fake_clock(0.3, names)
  masks, masks_softmax, dots = (cost.policy_costs[policies.get(n)]
                                for n in names)
  assert len(timed) == 4  # forward, plain step, masks, dots.
  assert masks == masks_softmax
  assert masks[1] == 10.0 - 2.0 and dots[1] == 20.0 - 2.0
  assert dots[0] > masks[0]
  # The printout names what each policy keeps of this layer: a softmax
  # policy keeps no softmax of a block that has none.
  assert [cost.policy_keeps[policies.get(n)] for n in names] == [
      "masks", "masks",
                                                   "dots+masks"]
  plan = planner.Plan([cost], [planner.Segment(
      0, 1, True, policies.masks_and_softmax_saveable)])
  assert "remat 0, keeps masks" in str(plan) and "softmax" not in str(
      plan).split("\n")[1], str(plan)


def test_a_policy_keeping_nothing_of_a_layer_costs_a_full_recompute(
    monkeypatch):
  # Without dropout, masks_saveable keeps nothing of this block: rerun under
  # it, the block runs the program of a full recompute. Its cost is that
  # one's (the forward time), not a timing of its own, which cost a trace
  # per layer while planning and could rank the two programs apart by noise.
  names = ("masks_saveable", "dots_saveable")
  cost, timed = _measured_on_a_fake_clock(0.0, names)
  assert len(timed) == 3  # forward, plain step, dots.
  assert cost.policy_costs[policies.masks_saveable] == [
      0, cost.forward_seconds]
  assert cost.policy_costs[policies.dots_saveable][1] == 10.0 - 2.0
  assert cost.policy_keeps[policies.masks_saveable] == "nothing"


@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_budgets_hold_when_measured(model):
  blocks, x = _chain(model)
  keep = planner.keep_all(len(blocks))
  # Measured as the planner measures plans (gated, the largest of its
  # check calls), so that the budget below is the quantity it checks.
  settings = planner.DEFAULT_SETTINGS
  full = chain.measure_peak(tfremat.RematSequential(blocks, keep, gated=True),
                            x, calls=settings.check_calls)
  # The transformer's plans may also run segments under a save policy: the
  # budget must hold for those as well.
  names = (("dots_with_no_batch_dims_and_masks_saveable",)
           if model == "transformer" else ())
  costs = chain.measure_chain(blocks, x, policies=names)
  assert cost_model.segment_policies(costs) == tuple(map(policies.get, names))
  # Two budgets that make the planner rematerialize much of these short
  # chains (below about 50%, no plan's bound, reserve included, fits
  # them). Short chains keep the suite under 10 minutes.
  for fraction in (0.55, 0.75):
    budget = int(fraction * full)
    chosen = chain.checked_plan(blocks, budget, x, costs=costs)
    # The planner's own check: its plan's bound for later calls.
    assert chosen.measured.bound_bytes <= budget, (fraction, str(chosen))
    # Measured again, on a fresh layer: every call within the budget.
    later = chain.measure_peaks(chain.apply_plan(blocks, chosen), x)
    assert max(later) <= budget, (fraction, later, budget, str(chosen))
    assert any(chosen.rematerialized)
  # A budget over the measured peak by more than its spread and the
  # reserve keeps everything. Reusing the costs: measuring them
  # again took 15 s of this test's 64 on the transformer ("100%" through
  # remat_sequential is test_plan_prints_the_same_after_a_keras_file's).
  chosen = chain.checked_plan(
      blocks, int((1.1 + settings.reserve) * full), x, costs=costs)
  assert not any(chosen.rematerialized), (full, str(chosen))

def _bn_dropout_chain():
  keras.utils.set_random_seed(3)
  layers = [keras.Sequential([keras.layers.Dense(32, activation="relu"),
                              keras.layers.BatchNormalization(),
                              keras.layers.Dropout(0.5, seed=i),
                              keras.layers.Dense(16)]) for i in range(3)]
  x = tf.random.stateless_normal([256, 16], seed=[2, 3]) * 3.0 + 1.0
  return layers, x

def test_planning_leaves_every_variable_as_it_was():
  # Issue "Keras and Lingvo users' first hour" [4]: measuring runs training
  # steps, which moved BatchNormalization statistics (by 2.64 once) and
  # advanced dropout seed generators.
  layers, x = _bn_dropout_chain()
  for layer in layers:
    layer.build((None, 16))
  variables = [v for layer in layers for v in layer.variables]
  assert any("seed_generator" in v.path for v in variables)
  before = [np.array(v.numpy()) for v in variables]
  chain = tfremat.remat_sequential(layers, budget=10**9, sample_input=x)
  assert chain.plan is not None
  for v, value in zip(variables, before):
    np.testing.assert_array_equal(v.numpy(), value, err_msg=v.path)

def test_planning_unbuilt_layers_leaves_their_statistics_initial():
  # [4] Layers the planner builds get the values a build gives them.
  layers, x = _bn_dropout_chain()
  tfremat.remat_sequential(layers, budget="1GiB", sample_input=x)
  norms = [layer.layers[1] for layer in layers]
  for norm in norms:
    np.testing.assert_array_equal(norm.moving_mean.numpy(), 0.0)
    np.testing.assert_array_equal(norm.moving_variance.numpy(), 1.0)

@pytest.mark.parametrize("given,error,match", [
    ("abc", ValueError, "A budget is bytes as an int"),
    ("5 parsecs", ValueError, "A budget is bytes as an int"),
    (float("nan"), ValueError, "fraction of the keep-everything peak"),
    (1.5, ValueError, "fraction of the keep-everything peak"),
    (0.0, ValueError, "fraction of the keep-everything peak"),
    ("150%", ValueError, "percentage budget must be in"),
    (0, ValueError, "must be positive"),
    (-5, ValueError, "must be positive"),
    (True, TypeError, "A budget is bytes as an int"),
    ([100], TypeError, "A budget is bytes as an int")])
def test_bad_budgets_fail_before_anything_is_measured(given, error, match):
  # A chain that raises if it is ever run, so measured.
  blocks = [_Untouchable(), _Untouchable()]
  with pytest.raises(error, match=match):
    tfremat.remat_sequential(blocks, budget=given,
                             sample_input=np.ones([2, 4], "float32"))
  with pytest.raises(error, match=match):
    tfremat.builder.Base.Params().Instantiate()._RematerializeSeq(
        "s", None, budget=given, sample_input=np.ones([2, 4], "float32"))

class _Untouchable(keras.layers.Layer):
  """A layer that fails the test if it is run."""

  def call(self, x):
    raise AssertionError("measured before the budget was checked")


def test_checked_plan_shows_progress_without_escape_codes_in_a_log(capsys):
  costs = random_costs(np.random.default_rng(6), 8)
  runner = StandInRunner(
      lambda c: int(planner.predict(costs, list(c.segments))[0]))
  layers = [keras.layers.Identity() for _ in costs]

  def plan(verbose):
    return budget_lib.plan_budget(
        budget_lib.Chain(tuple(layers)), runner, Batch(tf.zeros([1, 1])),
        0.5, costs=costs, verbose=verbose)

  plan(verbose=1)
  out = capsys.readouterr().out
  assert "unit" in out, out
  assert "\x1b" not in out and "\r" not in out and "\b" not in out, repr(out)
  plan(verbose=0)
  assert capsys.readouterr().out == ""

def test_remat_sequential_accepts_a_keras_sequential():
  blocks = models.residual_mlp(3, 8, dropout=0.0, residual_inside=True)
  chain = tfremat.remat_sequential(keras.Sequential(blocks), segments=3)
  assert chain.chain == blocks
  x = np.ones([2, 8], "float32")
  assert_trees_close(chain(x), keras.Sequential(blocks)(x))
  with pytest.raises(TypeError, match="Pass \\[layer\\]"):
    tfremat.remat_sequential(blocks[0], segments=1)

def test_plan_prints_the_same_after_a_keras_file(tmp_path):
  blocks = models.residual_mlp(3, 16, dropout=0.0, residual_inside=True)
  x = tf.random.stateless_normal([64, 16], seed=[1, 2])
  layer = tfremat.remat_sequential(blocks, budget="100%", sample_input=x,
                                   verbose=0)
  inputs = keras.Input((16,))
  keras.Model(inputs, layer(inputs)).save(tmp_path / "m.keras")
  loaded = keras.models.load_model(tmp_path / "m.keras").layers[1]
  assert str(loaded.plan) == str(layer.plan)
  assert "100% of the predicted peak of keeping" in str(loaded.plan)
  assert loaded.segments == layer.segments


def test_identical_layers_are_measured_once_and_share_their_costs():
  # Four identical blocks (their dropout seeds differ, which changes no
  # cost), then one of another width: the four share one measurement's
  # figures, times included, which two measurements would not give.
  blocks = models.residual_mlp(4, 16, dropout=0.1, residual_inside=True)
  other = keras.Sequential([keras.layers.Dense(24), keras.layers.Dense(16)])
  x = tf.random.stateless_normal([32, 16], seed=[1, 2])
  costs = chain.measure_chain(blocks + [other], x, repeats=1)
  assert [c.name for c in costs] == [l.name for l in blocks + [other]]
  first = dataclasses.replace(costs[0], name="")
  assert all(dataclasses.replace(c, name="") == first for c in costs[1:4])
  assert profile.structure_key(blocks[0], x) != profile.structure_key(
      blocks[0], x[:16])



@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_remat_sequential_matches_plain_in_every_mode(device, mode, ordered):
  # BatchNormalization and dropout in a kept and a rematerialized segment;
  # ordered, a tf.function builds the chain's backward pass itself.
  _assert_chain_parity([(0, 1, False), (1, 3, True)], ordered, mode, device)


def _assert_chain_parity(segments, ordered, mode, device):
  """A RematSequential of `_bn_dropout_chain` under `segments` gives the
  plain chain's gradients and state in `mode`; returns the chain's layers."""
  layers, x = _bn_dropout_chain()
  layer = tfremat.RematSequential(layers, segments, ordered=ordered)
  layer(x)  # Builds; inference changes no state.

  def call(remat, h):
    if remat:
      return layer(h, training=True)
    for l in layers:
      h = l(h, training=True)
    return h

  assert_parity(call, (x,), layer.trainable_weights, mode, device,
                state=layer.variables)
  return layers


@pytest.mark.parametrize("policy", [None, "dots_saveable"])
@pytest.mark.parametrize("device, mode", DEVICE_MODES)
def test_nested_segments_match_plain_in_every_mode(device, mode, policy):
  # Each block's own layers (BatchNormalization and dropout among them) are
  # rematerialized inside the block's rerun; one segment holds two blocks.
  layers = _assert_chain_parity(
      [(0, 1, True, policy, True), (1, 3, True, policy, True)], True, mode,
      device)
  # The blocks' own layers are rematerialized only while the chain runs.
  assert not any(tfremat.is_remat_in_place(l)
                 for block in layers for l in block.layers)


def test_nested_segments_round_trip_through_a_keras_file(tmp_path):
  layers, x = _bn_dropout_chain()
  layer = tfremat.RematSequential(layers, [(0, 1, False), (1, 3, True, None,
                                                          True)])
  inputs = keras.Input((16,))
  model = keras.Model(inputs, layer(inputs))
  model.save(tmp_path / "m.keras")
  loaded = keras.models.load_model(tmp_path / "m.keras").layers[1]
  assert loaded.segments == layer.segments
  assert loaded.segments[1].nested
  assert_trees_close(loaded(x).numpy(), layer(x).numpy())


@pytest.mark.slow
def test_a_budget_below_every_layer_alone_is_met_nested():
  # Four blocks, each three MLPs (Dense(256, gelu), Dropout, Dense(64)) at
  # batch 2048: a block's rerun holds its three 2 MiB-wide working sets at
  # once, so rematerializing each block alone peaks at 0.30x-0.31x of
  # keeping everything; nested, each MLP reruns alone, at 0.14x-0.16x
  # (2026-11-28, 5 calls each). At 22% the blocks alone are over; nested,
  # the plan fits.
  keras.utils.set_random_seed(0)
  blocks = [keras.Sequential([keras.Sequential([
      keras.layers.Dense(256, activation="gelu"),
      keras.layers.Dropout(0.2, seed=3 * i + j), keras.layers.Dense(64)])
                              for j in range(3)]) for i in range(4)]
  x = tf.random.stateless_normal([2048, 64], seed=[1, 2])
  layer = tfremat.remat_sequential(blocks, budget="22%", sample_input=x,
                                   verbose=0)
  chosen = layer.plan
  assert all(s.remat and s.nested for s in chosen.segments), str(chosen)
  assert chosen.measured.bound_bytes <= chosen.budget_bytes, str(chosen)
  assert "remat 0, nested" in str(chosen)
  later = chain.measure_peaks(layer, x)
  assert max(later) <= chosen.budget_bytes, (later, str(chosen))


def test_ordered_is_kept_in_the_config():
  blocks = models.residual_mlp(2, 8, dropout=0.0, residual_inside=True)
  layer = tfremat.RematSequential(blocks, [(0, 2, True)], ordered=True)
  again = tfremat.RematSequential.from_config(layer.get_config())
  assert again.ordered is True
  assert tfremat.RematSequential(blocks, [(0, 2, True)]).ordered is False


@pytest.mark.parametrize("threads, environment, cpus, one", [
    (1, None, 2, True), (2, None, 1, False), (0, "1", 2, True),
    (0, None, 1, True), (0, None, 2, False)])
def test_one_executor_thread_is_read_from_config_environment_or_cpus(
    monkeypatch, threads, environment, cpus, one):
  monkeypatch.setattr(tf.config.threading,
                      "get_inter_op_parallelism_threads", lambda: threads)
  if environment is None:
    monkeypatch.delenv("TF_NUM_INTEROP_THREADS", raising=False)
  else:
    monkeypatch.setenv("TF_NUM_INTEROP_THREADS", environment)
  monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(cpus)),
                      raising=False)
  assert chain_layers._one_executor_thread() is one  # pylint: disable=protected-access


def test_an_ordered_chain_runs_in_the_executors_order_on_one_thread(
    monkeypatch):
  monkeypatch.setattr(tf.config.threading,
                      "get_inter_op_parallelism_threads", lambda: 0)
  # One inter-op thread keeps one order by itself; the chain's own order
  # then only raised peaks.
  blocks = models.residual_mlp(3, 64, dropout=0.0, residual_inside=True)
  x = tf.zeros([2048, 64])  # 512 KiB activations: large enough to order.
  layer = tfremat.RematSequential(blocks, [(0, 1, True), (1, 3, True)],
                                  ordered=True)

  def control_edges():
    graph = chain.training_step(layer).get_concrete_function(x).graph
    return sum(len(op.control_inputs) for op in graph.get_operations())

  monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "2")
  ordered = control_edges()
  monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "1")
  assert control_edges() < ordered


def test_an_ordered_chains_backward_ops_are_not_colocated(monkeypatch):
  # The tape that differentiates an unordered chain places the backward ops
  # as any other; `tf.gradients` would colocate each with its forward op
  # (the reruns' with their segment's custom-gradient op), which cost
  # tracing and the first call's placement time on every planned chain.
  monkeypatch.setattr(tf.config.threading,
                      "get_inter_op_parallelism_threads", lambda: 0)
  monkeypatch.setenv("TF_NUM_INTEROP_THREADS", "2")
  blocks = models.residual_mlp(3, 64, dropout=0.0, residual_inside=True)
  x = tf.zeros([2048, 64])
  layer = tfremat.RematSequential(blocks, [(0, 1, True), (1, 3, True)],
                                  ordered=True)
  graph = chain.training_step(layer).get_concrete_function(x).graph
  assert sum(len(op.control_inputs) for op in graph.get_operations())
  assert not [op.name for op in graph.get_operations()
              if op.colocation_groups() != [f"loc:@{op.name}".encode()]]


_GELU_CHAIN = """
import keras, tensorflow as tf, tfremat
from tfremat import chain, planner
keras.utils.set_random_seed(0)
gelu = lambda h: keras.activations.gelu(h, approximate=True)
blocks = [keras.Sequential([keras.layers.Dense(256, activation=gelu),
                            keras.layers.Dense(64)]) for _ in range(3)]
layer = tfremat.RematSequential(blocks, planner.uniform_segments(3, 3),
                                ordered=True)
step = chain.training_step(layer)
x = tf.random.stateless_normal([512, 64], seed=[1, 2])
step(x)
print(sum(len(op.control_inputs) for op in
          step.get_concrete_function(x).graph.get_operations()
          if op.type == "Pow"))
"""


def test_an_ordered_chain_leaves_graph_optimizations_on(tmp_path):
  # Grappler rewrites x**3 (the tanh approximation of gelu, as GPT-2's
  # feed-forward layers use it) into products, and fails where the power
  # op waits on another op: the whole step then ran unoptimized, as only
  # TensorFlow's log said (which the tests otherwise silence).
  script = tmp_path / "gelu_chain.py"
  script.write_text(_GELU_CHAIN)
  done = subprocess.run([sys.executable, str(script)], capture_output=True,
                        text=True, check=True,
                        # Ordered, as on several CPUs.
                        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="0",
                                 TF_NUM_INTEROP_THREADS="2"))
  assert "optimization failure" not in done.stderr, done.stderr[-2000:]
  assert done.stdout.split()[-1] == "0"  # No power op waits on another.


@pytest.mark.slow
def test_the_planner_takes_policies_by_value_and_a_users_own():
  # A policy is a value to the planner as to everything else: a built-in's
  # value is measured as its name is (the same costs, under the same key),
  # and a user's policy (a `|` combination) is planned with, run, and saved.
  blocks, x = _chain("transformer")
  value = tfremat.policies.masks_saveable
  by_name, by_value = (chain.measure_layer(blocks[0], x, repeats=1,
                                           policies=p)[0]
                       for p in (["masks_saveable"], [value]))
  assert by_value.policy_costs.keys() == by_name.policy_costs.keys()
  assert by_value.policy_keeps == by_name.policy_keeps
  mine = (tfremat.policies.dots_with_no_batch_dims_saveable |
          tfremat.policies.save_only_these_names("attention_scores"))
  layer = tfremat.remat_sequential(blocks, budget=0.5, sample_input=x,
                                   verbose=0, policies=[mine])
  assert list(layer.plan.costs[0].policy_costs) == [mine]
  used = [s.policy for s in layer.segments if s.remat and s.policy]
  assert all(p == mine for p in used), layer.segments
  assert_parity(lambda remat, h: (layer if remat else keras.Sequential(
      blocks))(h, training=True), (x,), layer.trainable_weights, "function",
                "/CPU:0", state=layer.variables)
  again = tfremat.RematSequential.from_config(layer.get_config())
  assert again.segments == layer.segments


def test_a_budget_above_keeping_everything_keeps_everything():
  # The margin is 5% of a plan's predicted peak: a budget of what training
  # holds (the weights and the batch) plus 1.1x keeping everything's
  # predicted step buys no recompute.
  blocks, x = sample_chain("tanh")
  for block in blocks:
    block.trainable = False
  kept = tfremat.RematSequential(blocks, planner.keep_all(len(blocks)),
                                 gated=True)
  keep = measure.predict_peak(chain.training_step(kept), x)
  held = x.numpy().nbytes + sum(
      v.numpy().nbytes for block in blocks for v in block.weights)
  layer = tfremat.remat_sequential(blocks, budget=held + int(1.1 * keep),
                                   sample_input=x, verbose=0)
  assert not any(layer.plan.rematerialized), str(layer.plan)


@pytest.mark.slow
def test_a_budget_at_115_percent_of_the_lowest_plan_is_planned():
  # A budget the lowest plan meets with 15% to spare (beyond what training
  # holds) is planned, not refused: its bound adds its calls' spread and 5%,
  # not 35%.
  blocks, x = sample_chain("mlp")
  with pytest.raises(tfremat.errors.BudgetUnreachableError) as refused:
    tfremat.remat_sequential(blocks, budget=0.05, sample_input=x, verbose=0)
  search = refused.value.search
  lowest = min(t.measured.peak_bytes for t in search.trials)
  layer = tfremat.remat_sequential(
      blocks, budget=search.held.total_bytes + int(1.15 * lowest),
      sample_input=x, verbose=0)
  assert layer.plan.measured.bound_bytes <= int(1.15 * lowest)


def test_a_segment_first_traced_at_another_shape_runs_a_unit_built_on_the_sample():
  # remat_model's planner groups a CNN's single layers into Sequential units
  # and calls them on the sample, which fixes a Sequential's input to the
  # sample's image size; a segment's body built around such a unit by a
  # step first traced at a larger image raised (a MobileNetV2 planned at
  # 64x64 whose first train_on_batch was at 80x80).
  keras.utils.set_random_seed(0)
  unit = keras.Sequential([keras.layers.Conv2D(4, 3, padding="same"),
                           keras.layers.ReLU()])
  unit(tf.zeros([2, 8, 8, 3]))  # Built on the sample.
  layers = [unit, keras.layers.Conv2D(4, 3, padding="same")]
  chained = chain_layers.RematSequential(
      layers, [planner.Segment(0, 1, True), planner.Segment(1, 2, False)])
  x = tf.random.normal([4, 12, 12, 3])

  @tf.function
  def grads(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(chained(x, training=True) ** 2)
    return tape.gradient(loss, chained.trainable_weights)

  def plain(x):
    with tf.GradientTape() as tape:
      y = x
      for layer in layers:
        y = layer(y)
      loss = tf.reduce_sum(y ** 2)
    return tape.gradient(loss, chained.trainable_weights)

  assert_trees_close(grads(x), plain(x))
