"""RematerializationLayer: a Keras 3 layer that rematerializes another layer.

  block = tfremat.RematerializationLayer(keras.Sequential([...]))
  y = block(x, training=True)    # same as the wrapped layer's call

The wrapped layer's call runs through `RematerializeFn`: its activations are
recomputed in the backward pass, with the same dropout masks and with
BatchNormalization statistics updated once. Everything else is the wrapped
layer's: weights, output shapes, dtypes, masks, losses.
"""

import keras

from tfremat import errors
from tfremat._src.core import policies
from tfremat._src.core import hyperparams
from tfremat._src.core import remat

__all__ = [
    "RematerializationLayer",
    "refuse_keras2",
    "keras_layers",
]


def refuse_keras2(obj, caller):
  """Raises TypeError if `obj` is a Keras 2 (tf_keras) layer or model.

  Keras 2 lives on as the `tf_keras` package, which `tf.keras` is when
  TF_USE_LEGACY_KERAS=1. Its layers are not Keras 3 layers, so without this
  they were refused with a message that did not say why.
  """
  if not any(c.__module__.split(".")[0] == "tf_keras"
             for c in type(obj).__mro__):
    return
  raise errors.InvalidTypeError(
      f"{caller} got a Keras 2 {type(obj).__name__} (from tf_keras, which is "
      "also what tf.keras is when TF_USE_LEGACY_KERAS=1). tfremat's layers, "
      "remat_model and remat_sequential take Keras 3 layers and models "
      "(`import keras`, Keras 3). Build the model with Keras 3, or keep Keras "
      "2 and rematerialize a block's call in your training step with "
      "tfremat.RematerializeFn(lambda h: block(h, training=True), x).")


def keras_layers(layers, caller, chain=False):
  """`layers` as a non-empty list of Keras 3 layers, or a TypeError that
  names what was given.

  `layers` is an iterable of layers, or one layer. With `chain` (a chain of
  layers, each taking the previous one's output), a `keras.Sequential`
  gives its own layers and any other single layer is refused: one layer
  alone is not a chain, and a model is not its layers. Without, one layer
  is a list of one.
  """
  if chain and isinstance(layers, keras.Sequential):
    layers = layers.layers
  elif isinstance(layers, keras.layers.Layer):
    if chain:
      raise errors.InvalidTypeError(
          f"{caller} needs a list of Keras layers or a keras.Sequential; got "
          f"one {type(layers).__name__}. Pass [layer] for a chain of one.")
    layers = [layers]
  try:
    layers = list(layers)
  except TypeError:
    layers = [layers]
  for layer in layers:
    refuse_keras2(layer, caller)
  bad = [l for l in layers if not isinstance(l, keras.layers.Layer) or
         isinstance(l, keras.layers.InputLayer)]
  if not layers or bad:
    raise errors.InvalidTypeError(
        f"{caller} takes Keras layers (a non-empty list of them"
        f"{', or a keras.Sequential' if chain else ''}), such as a KerasHub "
        "backbone's `transformer_layers`; got "
        f"{', '.join(f'{type(l).__name__}: {l!r}' for l in bad) or 'none'}.")
  return layers


def _unquantized(policy):
  """The wrapper's dtype policy: the wrapped layer's, without quantization.

  The wrapper only casts inputs as the wrapped layer does; with a quantized
  policy Keras would route the wrapper's own call to a quantized call it
  does not have. The wrapped layer still runs its quantized call.
  """
  if getattr(policy, "quantization_mode", None) is None:
    return policy
  return keras.DTypePolicy(policy._source_name)  # pylint: disable=protected-access


@keras.saving.register_keras_serializable(package="tfremat")
class RematerializationLayer(keras.layers.Wrapper):
  """Wraps a Keras layer so that its activations are recomputed on backward.

  Calling the wrapper is calling the wrapped layer: the same positional inputs
  (tensors or nested structures), `training=`, `mask=` and other keyword
  arguments, the same outputs and masks. Tensor arguments, positional or
  keyword, are differentiated; other keyword arguments are passed as they are.

  Args:
    layer: the Keras layer to rematerialize: a built-in layer, a custom
      layer, a `Sequential` or a functional model.
    policy: what to keep from the forward pass instead of recomputing it
      (see `tfremat.policies`): a policy function, a built-in policy's name,
      or None to keep nothing but the inputs (or follow an enclosing
      `tfremat.policies.scope`). Saved in the layer's config.
    **kwargs: base `keras.layers.Layer` arguments (`name`, `trainable`, ...).
      `dtype` defaults to the wrapped layer's dtype policy, so that inputs are
      cast exactly as the wrapped layer casts them.
  """

  def __init__(self, layer, policy=None, **kwargs):
    # Parsed once, a bad one refused before anything else; None takes the
    # scope's policy when the layer runs.
    policy = (policies.deserialize(policy) if isinstance(policy, dict) else
              policies.parsed(policy))
    refuse_keras2(layer, "RematerializationLayer")
    if not isinstance(layer, keras.layers.Layer):
      raise errors.InvalidTypeError(
          "RematerializationLayer wraps a Keras layer (keras.layers.Layer, "
          f"including Sequential and functional models); got "
          f"{type(layer).__name__}: {layer!r}. To rematerialize a plain "
          "function, use tfremat.RematerializeFn(fn, *inputs) or the "
          "@tfremat.rematerialize decorator.")
    if isinstance(layer, keras.layers.InputLayer):
      raise errors.InvalidTypeError(
          "RematerializationLayer cannot wrap an InputLayer: it holds no "
          "computation. Wrap the layers that follow the input.")
    kwargs.setdefault("dtype", _unquantized(layer.dtype_policy))
    kwargs.setdefault("name", f"remat_{layer.name}")
    super().__init__(layer, **kwargs)
    self.policy = policy
    self.supports_masking = layer.supports_masking
    # Keras binds a call's arguments to `call`'s signature and refuses a
    # nested argument that mixes tensors and Python values, which the
    # wrapper's `**kwargs` would be (value=kv, use_causal_mask=True). Bound
    # to the wrapped layer's signature, each argument stands alone, as in a
    # call of the wrapped layer.
    self._call_signature = layer._call_signature  # pylint: disable=protected-access
    self.call_signature_parameters = layer.call_signature_parameters
    if not self.trainable:
      # Keras propagates `trainable` to sublayers only when it is set later.
      layer.trainable = False

  @classmethod
  def Params(cls):
    """Lingvo-style Params: `body` is the Params of the layer to wrap."""
    p = hyperparams.InstantiableParams(cls)
    p.Define("body", None, "Params of the layer to rematerialize.")
    p.Define("policy", None, "The save policy (a tfremat.policies name), or "
             "None to recompute everything.")
    return p

  @classmethod
  def FromParams(cls, params):
    if not hyperparams.IsInstantiable(params.body):
      raise errors.InvalidArgumentError(
          f"RematerializationLayer {params.name}: body must be instantiable "
          f"Params (e.g. from a builder helper); got {params.body!r}.")
    return cls(params.body.Instantiate(), name=params.name,
               policy=params.policy)

  def get_config(self):
    config = super().get_config()
    if self.policy is not None:
      config["policy"] = policies.serialize(self.policy)
    return config

  @classmethod
  def from_config(cls, config, custom_objects=None):
    # keras.layers.Wrapper.from_config pops "layer" from the caller's dict.
    return super().from_config(dict(config), custom_objects=custom_objects)

  def build(self, input_shape=None):
    # The wrapped layer builds itself from its own call signature on its first
    # call (symbolic in a functional model, or real); a wrapper that knows
    # only the first input's shape could not build, e.g., MultiHeadAttention.
    del input_shape
    self.built = True

  def get_build_config(self):
    return self.layer.get_build_config()

  def build_from_config(self, config):
    # Deserializing the wrapped layer may already have built it (a Dense
    # saved with its build config): building again would add its weights
    # twice.
    if config and not self.layer.built:
      self.layer.build_from_config(config)
    self.built = True

  def _layer_kwargs(self, training, mask, kwargs):
    kwargs = dict(kwargs)
    if training is not None and self.layer._call_has_training_arg:  # pylint: disable=protected-access
      kwargs["training"] = training
    if mask is not None and self.layer._call_has_mask_arg:  # pylint: disable=protected-access
      kwargs["mask"] = mask
    return kwargs

  def call(self, inputs, *args, training=None, mask=None, **kwargs):
    kwargs = self._layer_kwargs(training, mask, kwargs)

    def fn(inputs, args, kwargs):
      return self.layer(inputs, *args, **kwargs)

    # Tensors anywhere in the arguments are differentiated; Python values
    # pass through as they are.
    outputs, losses = remat.rematerialize_with_losses(
        fn, (inputs, args, kwargs), on_losses=lambda losses: None,
        policy=self.policy)
    # Losses the wrapped layer added (activity regularizers) come back as
    # outputs of the rematerialized call, so their gradients flow; they are
    # this layer's now.
    for _, loss in losses:
      self.add_loss(loss)
    return outputs

  def compute_output_spec(self, inputs, *args, training=None, mask=None,
                          **kwargs):
    # A symbolic call of the wrapped layer: gives its exact output spec and
    # builds it as an unwrapped call would.
    return self.layer(inputs, *args, **self._layer_kwargs(training, mask,
                                                          kwargs))

  def compute_output_shape(self, *args, **kwargs):
    return self.layer.compute_output_shape(*args, **kwargs)

  def compute_mask(self, inputs, mask=None):
    return self.layer.compute_mask(inputs, mask)
