"""qtrain.flax: Flax adapters (linen and nnx) and the interception of lax ops.

:mod:`qtrain.flax.intercept` swaps ``jax.lax.dot_general``, ``jnp.einsum``
and ``jax.lax.conv_general_dilated`` for dispatchers while a quantized model
runs; :mod:`qtrain.flax.hosts` keeps an op's state in the calling module's
scope; :mod:`qtrain.flax.model` wraps linen models and quantizes nnx models
in place (:func:`~qtrain.flax.model.quantize_model`).
"""
