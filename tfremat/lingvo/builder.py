"""A Lingvo-style builder: layer stacks described by Params.

  class MyBuilder(tfremat.builder.Base):

    def _Block(self, name, dims):
      return self._Seq(name,
                       self._LN("ln", dims),
                       self._Linear("proj", dims, dims),
                       self._Dropout("drop", 0.9))

  b = MyBuilder.Params().Set(deterministic_dropout=True).Instantiate()
  p = b._Rematerialize("block0", b._Block("body", 256))
  layer = p.Instantiate()            # a Keras layer
  y = layer(x, training=True)

Every helper returns Params, and `Instantiate()` turns them into a Keras layer
usable in any Keras model. Wrapping a sub-stack in `_Rematerialize` changes
what is kept for the backward pass, not the layer's weights, outputs or
gradients.
"""

import inspect

from tfremat import errors
from tfremat._src.api import sequential
from tfremat._src.core import policies as policies_lib
from tfremat._src.keras_api.segments import uniform_segments
from tfremat._src.planning import budget as budget_lib
from tfremat._src.keras_api.layers import RematerializationLayer
from tfremat.lingvo import builder_layers
from tfremat.lingvo import hyperparams

__all__ = [
    "Base",
]


class Base:
  """Builds Params for layer stacks; subclass it to add model helpers."""

  @classmethod
  def Params(cls):
    """The builder's own params (dropout kind, dtype, seed)."""
    p = hyperparams.InstantiableParams(cls)
    p.Define("deterministic_dropout", False,
             "Dropout from step seeds (tfremat.DeterministicDropout) instead "
             "of keras.layers.Dropout.")
    p.Define("fprop_dtype", None,
             "Dtype or Keras dtype policy of the basic layers; None: global.")
    p.Define("random_seed", None,
             "Seed of dropout layers (Keras) or added to their step seeds.")
    return p

  def __init__(self, params):
    self.params = params.Copy()

  def _Layer(self, cls, name, **kwargs):
    p = cls.Params().Set(name=name, **kwargs)
    if "fprop_dtype" in p:
      p.fprop_dtype = self.params.fprop_dtype
    return p

  def _Seq(self, name, *subs):
    """Connects sub-layers sequentially."""
    return self._Layer(builder_layers.SequentialLayer, name, sub=list(subs))

  def _Rep(self, name, repeat, *subs):
    """Applies `repeat` copies of _Seq(*subs), each with its own weights."""
    return self._Layer(builder_layers.RepeatLayer, name, repeat=repeat,
                       body=self._Seq(name, *subs))

  def _Par(self, name, *subs):
    """Applies sub-layers to the same inputs; concatenates their outputs.

    As Lingvo's: `_Par("p", _Id("a"), _Fn("b", f))` on `x` gives `(x, f(x))`.
    """
    return self._Layer(builder_layers.ParallelLayer, name, sub=list(subs))

  def _Residual(self, name, *body):
    """x + _Seq(*body)(x): Lingvo's _Seq(_Par(_Id, body), _Fn(add))."""
    return self._Seq(
        name, self._Par("branches", self._Id("skip"), self._Seq("body", *body)),
        self._Fn("add", builder_layers.Add))

  def _Fn(self, name, fn):
    """Applies `fn(*inputs)`, a function without weights."""
    return self._Layer(builder_layers.FnLayer, name, fn=fn)

  def _Id(self, name):
    """Returns its inputs."""
    return self._Layer(builder_layers.IdentityLayer, name)

  def _Arg(self, name, index):
    """Returns the input at `index`."""
    return self._Layer(builder_layers.ArgIndexLayer, name, index=index)

  def _Rematerialize(self, name, body, policy=None):
    """Recomputes `body`'s activations in the backward pass, keeping what
    the save policy `policy` (a `tfremat.policies` name) chooses."""
    return RematerializationLayer.Params().Set(name=name, body=body,
                                               policy=policy)

  def _RematerializeSeq(self, name, segments, *subs, budget=None,
                        sample_input=None, policy=None,
                        policies=policies_lib.PLANNED):
    """_Seq(*subs), split into segments that are rematerialized or kept.

    Args:
      name: the stack's name.
      segments: an int, or "sqrt" for about sqrt(len(subs)) equal segments
        (Chen et al. 2016), all rematerialized; None with `budget`.
      *subs: the sub-layers' Params.
      budget: instead of `segments`: instantiate the sub-layers, measure them
        on `sample_input` and keep the planner's choice, the fastest that
        fits. Bytes, "200MiB", or a fraction of the keep-everything peak
        (0.5, "50%"), as in `tfremat.remat_sequential`.
      sample_input: a batch to measure on, with `budget`.
      policy: with `segments`, the save policy of every rematerialized
        segment.
      policies: with `budget`, the built-in save policies the planner may
        choose per segment, as in `tfremat.remat_sequential`.
    """
    if (segments is None) == (budget is None):
      raise errors.InvalidArgumentError(
          "_RematerializeSeq: give either segments (an int or \"sqrt\") or "
          "budget with sample_input, not both or neither.")
    if segments is not None:
      # The Params name the policy (they print and read back as text).
      policy = policies_lib.name_of(policies_lib.parsed(policy))
      parts = []
      for i, seg in enumerate(uniform_segments(len(subs), segments)):
        seq = self._Seq(f"{name}_seg{i}", *subs[seg.start:seg.stop])
        parts.append(self._Rematerialize(f"{name}_remat{i}", seq, policy))
      return self._Seq(name, *parts)
    # Checked before instantiating anything.
    budget, policies = budget_lib.planning_arguments(
        "_RematerializeSeq", budget, sample_input, policies, policy)
    chosen = sequential.checked_plan([p.Instantiate() for p in subs], budget,
                                    sample_input, policies=policies)
    return self._Layer(builder_layers.PlannedSeqLayer, name, sub=list(subs),
                       plan=chosen)

  def _Linear(self, name, idims, odims):
    """x @ w, a weight matrix and no bias."""
    return self._Layer(builder_layers.LinearLayer, name, input_dims=idims,
                       output_dims=odims)

  def _Bias(self, name, dims):
    """x + b."""
    return self._Layer(builder_layers.BiasLayer, name, dims=dims)

  def _LN(self, name, dims):
    """Layer normalization over the last dimension."""
    return self._Layer(builder_layers.LayerNorm, name, input_dims=dims)

  def _Dropout(self, name, keep_prob):
    """Dropout keeping `keep_prob`: step-seeded or Keras, per the params."""
    cls = (builder_layers.DeterministicDropoutLayer
           if self.params.deterministic_dropout else
           builder_layers.KerasDropoutLayer)
    return self._Layer(cls, name, keep_prob=keep_prob,
                       random_seed=self.params.random_seed)

  def _Embedding(self, name, vocab, dims):
    """Looks up integer ids in a (vocab, dims) table."""
    return self._Layer(builder_layers.EmbeddingLayer, name, vocab_size=vocab,
                       embedding_dims=dims)

  def _MultiHeadAttention(self, name, dims, heads, keep_prob=1.0,
                          causal=True):
    """Self-attention over (batch, time, dims), keras.layers.MultiHeadAttention."""
    return self._Layer(builder_layers.MultiHeadAttentionLayer, name,
                       input_dims=dims, num_heads=heads, keep_prob=keep_prob,
                       causal=causal, random_seed=self.params.random_seed)


def _HelperIndex(cls):
  """One line per helper of `cls`: its signature and its docstring's first
  line. pydoc, and so help(), hides underscore names; the index puts them in
  the class docstring, where help(tfremat.builder.Base) shows them."""
  lines = []
  for name in sorted(vars(cls)):
    helper = vars(cls)[name]
    if (name.startswith("_") and not name.startswith("__") and
        callable(helper) and helper.__doc__):
      args = str(inspect.signature(helper)).replace("(self, ", "(", 1)
      summary = " ".join(helper.__doc__.split("\n\n")[0].split())
      lines.append(f"  {name}{args}\n      {summary}")
  return "\n".join(lines)


Base.__doc__ += ("\n\nHelpers (each returns Params; Instantiate() builds "
                 "the layer):\n\n" + _HelperIndex(Base))
