"""The Keras layers that `tfremat.builder` composes, each with `Params()`.

As in Lingvo, a layer is described by its Params and creates its weights when
it is instantiated, so a stack's weights exist, in the order its sub-layers
appear, before it is first called. Layers take any number of tensors and
return a tuple of tensors, or the tensor itself when there is one
(Lingvo's convention): `layer(*tensors, training=...)`.
"""

import keras
import tensorflow as tf

from tfremat import errors
from tfremat._src.core import hyperparams
from tfremat._src.core import step_seed
from tfremat._src.planning.apply import apply_plan

__all__ = [
    "BaseLayer",
    "SequentialLayer",
    "PlannedSeqLayer",
    "RepeatLayer",
    "ConcatMerge",
    "Add",
    "ParallelLayer",
    "FnLayer",
    "IdentityLayer",
    "ArgIndexLayer",
    "LinearLayer",
    "BiasLayer",
    "LayerNorm",
    "DeterministicDropoutLayer",
    "KerasDropoutLayer",
    "MultiHeadAttentionLayer",
    "EmbeddingLayer",
]


def _ToTuple(xs):
  return tuple(xs) if isinstance(xs, (tuple, list)) else (xs,)


def _FromTuple(xs):
  return xs[0] if len(xs) == 1 else tuple(xs)


class BaseLayer(keras.layers.Layer):
  """A Keras layer configured by Lingvo-style Params."""

  @classmethod
  def Params(cls):
    p = hyperparams.InstantiableParams(cls)
    p.Define("fprop_dtype", None,
             "Dtype (or Keras dtype policy) of the layer's computation; "
             "None: the global Keras policy.")
    return p

  def __init__(self, params):
    super().__init__(name=params.name, dtype=params.fprop_dtype)
    self.params = params.Copy()
    self.built = True  # Weights are created in __init__, from the params.

  def get_config(self):
    raise errors.UnsupportedError(
        f"{type(self).__name__} is built from Params; save its weights "
        "(save_weights) and rebuild it from its Params (p.ToText() / "
        "p.FromText()) rather than with get_config.")


class SequentialLayer(BaseLayer):
  """Connects sub-layers sequentially."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("sub", [], "Params of the sub-layers, applied in order.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.subs = [sub.Instantiate() for sub in params.sub]

  def call(self, *xs, training=None):
    for sub in self.subs:
      xs = _ToTuple(sub(*xs, training=training))
    return _FromTuple(xs)


class PlannedSeqLayer(BaseLayer):
  """Sub-layers in sequence, run as the planner's plan says: the builder's
  `_RematerializeSeq(..., budget=...)`. The plan's segments, their save
  policies, nested segments and order are those it measured
  (`tfremat.chain.apply_plan`); `.plan` is the plan."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("sub", [], "Params of the sub-layers, applied in order.")
    p.Define("plan", None, "The tfremat.planner.Plan chosen for them.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.chain = apply_plan([sub.Instantiate() for sub in params.sub],
                            params.plan, name=f"{params.name}_chain")

  @property
  def plan(self):
    return self.chain.plan

  def call(self, x, training=None):
    return self.chain(x, training=training)


class RepeatLayer(BaseLayer):
  """Applies `repeat` copies of a body, each with its own weights."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("body", None, "Params of the repeated body.")
    p.Define("repeat", 1, "How many times to apply the body.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.reps = []
    for i in range(params.repeat):
      body = params.body.Copy()
      body.name = f"{body.name or params.name}_{i}"
      self.reps.append(body.Instantiate())

  def call(self, *xs, training=None):
    for rep in self.reps:
      xs = _ToTuple(rep(*xs, training=training))
    return _FromTuple(xs)


def ConcatMerge(outputs):
  """Merges parallel sub-layers' output tuples into one tuple, in order."""
  return tuple(y for ys in outputs for y in ys)


def Add(*xs):
  """The elementwise sum of the inputs."""
  return tf.add_n(list(xs))


class ParallelLayer(BaseLayer):
  """Applies every sub-layer to the same inputs and merges their outputs."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("sub", [], "Params of the parallel sub-layers.")
    p.Define("merge", ConcatMerge,
             "Maps the list of sub-layer output tuples to one tuple.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.subs = [sub.Instantiate() for sub in params.sub]

  def call(self, *xs, training=None):
    outputs = [_ToTuple(sub(*xs, training=training)) for sub in self.subs]
    return _FromTuple(_ToTuple(self.params.merge(outputs)))


class FnLayer(BaseLayer):
  """Applies a function without weights: `fn(*inputs)`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("fn", None, "The function applied to the inputs.")
    return p

  def call(self, *xs, training=None):
    del training
    return self.params.fn(*xs)


class IdentityLayer(BaseLayer):
  """Returns its inputs."""

  def call(self, *xs, training=None):
    del training
    return _FromTuple(xs)


class ArgIndexLayer(BaseLayer):
  """Returns the input at `index`."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("index", 0, "Which input to return.")
    return p

  def call(self, *xs, training=None):
    del training
    return xs[self.params.index]


class LinearLayer(BaseLayer):
  """Multiplies by a weight matrix (no bias): x @ w."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("input_dims", 0, "Size of the last input dimension.")
    p.Define("output_dims", 0, "Size of the last output dimension.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.w = self.add_weight(
        name="w", shape=(params.input_dims, params.output_dims),
        initializer="glorot_uniform")

  def call(self, x, training=None):
    del training
    return tf.matmul(x, self.w)


class BiasLayer(BaseLayer):
  """Adds a bias: x + b."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("dims", 0, "Size of the last input dimension.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.b = self.add_weight(name="b", shape=(params.dims,),
                             initializer="zeros")

  def call(self, x, training=None):
    del training
    return x + self.b


class LayerNorm(BaseLayer):
  """Layer normalization over the last dimension, with scale and bias."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("input_dims", 0, "Size of the last input dimension.")
    p.Define("epsilon", 1e-6, "Added to the variance.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.norm = keras.layers.LayerNormalization(
        epsilon=params.epsilon, dtype=self.dtype_policy)
    self.norm.build((None, params.input_dims))

  def call(self, x, training=None):
    del training
    return self.norm(x)


class DeterministicDropoutLayer(BaseLayer):
  """Dropout with step-seeded masks (`tfremat.DeterministicDropout`).

  Its seeds are `[global step, step seed]` as Lingvo's, with the global step
  of `tfremat.SetGlobalStep`. Without one, the layer counts its own training
  calls and uses that count instead, so its masks still change from one
  training step to the next in `fit` and in custom loops.
  """

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("keep_prob", 1.0, "Probability to keep an activation.")
    p.Define("random_seed", None, "Optional seed added to the step seeds.")
    return p

  def __init__(self, params):
    super().__init__(params)
    # A step counter kept like a Keras SeedGenerator's state: not trained,
    # not aggregated across replicas.
    self.calls = self.add_weight(
        shape=(), dtype="int64", initializer="zeros", trainable=False,
        aggregation="none", name="calls")

  def call(self, x, training=None):
    keep_prob = self.params.keep_prob
    if not training or (not tf.is_tensor(keep_prob) and keep_prob == 1.0):
      return x
    if step_seed.HasGlobalStep():
      seeds = step_seed.GenerateStepSeedPair(
          random_seed=self.params.random_seed)
    else:
      step = tf.convert_to_tensor(self.calls)
      self.calls.assign(step + 1)
      seeds = step_seed.SeedPair(step, random_seed=self.params.random_seed)
    return step_seed.DeterministicDropout(x, keep_prob, seeds)


class KerasDropoutLayer(BaseLayer):
  """Dropout by `keras.layers.Dropout`, whose seed state tfremat replays."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("keep_prob", 1.0, "Probability to keep an activation.")
    p.Define("random_seed", None, "Seed of the dropout's SeedGenerator.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.dropout = keras.layers.Dropout(1.0 - params.keep_prob,
                                        seed=params.random_seed)

  def call(self, x, training=None):
    return self.dropout(x, training=training)


class MultiHeadAttentionLayer(BaseLayer):
  """Causal (or full) self-attention: keras.layers.MultiHeadAttention."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("input_dims", 0, "Model width.")
    p.Define("num_heads", 1, "Attention heads; input_dims divisible by it.")
    p.Define("keep_prob", 1.0, "Keep probability of the attention weights.")
    p.Define("causal", True, "Attend only to earlier positions.")
    p.Define("random_seed", None, "Seed of the attention dropout.")
    return p

  def __init__(self, params):
    super().__init__(params)
    if params.input_dims % params.num_heads:
      raise errors.InvalidArgumentError(
          f"MultiHeadAttentionLayer {params.name}: input_dims "
          f"{params.input_dims} is not divisible by num_heads "
          f"{params.num_heads}.")
    self.attention = keras.layers.MultiHeadAttention(
        params.num_heads, params.input_dims // params.num_heads,
        dropout=1.0 - params.keep_prob, seed=params.random_seed,
        dtype=self.dtype_policy)
    shape = (None, None, params.input_dims)
    self.attention.build(shape, shape)

  def call(self, x, training=None):
    return self.attention(x, x, use_causal_mask=self.params.causal,
                          training=training)


class EmbeddingLayer(BaseLayer):
  """Looks up integer ids in an embedding table."""

  @classmethod
  def Params(cls):
    p = super().Params()
    p.Define("vocab_size", 0, "Number of ids.")
    p.Define("embedding_dims", 0, "Size of each embedding.")
    return p

  def __init__(self, params):
    super().__init__(params)
    self.table = self.add_weight(
        name="table", shape=(params.vocab_size, params.embedding_dims),
        initializer=keras.initializers.RandomNormal(stddev=1.0))

  def call(self, ids, training=None):
    del training
    return tf.gather(self.table, ids)
