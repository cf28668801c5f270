"""flash-attention-tpu: Pallas TPU flash attention (GQA/MQA, causal, sliding window, soft-cap, sinks,
padding) as a torch op with autograd, and a transformers attention function.

    attention(q, k, v, sinks=None, seq=None, mask=None, scale=0.0, causal=True, window=0, softcap=0.0,
              block_q=0, block_k=0, mask_only=False)
        -> (out [B, Hq, Sq, D], lse [B, Hq, Sq] f32)          (torch custom op, differentiable)
        scale 0.0 (the default) means D**-0.5, as the JAX function pallas.flash_attention
    attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)
        -> (out [B, Sq, Hq, D], None)                         (transformers' AttentionInterface contract)

See pallas.py for the kernel and CARD.md for usage.
"""

from __future__ import annotations

import torch

from . import _attention_math as attention_math, pallas
from ._bridge import check_array, dtype_name, jax_op
from ._ops import add_op_namespace_prefix

import jax  # noqa: E402  (after the bridge: a kernel package imports jax, it does not declare it)
import jax.numpy as jnp  # noqa: E402


def _opt(x):
    return None if not x else x


def _check(q, k, v, sinks=None, seq=None, mask=None, scale=0.0, causal=True, window=0, softcap=0.0, block_q=0,
           block_k=0, mask_only=False):
    if window < 0:
        raise ValueError(f"window must be a positive number of tokens (0 = no window), got {window}")
    if mask_only and seq is not None:
        raise ValueError("mask_only=True takes the mask alone (it finds the lengths itself): seq must be None")
    pallas.validate(q, k, v, sinks, seq, mask, scale=scale, causal=causal, window=_opt(window),
                    softcap=_opt(softcap), block_q=_opt(block_q), block_k=_opt(block_k))


def _mask_structure(mask: jax.Array, causal: bool, window: int | None) -> tuple[jax.Array, jax.Array]:
    """(seq [B, 3] int32, exact) for a mask [B, Sq, Sk] (nonzero = attend), on the device.

    seq = (kv_start, kv_end, q_len = Sq) bounds the keys any row sees, so fully masked blocks are
    skipped; ``exact`` (a boolean array) says whether the mask is exactly those lengths with
    ``causal`` (bottom-right) and ``window``, as transformers' padding masks are: then the kernel
    needs no mask at all. A traced decision, so no host sync and nothing data-dependent to trace.
    """
    _, sq, sk = mask.shape
    mask = mask.astype(bool)
    cols = mask.any(axis=1)  # [B, Sk]: keys some row sees
    ar = jnp.arange(sk, dtype=jnp.int32)
    kv_end = jnp.max(jnp.where(cols, ar + 1, 0), axis=1, initial=0)  # initial: Sk may be 0
    kv_start = jnp.minimum(jnp.min(jnp.where(cols, ar, sk), axis=1, initial=sk), kv_end)
    q_len = jnp.full_like(kv_end, sq)
    q_pos = (kv_end - q_len)[:, None, None] + jnp.arange(sq, dtype=jnp.int32)[None, :, None]
    k_pos = ar[None, None, :]
    ok = attention_math.allowed(q_pos, k_pos, causal=causal, window=window)
    ok = ok & (k_pos >= kv_start[:, None, None]) & (k_pos < kv_end[:, None, None])
    return jnp.stack([kv_start, kv_end, q_len], axis=1), jnp.all(ok == mask)


def _by_mask(run, seq, mask, causal, window, mask_only):
    """run(seq, mask, causal, window) as the op's arguments say. With ``mask_only`` the mask alone
    decides (sdpa semantics) and causal/window describe the structure it probably has: the device
    picks the lengths-only kernel when the mask is exactly that structure, else the masked one."""
    if mask is None or not mask_only:
        return run(seq, mask, causal, window)
    seq, exact = _mask_structure(mask, causal, window)
    return jax.lax.cond(exact, lambda: run(seq, None, causal, window), lambda: run(seq, mask, False, None))


def _forward(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None = None, seq: jax.Array | None = None,
             mask: jax.Array | None = None, scale: float = 0.0, causal: bool = True, window: int = 0,
             softcap: float = 0.0, block_q: int = 0, block_k: int = 0,
             mask_only: bool = False) -> tuple[jax.Array, jax.Array]:
    def run(seq, mask, causal, window):
        return pallas.flash_attention_with_lse(q, k, v, sinks, seq, mask, scale=scale, causal=causal, window=window,
                                               softcap=_opt(softcap), block_q=_opt(block_q), block_k=_opt(block_k))

    return _by_mask(run, seq, mask, causal, _opt(window), mask_only)


def _backward(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array | None, seq: jax.Array | None,
              mask: jax.Array | None, out: jax.Array, lse: jax.Array, grad: jax.Array, grad_lse: jax.Array | None,
              scale: float = 0.0, causal: bool = True, window: int = 0, softcap: float = 0.0, block_q: int = 0,
              block_k: int = 0, mask_only: bool = False) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    hq = q.shape[1]

    def run(seq, mask, causal, window):
        dq, dk, dv, dsinks = pallas._backward(
            q, k, v, sinks, seq, mask, out, lse, grad,
            scale=attention_math.resolve_scale(scale, q.shape[3]), causal=causal, window=window,
            softcap=_opt(softcap), block_q=_opt(block_q), block_k=_opt(block_k), chip=pallas._chip_from_device(),
            dlse=grad_lse)
        return dq, dk, dv, (jnp.zeros((hq,), jnp.float32) if dsinks is None else dsinks)

    return _by_mask(run, seq, mask, causal, _opt(window), mask_only)


def _fake_forward(q, k, v, sinks=None, seq=None, mask=None, scale=0.0, causal=True, window=0, softcap=0.0,
                  block_q=0, block_k=0, mask_only=False):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _fake_backward(q, k, v, sinks, seq, mask, out, lse, grad, grad_lse, scale=0.0, causal=True, window=0,
                   softcap=0.0, block_q=0, block_k=0, mask_only=False):
    ds = torch.empty_like(sinks) if sinks is not None else q.new_empty((q.shape[1],), dtype=torch.float32)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), ds


def _check_backward(q, k, v, sinks, seq, mask, out, lse, grad, grad_lse, *args, **kwargs):
    _check(q, k, v, sinks, seq, mask, *args, **kwargs)


attention = jax_op(add_op_namespace_prefix("attention"), _forward, fake=_fake_forward, validate=_check,
                   returns=tuple[torch.Tensor, torch.Tensor])
attention_backward = jax_op(add_op_namespace_prefix("attention_backward"), _backward, fake=_fake_backward,
                            validate=_check_backward,
                            returns=tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor])


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, seq, mask = inputs[:6]
    ctx.static = inputs[6:]
    ctx.has_sinks = sinks is not None
    ctx.save_for_backward(q, k, v, sinks, seq, mask, *output)


def _autograd_backward(ctx, grad_out, grad_lse):
    q, k, v, sinks, seq, mask, out, lse = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(q, k, v, sinks, seq, mask, out, lse, grad_out.contiguous(),
                                            None if grad_lse is None else grad_lse.contiguous(), *ctx.static)
    return (dq, dk, dv, dsinks if ctx.has_sinks else None, None, None) + (None,) * len(ctx.static)


attention.register_autograd(_autograd_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- transformers integration

def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention contract: query [B, Hq, S, D], key/value [B, Hkv, Sk, D], the boolean
    mask of ``sdpa_mask`` ([B, 1, S, Sk], True = attend) or None; returns ((B, S, Hq, D), None).

    Reads ``sliding_window``, ``softcap``, ``s_aux`` (sinks) and ``is_causal`` from kwargs, falling
    back to the module's ``is_causal``. The mask alone decides (as in sdpa); the device checks
    whether it is a padding + causal (+ window) mask, which runs on per-sequence lengths (no mask
    traffic, padded blocks skipped), and reads any other mask block by block. No host sync.
    """
    if dropout:
        raise ValueError(f"pallas_attention does not implement attention dropout; got dropout={dropout} "
                         "(use model.eval() or attention_dropout=0.0)")
    for name, t in (("query", query), ("key", key), ("value", value)):
        check_array(name, t, dtypes=pallas.DTYPES, ndim=4)
    window = kwargs.get("sliding_window")
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    causal = kwargs.get("is_causal")
    if causal is None:
        causal = getattr(module, "is_causal", True)
    if window is not None and window <= 0:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window}")
    b, hq, sq, d = query.shape
    scale = attention_math.transformers_scale(scaling, d, "pallas_attention")
    sk = key.shape[2]
    mask = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise TypeError(f"attention_mask must be a boolean mask (True = attend) as built by transformers' "
                            f"sdpa_mask; got dtype {dtype_name(attention_mask)}. Register the 'sdpa' mask "
                            f"function for this attention implementation")
        if attention_mask.ndim != 4 or tuple(attention_mask.shape) != (b, 1, sq, sk):
            raise ValueError(f"attention_mask must have shape {(b, 1, sq, sk)} (batch, 1, q_len, kv_len), "
                             f"got {tuple(attention_mask.shape)}")
        mask = attention_mask[:, 0].contiguous()
    out, _ = attention(query.contiguous(), key.contiguous(), value.contiguous(), sinks, None, mask, scale,
                       bool(causal), int(window or 0), float(softcap or 0.0), 0, 0, True)
    return out.transpose(1, 2), None


def flash_attn_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``attention_forward`` under the name transformers' Hub-kernel loader looks for.

    With ``attn_implementation="pallas-hub/flash-attention-tpu"`` (transformers >= 5.24 with kernels
    0.18.2 <= version < 0.19) transformers loads this repository and, because it has ``flash_attn_forward``
    and ``supports_flash_attn``, registers this function with the sdpa (boolean) mask. Continuous batching
    (``generate_batch``) also accepts that name, since it contains "flash", but then passes all requests
    packed into one row with no mask; this kernel would attend across requests, so it refuses instead.
    """
    if "cu_seq_lens_q" in kwargs:
        raise ValueError("flash-attention-tpu does not run continuous batching (generate_batch packs requests into one "
                         "row without a mask); use paged-attention-tpu's 'paged_flash_tpu' (pallas_hub.load registers it)")
    return attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


supports_flash_attn = True  # what transformers' loader checks beside flash_attn_forward (see above)

REGISTRATIONS = [
    {"registry": "attention", "name": "pallas_attention", "function": "attention_forward", "mask": "sdpa"},
]
__all__ = ["attention", "attention_backward", "attention_forward", "attention_math", "flash_attn_forward", "pallas",
           "supports_flash_attn", "REGISTRATIONS"]
