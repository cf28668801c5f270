"""tokamax 0.0.12's Mosaic TPU ragged_dot (implementation "mosaic"), the anchor we compare against.

Two workarounds make it run off-TPU, both confined to this module and applied only when used:
* tokamax's ``Op.__call__`` refuses devices whose ``supported_on`` is false (CPU): a subclass
  answers True. The kernel still runs as Pallas: on CPU under the interpret mode the caller
  chose (our bridge forces it; Pallas' ``force_tpu_interpret_mode`` overrides every pallas_call).
* ``emit_pipeline`` asks ``pltpu.get_tpu_info()`` for the default device while tracing, which
  raises "Unsupported TPU device kind: cpu": on a CPU backend we register v6e's figures for the
  "cpu" kind in jax's tpu_info registry (a private hook; jax 0.10.2, tpu_info.py).
* tokamax reads absl flags; outside an absl app they are unparsed and absl would parse the
  host program's sys.argv (pytest's "-q" is then an unknown flag): we mark them parsed, so the
  flags keep their defaults.
tokamax leaves output rows past sum(group_sizes) uninitialised; ``ragged_dot`` here zeroes them
so it has jax.lax.ragged_dot's semantics, like ours. Every dimension must be >= 128 (tokamax).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.lru_cache(maxsize=None)
def _op():
    from absl import flags
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as rd

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()
    if jax.default_backend() == "cpu" and "cpu" not in tpu_info.registry:
        tpu_info.registry["cpu"] = lambda: pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V6E, 1)

    class AnyDeviceRaggedDot(rd.PallasMosaicTpuRaggedDot):
        def supported_on(self, device) -> bool:  # the Pallas kernel itself decides (interpret off TPU)
            return True

    return AnyDeviceRaggedDot(), rd


def ragged_dot(lhs, rhs, group_sizes, *, rhs_transposed: bool = False, out_dtype=None, zero_tail: bool = True):
    """jax.lax.ragged_dot through tokamax's Mosaic TPU kernel; rhs [g, k, n] or [g, n, k]."""
    op, rd = _op()
    dims = rd.DLHS_RAGGED_DOT_DIM_NUMS if rhs_transposed else rd.DEFAULT_RAGGED_DOT_DIM_NUMS
    m = lhs.shape[0]
    pad = -m % 128  # tokamax needs m divisible by its tile_m (128 by default)
    padded = jnp.pad(lhs, ((0, pad), (0, 0))) if pad else lhs
    out = op(padded, rhs, group_sizes=group_sizes.astype(jnp.int32), ragged_dot_dimension_numbers=dims,
             preferred_element_type=out_dtype or lhs.dtype)[:m]
    if zero_tail:
        rows = jnp.arange(lhs.shape[0])[:, None]
        out = jnp.where(rows < jnp.sum(jnp.maximum(group_sizes, 0)), out, 0).astype(out.dtype)
    return out
