"""Small reference models for the benchmark, the memory tests and examples.

Both are stacks of blocks, the unit one rematerializes: a residual MLP whose
blocks are `Sequential`s, and a causal transformer language model whose
blocks are functional `keras.Model`s.
"""

import keras

from tfremat._src.layers import RematerializationLayer

__all__ = [
    "residual_mlp",
    "transformer_block",
    "transformer_parts",
    "transformer_lm",
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
