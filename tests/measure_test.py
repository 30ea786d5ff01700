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
  # The temporary and the 4-byte sum; counting x would add 4 MiB.
  assert 4 * _N <= peak <= 4 * _N + 256, peak


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


def test_peak_bytes_while_another_profiler_runs_says_what_to_do(tmp_path):
  # A step's memory is read from TensorFlow's profiler, one session at a time.
  x = tf.random.stateless_normal([_N], seed=[1, 2])
  step = tf.function(tf.sin)
  tf.profiler.experimental.start(str(tmp_path))
  try:
    with pytest.raises(RuntimeError, match="tf.profiler.experimental.stop"):
      measure.peak_bytes(step, x)
  finally:
    tf.profiler.experimental.stop()
  assert measure.peak_bytes(step, x) == 4 * _N


def test_peak_bytes_without_the_bfc_allocator_says_how_to_turn_it_on():
  # TensorFlow's default CPU allocator reports to the profiler only tensors
  # above 256 KiB (with oneDNN) or none (without): a step's memory would be
  # undercounted. tfremat leaves an explicit setting alone, and refuses,
  # with oneDNN and without.
  code = textwrap.dedent("""
      import tfremat, tensorflow as tf
      try:
        tfremat.measure.peak_bytes(tf.function(lambda: tf.ones([8])))
      except RuntimeError as e:
        print(e)
  """)
  for onednn in ("1", "0"):
    env = dict(os.environ, TF_CPU_ALLOCATOR_USE_BFC="false",
               TF_ENABLE_ONEDNN_OPTS=onednn, TF_CPP_MIN_LOG_LEVEL="3",
               CUDA_VISIBLE_DEVICES="")
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True).stdout
    assert "TF_CPU_ALLOCATOR_USE_BFC=true" in out, (onednn, out)


def test_importing_tfremat_turns_on_the_bfc_allocator():
  code = textwrap.dedent("""
      import os
      import tfremat
      print(os.environ.get("TF_CPU_ALLOCATOR_USE_BFC"))
  """)
  env = {k: v for k, v in os.environ.items()
         if k != "TF_CPU_ALLOCATOR_USE_BFC"}
  env.update(TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")
  out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                       capture_output=True, text=True).stdout
  assert out.strip().splitlines()[-1] == "true", out


def test_small_tensors_count_too():
  # The tensors' requested sizes, down to a few bytes: a 4 KiB temporary.
  x = tf.random.stateless_normal([1024], seed=[1, 2])
  peak = measure.peak_bytes(tf.function(lambda x: tf.reduce_sum(tf.sin(x))),
                            x)
  assert 4096 <= peak <= 4096 + 256, peak


def test_allocated_bytes_are_the_allocators_chunks():
  # BFC rounds each request up to 256 bytes at least.
  x = tf.random.stateless_normal([1000], seed=[1, 2])
  found = measure.step_peaks(tf.function(tf.sin), x, calls=2)
  assert all(p.requested_bytes == 4000 for p in found), found
  assert all(p.allocated_bytes >= 4096 for p in found), found


def test_step_peaks_give_what_a_call_leaves_allocated():
  x = tf.random.stateless_normal([_N], seed=[1, 2])
  kept = []
  step = tf.function(lambda x: tf.sin(x))

  def keeping(x):
    kept.append(step(x))  # Held after the call: 4 MiB.
    return kept[-1]

  left = measure.step_peaks(keeping, x, calls=2)
  assert [p.held_bytes for p in left] == [4 * _N] * 2, left
  assert all(p.requested_bytes == 4 * _N for p in left), left


def test_held_bytes_sees_what_a_tape_holds():
  x = tf.random.stateless_normal([_N], seed=[3, 4])

  def taped():
    with tf.GradientTape() as tape:
      tape.watch(x)
      y = tf.sin(tf.sin(x))  # The tape keeps the inner sin's output.
    return tape, y

  (tape, y), held = measure.held_bytes(taped)
  assert held >= 2 * 4 * _N, held
  del tape, y


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
  # Already called with these arguments: no untimed call.
  calls.update(a=0)
  medians = measure.median_seconds([make("a")], 1, repeats=3, warmup=False)
  assert calls["a"] == 3 and len(medians) == 1


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
