"""The benchmark's problems: whole layers at real model shapes, with a reduced case to check numerics.

Three layers (DESIGN.md "Shapes that matter"):

* ``moe``: one MoE experts layer given the router's top-k (hidden [T, H], top-k ids and weights,
  gate_up [E, 2I, H], down [E, H, I] in transformers' layout, and the router logits [T, E] for
  kernels that route themselves: vLLM TPU's fused_moe) -> [T, H]. Routing is softmax top-k of
  seeded random logits, renormalised (Qwen3's ``norm_topk_prob``).
* ``prefill``: causal self-attention, q [1, Hq, S, D], k/v [1, Hkv, S, D] -> [1, Hq, S, D].
* ``decode``: one decode step of a continuous batch: write each sequence's new K/V into the paged
  cache (in place), then attend over its context (the new token included). Context lengths are
  seeded uniform in ``DECODE_CONTEXT``; pages of ``page`` tokens scattered at random over one pool.

Bulk data is abstract (ShapeDtypeStructs); what steers the kernels (routing, lengths, page tables)
is concrete, so the cost model follows the real control flow. ``min_bytes``/``min_flops`` are the
least any implementation must move and compute: the ideal time is their roofline.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

from .. import verify  # noqa: F401  (CPU-only JAX set-up before jax loads)

import jax  # noqa: E402
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
    q_heads: int
    kv_heads: int
    head_dim: int
    short: str = ""
    moe_tokens: tuple = (1, 8, 64, 256, 2048, 8192)  # decode batches and prefill lengths
    prefill_tokens: tuple = (2048, 8192)
    decode: tuple = ((1, 16), (8, 16), (64, 16), (256, 16), (64, 128))  # (batch, page size)


# transformers' Qwen3MoeConfig for Qwen/Qwen3-30B-A3B (checked against its config.json fields)
QWEN3_30B_A3B = Model("Qwen3-30B-A3B", hidden=2048, experts=128, top_k=8, moe_intermediate=768,
                      q_heads=32, kv_heads=4, head_dim=128, short="Qwen3")
# openai/gpt-oss-20b's config.json shapes (its experts are computed here as SiLU-gated, unbiased, as
# for Qwen3, by every implementation); fewer shapes, to keep the run short.
GPT_OSS_20B = Model("GPT-OSS-20B", hidden=2880, experts=32, top_k=4, moe_intermediate=2880,
                    q_heads=64, kv_heads=8, head_dim=64, short="GPT-OSS",
                    moe_tokens=(1, 64, 256, 2048), prefill_tokens=(2048,), decode=((1, 16), (64, 16)))
MODELS = (QWEN3_30B_A3B, GPT_OSS_20B)
DECODE_CONTEXT = (1024, 4096)  # each sequence's context length, uniform in this range (seeded)


@dataclasses.dataclass
class Check:
    args: tuple
    kwargs: dict
    reference: Any
    shape: str
    tol: float  # max |err| / max |reference|


@dataclasses.dataclass
class Problem:
    family: str  # "moe" | "prefill" | "decode"
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


def _moe_check(tokens: int) -> Check:
    e, top_k, h, i = 8, 2, 256, 128
    logits, ids, w = routing(tokens, e, top_k, seed=tokens)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((tokens, h)), BF16)
    gate_up = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / math.sqrt(h), BF16)
    down = jnp.asarray(rng.standard_normal((e, h, i)) / math.sqrt(i), BF16)
    args = (x, jnp.asarray(ids), jnp.asarray(w), gate_up, down)
    return Check(args + (jnp.asarray(logits),), {"top_k": top_k}, moe_reference(*args),
                 f"{tokens} tokens x top-{top_k} of {e} experts, hidden {h}, intermediate {i}", 2e-2)


def moe_problem(m: Model, tokens: int) -> Problem:
    h, e, k, i = m.hidden, m.experts, m.top_k, m.moe_intermediate
    logits, ids, w = routing(tokens, e, k, seed=tokens)
    active = int(len(np.unique(ids)))
    ct = min(tokens, 16)
    weights = active * 3 * h * i * 2
    return Problem(
        "moe", m.name, f"{m.short} MoE layer T={tokens}",
        {"tokens": tokens, "hidden": h, "experts": e, "top_k": k, "intermediate": i, "active_experts": active},
        (sds((tokens, h)), jnp.asarray(ids), sds((tokens, k), jnp.float32), sds((e, 2 * i, h)), sds((e, h, i)),
         jnp.asarray(logits)), {"top_k": k},
        min_bytes=weights + 2 * tokens * h * 2 + tokens * k * 8, min_flops=2 * tokens * k * 3 * h * i,
        check=functools.partial(_moe_check, ct), check_key=("moe", ct), recipe=("moe", dataclasses.asdict(m), tokens))


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


def _decode_check(m: Model, batch: int, page: int) -> Check:
    hq, hkv, d = m.q_heads // m.kv_heads, 1, m.head_dim
    lengths = np.array([37, 200, 129, 16][:batch], np.int32)
    table, total = paged_table(lengths, page, seed=3, multiple=max(1, 128 // page))
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), BF16)
    new_k, new_v = (jnp.asarray(rng.standard_normal((batch, hkv, d)), BF16) for _ in range(2))
    kp, vp = (jnp.asarray(rng.standard_normal((total, page, hkv, d)), BF16) for _ in range(2))
    scale = 1 / math.sqrt(d)
    args = (q, new_k, new_v, kp, vp, jnp.asarray(lengths), jnp.asarray(table))
    return Check(args, {"scale": scale}, decode_reference(*args, scale),
                 f"{batch} seqs of {', '.join(map(str, lengths))} tokens, {hq} q / {hkv} kv heads, page {page}", 2e-2)


def decode_problem(m: Model, batch: int, page: int) -> Problem:
    hq, hkv, d = m.q_heads, m.kv_heads, m.head_dim
    lengths = np.random.default_rng(batch).integers(*DECODE_CONTEXT, size=batch, endpoint=True).astype(np.int32)
    table, total = paged_table(lengths, page, seed=batch, multiple=max(1, 128 // page))
    ctx = int(lengths.sum())
    cb = min(batch, 4)
    return Problem(
        "decode", m.name, f"{m.short} decode B={batch} page {page}",
        {"batch": batch, "context_tokens": ctx, "context_min": int(lengths.min()), "context_max": int(lengths.max()),
         "page": page, "q_heads": hq, "kv_heads": hkv, "head_dim": d},
        (sds((batch, hq, d)), sds((batch, hkv, d)), sds((batch, hkv, d)), sds((total, page, hkv, d)),
         sds((total, page, hkv, d)), jnp.asarray(lengths), jnp.asarray(table)), {"scale": 1 / math.sqrt(d)},
        min_bytes=2 * (2 * hkv * ctx * d + 2 * batch * hq * d + 2 * batch * hkv * d), min_flops=4 * hq * d * ctx,
        check=functools.partial(_decode_check, m, cb, page), check_key=("decode", cb, hq // hkv, d, page),
        recipe=("decode", dataclasses.asdict(m), batch, page))


def problems(models=MODELS, families=("moe", "prefill", "decode")) -> list[Problem]:
    out = []
    for m in models:
        if "moe" in families:
            out += [moe_problem(m, t) for t in m.moe_tokens]
        if "prefill" in families:
            out += [prefill_problem(m, t) for t in m.prefill_tokens]
        if "decode" in families:
            out += [decode_problem(m, b, p) for b, p in m.decode]
    return out


_BUILDERS = {"moe": moe_problem, "prefill": prefill_problem, "decode": decode_problem}


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
