"""The planner: its measurements, its optimality, and its budgets in reality."""

import dataclasses
import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import models
from tfremat import planner
from tfremat.planner import LayerCost, Segment
from conftest import assert_trees_close


def _random_chain(rng, n):
  costs = []
  for i in range(n):
    size = int(rng.integers(1, 50)) * 1000
    costs.append(LayerCost(
        name=f"l{i}", forward_seconds=float(rng.uniform(0.1, 2)),
        backward_seconds=float(rng.uniform(0.1, 4)),
        input_bytes=costs[-1].output_bytes if costs else size,
        output_bytes=int(rng.integers(1, 50)) * 1000,
        saved_bytes=int(rng.integers(0, 400)) * 1000,
        forward_transient_bytes=int(rng.integers(0, 100)) * 1000,
        backward_transient_bytes=int(rng.integers(0, 100)) * 1000,
        weight_grad_bytes=int(rng.integers(0, 20)) * 1000,
        waiting_recompute_seconds=float(rng.uniform(0, 0.3))))
  return costs


def _all_plans(n, start=0):
  """Every plan: kept layers and rematerialized runs of any length."""
  if start == n:
    yield []
    return
  for rest in _all_plans(n, start + 1):
    yield [Segment(start, start + 1, False)] + rest
  for stop in range(start + 1, n + 1):
    for rest in _all_plans(n, stop):
      yield [Segment(start, stop, True)] + rest


@pytest.mark.parametrize("seed", range(8))
def test_plan_is_the_fastest_feasible_choice_by_exhaustive_search(seed):
  rng = np.random.default_rng(seed)
  n = int(rng.integers(2, 11))
  costs = _random_chain(rng, n)
  predictions = [planner.predict(costs, p) for p in _all_plans(n)]
  low = min(peak for peak, _ in predictions)
  high = max(peak for peak, _ in predictions)
  for fraction in (0.0, 0.2, 0.5, 0.8, 1.0):
    budget = int(low + fraction * (high - low))
    best = min(t for peak, t in predictions if peak <= budget)
    chosen = planner.plan(costs, budget)
    assert chosen.peak_bytes <= budget
    assert chosen.seconds == pytest.approx(best, rel=1e-12)
  assert planner.smallest_budget(costs) == low
  assert planner.MEASUREMENT_SLACK == 1.05  # The allowance.


def test_impossible_budget_names_the_smallest_that_works():
  costs = _random_chain(np.random.default_rng(3), 6)
  need = planner.smallest_budget(costs)
  with pytest.raises(ValueError, match=f"smallest budget that works for "
                     f"this chain is {need} bytes"):
    planner.plan(costs, need - 1)
  assert planner.plan(costs, need).peak_bytes <= need


def test_full_budget_rematerializes_nothing_and_plan_prints():
  costs = _random_chain(np.random.default_rng(4), 5)
  keep = planner.keep_all(5)
  chosen = planner.plan(costs, planner.predict(costs, keep)[0])
  assert chosen.rematerialized == [False] * 5
  assert chosen.seconds == pytest.approx(planner.predict(costs, keep)[1])
  text = str(planner.plan(costs, planner.smallest_budget(costs)))
  assert "remat segment" in text and "cost model's peak" in text
  assert len(text.splitlines()) == 5 + 1 + 3  # Header, layers, 3 summaries.


def test_long_segments_pay_for_waiting_recomputes():
  costs = [dataclasses.replace(c, waiting_recompute_seconds=0.25 * (i + 1))
           for i, c in enumerate(_random_chain(np.random.default_rng(5), 3))]
  singles = planner.predict(costs, planner.uniform_segments(3, 3))[1]
  whole = planner.predict(costs, planner.uniform_segments(3, 1))[1]
  # Layers 0 and 1 wait for the later recomputes; the last does not.
  assert whole - singles == pytest.approx(0.25 + 0.5)
  # Without that cost the two do the same work.
  plain = [dataclasses.replace(c, waiting_recompute_seconds=0.0)
           for c in costs]
  assert planner.predict(plain, planner.uniform_segments(3, 1))[1] == (
      pytest.approx(planner.predict(plain, planner.uniform_segments(3, 3))[1]))


def test_measure_chain_spreads_the_waiting_cost_by_forward_time():
  blocks = models.residual_mlp(3, 64, dropout=0.0, residual_inside=True)
  x = tf.random.stateless_normal([1024, 64], seed=[1, 4])
  costs = planner.measure_chain(blocks, x, repeats=3)
  ratios = {c.waiting_recompute_seconds / c.forward_seconds for c in costs}
  assert len({round(r, 12) for r in ratios}) == 1 and min(ratios) >= 0, costs


def test_measure_layer_counts_bytes_exactly():
  keras.utils.set_random_seed(0)
  block = keras.Sequential([keras.layers.Dense(256, activation="relu"),
                            keras.layers.Dense(64)])
  x = tf.random.stateless_normal([512, 64], seed=[1, 1])
  block(x)
  cost, y = planner.measure_layer(block, x, repeats=2)
  assert cost.input_bytes == cost.output_bytes == 512 * 64 * 4
  assert cost.weight_grad_bytes == (64 * 256 + 256 + 256 * 64 + 64) * 4
  # The hidden relu output (read by both backward matmuls) is kept; the
  # input and output are counted as such, not as saved. The measurement is
  # a difference of two peaks, so only its scale is checked.
  hidden = 512 * 256 * 4
  assert 0.5 * hidden <= cost.saved_bytes <= 2.1 * hidden, cost
  assert cost.forward_seconds > 0 and cost.backward_seconds >= 0
  assert y.shape == (512, 64)


def test_training_step_loss_reads_the_output():
  # With an incoming gradient built from the output's shape alone, TF prunes
  # the forward ops the backward pass does not read (a rematerialized last
  # segment's whole forward pass), and times and peaks come out too low.
  keras.utils.set_random_seed(0)
  dense = keras.layers.Dense(8)
  x = tf.random.stateless_normal([4, 8], seed=[1, 3])
  y = dense(x)
  grads = planner.training_step(dense)(x)
  # The loss is sum(y**2) / 2, so dL/dx = y W^T and dL/dW = x^T y.
  assert_trees_close(grads[0], tf.matmul(y, dense.kernel, transpose_b=True))
  assert_trees_close(grads[1], tf.matmul(x, y, transpose_a=True))


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
    tfremat.remat_sequential(blocks, segments=1, budget_bytes=10)
  with pytest.raises(ValueError, match="needs sample_input"):
    tfremat.remat_sequential(blocks, budget_bytes=10)
  with pytest.raises(TypeError, match="list of Keras layers"):
    tfremat.RematSequential([lambda x: x], [(0, 1, True)])
  with pytest.raises(ValueError, match="cover layers"):
    tfremat.RematSequential(blocks, [(0, 1, True)])


@pytest.mark.parametrize("error,keep_error", [(0.9, 0.9), (1.1, 1.1),
                                               (1.1, 1.0)])
def test_checked_plan_calibrates_the_model_by_measurement(
    monkeypatch, error, keep_error):
  # A stand-in allocator whose peaks are the model's times `error` (times
  # `keep_error` for keeping everything). 0.9: a model that predicts too much
  # (it would rematerialize more than needed); 1.1: too little (its plans
  # would break the budget); 1.1 with 1.0: a calibration that misleads.
  costs = _random_chain(np.random.default_rng(6), 8)
  layers = [keras.layers.Identity() for _ in costs]

  def measure(layer, x):
    del x
    remat = any(s.remat for s in layer.segments)
    peak = planner.predict(costs, layer.segments)[0]
    return int((error if remat else keep_error) * peak)

  monkeypatch.setattr(planner, "measure_peak", measure)
  keep_peak = planner.predict(costs, planner.keep_all(8))[0]
  for fraction in np.linspace(0.3, 0.95, 14):
    budget = int(fraction * keep_error * keep_peak)
    chosen = tfremat.layers.checked_plan(layers, budget, None, costs=costs)
    # The fastest plan whose stand-in peak fits.
    best = planner.plan(costs, budget / error)
    assert chosen.measured_peak_bytes <= budget, (fraction, str(chosen))
    assert chosen.seconds == pytest.approx(best.seconds, rel=1e-12), fraction
  if error == keep_error:
    need = planner.smallest_budget(costs) * error
    with pytest.raises(ValueError, match="smallest budget that works for "
                       f"this chain is about {math.ceil(need)} bytes"):
      tfremat.layers.checked_plan(layers, int(need) - 2, None, costs=costs)


def _chain(name):
  if name == "mlp":
    blocks = models.residual_mlp(16, 64, dropout=0.1, residual_inside=True)
    x = tf.random.stateless_normal([2048, 64], seed=[1, 2])
  else:
    embed, blocks, _ = models.transformer_parts(
        128, 64, 64, 4, 6, dropout=0.1)
    x = embed(tf.random.stateless_uniform([16, 64], seed=[1, 2], maxval=128,
                                          dtype=tf.int32))
  return blocks, x


@pytest.mark.parametrize("model", ["mlp", "transformer"])
def test_budgets_hold_when_measured(model):
  blocks, x = _chain(model)
  keep = planner.keep_all(len(blocks))
  full = planner.measure_peak(tfremat.RematSequential(blocks, keep), x)
  costs = planner.measure_chain(blocks, x)
  for fraction in (0.3, 0.5, 0.8):
    budget = int(fraction * full)
    chosen = tfremat.layers.checked_plan(blocks, budget, x, costs=costs)
    # Measured again, on a fresh layer: the bound the budget promises.
    measured = planner.measure_peak(
        tfremat.RematSequential(blocks, chosen.segments), x)
    assert measured <= planner.MEASUREMENT_SLACK * budget, (
        fraction, measured, budget, str(chosen))
    assert any(chosen.rematerialized)
  layer = tfremat.remat_sequential(blocks, budget=full, sample_input=x)
  assert not any(layer.plan.rematerialized)


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


# Issue "Keras and Lingvo users' first hour" [5]: budgets a person can give.

@pytest.mark.parametrize("given,num_bytes,fraction", [
    (200 * 2**20, 200 * 2**20, None), (np.int64(4096), 4096, None),
    ("200MiB", 200 * 2**20, None), ("1.5 GB", 1_500_000_000, None),
    ("64kib", 65536, None), ("4096", 4096, None),
    (0.5, None, 0.5), (np.float32(0.25), None, 0.25), (1.0, None, 1.0),
    ("50%", None, 0.5), (" 100 % ", None, 1.0)])
def test_budget_reads_bytes_units_fractions_and_percentages(
    given, num_bytes, fraction):
  budget = planner.Budget.parse(given)
  assert (budget.num_bytes, budget.fraction) == (num_bytes, fraction)
  keep = 1000
  assert budget.bytes_given(keep) == (
      num_bytes if num_bytes is not None else int(fraction * keep))


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
def test_bad_budgets_fail_before_anything_is_measured(
    monkeypatch, given, error, match):
  def measured(*args, **kwargs):
    raise AssertionError("measured before the budget was checked")

  monkeypatch.setattr(planner, "measure_layer", measured)
  monkeypatch.setattr(planner, "measure_peak", measured)
  blocks = models.residual_mlp(2, 4, dropout=0.0, residual_inside=True)
  with pytest.raises(error, match=match):
    tfremat.remat_sequential(blocks, budget=given,
                             sample_input=np.ones([2, 4], "float32"))
  with pytest.raises(error, match=match):
    tfremat.builder.Base.Params().Instantiate()._RematerializeSeq(
        "s", None, budget=given, sample_input=np.ones([2, 4], "float32"))


def _stand_in_allocator(monkeypatch, costs, error=1.0):
  """planner.measure_peak replaced by the model's peak times `error`."""
  def measure(layer, x):
    del x
    return int(error * planner.predict(costs, layer.segments)[0])

  monkeypatch.setattr(planner, "measure_peak", measure)
  return planner.predict(costs, planner.keep_all(len(costs)))[0] * error


@pytest.mark.parametrize("given", [0.5, "50%"])
def test_fraction_budget_is_of_the_measured_keep_everything_peak(
    monkeypatch, given):
  costs = _random_chain(np.random.default_rng(6), 8)
  keep_peak = int(_stand_in_allocator(monkeypatch, costs, error=1.1))
  layers = [keras.layers.Identity() for _ in costs]
  chosen = tfremat.layers.checked_plan(layers, given, None, costs=costs)
  assert chosen.budget_bytes == int(0.5 * keep_peak)
  assert chosen.measured_keep_peak_bytes == keep_peak
  assert chosen.measured_peak_bytes <= chosen.budget_bytes
  assert "50% of the measured peak of keeping everything" in str(chosen)


def test_plan_printout_compares_measured_with_measured_and_says_which():
  # The old printout put the model's peak (above the budget) beside the
  # measured one (below it) and named two different "no remat" peaks.
  costs = _random_chain(np.random.default_rng(7), 4)
  segments = planner.uniform_segments(4, 2)
  chosen = planner.Plan(costs, segments)
  chosen.budget_bytes = int(0.9 * chosen.peak_bytes)  # Model: over.
  chosen.budget = planner.Budget.parse(0.4)
  chosen.measured_peak_bytes = int(0.8 * chosen.peak_bytes)  # Measured: in.
  chosen.measured_keep_peak_bytes = 2 * chosen.measured_peak_bytes
  summary = str(chosen).splitlines()[5:]
  assert summary[0].startswith("budget") and "40% of the measured peak" in summary[0]
  assert summary[1].startswith("measured peak")
  assert "within the budget" in summary[1]
  assert "0.50x of keeping everything, measured" in summary[1]
  assert summary[2].startswith("cost model's peak") and "by the model" in (
      summary[2])
  assert summary[3].startswith("cost model's time")
  assert "chosen on its measured peak" in summary[4]
  assert "no remat" not in str(chosen)
  chosen.measured_peak_bytes = chosen.budget_bytes + 1
  assert "over the budget, within the 5% allowance" in str(chosen)


def test_checked_plan_shows_progress_without_escape_codes_in_a_log(
    monkeypatch, capsys):
  costs = _random_chain(np.random.default_rng(6), 8)
  keep_peak = _stand_in_allocator(monkeypatch, costs)
  layers = [keras.layers.Identity() for _ in costs]
  tfremat.layers.checked_plan(layers, int(0.5 * keep_peak), None, costs=costs,
                              verbose=1)
  out = capsys.readouterr().out
  assert "measurement" in out, out
  assert "\x1b" not in out and "\r" not in out and "\b" not in out, repr(out)
  tfremat.layers.checked_plan(layers, int(0.5 * keep_peak), None, costs=costs)
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
  assert "100% of the measured peak of keeping" in str(loaded.plan)
  assert loaded.segments == layer.segments
