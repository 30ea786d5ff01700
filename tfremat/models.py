"""Small reference models for the benchmark, the memory tests and examples.

Two are stacks of blocks, the unit one rematerializes: a residual MLP whose
blocks are `Sequential`s, and a causal transformer language model whose
blocks are functional `keras.Model`s. `whole_model` makes models nobody on
this project wrote (`keras.applications` CNNs, KerasHub backbones), small,
with random weights, for `python -m tfremat.bench --whole_models`.
"""

import keras
import tensorflow as tf

from tfremat import errors

from tfremat._src.keras_api.layers import RematerializationLayer

__all__ = [
    "residual_mlp",
    "transformer_block",
    "transformer_parts",
    "transformer_lm",
    "flat_lm",
    "whole_model",
    "hub_backbone",
    "hub_batch",
    "APPLICATIONS",
    "HUB_BACKBONES",
    "HUB_SIZES",
]


def residual_mlp(blocks, width, dropout, seed=0, residual_inside=False):
  """`blocks` blocks h -> Dense(4w, relu) -> Dropout -> Dense(w).

  The residual `h + block(h)` is added by the caller, or, with
  `residual_inside`, by each block (a functional model), so that the blocks
  form a chain of layers each taking the previous one's output.
  """
  keras.utils.set_random_seed(seed)
  model = []
  for i in range(blocks):
    block = keras.Sequential([
        keras.layers.Dense(4 * width, activation="relu"),
        keras.layers.Dropout(dropout, seed=1000 + i),
        keras.layers.Dense(width),
    ], name=f"mlp_block{i}")
    block.build((None, width))
    if residual_inside:
      x = keras.Input((width,))
      block = keras.Model(x, x + block(x), name=f"residual_block{i}")
    model.append(block)
  return model


def transformer_block(seq_len, width, heads, dropout, index=0):
  """A pre-LayerNorm causal transformer block, residuals included."""
  x = keras.Input((seq_len, width))
  h = keras.layers.LayerNormalization()(x)
  h = keras.layers.MultiHeadAttention(
      heads, width // heads, dropout=dropout, seed=2000 + index)(
          h, h, use_causal_mask=True)
  x1 = x + keras.layers.Dropout(dropout, seed=3000 + index)(h)
  h = keras.layers.LayerNormalization()(x1)
  h = keras.layers.Dense(4 * width, activation="gelu")(h)
  h = keras.layers.Dense(width)(h)
  y = x1 + keras.layers.Dropout(dropout, seed=4000 + index)(h)
  return keras.Model(x, y, name=f"transformer_block{index}")


def transformer_parts(vocab, seq_len, width, heads, blocks, dropout, seed=0):
  """(embed, blocks, head): token ids -> (B, T, width) -> ... -> logits."""
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((seq_len,), dtype="int32")
  positions = keras.ops.arange(seq_len)[None]
  h = (keras.layers.Embedding(vocab, width)(tokens) +
       keras.layers.Embedding(seq_len, width)(positions))
  embed = keras.Model(tokens, h, name="embed")
  stack = [transformer_block(seq_len, width, heads, dropout, i)
           for i in range(blocks)]
  features = keras.Input((seq_len, width))
  logits = keras.layers.Dense(vocab)(
      keras.layers.LayerNormalization()(features))
  head = keras.Model(features, logits, name="head")
  return embed, stack, head


def transformer_lm(vocab, seq_len, width, heads, blocks, dropout, remat,
                   seed=0):
  """A causal transformer LM; with `remat`, every block is wrapped in
  `RematerializationLayer`."""
  embed, stack, head = transformer_parts(vocab, seq_len, width, heads, blocks,
                                         dropout, seed)
  tokens = keras.Input((seq_len,), dtype="int32")
  h = embed(tokens)
  for block in stack:
    h = (RematerializationLayer(block) if remat else block)(h)
  return keras.Model(tokens, head(h), name="transformer_lm")


def flat_lm(blocks=8, vocab=64, seq_len=128, width=128, heads=4,
            dropout=0.1, seed=0):
  """A causal transformer LM written as one functional model of Keras
  layers, block by block (no block is a model of its own), as users write
  them: each block is LayerNormalization, causal MultiHeadAttention, a
  residual add, LayerNormalization, Dense(4 * width, gelu), Dense(width),
  Dropout and a residual add. Takes token ids of length `seq_len`."""
  keras.utils.set_random_seed(seed)
  tokens = keras.Input((seq_len,), dtype="int32")
  h = keras.layers.Embedding(vocab, width)(tokens)
  for i in range(blocks):
    a = keras.layers.LayerNormalization()(h)
    a = keras.layers.MultiHeadAttention(
        heads, width // heads, dropout=dropout, seed=2000 + i)(
            a, a, use_causal_mask=True)
    h = keras.layers.Add()([h, a])
    f = keras.layers.LayerNormalization()(h)
    f = keras.layers.Dense(4 * width, activation="gelu")(f)
    f = keras.layers.Dense(width)(f)
    f = keras.layers.Dropout(dropout, seed=3000 + i)(f)
    h = keras.layers.Add()([h, f])
  logits = keras.layers.Dense(vocab)(keras.layers.LayerNormalization()(h))
  return keras.Model(tokens, logits, name="flat_lm")


# keras.applications models: name -> (input height and width, batch).
APPLICATIONS = {
    "ResNet50": (96, 8),
    "MobileNetV2": (64, 8),
    "DenseNet121": (64, 8),
    "EfficientNetB0": (64, 4),
    "ConvNeXtTiny": (64, 4),
}
# KerasHub backbones, each 4 layers, hidden 128, sequence 128, batch 8.
HUB_BACKBONES = ("GPT2Backbone", "BertBackbone", "LlamaBackbone",
                 "GemmaBackbone")
HUB_SIZES = dict(vocabulary_size=256, num_layers=4, hidden_dim=128,
                 intermediate_dim=512, dropout=0.1)
_HUB_BATCH, _HUB_SEQ = 8, 128


def whole_model(name, seed=0):
  """(model, batch): `name` from APPLICATIONS (10 classes) or HUB_BACKBONES
  (`hub_backbone` and `hub_batch`), random weights, at its size above; the
  batch is the same in every process."""
  keras.utils.set_random_seed(seed)
  if name in APPLICATIONS:
    size, batch = APPLICATIONS[name]
    model = getattr(keras.applications, name)(
        weights=None, input_shape=(size, size, 3), classes=10)
    return model, tf.random.stateless_normal([batch, size, size, 3],
                                             seed=[1, 2])
  if name not in HUB_BACKBONES:
    raise errors.InvalidArgumentError(
        f"Unknown model {name!r}; choose from "
        f"{', '.join(list(APPLICATIONS) + list(HUB_BACKBONES))}.")
  return hub_backbone(name), hub_batch(name)


def hub_backbone(name, num_layers=HUB_SIZES["num_layers"]):
  """The KerasHub backbone `name` (one of HUB_BACKBONES) at HUB_SIZES, with
  `num_layers` layers; needs keras-hub (`pip install ".[hub]"`)."""
  try:
    import keras_hub  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise errors.UnsupportedError(
        f"{name} needs keras-hub: pip install \".[hub]\" (or keras-hub)."
    ) from e
  heads = (dict(num_heads=4, max_sequence_length=_HUB_SEQ)
           if name in ("GPT2Backbone", "BertBackbone") else
           dict(num_query_heads=4, num_key_value_heads=2))
  if name == "GemmaBackbone":
    heads["head_dim"] = 32
  return getattr(keras_hub.models, name)(
      **heads, **dict(HUB_SIZES, num_layers=num_layers))


def hub_batch(name):
  """A batch for `hub_backbone(name)`, the same in every process: its rows
  padded to different lengths."""
  batch = {
      "token_ids": tf.random.stateless_uniform(
          [_HUB_BATCH, _HUB_SEQ], seed=[1, 2],
          maxval=HUB_SIZES["vocabulary_size"], dtype=tf.int32),
      "padding_mask": tf.sequence_mask(
          [_HUB_SEQ, 100, 64, _HUB_SEQ, 30, _HUB_SEQ, 127, 90], _HUB_SEQ,
          dtype=tf.int32)}
  if name == "BertBackbone":
    batch["segment_ids"] = tf.zeros([_HUB_BATCH, _HUB_SEQ], tf.int32)
  return batch
