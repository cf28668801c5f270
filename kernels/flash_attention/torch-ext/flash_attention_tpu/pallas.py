"""Flash attention for TPU in Pallas: forward (output + log-sum-exp) and backward (dq, dk, dv, dsinks).

Layout: q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D], Hq = G * Hkv. q is viewed (for free) as
[B, Hkv, G, Sq, D], so one q block holds all G heads of a KV group: each K/V block is fetched once
per group and used G times (GQA/MQA without repeating K/V anywhere).

Which keys a query sees is described per sequence by three integers (``seq`` [B, 3]):
``kv_start`` (left padding: keys before it are masked), ``kv_end`` (keys from it on are padding)
and ``q_len`` (query rows from it on are padding and give 0). Queries are the last ``q_len``
tokens of the sequence, so query row i sits at position ``kv_end - q_len + i`` (causal is
bottom-right aligned: decode and chunked prefill). Causal, sliding window, soft-cap and sinks
follow transformers (see _attention_math). An arbitrary boolean mask [B, Sq, Sk] can be given as
well; its blocks are then read and applied on top.

Work is scheduled, not swept: from ``seq`` and the static mask kind, the wrapper lists, for every
q block, the contiguous run of KV blocks it needs, and the grid walks that list (scalar-prefetched
tables). Fully masked blocks are therefore neither computed nor fetched nor even stepped over;
a q block that needs nothing gets one step that writes zeros. The list length is static: the
largest the shapes and mask kind allow (``_max_items``), padded with no-op steps that repeat the
previous block indices (no DMA). Within a step, K/V blocks (long, for few steps) are computed in
tiles of bq keys, and tiles no row of the q block sees are skipped; the causal diagonal's tile goes in
slabs of queries, each against the keys up to its last one (``DIAGONAL_SLAB``).

Forward layout: with q blocks of whole lane tiles (prefill) the forward works keys-major, scores
transposed [keys, queries] (``am.online_softmax_step_keys_major``): the per-query max is a
lane-dense row reduced over sublanes (no cross-lane reductions or broadcasts), P @ V is computed
as V^T @ P^T, whose 512-wide output fills a 256-wide MXU where head_dim 128 would fill half, and
ones rows below V^T make the MXU sum the softmax denominator. With a head dim off the lane grid
(64), whose [.., S, D] arrays XLA:TPU keeps with S minor, it reads q, K, V and writes its output as
[.., D, S] views of them (``_d_major``). Short q blocks (decode) keep queries on sublanes. Logits
are kept in base 2 (exp2; TPUs compute exp as exp2 of a product anyway), exp in f32 on every chip: on
v6e, whose EUP also takes bf16, the f32 exp's schedule is the shorter one (cost model, layer us bf16 ->
f32 exp: Qwen3 8k 1790.9 -> 1717.7, Qwen3-235B 8k 3505.6 -> 3340.9, Gemma-3 8k 547.0 -> 531.9, every
prefill row 2.3-4.7% faster).

The forward's log-sum-exp (a training residual) leaves the kernel as lane-dense rows [..., 1, Sq]
(keys-major) or lane-broadcast [..., 128] (short blocks) and becomes [B, Hq, Sq]; the backward
reads it, and dO.O, lane-dense in rows. The backward works in the forward's layout: keys-major for prefill
blocks (head dim 64 on the same [.., D, S] views, dO and the gradients too), short q blocks row-major; the key
tiles every row sees whole run unmasked in a loop of their own, the causal diagonal's in slabs (keys-major), as
the forward's (without its aligned-triangle shortcut, tile pairs or longer K/V blocks).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _attention_math as am
from ._bridge import check_array, dtype_name, host_values
from ._chips import tpu_generation

DTYPES = ("float32", "bfloat16")
HEAD_DIMS = (64, 128, 256)
LANES = 128
COMPUTE, FIRST, LAST = 1, 2, 4  # schedule flags

# Per-chip defaults: (block_q, block_k, block_k for decode-sized q, vmem_limit_bytes). Blocks are
# multiples of 128 (256-wide MXUs on v6e/TPU7x); a q block carries all G heads of a KV group, so
# rows = G * block_q. Chosen with the cost model v2 (benchmarks/): larger blocks amortise the per-step
# overhead and each q block re-reads K/V less. 1024 x 2048 against 512 x 512-1024 at 8k causal: Qwen3
# (d 128) 4703 -> 4015 us on v5e, 2484 -> 1954 on v6e, 1771 -> 1460 on TPU7x; Gemma-3 (d 256) 3598
# -> 3279 on v5e; 2048 x 2048 loses and overflows VMEM at GQA 16:1. 1024 x 4096 on v6e and TPU7x (at
# 81447d8, 8k causal, v6e / TPU7x): Qwen3 1717.7 / 1326.2 -> 1693.6 / 1304.4 us, Qwen3-235B 3340.9 /
# 2567.9 -> 3310.8 / 2541.3, Gemma-3 531.9 / 408.5 -> 512.1 / 391.2; 2k rows unchanged (one K/V block).
# Decode steps are pure K/V streaming, so they take the longest K/V blocks (TPU7x's HBM is fastest,
# so its steps must be longest).
CHIP_BLOCKS = {
    "v5e": (1024, 2048, 2048, 64 << 20),
    "v6e": (1024, 4096, 4096, 96 << 20),
    "tpu7x": (1024, 4096, 8192, 48 << 20),
    "": (512, 512, 2048, None),  # unknown / interpret: the compiler's default VMEM limit
}


def _heads_per_iteration(groups: int, chip: str) -> int:
    """Query heads one iteration of the keys-major head loop pipelines. v6e / TPU7x: the whole KV group
    (up to 16), one basic block the scheduler fills end to end; v5e (and unknown chips): 4 where they
    divide G, else 2, else 1. Measured with the cost model (causal prefill, layer us v5e / v6e / TPU7x):
    Qwen3 8k (G = 8) 4 heads 3836 / 1852 / 1356, 8 heads 4164 / 1791 / 1326; Qwen3-235B 8k (G = 16) 4
    heads 7555 / 3609 / 2630, 8 heads 7483 / 3561 / 2551, 16 heads (v6e / TPU7x) 3506 / 2568, at 2k 4
    heads 326.5 / 251.3, 16 heads 310.7 / 232.3. Earlier, on every chip: 2 heads in program order 4015 /
    1954 / 1460 against 4 pipelined 3836 / 1852 / 1356 (Qwen3 8k); Gemma-3 (G = 2, one trip, inlined)
    pipelined 64621 / 23766 / 21596 bundles a step against 64823 / 26374 / 22099 in program order."""
    if chip in ("v6e", "tpu7x") and groups <= 16:
        return groups
    return next((n for n in (4, 2) if groups % n == 0), 1)


def _chip_from_device() -> str:
    return tpu_generation() or ""


# --------------------------------------------------------------------------- validation

def validate(q, k, v, sinks=None, seq=None, mask=None, *, scale=None, causal=True, window=None, softcap=None,
             block_q=None, block_k=None, chip=""):
    check_array("q", q, dtypes=DTYPES, ndim=4)
    check_array("k", k, dtypes=DTYPES, ndim=4)
    check_array("v", v, dtypes=DTYPES, ndim=4)
    if not dtype_name(q) == dtype_name(k) == dtype_name(v):
        raise TypeError(f"q, k and v must share a dtype, got {dtype_name(q)}, {dtype_name(k)}, {dtype_name(v)}")
    b, hq, sq, d = q.shape
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if k.shape[0] != b:
        raise ValueError(f"q and k must have the same batch size, got {b} and {k.shape[0]}")
    if k.shape[3] != d:
        raise ValueError(f"q and k head dims differ: {d} and {k.shape[3]}")
    if d not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {d}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"the number of query heads ({hq}) must be a multiple of the number of KV heads ({hkv})")
    if sinks is not None:
        check_array("sinks", sinks, ndim=1)
        if sinks.shape[0] != hq:
            raise ValueError(f"sinks must have one value per query head ({hq}), got shape {tuple(sinks.shape)}")
    if seq is not None:
        check_array("seq", seq, dtypes=("int32", "int64"), ndim=2)
        if tuple(seq.shape) != (b, 3):
            raise ValueError(f"seq (kv_start, kv_end, q_len per sequence) must have shape {(b, 3)}, got {tuple(seq.shape)}")
        _check_seq_values(host_values(seq), sq, k.shape[2])
    if mask is not None:
        check_array("mask", mask, dtypes=("bool", "int8"), ndim=3)
        if tuple(mask.shape) != (b, sq, k.shape[2]):
            raise ValueError(f"mask must have shape {(b, sq, k.shape[2])} (batch, q_len, kv_len), got {tuple(mask.shape)}")
    if window is not None and window <= 0:
        raise ValueError(f"window must be a positive number of tokens, got {window}")
    if softcap is not None and softcap <= 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    for name, blk in (("block_q", block_q), ("block_k", block_k)):
        if blk is not None and (blk <= 0 or blk % LANES):
            raise ValueError(f"{name} must be a positive multiple of {LANES}, got {blk}")
    if chip not in CHIP_BLOCKS:
        raise ValueError(f"chip must be one of {sorted(CHIP_BLOCKS)}, got {chip!r}")


def _check_seq_values(seq, sq, sk):
    """Refuse ``seq`` values the kernel would have to clamp: 0 <= kv_start <= kv_end <= Sk and
    0 <= q_len <= Sq. Only values already on the host are read (None: on device or under jit,
    where _canonical_seq clamps them instead, without a host sync)."""
    if seq is None:
        return
    for i, (kv_start, kv_end, q_len) in enumerate(seq.astype(np.int64).tolist()):
        where = f"seq[{i}] = (kv_start={kv_start}, kv_end={kv_end}, q_len={q_len})"
        if not 0 <= kv_start <= kv_end:
            raise ValueError(f"{where}: kv_start must be in [0, kv_end]")
        if kv_end > sk:
            raise ValueError(f"{where}: kv_end exceeds the {sk} keys of k (Sk = k.shape[2])")
        if not 0 <= q_len <= sq:
            raise ValueError(f"{where}: q_len must be in [0, Sq={sq}] (Sq = q.shape[2])")


# --------------------------------------------------------------------------- scheduling

def _blocks(sq, sk, block_q, block_k, chip):
    dq, dk, dk_decode, vmem = CHIP_BLOCKS[chip]
    if sq <= 16:  # decode-sized: a step is all K/V DMA, so take longer K/V blocks (fewer steps)
        dk = dk_decode
    block_q, block_k = block_q or dq, block_k or dk
    bq = sq if sq <= block_q else block_q  # a whole (short) dimension, or a multiple of 128
    bk = sk if sk <= block_k else block_k
    return bq, bk, pl.cdiv(sq, bq), pl.cdiv(sk, bk), vmem


def _compute_tile(bq, bk):
    """Keys per compute tile (forward and backward): bq when it divides bk (diagonal waste <= bq/S), else bk."""
    return bq if bq % LANES == 0 and bk % bq == 0 else bk


def _key_ranges(kv_start, kv_end, q_len, qi, *, bq, causal, window):
    """First/last key each q block ``qi`` may see, and whether it sees any (broadcasting int arrays)."""
    i_lo = qi * bq
    i_hi = jnp.minimum(qi * bq + bq, q_len) - 1
    off = kv_end - q_len  # position of query row 0 (bottom-right alignment)
    k_lo, k_hi = kv_start, kv_end - 1
    if window is not None:
        k_lo = jnp.maximum(k_lo, off + i_lo - window + 1)
    if causal:
        k_hi = jnp.minimum(k_hi, off + i_hi)
    return k_lo, k_hi, (i_hi >= i_lo) & (k_hi >= k_lo)


def _need(seq, *, nq, nk, bq, bk, causal, window):
    """need[b, qi, kj]: does q block qi see anything of kv block kj. Each row is one contiguous run."""
    kv_start, kv_end, q_len = (seq[:, i, None, None] for i in range(3))
    qi = jnp.arange(nq)[None, :, None]
    kj = jnp.arange(nk)[None, None, :]
    k_lo, k_hi, nonempty = _key_ranges(kv_start, kv_end, q_len, qi, bq=bq, causal=causal, window=window)
    return nonempty & (kj >= k_lo // bk) & (kj <= k_hi // bk)


@functools.lru_cache(maxsize=256)
def _max_items(sq, sk, bq, bk, causal, window, transposed):
    """Static upper bound on the schedule length over every admissible ``seq``.

    Shrinking kv_end or raising kv_start never adds blocks to a causal run, so the causal count is
    maximal at kv_start=0, kv_end=Sk for a given q_len; every q_len is tried. A window run spans at
    most bq + W - 1 keys. Every outer block (q block, or kv block when transposed) gets >= 1 step.
    """
    nq, nk = -(-sq // bq), -(-sk // bk)
    q_len = np.arange(0, sq + 1)[:, None]
    qi = np.arange(nq)[None, :]
    i_lo, i_hi = qi * bq, np.minimum(qi * bq + bq, q_len) - 1
    k_hi = np.minimum(sk - 1, sk - q_len + i_hi) if causal else np.full_like(i_hi, sk - 1)
    runs = np.where(i_hi >= i_lo, np.maximum(k_hi, -1) // bk + 1, 0)  # blocks 0..k_hi // bk
    if window is not None:
        runs = np.minimum(runs, (bq + window - 2) // bk + 2)
    runs = np.minimum(runs, nk)
    if transposed:
        return int((runs.sum(1) + nk).max())
    return int(np.maximum(runs, 1).sum(1).max())


def _schedule(need, n_items):
    """Flatten need [B, R, C] (rows = outer blocks, contiguous runs) into step tables [B * n_items]:
    outer block, inner block and flags (COMPUTE, FIRST/LAST step of its outer block)."""
    b, r, c = need.shape
    cnt = need.sum(-1).astype(jnp.int32)
    start = jnp.argmax(need, -1).astype(jnp.int32)
    slots = jnp.maximum(cnt, 1)
    ends = jnp.cumsum(slots, -1)
    base = ends - slots
    t = jnp.arange(n_items, dtype=jnp.int32)
    row = jax.vmap(lambda e: jnp.searchsorted(e, t, side="right"))(ends)
    row = jnp.minimum(row, r - 1).astype(jnp.int32)
    take = lambda a: jnp.take_along_axis(a, row, axis=1)  # noqa: E731
    live = t[None] < ends[:, -1:]
    compute = live & (take(cnt) > 0)
    inner = take(start) + t[None] - take(base)
    # Steps that compute nothing repeat the last computed inner block: no new DMA.
    last_compute = jax.lax.cummax(jnp.where(compute, t[None], -1), axis=1)
    inner = jnp.where(compute, inner, jnp.take_along_axis(inner, jnp.maximum(last_compute, 0), axis=1))
    inner = jnp.where(last_compute >= 0, inner, 0)
    inner = jnp.clip(inner, 0, c - 1)
    flags = (compute * COMPUTE + (live & (t[None] == take(base))) * FIRST
             + (live & (t[None] == take(ends) - 1)) * LAST).astype(jnp.int32)
    return row.reshape(-1), inner.reshape(-1).astype(jnp.int32), flags.reshape(-1)


def _tables(seq, b, sq, sk, grids, *, nq, nk, bq, bk, causal, window):
    """The kernels' scalar-prefetched tables: the canonical ``seq`` [B * 3] and, per (n_items, transposed) of
    ``grids``, step tables (``_schedule``; kv blocks outer when transposed), all from one ``_need``. Without
    ``seq`` (every sequence whole: a plain prefill) they depend on shapes alone and are worked out while
    tracing: constants of the program, no XLA ops before the kernels."""
    with jax.ensure_compile_time_eval() if seq is None else contextlib.nullcontext():
        seq = _canonical_seq(seq, b, sq, sk)
        need = _need(seq, nq=nq, nk=nk, bq=bq, bk=bk, causal=causal, window=window)
        return seq.reshape(-1), [_schedule(jnp.swapaxes(need, 1, 2) if transposed else need, n)
                                 for n, transposed in grids]


# --------------------------------------------------------------------------- kernels

def _positions(seq_ref, b, row0, col0, *, rows, cols, causal, window, mask=None, keys_major=False):
    """ok [rows, cols] (``keys_major``: [cols, rows]): which (query row, key) pairs of the tile at
    (row0, col0) of sequence b may attend."""
    kv_start, kv_end, q_len = seq_ref[3 * b], seq_ref[3 * b + 1], seq_ref[3 * b + 2]
    r_axis, k_axis = (1, 0) if keys_major else (0, 1)
    r = row0 + jax.lax.broadcasted_iota(jnp.int32, (1, rows) if keys_major else (rows, 1), r_axis)
    k_pos = col0 + jax.lax.broadcasted_iota(jnp.int32, (cols, 1) if keys_major else (1, cols), k_axis)
    q_pos = kv_end - q_len + r
    row_ok, key_ok = r < q_len, (k_pos >= kv_start) & (k_pos < kv_end)
    if causal:  # padding folded into the positions (vectors): one compare per pair tests everything
        ok = am.allowed(jnp.where(row_ok, q_pos, -_FAR), jnp.where(key_ok, k_pos, _FAR), causal=True, window=window)
    else:
        ok = am.allowed(q_pos, k_pos, causal=False, window=window) & row_ok & key_ok
    if mask is not None:  # given [rows, cols]
        ok = ok & ((mask.astype(jnp.int32).T if keys_major else mask) != 0)
    return ok


_FAR = 1 << 30  # a position no query or key reaches (a padded one is moved there)


def _tile_needed(seq_ref, b, qi, col0, cols, *, bq, causal, window):
    """Does q block qi see any key in [col0, col0 + cols) (scalar; same rule as the schedule)."""
    kv_start, kv_end, q_len = seq_ref[3 * b], seq_ref[3 * b + 1], seq_ref[3 * b + 2]
    k_lo, k_hi, nonempty = _key_ranges(kv_start, kv_end, q_len, qi, bq=bq, causal=causal, window=window)
    return nonempty & (col0 <= k_hi) & (col0 + cols > k_lo)


def _floor_div(a, n: int):
    """floor(a / n) of an int32 scalar for a static n > 0 (lax.div rounds towards zero)."""
    return jax.lax.div(a - jnp.where(a < 0, n - 1, 0), jnp.int32(n))


def _full_tiles(seq_ref, b, qi, col0, n, cols, *, bq, causal, window):
    """(lo, hi), lo <= hi: the tiles c in [lo, hi) of the n tiles of ``cols`` keys from key col0 whose every key
    every row of q block qi sees (no mask to apply; scalars). Each bound on the tile's keys is an interval in c:
    keys from kv_start, before kv_end, up to row_lo's position (causal), after row_hi's window."""
    kv_start, kv_end, q_len = seq_ref[3 * b], seq_ref[3 * b + 1], seq_ref[3 * b + 2]
    row_lo, row_hi = qi * bq, qi * bq + bq - 1
    off = kv_end - q_len  # position of query row 0
    lo = jnp.maximum(0, -_floor_div(col0 - kv_start, cols))  # col0 + c cols >= kv_start
    hi = jnp.minimum(n, _floor_div(kv_end - col0, cols))  # col0 + (c + 1) cols <= kv_end
    if causal:  # col0 + (c + 1) cols - 1 <= off + row_lo
        hi = jnp.minimum(hi, _floor_div(off + row_lo + 1 - col0, cols))
    if window is not None:  # col0 + c cols > off + row_hi - window
        lo = jnp.maximum(lo, _floor_div(off + row_hi - window - col0, cols) + 1)
    return lo, jnp.where(row_hi < q_len, jnp.maximum(lo, hi), lo)


# The causal diagonal's tile in slabs of DIAGONAL_SLAB queries (keys-major, bkc = bq): slab s computes only
# against the tile's first (s + 1) * DIAGONAL_SLAB keys, so most of the upper triangle, which the whole tile
# computed and then masked away, is skipped: 3/8 of the tile's MXU work at 4 slabs of 1024 queries. Cost
# model (layer us, v5e / v6e / TPU7x, at 1024 x 4096 blocks on v6e and TPU7x): Qwen3 2k 334.1 / 155.4 /
# 123.7 -> 266.4 / 128.8 / 102.4, 8k 3836.3 / 1693.6 / 1304.4 -> 3586.5 / 1666.9 / 1270.9; Gemma-3 (d 256)
# 2k 144.9 / 52.7 / 43.9 -> 111.6 / 45.5 / 38.2, 8k 1664.8 / 512.1 / 391.2 -> 1531.7 / 513.9 / 385.8.
# An aligned diagonal (its first key at the block's first query's position, no padding in it: every q block of a
# whole causal prefill) needs no positions: each slab sees every key before its own last DIAGONAL_SLAB, which
# takes the static causal triangle (``_diagonal_aligned``). Cost model, layer us (v6e / TPU7x, at the ring
# below with q scaled, tiles unrolled): Qwen3 8k 1405.2 / 1093.1 -> 1380.1 / 1076.0.
DIAGONAL_SLAB = 256

# Keys-major, each item's logits are written to a ring of tiles in VMEM scratch, up to SCORES_AHEAD items ahead
# of its softmax step, which reads them back. As values, a tile of logits (1024 x 1024 f32: 1024 vregs) is the
# compiler's to spill, and it spilled each stage of the step (the dots, scaled, minus the max, their exp2) to VMEM
# and back: v6e, Qwen3 8k, an unmasked tile for 8 heads issued 18630 bundles, 3.0 stores and 3.4 loads a vreg of
# logits (2 store slots a bundle: 12270 bundles of stores) for 3200 vmatmuls (12800 MXU cycles). The ring holds
# the unscaled dots: the scale joins the exp2's argument (``t_scale``), no pass of its own. Scaling q instead
# (rounded to bf16) ran 3.5% faster but doubled the error of bf16 outputs (mean 0.0007 -> 0.0015, max 0.009 ->
# 0.030 at logits of std 4); 3 ahead gained under 1.5%. Cost model, layer us (v5e / v6e / TPU7x), the ring with
# the aligned diagonal and the key-tile loop: Qwen3 2k 266.4 / 128.8 / 102.4 -> 229.9 / 115.4 / 94.2, 8k 3586.5 /
# 1666.9 / 1270.9 -> 3179.1 / 1450.3 / 1134.8; Qwen3-235B 8k 7022.9 / 3272.4 / 2471.0 -> 6268.1 / 2837.5 / 2329.0
# (TPU7x: a ring of 2); Gemma-3 (G = 2, d 256) 8k 1531.7 / 513.9 / 385.8 -> 1541.3 / 483.4 / 372.8.
SCORES_AHEAD = 2
# The ring has SCORES_AHEAD + 1 slots where they fit in the VMEM limit beside the blocks and scratch with
# VMEM_HEADROOM left for the compiler's own, else 2 (one item ahead). Measured: Qwen3-235B 2k on TPU7x (G = 16,
# 1024 x 2048 blocks, bf16, 3 slots): 39.5 MiB of blocks and scratch, the compiler asked for 49.0 MiB.
VMEM_HEADROOM = 12 << 20
DEFAULT_SCOPED_VMEM = 16 << 20  # the compiler's default limit where the chip sets none (v5e's, the smallest)


def _keys_major_fits(g, bq, bk, d, itemsize, vmem, slots):
    """Whether a keys-major forward of q blocks of g x bq rows, K/V blocks of bk and a logits ring of ``slots``
    fits the VMEM limit with VMEM_HEADROOM to spare."""
    blocks = 2 * (2 * g * bq + 2 * bk) * d * itemsize  # q, out, k and v, double-buffered
    scratch = 4 * g * bq * (8 + d + am.ONES_ROWS)  # the running max (a sublane tile a head) and acc, f32
    ring = slots * 4 * _compute_tile(bq, bk) * bq
    return blocks + scratch + ring + VMEM_HEADROOM <= (vmem or DEFAULT_SCOPED_VMEM)


def _ring_slots(g, bq, bk, d, itemsize, vmem):
    """Slots of the keys-major logits ring (``SCORES_AHEAD``) for q blocks of g x bq rows and K/V blocks of bk."""
    return SCORES_AHEAD + 1 if _keys_major_fits(g, bq, bk, d, itemsize, vmem, SCORES_AHEAD + 1) else 2


# A causal or full prefill with no window and no mask runs each q block against a contiguous run of K/V blocks
# from the first key; the forward takes them LONG_BLOCK_K keys long where the sequence has that many and they fit
# VMEM beside a ring of 2 or more slots (the backward keeps the chip's block_k). Fewer steps, and consecutive
# q blocks of a head share the one K/V block: cost model, 8k causal, layer us (4096 -> 8192 keys, v6e / TPU7x):
# Qwen3 1450.3 / 1134.8 -> 1434.5 / 1120.8, Gemma-3 483.4 / 372.8 -> 481.1 / 362.3, Qwen3-235B (G = 16) v6e
# 2837.5 -> 2814.1 (on TPU7x its 8192-key blocks overflow the VMEM limit: it keeps 4096). A window's run is
# short, so longer blocks would only fetch keys it does not see; a mask's blocks grow with them.
LONG_BLOCK_K = 8192


def _forward_blocks(sq, sk, g, d, itemsize, *, block_q, block_k, chip, window, has_mask):
    """``_blocks`` of the forward: K/V blocks of LONG_BLOCK_K keys where they pay and fit (above)."""
    bq, bk, nq, nk, vmem = _blocks(sq, sk, block_q, block_k, chip)
    long = LONG_BLOCK_K
    if (chip and block_k is None and window is None and not has_mask and _keys_major(bq) and bk < long <= sk
            and long % bq == 0 and _keys_major_fits(g, bq, long, d, itemsize, vmem, 2)):
        bk, nk = long, pl.cdiv(sk, long)
    return bq, bk, nq, nk, vmem


def _diagonal_slabs(bq, bkc, causal):
    """Slabs of the causal diagonal's tile, or 0 where it is computed whole: causal keys-major q blocks of
    two slabs or more, in tiles of bq keys."""
    n = bq // DIAGONAL_SLAB
    return n if causal and _keys_major(bq) and bkc == bq and bq % DIAGONAL_SLAB == 0 and n > 1 else 0


def _tile_on_diagonal(seq_ref, b, qi, col0, *, bq):
    """Does the tile at key col0 start at or after the position of q block qi's first query (scalar): then
    (causal) the queries of slab s see none of its keys from (s + 1) * DIAGONAL_SLAB on."""
    kv_end, q_len = seq_ref[3 * b + 1], seq_ref[3 * b + 2]
    return col0 >= kv_end - q_len + qi * bq


def _diagonal_aligned(seq_ref, b, qi, col0, *, bq):
    """Is the diagonal's tile at key col0 (bq keys) aligned with q block qi (scalar): its first key at the
    block's first query's position, all of its keys and queries real. Then causality alone masks it, and
    only within each slab's last block of keys (the triangle)."""
    kv_start, kv_end, q_len = seq_ref[3 * b], seq_ref[3 * b + 1], seq_ref[3 * b + 2]
    return ((col0 == kv_end - q_len + qi * bq) & (col0 >= kv_start) & (col0 + bq <= kv_end)
            & (qi * bq + bq <= q_len))


def _zero_past(x, start, n, ragged, axis=0):
    """x holding positions start.. of a length-n axis along ``axis`` (the rows of a [size, D] block, the
    columns of a [D, size] one), those past n zeroed when ``ragged``: a ragged last block holds stale memory,
    and a NaN there would survive a zero weight (0 * NaN)."""
    if ragged:
        shape = (x.shape[0], 1) if axis == 0 else (1, x.shape[1])
        pos = start + jax.lax.broadcasted_iota(jnp.int32, shape, axis)
        x = jnp.where(pos < n, x, jnp.zeros_like(x))
    return x


def _keys_major(bq):
    """Layout (forward and backward): q blocks of whole lane tiles (prefill) hold queries on lanes and keys on
    sublanes (``am.online_softmax_step_keys_major``); short ones (decode) keep queries on sublanes."""
    return bq % LANES == 0


def _d_major(bq, d):
    """Whether the kernels take q, k, v (and dO) and give their results as [.., d, S] views: q blocks of whole
    lane tiles (``_keys_major``) and a head dim off the lane grid (64), whose [.., S, d] arrays XLA:TPU lays out
    with S minor (lane-dense). The views are bitcasts, where [.., S, d] blocks took a relayout copy of each
    array in and out (and padded d to 128 lanes in VMEM). Keys-major, the forward wants q and V transposed
    anyway (scores K Q^T, V^T P^T): K is the block it transposes, where V and each head's output were; the
    backward transposes K and V once a tile (K Q^T, V dO^T) and takes dQ^T = K^T dS^T, dK^T = Q^T dS, dV^T =
    dO^T P as the blocks hold them. Compiled for v6e, GPT-OSS-20B 2k causal: the forward's unmasked tiles'
    loop 14750 -> 14787 bundles, the masked ones' 44549 -> 41777 (TPU7x 14764 -> 14219, 42109 -> 40737);
    layer us v5e / v6e / TPU7x 415.4 / 254.0 / 185.3 -> 335.6 / 191.3 / 151.1 (XLA's glue 53.6 / 46.9 / 23.9
    -> 1.1 / 1.1 / 3.2). Its gradient program: 7 copies (56 MiB) -> none, a tile's heads' loop dq 4923 ->
    4312 bundles, dk and dv 6789 -> 5312 (MXU pushes 384 -> 288, 512 -> 320: d no longer padded)."""
    return _keys_major(bq) and d % LANES != 0


def _view(x, d_major):
    """An operand x [.., S, D] as the kernels take it, or a result as they give it, back: [.., D, S] when
    ``d_major`` (a bitcast in the layout XLA:TPU gives a head dim of 64)."""
    return jnp.swapaxes(x, -1, -2) if d_major else x


def _block(rows, d, d_major):
    """The last two dims of a block of ``rows`` positions of a ``_view``."""
    return (d, rows) if d_major else (rows, d)


def _at(index, d_major):
    """Block ``index`` (along the positions) of a ``_view``: its block indices in the last two dims."""
    return (0, index) if d_major else (index, 0)


def _fwd_kernel(outer_ref, inner_ref, flags_ref, seq_ref, *refs, n_items, groups, bq, bk, bkc, sk, d, scale, causal,
                window, softcap, has_sinks, has_mask, with_lse, heads_per_iteration, d_major):
    refs = list(refs)
    sinks_ref = refs.pop(0) if has_sinks else None
    q_ref, k_ref, v_ref = refs[:3]
    refs = refs[3:]
    mask_ref = refs.pop(0) if has_mask else None
    o_ref = refs.pop(0)
    lse_ref = refs.pop(0) if with_lse else None
    keys_major = _keys_major(bq)
    if keys_major:
        m_sc, acc_sc, s_sc = refs
        l_sc = None
    else:
        m_sc, l_sc, acc_sc = refs
    b, h, t = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    step = b * n_items + t
    qi, kj, flags = outer_ref[step], inner_ref[step], flags_ref[step]

    @pl.when((flags & FIRST) != 0)
    def _init():
        m_sc[...] = jnp.full(m_sc.shape, am.MASK_VALUE, jnp.float32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)
        if l_sc is not None:
            l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)

    # K/V blocks are big (few steps, long DMAs) but computed in tiles of bkc keys, skipping tiles no
    # row of this q block sees: the causal diagonal then wastes at most one bq x bkc tile per q block
    # (keys-major, a little of it: its slabs, ``DIAGONAL_SLAB``).
    # Only tiles that some (row, key) pair of cannot attend build and apply a mask (the diagonal, the
    # padding edges, a given mask); the others, most of a long prefill, run the unmasked body.
    # The tiles are loops, not unrolled: each kind of tile is compiled once, not once per tile of the block
    # (compile seconds for 8k causal on v6e, Qwen3 ~100 -> 40, Qwen3-235B ~250 -> 90).
    def compute(c, masked, slabs=0, triangle=False):
        """Tile c's work: unmasked, ``masked`` (its positions' mask), or (``triangle``, an aligned
        diagonal's slabs) each slab's last ``size`` keys masked by the causal triangle alone."""
        col0 = kj * bk + c * bkc
        tile = pl.ds(pl.multiple_of(c * bkc, bkc), bkc)
        # a head's work comes in items: its whole q block against the tile, or (``slabs``, the diagonal's
        # tile) slab n of it, queries [n size, (n + 1) size) against the tile's first keys(n) keys
        size = bq // slabs if slabs else bq
        keys = lambda n: (n + 1) * size if slabs else bkc  # noqa: E731

        def positions(n=0):
            if not masked:
                return None
            return _positions(seq_ref, b, qi * bq + n * size, col0, rows=size, cols=keys(n), causal=causal,
                              window=window, mask=None if mask_ref is None else mask_ref[:, tile],
                              keys_major=keys_major)

        # keys-major: the mask is two vectors and a compare, cheaper to redo per head than to keep
        # a tile-sized mask in VMEM and reload it; row-major (short rows): built once per tile
        ok = None if keys_major else positions()
        ragged = masked and sk % bk != 0  # a full tile lies inside Sk
        if d_major:  # K^T, V^T blocks
            k, vt = k_ref[:, tile].T, _zero_past(v_ref[:, tile], col0, sk, ragged, axis=1)
        else:
            k, v = k_ref[tile, :], _zero_past(v_ref[tile, :], col0, sk, ragged)
            vt = v.T if keys_major else None
        if keys_major:  # V^T and ones rows (the MXU sums the denominator), shared by the G heads
            vt = jnp.concatenate([vt, jnp.ones((am.ONES_ROWS, bkc), vt.dtype)], axis=0)

        # The G query heads of this KV group share the K/V tile. Keys-major, the items of `per` heads an
        # iteration as a software pipeline: item x + ahead's scores are issued before item x's softmax step,
        # so the scheduler runs some items' matmuls under another's vector work (one basic block).
        per = heads_per_iteration if keys_major else 1
        # the scale deferred to the step (the max of unscaled dots is the scaled max only for a positive scale)
        t_scale = scale * am.LOG2E if softcap is None and scale > 0 else 1.0

        def heads(i, carry):
            if not keys_major:  # one head an iteration
                s = am.scores(q_ref[i], k, scale=scale, softcap=softcap)
                m_sc[i], l_sc[i], acc_sc[i] = am.online_softmax_step(m_sc[i], l_sc[i], acc_sc[i], s, ok, v)
                return carry
            items = [(i * per + j, n) for j in range(per) for n in range(slabs or 1)]

            def scores(g, n):  # the unscaled dots where the step scales them (t_scale)
                q = q_ref[g, :, pl.ds(n * size, size)].T if d_major else q_ref[g, pl.ds(n * size, size), :]
                if t_scale != 1:
                    return am.dots_keys_major(k[:keys(n)], q)
                return am.scores_keys_major(k[:keys(n)], q, scale=scale, softcap=softcap)

            def issue(y):  # item y's scores into its slot of the ring
                s_sc[y % slots, :keys(items[y][1]), :size] = scores(*items[y])

            slots = s_sc.shape[0]
            for y in range(min(slots - 1, len(items))):
                issue(y)
            for x, (g, n) in enumerate(items):
                if x + slots - 1 < len(items):
                    issue(x + slots - 1)
                t = s_sc[x % slots, :keys(n), :size]
                if triangle:  # key j of the slab's last block is seen by its queries i >= j
                    tri = (jax.lax.broadcasted_iota(jnp.int32, (size, size), 0)
                           <= jax.lax.broadcasted_iota(jnp.int32, (size, size), 1))
                    diag = jnp.where(tri, t[n * size:], am.MASK_VALUE)
                    t = jnp.concatenate([t[:n * size], diag], axis=0) if n else diag
                lanes = pl.ds(n * size, size)
                m_sc[g, :, lanes], acc_sc[g, :, lanes] = am.online_softmax_step_keys_major(
                    m_sc[g, :, lanes], acc_sc[g, :, lanes], t, positions(n), vt[:, :keys(n)], t_scale=t_scale)
            return carry

        jax.lax.fori_loop(0, groups // per, heads, 0)

    # The tiles every row sees whole, a run of them (most of a long prefill), run the unmasked body in a loop of
    # their own, whose body is that tile alone; the others (the diagonal, padding edges, a given mask) build and
    # apply their mask in a second loop. In one loop, each tile tested which of four kinds it was, and the cost
    # model, which cannot tell which predicated region a step runs, charged every tile the loop's bundles per MXU
    # flop over all four: compiled for TPU7x, Gemma-3 8k, an unmasked tile's region issues 4575 bundles for 4224
    # MXU cycles and was charged 5371; its own loop issues 4553. So on a TPU this saves the per-tile dispatch
    # (some 60-80 bundles a tile), and the model's figures (layer us v6e / TPU7x, 8k causal: Qwen3 1429.4 /
    # 1115.4 -> 1292.7 / 994.0, Gemma-3 476.0 / 356.9 -> 441.3 / 320.0) move mostly as it stops overcharging.
    # Pairs: where a tile's heads are fewer than 4 items of the keys-major pipeline (Gemma-3's 2), the
    # loop takes two tiles an iteration, one basic block in which the second tile's dots overlap the first's
    # softmax: compiled for TPU7x, Gemma-3 8k, 8668 bundles for two tiles against 2 x 4553 (MXU: 2 x 4224);
    # layer us v6e / TPU7x 441.3 / 320.0 -> 424.0 / 310.6 (v5e unchanged). With 8 heads the pair lost (Qwen3 8k
    # 1292.7 / 994.0 -> 1305.0 / 998.5) and compiled in 1.6x the time.
    computes = (flags & COMPUTE) != 0
    lo = hi = 0
    if mask_ref is None:
        lo, hi = _full_tiles(seq_ref, b, qi, kj * bk, bk // bkc, bkc, bq=bq, causal=causal, window=window)

        n_full = jnp.where(computes, hi - lo, 0)
        per_iteration = 2 if keys_major and heads_per_iteration < 4 else 1  # pairs (above)

        def full_tiles(i, carry):
            for j in range(per_iteration):
                compute(lo + per_iteration * i + j, False)
            return carry

        jax.lax.fori_loop(0, jax.lax.div(n_full, per_iteration), full_tiles, 0)
        if per_iteration == 2:
            pl.when(jax.lax.rem(n_full, 2) == 1)(lambda: compute(hi - 1, False))

    def masked_tile(c, carry):
        col0 = kj * bk + c * bkc
        masked = computes & _tile_needed(seq_ref, b, qi, col0, bkc, bq=bq, causal=causal, window=window) & (
            (c < lo) | (c >= hi))
        if mask_ref is None and (slabs := _diagonal_slabs(bq, bkc, causal)):
            diagonal = _tile_on_diagonal(seq_ref, b, qi, col0, bq=bq)
            general = masked & diagonal
            if window is None:
                aligned = _diagonal_aligned(seq_ref, b, qi, col0, bq=bq)
                pl.when(general & aligned)(functools.partial(compute, c, False, slabs=slabs, triangle=True))
                general &= jnp.logical_not(aligned)
            pl.when(general)(functools.partial(compute, c, True, slabs=slabs))
            masked &= jnp.logical_not(diagonal)
        pl.when(masked)(functools.partial(compute, c, True))
        return carry

    jax.lax.fori_loop(0, bk // bkc, masked_tile, 0)

    @pl.when((flags & LAST) != 0)
    def _finalize():
        def head(g, carry):
            sink = sinks_ref[h * groups + g] if has_sinks else None
            if keys_major:
                out, lse = am.finalize_keys_major(m_sc[g], acc_sc[g], d, sink)
                out = out if d_major else out.T
            else:
                out, lse = am.finalize(m_sc[g], l_sc[g], acc_sc[g], sink)
                lse = jnp.broadcast_to(lse, (bq, LANES))
            o_ref[g] = out.astype(o_ref.dtype)
            if with_lse:
                lse_ref[g] = lse
            return carry

        jax.lax.fori_loop(0, groups, head, 0)


_NT = (((1,), (1,)), ((), ()))  # dot_general: contract both operands' last dims (a @ b^T)


def _bwd_keys(k_ref, v_ref, col0, tile, masked, *, sk, bk, d_major):
    """The key tile's K and V [bkc, D] from key col0, keys past Sk zeroed (a ``masked`` tile: a full one lies
    inside Sk); ``d_major``: K^T and V^T [D, bkc], as the blocks hold them."""
    ragged = masked and sk % bk != 0
    if d_major:
        return tuple(_zero_past(r[:, tile], col0, sk, ragged, axis=1) for r in (k_ref, v_ref))
    return tuple(_zero_past(r[tile, :], col0, sk, ragged) for r in (k_ref, v_ref))


def _bwd_tile(seq_ref, q_ref, do_ref, lse_ref, di_ref, mask_ref, k, v, b, qi, col0, tile, g, masked, n=0,
              size=None, *, bq, sq, scale, causal, window, softcap, keys_major, d_major):
    """Shared backward math for head g, q block qi and the key tile ``tile`` (keys k, v [keys, D] from key
    col0, ``_bwd_keys``): returns ds (w.r.t. the scaled logits before soft-capping) and p, [rows, keys], and head
    g's q and dO [rows, D]; ``keys_major`` (``_keys_major``): ds and p [keys, rows], and with ``d_major`` q and
    dO [D, rows] (``_d_major`` views). The rows: the q block's bq, or (``size``, keys-major) its queries [n size,
    (n + 1) size), a slab of the diagonal's tile. Unless ``masked``, every row sees every key of the tile
    (``_full_tiles``): no mask, and no rows past Sq to zero."""
    size = size or bq
    rows = pl.ds(n * size, size)
    if masked:
        ok = _positions(seq_ref, b, qi * bq + n * size, col0, rows=size, cols=k.shape[0], causal=causal,
                        window=window, mask=None if mask_ref is None else mask_ref[:, tile], keys_major=keys_major)
    axis, ragged = (1 if d_major else 0), masked and sq % bq != 0
    block = (lambda r: r[g, :, rows]) if d_major else (lambda r: r[g, rows, :])  # noqa: E731
    q = _zero_past(block(q_ref), qi * bq + n * size, sq, ragged, axis)
    do = _zero_past(block(do_ref), qi * bq + n * size, sq, ragged, axis)
    if keys_major:  # K Q^T and V dO^T; the rows' statistics [1, rows] broadcast over the keys
        kq = jax.lax.dot if d_major else functools.partial(jax.lax.dot_general, dimension_numbers=_NT)
        s = am.logits(kq(k, q, preferred_element_type=jnp.float32), scale=scale, softcap=softcap)
        lse, di = lse_ref[g, :, rows], di_ref[g, :, rows]
        dp = kq(v, do, preferred_element_type=jnp.float32)
    else:
        s = am.scores(q, k, scale=scale, softcap=softcap)
        lse, di = jnp.expand_dims(lse_ref[g][0], -1), jnp.expand_dims(di_ref[g][0], -1)
        dp = jax.lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
    if not masked:
        p = jnp.exp(s - lse)
        ds = p * (dp - di)
    else:
        p = jnp.where(ok, jnp.exp(jnp.where(ok, s, am.MASK_VALUE) - lse), 0.0)
        ds = jnp.where(ok, p * (dp - di), 0.0)  # di of a ragged block's stale rows may be NaN
    if softcap is not None:
        ds = ds * (1.0 - jnp.square(s / softcap))  # d(cap * tanh(x / cap))/dx
    return ds, p, q, do


def _for_each_tile(seq_ref, b, qi, kj, flags, *, bq, bk, bkc, causal, window, has_mask, keys_major, body):
    """Run body(col0, tile, masked, slabs) for the key tiles of K/V block kj that q block qi sees (as the forward):
    those every row sees whole (``_full_tiles``) unmasked, in a loop of their own, then the others masked, the
    causal diagonal's (keys-major) in ``slabs`` of queries, each against the keys up to its last. Cost model,
    causal training step, layer us v6e, every tile masked (unrolled) -> the unmasked tiles' loop: Qwen3 8k 8083.3
    -> 6582.5 (dq 2972.6 -> 2203.8, dK/dV 3719.9 -> 2987.9: 3.35 / 3.50 -> 2.48 / 2.81 bundles per MXU MFLOP, the
    forward's 2.54), Gemma-3 8k 2550.4 -> 2153.2 (row-major), GPT-OSS-20B 2k 1321.8 -> 1197.5; -> the diagonal in
    slabs: Qwen3 8k 6582.5 -> 6198.1, 2k 654.9 -> 550.7, GPT-OSS-20B 2k 1197.5 -> 979.6."""
    computes = (flags & COMPUTE) != 0
    lo = hi = 0

    def tile(c, masked, slabs=0):
        return body(kj * bk + c * bkc, pl.ds(pl.multiple_of(c * bkc, bkc), bkc), masked, slabs)
    if not has_mask:
        lo, hi = _full_tiles(seq_ref, b, qi, kj * bk, bk // bkc, bkc, bq=bq, causal=causal, window=window)
        jax.lax.fori_loop(lo, jnp.where(computes, hi, lo), lambda c, carry: (tile(c, False), carry)[1], 0)

    slabs = _diagonal_slabs(bq, bkc, causal) if keys_major and not has_mask else 0  # (as the forward's)

    def masked_tile(c, carry):
        col0 = kj * bk + c * bkc
        masked = computes & _tile_needed(seq_ref, b, qi, col0, bkc, bq=bq, causal=causal, window=window) & (
            (c < lo) | (c >= hi))
        if slabs:
            diagonal = _tile_on_diagonal(seq_ref, b, qi, col0, bq=bq)
            pl.when(masked & diagonal)(lambda: tile(c, True, slabs))
            masked &= jnp.logical_not(diagonal)
        pl.when(masked)(lambda: tile(c, True))
        return carry
    jax.lax.fori_loop(0, bk // bkc, masked_tile, 0)


def _dq_kernel(outer_ref, inner_ref, flags_ref, seq_ref, *refs, n_items, groups, bq, bk, bkc, sq, sk, scale, causal,
               window, softcap, has_mask, keys_major, d_major):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
    refs = refs[6:]
    mask_ref = refs.pop(0) if has_mask else None
    dq_ref, dq_sc = refs
    b, t = pl.program_id(0), pl.program_id(2)
    step = b * n_items + t
    qi, kj, flags = outer_ref[step], inner_ref[step], flags_ref[step]
    static = dict(bq=bq, sq=sq, scale=scale, causal=causal, window=window, softcap=softcap, keys_major=keys_major,
                  d_major=d_major)

    @pl.when((flags & FIRST) != 0)
    def _init():
        dq_sc[...] = jnp.zeros(dq_sc.shape, jnp.float32)

    def compute(col0, tile, masked, slabs):
        keys = functools.partial(_bwd_keys, k_ref, v_ref, col0, tile, masked, sk=sk, bk=bk, d_major=d_major)
        if d_major:  # K and V transposed once a tile for the G heads (row-major: read per head)
            kt, vt = keys()
            kv = kt.T, vt.T
        elif keys_major:  # K^T once a tile
            kv = keys()
            kt = kv[0].T

        def head(g, carry):
            k, v = kv if keys_major else keys()
            if not keys_major:
                ds, *_ = _bwd_tile(seq_ref, q_ref, do_ref, lse_ref, di_ref, mask_ref, k, v, b, qi, col0, tile, g,
                                   masked, **static)
                dq_sc[g] += scale * jax.lax.dot(ds.astype(k.dtype), k, preferred_element_type=jnp.float32)
                return carry
            size = bq // (slabs or 1)
            for n in range(slabs or 1):  # slab n's queries (or the block's) against the keys it may see
                seen = (n + 1) * size if slabs else bkc
                ds, *_ = _bwd_tile(seq_ref, q_ref, do_ref, lse_ref, di_ref, mask_ref, k[:seen], v[:seen], b, qi,
                                   col0, tile, g, masked, n, size, **static)
                # dQ^T += K^T dS^T
                dq_sc[g, :, pl.ds(n * size, size)] += scale * jax.lax.dot(
                    kt[:, :seen], ds.astype(kt.dtype), preferred_element_type=jnp.float32)
            return carry

        jax.lax.fori_loop(0, groups, head, 0)

    _for_each_tile(seq_ref, b, qi, kj, flags, bq=bq, bk=bk, bkc=bkc, causal=causal, window=window, has_mask=has_mask,
                   keys_major=keys_major, body=compute)

    @pl.when((flags & LAST) != 0)
    def _finalize():
        if keys_major and not d_major:
            for g in range(groups):
                dq_ref[g] = dq_sc[g].T.astype(dq_ref.dtype)
        else:
            dq_ref[...] = dq_sc[...].astype(dq_ref.dtype)


def _dkv_kernel(outer_ref, inner_ref, flags_ref, seq_ref, *refs, n_items, groups, bq, bk, bkc, sq, sk, scale, causal,
                window, softcap, has_mask, keys_major, d_major):
    refs = list(refs)
    q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref = refs[:6]
    refs = refs[6:]
    mask_ref = refs.pop(0) if has_mask else None
    dk_ref, dv_ref, dk_sc, dv_sc = refs
    b, t = pl.program_id(0), pl.program_id(2)
    step = b * n_items + t
    kj, qi, flags = outer_ref[step], inner_ref[step], flags_ref[step]
    static = dict(bq=bq, sq=sq, scale=scale, causal=causal, window=window, softcap=softcap, keys_major=keys_major,
                  d_major=d_major)

    @pl.when((flags & FIRST) != 0)
    def _init():
        dk_sc[...] = jnp.zeros(dk_sc.shape, jnp.float32)
        dv_sc[...] = jnp.zeros(dv_sc.shape, jnp.float32)

    def compute(col0, tile, masked, slabs):
        keys = functools.partial(_bwd_keys, k_ref, v_ref, col0, tile, masked, sk=sk, bk=bk, d_major=d_major)
        kv = tuple(x.T for x in keys()) if d_major else keys() if keys_major else None

        def head(g, carry):
            k, v = kv if keys_major else keys()
            if keys_major:
                size = bq // (slabs or 1)
                for n in range(slabs or 1):  # slab n's queries (or the block's) against the keys it may see
                    seen = (n + 1) * size if slabs else bkc
                    ds, p, q, do = _bwd_tile(seq_ref, q_ref, do_ref, lse_ref, di_ref, mask_ref, k[:seen], v[:seen], b,
                                             qi, col0, tile, g, masked, n, size, **static)
                    if not d_major:  # the rows as [.., S, D] blocks hold them
                        q, do = q.T, do.T
                    # dV^T += dO^T P, dK^T += Q^T dS: [D, bq] against [bkc, bq], both contracting lanes
                    cols = pl.ds(tile.start, seen)
                    dv_sc[:, cols] += jax.lax.dot_general(do, p.astype(do.dtype), _NT,
                                                          preferred_element_type=jnp.float32)
                    dk_sc[:, cols] += scale * jax.lax.dot_general(q, ds.astype(q.dtype), _NT,
                                                                  preferred_element_type=jnp.float32)
                return carry
            ds, p, q, do = _bwd_tile(seq_ref, q_ref, do_ref, lse_ref, di_ref, mask_ref, k, v, b, qi, col0, tile, g,
                                     masked, **static)
            if bq % 8 == 0:
                dv_sc[tile, :] += jax.lax.dot(p.T.astype(do.dtype), do, preferred_element_type=jnp.float32)
                dk_sc[tile, :] += scale * jax.lax.dot(ds.T.astype(q.dtype), q, preferred_element_type=jnp.float32)
            else:  # a short q block (decode-sized): contract over rows without a transpose
                dims = (((0,), (0,)), ((), ()))
                dv_sc[tile, :] += jax.lax.dot_general(p.astype(do.dtype), do, dims, preferred_element_type=jnp.float32)
                dk_sc[tile, :] += scale * jax.lax.dot_general(ds.astype(q.dtype), q, dims,
                                                              preferred_element_type=jnp.float32)
            return carry

        jax.lax.fori_loop(0, groups, head, 0)

    _for_each_tile(seq_ref, b, qi, kj, flags, bq=bq, bk=bk, bkc=bkc, causal=causal, window=window, has_mask=has_mask,
                   keys_major=keys_major, body=compute)

    @pl.when((flags & LAST) != 0)
    def _finalize():
        transpose = keys_major and not d_major
        dk_ref[...] = (dk_sc[...].T if transpose else dk_sc[...]).astype(dk_ref.dtype)
        dv_ref[...] = (dv_sc[...].T if transpose else dv_sc[...]).astype(dv_ref.dtype)


# --------------------------------------------------------------------------- pallas calls

def _params(vmem):
    sem = ("parallel", "parallel", "arbitrary")
    return pltpu.CompilerParams(dimension_semantics=sem, vmem_limit_bytes=vmem)


def _is_empty(q, k):
    """No query row, or no key: no kernel runs (its blocks cannot be empty)."""
    return q.size == 0 or k.shape[2] == 0


def _empty_forward(q, sinks, with_lse):
    """Zero-size attention: every row has nothing to attend, so out = 0 and lse is what the kernel
    gives such a row (MASK_VALUE, or the sink logit: the sink alone is in the denominator)."""
    out = jnp.zeros(q.shape, q.dtype)
    if not with_lse:
        return out, None
    rows = q.shape[:3] + (1,)
    sink = None if sinks is None else sinks.astype(jnp.float32)[None, :, None, None]
    _, lse = am.finalize(jnp.full(rows, am.MASK_VALUE, jnp.float32), jnp.zeros(rows, jnp.float32),
                         jnp.zeros(rows, jnp.float32), sink)
    return out, lse[..., 0]


def _forward(q, k, v, sinks, seq, mask, *, scale, causal, window, softcap, block_q, block_k, chip, with_lse):
    if _is_empty(q, k):
        return _empty_forward(q, sinks, with_lse)
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    bq, bk, nq, nk, vmem = _forward_blocks(sq, sk, g, d, q.dtype.itemsize, block_q=block_q, block_k=block_k,
                                           chip=chip, window=window, has_mask=mask is not None)
    n_items = _max_items(sq, sk, bq, bk, causal, window, False)
    seq, [(outer, inner, flags)] = _tables(seq, b, sq, sk, [(n_items, False)], nq=nq, nk=nk, bq=bq, bk=bk,
                                           causal=causal, window=window)

    d_major = _d_major(bq, d)
    q_spec = pl.BlockSpec((None, None, g) + _block(bq, d, d_major),
                          lambda bb, h, t, o, i, f, s: (bb, h, 0) + _at(o[bb * n_items + t], d_major))
    kv_spec = pl.BlockSpec((None, None) + _block(bk, d, d_major),
                           lambda bb, h, t, o, i, f, s: (bb, h) + _at(i[bb * n_items + t], d_major))
    qkv = [_view(x, d_major) for x in (q.reshape(b, hkv, g, sq, d), k, v)]
    in_specs, args = [], []
    if sinks is not None:
        in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM))
        args.append(sinks.astype(jnp.float32))
    in_specs += [q_spec, kv_spec, kv_spec]
    args += qkv
    if mask is not None:
        in_specs.append(pl.BlockSpec((None, bq, bk), lambda bb, h, t, o, i, f, s: (
            bb, o[bb * n_items + t], i[bb * n_items + t])))
        args.append(mask.astype(jnp.int8))
    out_specs = [q_spec]
    out_shape = [jax.ShapeDtypeStruct(qkv[0].shape, q.dtype)]
    if with_lse and _keys_major(bq):  # lane-dense rows, as the backward reads it
        out_specs.append(pl.BlockSpec((None, None, g, 1, bq),
                                      lambda bb, h, t, o, i, f, s: (bb, h, 0, 0, o[bb * n_items + t])))
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, g, 1, sq), jnp.float32))
    elif with_lse:  # one value per row, lane-broadcast (a short block's rows sit on sublanes)
        out_specs.append(pl.BlockSpec((None, None, g, bq, LANES),
                                      lambda bb, h, t, o, i, f, s: (bb, h, 0, o[bb * n_items + t], 0)))
        out_shape.append(jax.ShapeDtypeStruct((b, hkv, g, sq, LANES), jnp.float32))
    if _keys_major(bq):
        scratch = [pltpu.VMEM((g, 1, bq), jnp.float32), pltpu.VMEM((g, d + am.ONES_ROWS, bq), jnp.float32),
                   pltpu.VMEM((_ring_slots(g, bq, bk, d, q.dtype.itemsize, vmem), _compute_tile(bq, bk), bq),
                              jnp.float32)]
    else:
        scratch = [pltpu.VMEM((g, bq, 1), jnp.float32), pltpu.VMEM((g, bq, 1), jnp.float32),
                   pltpu.VMEM((g, bq, d), jnp.float32)]
    kernel = functools.partial(
        _fwd_kernel, n_items=n_items, groups=g, bq=bq, bk=bk, bkc=_compute_tile(bq, bk), sk=sk, d=d, scale=scale,
        causal=causal, window=window, softcap=softcap, has_sinks=sinks is not None, has_mask=mask is not None,
        with_lse=with_lse, heads_per_iteration=_heads_per_iteration(g, chip), d_major=d_major)
    outs = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(b, hkv, n_items), in_specs=in_specs, out_specs=out_specs,
            scratch_shapes=scratch),
        out_shape=out_shape,
        compiler_params=_params(vmem),
        name="flash_attention_fwd",
    )(outer, inner, flags, seq, *args)
    out = _view(outs[0], d_major).reshape(b, hq, sq, d)
    lse = None
    if with_lse:
        lse = (outs[1] if _keys_major(bq) else outs[1][..., 0]).reshape(b, hq, sq)
    return out, lse


def _backward(q, k, v, sinks, seq, mask, out, lse, do, *, scale, causal, window, softcap, block_q, block_k, chip,
              dlse=None):
    """dq, dk, dv and dsinks (None without sinks) from the output's gradient ``do`` and (``dlse``) the log-sum-exp's:
    d lse / d s = p, so it joins as ``di`` - dlse (``di`` = dO . O, ds = p * (dp - di))."""
    if _is_empty(q, k):  # the output is 0 (or empty) whatever q, k, v and sinks are; with no key, a row's lse is
        # its sink logit (or MASK_VALUE, a constant, without sinks)
        dsinks = None if sinks is None else (jnp.zeros_like(sinks) if dlse is None else
                                             jnp.sum(dlse.astype(jnp.float32), axis=(0, 2)).astype(sinks.dtype))
        return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v), dsinks
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    g = hq // hkv
    bq, bk, nq, nk, vmem = _blocks(sq, sk, block_q, block_k, chip)
    n_q = _max_items(sq, sk, bq, bk, causal, window, False)
    n_k = _max_items(sq, sk, bq, bk, causal, window, True)
    seq, (tables_q, tables_k) = _tables(seq, b, sq, sk, [(n_q, False), (n_k, True)], nq=nq, nk=nk, bq=bq, bk=bk,
                                        causal=causal, window=window)
    di = jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)  # [B, Hq, Sq]
    if dlse is not None:
        di = di - dlse.astype(jnp.float32)
    # keys-major as the forward (``_keys_major``): ds and p [keys, queries], dQ^T = K^T dS^T, dK^T = Q^T dS and
    # dV^T = dO^T P, whose outputs are bq or bkc wide where head dim 128 fills half of a 256-wide MXU; on [.., S, D]
    # blocks (not ``_d_major``), K^T is transposed once a tile, each head's q and dO once a tile in the dK/dV
    # kernel (s = K Q^T and dp = V dO^T take them as they are), the f32 results once a block. Cost model, causal
    # training step, layer us: v6e Qwen3 8k (head dim 128) 9083.2 -> 8083.3, TPU7x 6860.4 -> 6399.0 (v6e: dq 3241.8
    # -> 2972.6, dK/dV 4450.6 -> 3719.9, MXU efficiency 0.50 -> 0.60 / 0.67). With the key tiles as the forward's
    # (``_for_each_tile``), row-major -> keys-major (and so the diagonal's slabs): v6e Gemma-3 (head dim 256) 8k
    # 2153.2 -> 2099.8, 2k 246.0 -> 210.1; v5e Qwen3 2k 1347.0 -> 1129.7, Gemma-3 2k 627.8 -> 542.1, 8k 7265.7 ->
    # 6964.6, but Qwen3 8k 14915.4 -> 15098.5. Lost: [.., D, S] views at head dim 128, which XLA transposes in HBM
    # (v6e Qwen3 8k 8535.9, 352 us of copies); q and dO transposed once into VMEM scratch (8233.8).
    d_major, keys_major = _d_major(bq, d), _keys_major(bq)
    q5, k, v, do5 = (_view(x, d_major) for x in (q.reshape(b, hkv, g, sq, d), k, v, do.reshape(b, hkv, g, sq, d)))
    row = lambda x: x.reshape(b, hkv, g, 1, sq)  # noqa: E731  per-row stats, lane-dense
    mask8 = None if mask is None else mask.astype(jnp.int8)
    common = dict(groups=g, bq=bq, bk=bk, bkc=_compute_tile(bq, bk), sq=sq, sk=sk, scale=scale, causal=causal,
                  window=window, softcap=softcap, has_mask=mask is not None, keys_major=keys_major,
                  d_major=d_major)

    def specs(n, q_idx, k_idx):
        qs = pl.BlockSpec((None, None, g) + _block(bq, d, d_major),
                          lambda bb, h, t, o, i, f, s: (bb, h, 0) + _at(q_idx(o, i, bb * n + t), d_major))
        ks = pl.BlockSpec((None, None) + _block(bk, d, d_major),
                          lambda bb, h, t, o, i, f, s: (bb, h) + _at(k_idx(o, i, bb * n + t), d_major))
        rs = pl.BlockSpec((None, None, g, 1, bq), lambda bb, h, t, o, i, f, s: (bb, h, 0, 0, q_idx(o, i, bb * n + t)))
        in_specs = [qs, ks, ks, qs, rs, rs]
        if mask is not None:
            in_specs.append(pl.BlockSpec((None, bq, bk), lambda bb, h, t, o, i, f, s: (
                bb, q_idx(o, i, bb * n + t), k_idx(o, i, bb * n + t))))
        return in_specs, qs, ks

    args = [q5, k, v, do5, row(lse), row(di)] + ([mask8] if mask is not None else [])

    # dq: q blocks outer, as the forward
    in_specs, qs, _ = specs(n_q, lambda o, i, x: o[x], lambda o, i, x: i[x])
    dq = pl.pallas_call(
        functools.partial(_dq_kernel, n_items=n_q, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=4, grid=(b, hkv, n_q), in_specs=in_specs, out_specs=qs,
            scratch_shapes=[pltpu.VMEM((g,) + _block(bq, d, keys_major), jnp.float32)]),
        out_shape=jax.ShapeDtypeStruct(q5.shape, q.dtype),
        compiler_params=_params(vmem),
        name="flash_attention_dq",
    )(*tables_q, seq, *args)

    # dk, dv: kv blocks outer, each summing over its q blocks and the G heads of its group
    in_specs, _, ks = specs(n_k, lambda o, i, x: i[x], lambda o, i, x: o[x])
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, n_items=n_k, **common),
        grid_spec=pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=4, grid=(b, hkv, n_k), in_specs=in_specs,
                                               out_specs=[ks, ks],
                                               scratch_shapes=[pltpu.VMEM(_block(bk, d, keys_major), jnp.float32)] * 2),
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=_params(vmem),
        name="flash_attention_dkv",
    )(*tables_k, seq, *args)
    dq, dk, dv = (_view(x, d_major) for x in (dq, dk, dv))

    dsinks = None
    if sinks is not None:  # d/dz of a sink logit z: -sum over rows of p_sink * (dO . O - dlse)
        p_sink = jnp.exp(sinks.astype(jnp.float32)[None, :, None] - lse)
        p_sink = jnp.where(lse == am.MASK_VALUE, 0.0, p_sink)
        dsinks = -jnp.sum(p_sink * di, axis=(0, 2)).astype(sinks.dtype)
    return dq.reshape(q.shape), dk, dv, dsinks


# --------------------------------------------------------------------------- public API

def _canonical_seq(seq, b, sq, sk):
    if seq is None:
        return jnp.tile(jnp.array([[0, sk, sq]], jnp.int32), (b, 1))
    seq = seq.astype(jnp.int32)
    kv_start = jnp.clip(seq[:, 0], 0, sk)
    kv_end = jnp.clip(seq[:, 1], kv_start, sk)
    q_len = jnp.clip(seq[:, 2], 0, sq)
    return jnp.stack([kv_start, kv_end, q_len], axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _attention(q, k, v, sinks, seq, mask, static):
    return _forward(q, k, v, sinks, seq, mask, with_lse=False, **dict(static))[0]


def _attention_fwd(q, k, v, sinks, seq, mask, static):
    out, lse = _forward(q, k, v, sinks, seq, mask, with_lse=True, **dict(static))
    return out, (q, k, v, sinks, seq, mask, out, lse)


def _attention_bwd(static, res, do):
    q, k, v, sinks, seq, mask, out, lse = res
    dq, dk, dv, dsinks = _backward(q, k, v, sinks, seq, mask, out, lse, do, **dict(static))
    return dq, dk, dv, dsinks, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


def flash_attention(q, k, v, sinks=None, seq=None, mask=None, *, scale=None, causal=True, window=None,
                    softcap=None, block_q=None, block_k=None, chip=None):
    """Attention of q [B, Hq, Sq, D] over k/v [B, Hkv, Sk, D] -> [B, Hq, Sq, D] (q's dtype).

    sinks [Hq] (GPT-OSS), seq int [B, 3] = (kv_start, kv_end, q_len) per sequence (module doc),
    mask bool/int8 [B, Sq, Sk] (True = may attend, applied on top), scale (None or 0: D**-0.5),
    causal (bottom-right), window W (keys k > q - W), softcap (cap * tanh(s / cap)).
    Differentiable in q, k, v and sinks. ``chip`` ("v5e", "v6e", "tpu7x") picks block sizes and the
    VMEM limit; by default the current device's.

    ``seq`` values on the host are checked (0 <= kv_start <= kv_end <= Sk, 0 <= q_len <= Sq); on
    device or under jit they are clamped into those ranges. Zero sizes: B, Hq or Sq = 0 give an
    empty output, Sk = 0 gives zeros (no row has a key to attend).
    """
    if chip is None:
        chip = _chip_from_device()
    validate(q, k, v, sinks, seq, mask, scale=scale, causal=causal, window=window, softcap=softcap,
             block_q=block_q, block_k=block_k, chip=chip)
    d = q.shape[3]
    static = (("scale", am.resolve_scale(scale, d)), ("causal", bool(causal)),
              ("window", None if window is None else int(window)),
              ("softcap", None if softcap is None else float(softcap)), ("block_q", block_q),
              ("block_k", block_k), ("chip", chip))
    return _attention(q, k, v, sinks, seq, mask, static)


def flash_attention_with_lse(q, k, v, sinks=None, seq=None, mask=None, *, scale=None, causal=True, window=None,
                             softcap=None, block_q=None, block_k=None, chip=None):
    """Forward only: (out [B, Hq, Sq, D], log-sum-exp [B, Hq, Sq] f32, sinks included; MASK_VALUE for empty rows)."""
    if chip is None:
        chip = _chip_from_device()
    validate(q, k, v, sinks, seq, mask, scale=scale, causal=causal, window=window, softcap=softcap,
             block_q=block_q, block_k=block_k, chip=chip)
    d = q.shape[3]
    return _forward(q, k, v, sinks, seq, mask, scale=am.resolve_scale(scale, d), causal=causal, window=window,
                    softcap=softcap, block_q=block_q, block_k=block_k, chip=chip, with_lse=True)


def reference(q, k, v, sinks=None, seq=None, mask=None, *, scale=None, causal=True, window=None, softcap=None, **_):
    """The dense reference with this module's conventions (f32 result)."""
    b, _, sq, d = q.shape
    sk = k.shape[2]
    seq = _canonical_seq(seq, b, sq, sk)
    scale = am.resolve_scale(scale, d)
    if mask is None and not bool(jnp.all(seq[:, 0] == 0)):
        mask = jnp.broadcast_to(jnp.arange(sk)[None, None, :] >= seq[:, 0, None, None], (b, sq, sk))
    elif mask is not None:
        mask = mask.astype(bool) & (jnp.arange(sk)[None, None, :] >= seq[:, 0, None, None])
    if mask is None:
        return am.reference_attention(q, k, v, scale=scale, causal=causal, window=window, softcap=softcap,
                                      sinks=sinks, q_lens=seq[:, 2], kv_lens=seq[:, 1])
    return _masked_reference(q, k, v, sinks, seq, mask, scale=scale, causal=causal, window=window, softcap=softcap)


def _masked_reference(q, k, v, sinks, seq, mask, *, scale, causal, window, softcap):
    b, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    s = jnp.einsum("bhgqd,bhkd->bhgqk", q.astype(jnp.float32).reshape(b, hkv, hq // hkv, sq, d),
                   k.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    kv_end, q_len = seq[:, 1, None, None], seq[:, 2, None, None]
    rows = jnp.arange(sq)[None, :, None]
    cols = jnp.arange(sk)[None, None, :]
    ok = am.allowed(kv_end - q_len + rows, cols, causal=causal, window=window)
    ok = ok & (rows < q_len) & (cols < kv_end) & mask
    s = jnp.where(ok[:, None, None], s, -jnp.inf)
    if sinks is not None:
        z = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1), s.shape[:-1] + (1,))
        s = jnp.concatenate([s, z], axis=-1)
    p = jnp.nan_to_num(jax.nn.softmax(s, axis=-1))
    if sinks is not None:
        p = p[..., :-1]
    return jnp.einsum("bhgqk,bhkd->bhgqd", p, v.astype(jnp.float32)).reshape(b, hq, sq, d)
