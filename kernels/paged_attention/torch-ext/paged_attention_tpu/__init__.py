"""paged-attention-tpu: ragged paged attention (continuous batching) as a Pallas TPU kernel.

* ``ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=None, scale=0.0, window=0,
  softcap=0.0, block_q=0, block_kv=8192, k_scale=None, v_scale=None)``: torch op (scale 0.0 = head_dim**-0.5);
  see ``pallas.ragged_paged_attention`` for layouts. A float8_e4m3fn or int8 cache takes k_scale/v_scale
  (float32 [Hkv], one per KV head). A head dim below 128 may come lane-packed, [P, page, Hkv * D / 128, 128]
  (``pallas.kv_heads``: the layout XLA:TPU does not copy around the kernel; ``pallas.lane_packed_shape(cache)``
  gives it, or None).
* ``write_kv(..., k_scale=None, v_scale=None)`` -> (k_pages', v_pages'): functional torch op writing new
  tokens into their pages (the JAX kernel aliases the cache: in place under jit with donation; as a
  functional torch op it returns new caches); ``write_kv_`` updates the torch caches in place, writing
  only the new rows. Both quantize the new rows for a quantized cache (``quantize_kv``).
* ``write_and_attend(q, new_k, new_v, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, ...)`` -> (out, k_pages',
  v_pages'): ``write_kv`` then ``ragged_paged_attention`` in one kernel (functional torch op, like ``write_kv``;
  ``pallas.fuses_write`` says which caches take one kernel, the rest take the two calls).
* ``paged_attention_forward``: the transformers attention function for continuous batching,
  ``enable_continuous_batching()``: registers it (see CARD.md).
"""

import jax
import jax.numpy as jnp
import torch

from . import pallas
from ._bridge import check_array, jax_op
from ._ops import add_op_namespace_prefix
from .transformers_cb import CB_NAME, enable_continuous_batching, paged_attention_forward


def _fake_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=None, scale=0.0, window=0,
                    softcap=0.0, block_q=0, block_kv=8192, k_scale=None, v_scale=None):
    return torch.empty_like(q)


def _fake_write(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, k_scale=None, v_scale=None):
    return torch.empty_like(k_pages), torch.empty_like(v_pages)


def _fake_write_and_attend(q, new_k, new_v, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=None, scale=0.0,
                           window=0, softcap=0.0, block_q=0, block_kv=8192, k_scale=None, v_scale=None):
    return torch.empty_like(q), torch.empty_like(k_pages), torch.empty_like(v_pages)


def _quantize_kv(x: jax.Array, scale: jax.Array, dtype: str) -> jax.Array:
    return pallas.quantize(x, scale, jnp.dtype(dtype))


def _validate_quantize(x, scale, dtype):
    if dtype not in pallas.QUANTIZED_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(pallas.QUANTIZED_DTYPES)}, got {dtype!r}")
    check_array("x", x, dtypes=pallas.KV_DTYPES, ndim=3)
    check_array("scale", scale, dtypes=("float32",), ndim=1)
    if tuple(scale.shape) != (x.shape[1],):
        raise ValueError(f"scale must have shape ({x.shape[1]},) (one per KV head of x [T, Hkv, D]), "
                         f"got {tuple(scale.shape)}")
    pallas.check_scale_values("scale", scale)


ragged_paged_attention = jax_op(add_op_namespace_prefix("ragged_paged_attention"), pallas.ragged_paged_attention,
                                fake=_fake_attention, validate=pallas.validate)
write_kv = jax_op(add_op_namespace_prefix("write_kv"), pallas.write_kv, fake=_fake_write,
                  returns=tuple[torch.Tensor, torch.Tensor], validate=pallas.validate_write)
write_and_attend = jax_op(add_op_namespace_prefix("write_and_attend"), pallas.write_and_attend,
                          fake=_fake_write_and_attend, returns=tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                          validate=pallas.validate_write_and_attend)
quantize_kv = jax_op(add_op_namespace_prefix("quantize_kv"), _quantize_kv,
                     fake=lambda x, scale, dtype: torch.empty(x.shape, dtype=getattr(torch, dtype), device=x.device),
                     validate=_validate_quantize)
quantize_kv.__doc__ = """quantize_kv(x [T, Hkv, D], scale [Hkv] float32, dtype "float8_e4m3fn" | "int8"): what write_kv
stores for new rows x (``pallas.quantize``: x / scale per KV head, nearest with ties to even, saturated)."""


def _write_targets(kv_lens: jax.Array, page_indices: jax.Array, cu_q_lens: jax.Array, tokens: int, num_pages: int,
                   page: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(page, row, source) per new token: token i is written to cache[page[i], row[i]] with the values
    of new token source[i] (``pallas.write_slots``). A token that must not be written (padding, a target
    outside the cache) repeats the first written token's target and source, so repeated targets carry
    identical values; with nothing to write, source is -1 and the target (page 0) keeps its own value."""
    pid, off, _ = pallas.write_slots(kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32),
                                  cu_q_lens.astype(jnp.int32), tokens, num_pages, page)
    ok = pid >= 0
    j = jnp.argmax(ok)  # the first token written, or 0
    source = jnp.where(ok, jnp.arange(tokens, dtype=jnp.int32), jnp.where(ok[j], j, -1).astype(jnp.int32))
    return jnp.where(ok, pid, jnp.maximum(pid[j], 0)), jnp.where(ok, off, off[j]), source


_write_targets_op = jax_op(
    add_op_namespace_prefix("write_targets"), _write_targets,
    fake=lambda kv_lens, page_indices, cu_q_lens, tokens, num_pages, page: tuple(
        kv_lens.new_empty((tokens,), dtype=torch.int32) for _ in range(3)),
    returns=tuple[torch.Tensor, torch.Tensor, torch.Tensor])


def write_kv_(k_cache, v_cache, new_k, new_v, kv_lens, page_indices, cu_q_lens, k_scale=None, v_scale=None):
    """Write the new tokens [T, Hkv, D] into the torch caches ``k_cache``/``v_cache`` in place.

    The targets are computed on the tensors' device (``pallas.write_slots`` in a small op), then one
    ``index_put_`` per cache writes the T new rows and nothing else: no host sync, no copy of a cache,
    and it traces (torch.compile, torch.export). k_cache/v_cache may be overlapping views of one
    buffer (transformers' paged cache interleaves the layers' K and V pages). TorchTPU runs in-place
    ops on a tensor or a view with its buffer donated (in-place buffer donation, on by default), so
    the cache is updated where it lies. The Pallas write kernel is ``write_kv`` (functional; in place
    for JAX callers that donate the caches under jit). A quantized cache (float8_e4m3fn, int8) takes
    ``k_scale``/``v_scale`` [Hkv] float32 and gets the rows quantized by ``quantize_kv``.
    """
    pallas.validate_write(k_cache, v_cache, new_k, new_v, kv_lens, page_indices, cu_q_lens, k_scale, v_scale)
    tokens = new_k.shape[0]
    if tokens == 0 or k_cache.shape[0] == 0:  # nothing to write, or no page to write into
        return
    if k_scale is not None:
        dtype = str(k_cache.dtype).removeprefix("torch.")
        new_k, new_v = quantize_kv(new_k, k_scale, dtype), quantize_kv(new_v, v_scale, dtype)
    pid, off, source = _write_targets_op(kv_lens, page_indices, cu_q_lens, tokens, k_cache.shape[0],
                                         k_cache.shape[1])
    write = (source >= 0)[:, None, None]
    for cache, new in ((k_cache, new_k), (v_cache, new_v)):
        new = new.reshape(tokens, *cache.shape[2:])  # a lane-packed cache: a row per group of heads
        cache.index_put_((pid, off), torch.where(write, new.index_select(0, source.clamp(min=0)), cache[pid, off]))


REGISTRATIONS = [{"registry": "paged_attention", "name": CB_NAME, "function": "paged_attention_forward"}]
__all__ = ["ragged_paged_attention", "write_kv", "write_kv_", "write_and_attend", "quantize_kv", "paged_attention_forward",
           "enable_continuous_batching", "CB_NAME", "pallas"]
