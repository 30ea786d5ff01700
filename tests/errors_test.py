"""Every error tfremat raises starts with "tfremat: ", is still the built-in
exception callers catch, and keeps its class through a tf.function."""

import keras
import pytest
import tensorflow as tf

import tfremat
from tfremat import planner

PREFIX = "tfremat: "


def _raised(fn):
  with pytest.raises(Exception) as info:
    fn()
  return info.value


@pytest.mark.parametrize("call, builtin", [
    (lambda: tfremat.RematerializeFn(3), TypeError),
    (lambda: tfremat.RematerializeFn(lambda x: x, tf.ones([2]),
                                     determinism_check="sometimes"),
     ValueError),
    (lambda: tfremat.remat_sequential([], segments=2), TypeError),
    (lambda: tfremat.RematerializationLayer(keras.layers.InputLayer(
        shape=(2,))), TypeError),
    (lambda: planner.Budget.parse("a lot"), ValueError),
    (lambda: tfremat.lingvo.Params().dims, AttributeError),
    (lambda: tfremat.policies.deserialize("no_such_policy"), ValueError),
], ids=["callable", "determinism", "chain", "input_layer", "budget", "params",
        "policy"])
def test_a_message_starts_with_the_prefix_once(call, builtin):
  error = _raised(call)
  assert isinstance(error, tfremat.errors.Error), type(error)
  assert isinstance(error, builtin), type(error)
  assert str(error).startswith(PREFIX), str(error)
  assert not str(error)[len(PREFIX):].startswith(PREFIX), str(error)


def test_an_error_raised_while_tracing_keeps_its_class():
  # AutoGraph re-raises errors from traced code; a class with its own
  # __init__ would reach the caller as a StagingError.
  @tf.function
  def draws(x):
    return tfremat.RematerializeFn(
        lambda h: h * tf.random.uniform(tf.shape(h)), x)

  error = _raised(lambda: draws(tf.ones([4])))
  assert isinstance(error, tfremat.UnreplayableOpError), type(error)
  assert str(error).count(PREFIX) == 1, str(error)

  @tf.function
  def bad_check(x):
    return tfremat.RematerializeFn(lambda h: h, x, determinism_check="no")

  error = _raised(lambda: bad_check(tf.ones([4])))
  assert isinstance(error, tfremat.errors.InvalidArgumentError), type(error)
  assert str(error).count(PREFIX) == 1, str(error)
