"""A budget is of the step users train: a compiled model's own
`train_on_batch` (its loss, its optimizer's update), bytes that count what
training holds (weights, optimizer state, batch), and every input shape the
step is traced for."""

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
from tfremat._src.planning import shapes
from conftest import assert_trees_close, planned_chain, random_costs


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
  assert "measured on        train_on_batch" in str(plan)
  assert "measured on train_on_batch" in str(plan.search)
  # What is held: the weights, Adam's two slots (and its step count and
  # learning rate), the batch; the fraction is of the step's own peak.
  weights = _nbytes(model.variables)
  assert plan.held.weights_bytes == weights
  assert plan.held.optimizer_bytes >= 2 * _nbytes(model.trainable_variables)
  assert plan.held.batch_bytes == _nbytes([x, y])
  assert plan.step_budget_bytes == int(0.6 * plan.measured_keep.peak_bytes)
  assert plan.budget_bytes == plan.held_bytes + plan.step_budget_bytes
  assert plan.measured.bound_bytes <= plan.step_budget_bytes
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
  step = _plan_of(keep).measured_keep.peak_bytes
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


def test_a_cost_fitted_over_shapes_passes_through_both_measurements():
  # Linear: the half holds half. Quadratic in part: it holds less (scores
  # of attention). Less than in proportion: a constant besides (scratch).
  assert shapes.fitted(100, 50, 0.5, 2.0) == pytest.approx(200)
  assert shapes.fitted(100, 25, 0.5, 2.0) == pytest.approx(400)
  assert shapes.fitted(100, 75, 0.5, 2.0) == pytest.approx(150)
  for half in (25, 40, 50, 75, 100):
    assert shapes.fitted(100, half, 0.5, 1.0) == pytest.approx(100)
    assert shapes.fitted(100, half, 0.5, 0.5) == pytest.approx(half)
  assert shapes.fitted(100, 0, 0.5, 0.1) >= 0


def _shaped_plan(budget_fraction=0.6):
  """A checked plan (stand-in measurements: the model's own figures) on
  random costs, fitted over shapes as a sequence model's: costs at half the
  sequence are half of them, but its layers' saved tensors, a quarter."""
  costs = random_costs(np.random.default_rng(6), 8)
  half = [dataclasses.replace(
      c, input_bytes=c.input_bytes // 2, output_bytes=c.output_bytes // 2,
      saved_bytes=c.saved_bytes // 4,
      forward_transient_bytes=c.forward_transient_bytes // 2,
      backward_transient_bytes=c.backward_transient_bytes // 2,
      forward_seconds=c.forward_seconds / 2,
      backward_seconds=c.backward_seconds / 2) for c in costs]
  keep_peak = planner.predict(costs, planner.keep_all(8))[0]
  budget = int(budget_fraction * keep_peak)
  segments = planner.plan(costs, int(0.9 * budget)).segments
  peak = planner.predict(costs, list(segments))[0]
  return planner.Plan(
      costs, segments, budget, planner.Budget(num_bytes=budget),
      measured=planner.Measured(peak, int(1.05 * peak), 10, peak // 20),
      measured_keep=planner.Measured(keep_peak, keep_peak, 10),
      held=planner.Held(), shapes=shapes.ShapeFit((8, 64, 16), 1, 32, half))


def test_a_plan_chooses_segments_for_each_shape_without_measuring():
  plan = _shaped_plan()
  assert plan.segments_at((8, 64, 16)) == plan.segments
  assert plan.segments_at((None, 64, 16)) == plan.segments  # The sample's.
  # A shorter sequence keeps more and runs faster; a longer one recomputes
  # more; each predicted within the budget.
  shorter, longer = plan.segments_at((8, 32, 16)), plan.segments_at(
      (8, 80, 16))
  remat = lambda segments: sum(s.stop - s.start for s in segments if s.remat)
  assert remat(shorter) < remat(plan.segments) < remat(longer)
  assert (plan.seconds_at((8, 32, 16), shorter) <
          plan.seconds_at((8, 32, 16), plan.segments))
  for shape, segments in (((8, 32, 16), shorter), ((8, 80, 16), longer)):
    assert plan.predicted_peak_at(shape, segments) <= plan.budget_bytes
  # Where no plan is predicted to fit, a clear error names the shape.
  with pytest.raises(tfremat.errors.BudgetUnreachableError,
                     match=r"at input shape \(8, 512, 16\)"):
    plan.segments_at((8, 512, 16))
  # A plan saved and loaded chooses the same.
  again = planner.Plan.from_config(plan.get_config())
  assert again == plan and again.segments_at((8, 32, 16)) == shorter


def test_a_planned_chain_runs_the_plan_for_the_shape_it_is_traced_for():
  # A chain of transformer blocks planned on a sample of sequence 32, then
  # trained at 40 and 16: the segments of each shape's plan run, with the
  # gradients of the chain without remat.
  blocks = [models.transformer_block(None, 32, 2, 0.0, i) for i in range(4)]
  x = tf.random.stateless_normal([8, 32, 32], seed=[1, 2])
  keep = tfremat.remat_sequential(blocks, budget=1.0, sample_input=x,
                                  verbose=0).plan
  budget = keep.held_bytes + int(0.6 * keep.measured_keep.peak_bytes)
  layer = tfremat.remat_sequential(blocks, budget=budget, sample_input=x,
                                   verbose=0)
  assert layer.plan.shapes.axis == 1 and layer.plan.shapes.half == 16
  for length in (40, 16):
    at = tf.random.stateless_normal([8, length, 32], seed=[3, length])
    assert layer.segments_for(at) == layer.plan.segments_at((8, length, 32))
    planned = chain.training_step(layer)(at)
    plain = chain.training_step(keras.Sequential(blocks))(at)
    assert_trees_close([np.asarray(g) for g in planned],
                       [np.asarray(g) for g in plain])
  # Traced for a shape no plan fits, the step raises before it runs.
  huge = tf.zeros([8, 2048, 32])
  with pytest.raises(tfremat.errors.BudgetUnreachableError,
                     match="at input shape"):
    chain.training_step(layer).get_concrete_function(huge)


def test_largest_batch_counts_the_optimizer_and_returns_a_compiled_model():
  model = _compiled_mlp()
  x, y = _batch(64)
  found = tfremat.largest_batch(model, "24MiB", x, sample_target=y,
                                verbose=0)
  assert found.fits and found.step == "train_on_batch"
  assert found.held.optimizer_bytes >= 2 * _nbytes(model.trainable_variables)
  assert found.held.batch_bytes == found.batch * _nbytes([x, y]) // 64
  assert (found.held.total_bytes + found.measured.bound_bytes <=
          found.memory_bytes), str(found)
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
