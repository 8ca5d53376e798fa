"""The lax functions qtrain itself calls, bound once when qtrain is imported.

The provider swaps ``jax.lax.dot_general`` / ``jax.lax.conv_general_dilated``
for dispatchers while a quantized linen model runs. qtrain's own products must
never go through those dispatchers, so every internal call uses these
references, taken before any swap can happen.
"""

import jax

dot_general = jax.lax.dot_general
conv_general_dilated = jax.lax.conv_general_dilated
optimization_barrier = jax.lax.optimization_barrier
