"""A budget holds wherever training goes: a model planned on one sample,
then trained through Keras's `fit` and `train_on_batch` at lengths and
batch sizes that change between calls. Keras traces its step again for any
size once a second shape arrives (`reduce_retracing`), so one traced step
runs at every later shape: the plan chooses what to rematerialize by the
shape each step runs at, or the step raises naming it."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import measure
from tfremat._src.api import remat_model as remat_model_lib
from tfremat._src.planning import budget as budget_lib
from tfremat._src.planning.runner import Batch
from tfremat._src.planning.search import Candidate
from conftest import assert_trees_close
from conftest import planned_chain

_VOCAB, _WIDTH = 64, 64
_NO_PLAN = "no rematerialization plan is predicted to fit"


def _lm(blocks=6):
  """A compiled LM over token sequences of any length: an embedding, then
  residual LayerNormalization + MLP blocks, as users write them."""
  keras.utils.set_random_seed(0)
  tokens = keras.Input((None,), dtype="int32")
  h = keras.layers.Embedding(_VOCAB, _WIDTH)(tokens)
  for _ in range(blocks):
    f = keras.layers.LayerNormalization()(h)
    f = keras.layers.Dense(4 * _WIDTH, activation="gelu")(f)
    h = keras.layers.Add()([h, keras.layers.Dense(_WIDTH)(f)])
  model = keras.Model(tokens, keras.layers.Dense(_VOCAB)(h))
  model.compile(optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  return model


def _tokens(batch, length):
  x = tf.random.stateless_uniform([batch, length], seed=[1, length],
                                  maxval=_VOCAB, dtype=tf.int32)
  return x, tf.roll(x, -1, axis=1)


def _mlp(blocks=4, width=64, hidden=256):
  """A compiled residual MLP with a 10-class head."""
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


def _rows(size, width=64):
  return (tf.random.stateless_normal([size, width], seed=[1, size]),
          tf.random.stateless_uniform([size], seed=[3, size], maxval=10,
                                      dtype=tf.int32))


def _nbytes(tree):
  return sum(int(np.prod(t.shape)) * tf.as_dtype(t.dtype).size
             for t in tf.nest.flatten(tree))


def _held(model, batch):
  """What training holds besides the step: weights, optimizer state, batch."""
  model.optimizer.build(model.trainable_variables)
  return (_nbytes(model.variables) + _nbytes(model.optimizer.variables) +
          _nbytes(batch))


def _budget(model, x, y, fraction):
  """Held, plus `fraction` of the step's peak keeping everything, in a step
  traced for any shape (`fit` after its first shape)."""
  model.train_on_batch(*_cut(x, y, 2))  # The next shape traces for any.
  keep = measure.peak_bytes(model.train_on_batch, x, y, calls=2)
  return _held(model, [x, y]) + int(fraction * keep)


def _cut(x, y, by):
  return x[:x.shape[0] // by], y[:y.shape[0] // by]


def _step_total(model, x, y):
  """Held plus the measured peak of `train_on_batch(x, y)`, or None where
  the step raises that no plan fits this shape: as it runs, where Keras
  traced it for any shape, or as Keras traces it for this one."""
  try:
    peak = measure.peak_bytes(model.train_on_batch, x, y, calls=2)
  except (tf.errors.InvalidArgumentError,
          tfremat.errors.BudgetUnreachableError) as e:
    # Raised as the step runs, or as it is traced for this shape; under
    # XLA, as it is compiled for it (the message names a tensor, its words
    # joined by underscores).
    words = str(e).lower().replace("_", " ")
    assert _NO_PLAN in words, e
    assert "raise the budget" in words, e
    return None
  return _held(model, [x, y]) + peak


def _lowest_total(model, plan, x, y):
  """Held plus the peak of `model` trained at `x`, `y` with its chain run as
  `plan`'s lowest variant (the lowest a plan goes: every unit
  rematerialized, or nearly), in a step traced for their shapes."""
  parts, units = remat_model_lib.model_chain_of(model)
  runner, _ = remat_model_lib.model_runner(model, parts, units, y, "test")
  lowest = Candidate(plan.variants[-1], plan.ordered)
  return _held(model, [x, y]) + max(runner.peaks(lowest, Batch(x, y), 2))


def test_an_lm_planned_at_one_length_holds_its_budget_at_every_length():
  # Planned at length 64, trained at 32..256 in mixed order: Keras traces
  # its step for any length from the second length on, and every step
  # holds the budget, keeping more where the sequence is short, or raises
  # where even the lowest plan does not fit. (At 70% of keeping
  # everything at 64, the lowest plan fits 128 with a fifth to spare and
  # 256 by no means.)
  model = _lm()
  x, y = _tokens(32, 64)
  budget = _budget(model, x, y, 0.7)
  planned = tfremat.remat_model(model, budget=budget, sample_input=x,
                                sample_target=y, verbose=0)
  plan = planned_chain(planned).plan
  raised = []
  for length in (32, 128, 64, 96, 256, 48, 128, 64):
    total = _step_total(planned, *_tokens(32, length))
    if total is None:
      raised.append(length)
    else:
      assert total <= budget, (length, total, budget, str(plan))
  assert raised == [256], raised
  assert _lowest_total(model, plan, *_tokens(32, 256)) > budget
  # A short sequence keeps more of the chain than a long one. (Between 32
  # and 64 the choice can be the same on a loaded machine, whose wider
  # measured spread leaves less room.)
  assert len(plan.variants) > 1
  remat = lambda s: sum(g.stop - g.start for g in s if g.remat)
  assert remat(plan.segments_at((32, 16, _WIDTH))) < remat(
      plan.segments_at((32, 128, _WIDTH)))


def test_an_lm_uses_most_of_its_budget_where_keeping_everything_does_not_fit():
  # Planned at 16x64 at 60% of keeping everything on the executor with 5
  # variants (`Settings(variants=5)`), trained shorter and longer: where
  # keeping everything is over the budget, the plan run there is predicted
  # to use at least 80% of what the budget leaves the step, and the step
  # holds the budget. (With the default 3, 16x48 ran the sample's plan,
  # predicted at 72% and measured at 72% of the budget; with 5, measured
  # at 82-87% idle and 78% beside two busy processes, whose threads
  # overlap the step's ops less: the prediction is what the choice rests
  # on.) The budget is of keeping everything's predicted peak: a measured
  # one moves with the machine's load.
  model = _lm(blocks=4)
  x, y = _tokens(16, 64)
  budget = _held(model, [x, y]) + int(
      0.6 * measure.predict_peak(model.train_on_batch, x, y))
  planned = tfremat.remat_model(
      model, budget=budget, sample_input=x, sample_target=y, verbose=0,
      settings=tfremat.planner.Settings(variants=5))
  plan = planned_chain(planned).plan
  for shape in ((16, 48), (16, 64), (16, 96)):
    at = _tokens(*shape)
    assert _step_total(model, *at) > budget, shape  # Keeping everything.
    full = shape + plan.shape[2:]
    runs = plan.segments_at(full)
    used = plan.predicted_bound_at(full, runs) / plan.allowed_at(full)
    assert 0.8 <= used <= 1, (shape, used, str(plan))
    total = _step_total(planned, *at)
    assert total is not None and total <= budget, (shape, total, str(plan))


def test_an_lm_trained_with_fit_on_padded_batches_holds_its_budget():
  # `fit` over a dataset of sequences of different lengths, padded per
  # batch (tf.data's padded_batch): each batch has its own length.
  # At 80% of keeping everything at 64, only the lowest plan fits 96, by
  # a quarter predicted. (At 70% it fitted by a ninth, and a run beside
  # another test measured its spread wide enough that 96 raised.)
  model = _lm(blocks=4)
  x, y = _tokens(16, 64)
  budget = _budget(model, x, y, 0.8)
  planned = tfremat.remat_model(model, budget=budget, sample_input=x,
                                sample_target=y, verbose=0)
  # Batches of 16 rows, each as long as its longest row; the first is
  # the shortest, so the step is first traced for it.
  longest = [16, 24, 96, 40, 80, 32, 64, 96]
  lengths = [n - i % 5 for n in longest for i in range(16)]
  rows = tf.data.Dataset.from_generator(
      lambda: ((np.arange(n) % _VOCAB, (np.arange(n) + 1) % _VOCAB)
               for n in lengths),
      output_signature=(tf.TensorSpec([None], tf.int64),) * 2)
  data = rows.padded_batch(16).map(
      lambda a, b: (tf.cast(a, tf.int32), tf.cast(b, tf.int32)))
  planned.fit(data, epochs=1, verbose=0)  # Traces for its shapes.
  peak = measure.peak_bytes(lambda: planned.fit(data, epochs=1, verbose=0),
                            calls=1, warmup=False)
  assert _held(planned, _tokens(16, 96)) + peak <= budget, (peak, budget)


@pytest.mark.slow
def test_an_lm_compiled_with_xla_holds_its_budget_at_every_length():
  # Compiled with XLA, planned at 16x64 at 60% of keeping everything,
  # trained at 16x48 (after which Keras traces its step for any shape, and
  # XLA compiles that for each shape it runs at, where the variant chosen
  # for it runs), then at longer and shorter lengths and a larger batch.
  # Each step holds the budget, or its compile fails naming the refusal,
  # and only where the lowest variant's prediction does not fit; at 16x64,
  # where keeping everything does not fit, the step uses at least 80% of
  # the budget. (With each variant's peak at the sample estimated from the
  # executor's program rather than compiled, this LM ran at 16x96, 16x128
  # and 32x64 at 103-132% of its budget.)
  model = _lm(blocks=4)
  model.compile(optimizer="adam", jit_compile=True,
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  x, y = _tokens(16, 64)
  budget = _budget(model, x, y, 0.6)
  planned = tfremat.remat_model(model, budget=budget, sample_input=x,
                                sample_target=y, verbose=0)
  plan = planned_chain(planned).plan
  planned.train_on_batch(*_tokens(16, 48))
  ran = {}
  for shape in ((16, 32), (16, 64), (16, 96), (16, 128), (32, 64), (16, 160)):
    total = _step_total(planned, *_tokens(*shape))
    lowest = plan.predicted_bound_at(shape + plan.shape[2:], plan.variants[-1])
    if total is None:
      assert lowest > plan.allowed_at(shape + plan.shape[2:]), (
          shape, lowest, str(plan))
    else:
      assert total <= budget, (shape, total, budget, str(plan))
      ran[shape] = total
  assert list(ran)[:2] == [(16, 32), (16, 64)], (ran, str(plan))
  assert (16, 160) not in ran, (ran, str(plan))
  assert ran[(16, 64)] >= 0.8 * budget, (ran, budget, str(plan))


def test_a_step_compiled_for_any_batch_trains_as_the_model_does():
  # Under XLA a step traced for any batch builds every variant and selects,
  # by the batch XLA compiles it for, the chosen one's output, gradients
  # and variable updates. Trained at batches that choose different
  # variants, it moves the weights, BatchNormalization's statistics and
  # dropout's seeds as the model without remat does.
  def model(jit):
    keras.utils.set_random_seed(0)
    x = inputs = keras.Input((64,))
    for _ in range(2):
      h = keras.layers.Dense(256, activation="gelu")(x)
      h = keras.layers.BatchNormalization()(keras.layers.Dropout(0.1)(h))
      x = x + keras.layers.Dense(64)(h)
    built = keras.Model(inputs, keras.layers.Dense(10)(x))
    built.compile(optimizer="adam", jit_compile=jit,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
    return built

  plain, base = model(True), model(False)
  # Planned on the executor (a compile per prediction under XLA would make
  # this test slow), then trained compiled. At 70% the chosen plan's bound
  # fitted the room by 1.6%, and in CI, beside other tests, the check's
  # calls all peaked above the prediction, which refused the sample; at 75%
  # by 5.6%.
  planned = tfremat.remat_model(base, budget=0.75, sample_input=_rows(256)[0],
                                sample_target=_rows(256)[1], verbose=0)
  planned.compile(optimizer="adam", jit_compile=True,
                  loss=keras.losses.SparseCategoricalCrossentropy(
                      from_logits=True))
  plan = planned_chain(planned).plan
  sizes = (128, 96, 256, 32)  # After 96, one step for any batch.
  chosen = {plan.variants.index(plan.segments_at((n, 64))) for n in sizes}
  assert len(chosen) > 1, str(plan)
  for n in sizes:
    plain.train_on_batch(*_rows(n))
    planned.train_on_batch(*_rows(n))
  assert_trees_close([np.array(v) for v in base.variables],
                     [np.array(v) for v in plain.variables])


def test_a_fraction_is_of_keeping_everything_at_each_length():
  # 60% of keeping everything at each length. (At 50% the lowest plan's
  # bound fits length 32 by 5%, as weight gradients do not shrink with the
  # sequence: on a loaded machine its measured spread can tip it over, and
  # the step raises.)
  model = _lm(blocks=4)
  x, y = _tokens(16, 64)
  planned = tfremat.remat_model(model, budget="60%", sample_input=x,
                                sample_target=y, verbose=0)
  plan = planned_chain(planned).plan
  for length in (32, 128):
    at = _tokens(16, length)
    total = _step_total(planned, *at)
    assert total is not None, (length, str(plan))
    peak = total - _held(planned, at)
    model.train_on_batch(*_cut(*at, 2))
    keep = measure.peak_bytes(model.train_on_batch, *at, calls=2)
    assert peak <= 0.6 * keep * 1.02, (length, peak, keep, str(plan))


def test_an_mlp_planned_at_one_batch_holds_its_budget_at_others():
  # Planned at batch 256; trained with fit over a dataset of batches of 128
  # whose last batch is partial (its batch dimension is unknown, so fit
  # traces its step for any number of rows), then at 512, which runs that
  # step. At 95% of keeping everything at 256, 512 needs the lowest plan,
  # which fits it by about 14% measured, and its bound (the lowest plan's
  # own prediction at the sample, in proportion, with the 5% margin) by
  # about a fifth. (Carrying the chosen plan's saving over the cost model
  # instead, its bound fitted by 12%, and in one CI run 512 raised.)
  model = _mlp()
  x, y = _rows(256)
  budget = _budget(model, x, y, 0.95)
  planned = tfremat.remat_model(model, budget=budget, sample_input=x,
                                sample_target=y, verbose=0)
  data = tf.data.Dataset.from_tensor_slices(_rows(1000)).batch(128)
  planned.fit(data, epochs=1, verbose=0)  # Its last batch has 104 rows.
  peak = measure.peak_bytes(lambda: planned.fit(data, epochs=1, verbose=0),
                            calls=1, warmup=False)
  assert _held(planned, [x, y]) + peak <= budget, (peak, budget)
  total = _step_total(planned, *_rows(512))
  plan = planned_chain(planned).plan
  assert total is not None and total <= budget, (
      total, budget, plan.measured, plan.overhead_bytes, str(plan))


def test_a_fraction_lets_a_much_smaller_batch_run_within_the_samples_bytes():
  # Planned at 50% on 4096 rows of six features, then batches of 4 and 5
  # (fit's partial last batch, a replica's share). There the weights'
  # gradients are most of the step: no plan can save half of keeping
  # everything, and each plan's bound carries its measured spread. The
  # step runs the lowest plan, far within the bytes the fraction allowed at
  # the sample (before, it raised: at trace time, then as the step ran).
  # (Where the measured spreads are narrow, another plan may reach it.)
  keras.utils.set_random_seed(0)
  x = inputs = keras.Input((6,))
  for _ in range(4):
    h = keras.layers.Dense(64, activation="gelu")(x)
    x = x + keras.layers.Dense(6)(keras.layers.LayerNormalization()(h))
  model = keras.Model(inputs, keras.layers.Dense(1)(x))
  model.compile(optimizer="sgd", loss="mse")

  def rows(size):
    return (tf.random.stateless_normal([size, 6], seed=[1, size]),
            tf.random.stateless_normal([size, 1], seed=[2, size]))

  planned = tfremat.remat_model(model, budget="50%", sample_input=rows(4096)[0],
                                sample_target=rows(4096)[1], verbose=0)
  plan = planned_chain(planned).plan
  allowed = 0.5 * plan.predicted_keep
  chosen = plan.segments_at((4, 6))  # Raised here.
  assert plan.predicted_bound_at((4, 6), chosen) <= allowed
  for size in (4, 5):  # Traced for 4 rows, then for any number.
    peak = measure.peak_bytes(planned.train_on_batch, *rows(size), calls=2)
    assert peak <= allowed, (size, peak, allowed)


@pytest.mark.slow
def test_a_gpt2_backbone_planned_at_one_length_trains_at_others():
  # Its plan's variants run save policies in a tf.switch_case, for any
  # length: there each TransformerDecoder's forward pass reads the padding
  # mask through the branch's capture of it, which its rerun must number
  # as it does its own input (it raised RerunMismatchError; before that,
  # planning raised a TypeError).
  pytest.importorskip("keras_hub")
  from tfremat import models  # pylint: disable=g-import-not-at-top
  model = models.hub_backbone("GPT2Backbone")
  model.compile(optimizer="adam", loss="mse")

  def batch(length):
    tokens = tf.random.stateless_uniform(
        [8, length], seed=[1, 2], dtype=tf.int32,
        maxval=models.HUB_SIZES["vocabulary_size"])
    return ({"token_ids": tokens, "padding_mask": tf.ones_like(tokens)},
            tf.zeros([8, length, models.HUB_SIZES["hidden_dim"]]))

  planned = tfremat.remat_model(model, budget="60%", sample_input=batch(64)[0],
                                sample_target=batch(64)[1], verbose=0)
  # Traced for any length from 32 on: each step runs, or raises naming a
  # length the plan does not fit (`_step_total` checks which).
  ran = [length for length in (64, 32, 96)
         if _step_total(planned, *batch(length)) is not None]
  assert 64 in ran, ran
  # All its variants, not the sample's plan alone (at 64, 32 and 96 here).
  assert len(planned_chain(planned).plan.variants) > 1


def test_a_group_of_layers_built_on_the_sample_fixes_no_axis():
  # The chain groups runs of single layers into a keras.Sequential, whose
  # first call (on the sample) builds it for that shape: that fixes no
  # size (it runs at any), so every axis is still perturbed to measure
  # growth. A functional part built for one image size fixes those axes.
  # (Every axis counted as fixed, so no growth was measured: a MobileNetV2
  # over images of any size was predicted from its sample alone.)
  group = keras.Sequential([keras.layers.Conv2D(4, 3, padding="same"),
                            keras.layers.ReLU()])
  group(tf.zeros([8, 32, 32, 3]))
  images = keras.Input((32, 32, 3))
  part = keras.Model(images, keras.layers.Conv2D(4, 3)(images))
  assert not any(budget_lib._fixed([group], axis) for axis in range(4))
  assert budget_lib._fixed([group, part], 1)
  assert not budget_lib._fixed([group, part], 0)


def test_a_cnn_built_for_one_image_size_is_planned_and_trained():
  # A functional CNN whose input has a fixed image size (as
  # keras.applications builds them by default): its chain's parts take
  # that size only, so only the batch may change (planning halved the
  # image and failed in a part's input check). At 90% of keeping
  # everything: at 80% the lowest plan's bound fitted by 2%, and where the
  # check, in a step traced for any batch (kept layers ungated, their peak
  # moving with thread timing), ran above its prediction on a loaded
  # machine, planning refused.
  keras.utils.set_random_seed(0)
  images = keras.Input((32, 32, 3))
  h = keras.layers.Conv2D(16, 3, padding="same", activation="relu")(images)
  for _ in range(3):
    f = keras.layers.Conv2D(32, 3, padding="same", activation="relu")(h)
    h = keras.layers.Add()([h, keras.layers.Conv2D(16, 1)(f)])
  h = keras.layers.GlobalAveragePooling2D()(h)
  model = keras.Model(images, keras.layers.Dense(10)(h))
  model.compile(optimizer="adam",
                loss=keras.losses.SparseCategoricalCrossentropy(
                    from_logits=True))
  x = tf.random.stateless_normal([16, 32, 32, 3], seed=[1, 2])
  y = tf.zeros([16], tf.int32)
  planned = tfremat.remat_model(model, budget="90%", sample_input=x,
                                sample_target=y, verbose=0)
  assert planned_chain(planned).plan.shape[1:3] == (32, 32)
  for size in (16, 8):  # The second traces for any batch size.
    planned.train_on_batch(x[:size], y[:size])
