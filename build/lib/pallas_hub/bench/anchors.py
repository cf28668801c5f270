"""The anchors: the best public Pallas TPU kernels ours are measured against, callable on CPU.

Each is used at its default tiling, through its public entry point; only what CPU needs is added
(tokamax refuses non-TPU devices and asks the TPU for its tiling while tracing: ``tpu_info_on_cpu``
answers for a chosen generation). Layouts follow our problems: attention q [B, Hq, S, D],
k/v [B, Hkv, S, D]; decode q [B, Hq, D] with pages [Hkv, P, page, D]; MoE lhs [M, K],
rhs [G, K, N], group_sizes [G].
"""

from __future__ import annotations

import contextlib
import functools

from .. import verify  # noqa: F401  (CPU-only JAX set-up before jax loads)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

# pages per compute block for jax's paged_attention, which has no default: 8 pages of 16 tokens
# (128 tokens per block), the setting of jax's own tests and benchmarks
PAGED_PAGES_PER_COMPUTE_BLOCK = 8


@contextlib.contextmanager
def tpu_info_on_cpu(chip: str = "v6e"):
    """Let kernels that query the TPU while tracing (tokamax, emit_pipeline) trace on CPU."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    version = {"v5e": pltpu.ChipVersion.TPU_V5E, "v6e": pltpu.ChipVersion.TPU_V6E,
               "tpu7x": pltpu.ChipVersion.TPU_7X}[chip]
    previous = tpu_info.registry.get("cpu")
    tpu_info.registry["cpu"] = lambda: pltpu.get_tpu_info_for_chip(version, 1)
    try:
        yield
    finally:
        if previous is None:
            tpu_info.registry.pop("cpu", None)
        else:
            tpu_info.registry["cpu"] = previous


# --------------------------------------------------------------------------- MoE: grouped matmul

GMM_ROW_MULTIPLE = 128  # megablox's default tile_m, and tokamax's minimum dimension


def _padded_rows(fn):
    """Both grouped matmuls need m to be a multiple of 128: callers pad rows (outside every group)
    and slice them off, as done here. The padding is part of what the kernel then moves."""

    @functools.wraps(fn)
    def wrapper(lhs, rhs, group_sizes):
        m = lhs.shape[0]
        pad = -m % GMM_ROW_MULTIPLE
        if pad:
            lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
        return fn(lhs, rhs, group_sizes)[:m]

    return wrapper


@_padded_rows
def megablox_gmm(lhs, rhs, group_sizes):
    from jax.experimental.pallas.ops.tpu.megablox import ops as megablox

    return megablox.gmm(lhs, rhs, group_sizes, preferred_element_type=lhs.dtype)


@functools.lru_cache(maxsize=1)
def _tokamax_op():
    from absl import flags
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as rd

    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; otherwise they parse our sys.argv
        flags.FLAGS.mark_as_parsed()

    class AnyDeviceRaggedDot(rd.PallasMosaicTpuRaggedDot):
        def supported_on(self, device):  # tokamax checks the device; CPU runs it interpreted
            return True

    return AnyDeviceRaggedDot()


@_padded_rows
def tokamax_ragged_dot(lhs, rhs, group_sizes):
    with tpu_info_on_cpu():
        return _tokamax_op()(lhs, rhs, group_sizes=group_sizes)


# --------------------------------------------------------------------------- prefill attention

def _repeat_kv(q, k, v):
    """jax's flash_attention has no GQA: K/V heads are repeated, as transformers' sdpa path does."""
    rep = q.shape[1] // k.shape[1]
    return jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)


def jax_flash_attention(q, k, v, *, scale):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    k, v = _repeat_kv(q, k, v)
    return fa.flash_attention(q, k, v, causal=True, sm_scale=scale)


@functools.lru_cache(maxsize=8)
def _splash_kernel(group: int, seq: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((seq, seq))] * group)
    with jax.ensure_compile_time_eval():  # its mask tables are cached: they must not be tracers
        return sk.make_splash_mqa_single_device(mask)


def splash_attention(q, k, v, *, scale):
    """Splash in its GQA form: one MQA kernel per K/V head over that head's query group."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    kernel = _splash_kernel(hq // hkv, s)
    qg = (q * scale).reshape(b, hkv, hq // hkv, s, d)  # splash takes no softmax scale
    out = jax.vmap(jax.vmap(kernel))(qg, k, v)
    return out.reshape(b, hq, s, d)


# --------------------------------------------------------------------------- decode attention

def jax_paged_attention(q, k_pages, v_pages, lengths, page_indices, *, scale):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    # no softmax-scale argument: scale q instead (what its callers do)
    return paged_attention((q * scale).astype(q.dtype), k_pages, v_pages, lengths, page_indices,
                           pages_per_compute_block=PAGED_PAGES_PER_COMPUTE_BLOCK)
