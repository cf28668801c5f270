"""Attention math shared by the flash and paged attention kernels (one source, in
``pallas_hub/vendored/``; the build copies it into each package that imports ``_attention_math``).

Everything here works both inside a Pallas kernel body (on block values) and on whole arrays.
Semantics follow transformers:
  * positions are absolute: a query at row i of a sequence whose KV holds L tokens and which brings
    lq new tokens sits at position (L - lq) + i (causal is bottom-right aligned);
  * causal: k_pos <= q_pos; sliding window W: k_pos > q_pos - W (transformers' `kv_idx > q_idx - W`);
  * soft-capping (Gemma-2): s = cap * tanh(s / cap), after scaling;
  * sinks (GPT-OSS's s_aux): one extra logit per head in the softmax denominator, no value;
  * a query row with no allowed key gives 0, never NaN.
"""

import math

import jax
import jax.numpy as jnp

# Finite, so that running maxima of fully masked rows stay finite (exp(-inf - -inf) would be NaN);
# masked probabilities are zeroed explicitly, so the value itself never leaks into a result.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def resolve_scale(scale: float | None, head_dim: int) -> float:
    """The softmax scale of every attention op: ``scale``, or head_dim**-0.5 when it is None or 0.

    0 is the torch ops' default: TorchTPU's jax_op makes the op schema from the JAX function's
    signature, so a default that depends on the input shape can only be a sentinel.
    """
    return float(scale) if scale else float(head_dim) ** -0.5


def transformers_scale(scaling: float | None, head_dim: int, who: str) -> float:
    """A transformers attention function's ``scaling`` (None = head_dim**-0.5) as the ops take it.

    0 is refused, not passed on: the ops read a scale of 0 as their default (``resolve_scale``), so
    ``scaling=0.0`` (every key weighted alike) would silently become head_dim**-0.5.
    """
    if scaling == 0:
        raise ValueError(f"{who}: scaling=0.0 (every key weighted alike) is not supported: the kernel op reads a "
                         "scale of 0 as head_dim ** -0.5; pass scaling=None for that default")
    return resolve_scale(scaling, head_dim)


def allowed(q_pos, k_pos, *, causal: bool, window: int | None):
    """Which (query, key) position pairs may attend; q_pos [..., q, 1], k_pos [..., 1, k] broadcast."""
    ok = jnp.ones(jnp.broadcast_shapes(q_pos.shape, k_pos.shape), dtype=jnp.bool_)
    if causal:
        ok &= k_pos <= q_pos
    if window is not None:
        ok &= k_pos > q_pos - window
    return ok


def scores(q, k, *, scale: float, softcap: float | None):
    """f32 logits q @ k^T (contracting the last dims), scaled then soft-capped."""
    s = jax.lax.dot_general(q, k, (((q.ndim - 1,), (k.ndim - 1,)), ((), ())), preferred_element_type=jnp.float32)
    return logits(s, scale=scale, softcap=softcap)


def logits(dots, *, scale: float, softcap: float | None):
    """f32 q.k dots as logits: scaled then soft-capped (``scores`` after its dot, for dots taken another way)."""
    s = dots * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    return s


def online_softmax_step(m, l, acc, s, ok, v):
    """Fold one block of logits ``s`` [q, k] (``ok`` masks it; None: every pair may attend) and values
    ``v`` [k, d] into the running max ``m`` [q, 1], denominator ``l`` [q, 1] and f32 accumulator ``acc`` [q, d]."""
    m_new, l_new, alpha, p = softmax_weights(m, l, s, ok)
    return m_new, l_new, accumulate(acc, alpha, p, v)


def softmax_weights(m, l, s, ok):
    """The first half of ``online_softmax_step``: (m_new, l_new, alpha = exp(m - m_new), p [q, k] f32), the
    weights ``accumulate`` folds into acc. Split so a kernel can start the next head's scores before this
    head's P @ V (the MXU works on one while the vector units work on the other)."""
    if ok is not None:
        s = jnp.where(ok, s, MASK_VALUE)
    m_new = jnp.maximum(m, s.max(axis=-1, keepdims=True))
    p = jnp.exp(s - m_new)
    if ok is not None:  # a row with nothing allowed yet has m_new = MASK_VALUE: exp(0) must not count
        p = jnp.where(ok, p, 0.0)
    alpha = jnp.exp(m - m_new)
    return m_new, alpha * l + p.sum(axis=-1, keepdims=True), alpha, p


def accumulate(acc, alpha, p, v):
    """The second half of ``online_softmax_step``: alpha * acc + p @ v (p rounded to v's dtype for the MXU)."""
    pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return alpha * acc + pv


LOG2E = math.log2(math.e)
ONES_ROWS = 16  # rows of ones below V^T in the keys-major step (one packed bf16 sublane tile)
# Chips whose keys-major step takes exp in bf16 for bf16 inputs, in the paged kernel's prefill row blocks: v6e
# (bf16 EUP; half the exp pushes and pops). Not v5e (no bf16 VPU/EUP), nor TPU7x: it has them, but the compiled
# schedule came out 0-2% longer with bf16 exp (benchmarks, pallas-hub bench runner). The flash kernel takes
# exp in f32 everywhere: its v6e schedule is shorter so (flash_attention_tpu.pallas), the paged kernel's mixed
# batches 0.3-0.5% longer.
BF16_EXP_CHIPS = ("v6e",)


def exp_dtype(dtype, chip: str | None):
    """The dtype of the keys-major step's exp on ``chip``: bf16 for bf16 inputs on BF16_EXP_CHIPS (p is
    rounded to bf16 for the MXU either way), else f32."""
    return jnp.bfloat16 if jnp.dtype(dtype) == jnp.bfloat16 and chip in BF16_EXP_CHIPS else jnp.float32


def scores_keys_major(k, q, *, scale: float, softcap: float | None):
    """Logits transposed and in base 2: log2(e) * scores(q, k) as [k, q] f32 (keys on sublanes,
    queries on lanes), so that exp2 of them needs no extra multiply (TPUs compute exp as exp2).
    Without a soft-cap, ``dots_keys_major`` and the step's ``t_scale`` defer the multiply."""
    s = dots_keys_major(k, q)
    if softcap is None:
        return s * (scale * LOG2E)
    return (softcap * LOG2E) * jnp.tanh(s * (scale / softcap))


def dots_keys_major(k, q):
    """k @ q^T as [k, q] f32: logits before any scale."""
    return jax.lax.dot_general(k, q, (((k.ndim - 1,), (q.ndim - 1,)), ((), ())), preferred_element_type=jnp.float32)


def online_softmax_step_keys_major(m, acc, t, ok, vt, *, exp_dtype=jnp.float32, t_scale: float = 1.0):
    """online_softmax_step with keys on sublanes and queries on lanes, in base 2.

    Folds logits ``t`` [k, q] (log2 units: ``scores_keys_major``; or t_scale times them: unscaled dots and
    the scale, applied in the exp2's argument, with no pass of its own over the tile; ``ok`` masks them, None:
    every pair may attend) and ``vt`` [d + r, k] into the running max ``m`` [1, q] and the f32 accumulator
    ``acc`` [d + r, q]. ``vt`` is V^T with r rows of ones below it: the MXU computes the softmax
    denominator (row d of ``acc``) alongside (P @ V)^T, from the same rounded p, so no row sum is
    left to the vector units; per-query statistics are lane-dense rows and the reductions run over
    sublanes (no cross-lane work). ``exp_dtype`` bfloat16 evaluates exp2 at bf16 (chips with a
    bf16 EUP): p is rounded to bf16 for the MXU anyway, and the argument's own rounding costs at
    most ~2^-9 / e of the largest weight. Unscaled logits (``t_scale``) masked to MASK_VALUE by the
    caller need a real key of each query in the tile (its m_new real: they get weight 0)."""
    def log2_units(v):  # the deferred scale, in the argument of each use: no pass of its own over the tile
        return v * t_scale if t_scale != 1 else v
    if ok is not None:  # masked logits become MASK_VALUE exactly: exp2 of them is 0 once m_new is real
        t, t_scale = jnp.where(ok, log2_units(t), MASK_VALUE), 1.0  # t is scaled now
    m_new = jnp.maximum(m, log2_units(t.max(axis=0, keepdims=True)))
    # A query with nothing allowed yet keeps m_new = MASK_VALUE and takes weight 1 for its masked
    # keys: the next real key scales that away (alpha = 0), and finalize_keys_major empties a query
    # that never saw one, so no second select is needed here.
    p = jnp.exp2((log2_units(t) - m_new).astype(exp_dtype))
    pv = jax.lax.dot_general(vt, p.astype(vt.dtype), (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return m_new, jnp.exp2(m - m_new) * acc + pv


def finalize_keys_major(m, acc, d: int, sink=None):
    """``finalize`` of the keys-major state (m [1, q] in log2 units, acc [d + r, q] with the denominator
    in row d): (out f32 [d, q], log-sum-exp [1, q]). A query whose max is still MASK_VALUE saw no
    allowed key: its denominator is 0 whatever was accumulated (its acc is then scaled to 0)."""
    l = jnp.where(m > MASK_VALUE, acc[d:d + 1], 0.0)
    return finalize(m * (1.0 / LOG2E), l, acc[:d], sink)


def finalize(m, l, acc, sink=None):
    """Output rows acc / l, with an optional sink logit per row joining the denominator.

    Returns (out f32 [q, d], log-sum-exp [q, 1]); rows with nothing to attend give 0 and lse = MASK_VALUE.
    """
    if sink is not None:
        sink = jnp.asarray(sink, jnp.float32)
        m_all = jnp.maximum(m, sink)
        scale = jnp.exp(m - m_all)
        l = l * scale + jnp.exp(sink - m_all)
        acc = acc * scale
        m = m_all
    empty = l == 0.0
    out = jnp.where(empty, 0.0, acc / jnp.where(empty, 1.0, l))
    lse = jnp.where(empty, MASK_VALUE, m + jnp.log(jnp.where(empty, 1.0, l)))
    return out, lse


def reference_attention(q, k, v, *, scale, causal=True, window=None, softcap=None, sinks=None,
                        q_lens=None, kv_lens=None):
    """Dense attention in plain JAX, f32, the reference every kernel test compares to.

    q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] (GQA: Hq a multiple of Hkv). ``kv_lens`` [B]: keys past it
    are padding; ``q_lens`` [B]: queries past it are padding (their rows are 0). Queries of batch b
    are the last q_lens[b] tokens of its kv_lens[b] (bottom-right). ``sinks`` [Hq]. Returns f32.
    """
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    kv_lens = jnp.full((b,), sk) if kv_lens is None else jnp.asarray(kv_lens)
    q_lens = jnp.full((b,), sq) if q_lens is None else jnp.asarray(q_lens)
    qg = q.astype(jnp.float32).reshape(b, hkv, hq // hkv, sq, d)
    s = jnp.einsum("bhgqd,bhkd->bhgqk", qg, k.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    q_pos = (kv_lens - q_lens)[:, None, None, None, None] + jnp.arange(sq)[:, None]
    k_pos = jnp.arange(sk)[None, :]
    ok = allowed(q_pos, k_pos, causal=causal, window=window)
    ok &= (k_pos < kv_lens[:, None, None, None, None]) & (jnp.arange(sq)[:, None] < q_lens[:, None, None, None, None])
    s = jnp.where(ok, s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1), s.shape[:-1] + (1,))
        s = jnp.concatenate([s, sink], axis=-1)
    p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))  # rows of all -inf give NaN: they are 0
    if sinks is not None:
        p = p[..., :-1]
    out = jnp.einsum("bhgqk,bhkd->bhgqd", p, v.astype(jnp.float32))
    return out.reshape(b, hq, sq, d)
