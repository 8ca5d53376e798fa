"""Private helpers of :mod:`qtrain.qwix` (qwix's params and statistics layouts)."""
