"""Tests of tfremat.measure: a step's peak memory and its time."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import tensorflow as tf

import tfremat
from tfremat import measure

_N = 1 << 20  # Floats: 4 MiB.


def test_peak_bytes_counts_a_steps_temporaries_not_its_inputs():
  x = tf.random.stateless_normal([_N], seed=[1, 2])

  @tf.function
  def step(x):
    # One temporary of x's size; the scalar result is a few bytes.
    return tf.reduce_sum(tf.sin(x))

  peak = measure.peak_bytes(step, x)
  # Counting x (4 MiB more) would reach 8 MiB; the allocator's own
  # bookkeeping adds well under that.
  assert 4 * _N <= peak < 2 * 4 * _N, peak


def test_peak_bytes_grows_with_what_the_step_holds():
  x = tf.random.stateless_normal([_N], seed=[1, 2])
  one = tf.function(lambda x: tf.reduce_sum(tf.sin(x)))
  # Both temporaries are live at once: the product reads both.
  two = tf.function(lambda x: tf.reduce_sum(tf.sin(x) * tf.cos(x)))
  peak_one, peak_two = measure.peak_bytes(one, x), measure.peak_bytes(two, x)
  assert peak_one < 2 * 4 * _N <= peak_two, (peak_one, peak_two)


def test_peak_bytes_warms_up_once_then_calls_calls_times():
  calls = []

  def step(x, scale=1.0):
    calls.append(scale)
    return x * scale

  measure.peak_bytes(step, tf.ones([4]), calls=3, scale=2.0)
  assert calls == [2.0] * 4
  calls.clear()
  measure.peak_bytes(step, tf.ones([4]), calls=2, warmup=False)
  assert calls == [1.0] * 2


def test_peak_bytes_measures_keras_train_on_batch():
  model = tf.keras.Sequential([tf.keras.layers.Dense(256, activation="relu"),
                               tf.keras.layers.Dense(1)])
  model.compile(optimizer="sgd", loss="mse")
  x, y = tf.ones([512, 64]), tf.ones([512, 1])
  # The 512 x 256 hidden activation (0.5 MiB) is kept for the backward pass.
  assert measure.peak_bytes(model.train_on_batch, x, y, calls=2) >= 512 * 256 * 4


@pytest.mark.parametrize("calls", [0, -1, 1.5, True, "5"])
def test_peak_bytes_rejects_calls_before_calling(calls):
  called = []
  with pytest.raises(ValueError, match="calls must be a positive int"):
    measure.peak_bytes(called.append, 1, calls=calls)
  assert not called


def test_peak_bytes_without_allocator_statistics_says_how_to_turn_them_on():
  # TensorFlow's default CPU allocator keeps no statistics; tfremat leaves an
  # explicit setting alone. On CPUs where TensorFlow turns oneDNN on by
  # default (AVX512_VNNI and newer), its CPU allocator keeps statistics even
  # without BFC, so oneDNN is turned off here: this test is about the plain
  # allocator, on any machine.
  env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="false",
             TF_ENABLE_ONEDNN_OPTS="0", TF_CPP_MIN_LOG_LEVEL="3",
             CUDA_VISIBLE_DEVICES="")
  code = textwrap.dedent("""
      import tfremat, tensorflow as tf
      try:
        tfremat.measure.peak_bytes(tf.function(lambda: tf.ones([8])))
      except RuntimeError as e:
        print(e)
  """)
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout
  assert "TF_CPU_ALLOCATOR_USE_BFC=true" in out, out


def test_peak_bytes_refuses_statistics_that_are_always_zero(monkeypatch):
  # Some builds' default CPU allocator reports statistics, all zero, where
  # others raise: a peak of 0 would be a meaningless measurement.
  monkeypatch.setattr(tf.config.experimental, "get_memory_info",
                      lambda device: {"current": 0, "peak": 0})
  monkeypatch.setattr(tf.config.experimental, "reset_memory_stats",
                      lambda device: None)
  step = tf.function(lambda: tf.ones([8]))
  with pytest.raises(RuntimeError, match="TF_CPU_ALLOCATOR_USE_BFC=true"):
    measure.peak_bytes(step)
  with pytest.raises(RuntimeError, match="no allocation while a tensor"):
    measure.current_bytes()


def test_current_bytes_sees_a_held_tensor():
  before = measure.current_bytes()
  held = tf.random.stateless_normal([_N], seed=[3, 4])
  assert measure.current_bytes() - before >= 4 * _N
  del held


def test_median_seconds_times_each_fn_in_every_round():
  calls = {"a": 0, "b": 0}

  def make(name):
    def fn(x):
      calls[name] += 1
      return x
    return fn

  times = measure.seconds([make("a"), make("b")], 1, repeats=4)
  # One untimed call each, then one per round.
  assert calls == {"a": 5, "b": 5}
  assert [len(t) for t in times] == [4, 4]
  medians = measure.median_seconds([make("a")], 1, repeats=3)
  assert len(medians) == 1 and medians[0] >= 0


def test_format_bytes_gives_mib():
  assert measure.format_bytes(79 * 2**20) == "79.0 MiB"
  assert tfremat.measure is measure


def test_restoring_puts_variables_back_also_between_measurements():
  weight = tf.Variable([1.0, 2.0])
  with measure.restoring([weight]) as snapshot:
    weight.assign([5.0, 5.0])
    snapshot.restore()
    np.testing.assert_array_equal(weight.numpy(), [1.0, 2.0])
    weight.assign_add([1.0, 1.0])
  np.testing.assert_array_equal(weight.numpy(), [1.0, 2.0])
