"""A rematerialized call's variable reads stay before the step's later writes.

The rerun in the backward pass uses the values the forward pass read. When a
training step updates the weights in the same graph (`optimizer.apply` after
`tape.gradient`, as `model.fit` does), TensorFlow orders each read before the
update with a control edge. Grappler, the graph optimizer that runs before a
`tf.function` executes, may drop that edge when another path seems to imply
the order: the `tf.custom_gradient` identity that attaches the call's
gradient reads every source of the gradient, the weights' values among them,
so the edge looks redundant; Grappler then forwards the identity's inputs
past it, and nothing orders the read any more. The rerun then sometimes
reads the updated weight, and gradients are silently wrong, at random from
one trace to the next (seen in CI as a `fit` parity failure).

These tests run Grappler on the step's graph, as the runtime does, and check
the order directly, so they fail deterministically where the race is rare.
"""

import keras
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.grappler import tf_optimizer
from tensorflow.python.training import saver as saver_lib

import tfremat
from tfremat._src.core import forward_ops
from tfremat._src.core import unreplayable
from conftest import DEVICES


def _resource(node):
  return node.input[0].split(":")[0]


def _ancestors(nodes, name):
  seen, stack = set(), [name]
  while stack:
    for i in nodes[stack.pop()].input:
      i = i.lstrip("^").split(":")[0]
      if i not in seen and i in nodes:
        seen.add(i)
        stack.append(i)
  return seen


def _reads_after_writes(step, *args):
  """(read, write) pairs of one variable where the traced graph ran the read
  first but the graph Grappler optimizes it into does not."""
  graph = step.get_concrete_function(*args).graph
  graph_def = graph.as_graph_def()
  with tf.Graph().as_default() as imported:
    tf.graph_util.import_graph_def(graph_def, name="")
    meta_graph = saver_lib.export_meta_graph(graph=imported)
  fetch = meta_graph.collection_def["train_op"].node_list.value
  for t in graph.outputs:
    fetch.append(t.name)
  before = {n.name: n for n in graph_def.node}
  for node in graph_def.node:
    if unreplayable._is_variable_write(node.op):
      fetch.append(node.name)
  optimized = tf_optimizer.OptimizeGraph(config_pb2.ConfigProto(), meta_graph)
  after = {n.name: n for n in optimized.node}
  assert len(after) < len(before)  # Grappler did run.
  found = []
  for write in (n for n in graph_def.node if unreplayable._is_variable_write(n.op)):
    ordered = _ancestors(before, write.name)
    still = _ancestors(after, write.name)
    for name in ordered:
      read = before[name]
      if (read.op == "ReadVariableOp" and _resource(read) == _resource(write)
          and name in after and name not in still):
        found.append((name, write.name))
  return found


def _keras_step(policy):
  keras.utils.set_random_seed(1)
  block = keras.Sequential([keras.layers.Dense(8, activation="relu"),
                            keras.layers.Dropout(0.2, seed=3),
                            keras.layers.Dense(4)])
  layer = tfremat.RematerializationLayer(block, policy=policy)
  x = tf.random.stateless_normal([4, 6], seed=[1, 2])
  layer(x)
  optimizer = keras.optimizers.SGD(0.1)

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(layer(x, training=True)))
    grads = tape.gradient(loss, layer.trainable_weights)
    optimizer.apply(grads, layer.trainable_weights)
    return loss

  return step, x


def _raw_variable_step():
  # Lingvo-style: plain tf.Variables closed over, updated by assign_sub.
  w1 = tf.Variable(tf.random.stateless_normal([6, 8], seed=[3, 4]))
  w2 = tf.Variable(tf.random.stateless_normal([8, 4], seed=[5, 6]))
  x = tf.random.stateless_normal([4, 6], seed=[1, 2])

  def block(h):
    return tf.matmul(tf.nn.relu(tf.matmul(h, w1)), w2)

  @tf.function
  def step(x):
    with tf.GradientTape() as tape:
      loss = tf.reduce_sum(tf.square(tfremat.RematerializeFn(block, x)))
    grads = tape.gradient(loss, [w1, w2])
    for w, g in zip((w1, w2), grads):
      w.assign_sub(0.1 * g)
    return loss

  return step, x


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", [None, "dots_saveable"])
def test_keras_weights_are_read_before_the_optimizer_updates_them(
    device, policy):
  with tf.device(device):
    step, x = _keras_step(policy)
    assert _reads_after_writes(step, x) == []


@pytest.mark.parametrize("device", DEVICES)
def test_raw_variables_are_read_before_they_are_assigned(device):
  # Grappler kept this order even before the fix (its graph differs: the
  # gradient reaches a raw variable through a read of its handle); the test
  # guards the raw variables' path through the shared forward read.
  with tf.device(device):
    step, x = _raw_variable_step()
    assert _reads_after_writes(step, x) == []


def test_the_check_finds_the_reads_of_a_rerun_reading_values_of_its_own(
    monkeypatch):
  # Before the fix, the rerun read values that tfremat read after the forward
  # pass, which nothing but the dropped edges ordered; the check finds those.
  monkeypatch.setattr(forward_ops.ForwardOps, "first_read", lambda self, v: None)
  step, x = _keras_step(None)
  assert _reads_after_writes(step, x)
