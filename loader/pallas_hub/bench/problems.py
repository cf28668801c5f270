"""The benchmark's problems: whole layers at real model shapes, with a reduced case to check numerics.

Three layers (DESIGN.md "Shapes that matter") and a training step:

* ``moe``: one MoE experts layer given the router's top-k (hidden [T, H], top-k ids and weights,
  gate_up [E, 2I, H], down [E, H, I] in transformers' (Qwen3's) layout, and the router logits [T, E] for
  kernels that route themselves: vLLM TPU's fused_moe) -> [T, H]. Routing is softmax top-k of
  seeded random logits, renormalised (Qwen3's ``norm_topk_prob``). Each implementation takes the
  weights in its own layout (``prepare``, outside cost and timing); ``params["storage"]`` says how
  transformers stores the model's (``EXPERTS_STORAGE``: GPT-OSS [E, H, 2I] interleaved).
* ``prefill``: causal self-attention, q [1, Hq, S, D], k/v [1, Hkv, S, D] -> [1, Hq, S, D].
* ``train``: the causal prefill's training step: its output and, from the output's gradient do [1, Hq, S, D],
  dq, dk, dv (every prefill implementation differentiated by JAX, ``runner.training_step``).
* ``decode``: one decode step of a continuous batch: write each sequence's new K/V into the paged
  cache (in place), then attend over its context (the new token included). Context lengths are
  seeded uniform in ``DECODE_CONTEXT``, or all one given length (the long-context rows); pages of
  ``page`` tokens scattered at random over one pool. A mixed batch (``MIXED``) holds decode sequences
  and then prefill chunks (vLLM's order), its query rows ragged by ``cu_q_lens`` (a keyword argument).

A problem's ``format`` is how its big operand is stored: "bf16", or quantized (``QUANT_FORMATS``):
the experts' weights as checkpoints store them (fp8 e4m3 with f32 scales per 128 x 128 block, the
FP8 checkpoints' ``*_scale_inv``; int8 with f32 per-output-channel scales; GPT-OSS's MXFP4, uint8
packed pairs with e8m0 scales per 32 inputs, gate_up's columns interleaved gate, up, gate, ... as
GPT-OSS stores them, in the layout ``from_pretrained_mxfp4`` stores: [E, in/2, out] and [E, in/32
padded to 32 rows, out]), their scales appended to the arguments; or the KV
cache (fp8 e4m3 or int8 with f32 scales per KV head, ``k_scale, v_scale`` appended). Only
implementations that declare the format race it.

Bulk data is abstract (ShapeDtypeStructs); what steers the kernels (routing, lengths, page tables)
is concrete, so the cost model follows the real control flow (the routing weights too: a kernel may
take them in SMEM). ``min_bytes``/``min_flops`` are the
least any implementation must move and compute: the ideal time is their roofline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

from .. import verify  # noqa: F401  (CPU-only JAX set-up before jax loads)

import jax  # noqa: E402
from ..hub.quantized import mxfp4_scale_rows  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    experts: int
    top_k: int
    moe_intermediate: int
    q_heads: int | None = None  # attention shapes: None for a model raced on its experts only
    kv_heads: int | None = None
    head_dim: int | None = None
    short: str = ""
    moe_tokens: tuple = (1, 8, 64, 256, 2048, 8192)  # decode batches and prefill lengths
    prefill_tokens: tuple = (2048, 8192)
    decode: tuple = ((1, 16), (8, 16), (64, 16), (256, 16), (64, 128))  # (batch, page size[, context])
    quantized_moe: tuple = ()  # (format, tokens)
    quantized_decode: tuple = ()  # (format, batch, page size)


# transformers' Qwen3MoeConfig for Qwen/Qwen3-30B-A3B (checked against its config.json fields)
QWEN3_30B_A3B = Model("Qwen3-30B-A3B", hidden=2048, experts=128, top_k=8, moe_intermediate=768,
                      q_heads=32, kv_heads=4, head_dim=128, short="Qwen3",
                      decode=((1, 16), (8, 16), (64, 16), (256, 16), (64, 32), (64, 64), (64, 128), (64, 256),
                              (256, 256), (64, 16, 8192), (256, 16, 8192), (64, 256, 8192), (64, 16, 32768)),
                      quantized_moe=(("fp8", 1), ("fp8", 64), ("fp8", 256), ("int8", 64)),
                      quantized_decode=(("fp8", 64, 16), ("fp8", 64, 128), ("int8", 64, 128)))
# openai/gpt-oss-20b's config.json shapes (its experts are computed here as SiLU-gated, unbiased, as
# for Qwen3, by every implementation); fewer attention shapes, to keep the run short.
GPT_OSS_20B = Model("GPT-OSS-20B", hidden=2880, experts=32, top_k=4, moe_intermediate=2880,
                    q_heads=64, kv_heads=8, head_dim=64, short="GPT-OSS",
                    prefill_tokens=(2048,), decode=((1, 16), (64, 16)),
                    quantized_moe=(("mxfp4", 1), ("mxfp4", 64)))
# google/gemma-4-26b-a4b's experts (hidden, experts, top-k, intermediate as in kernels/ragged_dot/
# compile_matrix.py, checked against its config): GELU-tanh gated in the model, computed here SiLU-gated
# by every implementation as for GPT-OSS; the experts only (intermediate 704 is off the 128-lane grid).
GEMMA4_26B_A4B = Model("Gemma-4-26B-A4B", hidden=2816, experts=128, top_k=8, moe_intermediate=704, short="Gemma-4",
                       prefill_tokens=(), decode=())
# Attention-only shapes, for the GQA ratios and head dims the two models above lack: Qwen3-235B-A22B
# (64 q / 4 kv heads, GQA 16:1, head_dim 128; Qwen3MoeConfig fields of its config.json) and Gemma-3-4B's
# global (full causal) layers (8 q / 4 kv heads, head_dim 256: transformers' Gemma3TextConfig defaults,
# documented as google/gemma-3-4b-it). Attention only: Qwen3-235B's experts are not raced, Gemma-3 is dense.
QWEN3_235B_A22B = Model("Qwen3-235B-A22B", hidden=4096, experts=128, top_k=8, moe_intermediate=1536,
                        q_heads=64, kv_heads=4, head_dim=128, short="Qwen3-235B", moe_tokens=(), decode=())
GEMMA3_4B = Model("Gemma-3-4B", hidden=2304, experts=0, top_k=0, moe_intermediate=0, q_heads=8, kv_heads=4,
                  head_dim=256, short="Gemma-3", moe_tokens=(), decode=())
MODELS = (QWEN3_30B_A3B, GPT_OSS_20B, GEMMA4_26B_A4B, QWEN3_235B_A22B, GEMMA3_4B)
# How transformers stores a model's bf16 experts where it is not [E, 2I, H] / [E, H, I] with [gate; up]
# ("concatenated"): GptOssExperts (is_transposed=True) keeps gate_up [E, H, 2I] with gate and up in
# alternate columns, and down [E, I, H]. The problems hold the concatenated layout; an implementation
# that runs the model's own storage (ours) takes it from ``params["storage"]`` in its ``prepare``.
# (Not a field of Model: that would change every problem's recipe, the compile cache's key.)
EXPERTS_STORAGE = {GPT_OSS_20B.name: "transposed-interleaved"}
DECODE_CONTEXT = (1024, 4096)  # each sequence's context length, uniform in this range (seeded)
# Mixed prefill/decode batches: (decode sequences, prefill chunks, tokens per chunk, page size). Every
# sequence's length (its chunk included) is uniform in DECODE_CONTEXT. (A Model's fields are in its problems'
# recipes, but the compile cache keys a program by its shapes, not its recipe: a new row compiles alone.)
MIXED = {QWEN3_30B_A3B.name: ((60, 4, 128, 16), (60, 4, 128, 128), (60, 4, 128, 256))}


@dataclasses.dataclass
class Check:
    args: tuple
    kwargs: dict
    reference: Any
    shape: str
    tol: float  # max |err| / max |reference|


@dataclasses.dataclass
class Problem:
    family: str  # "moe" | "prefill" | "decode" | "train"
    model: str
    name: str
    params: dict
    args: tuple  # bulk data abstract, steering values concrete
    kwargs: dict
    min_bytes: int
    min_flops: int
    check: Callable[[], Check]  # a reduced concrete case for the interpret-mode check
    check_key: tuple
    recipe: tuple = ()  # how to build it again: (builder name, model fields, arguments...)
    format: str = "bf16"  # how the weights (moe) or the KV cache (decode) are stored: "bf16" or QUANT_FORMATS


def sds(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(tuple(int(s) for s in shape), dtype)


# --------------------------------------------------------------------------- MoE

def routing(tokens: int, experts: int, top_k: int, seed: int):
    """Router logits [T, E] (f32) and their softmax top-k: ids [T, k] int32, renormalised weights [T, k]."""
    logits = np.random.default_rng(seed).standard_normal((tokens, experts)).astype(np.float32)
    ids = np.argsort(-logits, axis=1, kind="stable")[:, :top_k].astype(np.int32)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    w = np.take_along_axis(p, ids, axis=1)
    return logits, ids, (w / w.sum(axis=1, keepdims=True)).astype(np.float32)


def moe_reference(x, ids, weights, gate_up, down):
    """Plain f32 experts layer in transformers' layout (gate_up [E, 2I, H], down [E, H, I])."""
    x = x.astype(jnp.float32)
    gu = jnp.einsum("th,tkoh->tko", x, gate_up[ids].astype(jnp.float32))
    gate, up = jnp.split(gu, 2, axis=-1)
    inter = jax.nn.silu(gate) * up
    y = jnp.einsum("tki,tkhi->tkh", inter, down[ids].astype(jnp.float32))
    return (y * weights[:, :, None]).sum(axis=1)


QUANT_FORMATS = {  # format -> what the weights (moe) or the KV cache (decode) hold
    "fp8": "float8_e4m3fn, f32 scales per 128 x 128 block (moe) or per KV head (decode)",
    "int8": "int8, f32 scales per output channel (moe) or per KV head (decode)",
    "mxfp4": "uint8 packed e2m1 pairs [E, in/2, out], uint8 e8m0 scales per 32 inputs [E, in/32 padded, out] "
             "(moe only; as from_pretrained_mxfp4 stores them)",
}
FP8_BLOCK = 128
_FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)


def quantized_weight(fmt: str, e: int, out: int, inp: int) -> tuple:
    """(weights, scales) of one [E, out, inp] expert weight stored in ``fmt`` (ShapeDtypeStructs)."""
    cdiv = lambda a, b: -(-a // b)  # noqa: E731
    if fmt == "fp8":
        return sds((e, out, inp), jnp.float8_e4m3fn), sds((e, cdiv(out, FP8_BLOCK), cdiv(inp, FP8_BLOCK)), jnp.float32)
    if fmt == "int8":
        return sds((e, out, inp), jnp.int8), sds((e, out), jnp.float32)
    if fmt == "mxfp4":
        return sds((e, inp // 2, out), jnp.uint8), sds((e, mxfp4_scale_rows(inp), out), jnp.uint8)
    raise ValueError(f"unknown format {fmt!r}: one of {sorted(QUANT_FORMATS)}")


def mxfp4_stored(w, scale):
    """MXFP4 blocks [E, out, in/2] and scales [E, out, in/32] (the checkpoint's) in the layout of
    ``quantized_weight`` (``from_pretrained_mxfp4``'s: hub.quantized.mxfp4_kernel_layout)."""
    w, scale = np.asarray(w), np.asarray(scale)
    pad = mxfp4_scale_rows(scale.shape[2] * 32) - scale.shape[2]
    return (jnp.asarray(np.swapaxes(w, 1, 2)),
            jnp.asarray(np.pad(np.swapaxes(scale, 1, 2), ((0, 0), (0, pad), (0, 0)), constant_values=127)))


def dequantize_weight(fmt: str, w, scale):
    """Plain f32 [E, out, inp] of a quantized expert weight in the checkpoint's layout (MXFP4: [E, out, in/2] and
    [E, out, in/32]; the reference's own decoding)."""
    if fmt == "fp8":
        full = jnp.repeat(jnp.repeat(scale, FP8_BLOCK, axis=1), FP8_BLOCK, axis=2)[:, :w.shape[1], :w.shape[2]]
        return w.astype(jnp.float32) * full
    if fmt == "int8":
        return w.astype(jnp.float32) * scale[:, :, None]
    if fmt == "mxfp4":  # low nibble first, then high (transformers' convert_moe_packed_tensors)
        w = np.asarray(w)
        vals = np.stack([_FP4[w & 0x0F], _FP4[w >> 4]], axis=-1).reshape(*w.shape[:-1], w.shape[-1] * 2)
        exp = np.repeat(np.asarray(scale, np.int32) - 127, 32, axis=-1)
        return jnp.asarray(np.ldexp(vals, exp))
    raise ValueError(f"unknown format {fmt!r}")


def _random_quantized(fmt: str, rng, e: int, out: int, inp: int) -> tuple:
    """Concrete random weights of ``fmt`` for the checks: values of about 1 / sqrt(inp)."""
    if fmt == "fp8":
        w = jnp.asarray(rng.standard_normal((e, out, inp)), jnp.float8_e4m3fn)
        s = rng.uniform(0.5, 1.5, (e, -(-out // FP8_BLOCK), -(-inp // FP8_BLOCK))) / math.sqrt(inp)
        return w, jnp.asarray(s, jnp.float32)
    if fmt == "int8":
        w = jnp.asarray(rng.integers(-127, 128, (e, out, inp)), jnp.int8)
        return w, jnp.asarray(rng.uniform(0.5, 1.5, (e, out)) / (64 * math.sqrt(inp)), jnp.float32)
    w = jnp.asarray(rng.integers(0, 256, (e, out, inp // 2)), jnp.uint8)  # the checkpoint's layout
    s = rng.integers(127 - 2, 127 + 1, (e, out, inp // 32)) - round(math.log2(math.sqrt(inp)))
    return w, jnp.asarray(s, jnp.uint8)


def _moe_check(tokens: int, fmt: str = "bf16") -> Check:
    e, top_k, h, i = 8, 2, 256, 128
    logits, ids, w = routing(tokens, e, top_k, seed=tokens)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((tokens, h)), BF16)
    if fmt == "bf16":
        gate_up = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / math.sqrt(h), BF16)
        down = jnp.asarray(rng.standard_normal((e, h, i)) / math.sqrt(i), BF16)
        args, scales = (x, jnp.asarray(ids), jnp.asarray(w), gate_up, down), ()
        reference = moe_reference(*args)
    else:
        (gate_up, gu_s), (down, dn_s) = _random_quantized(fmt, rng, e, 2 * i, h), _random_quantized(fmt, rng, e, h, i)
        gu, dn = dequantize_weight(fmt, gate_up, gu_s), dequantize_weight(fmt, down, dn_s)
        if fmt == "mxfp4":  # GPT-OSS stores gate and up interleaved (rows gate, up, gate, ...)
            gu = jnp.concatenate([gu[:, 0::2], gu[:, 1::2]], axis=1)
            (gate_up, gu_s), (down, dn_s) = mxfp4_stored(gate_up, gu_s), mxfp4_stored(down, dn_s)
        args, scales = (x, jnp.asarray(ids), jnp.asarray(w), gate_up, down), (gu_s, dn_s)
        reference = moe_reference(*args[:3], gu, dn)
    return Check(args + (jnp.asarray(logits),) + scales, {"top_k": top_k}, reference,
                 f"{tokens} tokens x top-{top_k} of {e} experts, hidden {h}, intermediate {i}"
                 + ("" if fmt == "bf16" else f", {fmt} weights"), 2e-2)


def moe_problem(m: Model, tokens: int, fmt: str = "bf16") -> Problem:
    h, e, k, i = m.hidden, m.experts, m.top_k, m.moe_intermediate
    logits, ids, w = routing(tokens, e, k, seed=tokens)
    active = int(len(np.unique(ids)))
    ct = min(tokens, 16)
    storage = EXPERTS_STORAGE.get(m.name, "concatenated") if fmt == "bf16" else None  # quantized: as given
    if fmt == "bf16":
        gate_up, down, scales = sds((e, 2 * i, h)), sds((e, h, i)), ()
    else:
        (gate_up, gu_s), (down, dn_s) = quantized_weight(fmt, e, 2 * i, h), quantized_weight(fmt, e, h, i)
        scales = (gu_s, dn_s)
    per_expert = sum(math.prod(a.shape[1:]) * a.dtype.itemsize for a in (gate_up, down) + scales)
    return Problem(
        "moe", m.name, f"{m.short} MoE layer T={tokens}" + ("" if fmt == "bf16" else f" {fmt}"),
        {"tokens": tokens, "hidden": h, "experts": e, "top_k": k, "intermediate": i, "active_experts": active,
         "format": fmt, "storage": storage},
        (sds((tokens, h)), jnp.asarray(ids), jnp.asarray(w), gate_up, down, jnp.asarray(logits))
        + scales, {"top_k": k},
        min_bytes=active * per_expert + 2 * tokens * h * 2 + tokens * k * 8, min_flops=2 * tokens * k * 3 * h * i,
        check=functools.partial(_moe_check, ct, fmt), check_key=("moe", ct, fmt, storage),
        recipe=("moe", dataclasses.asdict(m), tokens, fmt), format=fmt)


# --------------------------------------------------------------------------- prefill

def attention_reference(q, k, v, scale, lengths=None):
    """Plain f32 causal (or, with lengths, decode) GQA attention: [B, Hq, S, D] x [B, Hkv, S, D]."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * scale
    qi = jnp.arange(q.shape[2])[:, None] + (k.shape[2] - q.shape[2])
    ki = jnp.arange(k.shape[2])[None, :]
    mask = ki <= qi
    if lengths is not None:
        mask = mask & (ki[None, None] < lengths[:, None, None, None])
    s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision="highest")


def _prefill_check(m: Model) -> Check:
    s, hq, hkv, d = 256, m.q_heads // m.kv_heads, 1, m.head_dim  # same GQA group as the model
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((1, h, s, d)), BF16) for h in (hq, hkv, hkv))
    scale = 1 / math.sqrt(d)
    return Check((q, k, v), {"scale": scale}, attention_reference(q, k, v, scale),
                 f"1 x {s} tokens, {hq} q / {hkv} kv heads, d {d}", 2e-2)


def prefill_problem(m: Model, tokens: int) -> Problem:
    hq, hkv, d = m.q_heads, m.kv_heads, m.head_dim
    return Problem(
        "prefill", m.name, f"{m.short} causal prefill S={tokens}",
        {"batch": 1, "tokens": tokens, "q_heads": hq, "kv_heads": hkv, "head_dim": d},
        (sds((1, hq, tokens, d)), sds((1, hkv, tokens, d)), sds((1, hkv, tokens, d))),
        {"scale": 1 / math.sqrt(d)},
        min_bytes=2 * (2 * hq + 2 * hkv) * tokens * d, min_flops=4 * hq * d * tokens * (tokens + 1) // 2,
        check=functools.partial(_prefill_check, m), check_key=("prefill", hq // hkv, d),
        recipe=("prefill", dataclasses.asdict(m), tokens))


# --------------------------------------------------------------------------- training step

def _train_check(m: Model) -> Check:
    c = _prefill_check(m)
    q, k, v = c.args
    do = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), BF16)
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]  # f32 gradients of the bf16 inputs' values
    out, vjp = jax.vjp(functools.partial(attention_reference, scale=c.kwargs["scale"]), *f32[:3])
    return Check((q, k, v, do), c.kwargs, (out,) + vjp(f32[3]), c.shape + ", with dq, dk, dv", 2e-2)


def train_problem(m: Model, tokens: int) -> Problem:
    """The causal prefill's training step: its output and, from the output's gradient ``do``, dq, dk, dv (each
    implementation's prefill differentiated: ``runner.training_step``). The least it must move: q, k, v and do
    read, out, dq, dk, dv written; the least it must compute: the forward's two matmuls and the backward's
    four (dV = P^T dO, dP = dO V^T, dQ = dS K, dK = dS^T Q), 3x the forward (recomputing P adds one more)."""
    pre = prefill_problem(m, tokens)
    hq, hkv, d = m.q_heads, m.kv_heads, m.head_dim
    return dataclasses.replace(
        pre, family="train", name=f"{m.short} causal training S={tokens}", args=pre.args + (pre.args[0],),
        min_bytes=2 * (4 * hq + 4 * hkv) * tokens * d, min_flops=3 * pre.min_flops,
        check=functools.partial(_train_check, m), check_key=("train", hq // hkv, d),
        recipe=("train", dataclasses.asdict(m), tokens))


# --------------------------------------------------------------------------- decode

def paged_table(lengths: np.ndarray, page: int, seed: int, multiple: int = 1):
    """Every sequence's pages scattered at random over one pool; the table's width is a multiple of
    ``multiple`` pages (unused entries point at valid pages)."""
    pages_per_seq = -(-int(-(-lengths.max() // page)) // multiple) * multiple
    total = len(lengths) * pages_per_seq
    table = np.random.default_rng(seed).permutation(total).astype(np.int32).reshape(len(lengths), pages_per_seq)
    return table, total


def decode_reference(q, new_k, new_v, k_pages, v_pages, lengths, table, scale):
    """Dense f32 reference: write the new K/V at position length - 1, attend over [0, length)."""
    b, hq, d = q.shape
    page = k_pages.shape[1]
    pos = lengths - 1
    pid = table[np.arange(b), pos // page]
    k_pages = k_pages.at[pid, pos % page].set(new_k)
    v_pages = v_pages.at[pid, pos % page].set(new_v)
    dense = lambda p: jnp.moveaxis(p[jnp.asarray(table)].reshape(b, -1, p.shape[2], d), 2, 1)  # noqa: E731  [B, Hkv, S, D]
    return attention_reference(q[:, :, None], dense(k_pages), dense(v_pages), scale, jnp.asarray(lengths))[:, :, 0]


_KV_DTYPES = {"bf16": BF16, "fp8": jnp.float8_e4m3fn, "int8": jnp.int8}


def quantize_kv(x, scale, dtype):
    """x / scale[h] stored in a quantized cache dtype (int8 rounds to nearest and saturates), as f32 again
    times the scale: what a quantized cache holds for a new row [..., Hkv, D]."""
    y = x.astype(jnp.float32) / scale[:, None]
    y = jnp.clip(jnp.round(y), -127, 127).astype(dtype) if dtype == jnp.int8 else y.astype(dtype)
    return y.astype(jnp.float32) * scale[:, None]


def _decode_check(m: Model, batch: int, page: int, fmt: str = "bf16") -> Check:
    # the model's group on one KV head, or two below head dim 128 (a lane-packed cache holds two a row)
    hkv, d = (2 if m.head_dim < 128 else 1), m.head_dim
    hq = m.q_heads // m.kv_heads * hkv
    lengths = np.array([37, 200, 129, 16][:batch], np.int32)
    table, total = paged_table(lengths, page, seed=3, multiple=max(1, 128 // page))
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), BF16)
    new_k, new_v = (jnp.asarray(rng.standard_normal((batch, hkv, d)), BF16) for _ in range(2))
    scale = 1 / math.sqrt(d)
    if fmt == "bf16":
        kp, vp = (jnp.asarray(rng.standard_normal((total, page, hkv, d)), BF16) for _ in range(2))
        args, scales = (q, new_k, new_v, kp, vp, jnp.asarray(lengths), jnp.asarray(table)), ()
        reference = decode_reference(*args, scale)
    else:
        dt = _KV_DTYPES[fmt]
        ks, vs = (jnp.asarray(rng.uniform(0.02, 0.05, hkv), jnp.float32) for _ in range(2))
        kp, vp = (jnp.asarray(rng.standard_normal((total, page, hkv, d)) / 0.035, jnp.float32) for _ in range(2))
        kp, vp = ((jnp.clip(jnp.round(x), -127, 127) if dt == jnp.int8 else x).astype(dt) for x in (kp, vp))
        args, scales = (q, new_k, new_v, kp, vp, jnp.asarray(lengths), jnp.asarray(table)), (ks, vs)
        deq = lambda p, s: p.astype(jnp.float32) * s[:, None]  # noqa: E731  [P, page, Hkv, D] * [Hkv, 1]
        reference = decode_reference(q, quantize_kv(new_k, ks, dt), quantize_kv(new_v, vs, dt), deq(kp, ks),
                                     deq(vp, vs), jnp.asarray(lengths), jnp.asarray(table), scale)
    return Check(args + scales, {"scale": scale}, reference,
                 f"{batch} seqs of {', '.join(map(str, lengths))} tokens, {hq} q / {hkv} kv heads, page {page}"
                 + ("" if fmt == "bf16" else f", {fmt} cache"), 2e-2)


def decode_problem(m: Model, batch: int, page: int, fmt: str = "bf16", context: int | None = None) -> Problem:
    hq, hkv, d = m.q_heads, m.kv_heads, m.head_dim
    lengths = np.full(batch, context, np.int32) if context else \
        np.random.default_rng(batch).integers(*DECODE_CONTEXT, size=batch, endpoint=True).astype(np.int32)
    table, total = paged_table(lengths, page, seed=batch, multiple=max(1, 128 // page))
    ctx = int(lengths.sum())
    cb = min(batch, 4)
    if fmt not in _KV_DTYPES:
        raise ValueError(f"unknown KV cache format {fmt!r}: one of {sorted(_KV_DTYPES)}")
    cache = sds((total, page, hkv, d), _KV_DTYPES[fmt])
    # the kernels keep per-head scales in SMEM, where the cost model wants values: small, so concrete
    scales = () if fmt == "bf16" else (jnp.full((hkv,), 0.05, jnp.float32),) * 2
    kv_bytes = cache.dtype.itemsize
    return Problem(
        "decode", m.name, f"{m.short} decode B={batch} page {page}" + ("" if fmt == "bf16" else f" {fmt}")
        + (f" context {context // 1024}k" if context else ""),
        {"batch": batch, "context_tokens": ctx, "context_min": int(lengths.min()), "context_max": int(lengths.max()),
         "page": page, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "format": fmt},
        (sds((batch, hq, d)), sds((batch, hkv, d)), sds((batch, hkv, d)), cache, cache, jnp.asarray(lengths),
         jnp.asarray(table)) + scales, {"scale": 1 / math.sqrt(d)},
        min_bytes=2 * hkv * ctx * d * kv_bytes + 2 * (2 * batch * hq * d + 2 * batch * hkv * d),
        min_flops=4 * hq * d * ctx,
        check=functools.partial(_decode_check, m, cb, page, fmt), check_key=("decode", cb, hq // hkv, d, page, fmt),
        recipe=("decode", dataclasses.asdict(m), batch, page, fmt) + ((context,) if context else ()), format=fmt)


def ragged_reference(q, new_k, new_v, k_pages, v_pages, lengths, table, cu_q_lens, scale):
    """Dense f32 reference of a ragged batch: sequence i's new tokens (rows cu_q_lens[i]:cu_q_lens[i+1])
    written at positions lengths[i] - q_len ... lengths[i] - 1, each attending causally over its prefix."""
    page = k_pages.shape[1]
    cu = np.asarray(cu_q_lens)
    outs = []
    for i, length in enumerate(np.asarray(lengths)):
        rows = slice(int(cu[i]), int(cu[i + 1]))
        pos = np.arange(length - (cu[i + 1] - cu[i]), length)
        pid = np.asarray(table)[i, pos // page]
        k_pages = k_pages.at[pid, pos % page].set(new_k[rows])
        v_pages = v_pages.at[pid, pos % page].set(new_v[rows])
        pages = np.asarray(table)[i, :-(-length // page)]
        dense = lambda p: jnp.moveaxis(p[pages].reshape(-1, p.shape[2], p.shape[3])[:length], 1, 0)[None]  # noqa: E731
        qi = jnp.moveaxis(q[rows], 1, 0)[None]  # [1, Hq, q_len, D]: causal aligned to the end
        outs.append(jnp.moveaxis(attention_reference(qi, dense(k_pages), dense(v_pages), scale)[0], 0, 1))
    return jnp.concatenate(outs)


def _mixed_check(m: Model, page: int) -> Check:
    hq, hkv, d = m.q_heads // m.kv_heads, 1, m.head_dim
    lengths = np.array([37, 200, 16, 150, 97], np.int32)
    q_lens = np.array([1, 1, 1, 20, 33])  # three decode sequences, then two prefill chunks
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    table, total = paged_table(lengths, page, seed=5, multiple=max(1, 128 // page))
    rng = np.random.default_rng(6)
    q = jnp.asarray(rng.standard_normal((cu[-1], hq, d)), BF16)
    new_k, new_v = (jnp.asarray(rng.standard_normal((cu[-1], hkv, d)), BF16) for _ in range(2))
    kp, vp = (jnp.asarray(rng.standard_normal((total, page, hkv, d)), BF16) for _ in range(2))
    scale = 1 / math.sqrt(d)
    args = (q, new_k, new_v, kp, vp, jnp.asarray(lengths), jnp.asarray(table))
    return Check(args, {"scale": scale, "cu_q_lens": tuple(int(x) for x in cu)},
                 ragged_reference(*args, cu, scale),
                 f"{len(lengths)} seqs of {', '.join(map(str, lengths))} tokens with {', '.join(map(str, q_lens))} new, "
                 f"{hq} q / {hkv} kv heads, page {page}", 2e-2)


def mixed_problem(m: Model, decode: int, chunks: int, chunk: int, page: int) -> Problem:
    """One step of a mixed batch: ``decode`` sequences with one new token, then ``chunks`` prefill chunks
    of ``chunk`` new tokens each; write the new K/V, then attend."""
    hq, hkv, d = m.q_heads, m.kv_heads, m.head_dim
    batch = decode + chunks
    lengths = np.random.default_rng(1000 + batch).integers(*DECODE_CONTEXT, size=batch, endpoint=True).astype(np.int32)
    q_lens = np.array([1] * decode + [chunk] * chunks)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    tokens = int(cu[-1])
    table, total = paged_table(lengths, page, seed=batch, multiple=max(1, 128 // page))
    ctx = int(lengths.sum())
    cache = sds((total, page, hkv, d))
    keys_seen = int(sum(ql * (length - ql) + ql * (ql + 1) // 2 for ql, length in zip(q_lens, lengths)))
    return Problem(
        "decode", m.name, f"{m.short} mixed {decode} decode + {chunks}x{chunk} prefill page {page}",
        {"batch": batch, "decode": decode, "prefill_chunks": chunks, "chunk": chunk, "new_tokens": tokens,
         "context_tokens": ctx, "context_min": int(lengths.min()), "context_max": int(lengths.max()), "page": page,
         "q_heads": hq, "kv_heads": hkv, "head_dim": d, "format": "bf16"},
        (sds((tokens, hq, d)), sds((tokens, hkv, d)), sds((tokens, hkv, d)), cache, cache, jnp.asarray(lengths),
         jnp.asarray(table)), {"scale": 1 / math.sqrt(d), "cu_q_lens": tuple(int(x) for x in cu)},
        min_bytes=2 * hkv * ctx * d * 2 + 2 * (2 * tokens * hq * d + 2 * tokens * hkv * d),
        min_flops=4 * hq * d * keys_seen,
        check=functools.partial(_mixed_check, m, page), check_key=("mixed", hq // hkv, d, page),
        recipe=("mixed", dataclasses.asdict(m), decode, chunks, chunk, page))


def problems(models=MODELS, families=("moe", "prefill", "decode", "train")) -> list[Problem]:
    out = []
    for m in models:
        if "moe" in families:
            out += [moe_problem(m, t) for t in m.moe_tokens] + [moe_problem(m, t, f) for f, t in m.quantized_moe]
        if "prefill" in families:
            out += [prefill_problem(m, t) for t in m.prefill_tokens]
        if "decode" in families:
            out += [decode_problem(m, b, p, context=c[0] if c else None) for b, p, *c in m.decode]
            out += [decode_problem(m, b, p, f) for f, b, p in m.quantized_decode]
            out += [mixed_problem(m, *spec) for spec in MIXED.get(m.name, ())]
        if "train" in families:
            out += [train_problem(m, t) for t in m.prefill_tokens]
    return out


_BUILDERS = {"moe": moe_problem, "prefill": prefill_problem, "decode": decode_problem, "mixed": mixed_problem,
             "train": train_problem}


def rebuild(recipe) -> Problem:
    """The problem a ``Problem.recipe`` describes (how a compile worker gets it)."""
    kind, model, *args = recipe
    model = Model(**{k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
                     for k, v in model.items()})
    return _BUILDERS[kind](model, *args)


def signature(problem: Problem) -> list:
    """What a compile of the problem depends on: shapes, dtypes and static arguments."""
    leaves = [(tuple(a.shape), str(a.dtype)) for a in problem.args]
    return [problem.name, leaves, sorted((k, repr(v)) for k, v in problem.kwargs.items())]
