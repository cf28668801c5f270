"""paged-attention-tpu: ragged paged attention (continuous batching) as a Pallas TPU kernel."""

from . import pallas

REGISTRATIONS = []
__all__ = ["pallas"]
