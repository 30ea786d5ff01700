"""Save policies: which tensors a rematerialized call keeps from its forward
pass instead of recomputing them.

  y = tfremat.RematerializeFn(block, x, policy=tfremat.policies.dots_saveable)

By default a rematerialized call keeps only its inputs and recomputes
everything else in the backward pass. Under a policy it also keeps the
outputs of the ops the policy chooses, and the backward pass uses them where
it would have recomputed them: everything upstream of a kept tensor that only
it needed is not recomputed at all. Matrix products are the expensive part of
a layer and their outputs are often no larger than the elementwise tensors
around them, so keeping them buys most of the time back for little memory.

A policy is called on an `Op` (the op's type, name, input and output
shapes and dtypes, and the name given by `checkpoint_name`, if any) and
returns True to keep the op's outputs. The built-in ones are `Policy`
values: frozen, compared with `==`, written into a layer's config by name or
recipe, and combined with `|` into a policy keeping what either keeps
(`dots_saveable | masks_saveable == dots_and_masks_saveable`). Any function
of an `Op` is a policy too. The built-in ones:

- `nothing_saveable`: keep nothing (the default; the same as no policy);
- `everything_saveable`: keep every op's outputs (nothing is recomputed;
  useful as a check);
- `dots_saveable`: keep matrix products (`MatMul`, `BatchMatMul*`, `Einsum`)
  and convolutions;
- `dots_with_no_batch_dims_saveable`: the same, except products with batch
  dimensions on both sides, such as attention's query-key scores and their
  product with the values, which are recomputed (as Megatron-LM's selective
  recomputation does for the attention core);
- `masks_saveable`: keep boolean tensors: dropout masks and other
  comparisons. They take a quarter of a float32 tensor's bytes, and a
  dropout mask costs a random draw to recompute, which on a CPU takes longer
  than many matrix products;
- `softmax_saveable`: keep softmax outputs, such as attention's
  probabilities. A softmax's gradient reads only its output, so with it kept
  nothing in the backward pass needs the scores it was computed from: the
  scores' product, their masking and the softmax (an exponential and two
  reductions over attention's largest tensor) are not recomputed;
- `dots_and_masks_saveable`, `dots_with_no_batch_dims_and_masks_saveable`,
  `masks_and_softmax_saveable`, `dots_masks_and_softmax_saveable`,
  `dots_with_no_batch_dims_masks_and_softmax_saveable`: the unions of those;
- `save_only_these_names(*names)`: keep the tensors named with
  `checkpoint_name` under these names;
- `save_anything_except_these_names(*names)`: keep every op's outputs except
  the named tensors (and the op that computed each of them);
- `save_from_both_policies(a, b)`: keep what either policy keeps, `a | b`.

`scope(policy)` sets the policy of the rematerialized calls made inside it
that name none.

Policies act in graphs: inside a `tf.function`, with or without XLA. An
eager call runs each op as it is called, before anything could decide not to
run it, so there a policy keeps nothing (the gradients are the same; only the
time and memory of graph mode are at stake).
"""

from tfremat._src.core.policies import BUILT_IN
from tfremat._src.core.policies import Op
from tfremat._src.core.policies import PLANNED
from tfremat._src.core.policies import Policy
from tfremat._src.core.policies import checkpoint_name
from tfremat._src.core.policies import current
from tfremat._src.core.policies import deserialize
from tfremat._src.core.policies import dots_and_masks_saveable
from tfremat._src.core.policies import dots_masks_and_softmax_saveable
from tfremat._src.core.policies import dots_saveable
from tfremat._src.core.policies import dots_with_no_batch_dims_and_masks_saveable
from tfremat._src.core.policies import dots_with_no_batch_dims_masks_and_softmax_saveable
from tfremat._src.core.policies import dots_with_no_batch_dims_saveable
from tfremat._src.core.policies import everything_saveable
from tfremat._src.core.policies import get
from tfremat._src.core.policies import masks_and_softmax_saveable
from tfremat._src.core.policies import masks_saveable
from tfremat._src.core.policies import name_of
from tfremat._src.core.policies import nothing_saveable
from tfremat._src.core.policies import save_anything_except_these_names
from tfremat._src.core.policies import save_from_both_policies
from tfremat._src.core.policies import save_only_these_names
from tfremat._src.core.policies import scope
from tfremat._src.core.policies import serialize
from tfremat._src.core.policies import short_name
from tfremat._src.core.policies import softmax_saveable

__all__ = [
    "Op",
    "Policy",
    "checkpoint_name",
    "current",
    "deserialize",
    "dots_saveable",
    "dots_and_masks_saveable",
    "dots_with_no_batch_dims_and_masks_saveable",
    "dots_masks_and_softmax_saveable",
    "dots_with_no_batch_dims_masks_and_softmax_saveable",
    "dots_with_no_batch_dims_saveable",
    "everything_saveable",
    "get",
    "masks_and_softmax_saveable",
    "masks_saveable",
    "name_of",
    "nothing_saveable",
    "save_anything_except_these_names",
    "save_from_both_policies",
    "save_only_these_names",
    "scope",
    "serialize",
    "short_name",
    "softmax_saveable",
    "PLANNED",
    "BUILT_IN",
]
