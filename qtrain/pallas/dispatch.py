"""Placeholder seam (the kernels' dispatch replaces this file): always XLA."""
def quantized_dot_general(lhs, rhs, dimension_numbers, *, preferred_element_type, implementation="auto"):
  from qtrain.core import qdot
  return qdot.dot_general_quantized_xla(lhs, rhs, dimension_numbers, preferred_element_type=preferred_element_type)
