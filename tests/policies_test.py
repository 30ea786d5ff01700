"""Save policies: exact gradients under each, kept ops not recomputed,
`saved_residuals`, `checkpoint_name`, serialization and errors.

The whole parity suite also runs under each built-in policy in CI
(`TFREMAT_TEST_POLICY`, see conftest.py); the parity tests here cover the
scenarios the policies most affect, under every policy, in one file.

Scenarios follow JAX's checkpoint policy tests (`jax/tests/api_test.py`:
`test_remat_checkpoint_dots`, `..._with_no_batch_dims`, `save_only_these_names`
with `checkpoint_name`, `print_saved_residuals`) and PyTorch's selective
checkpointing tests (`test/test_autograd.py`, policy functions that choose
ops), ported to TensorFlow graphs.
"""

import dataclasses
import keras
import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import models
from tfremat import policies
from tfremat._src.core import selective
from tfremat._src.core import residuals
from conftest import assert_parity, assert_trees_close, device_modes

# Policies act in graphs; eager calls keep nothing (tested below once).
GRAPH_MODES = device_modes(["function", "xla"])

# The MLP parity test's policies: the built-ins that differ on an MLP block
# and the composed ones. (Every built-in also runs the whole core parity
# suite in CI.)
ALL_POLICIES = {
    **{name: name for name in ("dots_saveable", "masks_saveable",
                               "dots_and_masks_saveable",
                               "everything_saveable")},
    "save_only_these_names": policies.save_only_these_names("hidden"),
    "save_anything_except_these_names":
        policies.save_anything_except_these_names("hidden"),
    "save_from_both_policies": policies.save_from_both_policies(
        "masks_saveable", policies.save_only_these_names("hidden")),
}


def _x(*shape, seed=0):
  return tf.random.stateless_normal(shape, seed=[seed, 11])


def _mlp_block(seed=0):
  keras.utils.set_random_seed(seed)
  dense1 = keras.layers.Dense(24, activation="relu")
  dropout = keras.layers.Dropout(0.4, seed=5)
  dense2 = keras.layers.Dense(8)
  norm = keras.layers.BatchNormalization()

  def block(x, training=True):
    h = tfremat.checkpoint_name(dense1(x), "hidden")
    return norm(dense2(dropout(h, training=training)), training=training)

  block(tf.zeros([1, 8]), training=False)
  layers = [dense1, dropout, dense2, norm]
  variables = [v for l in layers for v in l.variables]
  return block, [v for l in layers for v in l.trainable_weights], variables


@pytest.mark.parametrize("name", sorted(ALL_POLICIES))
@pytest.mark.parametrize("device, mode", GRAPH_MODES)
def test_mlp_dropout_batch_norm_parity_under_policies(device, mode, name):
  with tf.device(device):
    block, weights, variables = _mlp_block()

  def call(remat, x):
    if not remat:
      return block(x)
    return tfremat.RematerializeFn(block, x, policy=ALL_POLICIES[name])

  assert_parity(call, (_x(6, 8),), weights, mode, device, state=variables)


@pytest.mark.parametrize("name", [
    "dots_saveable", "dots_with_no_batch_dims_saveable",
    "dots_with_no_batch_dims_and_masks_saveable", "everything_saveable",
    "masks_and_softmax_saveable",
    "dots_with_no_batch_dims_masks_and_softmax_saveable"])
@pytest.mark.parametrize("device, mode", GRAPH_MODES)
def test_transformer_block_parity_under_policies(device, mode, name):
  # Attention (batched products, softmax, attention dropout), LayerNorm,
  # GELU, residuals: every kind of op the built-in policies choose between.
  # (The other built-ins run on the MLP block above, and every one runs the
  # whole parity suite, attention tests included, in CI.)
  with tf.device(device):
    block = models.transformer_block(6, 8, 2, dropout=0.3)
    layer = tfremat.RematerializationLayer(block, policy=name)
  call = lambda remat, x: (layer if remat else block)(x, training=True)
  # The key projection's bias shifts every score of a query equally, which
  # softmax ignores: its gradient is zero up to rounding, and its rounding
  # noise (1e-6 against 1e-5) is not a parity question.
  weights = [w for w in block.trainable_weights
             if not w.path.endswith("key/bias")]
  assert len(weights) == len(block.trainable_weights) - 1
  assert_parity(call, (_x(2, 6, 8),), weights, mode, device,
                state=block.variables)


@pytest.mark.parametrize("name", ["everything_saveable", "dots_saveable",
                                  "masks_and_softmax_saveable"])
def test_policies_are_exact_in_a_step_traced_for_any_batch_size(name):
  # A step traced with an unknown batch size (Keras's fit traces its train
  # function with reduce_retracing, and a last, smaller batch makes it
  # relax; tfremat.largest_batch measures such steps). The rerun's ops may
  # know fewer dimensions than the forward pass's (attention's reshapes
  # read the batch from the tensor); kept tensors are matched all the same.
  block = models.transformer_block(6, 8, 2, dropout=0.3)
  layer = tfremat.RematerializationLayer(block, policy=name)
  spec = tf.TensorSpec([None, 6, 8], tf.float32)
  weights = [w for w in block.trainable_weights
             if not w.path.endswith("key/bias")]
  found = {}
  before = [np.array(v.numpy()) for v in block.variables]
  for remat in (False, True):
    for v, value in zip(block.variables, before):
      v.assign(value)

    @tf.function(input_signature=[spec])
    def step(x, remat=remat):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = (layer if remat else block)(x, training=True)
        loss = tf.reduce_sum(y * y)
      return tape.gradient(loss, [x] + weights)

    found[remat] = step(_x(2, 6, 8))
  assert_trees_close(found[True], found[False])


@pytest.mark.parametrize("name", ["dots_saveable", "masks_saveable"])
@pytest.mark.parametrize("device, mode", GRAPH_MODES)
def test_conv_batch_norm_and_step_seed_dropout_parity(device, mode, name):
  with tf.device(device):
    keras.utils.set_random_seed(2)
    conv = keras.layers.Conv2D(4, 3, padding="same", activation="relu")
    norm = keras.layers.BatchNormalization()
    conv(tf.zeros([1, 5, 5, 2]))
    norm(tf.zeros([1, 5, 5, 4]))

  def block(x):
    h = norm(conv(x), training=True)
    return tfremat.DeterministicDropout(h, 0.6,
                                        tfremat.GenerateStepSeedPair())

  def call(remat, x):
    tfremat.ResetStepSeed(7)
    return tfremat.RematerializeFn(block, x, policy=name) if remat else block(x)

  variables = conv.variables + norm.variables
  tfremat.SetGlobalStep(tf.Variable(3, dtype=tf.int64))
  try:
    assert_parity(call, (_x(2, 5, 5, 2),),
                  conv.trainable_weights + norm.trainable_weights, mode,
                  device, state=variables)
  finally:
    tfremat.SetGlobalStep(None)


def _reachable_types(concrete):
  """Op types in the traced graph that the function's outputs depend on
  (what the runtime runs; the rest is pruned)."""
  graph = concrete.graph
  todo = [t.op for t in concrete.outputs]
  seen = set()
  counts = {}
  while todo:
    op = todo.pop()
    if op.name in seen:
      continue
    seen.add(op.name)
    counts[op.type] = counts.get(op.type, 0) + 1
    todo += [t.op for t in op.inputs] + list(op.control_inputs)
  del graph
  return counts


def _matmuls(policy, remat=True):
  keras.utils.set_random_seed(0)
  d1, d2 = keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)
  block = lambda x: d2(d1(x))
  block(tf.zeros([1, 8]))
  weights = d1.trainable_weights + d2.trainable_weights

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = (tfremat.RematerializeFn(block, x, policy=policy) if remat
           else block(x))
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, [x] + weights)

  counts = _reachable_types(step.get_concrete_function(
      tf.TensorSpec([3, 8])))
  return counts.get("MatMul", 0)


def test_kept_products_are_not_recomputed():
  # Two dense layers: 2 forward products and 4 gradient products (the first
  # layer's input gradient included). Full rematerialization adds the first
  # layer's recomputed product: the tanh gradient reads its output. (No
  # gradient reads the second layer's output, so its recompute is pruned
  # even without a policy.) Keeping that product recomputes none.
  plain = _matmuls(None, remat=False)
  assert plain == 6
  assert _matmuls(None) == plain + 1
  assert _matmuls("dots_saveable") == plain
  assert _matmuls("everything_saveable") == plain
  assert _matmuls("masks_saveable") == plain + 1
  width = lambda op: op.output_shapes[0][-1]
  assert _matmuls(lambda op: op.type == "MatMul" and width(op) == 16) == plain
  assert _matmuls(lambda op: op.type == "MatMul" and width(op) == 4) == (
      plain + 1)


def _attention_ops(policy, remat=True):
  """Softmax and batched-product ops a training step of an attention layer
  runs (forward, recompute and gradient)."""
  keras.utils.set_random_seed(3)
  attention = keras.layers.MultiHeadAttention(2, 4, dropout=0.2, seed=1)
  x = _x(2, 5, 8)
  attention(x, x, use_causal_mask=True)
  block = lambda h: attention(h, h, use_causal_mask=True, training=True)

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tfremat.RematerializeFn(block, x, policy=policy) if remat else (
          block(x))
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, [x] + attention.trainable_weights)

  counts = _reachable_types(step.get_concrete_function(
      tf.TensorSpec([2, 5, 8])))
  return counts.get("Softmax", 0), counts.get("BatchMatMulV2", 0)


def test_kept_softmax_recomputes_neither_it_nor_the_scores():
  # The softmax gradient reads only its output, so keeping the attention
  # probabilities leaves nothing in the backward pass that needs the scores:
  # neither the softmax nor the query-key product is recomputed. (Keras's
  # attention computes its products as BatchMatMulV2.) Full remat recomputes
  # five: the query, key and value projections, the scores and the
  # probabilities times the values; no gradient reads the output
  # projection's result, so its recompute is pruned. With the softmax kept,
  # the scores are not: the projections are (the scores' gradient reads the
  # queries and keys, the probabilities' the values), and so is the product
  # of probabilities and values (the output projection's weight gradient
  # reads it), unless a policy keeps them.
  softmaxes, products = _attention_ops(None, remat=False)
  assert softmaxes == 1
  assert _attention_ops(None) == (2, products + 5)
  assert _attention_ops("masks_and_softmax_saveable") == (1, products + 4)
  assert _attention_ops("dots_masks_and_softmax_saveable") == (1, products)
  assert _attention_ops(
      "dots_with_no_batch_dims_masks_and_softmax_saveable") == (
          1, products + 1)


def test_nothing_saveable_builds_exactly_todays_graph():
  # "A policy that saves nothing must cost nothing over today."
  def graph_ops(policy):
    keras.utils.set_random_seed(0)
    d = keras.layers.Dense(4)
    d(tf.zeros([1, 4]))

    @tf.function
    def step(x):
      with tf.GradientTape() as tape:
        tape.watch(x)
        y = tfremat.RematerializeFn(lambda h: tf.nn.relu(d(h)), x,
                                    policy=policy)
      return tape.gradient(y, [x] + d.trainable_weights)

    graph = step.get_concrete_function(tf.TensorSpec([2, 4])).graph
    return sorted(op.type for op in graph.get_operations())

  assert graph_ops("nothing_saveable") == graph_ops(None)
  assert "IdentityN" in graph_ops(None)  # The call's own custom gradient.


def _dense_block():
  keras.utils.set_random_seed(1)
  d1 = keras.layers.Dense(32, activation="relu")
  d2 = keras.layers.Dense(16)
  d2(d1(tf.zeros([1, 16])))
  return lambda x: d2(tfremat.checkpoint_name(d1(x), "hidden"))


def test_saved_residuals_lists_what_each_policy_keeps():
  block, x = _dense_block(), tf.zeros([8, 16])
  none = tfremat.saved_residuals(block, x)
  assert [(r.source, r.shape, r.num_bytes) for r in none] == [
      ("argument", (8, 16), 8 * 16 * 4)]
  dots = tfremat.saved_residuals(block, x, policy="dots_saveable")
  kept = [r for r in dots if r.source == "policy"]
  assert [(r.shape, r.dtype) for r in kept] == [((8, 32), "float32"),
                                                ((8, 16), "float32")]
  assert all(r.what.startswith("MatMul") for r in kept)
  assert dots.total_bytes == (8 * 16 + 8 * 32 + 8 * 16) * 4
  named = tfremat.saved_residuals(
      block, x, policy=policies.save_only_these_names("hidden"))
  assert [r.what for r in named if r.source == "policy"] == [
      "checkpoint_name 'hidden'"]
  text = str(dots)
  assert "dots_saveable" in text and "MatMul" in text and "(8, 32)" in text
  assert "total: 3 tensors" in text


@pytest.mark.parametrize("block", ["mlp", "transformer"])
def test_one_trace_lists_what_each_of_several_policies_keeps(block):
  # The planner asks what each of its policies keeps of every layer; one
  # trace answers for all, exactly as a trace per policy does.
  if block == "mlp":
    fn, x = _mlp_block()[0], _x(6, 8)
  else:
    keras.utils.set_random_seed(0)
    layer = models.transformer_block(6, 8, 2, dropout=0.3)
    fn, x = lambda h: layer(h, training=True), _x(2, 6, 8)
  asked = [*ALL_POLICIES.values(), *policies.PLANNED]
  together = residuals.policy_residuals(fn, x, among=asked)
  assert len(together) == len(asked)
  for policy, found in zip(asked, together):
    alone = tfremat.saved_residuals(fn, x, policy=policy)
    assert list(found) == [r for r in alone if r.source == "policy"], policy


def test_saved_residuals_lists_captured_tensors():
  # Read by closure, not passed; larger than the 128 elements below which a
  # tf.function captures an eager tensor as a constant.
  outside = tf.ones([16, 16]) * 2.0
  found = tfremat.saved_residuals(lambda h: h @ outside, tf.zeros([2, 16]))
  assert [(r.source, r.shape) for r in found] == [("argument", (2, 16)),
                                                  ("captured", (16, 16))]


def test_save_anything_except_recomputes_the_named_tensor_and_its_op():
  block, x = _dense_block(), tf.zeros([8, 16])
  everything = tfremat.saved_residuals(block, x, policy="everything_saveable")
  but_hidden = tfremat.saved_residuals(
      block, x, policy=policies.save_anything_except_these_names("hidden"))
  names = lambda r: {e.what for e in r if e.source == "policy"}
  dropped = names(everything) - names(but_hidden)
  # The named identity and the ReLU computing it; the product before it
  # stays kept.
  assert dropped == {"checkpoint_name 'hidden'"} | {
      w for w in dropped if w.startswith("Relu")}
  assert any(w.startswith("Relu") for w in dropped)
  assert any(w.startswith("MatMul") for w in names(but_hidden))


def test_user_policy_sees_the_ops_description():
  seen = []

  def record(op):
    seen.append(op)
    return False

  block = _dense_block()
  tfremat.saved_residuals(block, tf.zeros([8, 16]), policy=record)
  matmuls = [op for op in seen if op.type == "MatMul"]
  assert len(matmuls) == 2
  assert matmuls[0].input_shapes[0] == tf.TensorShape([8, 16])
  assert matmuls[0].output_shapes == (tf.TensorShape([8, 32]),)
  assert matmuls[0].output_dtypes == (tf.float32,)
  assert matmuls[0].output_bytes == 8 * 32 * 4
  named = [op for op in seen if op.checkpoint_name == "hidden"]
  assert len(named) == 1 and named[0].type == "Identity"


def test_batch_dims_tell_attention_scores_from_projections():
  op = lambda t, shapes, eq=None: policies.Op(
      t, "op", tuple(tf.TensorShape(s) for s in shapes), (), (), (),
      attrs={"equation": eq} if eq else {})
  dense3d = op("BatchMatMulV2", [[2, 5, 8], [8, 8]])
  scores = op("BatchMatMulV2", [[2, 4, 5, 2], [2, 4, 2, 5]])
  einsum_dense = op("Einsum", [[2, 5, 8], [8, 4, 2]], "abc,cde->abde")
  einsum_scores = op("Einsum", [[2, 5, 4, 2], [2, 5, 4, 2]],
                     "aecd,abcd->acbe")
  for o in (dense3d, scores, einsum_dense, einsum_scores):
    assert policies.dots_saveable(o)
  assert policies.dots_with_no_batch_dims_saveable(dense3d)
  assert policies.dots_with_no_batch_dims_saveable(einsum_dense)
  assert not policies.dots_with_no_batch_dims_saveable(scores)
  assert not policies.dots_with_no_batch_dims_saveable(einsum_scores)
  assert policies.dots_saveable(op("Conv2D", [[1, 4, 4, 2], [3, 3, 2, 2]]))
  assert not policies.dots_saveable(op("Relu", [[2, 2]]))


def test_eager_calls_keep_nothing_and_stay_exact():
  block, weights, variables = _mlp_block()
  calls = []
  tfremat._src.core.remat._observers.append(calls)  # pylint: disable=protected-access
  try:
    assert_parity(
        lambda remat, x: (tfremat.RematerializeFn(block, x, policy="dots_saveable")
                          if remat else block(x)),
        (_x(6, 8),), weights, "eager", "/CPU:0", state=variables)
  finally:
    tfremat._src.core.remat._observers.remove(calls)  # pylint: disable=protected-access
  assert calls and all(c.saver is None for c in calls)


def test_scope_sets_the_default_and_an_explicit_policy_wins():
  block = _dense_block()
  x = tf.zeros([4, 16])
  with policies.scope("dots_saveable"):
    assert tfremat.saved_residuals(block, x).bytes_from("policy") > 0
    assert tfremat.saved_residuals(
        block, x, policy="masks_saveable").bytes_from("policy") == 0
  assert tfremat.saved_residuals(block, x).bytes_from("policy") == 0


def test_a_rerun_that_builds_other_ops_raises():
  calls = [0]

  def unstable(x):
    calls[0] += 1
    h = tf.matmul(x, tf.ones([4, 4]))
    if calls[0] > 1:  # Python state deciding what is built.
      h = tf.matmul(h, tf.ones([4, 4]))
    return tf.tanh(h)

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tfremat.RematerializeFn(unstable, x, policy="dots_saveable")
    return tape.gradient(y, x)

  with pytest.raises(tfremat.RerunMismatchError, match="dots_saveable"):
    step(tf.ones([2, 4]))


def test_layer_policy_round_trips_through_config_and_a_keras_file(tmp_path):
  keras.utils.set_random_seed(0)
  for policy in ("dots_saveable", policies.save_only_these_names("a", "b"),
                 policies.save_from_both_policies(
                     "masks_saveable",
                     policies.save_anything_except_these_names("c"))):
    layer = tfremat.RematerializationLayer(keras.layers.Dense(3),
                                           policy=policy)
    model = keras.Sequential([keras.Input((2,)), layer])
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path).layers[0]
    assert policies.name_of(policies.get(loaded.policy)) == (
        policies.name_of(policies.get(policy)))
    np.testing.assert_allclose(loaded(tf.ones([1, 2])),
                               layer(tf.ones([1, 2])))


def test_policies_are_values_combined_with_or():
  dots, masks = policies.dots_saveable, policies.masks_saveable
  # The built-in unions are combinations, under the names users know.
  assert dots | masks == masks | dots == policies.dots_and_masks_saveable
  assert policies.get("dots_and_masks_saveable") == dots | masks
  assert (dots | masks).name == "dots_and_masks_saveable"
  assert (policies.masks_and_softmax_saveable | dots ==
          policies.dots_masks_and_softmax_saveable)
  # Keeping nothing adds nothing; keeping everything absorbs the rest.
  assert dots | policies.nothing_saveable is dots
  assert masks | policies.everything_saveable == policies.everything_saveable
  named = policies.save_only_these_names("hidden")
  assert named == policies.save_only_these_names("hidden") != (
      policies.save_only_these_names("other"))
  both = masks | named
  assert both == policies.save_from_both_policies("masks_saveable", named)
  assert both.name == "masks_saveable | save_only_these_names('hidden')"
  assert policies.serialize(both) == {
      "any_of": ["masks_saveable", {"save_only_these_names": ["hidden"]}]}
  assert policies.deserialize(policies.serialize(both)) == both
  # A config written by earlier versions still loads.
  assert policies.deserialize({"save_from_both_policies": [
      "dots_saveable", "masks_saveable"]}) == policies.dots_and_masks_saveable
  # Frozen, hashable, and what they keep follows from the parts.
  with pytest.raises(dataclasses.FrozenInstanceError):
    named.names = ("x",)
  assert len({dots | masks, masks | dots, dots}) == 2
  op = policies.Op("Softmax", "s", (), (), (), (tf.float32,))
  assert not (dots | masks)(op) and (masks | policies.softmax_saveable)(op)
  # A plain function of an Op combines with a Policy either way round.
  softmax_fn = lambda o: o.type == "Softmax"
  assert (dots | softmax_fn)(op) and (softmax_fn | dots)(op)
  assert (policies.save_anything_except_these_names("a") | dots
         ).unsave_named_inputs


def test_remat_sequential_segments_carry_their_policy(tmp_path):
  blocks = models.residual_mlp(4, 8, dropout=0.2, residual_inside=True)
  layer = tfremat.RematSequential(
      blocks, [(0, 2, True, "dots_saveable"), (2, 3, False), (3, 4, True)])
  remats = [s for s in layer.steps
            if isinstance(s, tfremat.RematerializationLayer)]
  # Names are parsed once, into values.
  assert [r.policy for r in remats] == [policies.dots_saveable, None]
  config = layer.get_config()
  assert config["segments"][0] == [0, 2, True, "dots_saveable"]
  uniform = tfremat.remat_sequential(blocks, segments=2,
                                     policy="masks_saveable")
  assert all(s.policy == policies.masks_saveable for s in uniform.steps)
  path = str(tmp_path / "chain.keras")
  keras.Sequential([keras.Input((8,)), layer]).save(path)
  loaded = keras.models.load_model(path).layers[0]
  assert loaded.segments == layer.segments


@pytest.mark.parametrize("bad, error, match", [
    ("dots", ValueError, "Unknown policy 'dots'"),
    (3, TypeError, "A policy is a function"),
])
def test_bad_policies_are_refused_before_anything_runs(bad, error, match):
  ran = []
  with pytest.raises(error, match=match):
    tfremat.RematerializeFn(lambda x: ran.append(x) or x, tf.ones([2]),
                            policy=bad)
  assert not ran
  with pytest.raises(error, match=match):
    tfremat.RematerializationLayer(keras.layers.Dense(2), policy=bad)
  with pytest.raises(error, match=match):
    tfremat.rematerialize(policy=bad)
  with pytest.raises(error, match=match):
    tfremat.remat_sequential([keras.layers.Dense(2)], segments=1, policy=bad)
  with pytest.raises(TypeError, match="must return True or False"):
    tfremat.saved_residuals(lambda h: h @ tf.ones([2, 2]), tf.ones([1, 2]),
                            policy=lambda op: "yes")
  with pytest.raises(TypeError, match="non-empty string"):
    policies.save_only_these_names()
  with pytest.raises(TypeError, match="non-empty string"):
    tfremat.checkpoint_name(tf.ones([1]), "")


def test_planner_policies_must_be_policies():
  blocks = [keras.layers.Dense(2)]
  for bad in (["dots"], [3], [tfremat.policies.nothing_saveable]):
    with pytest.raises(ValueError, match="Choose from"):
      tfremat.remat_sequential(blocks, budget="50%",
                               sample_input=tf.ones([1, 2]), policies=bad)
  with pytest.raises(ValueError, match="policies="):
    tfremat.remat_sequential(blocks, budget="50%", sample_input=tf.ones([1, 2]),
                             policy="dots_saveable")


def test_ops_inside_control_flow_are_recomputed_not_kept():
  # A tf.cond branch's tensors do not exist outside it: only the function's
  # own graph's ops are candidates.
  def block(x):
    return tf.cond(tf.reduce_sum(x) > 0, lambda: tf.matmul(x, tf.ones([3, 3])),
                   lambda: tf.matmul(x, 2 * tf.ones([3, 3])))

  found = tfremat.saved_residuals(block, tf.ones([2, 3]),
                                  policy="dots_saveable")
  assert found.bytes_from("policy") == 0

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tfremat.RematerializeFn(block, x, policy="dots_saveable")
      loss = tf.reduce_sum(y * y)
    return tape.gradient(loss, x)

  expected = 2 * tf.matmul(tf.ones([2, 3]) @ tf.ones([3, 3]), tf.ones([3, 3]))
  np.testing.assert_allclose(step(tf.ones([2, 3])), expected)


def test_only_ops_reading_the_inputs_are_candidates():
  # The matching key is the op type, or the checkpoint name; ops computed
  # from constants (or weights, seeds) alone are never kept.
  graph = tf.Graph()
  with graph.as_default():
    x = tf.compat.v1.placeholder(tf.float32, [2, 3])
    saver = selective.ForwardSaver("dots_saveable", [x])
    with saver:
      tf.matmul(tf.ones([2, 3]), tf.ones([3, 3]))
      tf.matmul(x, tf.ones([3, 3]))
      tfremat.checkpoint_name(x, "n")
  assert list(saver.saved) == [("MatMul", 0)]
  assert saver.signatures["MatMul"] == [(((2, 3), tf.float32),)]
  assert ("checkpoint", "n") in saver.signatures


@pytest.mark.parametrize("jit", [False, True], ids=["function", "xla"])
@pytest.mark.parametrize("name", ["dots_saveable", "everything_saveable"])
def test_an_argument_captured_into_a_branch_is_data_in_both_passes(name, jit):
  # In a tf.switch_case branch (a planned chain's variants in a step traced
  # for any shape) an argument made outside the branch reaches the
  # function's ops through the branch's capture of it. The forward pass
  # took the capture for a constant and numbered only the ops reading the
  # other argument; the rerun, whose arguments are its own inputs, numbered
  # both, and raised RerunMismatchError (a KerasHub TransformerDecoder's
  # padding mask, planned under a policy, did so).
  w1 = tf.Variable(tf.random.stateless_normal([4, 4], seed=[1, 1]))
  w2 = tf.Variable(tf.random.stateless_normal([4, 4], seed=[1, 2]))

  def gradients(remat):
    @tf.function(input_signature=[tf.TensorSpec([None, 4]),
                                  tf.TensorSpec([None, 4]),
                                  tf.TensorSpec([], tf.int32)],
                 jit_compile=jit)
    def step(x, m, branch):
      # Read outside the branch: TensorFlow's cond gradient does not
      # resolve a variable first captured inside one.
      v1, v2 = w1 * 1.0, w2 * 1.0

      def fn(a, b):
        return tf.tanh(tf.matmul(b, v1)) * tf.tanh(tf.matmul(a, v2))

      def first():
        a = x * 2.0  # Made in the branch; m is captured into it.
        return (tfremat.RematerializeFn(fn, a, m, policy=name) if remat
                else fn(a, m))
      y = tf.switch_case(branch, [first, lambda: x + m])
      return tf.gradients(tf.reduce_sum(y**2), [x, m, w1, w2])
    return step(tf.random.stateless_normal([3, 4], seed=[1, 3]),
                tf.random.stateless_normal([3, 4], seed=[1, 4]),
                tf.constant(0))

  assert_trees_close(gradients(True), gradients(False))
