"""ragged-dot-tpu: a Pallas TPU grouped matmul (jax.lax.ragged_dot semantics) for Mixture-of-Experts."""

from . import pallas

REGISTRATIONS = []
__all__ = ["pallas"]
