"""A budget is of the step users train: a compiled model's own training
step (its loss, its optimizer's update), bytes that count what training
holds (weights, optimizer state, batch), and the input shape each step runs
at (budget_shapes_test.py trains through `fit` at shapes that change)."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import chain
from tfremat import measure
from tfremat import models
from tfremat import planner
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning import growth
from conftest import assert_one_scale_parity
from conftest import assert_trees_close
from conftest import planned_chain
from conftest import random_costs


def _compiled_mlp(blocks=4, width=64, hidden=256):
  """A residual MLP with a 10-class head, compiled with Adam."""
  keras.utils.set_random_seed(0)
  x = inputs = keras.Input((width,))
  for _ in range(blocks):
    h = keras.layers.Dense(hidden, activation="gelu")(x)
    x = x + keras.layers.Dense(width)(keras.layers.Dropout(0.1)(h))
  model = keras.Model(inputs, keras.layers.Dense(10)(x))
  model.compile(optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def _batch(size=256, width=64):
  return (tf.random.stateless_normal([size, width], seed=[1, 2]),
          tf.random.stateless_uniform([size], seed=[3, 4], maxval=10,
                                      dtype=tf.int32))


def _nbytes(variables):
  return sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
             for v in variables)


def _plan_of(model):
  return planned_chain(model).plan


def test_a_compiled_model_is_planned_on_its_own_train_on_batch():
  model = _compiled_mlp()
  x, y = _batch()
  planned = tfremat.remat_model(model, budget=0.6, sample_input=x,
                                sample_target=y, verbose=0)
  plan = _plan_of(planned)
  assert plan.step == plan.search.step == "train_on_batch"
  assert "predicted on       train_on_batch" in str(plan)
  assert "on train_on_batch" in str(plan.search)
  # What is held: the weights, Adam's two slots (and its step count and
  # learning rate), the batch; the fraction is of the step's own peak.
  weights = _nbytes(model.variables)
  assert plan.held.weights_bytes == weights
  assert plan.held.optimizer_bytes >= 2 * _nbytes(model.trainable_variables)
  assert plan.held.batch_bytes == _nbytes([x, y])
  assert plan.step_budget_bytes == int(0.6 * plan.predicted_keep)
  assert plan.budget_bytes == plan.held_bytes + plan.step_budget_bytes
  # Held to the budget by its prediction; its three check calls measured.
  # (They run in the step traced for any shape, whose peak moves with
  # thread timing: one measured 6% over the room in CI here, which the
  # check allows, docs/design.md "How the planner chooses", step 4.
  # Budgets over 100 steps in new processes: budget_later_test.py.)
  assert plan.predicted_bound_at(plan.shape, plan.segments_at(
      plan.shape)) <= plan.step_budget_bytes, str(plan)
  assert plan.measured.calls == 3
  # The result is compiled as the model was, with the model's optimizer:
  # both train the same variables, and the optimizer's state carries on.
  assert planned.compiled and planned.optimizer is model.optimizer
  before = [np.array(v) for v in model.trainable_variables]
  planned.train_on_batch(x, y)
  assert any(np.abs(np.array(v) - b).max() > 0
             for v, b in zip(model.trainable_variables, before))


def test_the_plan_matches_the_models_gradients_on_its_train_step():
  # The planned model's train_on_batch moves the weights as the model's
  # own does, from the same weights and seeds.
  x, y = _batch()
  plain = _compiled_mlp()
  plain.train_on_batch(x, y)
  planned_from = _compiled_mlp()
  planned = tfremat.remat_model(planned_from, budget=0.6, sample_input=x,
                                sample_target=y, verbose=0)
  planned.train_on_batch(x, y)
  assert_trees_close([np.array(v) for v in planned_from.trainable_variables],
                     [np.array(v) for v in plain.trainable_variables])


def test_sample_target_needs_a_compiled_model_and_a_budget():
  model = _compiled_mlp()
  x, y = _batch()
  with pytest.raises(ValueError, match="sample_target is for budget="):
    tfremat.remat_model(model, "full", sample_target=y)
  uncompiled = keras.Model(model.inputs, model.outputs)
  with pytest.raises(ValueError, match="needs a compiled model"):
    tfremat.remat_model(uncompiled, budget=0.5, sample_input=x,
                        sample_target=y)


def test_without_targets_the_stand_in_step_is_measured_and_said():
  model, x = _compiled_mlp(), _batch()[0]
  planned = tfremat.remat_model(model, budget=0.6, sample_input=x, verbose=0)
  plan = _plan_of(planned)
  assert plan.step == "stand-in" and "no optimizer" in str(plan)
  assert plan.held.optimizer_bytes == 0
  # Compiled as the model was all the same.
  assert planned.compiled and planned.optimizer is model.optimizer


def test_a_byte_budget_counts_what_training_holds():
  model = _compiled_mlp()
  x, y = _batch()
  keep = tfremat.remat_model(model, budget=1.0, sample_input=x,
                             sample_target=y, verbose=0)
  held = _plan_of(keep).held_bytes
  step = _plan_of(keep).predicted_keep
  budget = held + int(0.6 * step)
  plan = _plan_of(tfremat.remat_model(model, budget=budget, sample_input=x,
                                      sample_target=y, verbose=0))
  assert plan.budget_bytes == budget and plan.held_bytes == held
  assert plan.measured.bound_bytes <= budget - held
  # A budget below what is held is refused, naming it and the fix.
  with pytest.raises(tfremat.errors.BudgetUnreachableError,
                     match="training holds .* before a step allocates"):
    tfremat.remat_model(model, budget=held // 2, sample_input=x,
                        sample_target=y, verbose=0)


def _shaped_plan(budget_fraction=0.6):
  """A checked plan on random costs that grow as a sequence model's do:
  inputs, outputs and transients in proportion to batch x sequence, saved
  tensors half so and half as attention's scores (batch x sequence
  squared); its variants measured as the cost model predicts them."""
  costs = random_costs(np.random.default_rng(6), 8)
  bs, bss = growth.Rows.monomial((1, 1)), growth.Rows.monomial((1, 2))
  costs = [dataclasses.replace(c, growth={
      "input_bytes": bs * c.input_bytes,
      "output_bytes": bs * c.output_bytes,
      "saved_bytes": (bs + bss) * (c.saved_bytes / 2),
      "forward_transient_bytes": bs * c.forward_transient_bytes,
      "backward_transient_bytes": bs * c.backward_transient_bytes,
      "saved_share": (bs + bss) * 0.5, "work": bs}) for c in costs]
  keep_peak = planner.predict(costs, planner.keep_all(8))[0]
  budget = int(budget_fraction * keep_peak)
  segments = planner.plan(costs, int(0.9 * budget)).segments
  peak = planner.predict(costs, list(segments))[0]
  plan = planner.Plan(
      costs, segments, budget, planner.Budget(num_bytes=budget),
      measured=planner.Measured(peak, int(1.05 * peak), 10, peak // 20),
      measured_keep=planner.Measured(keep_peak, keep_peak, 10),
      held=planner.Held(), shape=(8, 64, 16))
  return budget_lib.with_variants(plan.replace(margin=0.05),
                                  planner.DEFAULT_SETTINGS)


def test_a_plan_chooses_segments_for_each_shape_without_measuring():
  plan = _shaped_plan()
  remat = lambda segments: sum(s.stop - s.start for s in segments if s.remat)
  sample = plan.segments_at((8, 64, 16))
  assert plan.segments_at((None, 64, 16)) == sample  # The sample's.
  assert plan.predicted_bound_at((8, 64, 16), sample) <= plan.budget_bytes
  # A shorter sequence keeps more and runs faster; a longer one recomputes
  # more; each predicted within the budget, where attention's scores grow
  # with the sequence squared.
  shorter, longer = plan.segments_at((8, 32, 16)), plan.segments_at(
      (8, 80, 16))
  assert remat(shorter) < remat(sample) < remat(longer)
  assert (plan.seconds_at((8, 32, 16), shorter) <
          plan.seconds_at((8, 32, 16), sample))
  for shape, segments in (((8, 32, 16), shorter), ((8, 80, 16), longer)):
    assert plan.predicted_bound_at(shape, segments) <= plan.budget_bytes
  ratio = plan.predicted_peak_at((8, 128, 16), longer) / (
      plan.predicted_peak_at((8, 64, 16), longer))
  assert ratio > 2.0  # Not in proportion: the scores' square.
  # Where no variant is predicted to fit, a clear error names the shape.
  with pytest.raises(tfremat.errors.BudgetUnreachableError,
                     match=r"at input shape \(8, 512, 16\)"):
    plan.segments_at((8, 512, 16))
  # A plan saved and loaded chooses the same.
  again = planner.Plan.from_config(plan.get_config())
  assert again == plan and again.segments_at((8, 32, 16)) == shorter


def test_the_choice_in_a_graph_is_the_choice_in_python():
  plan = _shaped_plan()
  shapes = [(8, 64, 16), (8, 32, 16), (8, 80, 16), (3, 100, 16),
            (16, 48, 16), (8, 512, 16)]

  @tf.function
  def choose(shape):
    index, check = plan.choose_in_graph(shape)
    with tf.control_dependencies([check]):
      return tf.identity(index)

  for shape in shapes:
    try:
      expected = plan.variants.index(plan.segments_at(shape))
    except tfremat.errors.BudgetUnreachableError:
      with pytest.raises(tf.errors.InvalidArgumentError,
                         match="no rematerialization plan is predicted"):
        choose(tf.constant(shape))
      continue
    assert int(choose(tf.constant(shape))) == expected, shape


def test_a_planned_chain_runs_the_plan_for_the_shape_it_is_traced_for():
  # A chain of transformer blocks planned on a sample of sequence 32, then
  # run at 40 and 16 in steps traced for those shapes and in one traced
  # for any: the segments chosen there run, with the gradients of the
  # chain without remat.
  blocks = [models.transformer_block(None, 32, 2, 0.0, i) for i in range(4)]
  x = tf.random.stateless_normal([8, 32, 32], seed=[1, 2])
  keep = tfremat.remat_sequential(blocks, budget=1.0, sample_input=x,
                                  verbose=0).plan
  # At 65%: the lowest plan fits 40 by about a quarter predicted (at 60%
  # a check that measured 8% over its prediction on a loaded machine moved
  # every variant up by the excess, and 40 was refused).
  budget = keep.held_bytes + int(0.65 * keep.predicted_keep)
  layer = tfremat.remat_sequential(blocks, budget=budget, sample_input=x,
                                   verbose=0)
  assert len(layer.plan.variants) > 1 and layer.plan.shape == (8, 32, 32)
  relaxed = chain.training_step(layer, relaxed=True)
  plain = chain.training_step(keras.Sequential(blocks))
  for length in (40, 16):
    at = tf.random.stateless_normal([8, length, 32], seed=[3, length])
    assert layer.segments_for(at) == layer.plan.segments_at((8, length, 32))
    expected = [np.asarray(g) for g in plain(at)]
    for step in (chain.training_step(layer), relaxed):
      assert_one_scale_parity([np.asarray(g) for g in step(at)], expected)
  # Traced for a shape no plan fits, the step raises before it runs; run
  # at it in a step traced for any shape, the step raises as it runs.
  huge = tf.zeros([8, 2048, 32])
  with pytest.raises(tfremat.errors.BudgetUnreachableError,
                     match="at input shape"):
    chain.training_step(layer).get_concrete_function(huge)
  with pytest.raises(tf.errors.InvalidArgumentError,
                     match="no rematerialization plan is predicted"):
    relaxed(huge)


def test_largest_batch_counts_the_optimizer_and_returns_a_compiled_model():
  model = _compiled_mlp()
  x, y = _batch(64)
  found = tfremat.largest_batch(model, "24MiB", x, sample_target=y,
                                verbose=0)
  assert found.fits and found.step == "train_on_batch"
  assert found.held.optimizer_bytes >= 2 * _nbytes(model.trainable_variables)
  assert found.held.batch_bytes == found.batch * _nbytes([x, y]) // 64
  # Held to the memory by its prediction with the margin, as the planner
  # holds it: on the executor one of the check's calls moves up with thread
  # timing (in CI, beside another test, 6.8% over the prediction and 1.3%
  # over the memory, where it fitted here).
  plan = found.plan
  bound = plan.predicted_peak_at(plan.shape) * (1 + plan.margin)
  assert found.held.total_bytes + bound <= found.memory_bytes, str(found)
  assert found.model.compiled and found.model.optimizer is model.optimizer
  assert "held" in str(found) and "train_on_batch step" in str(found)
  with pytest.raises(ValueError, match="needs a compiled model"):
    tfremat.largest_batch(keras.Model(model.inputs, model.outputs), "24MiB",
                          x, sample_target=y)
  found_peak = measure.peak_bytes(
      found.model.train_on_batch,
      *[tf.tile(t, [found.batch // 64 + 1] + [1] * (t.shape.rank - 1))
        [:found.batch] for t in (x, y)])
  assert found_peak <= 1.2 * found.measured.bound_bytes
