"""Grouped matmul for TPU in Pallas: ``ragged_dot`` (jax.lax.ragged_dot semantics) and its backward.

Design (weights streamed once):

* ``gmm``: grid ``(n_tiles, items)``. An *item* is one (group, m-tile) pair, in row order; empty
  groups have no item. The contraction is never split (a block holds all of k), so the weight block
  of an item is ``rhs[group, :, n_tile]``: consecutive items of the same group keep the same block
  index and Pallas does not fetch it again. Each active expert's weights therefore cross HBM
  once per n tile (once overall when a whole [k, n] slab fits VMEM, the common case), an empty
  group costs no DMA and no MXU work, and the lhs tile stays resident while the groups sharing
  it are visited. The output block (tm, tn) also stays resident across the items of one m-tile;
  each item writes only its own rows. Tiles wholly past ``sum(group_sizes)`` get one "tail" item
  that writes zeros (fetch indices repeat the previous item's, so a tail item moves no input).
  The number of items is a traced value: the grid is dynamic, with no padding steps.
* ``tgmm`` (d/drhs): grid ``(k_tiles, n_tiles, items)`` with items per group (an empty group gets
  one item that writes its zero gradient without fetching anything) and an f32 accumulator.
* Group metadata is computed on device from ``group_sizes`` and scalar-prefetched into SMEM, so
  everything works under jit with traced group sizes and needs no host round trip.
* Optional fused epilogues for MoE: per-group bias, and the gated activations of the first
  expert matmul (gate and up are two blocks of the same weight array, so no copy is made).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from ._bridge import check_array, dtype_name, host_values, in_hbm
from ._chips import CHIPS, Chip, MiB, tpu_generation

DTYPES = ("float32", "bfloat16")
# group sizes: every integer dtype, as jax.lax.ragged_dot (values travel as int32)
SIZE_DTYPES = ("int32", "int64", "uint32", "uint64", "int16", "uint16", "int8", "uint8")
ACTIVATIONS = ("none", "silu", "gelu_tanh", "swiglu_oai")
# quantized expert weights (transformers' [E, out, in] layout): weight dtype -> what its scale holds
QUANT_DTYPES = {
    "float8_e4m3fn": "float32 scale_inv per 128x128 block, [E, ceil(out/128), ceil(in/128)] (transformers' FP8)",
    "int8": "float32 scale per output channel, [E, out]",
    "uint8": "MXFP4 (GPT-OSS): weights are e2m1 pairs [E, out, in/2] (low nibble first), scales uint8 e8m0 "
             "per 32 inputs [E, out, in/32]; or [E, in/2, out] and [E, in/32 (rows padded up to a multiple "
             "of 32 allowed), out] with is_transposed",
}
FP8_BLOCK = 128


# --------------------------------------------------------------------------- chips and tiling

def current_chip() -> str | None:
    """The TPU generation of the default device; None off TPU (interpret mode, or compiling ahead
    of time for some TPU from a CPU host): tiles then fit every generation's VMEM."""
    return tpu_generation()


def _chip(name: str | None) -> Chip:
    """Figures for tiling: the named (or current) chip; off TPU, v6e's speeds with the smallest
    VMEM of all generations, so the tiles compile everywhere."""
    name = name or current_chip()
    if name:
        return CHIPS[name]
    return dataclasses.replace(CHIPS["v6e"], vmem_bytes=min(c.vmem_bytes for c in CHIPS.values()))


def _vmem_budget(chip: Chip) -> int:
    """VMEM a gmm's pipeline may use (``gmm_vmem_bytes``), leaving room for Mosaic's own scratch (its limit:
    ``_vmem_limit``). Wider blocks read the lhs fewer times in fewer steps. At 0.45 of the VMEM, TPU7x took
    GPT-OSS-20B's gate_up in 512-column blocks (282 steps at 2048 tokens); at 0.6, 768 (188): layer us 918.9
    -> 819.2 (cost model). At 0.85 (with GPT-OSS's gate and up activated as pairs, ``activates_pairs``),
    TPU7x's gate_up takes 1024-column blocks and its down projection whole rows (2880 columns), MXFP4's gate_up
    whole rows on v5e and v6e at 1 and 64 tokens: layer us GPT-OSS-20B
    TPU7x 2048 / 8192 tokens 709.8 / 2542.5 -> 678.1 / 2487.7, MXFP4 at 64 tokens v5e / v6e / TPU7x 1195.3 /
    858.6 / 544.0 -> 981.2 / 780.2 / 518.9, at 1 token 129.1 / 102.5 / 74.2 -> 122.2 / 96.4 / 71.6. At 0.75
    TPU7x's 2048 tokens took 256-row down tiles: 789.0. With the pairs' weights counted as the two units they
    are (``gmm``), TPU7x's gate_up takes 1536-column blocks (two, where 1024 took three passes over the rows):
    678.1 / 2487.7 -> 654.2 / 2438.4."""
    return int(chip.vmem_bytes * 0.85)


def _vmem_limit(need: int, chip: str | None) -> int:
    """A kernel's VMEM limit for an estimate of ``need`` bytes: a quarter more plus 4 MiB for Mosaic's own
    scratch, at least XLA's default 32 MiB, at most 90% of the chip's VMEM."""
    return int(min(max(need * 1.25 + 4 * MiB, 32 * MiB), _chip(chip).vmem_bytes * 0.9))


def _dims(rhs_transposed: bool):
    """dot_general dimensions of x [m, k] with a weight [k, n], or [n, k] when ``rhs_transposed``."""
    return (((1,), (1,)), ((), ())) if rhs_transposed else (((1,), (0,)), ((), ()))


def _sublanes(dtype) -> int:
    return 8 * 4 // jnp.dtype(dtype).itemsize  # 8 rows for 32-bit, 16 for bf16


def _round_up(x: int, r: int) -> int:
    return -(-x // r) * r


def gmm_vmem_bytes(tm: int, tn: int, k: int, in_bytes: int, out_bytes: int, n_weights: int = 1,
                   quantized: bool = False, chunk: int | None = None) -> int:
    """VMEM a gmm step needs: double-buffered lhs, weight and output blocks plus f32 temporaries (of
    ``chunk`` rows, default tm). Quantized weights (1 byte, double-buffered, plus their dequantized copy
    in ``in_bytes``) take about what in_bytes weights double-buffered take; add the f32 temporaries of
    dequantizing."""
    return (2 * tm * k * in_bytes + 2 * n_weights * k * tn * in_bytes + 2 * tm * tn * out_bytes
            + (n_weights + 1) * (chunk or tm) * tn * 4 + 4 * n_weights * tn * 4 + (2 * 256 * k * 4 if quantized else 0))


def _tn_candidates(n: int, lane_dim: bool, divisors_only: bool = True) -> list[int]:
    """Block widths for a dimension of size n: n itself, then multiples of 128 below it (dividing
    n when ``divisors_only``; otherwise the last block overhangs and its extra columns are dropped)."""
    del lane_dim  # 128 suits both the lane (multiple of 128) and the sublane (multiple of 8) rule
    return [n] + [t for t in range(_round_up(n, 128) - 128, 0, -128) if not divisors_only or n % t == 0]


def expected_active_groups(m: int, g: int) -> float:
    """Groups hit when m rows pick groups uniformly (MoE routing): sizes the tile model."""
    return g * (1.0 - (1.0 - 1.0 / g) ** m) if g else 0.0


DECODE_GROUP_ROWS = 48  # groups averaging up to this many rows (decode-sized) take the short chunks below


def group_chunk_rows(m: int, groups: int | None) -> int:
    """Rows per iteration of a kernel's loop over the rows of one group in a tile (``_for_group_rows``).
    Every iteration pushes the weight block through the MXU whole, but its result pops, adds and masks
    scale with its rows: when groups average few rows (decode: Qwen3 at 64 tokens has 4), the smallest
    chunk that holds an average group in one iteration from the native tile where it starts (32 rows: any
    group of up to 17 bf16 rows). Compiled for v6e, the fused MLP for Qwen3 at 64 tokens in bf16: 3249
    bundles an iteration against 3610 at 128 rows, 96 vmatmuls per MXU against 384."""
    avg = -(-m // groups) if groups else m
    return 32 if avg <= 16 else 64 if avg <= DECODE_GROUP_ROWS else 128


def _for_group_rows(lo, hi, *, tm: int, chunk: int, sub: int, body, fresh: bool = False, tails: tuple = ()):
    """``body(r0)`` for chunks of ``chunk`` rows from r0 (a multiple of ``sub``: the native tile of what the
    chunk reads, or 1 for rows copied into a chunk of their own) covering rows [lo, hi) of a tm-row tile:
    from the ``sub`` rows holding row lo, so a group of a few rows takes one chunk wherever it starts; the
    last chunk pulled back inside the tile (rows it repeats are written again, with the same values).
    ``fresh``: ``body(r0, new)``, rows from r0 + new on not in an earlier chunk.
    ``tails`` (ascending row counts under ``chunk``): ``body(r0, rows)`` (``fresh``: ``body(r0, new, rows)``),
    whole chunks while they fit before hi, then one chunk of the fewest rows (a tail, or ``chunk``) that covers
    the rest, pulled back inside the tile (``chunk_tails``)."""
    aligned = (lambda r: pl.multiple_of(r, sub)) if sub > 1 else (lambda r: r)  # noqa: E731
    first_row = jnp.minimum(lax.div(lo, jnp.int32(sub)) * sub, tm - chunk)
    n = jnp.int32(chunk)
    if tails:
        assert all(t % sub == 0 for t in tails) and list(tails) == sorted(tails) and tails[-1] < chunk

        def whole(c, carry):
            r0 = aligned(first_row + c * chunk)
            body(r0, 0, chunk) if fresh else body(r0, chunk)
            return carry

        done = lax.div(hi - first_row, n)
        lax.fori_loop(0, done, whole, 0)
        r, rest = first_row + done * chunk, hi - first_row - done * chunk
        for low, rows in zip((0,) + tuple(tails), tuple(tails) + (chunk,)):
            @pl.when(jnp.logical_and(rest > low, rest <= rows))
            def _tail():
                r0 = aligned(jnp.minimum(r, tm - rows))
                body(r0, r - r0, rows) if fresh else body(r0, rows)
        return

    def step(c, carry):
        r0 = aligned(jnp.minimum(first_row + c * chunk, tm - chunk))
        body(r0, first_row + c * chunk - r0) if fresh else body(r0)
        return carry

    lax.fori_loop(0, lax.div(hi - first_row + n - 1, n), step, 0)


def gmm_chunk_rows(m: int, groups: int, tm: int, chip: str | None = None) -> int:
    """gmm's rows per iteration at row tile tm: decode-sized groups (``DECODE_GROUP_ROWS``) in chunks of
    ``group_chunk_rows``; longer ones in chunks of the MXU's width, each group's last chunk cut
    to a tail (``chunk_tails``), so only the chunks holding a group's rows go through the MXU and few rows
    past the group do. Measured with the cost model (GPT-OSS-20B, 2880 x 5760 gate_up and 2880 x 2880 down
    at 32 experts, TPU7x, layer us): 2048 tokens (256 rows an expert) 128-row chunks in 512-row tiles 819.2,
    with tails of 32 and 64 rows 772.5; 256-row chunks with tails of 32, 64 and 128 rows 729.3 (64 and 128:
    741.7; whole 256-row chunks: 988.8); 8192 tokens (1024 rows an expert) one pass per 256-row tile
    2914.9, 256-row chunks with tails in 512-row tiles 2813.9."""
    avg = -(-m // groups) if groups else m
    return min(tm, group_chunk_rows(m, groups) if avg <= DECODE_GROUP_ROWS else _chip(chip).mxu_dim)


def chunk_tails(chunk: int, sub: int) -> tuple[int, ...]:
    """The shorter chunks a group's last rows may take in gmm and the fused MLP (``_for_group_rows``): an
    eighth, a quarter and a half of ``chunk``, in whole native tiles of ``sub`` rows. Each is one more copy
    of the dots in the compiled kernel; a group then runs at most a tail's worth of rows (up to half the
    chunk) past its end, against up to a whole chunk."""
    return tuple(t for t in (chunk // 8, chunk // 4, chunk // 2) if t >= sub and t % sub == 0)


def choose_gmm_tiling(m: int, k: int, n: int, g: int, *, in_dtype, out_dtype, chip: str | None = None,
                      n_weights: int = 1, lane_n: bool = True, divisors_only: bool = True,
                      quantized: bool = False) -> tuple[int, int]:
    """(tm, tn) minimising a roofline model of the kernel on ``chip`` (default: the current one).

    A step costs the longer of its DMAs and its MXU work, plus a step's overhead.
    tn: fewer, wider blocks re-read the lhs less and take fewer steps, but a last block that overhangs
    n moves its whole width of weights (GPT-OSS's 2880 in blocks of 2432 reads 1.7x its weights; in
    blocks of 1536, 1.07x). tm: trades wasted MXU rows (an item computes tm rows however few belong
    to its group, or its chunks of ``gmm_chunk_rows``, and the MXU takes at least its width) against
    grid steps: each costs ~0.35 us, and a group straddling two tiles takes two, the second pushing the
    weight block through the MXU again with no DMA to hide it under (GPT-OSS at 64 tokens in 16-row
    tiles: 47 items for 32 groups). Modelled per step (rather than as all DMAs against the first steps' MXU
    work), TPU7x's GPT-OSS down projection at 8192 tokens keeps 256-row tiles (whole 512-row tiles issue 1.2x
    the MXU work: layer us 3007.1 against 2914.9).
    """
    spec = _chip(chip)
    inb, outb = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
    sub = _sublanes(in_dtype)
    budget = _vmem_budget(spec)
    ga = max(expected_active_groups(m, g), 1.0)
    tms = [t for t in (8, 16, 32, 64, 128, 256, 512) if t % sub == 0]
    tms = [t for t in tms if t <= max(_round_up(m, sub), sub)] or [sub]
    best = None
    for tn in _tn_candidates(n, lane_n, divisors_only):
        tiles_n = -(-n // tn)
        for tm in tms:
            chunk = gmm_chunk_rows(m, g, tm, chip)
            if gmm_vmem_bytes(tm, tn, k, inb, outb, n_weights, quantized, chunk) > budget:
                continue
            tiles_m = -(-m // tm)
            steps = tiles_n * (ga + tiles_m - 1)
            # an item pushes its weight block through the MXU whole and streams its rows (chunks) past it;
            # a step takes the longer of its DMAs and its MXU work: a group's first fetches its weights, one
            # continuing from the previous tile finds them in VMEM (only its rows move)
            item_s = 2.0 * max(chunk, spec.mxu_dim) * k * tn * n_weights / spec.peak_flops
            rows_s = (tm * k * inb + tm * tn * outb) / spec.hbm_bandwidth
            first_s = max(rows_s + k * tn * n_weights * inb / spec.hbm_bandwidth, item_s)
            t = (ga * tiles_n * first_s + (tiles_m - 1) * tiles_n * max(rows_s, item_s)
                 + steps * spec.step_overhead_s)
            if best is None or t < best[0] * 0.98:  # wider tn and smaller tm first: later ones must win clearly
                best = (t, tm, tn)
    if best is None:
        raise ValueError(f"no (tm, tn) tiling of a [{m}, {k}] x [{k}, {n}] grouped matmul fits in "
                         f"{spec.name} VMEM ({budget / MiB:.0f} MiB budget); k={k} is too large")
    return best[1], best[2]


def choose_tgmm_tiling(m: int, k: int, n: int, *, in_dtype, out_dtype, chip: str | None = None) -> tuple[int, int, int]:
    """(tm, tk, tn) for the weight gradient: big k/n blocks (each re-reads lhs or dout), tm 256-512."""
    spec = _chip(chip)
    inb = jnp.dtype(in_dtype).itemsize
    sub = _sublanes(in_dtype)
    budget = _vmem_budget(spec) // 2
    tm = min(512, max(_round_up(m, sub), sub))
    for tk in _tn_candidates(k, True)[:6] + [k]:
        for tn in _tn_candidates(n, True)[:6] + [n]:
            need = 2 * tm * (tk + tn) * inb + 2 * tk * tn * 4 + tk * tn * 4 + 2 * tm * (tk + tn) * 4
            if need <= budget:
                return tm, tk, tn
    return tm, min(k, 512), min(n, 512)


# --------------------------------------------------------------------------- group metadata

def _udiv(a: jax.Array, b) -> jax.Array:
    """a // b for non-negative int32 a, as unsigned division: a signed one adds sign fix-up ops (negate,
    select, ...), and around the kernels each small op is a launch of its own on the TPU."""
    return lax.div(a.astype(jnp.uint32), jnp.uint32(b)).astype(jnp.int32)


def _group_items(count: jax.Array, size: int):
    """Work items of consecutive groups, ``count[e]`` of them for group e, over ``size`` item slots (a static
    bound): (n, the slots' indices; ends; item n's group; its rank in the group; pick) where ends[e] counts the
    items up to and including group e's, slots past the items take the last group, and pick(v) is each slot's
    group's v.
    Masked sums, no cumsum, searchsorted or gather: around the kernels every op is a launch on the TPU, and
    each of these is one fusion (a cumsum is a chain of them)."""
    groups = jnp.arange(count.shape[0], dtype=jnp.int32)
    ends = jnp.sum(jnp.where(groups[None, :] <= groups[:, None], count[None, :], 0), axis=1)
    n = jnp.arange(size, dtype=jnp.int32)
    grp = jnp.minimum(jnp.sum(ends[None, :] <= n[:, None], axis=1, dtype=jnp.int32), count.shape[0] - 1)
    of_grp = grp[:, None] == groups[None, :]

    def pick(v):
        return jnp.sum(jnp.where(of_grp, v[None, :], 0), axis=1)
    return n, ends, grp, n - pick(ends - count), pick


def group_metadata(group_sizes: jax.Array, m: int, tm: int):
    """Work items for the transposed grouped matmul (tgmm: one output per group) over m rows in tiles
    of tm, computed on device: each non-empty group's tiles, and one item for each empty group (its
    output is zeros).

    Returns (offsets[g+1], item_group, item_tile, fetch_group, fetch_tile, num_items) where item
    arrays have a static length. ``fetch_*`` are the input block indices: those of the latest item
    that needs data (non-empty group), so empty groups trigger no DMA. Negative sizes count as 0 and
    the sizes are clipped so their sum never passes m: no index can leave the arrays, whatever the values.
    """
    g = group_sizes.shape[0]
    tiles = -(-m // tm)
    div = functools.partial(_udiv, b=tm)
    gs = jnp.maximum(group_sizes.astype(jnp.int32), 0)
    ends = jnp.minimum(jnp.cumsum(gs), m).astype(jnp.int32)
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    offsets = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
    nonempty = ends > starts
    first_tile = jnp.minimum(div(starts), tiles - 1)
    count = jnp.where(nonempty, div(jnp.maximum(ends, 1) - 1) - first_tile + 1, 1)
    idx, item_ends, grp, j, pick = _group_items(count, tiles + g)  # every group boundary adds at most one item
    num_items = item_ends[-1]
    tile = jnp.clip(pick(first_tile) + j, 0, tiles - 1)  # past num_items: never run, any valid tile
    has_data = (idx < num_items) & (pick(nonempty.astype(jnp.int32)) > 0)
    # the latest item that needs data (empty groups come between): group and tile only grow along such
    # items, so theirs are the maxima
    src = lax.cummax(jnp.where(has_data, idx, -1))
    fetch_group = jnp.where(src >= 0, grp[jnp.maximum(src, 0)], 0).astype(jnp.int32)
    fetch_tile = jnp.where(src >= 0, tile[jnp.maximum(src, 0)], 0).astype(jnp.int32)
    return offsets, grp, tile.astype(jnp.int32), fetch_group, fetch_tile, num_items.astype(jnp.int32)


def rows_of_groups(group_sizes: jax.Array, m: int) -> jax.Array:
    """The group of each of m rows [m] for consecutive groups of ``group_sizes`` (g for rows past them),
    clamped as ``group_metadata`` clamps: negative sizes count 0, the groups end at row m."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0)), m)
    return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right", method="compare_all").astype(jnp.int32)


def run_metadata(row_groups: jax.Array, tm: int, num_groups: int, windows: int | None = None):
    """Work items for a forward grouped matmul from the group of each row, computed on device in a few XLA
    ops: what a MoE layer's routing sort gives, so the caller computes no group sizes nor their offsets
    (each a chain of small launches on the TPU). ``row_groups`` must be ascending, in [0, num_groups]
    (num_groups: the row is in no group): the static bound on the items counts on it.

    An item is a run of rows sharing a tm-row tile and a group. Returns (bounds, item_group, item_tile,
    fetch_group, fetch_tile, num_items): item n covers rows [bounds[n], bounds[n + 1]) (bounds past the
    items are m); ``item_group == num_groups`` marks rows of no group (nothing computed, zeros written).
    ``fetch_*`` are the block indices of the latest item with data, so items of no group move nothing.
    Other values count as no group: no index can leave the arrays, whatever the values.

    ``windows`` (a native row tile; for a kernel that reads its rows at any native tile, not in tm-row
    blocks): an item is instead a window of up to tm rows of one group from the group's first row, so no
    group splits at a tile edge;
    ``item_tile`` is the item's first row rounded down to a multiple of ``windows`` and ``fetch_tile``
    the index of the latest item with data.
    """
    m = row_groups.shape[0]
    g = num_groups
    size = -(-m // tm) + g + 1  # static bound: runs start at a tile's first row or where the group changes
    key = jnp.where((row_groups >= 0) & (row_groups < g), row_groups, g).astype(jnp.int32)
    # The items from the groups' first rows, not the rows: group e (g: no group) holds rows [lo[e], hi[e]),
    # found by comparing every row with every group (one fusion), and its items follow in closed form. A sort
    # compacting the rows that start an item took 24 of the 40 us these ops took at 65536 rows on v6e (13 now;
    # 14.4 -> 8.1 us at 2048 rows, 9.4 -> 8.4 at 8; XLA ops alone, cost model v2).
    e = jnp.arange(g + 2, dtype=jnp.int32)
    first_row = jnp.sum(key[None, :] < e[:, None], axis=1, dtype=jnp.int32)
    lo, hi = first_row[:-1], first_row[1:]
    div = functools.partial(_udiv, b=tm)
    if windows:  # windows of up to tm rows from the group's first row
        count = div(hi - lo + tm - 1)
    else:  # the tiles the group's rows touch
        count = jnp.where(hi > lo, div(jnp.maximum(hi, 1) - 1) - div(lo) + 1, 0)
    n, ends, grp, j, pick = _group_items(count, size)  # item n is group grp[n]'s j-th
    num_items, with_data = ends[g], ends[g - 1] if g else jnp.int32(0)
    lo_n = pick(lo)
    start = lo_n + j * tm if windows else jnp.where(j == 0, lo_n, (div(lo_n) + j) * tm)
    bounds = jnp.concatenate([jnp.where(n < num_items, start, m), jnp.full((1,), m, jnp.int32)])
    row = jnp.minimum(bounds[:size], m - 1)
    item_group = jnp.where(n < num_items, grp, g).astype(jnp.int32)
    item_tile = (row // windows * windows if windows else row // tm).astype(jnp.int32)
    # rows of no group sort last, so their items follow every item with data: they keep its blocks (a
    # clamp, not a running max: on the TPU a cummax is a chain of five launches; vector ops, as scalar
    # ones would be launches of their own)
    src = jnp.maximum(jnp.minimum(n + 1, with_data) - 1, 0)
    fetch_group = jnp.where(item_group[src] < g, item_group[src], 0)  # no group anywhere: any valid block
    return bounds, item_group, item_tile, fetch_group, src if windows else item_tile[src], num_items


def sort_by_expert(top_k_index: jax.Array, num_experts: int):
    """The routing sort of a MoE layer: the (token, k) pairs of ``top_k_index`` [T, k] in expert order.
    Returns (keys, order, tokens) [T * k]: each sorted pair's expert (``num_experts`` for ids outside
    [0, num_experts): sentinels and padding, sorted last), its index in ``top_k_index.reshape(-1)`` and
    its token."""
    ids = top_k_index.reshape(-1).astype(jnp.int32)
    key = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    keys, order = lax.sort((key, jnp.arange(key.shape[0], dtype=jnp.int32)), num_keys=1, is_stable=True)
    return keys, order, _udiv(order, max(top_k_index.shape[1], 1))


# --------------------------------------------------------------------------- epilogues

def _activate(gate, up, activation: str, alpha: float, limit: float):
    if activation == "silu":
        return gate * jax.nn.sigmoid(gate) * up
    if activation == "gelu_tanh":
        return jax.nn.gelu(gate, approximate=True) * up
    if activation == "swiglu_oai":  # GPT-OSS: clamped gate and up, (up + 1) * gate * sigmoid(alpha * gate)
        gate = jnp.minimum(gate, limit)
        up = jnp.clip(up, -limit, limit)
        return (up + 1.0) * gate * jax.nn.sigmoid(alpha * gate)
    raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


# --------------------------------------------------------------------------- quantized weights

def is_mxfp4(w) -> bool:
    """uint8 weights: MXFP4 blocks, two e2m1 values per byte, one power-of-two scale per 32 values."""
    return jnp.dtype(w.dtype) == jnp.uint8


def _e2m1_as_e5m2(words, nibble: int):
    """The e2m1 codes in the low (``nibble`` 0) or high (1) nibbles of packed bytes (uint32 words, 4 bytes each)
    as float8_e5m2 bytes in the same byte positions, each worth exactly 2^-14 times its code: e2m1 (sign,
    2 exponent bits with bias 1, 1 mantissa bit) is e5m2 (bias 15, 2 mantissa bits) with the exponent's top bits
    and the low mantissa bit zero, subnormals (0, 0.5) and -0 included. Bytewise bit moves only, 4 codes per op:
    the hardware's fp8 unpack then does the decoding."""
    if nibble == 0:
        return ((words & np.uint32(0x07070707)) << 1) | ((words & np.uint32(0x08080808)) << 4)
    return (lax.shift_right_logical(words, np.uint32(3)) & np.uint32(0x0E0E0E0E)) | (words & np.uint32(0x80808080))


MXFP4_SCALE_ROWS = 16  # packed weight rows (bytes: 32 inputs) per e8m0 scale row
_MXFP4_ROWS = 128  # byte rows decoded per loop iteration (a multiple of 32: whole uint8 tiles)


def _mxfp4_scales(s_scr, s0, nr: int, c0: int, cw: int):
    """e8m0 scales of ``nr`` weight rows from scale row s0 (f32 in s_scr, ``_mxfp4_scale_table``), columns
    [c0, c0 + cw): each scale row covers 16 weight rows, a sublane broadcast."""
    s = s_scr[pl.ds(s0, nr // MXFP4_SCALE_ROWS), pl.ds(c0, cw)]
    return jnp.broadcast_to(s[:, None, :], (nr // MXFP4_SCALE_ROWS, MXFP4_SCALE_ROWS, cw)).reshape(nr, cw)


def _mxfp4_scale_table(s_ref, s_scr, kh: int):
    """The e8m0 scales of a block of ``kh`` byte rows (uint8 [>= kh/16, n]) as f32 2^(s - 127) in s_scr
    (from the exponent bits; s = 0 gives 0, TPU has no subnormals), once per weight block."""
    sr = kh // MXFP4_SCALE_ROWS
    s_scr[:sr, :] = lax.bitcast_convert_type(s_ref[:sr, :].astype(jnp.int32) << 23, jnp.float32)


MXFP4_UNIT = 2.0 ** -14  # what ``_mxfp4_values`` gives for a weight of 1: the kernel scales its sums back


def _mxfp4_values(w_ref, s_scr, r0, s0, nr: int, c0: int, cw: int, dtype, packed: bool):
    """(even inputs' weights, odd inputs') times ``MXFP4_UNIT``, in ``dtype``, of MXFP4 byte rows
    [r0, r0 + nr) (r0 a multiple of 32, maybe traced; s0 = r0 / 16), columns [c0, c0 + cw). The bytes are
    read as uint32 words (8-bit integer ops do not lower on TPU), each nibble moved into a float8_e5m2 byte
    (``_e2m1_as_e5m2``: its value times 2^-14) and converted by the fp8 unpack, then times the scale, an exact
    product (in packed bf16 with ``packed``: two values per op where the chip has bf16 arithmetic). Leaving
    2^-14 in the values for the f32 sums to take back saves a multiply per value (GPT-OSS at 64 tokens,
    modelled: v6e 1031.8 -> 976.0 us, v5e -9%); weights below 2^-112 (e8m0 scales under 2^-111) read as zero,
    where TPU's flush of non-normal numbers took those below 2^-126."""
    words = pltpu.bitcast(w_ref[pl.ds(r0, nr), pl.ds(c0, cw)], jnp.uint32)
    s = _mxfp4_scales(s_scr, s0, nr, c0, cw)
    if packed:
        s = s.astype(dtype)
    out = []
    for nibble in (0, 1):
        v = pltpu.bitcast(_e2m1_as_e5m2(words, nibble), jnp.float8_e5m2).astype(jnp.float32)
        if packed:  # every product is exact (powers of two): the same in bf16, two per op
            out.append(v.astype(dtype) * s)
        else:
            out.append((v * s).astype(dtype))
    return out


def _dequantize_mxfp4(lo_ref, hi_ref, w_ref, s_ref, s_scr, rows: int = _MXFP4_ROWS, cols: int = 1024,
                      bf16_vpu: bool = False):
    """MXFP4 weights of one block, [k/2, n] (w_ref uint8: byte row r holds inputs 2r, low nibble, and 2r + 1),
    with uint8 e8m0 scales s_ref [>= k/32, n] (rows past k/32 are padding), into VMEM: lo = the even inputs'
    rows, hi = the odd inputs', times ``MXFP4_UNIT``, in lo_ref's dtype (``_mxfp4_values``; ``bf16_vpu``:
    packed bf16 products for a bf16 destination); the kernel multiplies them with the lhs's even and odd
    columns. Chunks of ``rows`` x ``cols`` (a loop over row chunks, so the program stays small) keep the f32
    temporaries small; a row count off the 32-row uint8 tile (k/2 = 16 mod 32) ends with a chunk overlapping
    the previous one."""
    kh, n = w_ref.shape
    packed = bf16_vpu and jnp.dtype(lo_ref.dtype) == jnp.bfloat16
    _mxfp4_scale_table(s_ref, s_scr, kh)
    tile = 32  # uint8 rows per native tile: the unit the uint32 view needs
    if kh < tile:
        raise ValueError(f"MXFP4 weights need at least {2 * tile} inputs per block, got {2 * kh}")

    def decode(r0, s0, nr):  # nr weight rows from r0 (a multiple of 16, maybe traced); s0 = r0 / 16
        for c0 in range(0, n, cols):
            cw = min(cols, n - c0)
            lo, hi = _mxfp4_values(w_ref, s_scr, r0, s0, nr, c0, cw, lo_ref.dtype, packed)
            lo_ref[pl.ds(r0, nr), pl.ds(c0, cw)] = lo
            hi_ref[pl.ds(r0, nr), pl.ds(c0, cw)] = hi

    full = kh // rows
    if full:
        @pl.loop(0, full)
        def _chunk(c):
            decode(pl.multiple_of(c * rows, rows), pl.multiple_of(c * (rows // MXFP4_SCALE_ROWS), 8), rows)

    rest = kh % rows
    if rest:
        nr = _round_up(rest, tile)
        decode(kh - nr, (kh - nr) // MXFP4_SCALE_ROWS, nr)


def _mxfp4_dots(x_lo, x_hi, w_ref, s_scr, rows, n_rows: int, *, packed: bool, piece_rows: int = _MXFP4_ROWS,
                piece_cols: int = 256):
    """f32 x_lo[rows] @ lo + x_hi[rows] @ hi (``n_rows`` rows; times ``MXFP4_UNIT``), the MXFP4 block w_ref
    [k/2, n] (k/2 a multiple of 32) decoded inside the dots, piece by piece (``_mxfp4_values``), instead of
    into VMEM scratch first: the conversion's vector work and the MXU pushes share one block of code, which
    the scheduler interleaves. Per column piece a loop over ``piece_rows`` byte rows carries the
    [rows, piece_cols] f32 sum (in registers)."""
    kh, n = w_ref.shape
    dtype = x_lo.dtype
    full, rest = divmod(kh, piece_rows)
    out = []
    for c0 in range(0, n, piece_cols):
        cw = min(piece_cols, n - c0)

        def piece(r0, s0, nr, acc, c0=c0, cw=cw):
            lo, hi = _mxfp4_values(w_ref, s_scr, r0, s0, nr, c0, cw, dtype, packed)
            for x, w in ((x_lo, lo), (x_hi, hi)):
                acc = acc + jnp.dot(x[rows, pl.ds(r0, nr)], w, preferred_element_type=jnp.float32)
            return acc

        acc = jnp.zeros((n_rows, cw), jnp.float32)
        if full:
            acc = lax.fori_loop(0, full, lambda t, a: piece(pl.multiple_of(t * piece_rows, piece_rows),
                                                             pl.multiple_of(t * (piece_rows // MXFP4_SCALE_ROWS), 8),
                                                             piece_rows, a), acc)
        if rest:
            acc = piece(full * piece_rows, full * piece_rows // MXFP4_SCALE_ROWS, rest, acc)
        out.append(acc)
    return jnp.concatenate(out, axis=1) if len(out) > 1 else out[0]


def mxfp4_in_dots(m: int, groups: int, k: int) -> bool:
    """Whether gmm decodes MXFP4 weights inside each chunk's dots (``_mxfp4_dots``) rather than once per
    weight block into VMEM scratch: when groups average at most 2 rows (every chunk, and a group's second
    item in the next tile, decodes again) and k/2 is whole uint8 tiles (32 byte rows). The decode's vector
    work bounds both ways (a 128 x 256 byte piece: 104 bundles in the dots, 78 + 30 for the decode and the
    dots apart, v6e); modelled GPT-OSS when this was chosen (cost model v2, layer us): at 1 token (1 row a
    group) v5e 176.0 -> 160.0 us, v6e 137.7 -> 130.4, TPU7x even; at 64 tokens (8 rows) v5e even, v6e
    976.0 -> 989.4, TPU7x 678.3 -> 754.1."""
    return -(-m // groups) <= 2 and (k // 2) % 32 == 0


def per_channel(w) -> bool:
    """int8 weights: one scale per output channel, applied to the matmul's output columns (the weights
    convert exactly to bf16), so the scales stay [E, out] (lane-dense); fp8: 128x128 block scales,
    applied to the weights while dequantizing."""
    return jnp.dtype(w.dtype) == jnp.int8


def gate_up_scale_rows(scale_blocks: int, half: int, block_rows: int) -> tuple[int, int]:
    """(first scale block row, row offset in it) of the up half, which starts at weight row ``half``.

    A checkpoint quantizes gate and up as separate tensors, so when ``half`` is off the block grid
    the concatenated scales hold 2 * ceil(half / block) rows (transformers: at least 2) and up
    starts on a fresh block row; scales of the concatenated tensor (ceil(2 * half / block) rows)
    put up mid-block. Both agree when ``half`` is a block multiple.
    """
    if half % block_rows and scale_blocks == 2 * (-(-half // block_rows)):
        return -(-half // block_rows), 0
    return half // block_rows, half % block_rows


BF16_VPU = ("v6e", "tpu7x")  # generations whose vector unit computes on packed bf16 (two values per op)


def bf16_vpu(chip: str | None) -> bool:
    """The named (or current) chip has bf16 vector arithmetic; unknown (compiling from a CPU host): no."""
    return (chip or current_chip()) in BF16_VPU


def e4m3_mode(chip: str | None) -> str:
    """How the named (or current) chip turns float8_e4m3fn into values (see ``_e4m3_times``): "native" where
    the vector unit unpacks e4m3fn itself (TPU7x), "bf16" where it unpacks only e4m3b11fnuz but compares bf16
    natively (v6e), "f32" otherwise: no bf16 vector unit (v5e, or an unknown chip when compiling from a CPU host:
    right everywhere)."""
    chip = chip or current_chip()
    return "native" if chip == "tpu7x" else "bf16" if bf16_vpu(chip) else "f32"


def _e4m3_times(w, scale, mode: str = "f32"):
    """float8_e4m3fn values ``w`` times ``scale`` (a block of the scales, already in the destination dtype) in
    that dtype, as transformers dequantizes (``_dequantize_fp8_weight``: weight and ``scale_inv`` both cast to
    the compute dtype, one multiply; every e4m3fn value is exact in bf16). ``mode`` from ``e4m3_mode``.

    TPU7x converts e4m3fn itself. v5e and v6e unpack only e4m3b11fnuz (bias 11, no -0 or infinities, one NaN
    at 0x80), which reads every e4m3fn byte as its value / 16 (the 16 goes into the scale: a power of two, the
    same product) except -0 (0x80, NaN there) and the NaN codes 0x7f / 0xff (+-30 there, so +-480 times the
    scale: no quantizer writes them, it saturates at +-448, and ``from_pretrained_fp8`` refuses a checkpoint
    that holds them). -0 reads as +0: v6e picks it out by a compare of the packed bf16 values; v5e, which has no
    bf16 vector unit, clears the byte in the 32-bit words before the unpack (4 bytes an op, whole 32-row tiles).
    Compiled for a 512 x 2048 block, bundles per 1k weights against the exact f32 conversion with NaN fix-ups
    this replaced: v5e 1.96 -> 1.48, v6e 1.64 -> 0.96, TPU7x 0.71 -> 0.48."""
    dtype = scale.dtype
    if mode == "native":
        return w.astype(dtype) * scale
    scale = scale * 16
    if mode == "f32" and w.shape[0] % 32 == 0:
        words = pltpu.bitcast(lax.bitcast_convert_type(w, jnp.uint8), jnp.uint32)
        low = words & np.uint32(0x7F7F7F7F)
        keep = ((low + np.uint32(0x7F7F7F7F)) & np.uint32(0x80808080)) | np.uint32(0x7F7F7F7F)  # 0 at -0's sign
        w = lax.bitcast_convert_type(pltpu.bitcast(words & keep, jnp.uint8), jnp.float8_e4m3b11fnuz)
        return w.astype(dtype) * scale
    v = lax.bitcast_convert_type(w, jnp.float8_e4m3b11fnuz).astype(dtype)
    return jnp.where(v != v, jnp.zeros_like(scale), v * scale)


def _dequantized_pieces(w_ref, s_ref, dtype, *, block0=0, row_off: int = 0, step: int = 256, e4m3: str = "f32"):
    """(rows, cols, w * scale in ``dtype``) for each piece of w.

    w_ref [rows, k] quantized; s_ref [row blocks, col blocks] f32, the whole expert's 128x128 grid;
    weight row r uses scale block row ``block0 + (row_off + r) // 128`` (block0 may be traced).
    The weights go in pieces of at most 128 rows inside one scale block row by 256 columns (two scale
    blocks, each scale broadcast from its lane; 128 at an unaligned end): the f32 temporaries stay in
    registers. Expanding the whole scale grid over 256-row steps spilled it and the temporaries to VMEM,
    and those stores bounded the work. ``e4m3``: how the chip converts e4m3fn (``e4m3_mode``, ``_e4m3_times``).
    ``s_ref`` None (per-channel int8): a plain conversion, ``step`` rows at a time; the scales apply
    to the output.
    """
    rows_total, k = w_ref.shape
    if s_ref is None:
        for r in range(0, rows_total, step):
            rows = min(step, rows_total - r)
            yield slice(r, r + rows), slice(0, k), w_ref[r:r + rows, :].astype(dtype)
        return
    bn = FP8_BLOCK
    r = 0
    while r < rows_total:
        rows = min(bn - (row_off + r) % bn, rows_total - r)  # to the end of this scale block row
        s = s_ref[pl.ds(block0 + (row_off + r) // bn, 1), :].astype(dtype)
        c = 0
        while c < k:
            cols = 2 * bn if c + 2 * bn <= k else min(bn, k - c)
            scale = jnp.concatenate([jnp.broadcast_to(s[:, b:b + 1], (rows, min(bn, cols)))
                                     for b in range(c // bn, (c + cols + bn - 1) // bn)], axis=1)
            yield slice(r, r + rows), slice(c, c + cols), _e4m3_times(w_ref[r:r + rows, c:c + cols], scale, e4m3)
            c += cols
        r += rows


def _dequantize(dst_ref, w_ref, s_ref, **kw):
    """dst = w * scale (in dst's dtype), piece by piece (``_dequantized_pieces``)."""
    for rows, cols, v in _dequantized_pieces(w_ref, s_ref, dst_ref.dtype, **kw):
        dst_ref[rows, cols] = v


def _dequantized(w_ref, s_ref, dtype, **kw):
    """w * scale (in ``dtype``) as a value (``_dequantized_pieces``)."""
    rows_out, row = [], []
    for rows, cols, v in _dequantized_pieces(w_ref, s_ref, dtype, **kw):
        row.append(v)
        if cols.stop == w_ref.shape[1]:
            rows_out.append(jnp.concatenate(row, axis=1) if len(row) > 1 else row[0])
            row = []
    return jnp.concatenate(rows_out, axis=0) if len(rows_out) > 1 else rows_out[0]


def _new_weights(fetch_group, i):
    """The weight blocks changed at grid step i (first step, or another group's blocks): dequantize."""
    return jnp.logical_or(i == 0, fetch_group[i] != fetch_group[jnp.maximum(i - 1, 0)])


# --------------------------------------------------------------------------- gmm kernel

class GmmQuant(NamedTuple):
    """How the gmm kernel dequantizes its weights (static: part of the kernel's partial)."""

    kind: str  # "block" (fp8/int8 with 128x128 scale blocks), "channel" (int8 per column), "mxfp4"
    starts: tuple  # (first scale block row, row offset) of each weight (gate, up) in its scale grid
    e4m3: str  # how the chip converts e4m3fn (``e4m3_mode``)
    in_dots: bool  # MXFP4: decode the weights inside the dots (``mxfp4_in_dots``)
    bf16_vpu: bool  # the chip does bf16 VPU math (``bf16_vpu``): MXFP4 values decoded in packed bf16


class MoeQuant(NamedTuple):
    """How the fused experts kernel dequantizes its weights (static)."""

    channel: bool  # int8 per output column (else fp8/int8 with 128x128 scale blocks)
    up_start: tuple  # (first scale block row, row offset) of the up half in gate_up's scale grid
    e4m3: str  # how the chip converts e4m3fn (``e4m3_mode``)
    in_dots: bool  # dequantize inside the dots (``dequantize_in_dots``), not into VMEM scratch once per group


def _deinterleave(y):
    """(tm, 2t) f32 with gate/up in even/odd lanes -> two (tm, t). Mosaic has no lane-strided loads, so
    transpose (lanes become sublanes), split sublane pairs, transpose back (XLU work only; the transposes move
    the bits as int32, free bitcasts on TPU: XLA:CPU, which runs the kernel in interpret mode, folds a
    transpose of a bf16 x bf16 -> f32 dot into a dot it cannot execute, "DotThunk ... BF16 x BF16 = F32").
    Exact, for any dtype; ``_activate_pairs`` is the faster way where it applies."""
    pairs = lax.bitcast_convert_type(y, jnp.int32).T.reshape(y.shape[1] // 2, 2, y.shape[0])
    return tuple(lax.bitcast_convert_type(pairs[:, i, :].T, y.dtype) for i in (0, 1))


# GPT-OSS's interleaved gate/up lanes, activated as pairs (``_activate_pairs``) rather than split by transposes
# (``_deinterleave``) then activated: the transposes' XLU and select work (a chunk of the fused MLP for
# GPT-OSS-20B at 8192 tokens on v6e: 1260 vxpose, 3360 vcombine, 3858 vsel, 2880 vrot) gives way to a roll, the
# activation over both lanes of a pair and gathering dots, 5% more MXU work (1292 -> 1359 vmatmuls an MXU):
# 12859 / 13121 bundles a chunk -> 11720 / 11646. Layer us (cost model, v5e / v6e / TPU7x; it also replaced a
# split on the MXU, in hi + lo bf16 parts, where experts averaged up to 512 rows on v6e and TPU7x): GPT-OSS-20B
# at 8192 tokens v6e / TPU7x 3502.7 / 2805.6 -> 3204.6 / 2542.5, 2048 1111.3 / 727.3 -> 1108.5 / 709.8; MXFP4 at
# 1 / 64 tokens v5e 144.8 / 1278.9 -> 129.1 / 1195.3, v6e 103.6 / 881.9 -> 102.5 / 858.6, TPU7x 75.6 / 558.2 ->
# 74.2 / 544.0; 1 to 256 tokens in bf16 unchanged (the weights' DMA bounds them). But v5e's fused MLP at 2048 /
# 8192 tokens (128-wide MXU; a chunk bound by its vector loads and adds, 33179 -> 34815 bundles) 2756.1 / 10703.8
# -> 2828.2 / 10970.8: on a 128-wide MXU only decode-sized groups (``DECODE_GROUP_ROWS``) take pairs.
PAIR_BLOCK = 256  # lanes of interleaved pairs one gathering dot takes, for half as many outputs


def activates_pairs(m: int, groups: int, chip: str | None = None) -> bool:
    """Whether kernels over ``m`` rows of ``groups`` experts activate interleaved gate/up as pairs (see above)."""
    return _chip(chip).mxu_dim >= 256 or -(-m // max(groups, 1)) <= DECODE_GROUP_ROWS


def _pairs(interleaved: bool, width: int, dtype, m: int, groups: int, chip, forced: bool | None) -> bool:
    """A kernel's interleaved gate/up activation: as pairs (``forced``, else ``activates_pairs``) where
    ``_activate_pairs`` takes them: a ``width`` (2t lanes a weight block) of whole lane tiles, and bf16 results
    (the gathering dots copy values already rounded to them); never for [gate; up] halves."""
    able = interleaved and width % 128 == 0 and jnp.dtype(dtype) == jnp.bfloat16
    return able and (activates_pairs(m, groups, chip) if forced is None else forced)


def _activate_pairs(y, activation: str, alpha: float, limit: float, dtype):
    """act(gate, up) of interleaved gate/up lanes y (rows, 2t) f32, gate / up in even / odd lanes -> (rows, t)
    in ``dtype`` (bf16). Each even lane is activated where it is, its up a lane over (a roll within each
    128-lane tile: no pair straddles one); the odd lanes, zeroed (whatever they hold: an infinite up clamps to a
    finite value, a NaN must not reach the dots), are dropped by the MXU: each PAIR_BLOCK lanes times a 0/1
    [PAIR_BLOCK, PAIR_BLOCK / 2] matrix, one term an output (exact)."""
    up = jnp.concatenate([pltpu.roll(y[:, b:b + 128], 127, 1) for b in range(0, y.shape[1], 128)], axis=1)
    even = lax.broadcasted_iota(jnp.int32, (1, y.shape[1]), 1) % 2 == 0
    h = jnp.where(even, _activate(y, up, activation, alpha, limit), 0.0).astype(dtype)
    r, c = (lax.broadcasted_iota(jnp.int32, (PAIR_BLOCK, PAIR_BLOCK // 2), d) for d in (0, 1))
    pick = (r == 2 * c).astype(dtype)
    out = []
    for b in range(0, h.shape[1], PAIR_BLOCK):
        w = min(PAIR_BLOCK, h.shape[1] - b)
        out.append(lax.dot_general(h[:, b:b + w], pick[:w, :w // 2], (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32).astype(dtype))
    return jnp.concatenate(out, axis=1) if len(out) > 1 else out[0]


def _gmm_kernel(bounds, item_group, item_tile, fetch_group, fetch_tile, *refs,
                tm, tn, chunk, num_groups, transposed, activation, interleaved, alpha, limit, has_bias, quant,
                pairs):
    del fetch_tile  # index maps only
    n_w = 2 if activation != "none" and not interleaved else 1
    mxfp4 = quant is not None and quant.kind == "mxfp4"
    n_x = 2 if mxfp4 else 1  # MXFP4: the lhs's even and odd columns, for the weights' two nibbles
    lhs_refs, w_refs = refs[:n_x], refs[n_x:n_x + n_w]
    refs = refs[n_x - 1:]  # as if there were one lhs
    b_refs = refs[1 + n_w:1 + 2 * n_w] if has_bias else ()
    i = pl.program_id(1)
    grp, tile = item_group[i], item_tile[i]
    first = jnp.logical_or(i == 0, item_tile[jnp.maximum(i - 1, 0)] != tile)
    col_scales = [None] * n_w  # per-channel scales of each weight's output columns in this tile
    if quant is None:
        out_ref = refs[-1]
    else:  # dequantize each new weight block once into VMEM scratch; the MXU sees the compute dtype
        kind, starts, e4m3, in_dots, packed_bf16 = quant
        channel = kind == "channel"
        # MXFP4: the weight dequantizes into even- and odd-input halves, plus its scales in f32 (in the dots:
        # the scales only)
        n_d = (1 if in_dots else 3) if mxfp4 else n_w
        s_ref, out_ref, deq_refs = refs[-2 - n_d], refs[-1 - n_d], refs[-n_d:]
        j = pl.program_id(0)

        @pl.when(_new_weights(fetch_group, i))
        def _dequant():
            if mxfp4 and in_dots:  # the weights decode inside the dots (``_mxfp4_dots``)
                _mxfp4_scale_table(s_ref, deq_refs[-1], w_refs[0].shape[0])
                return
            if mxfp4:
                _dequantize_mxfp4(deq_refs[0], deq_refs[1], w_refs[0], s_ref, deq_refs[2], bf16_vpu=packed_bf16)
                return
            for w, d, (b0, off) in zip(w_refs, deq_refs, starts):
                # tn is a block multiple when there are several n tiles (no traced floor division:
                # Mosaic lowers its sign fix-up by asking the runtime for the chip, none when compiling AOT)
                first_block = j * (tn // FP8_BLOCK) if tn % FP8_BLOCK == 0 else 0
                _dequantize(d, w, None if channel else s_ref, block0=first_block + b0, row_off=off,
                            e4m3=e4m3)

        if not (mxfp4 and in_dots):
            w_refs = deq_refs[:2] if mxfp4 else deq_refs
        if channel:  # starts hold each weight's first output column: 0, and n for up
            col_scales = [lambda off=off: s_ref[pl.ds(jnp.minimum(grp, num_groups - 1), 1), pl.ds(j * tn + off, tn)]
                          for off, _ in starts]

    @pl.when(grp < num_groups)
    def _compute():
        start, end = bounds[i], bounds[i + 1]
        dims = _dims(transposed)

        def epilogue(rows, n_rows):  # the output rows ``rows`` of the tile, f32
            if mxfp4 and in_dots:
                ys = [_mxfp4_dots(lhs_refs[0], lhs_refs[1], w_refs[0], deq_refs[-1], rows, n_rows,
                                  packed=e4m3 != "f32" and lhs_refs[0].dtype == jnp.bfloat16) * (1 / MXFP4_UNIT)]
            elif mxfp4:  # even inputs x even weights + odd x odd (weights times MXFP4_UNIT)
                ys = [sum(lax.dot_general(x[rows, :], w[...], dims, preferred_element_type=jnp.float32)
                          for x, w in zip(lhs_refs, w_refs)) * (1 / MXFP4_UNIT)]
            else:
                ys = [lax.dot_general(lhs_refs[0][rows, :], w[...], dims, preferred_element_type=jnp.float32)
                      for w in w_refs]
            ys = [y if cs is None else y * cs() for y, cs in zip(ys, col_scales)]
            if has_bias:
                ys = [y + b[...].astype(jnp.float32) for y, b in zip(ys, b_refs)]
            if pairs:
                return _activate_pairs(ys[0], activation, alpha, limit, out_ref.dtype)
            if interleaved:
                ys = _deinterleave(ys[0])
            return ys[0] if activation == "none" else _activate(ys[0], ys[1], activation, alpha, limit)

        def mine(y, r0):
            rows = tile * tm + r0 + lax.broadcasted_iota(jnp.int32, y.shape, 0)
            return jnp.logical_and(rows >= start, rows < end)

        if chunk == tm:  # one pass over the tile; the first item on it zeroes the rows no group writes
            y = epilogue(slice(None), tm)
            keep = jnp.where(first, jnp.zeros(out_ref.shape, out_ref.dtype), out_ref[...])
            out_ref[...] = jnp.where(mine(y, 0), y.astype(out_ref.dtype), keep)
            return

        @pl.when(first)
        def _zero():
            out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

        def chunk_rows(r0, n_rows=chunk):
            rows = pl.ds(r0, n_rows)
            y = epilogue(rows, n_rows)
            out_ref[rows, :] = jnp.where(mine(y, r0), y.astype(out_ref.dtype), out_ref[rows, :])

        sub = _sublanes(lhs_refs[0].dtype)
        _for_group_rows(jnp.clip(start - tile * tm, 0, tm), jnp.clip(end - tile * tm, 0, tm), tm=tm, chunk=chunk,
                        sub=sub, body=chunk_rows, tails=chunk_tails(chunk, sub))

    @pl.when(jnp.logical_and(grp >= num_groups, first))
    def _tail():  # a tile of rows in no group (past sum(group_sizes)): ragged_dot defines them as zero
        out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)


def gmm(lhs, rhs, group_sizes, *, transposed: bool = False, out_dtype=None, tm: int | None = None,
        tn: int | None = None, activation: str = "none", interleaved: bool = False, alpha: float = 1.702,
        limit: float = 7.0, bias=None, rhs_scale=None, chip: str | None = None,
        vmem_limit_bytes: int | None = None, chunk: int | None = None, in_dots: bool | None = None,
        row_groups=None, pairs: bool | None = None):
    """out[rows of group i] = epilogue(lhs[rows] @ rhs[i]); rows past sum(group_sizes) are 0.
    ``row_groups`` [m] (the sorted group of each row, g for none; ``run_metadata``) replaces group_sizes.

    rhs is [g, k, n], or [g, n, k] with ``transposed`` (transformers' layout, used as is). With a
    gated ``activation`` the weight's n holds [gate; up] halves (or, ``interleaved``, gate and up in
    alternate columns, GPT-OSS) and the output is n/2 wide: act(lhs @ gate) * (lhs @ up).
    ``bias`` [g, n] is added to the f32 accumulator first. ``rhs_scale``: rhs is quantized
    (``QUANT_DTYPES``, transposed; fp8 and int8 not interleaved) and is dequantized in VMEM to lhs's
    dtype, once per weight block (HBM moves the quantized bytes and the scales only). MXFP4 (uint8) rhs is
    [g, k/2, n] (not ``transposed``: byte row r holds inputs 2r and 2r + 1) with e8m0 scales [g, >= k/32, n],
    one weight block per step (plain, or interleaved gate/up). ``chunk``: rows per iteration of the loop
    over a group's rows in a tile (default ``gmm_chunk_rows``; tm: the whole tile at once). ``in_dots``:
    MXFP4 weights decode inside each chunk's dots rather than once per block into scratch (default
    ``mxfp4_in_dots``). ``pairs``: interleaved gate/up activated as pairs (default
    ``activates_pairs``; bf16 results only, else split by transposes).
    No validation here: ``ragged_dot`` and the experts op validate their inputs.
    """
    m, k = lhs.shape
    g = rhs.shape[0]
    n_full = rhs.shape[1] if transposed else rhs.shape[2]
    gated = activation != "none"
    n_w = 2 if gated and not interleaved else 1  # weight blocks per step
    n = n_full // 2 if gated else n_full
    out_dtype = jnp.dtype(out_dtype or lhs.dtype)
    if tm is None or tn is None:
        # the weights' VMEM in units of k x tn: [gate; up]'s two blocks, or an interleaved one 2 tn wide; a third
        # where that one is split by transposes (their temporaries) or dequantized from MXFP4 (its scratch).
        # Compiled for TPU7x, GPT-OSS-20B's gate_up (pairs) at 8192 rows in (512, 1536) blocks needs 44-47 MiB
        # of VMEM, in (512, 1024) 30-34: two units estimate 46.8 and 33.1, three 65.2 and 45.4. Pairs counted
        # where all 2n interleaved columns are whole lane tiles: then so is every block's 2 tn (tn: 128s or n)
        as_pairs = _pairs(interleaved and gated, 2 * n, out_dtype, m, g, chip, pairs)
        units = 1 if not gated else 2 if not interleaved or (as_pairs and rhs_scale is None) else 3
        try:
            ctm, ctn = choose_gmm_tiling(m, k, n, g, in_dtype=lhs.dtype, out_dtype=out_dtype, chip=chip,
                                         n_weights=units, lane_n=not transposed,
                                         divisors_only=n_w == 2, quantized=rhs_scale is not None)
        except ValueError:
            if n_w != 2 or tm is not None or tn is not None:
                raise
            # [gate; up] halves whose width no fitting 128-multiple divides (GPT-OSS's 2880 at k = 2880): the
            # whole [gate; up] product in one pass, the activation after it (an [m, 2n] temporary in HBM, in
            # the output dtype, as transformers' grouped_mm keeps it), in column tiles dividing 2n if any fit
            try:
                ftm, ftn = choose_gmm_tiling(m, k, 2 * n, g, in_dtype=lhs.dtype, out_dtype=out_dtype, chip=chip,
                                             lane_n=not transposed, divisors_only=True, quantized=rhs_scale is not None)
            except ValueError:
                ftm = ftn = None
            both = gmm(lhs, rhs, group_sizes, transposed=transposed, out_dtype=out_dtype, tm=ftm, tn=ftn, bias=bias,
                       rhs_scale=rhs_scale, chip=chip, vmem_limit_bytes=vmem_limit_bytes, row_groups=row_groups)
            both = both.astype(jnp.float32)
            return _activate(both[:, :n], both[:, n:], activation, alpha, limit).astype(out_dtype)
        tm, tn = tm or ctm, tn or ctn
        if n_w == 2 and n % tn:
            tn = n
    if n_w == 2 and n % tn:  # the up block sits n/tn blocks after the gate block
        raise ValueError(f"a fused [gate; up] activation needs tn to divide the half width n/2={n}, got tn={tn}")
    chunk = chunk or gmm_chunk_rows(m, g, tm, chip)
    sub = _sublanes(lhs.dtype)
    if tm % sub or chunk % sub or chunk > tm:
        raise ValueError(f"gmm: tm={tm} and chunk={chunk} must be multiples of {sub} (lhs is {lhs.dtype}), "
                         "chunk at most tm")
    tiles_n = -(-n // tn)
    up_off = n // tn if n_w == 2 else 0
    wn = 2 * tn if interleaved else tn  # weight columns per block
    bounds, item_group, item_tile, fetch_group, fetch_tile, num_items = run_metadata(
        rows_of_groups(group_sizes, m) if row_groups is None else row_groups, tm, g)

    def lhs_map(j, i, off, ig, it, fg, ft):
        return ft[i], 0

    def w_map(shift):
        if transposed:
            return lambda j, i, off, ig, it, fg, ft: (fg[i], j + shift, 0)
        return lambda j, i, off, ig, it, fg, ft: (fg[i], 0, j + shift)

    def b_map(shift):
        return lambda j, i, off, ig, it, fg, ft: (fg[i], 0, j + shift)

    mxfp4 = rhs_scale is not None and is_mxfp4(rhs)
    kw = k // 2 if mxfp4 else k  # MXFP4: the lhs is passed as its even and odd columns, k/2 each
    w_block = (None, wn, kw) if transposed else (None, kw, wn)
    in_specs = [pl.BlockSpec((tm, kw), lhs_map) for _ in range(2 if mxfp4 else 1)]
    in_specs += [pl.BlockSpec(w_block, w_map(s * up_off)) for s in range(n_w)]
    operands = ([lhs[:, 0::2], lhs[:, 1::2]] if mxfp4 else [lhs]) + [rhs] * n_w
    if bias is not None:
        in_specs += [pl.BlockSpec((None, 1, wn), b_map(s * up_off)) for s in range(n_w)]
        operands += [bias.reshape(g, 1, n_full)] * n_w
    out_spec = pl.BlockSpec((tm, tn), lambda j, i, off, ig, it, fg, ft: (it[i], j))
    quant, scratch = None, []
    if rhs_scale is not None:
        if transposed == mxfp4 or (interleaved and not mxfp4) or (mxfp4 and n_w != 1):
            raise NotImplementedError("quantized weights: fp8 and int8 in the [g, n, k] layout with [gate; up] "
                                      "halves, MXFP4 in the [g, k/2, n] layout with one weight block per step")
        channel = per_channel(rhs)
        if mxfp4:  # e8m0 scales per 32 inputs, [g, >= k/32, n]: blocked like the weight columns
            starts = [(0, 0)]
            # kept in HBM: XLA would otherwise prefetch every expert's scales (they fit) into VMEM before the call
            scales = in_hbm(rhs_scale)
            in_specs.append(pl.BlockSpec((None, rhs_scale.shape[1], wn), w_map(0)))
        elif channel:  # [g, n_full] whole in VMEM (a few MiB at most), the group's row read per tile
            starts = [(0, 0)] + ([(n, 0)] if n_w == 2 else [])
            need_cols = max(off + tiles_n * tn for off, _ in starts)
            scales = rhs_scale if need_cols <= n_full else jnp.pad(rhs_scale, ((0, 0), (0, need_cols - n_full)))
            in_specs.append(pl.BlockSpec(scales.shape, lambda j, i, off, ig, it, fg, ft: (0, 0)))
        else:  # [g, n/128, k/128] block grid: the group's whole grid (full dims), sliced per tile in-kernel
            if tiles_n > 1 and tn % FP8_BLOCK:
                raise ValueError(f"fp8 weights need tn to be a multiple of {FP8_BLOCK}, got {tn}")
            starts = [(0, 0)] + ([gate_up_scale_rows(rhs_scale.shape[1], n, FP8_BLOCK)] if n_w == 2 else [])
            need_blocks = max(b0 + -(-(off + tiles_n * tn) // FP8_BLOCK) for b0, off in starts)
            scales = rhs_scale if need_blocks <= rhs_scale.shape[1] else jnp.pad(  # last n tile overhangs
                rhs_scale, ((0, 0), (0, need_blocks - rhs_scale.shape[1]), (0, 0)))
            in_specs.append(pl.BlockSpec((None,) + scales.shape[1:], lambda j, i, off, ig, it, fg, ft: (fg[i], 0, 0)))
        if in_dots is None:
            in_dots = mxfp4 and mxfp4_in_dots(m, g, k)
        if in_dots and not (mxfp4 and kw % 32 == 0):
            raise ValueError(f"in_dots: MXFP4 weights with k/2 a multiple of 32 only, got {rhs.dtype} and k={k}")
        quant = GmmQuant("mxfp4" if mxfp4 else "channel" if channel else "block", tuple(starts), e4m3_mode(chip),
                         in_dots, bf16_vpu(chip))
        operands.append(scales)  # f32 (uint8 for MXFP4), validated by the experts op
        s_scr = pltpu.VMEM((_round_up(rhs_scale.shape[1], 8), wn), jnp.float32) if mxfp4 else None
        scratch = [s_scr] if in_dots else [pltpu.VMEM((kw, wn), lhs.dtype) for _ in range(2)] + [s_scr] if mxfp4 \
            else [pltpu.VMEM((wn, kw), lhs.dtype) for _ in range(n_w)]

    inb, outb = lhs.dtype.itemsize, out_dtype.itemsize
    if vmem_limit_bytes is None:
        need = gmm_vmem_bytes(tm, tn, k, inb, outb, 2 if gated else 1, quantized=quant is not None, chunk=chunk) + (
            4 * tm * wn * 4 if interleaved else 0) + (2 * operands[-1].size * 4 if quant and quant.kind == "channel" else 0)
        vmem_limit_bytes = _vmem_limit(need, chip)
    kernel = functools.partial(_gmm_kernel, tm=tm, tn=tn, chunk=chunk, num_groups=g, transposed=transposed, activation=activation,
                               interleaved=interleaved, alpha=float(alpha), limit=float(limit),
                               has_bias=bias is not None, quant=quant,
                               pairs=_pairs(interleaved and gated, wn, out_dtype, m, g, chip, pairs))
    wb = rhs.dtype.itemsize
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(tiles_n, num_items), in_specs=in_specs, out_specs=out_spec,
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        cost_estimate=pl.CostEstimate(flops=2 * m * k * n_full, transcendentals=0,
                                      bytes_accessed=g * k * n_full * wb + m * k * inb + m * n * outb),
        name="ragged_dot_gmm",
    )(bounds, item_group, item_tile, fetch_group, fetch_tile, *operands)


# --------------------------------------------------------------------------- tgmm kernel

def _tgmm_kernel(offsets, item_group, item_tile, fetch_group, fetch_tile, x_ref, y_ref, out_ref, acc_ref, *, tm):
    del fetch_group, fetch_tile
    i, last_i = pl.program_id(2), pl.num_programs(2) - 1
    grp, tile = item_group[i], item_tile[i]
    first = jnp.logical_or(i == 0, item_group[jnp.maximum(i - 1, 0)] != grp)
    last = jnp.logical_or(i == last_i, item_group[jnp.minimum(i + 1, last_i)] != grp)
    start, end = offsets[grp], offsets[grp + 1]

    @pl.when(first)
    def _zero():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(end > start)
    def _accumulate():
        rows_x = tile * tm + lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
        rows_y = tile * tm + lax.broadcasted_iota(jnp.int32, y_ref.shape, 0)
        x = jnp.where((rows_x >= start) & (rows_x < end), x_ref[...], 0).astype(x_ref.dtype)
        y = jnp.where((rows_y >= start) & (rows_y < end), y_ref[...], 0).astype(y_ref.dtype)
        acc_ref[...] += lax.dot_general(x, y, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(last)
    def _store():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def tgmm(x, y, group_sizes, *, out_dtype=None, tm: int | None = None, tk: int | None = None,
         tn: int | None = None, chip: str | None = None):
    """out[i] = x[rows of group i]^T @ y[rows of group i] -> [g, kx, ny]; empty groups give zeros."""
    m, kx = x.shape
    ny = y.shape[1]
    g = group_sizes.shape[0]
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if tm is None or tk is None or tn is None:
        ctm, ctk, ctn = choose_tgmm_tiling(m, kx, ny, in_dtype=x.dtype, out_dtype=out_dtype, chip=chip)
        tm, tk, tn = tm or ctm, tk or ctk, tn or ctn
    offsets, item_group, item_tile, fetch_group, fetch_tile, num_items = group_metadata(group_sizes, m, tm)
    need = 2 * tm * (tk + tn) * x.dtype.itemsize + 3 * tk * tn * 4 + 2 * tm * (tk + tn) * 4
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tm=tm),
        out_shape=jax.ShapeDtypeStruct((g, kx, ny), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=5, grid=(-(-kx // tk), -(-ny // tn), num_items),
            in_specs=[pl.BlockSpec((tm, tk), lambda a, b, i, off, ig, it, fg, ft: (ft[i], a)),
                      pl.BlockSpec((tm, tn), lambda a, b, i, off, ig, it, fg, ft: (ft[i], b))],
            out_specs=pl.BlockSpec((None, tk, tn), lambda a, b, i, off, ig, it, fg, ft: (ig[i], a, b)),
            scratch_shapes=[pltpu.VMEM((tk, tn), jnp.float32)]),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=_vmem_limit(need, chip)),
        name="ragged_dot_tgmm",
    )(offsets, item_group, item_tile, fetch_group, fetch_tile, x, y)


# --------------------------------------------------------------------------- validation

def validate(lhs, rhs, group_sizes, rhs_transposed=False, out_dtype="", tile_m=0, tile_n=0):
    """Clear errors before anything is traced or launched; sizes are checked when on the host."""
    check_array("lhs", lhs, dtypes=DTYPES, ndim=2)
    check_array("rhs", rhs, dtypes=DTYPES, ndim=3)
    check_array("group_sizes", group_sizes, dtypes=SIZE_DTYPES, ndim=1)
    if dtype_name(lhs) != dtype_name(rhs):
        raise TypeError(f"lhs and rhs must have the same dtype, got {dtype_name(lhs)} and {dtype_name(rhs)}")
    if out_dtype and out_dtype not in DTYPES:
        raise TypeError(f"out_dtype must be one of {DTYPES} (or '' for lhs's dtype), got {out_dtype!r}")
    m, k = lhs.shape
    g = rhs.shape[0]
    rk = rhs.shape[2] if rhs_transposed else rhs.shape[1]
    if rk != k:
        layout = "[g, n, k] (rhs_transposed)" if rhs_transposed else "[g, k, n]"
        raise ValueError(f"contraction mismatch: lhs is [m, k] = {tuple(lhs.shape)} but rhs {layout} "
                         f"has k = {rk} (shape {tuple(rhs.shape)})")
    if group_sizes.shape[0] != g:
        raise ValueError(f"group_sizes must have one entry per group of rhs ({g}), got {group_sizes.shape[0]}")
    sub = _sublanes(dtype_name(lhs))  # a row tile is whole sublane tiles of lhs's dtype
    for name, t, unit in (("tile_m", tile_m, sub), ("tile_n", tile_n, 128)):
        if t < 0 or (t and t % unit):
            why = f" (lhs is {dtype_name(lhs)})" if name == "tile_m" else ""
            raise ValueError(f"{name} must be 0 (automatic) or a positive multiple of {unit}{why}, got {t}")
    sizes = host_values(group_sizes)  # None on device or under jit: the kernel clamps (group_metadata)
    if sizes is not None:
        sizes = sizes.astype(np.int64)
        if (sizes < 0).any():
            raise ValueError(f"group_sizes must be non-negative, got {sizes.tolist()}")
        if sizes.sum() > m:
            raise ValueError(f"group_sizes sum to {int(sizes.sum())}, more than the {m} rows of lhs")


def _is_empty(lhs, rhs) -> bool:
    """A zero-size ragged_dot (m, k, n or the number of groups is 0): the result is all zeros
    ([m, n], as jax.lax.ragged_dot), so no kernel runs (its blocks cannot be empty)."""
    return 0 in lhs.shape or 0 in rhs.shape


# --------------------------------------------------------------------------- ragged_dot with its VJP

@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ragged_dot(lhs, rhs, group_sizes, cfg):
    transposed, out_dtype, tm, tn = cfg
    return gmm(lhs, rhs, group_sizes, transposed=transposed, out_dtype=out_dtype, tm=tm or None, tn=tn or None)


def _ragged_dot_fwd(lhs, rhs, group_sizes, cfg):
    return _ragged_dot(lhs, rhs, group_sizes, cfg), (lhs, rhs, group_sizes)


def ragged_dot_backward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, dout: jax.Array,
                        rhs_transposed: bool = False) -> tuple[jax.Array, jax.Array]:
    """(d lhs, d rhs) of ragged_dot: dlhs = the grouped matmul with rhs transposed (the other
    layout flag, same array), drhs = tgmm, in rhs's own layout. Runs in the input dtype."""
    if _is_empty(lhs, rhs):  # zero-size forward: its gradients are zero (or empty)
        return jnp.zeros_like(lhs), jnp.zeros_like(rhs)
    group_sizes = group_sizes.astype(jnp.int32)
    dout = dout.astype(lhs.dtype)  # backward matmuls run in the input dtype, f32 accumulation
    dlhs = gmm(dout, rhs, group_sizes, transposed=not rhs_transposed, out_dtype=lhs.dtype)
    drhs = tgmm(dout, lhs, group_sizes, out_dtype=rhs.dtype) if rhs_transposed else \
        tgmm(lhs, dout, group_sizes, out_dtype=rhs.dtype)
    return dlhs, drhs


def _ragged_dot_bwd(cfg, res, dout):
    lhs, rhs, group_sizes = res
    dlhs, drhs = ragged_dot_backward(lhs, rhs, group_sizes, dout, cfg[0])
    return dlhs, drhs, np.zeros(group_sizes.shape, jax.dtypes.float0)


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, rhs_transposed: bool = False,
               out_dtype: str = "", tile_m: int = 0, tile_n: int = 0) -> jax.Array:
    """jax.lax.ragged_dot on TPU: lhs [m, k], rhs [g, k, n] (or [g, n, k] with rhs_transposed),
    group_sizes [g] (any integer dtype) -> [m, n] in ``out_dtype`` (default lhs's), f32 accumulation.

    Rows of lhs are consecutive groups; rows past sum(group_sizes) come out zero. Zero sizes give
    jax.lax.ragged_dot's result: m = 0 -> [0, n]; k = 0 or no groups -> zeros [m, n].
    Differentiable in lhs and rhs. tile_m / tile_n: 0 picks them per chip and shape (see
    choose_gmm_tiling).
    """
    validate(lhs, rhs, group_sizes, rhs_transposed, out_dtype, tile_m, tile_n)
    cfg = (bool(rhs_transposed), out_dtype or dtype_name(lhs), int(tile_m), int(tile_n))
    if _is_empty(lhs, rhs):
        return jnp.zeros((lhs.shape[0], rhs.shape[1] if rhs_transposed else rhs.shape[2]), cfg[1])
    return _ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32), cfg)


def reference(lhs, rhs, group_sizes, rhs_transposed=False, out_dtype=None):
    """Plain JAX, obviously right: each group's rows times its matrix, f32, everything else 0."""
    w = jnp.swapaxes(rhs, 1, 2) if rhs_transposed else rhs
    ends = jnp.cumsum(group_sizes)
    rows = jnp.arange(lhs.shape[0])[:, None]
    out = jnp.zeros((lhs.shape[0], w.shape[2]), jnp.float32)
    for i in range(w.shape[0]):
        mine = (rows >= ends[i] - group_sizes[i]) & (rows < ends[i])
        y = jnp.dot(lhs.astype(jnp.float32), w[i].astype(jnp.float32), precision=lax.Precision.HIGHEST)
        out = jnp.where(mine, y, out)
    return out.astype(out_dtype or lhs.dtype)


# --------------------------------------------------------------------------- fused expert MLP

def _moe_kernel(bounds, item_group, item_tile, fetch_group, fetch_tile, *refs, tm, chunk, num_groups,
                transposed, down_transposed, activation, interleaved, alpha, limit, has_bias, quant, i_tiles,
                combine, gather, windows, last_window, pairs, straight_adds, sum_cols=None, tails=()):
    del fetch_tile
    smem_weights = gather and windows
    if sum_cols is not None:  # the rows' other columns: two buffers of an item's rows on their way to rest_ref, a
        # native tile of rows read back, their DMAs' semaphores, (SMEM) the next buffer and whether the other's
        # DMA is in flight
        refs, (rbuf, lead, rsem, rflag) = refs[:-4], refs[-4:]
    if combine is not None:  # each row's token (scalar-prefetched) and routing weight: the item's rows' block
        # as x's, or (gathered windows) all rows' as f32 bits, scalar-prefetched too; a chunk of weighted rows
        # (``straight_adds``: two, and the pending one's (slot, first row, rows [lo, hi) of it) in SMEM); the
        # tokens' f32 sums, and two blocks of them in the output's dtype on their way to HBM
        refs, (sums, obuf, osem) = refs[:-3], refs[-3:]
        if straight_adds:
            refs, pend = refs[:-1], refs[-1]
        if smem_weights:
            row_token, row_weight, x_ref, refs = refs[0], refs[1], refs[2], refs[3:]
            refs, wbuf = refs[:-1], refs[-1]  # the chunk's rows' weights, each row's in every lane
        else:
            row_token, x_ref, row_weight, refs = refs[0], refs[1], refs[2], refs[3:]
        if gather:  # the tokens' rows' f32 copy, a chunk's rows gathered from it, the rows' staging buffer
            refs, (xs, xbuf, stage, sem) = refs[:-4], refs[-4:]
        refs, ybuf = refs[:-1], refs[-1]
    else:
        x_ref, refs = refs[0], refs[1:]
    n_w = 1 if interleaved else 2
    w_refs, d_ref = refs[:n_w], refs[n_w]
    b_refs, db_ref = (refs[n_w + 1:2 * n_w + 1], refs[2 * n_w + 1]) if has_bias else ((), None)
    if i_tiles > 1:  # the down products of the intermediate's tiles add up in f32 scratch (unquantized only)
        refs, acc_ref = refs[:-1], refs[-1]
    i, j = pl.program_id(0), pl.program_id(1)
    grp, tile = item_group[i], item_tile[i]
    # the item's rows lie in [row0, row0 + span): a tile, or a window of run_metadata(windows=sub) from a
    # native tile's first row (x's block there; one that would pass x's last row starts at ``last_window``
    # instead, the window's rows still inside it)
    sub = _sublanes(x_ref.dtype)
    row0, span = (tile if last_window is None else jnp.minimum(tile, last_window), tm + sub) if windows else (tile * tm, tm)
    col_scales, d_scale = [None, None], None
    # each slab's value as the MXU takes it: read from VMEM, or (quantized) dequantized to x's dtype
    weights, down = [lambda w=w: w[...] for w in w_refs], lambda: d_ref[...]  # noqa: E731
    mxu_dtype = d_ref.dtype if quant is None else x_ref.dtype
    n_out = 1 if sum_cols is None else 2  # the sums (in columns [0, sum_cols)) and (rest_ref) the rows' others
    if quant is None:
        out_ref, rest_ref = refs[-n_out], refs[-1] if sum_cols is not None else None
    else:
        channel, up_start, e4m3, in_dots = quant
        n_scratch = 0 if in_dots else 3
        gs_ref, ds_ref, out_ref = refs[len(refs) - 2 - n_out - n_scratch:len(refs) - n_out + 1 - n_scratch]
        rest_ref = refs[len(refs) - 1 - n_scratch] if sum_cols is not None else None
        slabs = [(w, None if channel else gs_ref, dict(block0=b0, row_off=off, e4m3=e4m3))
                 for w, (b0, off) in zip(w_refs, [(0, 0), up_start])] + [(d_ref, None if channel else ds_ref, dict(e4m3=e4m3))]
        if in_dots:  # dequantized inside each chunk's dots: one block of code the scheduler interleaves
            *weights, down = [functools.partial(_dequantized, w, sc, x_ref.dtype, **kw) for w, sc, kw in slabs]
        else:  # dequantized once per expert (first item of the group) into VMEM scratch
            scratch = refs[len(refs) - n_scratch:]

            @pl.when(_new_weights(fetch_group, i))
            def _dequant():
                for dst, (w, sc, kw) in zip(scratch, slabs):
                    _dequantize(dst, w, sc, **kw)

            weights, down = [lambda r=r: r[...] for r in scratch[:2]], lambda: scratch[2][...]  # noqa: E731
        if channel:  # per-channel scales multiply the f32 outputs: gate columns [0, I), up [I, 2I), down [0, H)
            half = d_ref.shape[1]
            row = lambda ref, off, width: ref[pl.ds(grp, 1), pl.ds(off, width)]  # noqa: E731
            col_scales = [lambda: row(gs_ref, 0, half), lambda: row(gs_ref, half, half)]
            d_scale = lambda: row(ds_ref, 0, ds_ref.shape[1])  # noqa: E731
    first = jnp.logical_or(i == 0, item_tile[jnp.maximum(i - 1, 0)] != tile)
    dims = _dims(transposed)
    ddims = _dims(down_transposed)

    if combine is not None:
        y_dtype, prod_dtype = combine

        @pl.when(jnp.logical_and(i == 0, j == 0))
        def _zero_sums():  # a loop: the code of a branch taken once stays short
            if straight_adds:
                pend[0], pend[1], pend[2], pend[3] = 0, 0, 0, 0
            if sum_cols is not None:
                rflag[0], rflag[1] = 0, 0
            def zero(b, carry):
                sums[pl.ds(pl.multiple_of(b * 8, 8), 8), :] = jnp.zeros((8, sums.shape[1]), sums.dtype)
                return carry
            lax.fori_loop(0, sums.shape[0] // 8, zero, 0)
            if gather:  # the tokens' rows as f32 (rows of 32 bits: one sublane each, any row loads alone),
                # through a staging buffer: the rows in x's dtype never sit in VMEM whole. One flat loop
                # (a nested one defeated the cost model's matching of compiled loops to the kernel's)
                n = stage.shape[0]

                def widen(b, carry):
                    r = pl.multiple_of(b * sub, sub)
                    rs = pl.multiple_of(r % n, sub)

                    @pl.when(rs == 0)
                    def _fetch():
                        copy = pltpu.make_async_copy(x_ref.at[pl.ds(r, n)], stage, sem)
                        copy.start()
                        copy.wait()
                    xs[pl.ds(r, sub), :] = stage[pl.ds(rs, sub), :].astype(jnp.float32)
                    return carry
                lax.fori_loop(0, x_ref.shape[0] // sub, widen, 0)

        def gather_rows(r0, start, end, n):
            """x of the n-row chunk's rows of this group, gathered from the tokens' rows, and (``smem_weights``)
            their routing weights (others: stale)."""
            base = row0 + r0
            lo, hi = jnp.clip(start - base, 0, n), jnp.clip(end - base, 0, n)

            def copy(n, carry):
                for u in range(ADD_ROWS):
                    r = lo + n * ADD_ROWS + u
                    t = jnp.where(r < hi, row_token[base + r], 0)
                    xbuf[pl.ds(r, 1), :] = xs[pl.ds(t, 1), :]
                    if smem_weights:
                        w = lax.bitcast_convert_type(row_weight[base + r], jnp.float32)
                        wbuf[pl.ds(r, 1), :] = jnp.full((1, wbuf.shape[1]), w, jnp.float32)
                return carry
            lax.fori_loop(0, lax.div(hi - lo + ADD_ROWS - 1, ADD_ROWS), copy, 0)
            return xbuf[pl.ds(0, n), :].astype(x_ref.dtype)

        def add_rows(y, r0, new, start, end):
            """The chunk's rows of this group (once), weighted, into their tokens' sums: now, or
            (``straight_adds``: chunks mostly of one group's rows) as the pending chunk, during the next
            chunk's down dots (``add_pending``)."""
            n = y.shape[0]
            w = (wbuf[pl.ds(0, n), pl.ds(0, 1)] if smem_weights else row_weight[pl.ds(r0, n), :]).astype(prod_dtype)
            slot = 1 - pend[0] if straight_adds else 0
            ybuf[slot, pl.ds(0, n), :] = (y.astype(y_dtype).astype(prod_dtype) * w).astype(jnp.float32)
            base = row0 + r0
            lo, hi = jnp.clip(jnp.maximum(start - base, new), 0, n), jnp.clip(end - base, 0, n)
            if straight_adds:
                pend[0], pend[1], pend[2], pend[3] = slot, base, lo, hi
            else:
                add(slot, base, lo, hi)

        def add_pending(straight=False):
            add(pend[0], pend[1], pend[2], pend[3], straight)
            pend[3] = 0

        def add(slot, base, lo, hi, straight=False):
            """Rows [lo, hi) of the chunk in ybuf[slot] (from row ``base``), weighted, into their tokens'
            sums: the unsort and the top-k sum of the layer, in VMEM (rounded and weighted as the result rows
            would be). ``straight``: straight-line code for every row of the chunk (rows outside [lo, hi) go
            to the trash row), which shares the basic block, and the bundles, of the dots around it; else a
            loop over its rows (up to ADD_ROWS - 1 past hi: to the trash row too)."""
            trash = sums.shape[0] - 1

            def at_once(r0, n):
                # n rows at a time, their sums read before any is written; a token twice in a group (an
                # expert listed twice) has adjacent rows: the second takes the first's new sum
                rs = [r0 + u for u in range(n)]
                ts = [jnp.where((r >= lo) & (r < hi) if straight else r < hi, row_token[base + r], trash) for r in rs]
                olds = [sums[pl.ds(t, 1), :] for t in ts]
                prev = None
                for u, (r, t) in enumerate(zip(rs, ts)):
                    old = olds[u] if u == 0 else jnp.where(t == ts[u - 1], prev, olds[u])
                    prev = old + ybuf[slot, pl.ds(r, 1), :]
                    sums[pl.ds(t, 1), :] = prev
            if straight:  # a row at a time (see STRAIGHT_ADD_ROWS)
                for r0 in range(0, chunk, STRAIGHT_ADD_ROWS):
                    at_once(r0, STRAIGHT_ADD_ROWS)
            else:
                lax.fori_loop(0, lax.div(hi - lo + ADD_ROWS - 1, ADD_ROWS),
                              lambda n, c: (at_once(lo + n * ADD_ROWS, ADD_ROWS), c)[1], 0)

        def rest_copy(slot, base):
            return pltpu.make_async_copy(rbuf.at[slot], rest_ref.at[pl.ds(pl.multiple_of(base, sub), span)],
                                         rsem.at[slot])

        def send_rest(start):
            """The item's rows' columns past sum_cols (``finish`` left them in rbuf) into rest_ref by a DMA that runs
            during the next item. The window's rows before ``start``, of earlier items, are read back first, once
            the DMA before has landed: one in flight at a time, in the items' order, so the rows past the item's
            that go too (a later item's) are written again after."""
            slot = rflag[0]

            @pl.when(rflag[1] == 1)
            def _wait():
                rest_copy(1 - slot, 0).wait()
            lo = jnp.clip(start - row0, 0, span)

            def read_back(n):  # rows [0, lo) of native tile n of the window
                copy = pltpu.make_async_copy(rest_ref.at[pl.ds(pl.multiple_of(row0 + n * sub, sub), sub)], lead,
                                             rsem.at[2])
                copy.start()
                copy.wait()
                r = pl.multiple_of(n * sub, sub)
                earlier = lax.broadcasted_iota(jnp.int32, lead.shape, 0) + r < lo
                rbuf[slot, pl.ds(r, sub), :] = jnp.where(earlier, lead[...], rbuf[slot, pl.ds(r, sub), :])

            @pl.when(lo > 0)
            def _lead():  # a group's first window: its start's native tile (in a loop, the DMA would make the
                read_back(0)  # cost model charge its trip as a step of its own)
            lax.fori_loop(1, lax.div(lo + sub - 1, sub), lambda n, c: (read_back(n), c)[1], 0)  # windows pulled back
            rest_copy(slot, row0).start()
            rflag[0], rflag[1] = 1 - slot, 1
    else:
        @pl.when(jnp.logical_and(first, j == 0))
        def _zero():  # the tile's rows no group of its items writes stay zero
            out_ref[...] = jnp.zeros(out_ref.shape, out_ref.dtype)

    @pl.when(grp < num_groups)
    def _compute():
        start, end = bounds[i], bounds[i + 1]

        def finish(y, r0, new=0):  # the rows' whole down product, f32
            if d_scale is not None:
                y = y * d_scale()
            if has_bias:
                y = y + db_ref[...].astype(jnp.float32)
            if combine is not None:
                if sum_cols is not None:
                    rbuf[rflag[0], pl.ds(r0, y.shape[0]), :] = y[:, sum_cols:].astype(rbuf.dtype)
                    y = y[:, :sum_cols]
                return add_rows(y, r0, new, start, end)
            rows = pl.ds(r0, y.shape[0])
            r = row0 + r0 + lax.broadcasted_iota(jnp.int32, y.shape, 0)
            mine = jnp.logical_and(r >= start, r < end)
            out_ref[rows, :] = jnp.where(mine, y.astype(out_ref.dtype), out_ref[rows, :])

        def down_rows(h, r0, new, final):
            """h's down product, added to the item's earlier intermediate tiles (scratch rows another item
            left are overwritten at its tile 0) and carried to the next, or (``final``) finished."""
            y = lax.dot_general(h, down(), ddims, preferred_element_type=jnp.float32)
            if i_tiles > 1:
                rows = pl.ds(r0, y.shape[0])
                acc = acc_ref[rows, :]
                y = y + (acc if final else jnp.where(j > 0, acc, 0.0))
                if not final:  # rows a pulled-back chunk repeats already carry this tile, from the chunk before
                    acc_ref[rows, :] = jnp.where(lax.broadcasted_iota(jnp.int32, y.shape, 0) < new, acc, y)
                    return
            finish(y, r0, new)

        def chunk_rows(r0, new=0, n=chunk, final=True):  # MXU work only for chunks holding rows of this group
            rows = pl.ds(r0, n)
            x = gather_rows(r0, start, end, n) if gather else x_ref[rows, :]
            ys = [lax.dot_general(x, w(), dims, preferred_element_type=jnp.float32) for w in weights]
            ys = [y if cs is None else y * cs() for y, cs in zip(ys, col_scales)]
            if has_bias:
                ys = [y + b[...].astype(jnp.float32) for y, b in zip(ys, b_refs)]
            if pairs:
                h = _activate_pairs(ys[0], activation, alpha, limit, mxu_dtype)
            elif interleaved:
                h = _activate(*_deinterleave(ys[0]), activation, alpha, limit).astype(mxu_dtype)
                # a branch the data always takes (start >= 0): XLA:CPU, running the kernel in interpret mode,
                # would otherwise fold _deinterleave's last transpose into this dot's bf16 operand, which it
                # cannot execute ("DotThunk ... BF16 x BF16 = F32"); on the TPU a scalar branch
                h = lax.cond(start >= 0, lambda: h, lambda: jnp.zeros_like(h))
            else:
                h = _activate(ys[0], ys[1], activation, alpha, limit).astype(mxu_dtype)
            if combine is not None and straight_adds:  # in the basic block of the down dots, if not of all
                add_pending(straight=True)
            down_rows(h, r0, new, final)

        # gathered rows start a chunk at the group's first row (the rows, their weights and products sit in
        # chunk buffers of their own), so a group of up to a tail's rows takes that tail wherever it starts; with
        # intermediate tiles at the f32 carry's native tile (its rows are the window's); x's blocks at theirs
        align = (_sublanes(jnp.float32) if i_tiles > 1 else 1) if gather else sub

        def item_rows(final):
            _for_group_rows(jnp.clip(start - row0, 0, span), jnp.clip(end - row0, 0, span), tm=span, chunk=chunk,
                            sub=align, body=functools.partial(chunk_rows, final=final), fresh=True, tails=tails)
        if i_tiles == 1:
            item_rows(True)
        else:  # the last tile's chunks and the others' as code of their own: a chunk is one basic block,
            # its carry or finish scheduled among its dots, not branches after them (compiled for v6e,
            # GPT-OSS-20B at 8192 tokens, 960-unit tiles, 256-row chunks of 1292 vmatmuls an MXU: 14189
            # bundles a chunk -> 12808 at the last tile, 13082 at the others)
            pl.when(j == i_tiles - 1)(lambda: item_rows(True))
            pl.when(j < i_tiles - 1)(lambda: item_rows(False))
        if sum_cols is not None:
            @pl.when(j == i_tiles - 1)
            def _rest():
                send_rest(start)

    if combine is not None:
        last = jnp.logical_and(i == pl.num_programs(0) - 1, j == pl.num_programs(1) - 1)
        if straight_adds:
            @pl.when(last)
            def _last_rows():  # the last chunk's rows wait for no next chunk
                add_pending()
        # then the sums leave in the output's dtype, a block at a time through two VMEM buffers (a block's
        # DMA runs while the next is converted): the f32 sums never reach HBM. Loops whose trip counts are
        # 0 but at the last step: code in the step's own body counts in every step (the cost model cannot
        # tell its branches apart), and a loop of few static trips the compiler unrolls into it
        n, piece = obuf.shape[1], _sublanes(obuf.dtype)

        def dma(b, slot):  # (``sum_cols``: into the result's first columns, XLA's sums of the others beside)
            dst = out_ref.at[pl.ds(b * n, n)] if sum_cols is None else out_ref.at[pl.ds(b * n, n), pl.ds(0, sum_cols)]
            return pltpu.make_async_copy(obuf.at[slot], dst, osem.at[slot])

        def block(b, carry):
            slot = b % 2

            @pl.when(b >= 2)
            def _wait():  # the slot's previous block has left
                dma(b - 2, slot).wait()

            def convert(p, carry):
                r = pl.multiple_of(p * piece, piece)
                obuf[slot, pl.ds(r, piece), :] = sums[pl.ds(pl.multiple_of(b * n + r, piece), piece), :].astype(obuf.dtype)
                return carry
            lax.fori_loop(0, n // piece, convert, 0)
            dma(b, slot).start()
            return carry
        blocks = out_ref.shape[0] // n
        lax.fori_loop(0, jnp.where(last, blocks, 0), block, 0)

        @pl.when(last)
        def _sent():
            for b in range(max(blocks - 2, 0), blocks):
                dma(b, b % 2).wait()
            if sum_cols is not None:
                @pl.when(rflag[1] == 1)
                def _rest():
                    rest_copy(1 - rflag[0], 0).wait()


def moe_vmem_bytes(tm, chunk, h, i, in_bytes, out_bytes, w_bytes=None, ti=None):
    """Double-buffered x, weight slabs (``ti`` of the intermediate's i units at a time: then an f32
    accumulator too) and output, f32 temporaries; quantized weights (``w_bytes`` below ``in_bytes``) add
    their dequantized copy and the f32 temporaries of dequantizing."""
    w_bytes = in_bytes if w_bytes is None else w_bytes
    ti = ti or i
    quant = 3 * h * i * in_bytes + 2 * 256 * max(h, i) * 4 if w_bytes < in_bytes else 0
    acc = tm * h * 4 if ti < i else 0
    return (2 * tm * h * in_bytes + 2 * 3 * h * ti * w_bytes + 2 * tm * h * out_bytes + acc
            + chunk * (2 * ti + ti + h) * 4 * 2 + 8 * (2 * ti + h) * 4 + quant)


def dequantize_in_dots(m: int, groups: int, chunk: int, w_dtype, chip: str | None) -> bool:
    """Whether the fused kernel converts quantized slabs inside each chunk's dots, as values, rather than
    once per expert into VMEM scratch. In the dots, the conversion's vector work sits in one block of code
    with the MXU pushes, and the scheduler interleaves the two; but every chunk converts again, so only
    when an average group fits in half a chunk (decode). Not for fp8 on TPU7x, whose native conversion
    measured slower there (Qwen3 at 64 tokens: 376.7 against 362.1 us modelled; v6e: 551.5 against 642.4;
    int8 on TPU7x: 287.9 against 352.9)."""
    if -(-m // groups) > chunk // 2:
        return False
    return jnp.dtype(w_dtype) == jnp.int8 or e4m3_mode(chip) != "native"


# Average rows per expert above which the fused MLP's loop takes 256-row chunks on a 256-wide MXU: each
# chunk pushes every weight block through the MXU, so larger groups want fewer, longer chunks; the rows a
# chunk holds beyond its group are wasted. Measured on the fused MLP of Qwen3-30B-A3B (kernel us, 128 -> 256
# rows; modelled by the bench's cost model): 8192 tokens (512 rows an expert) v6e 1644 -> 1355, TPU7x
# 1149 -> 892; 2048 tokens (128 rows) v6e 823 -> 844, TPU7x 471 -> 402; v5e (128-wide MXU) slower at both.
# Quantized experts (unmeasured at these sizes) keep 128.
LONG_CHUNK_ROWS = {"v6e": 192, "tpu7x": 96}
# Rows per tile of the fused MLP: a group split between two tiles takes chunk passes in each, so longer
# tiles split fewer groups, but expose a longer first fetch and last write-back; VMEM may halve them.
# Measured as above (layer us, 512 -> 1024-row tiles): Qwen3-30B-A3B at 8192 tokens v5e 6551 -> 6351, v6e
# 2209 -> 2115 (TPU7x: halved back to 512); at 2048 tokens v5e 2069 -> 2038; at 256 tokens (2048 rows)
# TPU7x 374.2 -> 377.6, so short layers keep 512.
LONG_TILE_ROWS = 4096
# Up to this many rows an expert (on average), the fused MLP's chunk holds an average group and two native
# tiles more (its start is rounded down to one, the group runs over the average): most groups then take one
# chunk, not a full one and a few rows in a second (128-row chunks at Qwen3's 2048 tokens, 128 rows an
# expert: 229 chunk passes for 128 groups; 160-row chunks: 145). Measured as above (layer us, 2048 tokens):
# Qwen3 v5e 2038 -> 1963, Gemma-4 v5e 2886 -> 2693, TPU7x 799 -> 759; v6e unchanged (its kernel waits on
# the weights' DMA there). Larger groups (8192 tokens) measured slower in one chunk (Qwen3 v5e 6351 -> 7484).
FITTED_CHUNK_ROWS = 192


def moe_intermediate_tiles(i: int, *, transposed: bool, down_transposed: bool, interleaved: bool,
                           sub: int = 16) -> list[int]:
    """Widths ti that split the experts' intermediate into i / ti equal tiles the weights' blocks can take,
    widest first (i itself: whole slabs). A tile's width sits in the lanes of gate_up's block when it is
    [E, H, 2I] (2ti lanes interleaved, ti a half) and of down's when it is [E, H, I]: a multiple of 128
    there, of the packed sublane tile elsewhere."""
    lanes = [(2 if interleaved else 1, not transposed), (1, down_transposed)]

    def ok(ti):
        return all(mult * ti % (128 if lane else sub) == 0 for mult, lane in lanes)
    return [i] + [ti for ti in range(i - 1, 0, -1) if i % ti == 0 and ok(ti)]


# Intermediate tiles refetch an expert's weights for each row tile its rows span (all but the block at the
# turn) and run narrower dots than whole slabs; two gmm calls move the [rows, I] intermediate through HBM
# instead. Measured with the cost model on GPT-OSS-20B (bf16, H = I = 2880, 32 experts, top-4; layer us,
# two gmm calls -> tiled fused): v6e 1 / 8 / 64 / 256 / 2048 tokens 136.7 / 584.3 / 1043.6 / 1081.4 / 1569.9
# -> 130.8 / 559.4 / 988.0 / 1025.8 / 1482.0 (960-unit tiles); TPU7x 64 / 256 tokens 489.0 / 515.2 -> 445.5
# / 474.7 (576), but 2048 1079.9 -> 1387.7 (320 units in 512-row tiles; 1176.0 in 576 x 256) and 8192
# 2928.4 -> 3724.1; v5e 256 2113.2 -> 2034.4, 2048 3652.0 -> 3765.9, 8192 13291.0 -> 13007.2; v6e 8192
# 4318.9 -> 4086.1. So tiles where the MXU work per weight byte is under this fraction of the chip's flops
# per HBM byte (the layer waits on its weights). Compute-bound layers tile only where the tiles fill the
# MXU's width to TILED_MXU_FILL (ti over ti rounded up to the MXU's width), the dots then as full as whole
# slabs' and the intermediate's HBM trip saved: 960-unit tiles (0.94 of 1024), measured at 2edc97a (layer
# us, two gmm calls -> tiled fused) on v5e 2048 / 8192 tokens 3652.0 / 13291.0 -> 3572.9 (it gathers, in
# windows) / 12697.1, on v6e 8192 4318.9 -> 4136.0; TPU7x's VMEM takes only 320 or 576 (0.63 / 0.75 of 512 /
# 768): 2048 1079.9 -> 1460.3, 8192 2928.4 -> 3926.5 (the MXU work of its dots on the padded width).
TILED_MOE_RIDGE = 0.5
TILED_MXU_FILL = 0.9


def waits_on_weights(rows: int, groups: int | None, w_dtype, chip=None, ridge: float = TILED_MOE_RIDGE) -> bool:
    """Whether a MoE layer of ``rows`` (tokens x top-k) over ``groups`` experts waits on its weights' DMA:
    its MXU work per weight byte under ``ridge`` of the chip's flops per HBM byte."""
    spec = _chip(chip)
    avg = -(-rows // (groups or 1))
    return 2 * avg / jnp.dtype(w_dtype).itemsize <= ridge * spec.peak_flops / spec.hbm_bandwidth


def fused_moe_tiling(m, h, i, *, in_dtype, out_dtype, chip=None, transposed=True, interleaved=False,
                     w_dtype=None, groups=None, down_transposed=None):
    """(tm, chunk, ti) for the fused expert MLP, or None when it does not fit (then use two gmm calls):
    each expert's gate, up and down slabs sit in VMEM double-buffered, whole (``ti`` = i) or, unquantized,
    ti of the intermediate's i units at a time (``moe_intermediate_tiles``: the widest that fits 512-row
    tiles). ``w_dtype``: quantized weights, also held dequantized; ``groups``: the number of experts
    (``group_chunk_rows``, ``LONG_CHUNK_ROWS``, ``FITTED_CHUNK_ROWS``: chunks tried in turn until one
    fits). Tiles of 512 rows, 1024 above ``LONG_TILE_ROWS``, halved until they fit."""
    spec = _chip(chip)
    sub = _sublanes(in_dtype)
    down_transposed = transposed if down_transposed is None else down_transposed
    if not transposed and not interleaved and i % 128:
        return None  # [E, H, 2I] with a half width off the lane grid cannot be split in two blocks
    chunks = [group_chunk_rows(m, groups)]
    quantized = w_dtype is not None and jnp.dtype(w_dtype) != jnp.dtype(in_dtype)
    avg = -(-m // (groups or 1))
    if spec.mxu_dim >= 256 and not quantized and avg > LONG_CHUNK_ROWS.get(spec.name, m):
        chunks.insert(0, 256)  # the shorter chunk stays as the fallback when the longer one's temporaries do not fit
    if not quantized and DECODE_GROUP_ROWS < avg <= FITTED_CHUNK_ROWS:
        chunks.insert(0, _round_up(avg + 2 * sub, sub))
    budget = int(spec.vmem_bytes * 0.6)  # measured: Gemma-4 26B-A4B experts compile on TPU7x at this budget
    wb = jnp.dtype(w_dtype or in_dtype).itemsize
    widths = moe_intermediate_tiles(i, transposed=transposed, down_transposed=down_transposed,
                                    interleaved=interleaved, sub=max(sub, 16))
    if quantized:
        widths = [i]
    elif not waits_on_weights(m, groups, w_dtype or in_dtype, chip):
        # a compute-bound layer (``TILED_MOE_RIDGE``): only tiles whose dots fill the MXU's width
        widths = [w for w in widths if w == i or w / _round_up(w, spec.mxu_dim) >= TILED_MXU_FILL]
    tm0 = min(1024 if m > LONG_TILE_ROWS else 512, _round_up(max(m, 1), sub))
    # whole slabs with row tiles halved as needed; else the widest intermediate tiles that fit row tiles of
    # 512 or more (shorter ones split more groups between tiles, each split refetching the expert's weights)
    floor = min(tm0, 512)
    for ti, least in [(i, 0)] + [(ti, floor) for ti in widths[1:]] + [(ti, 0) for ti in widths[1:]]:
        for chunk in chunks:
            chunk = min(tm0, chunk)
            tm = tm0
            need = lambda tm: moe_vmem_bytes(tm, chunk, h, i, jnp.dtype(in_dtype).itemsize,  # noqa: E731
                                              jnp.dtype(out_dtype).itemsize, wb, ti)
            while tm > max(chunk, least) and need(tm) > budget:
                tm = max(chunk, least, _round_up(tm // 2, sub))
            if need(tm) <= budget:
                return tm, chunk, ti
    return None


# The MoE layer's combine (each result row, weighted, into its token's f32 sum) inside the fused MLP: the
# tokens' sums stay in VMEM for the whole call, and the rows are added ADD_ROWS at a time, all read before
# any is written. Where a chunk is mostly one group's rows (an average group at least 3/4 of a chunk:
# 2048 tokens and more), they are added during the next chunk's down dots (the last chunk's at the last
# step), in straight-line code in the dots' basic block, whose spare slots take most of the adds: compiled
# for v6e, Qwen3-30B-A3B at 8192 tokens (288-row chunks, 648 vmatmuls an MXU), a chunk's dots and adds
# issue 6344 bundles, against 5463 for its dots and 4104 for the adds as a loop after them (57 bundles for
# 4 rows of 2048). Layer us (cost model, the bench at 8bc658e -> deferred): v6e Qwen3 8192 tokens 1754.2
# -> 1353.9; TPU7x 2048 tokens Qwen3 502.4 -> 465.8, Gemma-4 26B-A4B 606.4 -> 589.5; v5e Qwen3 8192
# 4588.6 -> 4529.6, GPT-OSS-20B 2048 2872.0 -> 2851.8. Sparser chunks add their few rows at once, in
# a loop (straight-line, every row of a chunk costs: Qwen3 fp8 at 64 tokens, 4 rows an expert in 32-row
# chunks, measured 1-3% slower so). Outside the kernel the same rows cross HBM four times (the kernel writes them, the unsort
# gather reads and writes them, the top-k sum reads them). Measured with the cost model (layer us, glue
# combine -> in the kernel; the bench at b744681): Qwen3 2048 tokens v5e 1965 -> 1796, v6e 1040 -> 888;
# 8192 tokens v5e 6358 -> 5092, v6e 2049 -> 2020; Gemma-4 26B-A4B 2048 tokens v5e 2675 -> 2292, v6e 1321 ->
# 1113; GPT-OSS-20B 2048 tokens v6e 1482 -> 1450; TPU7x, whose HBM is the fastest for its clock, where the
# weights' DMA hides the adds: 256 tokens Qwen3 370.0 -> 354.8, Gemma-4 467.5 -> 440.7, GPT-OSS 474.7 ->
# 464.9. At 2048 tokens on TPU7x the adds did not hide (Qwen3 531 -> 565) until the combining kernels took
# windows of a group's rows (``fused_moe_windows``): 531.3 -> 503.2 at e3e03e1. So it combines wherever
# the sums fit VMEM beside the tiles (COMBINE_VMEM: Qwen3 at 8192 tokens, 0.79 of v6e's VMEM, compiles;
# Gemma-4 at 8192 does not; Gemma-4 at 2048 tokens on TPU7x, 0.87 of its VMEM by the estimate, does:
# 730.4 -> 607.1 us).
ADD_ROWS = 4
# Straight-line adds (``straight_adds``) go a row at a time: the scheduler fits the short chains among the
# dots better than four rows' loads, adds and stores at once. Compiled for v6e, a chunk's dots and adds:
# Qwen3-30B-A3B at 8192 tokens 6345 bundles (4 rows at a time) -> 6172 (8 rows: 6462), at 2048 tokens 5265
# -> 4727; TPU7x at 2048 tokens 4345 -> 4271. Layer us (cost model): Qwen3 at 8192 tokens v6e 1268.6 ->
# 1243.5, TPU7x 1015.4 -> 995.9; 2048 tokens 0.1-2.5 us faster; but GPT-OSS-20B on v6e at 8192 tokens 3493.8 ->
# 3502.7 (at 2048 +0.3) and v5e's Qwen3 and Gemma-4 at 8192 tokens about 2 us slower. Tying the adds to the activation (a store to the trash
# row they must follow), so they land among the down dots only, compiled to 7087 at 8192 tokens on v6e.
STRAIGHT_ADD_ROWS = 1
# At the last step the sums leave VMEM converted to the result's dtype, a block of rows a DMA, two in flight:
# blocks of WRITE_ROWS (all the planners count) up to MAX_WRITE_ROWS, as the VMEM left under COMBINE_VMEM
# allows, in whole sublane tiles dividing the result's rows (the cost model charges a step's overhead per
# iteration of a loop that waits on DMAs: Qwen3-30B-A3B at 8192 tokens on v6e in 32-row blocks, 256
# iterations, 89.6 us).
WRITE_ROWS = 16
MAX_WRITE_ROWS = 512
COMBINE_VMEM = 0.9
GATHER_STAGE_ROWS = 128  # the tokens' rows reach their f32 copy in VMEM this many at a time
GATHER_TILES_RIDGE = 0.25  # see fused_moe_gathers


def fused_moe_combines(tokens: int, h: int, i: int, tiling, *, in_dtype, out_dtype, w_dtype=None,
                       chip=None) -> bool:
    """Whether the fused MLP at ``tiling`` (``fused_moe_tiling``) should also combine the layer's rows into
    its ``tokens`` outputs (``fused_moe(combine=...)``): where the sums fit VMEM (see ADD_ROWS)."""
    tm, chunk, ti = tiling
    need = combining_vmem_bytes(tokens, h, i, tm, chunk, ti, jnp.dtype(in_dtype).itemsize,
                                jnp.dtype(w_dtype or in_dtype).itemsize)
    return need <= COMBINE_VMEM * _chip(chip).vmem_bytes


# Where the tokens' f32 sums do not fit VMEM whole, the kernel sums the most columns whose sums fit beside its
# windows (``fused_moe_windows``), and leaves only the rows' other columns to XLA's unsort and top-k sum. The
# windows are what pays most: a group's rows in one or two fitted chunks, against row tiles that split groups
# and run a chunk for each piece. Measured with the cost model (layer us, row tiles and XLA's combine -> windows
# and some columns in the kernel, the bench at 4be41ac): at 8192 tokens Gemma-4 26B-A4B on TPU7x (256 of 2816
# columns, 640-row windows: the tiling's 256-row tiles no longer cap them) 1730.5 -> 1419.3, on v6e (2048) 2719.8
# -> 1887.5; Qwen3-30B-A3B on TPU7x (512 of 2048) 1275.3 -> 1036.9; GPT-OSS-20B on v6e (896 of 2880, 1280-row
# windows) 4136.0 -> 3763.6 (768 columns: 3760.3, the count is no sharp optimum). More columns with windows the
# tiling's size lose: GPT-OSS on v6e (1280, 1024-row windows) 4296.9, Gemma-4 on TPU7x (512, 288) 1799.7.


def fused_moe_sum_cols(tokens: int, h: int, i: int, tiling, *, rows: int, groups: int, in_dtype, out_dtype,
                       w_dtype=None, chip=None) -> int:
    """How many of the rows' h columns the fused MLP at ``tiling`` sums into its ``tokens`` outputs
    (``fused_moe(sum_cols=...)``): all where the sums fit VMEM (``fused_moe_combines``); else the most multiples
    of 128 whose sums fit beside the windows of ``rows`` (``fused_moe_windows``), the rows' other columns left
    for XLA's unsort and top-k sum; else 0 (XLA combines, the kernel's items are row tiles)."""
    if fused_moe_combines(tokens, h, i, tiling, in_dtype=in_dtype, out_dtype=out_dtype, w_dtype=w_dtype, chip=chip):
        return h
    for cols in range((h - 1) // 128 * 128, 0, -128):
        if _windows(rows, h, i, tiling, groups=groups, tokens=tokens, in_dtype=in_dtype, w_dtype=w_dtype,
                    gather=False, chip=chip, sum_cols=cols):
            return cols
    return 0


def moe_tails(m: int, groups: int, chunk: int, sub: int, gathered: bool = False) -> tuple[int, ...]:
    """The fused MLP's tail chunks (``chunk_tails``) where an average group fills at most a quarter of a chunk
    (decode-sized groups: most of a whole chunk's rows would be another group's); with ``gathered`` rows, whose
    chunks start at the group's first row (``_moe_kernel``), where it fits a chunk, and three quarters of the
    chunk too (a group a little over the average then takes no whole chunk). Measured with the cost model
    (layer us v5e / v6e / TPU7x, whole chunks -> tails, 32-row chunks, 16-row tails): Qwen3-30B-A3B at 64
    tokens (4 rows an expert) fp8 838.2 / 530.8 / 342.2 -> 815.8 / 448.4 / 307.3, int8 740.1 / 379.8 / 269.5
    -> 740.1 / 385.2 / 233.8; at 256 tokens (16 rows) fp8 931.4 / 591.1 / 380.9 -> 1109.0 / 689.3 / 423.3
    (the chunks then started at the native tile holding the group's first row).
    Longer groups measured slower or mixed with tails too (Qwen3 at 8192 tokens, 288-row chunks: v6e 1294.0 ->
    1378.3; GPT-OSS-20B at 8192 v6e 3763.6 -> 3636.1 but v5e 10751.6 -> 11509.5). Gathered, chunks from the
    group's first row (native tiles -> the group's row, tails to an average group that fits a chunk; the bench
    at 3a384ed): 256 tokens fp8 932.5 / 590.0 / 378.7 -> 924.1 / 536.2 / 356.5, issued MXU work over useful 2.09
    -> 1.41 (bf16: DMA-bound, 0-2 us faster; Gemma-4 26B-A4B 2.28 -> 1.54); 64 tokens fp8 814.1 / 447.3 / 306.6 ->
    744.9 / 386.5 / 280.7; 2048 tokens (80-row tails) v5e / v6e Qwen3 1622.1 / 813.0 -> 1607.7 / 809.8.
    GPT-OSS-20B at 256 tokens (intermediate tiles: chunks from the carry's 8-row tile; 64-row chunks, 32 rows an
    expert): issued over useful 2.15 / 2.39 / 2.62 -> 1.85 / 2.05 / 2.26 with 16- and 32-row tails (TPU7x 457.5
    -> 459.7 us), -> 1.46 / 1.63 / 1.79 with the 48-row one too (layer us the same)."""
    avg = -(-m // (groups or 1))
    if gathered and avg <= chunk:
        return chunk_tails(chunk, sub) + ((3 * chunk // 4,) if 3 * chunk // 4 % sub == 0 else ())
    return chunk_tails(chunk, sub) if 4 * avg <= chunk else ()


def straight_adds(m: int, groups: int, chunk: int) -> bool:
    """Whether a combining fused MLP adds a chunk's rows during the next chunk's dots (see ADD_ROWS)."""
    return 4 * -(-m // groups) >= 3 * chunk


def _sums_rows(tokens: int, dtype) -> tuple[int, int]:
    """(the combine's result rows: whole sublane tiles of ``dtype``, its f32 sums' rows: those and a trash
    row, in whole f32 tiles)."""
    out_rows = _round_up(tokens, _sublanes(dtype))
    return out_rows, max(out_rows, _round_up(tokens + 1, 8))


def _write_block(rows: int, most: int, tile: int) -> int:
    """The sums' write-back block: the most rows, up to ``most``, in whole ``tile``s dividing ``rows``."""
    return max(b for b in range(tile, min(most, rows) + 1, tile) if rows % b == 0)


def combine_vmem_bytes(tokens: int, h: int, chunk: int, straight: bool = True, out_bytes: int = 4) -> int:
    """The tokens' f32 sums (``_sums_rows``), a chunk of weighted rows (``straight``: two, one pending) and
    the sums' two write-back blocks of ``out_bytes`` elements."""
    return ((_sums_rows(tokens, jnp.bfloat16)[1] + (2 if straight else 1) * (chunk + ADD_ROWS)) * h * 4
            + 2 * WRITE_ROWS * h * out_bytes)


def combining_vmem_bytes(tokens: int, h: int, i: int, tm: int, chunk: int, ti: int, in_bytes: int, w_bytes: int,
                         *, x_rows: int | None = None, gather: bool = False, straight: bool = True,
                         sum_cols: int | None = None) -> int:
    """A combining fused MLP's VMEM: its tiles (x's blocks of ``x_rows``, tm by default; no output tiles,
    the sums instead), the tokens' sums (``combine_vmem_bytes``, the result in x's dtype; ``sum_cols`` of the
    columns, and two blocks of the rows' others on their way out) and (``gather``) the tokens' rows."""
    hs = sum_cols or h
    return (moe_vmem_bytes(x_rows or tm, chunk, h, i, in_bytes, 0, w_bytes, ti)
            + combine_vmem_bytes(tokens, hs, chunk, straight, in_bytes)
            + (2 * (x_rows or tm) + 16) * (h - hs) * in_bytes
            + (gather_vmem_bytes(tokens, h, tm, chunk, in_bytes, i_tiled=ti < i) if gather else 0))


def gather_vmem_bytes(tokens: int, h: int, tm: int, chunk: int, in_bytes: int, i_tiled: bool = False) -> int:
    """The tokens' f32 rows and their staging buffer, a chunk of gathered rows and their weights; no x tiles.
    ``i_tiled``: the accumulator's extra native tile of rows (a window starts within one)."""
    rows = _round_up(tokens, GATHER_STAGE_ROWS)
    return (rows * h * 4 + GATHER_STAGE_ROWS * h * in_bytes + (chunk + ADD_ROWS) * (h + 128) * 4
            - 2 * tm * h * in_bytes + (16 * h * 4 if i_tiled else 0))


def fused_moe_gathers(tokens: int, h: int, i: int, tiling, *, rows: int, groups: int, in_dtype, out_dtype,
                      w_dtype=None, chip=None) -> bool:
    """Whether a combining fused MLP (``fused_moe_combines``) should also gather its rows' x from the tokens'
    rows held in VMEM (``fused_moe(gather=True)``): where they fit too. A row copy costs
    the core less than a combine's add, and saves the gathered [T * k, H] rows' trip through HBM and back
    (the XLA gather's write, the kernel's read); its windows (``fused_moe_windows``) then fetch no x block.
    The cost model: Qwen3-30B-A3B at 2048 tokens,
    layer us 1795.7 -> 1750.8 on v5e, 888.3 -> 851.4 on v6e, Gemma-4 26B-A4B 2291.7 -> 2210.5, 1112.7 ->
    1056.7 (before the windows). With intermediate tiles each tile copies the rows again: only where the
    weights' DMA hides that (``waits_on_weights`` at GATHER_TILES_RIDGE). GPT-OSS-20B, layer us gathered
    -> x's windows, at 6648ead: 2048 tokens (0.46 / 0.53 of the v6e / v5e ridge) v6e (COMBINE_VMEM 0.9)
    1216.7 -> 1149.4, v5e 2987.5 -> 2871.6; but 256 tokens (0.06 of it) v5e / v6e 1990.9 / 1005.6 -> 2007.7
    / 1012.2."""
    spec = _chip(chip)
    tm, chunk, ti = tiling
    if ti < i and not waits_on_weights(rows, groups, w_dtype or in_dtype, chip, ridge=GATHER_TILES_RIDGE):
        return False
    need = combining_vmem_bytes(tokens, h, i, tm, chunk, ti, jnp.dtype(in_dtype).itemsize,
                                jnp.dtype(w_dtype or in_dtype).itemsize, gather=True)
    return need <= COMBINE_VMEM * spec.vmem_bytes


# Where the fused MLP combines, its items are windows of a group's rows (``run_metadata(windows=...)``):
# gathered rows need no block in HBM, and x's rows otherwise come as a block from the window's first native
# tile. No group is split at a row tile's edge then (nor an expert's intermediate tiles fetched again for
# its second part), and as a group starts at its window's start, a chunk fitted to it holds its rows in as
# few passes as they need: up to WINDOW_CHUNK_ROWS rows a chunk, a 1/n of an average group and two native
# tiles (groups of more than FITTED_CHUNK_ROWS rows; ``fused_moe_tiling`` fits the shorter ones). Each
# window's x block is fetched whole: windows of WINDOW_SLACK times an average group. Measured with the cost
# model (layer us, row tiles -> windows, at 4f3f4c0): GPT-OSS-20B at 2048 tokens v5e 3572.9 -> 2987.5 (it
# gathers; 128 -> 288-row chunks), v6e 1449.7 -> 1149.4 (each expert's weights fetched once: 1.90 -> 1.68
# GB); Qwen3-30B-A3B at 8192 tokens v5e 5091.2 -> 4599.9, v6e 2019.8 -> 1764.0; every other row unchanged.
WINDOW_SLACK = 1.25
WINDOW_CHUNK_ROWS = 320


def fused_moe_windows(m: int, h: int, i: int, tiling, *, groups: int, tokens: int, in_dtype, w_dtype=None,
                      gather: bool = False, chip=None, sum_cols: int | None = None) -> tuple[int, int]:
    """(tm, chunk) for a combining fused MLP (``fused_moe_combines``) at ``tiling``, its items windows of a
    group's rows (``WINDOW_SLACK``, ``WINDOW_CHUNK_ROWS``; gathering rows of short groups, the tiling's
    window), where they fit VMEM; else the tiling's."""
    return _windows(m, h, i, tiling, groups=groups, tokens=tokens, in_dtype=in_dtype, w_dtype=w_dtype,
                    gather=gather, chip=chip, sum_cols=sum_cols) or tiling[:2]


def _windows(m, h, i, tiling, *, groups, tokens, in_dtype, w_dtype, gather, chip, sum_cols):
    """``fused_moe_windows``' (tm, chunk), or None where they do not fit VMEM. Neither is capped by the
    tiling's row tile, which has room for an output tile a combining kernel does not hold."""
    tm, chunk, ti = tiling
    sub = _sublanes(in_dtype)
    avg = -(-m // groups)
    fitted = (w_dtype is None or jnp.dtype(w_dtype) == jnp.dtype(in_dtype)) and avg > FITTED_CHUNK_ROWS
    if fitted:
        n = -(-avg // WINDOW_CHUNK_ROWS)
        chunk = _round_up(-(-avg // n) + 2 * sub, sub)
    if fitted or not gather:  # x's window is fetched whole; a fitted chunk takes room a long window held
        tm = max(chunk, _round_up(int(WINDOW_SLACK * avg), sub))
    need = combining_vmem_bytes(tokens, h, i, tm, chunk, ti, jnp.dtype(in_dtype).itemsize,
                                jnp.dtype(w_dtype or in_dtype).itemsize, x_rows=tm if gather else tm + sub,
                                gather=gather, straight=straight_adds(m, groups, chunk), sum_cols=sum_cols)
    return (tm, chunk) if need <= COMBINE_VMEM * _chip(chip).vmem_bytes else None


def fused_moe(x, gate_up, down, group_sizes, *, transposed=True, activation="silu", interleaved=False,
              alpha=1.702, limit=7.0, gate_up_bias=None, down_bias=None, out_dtype=None, tm=None, chunk=None,
              chip=None, down_transposed=None, gate_up_scale=None, down_scale=None, in_dots=None, row_groups=None,
              ti=None, combine=None, gather=False, pairs=None, sums_dtype=None, sum_cols=None, tails=None):
    """down(act(x @ gate) * (x @ up)) per group in ONE kernel: the intermediate never leaves VMEM.

    x [m, H] (rows sorted by group), gate_up [g, 2I, H] / down [g, H, I] (``transposed``, the
    transformers layout) or [g, H, 2I] / [g, I, H]; rows past sum(group_sizes) are zero (``row_groups``
    [m], each row's group, g for none, replaces group_sizes: ``run_metadata``). One grid step per run of
    a group's rows in an m-tile; each expert's three weight slabs are fetched once. ``ti``: the slabs
    come ti of the intermediate's I units at a time (one grid step each; ``moe_intermediate_tiles``), the
    down products summed in f32 VMEM (an expert split between m-tiles is fetched again for the second one,
    but for the block at the turn: odd m-tiles take the intermediate's tiles in reverse; with ``gather`` no
    expert is split but one with more than tm rows).
    ``down_transposed`` (default: ``transposed``) gives down's layout on its own.
    ``gate_up_scale`` / ``down_scale``: quantized weights (``QUANT_DTYPES``, transposed layout),
    dequantized to x's dtype in VMEM once per expert, or inside each chunk's dots (``in_dots``; default
    ``dequantize_in_dots``).
    ``combine`` = (row_token [m], row_weight [m], T): the MoE layer's combine in the kernel
    (``fused_moe_combines``): returns [T, H] in ``sums_dtype`` (default out_dtype) whose row t sums, in f32,
    row_weight[r] * result row r (rounded to out_dtype, multiplied in its promotion with row_weight's dtype)
    over the rows r of a group with row_token[r] = t, rounded once. The items are then windows of up to tm rows
    of a group (``run_metadata(windows=...)``; ``fused_moe_windows`` sizes them), x's rows fetched from
    each window's first native tile. ``gather`` (with combine; ``fused_moe_gathers``): x is the tokens'
    rows [T, H], row r's x is x[row_token[r]], copied in the kernel. ``sum_cols`` (with combine, not gather; a
    multiple of 128 below H; ``fused_moe_sum_cols``): only the rows' first sum_cols columns are summed, the
    rest leave as rows: returns ([T, H] with the sums in its first sum_cols columns (the others unwritten, for
    the caller's sums of the rows' others, in place), [m', H - sum_cols] rows, m' >= m; rows of no group hold
    garbage). ``pairs``: as ``gmm``'s. ``tails``: the row counts a group's last chunk may take
    (``chunk_tails``; default ``moe_tails``).
    """
    down_transposed = transposed if down_transposed is None else down_transposed
    m, h = x.shape
    if gather:  # x holds the tokens' rows; the rows are combine's
        if combine is None:
            raise ValueError("fused_moe: gather=True needs combine (each row's token)")
        m = combine[0].shape[0]
    if sum_cols is not None and (combine is None or gather or sum_cols % 128 or not 0 < sum_cols < h):
        raise ValueError(f"fused_moe: sum_cols={sum_cols} needs combine without gather and must be a multiple of "
                         f"128 in (0, {h})")
    g = gate_up.shape[0]
    i = (gate_up.shape[1] if transposed else gate_up.shape[2]) // 2
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    if tm is None or chunk is None:
        tiling = fused_moe_tiling(m, h, i, in_dtype=x.dtype, out_dtype=out_dtype, chip=chip,
                                  transposed=transposed, interleaved=interleaved, w_dtype=gate_up.dtype,
                                  groups=g, down_transposed=down_transposed)
        if tiling is None:
            raise ValueError(f"fused_moe: experts of {h} x {i} fit VMEM in no tiling; use gmm")
        tm, chunk, ti = tiling[0], tiling[1], ti or tiling[2]
    ti = ti or i
    sub = _sublanes(x.dtype)
    if tm % sub or chunk % sub or chunk > tm:
        raise ValueError(f"fused_moe: tm={tm} and chunk={chunk} must be multiples of {sub} (x is {x.dtype}), "
                         "chunk at most tm")
    if ti not in moe_intermediate_tiles(i, transposed=transposed, down_transposed=down_transposed,
                                        interleaved=interleaved, sub=max(sub, 16)):
        raise ValueError(f"fused_moe: ti={ti} must divide the intermediate size {i} and fit the weights' "
                         "blocks (moe_intermediate_tiles)")
    nt = i // ti
    # combining, the items are windows of a group's rows (one tile splits no group: a window at row 0 is the
    # tile): gathered, or x's rows as a block from the window's first native tile (an element offset, the
    # block inside x: m rows in whole native tiles, a window's at least)
    windows = sub if combine is not None and m > tm and (gather or (m % sub == 0 and m >= tm + sub)) else None
    last_window = m - tm - sub if windows and not gather else None
    smem_weights = gather and bool(windows)  # a gathered window's weights: scalars read as its rows are copied
    bounds, item_group, item_tile, fetch_group, fetch_tile, num_items = run_metadata(
        rows_of_groups(group_sizes, m) if row_groups is None else row_groups, tm, g, windows=windows)

    def tile(j, group, row_tile):
        # odd row tiles (windows: odd items) take the intermediate's tiles in reverse, so an expert split
        # between two of them reuses the block at the turn; items of no group hold the last block fetched
        j = jnp.where(group < g, j, nt - 1)
        return jnp.where(row_tile % 2 == 1, nt - 1 - j, j)

    imap = lambda f: (lambda it, j, off, ig, itl, fg, ft, *_: f(it, tile(j, ig[it], ft[it]), fg, ft))  # noqa: E731
    # gate_up's blocks: [gate; up] halves as blocks s * nt + j (s = 0, 1), interleaved as block j of 2ti
    bw = 2 * ti if interleaved else ti
    w_specs = [pl.BlockSpec((None, bw, h) if transposed else (None, h, bw),
                            imap(lambda it, j, fg, ft, s=s: (fg[it], s * nt + j, 0) if transposed else (fg[it], 0, s * nt + j)))
               for s in range(1 if interleaved else 2)]
    d_spec = pl.BlockSpec((None, h, ti) if down_transposed else (None, ti, h),
                          imap(lambda it, j, fg, ft: (fg[it], 0, j) if down_transposed else (fg[it], j, 0)))

    def rows_spec(width):  # the rows of a tile, or of the window of the latest item with data (x's windows)
        if last_window is None:
            return pl.BlockSpec((tm, width), imap(lambda it, j, fg, ft: (ft[it], 0)))
        return pl.BlockSpec((pl.Element(tm + sub), pl.Element(width)), lambda it, j, off, ig, itl, fg, ft, *_: (
            pl.multiple_of(jnp.minimum(itl[ft[it]], last_window), sub), 0))
    in_specs = [rows_spec(h)] + w_specs + [d_spec]
    operands = [x] + [gate_up] * len(w_specs) + [down]
    if gate_up_bias is not None:  # [g * 2I / bw, 1, bw]: each block a whole row
        per = 2 * i // bw
        in_specs += [pl.BlockSpec((None, 1, bw), imap(lambda it, j, fg, ft, s=s: (fg[it] * per + s * nt + j, 0, 0)))
                     for s in range(len(w_specs))]
        in_specs += [pl.BlockSpec((None, 1, h), imap(lambda it, j, fg, ft: (fg[it], 0, 0)))]
        operands += [gate_up_bias.reshape(g * per, 1, bw)] * len(w_specs) + [down_bias.reshape(g, 1, h)]
    quant, scratch = None, []
    if gate_up_scale is not None:
        if not (transposed and down_transposed) or interleaved or nt > 1:
            raise NotImplementedError("quantized weights: only whole slabs in the [g, 2I, H] / [g, H, I] layout "
                                      "with [gate; up] halves")
        channel = per_channel(gate_up)
        if in_dots is None:
            in_dots = dequantize_in_dots(m, g, chunk, gate_up.dtype, chip)
        if channel:  # [g, 2I] and [g, H] whole in VMEM, the group's row read per item
            quant = MoeQuant(True, (0, 0), "f32", in_dots)
            in_specs += [pl.BlockSpec(a.shape, imap(lambda it, j, fg, ft: (0, 0))) for a in (gate_up_scale, down_scale)]
        else:  # the group's whole 128x128 block grids
            quant = MoeQuant(False, gate_up_scale_rows(gate_up_scale.shape[1], i, FP8_BLOCK), e4m3_mode(chip), in_dots)
            in_specs += [pl.BlockSpec((None,) + a.shape[1:], imap(lambda it, j, fg, ft: (fg[it], 0, 0)))
                         for a in (gate_up_scale, down_scale)]
        operands += [gate_up_scale, down_scale]  # f32 (validated by the experts op)
        scratch = [] if in_dots else [pltpu.VMEM((i, h), x.dtype), pltpu.VMEM((i, h), x.dtype), pltpu.VMEM((h, i), x.dtype)]
    if nt > 1:  # a window's rows start up to a native tile before the window
        scratch = [pltpu.VMEM((tm + sub if windows else tm, h), jnp.float32)]
    prefetch = [bounds, item_group, item_tile, fetch_group, fetch_tile]
    stage_rows = min(GATHER_STAGE_ROWS, _round_up(x.shape[0], sub))
    out_shape, out_spec = (m, h), pl.BlockSpec((tm, h), lambda it, j, off, ig, itl, fg, ft, *_: (itl[it], 0))
    comb, out_bytes, straight = None, m * h * out_dtype.itemsize, False
    tails = moe_tails(m, g, chunk, sub, gathered=gather) if tails is None else tuple(tails)
    need = moe_vmem_bytes(tm, chunk, h, i, x.dtype.itemsize, out_dtype.itemsize, gate_up.dtype.itemsize, ti)
    if combine is not None:
        row_token, row_weight, num_tokens = combine
        straight = straight_adds(m, g, chunk)
        # rows a chunk may read past m (the straight adds read a whole chunk's from a tail's first row)
        pad = (0, (m + tm + sub if windows else -(-m // tm) * tm) + (chunk if tails else 0) + ADD_ROWS - m)
        prefetch.append(jnp.pad(row_token.astype(jnp.int32), pad))
        comb = (out_dtype, jnp.promote_types(out_dtype, row_weight.dtype))
        if smem_weights:  # the weights as f32 bits beside the tokens: each row's read as it is gathered
            # (a block of a window's weights, a lane of each (8, 128) tile, would move 128x their bytes)
            prefetch.append(jnp.pad(lax.bitcast_convert_type(row_weight.astype(jnp.float32), jnp.int32), pad))
        else:  # the weights' block beside x's (x's windows: f32, whose sublane tile any native tile of x spans)
            in_specs.insert(1, rows_spec(1))
            operands.insert(1, (row_weight if last_window is None else row_weight.astype(jnp.float32)).reshape(m, 1))
        if gather:  # the tokens' rows, in HBM, in whole staging blocks
            operands[0] = x = jnp.pad(x, ((0, -x.shape[0] % stage_rows), (0, 0)))
            in_specs[0] = pl.BlockSpec(memory_space=pl.ANY)
        out_dtype = jnp.dtype(sums_dtype or out_dtype)
        # the sums in whole sublane tiles of the result's dtype, a trash row
        out_rows, rows = _sums_rows(num_tokens, out_dtype)
        out_shape, out_spec = (out_rows, h), pl.BlockSpec(memory_space=pl.ANY)  # written by the kernel's DMAs
        scratch += [pltpu.VMEM((2 if straight else 1, chunk + ADD_ROWS, sum_cols or h), jnp.float32)]
        out_bytes = out_rows * h * out_dtype.itemsize
        need = combining_vmem_bytes(num_tokens, h, i, tm, chunk, ti, x.dtype.itemsize, gate_up.dtype.itemsize,
                                    x_rows=tm if last_window is None else tm + sub, gather=gather, straight=straight,
                                    sum_cols=sum_cols)
        hs = sum_cols or h
        if gather:
            scratch += [pltpu.VMEM(x.shape, jnp.float32), pltpu.VMEM((chunk + ADD_ROWS, h), jnp.float32),
                        pltpu.VMEM((stage_rows, h), x.dtype), pltpu.SemaphoreType.DMA(())]
        if smem_weights:
            scratch += [pltpu.VMEM((chunk + ADD_ROWS, 128), jnp.float32)]
        if straight:
            scratch += [pltpu.SMEM((4,), jnp.int32)]
        room = (int(COMBINE_VMEM * _chip(chip).vmem_bytes) - need) // (2 * hs * out_dtype.itemsize) + WRITE_ROWS
        block = _write_block(out_rows, min(max(room, WRITE_ROWS), MAX_WRITE_ROWS), _sublanes(out_dtype))
        need += 2 * max(block - WRITE_ROWS, 0) * hs * out_dtype.itemsize
        scratch += [pltpu.VMEM((rows, hs), jnp.float32), pltpu.VMEM((2, block, hs), out_dtype),
                    pltpu.SemaphoreType.DMA((2,))]
        if sum_cols:  # the rows' other columns, in rows a window's chunks may reach (past m: garbage)
            rest_rows = _round_up(m + tm + sub, sub) if windows else -(-m // tm) * tm
            out_shape = [out_shape, (rest_rows, h - hs)]
            out_spec = [out_spec, pl.BlockSpec(memory_space=pl.ANY)]
            out_bytes = out_rows * hs * out_dtype.itemsize + m * (h - hs) * comb[0].itemsize
            scratch += [pltpu.VMEM((2, tm + sub if windows else tm, h - hs), comb[0]),
                        pltpu.VMEM((sub, h - hs), comb[0]), pltpu.SemaphoreType.DMA((3,)), pltpu.SMEM((2,), jnp.int32)]
    need += 2 * 4 * (gate_up_scale.size + down_scale.size) if quant and quant.channel else 0
    kernel = functools.partial(_moe_kernel, tm=tm, chunk=chunk, num_groups=g, transposed=transposed,
                               down_transposed=down_transposed,
                               activation=activation, interleaved=interleaved, alpha=float(alpha),
                               limit=float(limit), has_bias=gate_up_bias is not None, quant=quant, i_tiles=nt,
                               combine=comb, gather=gather, windows=bool(windows), last_window=last_window,
                               straight_adds=straight, sum_cols=sum_cols, tails=tails,
                               pairs=_pairs(interleaved, bw, x.dtype if quant else down.dtype, m, g, chip, pairs))
    out_shapes = ([jax.ShapeDtypeStruct(out_shape[0], out_dtype), jax.ShapeDtypeStruct(out_shape[1], comb[0])]
                  if sum_cols else jax.ShapeDtypeStruct(out_shape, out_dtype))
    out = pl.pallas_call(
        kernel,
        out_shape=out_shapes,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=len(prefetch), grid=(num_items, nt), in_specs=in_specs, out_specs=out_spec,
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary", "arbitrary"),
            vmem_limit_bytes=_vmem_limit(need, chip)),
        cost_estimate=pl.CostEstimate(flops=2 * m * h * 3 * i, transcendentals=m * i,
                                      bytes_accessed=g * 3 * h * i * gate_up.dtype.itemsize + m * h * x.dtype.itemsize
                                      + out_bytes),
        name="ragged_dot_fused_moe",
    )(*prefetch, *operands)
    if sum_cols:
        return out[0][:combine[2]], out[1]
    return out if combine is None else out[:combine[2]]  # no copy where T fills whole sublane tiles


# --------------------------------------------------------------------------- decode experts

DECODE_TOKENS = 8  # decode_moe runs every token through each routed expert: at most one f32 sublane tile of rows


def _decode_moe_kernel(expert, fetch, keys_ref, weights_ref, tokens_ref, x_ref, g_ref, u_ref, d_ref, *refs,
                       num_groups, transposed, down_transposed, activation, alpha, limit, prod_dtype, quant):
    del fetch
    s = pl.program_id(0)
    e = expert[s]
    out_ref, acc_ref = refs[-2:] if quant is None else refs[2:4]
    weights = [lambda r=r: r[...] for r in (g_ref, u_ref, d_ref)]  # noqa: E731
    scales = [None, None, None]  # per-channel scales of the f32 outputs: gate, up, down
    if quant is not None:  # dequantized into VMEM scratch once per expert (each is computed once)
        channel, up_start, e4m3, _ = quant
        gs_ref, ds_ref, deq = refs[0], refs[1], refs[4:]
        slabs = [(g_ref, gs_ref, dict(e4m3=e4m3)), (u_ref, gs_ref, dict(block0=up_start[0], row_off=up_start[1],
                                                                         e4m3=e4m3)), (d_ref, ds_ref, dict(e4m3=e4m3))]
        weights = [lambda r=r: r[...] for r in deq]  # noqa: E731
        if channel:
            half = d_ref.shape[1]
            row = lambda ref, off, width: ref[pl.ds(e, 1), pl.ds(off, width)]  # noqa: E731
            scales = [lambda: row(gs_ref, 0, half), lambda: row(gs_ref, half, half),
                      lambda: row(ds_ref, 0, ds_ref.shape[1])]

    @pl.when(s == 0)
    def _zero():
        acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

    # steps are the routed (token, k) pairs in expert order: an expert's first pair computes, its others are
    # empty steps (their weight blocks do not change, so nothing is fetched either)
    @pl.when((e < num_groups) & ((s == 0) | (expert[jnp.maximum(s - 1, 0)] != e)))
    def _expert():
        if quant is not None:
            for dst, (w, sc, kw) in zip(deq, slabs):
                _dequantize(dst, w, None if quant.channel else sc, **kw)
        x = x_ref[...]  # all T rows: as cheap on the MXU as the expert's own, and no dynamic row offsets
        gate, up = [lax.dot_general(x, w(), _dims(transposed), preferred_element_type=jnp.float32)
                    for w in weights[:2]]
        gate, up = [y if sc is None else y * sc() for y, sc in zip((gate, up), scales)]
        h = _activate(gate, up, activation, alpha, limit).astype(x.dtype)
        y = lax.dot_general(h, weights[2](), _dims(down_transposed), preferred_element_type=jnp.float32)
        y = (y if scales[2] is None else y * scales[2]()).astype(x.dtype)
        # each token's routing weight for this expert, from [1, pairs] vectors; tokens not routed to it add
        # exact zeros (not 0 * y: their rows went through the MLP too, and y may not be finite)
        token = lax.broadcasted_iota(jnp.int32, (x.shape[0], keys_ref.shape[1]), 0)
        mine = (keys_ref[...] == e) & (tokens_ref[...] == token)
        w = jnp.sum(jnp.where(mine, weights_ref[...], 0.0), axis=1, keepdims=True)
        routed = jnp.max(mine.astype(jnp.int32), axis=1, keepdims=True) > 0
        acc_ref[...] += jnp.where(routed, (y.astype(prod_dtype) * w.astype(prod_dtype)).astype(jnp.float32), 0.0)

    @pl.when(s == pl.num_programs(0) - 1)
    def _out():
        out_ref[...] = acc_ref[...].astype(out_ref.dtype)


def decode_moe(x, gate_up, down, top_k_index, top_k_weights, *, transposed=True, down_transposed=None,
               activation="silu", alpha=1.702, limit=7.0, out_dtype=None, chip=None, gate_up_scale=None,
               down_scale=None):
    """The whole experts layer for a few tokens (T <= ``DECODE_TOKENS``) in one kernel: routing,
    expert MLPs, weighting and the sum over top-k.

    x [T, H] in the weights' (compute) dtype; gate_up / down as ``fused_moe`` (no bias, not interleaved;
    quantized with ``gate_up_scale`` / ``down_scale`` as there, dequantized into VMEM once per routed expert);
    top_k_index / top_k_weights [T, k], ids outside [0, g) route nowhere. Returns
    sum_k w[t, k] * mlp_{ids[t, k]}(x[t]) [T, H] in ``out_dtype`` (default x's): each expert's output
    is rounded to x's dtype and weighted in its promotion with the routing weights' dtype (as the experts
    op), summed in f32. A token routed twice to one expert takes one product, with its two weights summed.

    One sort orders the (token, k) pairs by expert; the grid has one step per routed pair, and the
    sorted ids, scalar-prefetched, pick each step's weight blocks, so every routed expert's weights
    cross HBM once and padding moves nothing. There is no gather of x, unsort or weighted sum left
    to XLA: at decode sizes those launches cost as much as the kernel's own work.
    """
    down_transposed = transposed if down_transposed is None else down_transposed
    t, h = x.shape
    k = top_k_index.shape[1]
    g = gate_up.shape[0]
    i = (gate_up.shape[1] if transposed else gate_up.shape[2]) // 2
    m = t * k
    out_dtype = jnp.dtype(out_dtype or x.dtype)
    keys, order, tokens = sort_by_expert(top_k_index, g)
    routed = jnp.sum(keys < g, dtype=jnp.int32)
    # weight blocks per step: pairs routed nowhere keep the last routed expert's (no fetch)
    fetch = jnp.minimum(keys, keys[jnp.maximum(routed - 1, 0)]) % g
    # the routing weights reach the kernel as a VMEM vector: data-dependent scalar operands would need SMEM
    weights = top_k_weights.reshape(-1).astype(jnp.float32)[order]
    blk = (None, i, h) if transposed else (None, h, i)
    half = lambda s: (lambda st, ex, fg: (fg[st], s, 0) if transposed else (fg[st], 0, s))  # noqa: E731
    whole = lambda shape: pl.BlockSpec(shape, lambda st, ex, fg: (0,) * len(shape))  # noqa: E731
    in_specs = [whole((1, m))] * 3 + [whole((t, h)), pl.BlockSpec(blk, half(0)), pl.BlockSpec(blk, half(1)),
                                      pl.BlockSpec((None, h, i) if down_transposed else (None, i, h),
                                                   lambda st, ex, fg: (fg[st], 0, 0))]
    operands = [keys.reshape(1, m), weights.reshape(1, m), tokens.reshape(1, m), x, gate_up, gate_up, down]
    quant, scratch = None, [pltpu.VMEM((t, h), jnp.float32)]
    if gate_up_scale is not None:
        if not (transposed and down_transposed):
            raise NotImplementedError("quantized weights: only the [g, 2I, H] / [g, H, I] layout")
        if per_channel(gate_up):  # [g, 2I] and [g, H] whole in VMEM, the expert's row read per step
            quant = MoeQuant(True, (0, 0), "f32", False)
            in_specs += [whole(a.shape) for a in (gate_up_scale, down_scale)]
        else:  # the expert's whole 128x128 block grids
            quant = MoeQuant(False, gate_up_scale_rows(gate_up_scale.shape[1], i, FP8_BLOCK), e4m3_mode(chip), False)
            in_specs += [pl.BlockSpec((None,) + a.shape[1:], lambda st, ex, fg: (fg[st], 0, 0))
                         for a in (gate_up_scale, down_scale)]
        operands += [gate_up_scale, down_scale]
        scratch += [pltpu.VMEM((i, h), x.dtype), pltpu.VMEM((i, h), x.dtype), pltpu.VMEM((h, i), x.dtype)]
    need = moe_vmem_bytes(_round_up(t, 8), _round_up(t, 8), h, i, x.dtype.itemsize, out_dtype.itemsize,
                          gate_up.dtype.itemsize) + t * h * 4 + (
        2 * 4 * (gate_up_scale.size + down_scale.size) if quant and quant.channel else 0)
    kernel = functools.partial(_decode_moe_kernel, num_groups=g, transposed=transposed,
                               down_transposed=down_transposed, activation=activation, alpha=float(alpha),
                               limit=float(limit),
                               prod_dtype=jnp.promote_types(x.dtype, top_k_weights.dtype), quant=quant)
    return pl.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((t, h), out_dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2, grid=(jnp.maximum(routed, 1),), in_specs=in_specs, out_specs=whole((t, h)),
            scratch_shapes=scratch),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=_vmem_limit(need, chip)),
        cost_estimate=pl.CostEstimate(flops=2 * m * h * 3 * i, transcendentals=m * i,
                                      bytes_accessed=min(m, g) * 3 * h * i * gate_up.dtype.itemsize
                                      + t * h * (x.dtype.itemsize + out_dtype.itemsize)),
        name="ragged_dot_decode_moe",
    )(keys, fetch, *operands)
