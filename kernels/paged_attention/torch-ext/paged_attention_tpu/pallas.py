"""Ragged paged attention for TPU in Pallas: many sequences, prefill and decode mixed in one call.

Layout (transformers' PagedAttentionCache page views, so its block tables index them directly):
  q            [T, Hq, D]          new queries of all sequences, packed; sequence s owns rows
                                   cu_q_lens[s]:cu_q_lens[s+1] (rows past cu_q_lens[-1] are padding -> 0)
  k/v_pages    [P, page, Hkv, D]   the paged cache, never copied or gathered: q's dtype (bf16 or f32), or
                                   quantized (float8_e4m3fn or int8) with k_scale/v_scale; for D < 128
                                   dividing 128 also lane-packed: [P, page, Hkv * D / 128, 128] (``kv_heads``)
  k/v_scale    [Hkv] float32       quantized caches only: stored value x scale[h] = the K/V value of KV head h
  kv_lens      [S] int32           tokens in sequence s's cache, the new ones included (they are its last)
  page_indices [S, pps] int32      page table; only the first cdiv(kv_lens[s], page) entries are read
  cu_q_lens    [S+1] int32         0 = cu[0] <= cu[1] <= ... <= T
Query row i of sequence s sits at position kv_lens[s] - q_len + i (causal, bottom-right).

How the kernel works. The packed query rows are cut into tiles of ``block_q`` tokens, one grid step
each; a step loops over its (tile, sequence) work items, the sequences with rows in the tile (their
range computed on device from cu_q_lens), so a tile shared by several short sequences (decode) is one
resident output block that each of them fills in, and a decode batch is one grid step. For an
item, only the pages its rows can see (causal end, sliding-window start) are fetched, ``block_kv``
tokens at a time, by manual DMAs from HBM into a double-buffered VMEM scratch: chunk c+1 is in
flight while chunk c is computed, and during an item's last chunk the next item's first (its
page-table row fetched into SMEM beforehand), so no item waits for its first DMA. A step's items
are one loop of chunks, not a loop of items each looping over its chunks: an item's start (init) and
end (finalize) run in its first and last chunk's iteration, while the next chunk flies. Whole pages
[page, Hkv, D] are copied (one contiguous DMA each; on PARTIAL_PAGE_CHIPS a sequence's last page only up to
its end) as page * Hkv dense rows (token, head), and every
KV head is computed from them, so GQA never repeats K/V; a head's keys are one strided sublane load
(``_head_rows``), not a per-token shuffle. The page table stays in HBM and each item copies its own
row into SMEM (a 256-sequence x 32k-token table does not fit in 1 MiB of SMEM).
Queries are regrouped by the wrapper to [Hkv, T*G, D] (G = Hq/Hkv) so each head's block is 2-D.
``write_and_attend`` runs the KV write in the same kernel: a chunk copies from the pages only the tokens
before its sequence's new ones and takes those from new_k/new_v (so no read waits on a write), and the
item's own new rows go from VMEM to their pages while it computes, waited before the slot is refilled.
Row blocks of a prefill chunk (128 or 256 rows) run keys-major on v6e and TPU7x (``_keys_major``): keys on
sublanes and rows on lanes, the softmax denominator summed by the MXU beside P @ V, the masked keys near
the causal diagonal in blocks of MASKED_KEYS; a decode item's block (one sublane tile) keeps rows on sublanes.

Quantized caches (float8_e4m3fn, int8). HBM holds and the DMAs move the 1-byte values; in VMEM each
head's chunk is converted to q's dtype (exact: every e4m3 and int8 value is a bf16 value; fp8 through
e4m3b11fnuz on v5e and v6e, ``reads_e4m3_as_b11``) and the
scales, one per KV head, are folded into f32 scalars: scores take scale * k_scale[h], the finished
output row is multiplied by v_scale[h]. That is exactly attention over the dequantized cache, with
the same bf16/f32 math as an unquantized cache. ``write_kv`` quantizes the new rows (``quantize``).

Every index the device computes is clamped (page ids into [0, P), table columns into [0, pps),
cumulative lengths into [0, T] and made monotone), so bad metadata can give wrong numbers but never
an out-of-bounds access; ``validate`` raises clear errors on the host whenever values are concrete.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import _attention_math as am
from ._bridge import check_array, dtype_name, host_values, in_hbm
from ._chips import tpu_generation

KV_DTYPES = ("float32", "bfloat16")  # q, sinks, unquantized caches, new K/V
QUANTIZED_DTYPES = ("float8_e4m3fn", "int8")
CACHE_DTYPES = KV_DTYPES + QUANTIZED_DTYPES
# Saturation bounds: e4m3fn has no inf (a cast past its largest value, 448, gives NaN); int8 is kept
# symmetric (-127..127), so x and -x quantize to opposite values.
QUANT_MAX = {"float8_e4m3fn": 448.0, "int8": 127.0}
INDEX_DTYPES = ("int32", "int64")
MiB = 1 << 20
LANES = 128  # a lane-packed cache's row width (``kv_heads``)
# Each page of a chunk is its own DMA, issued by unrolled scalar code; every chunk is a DMA-loop
# iteration (cost model v2, Qwen3 decode B=64 x 8k, page 16, one tile's items per grid step, layer at
# 0.35 us per step on TPU7x: 512 pages per chunk 420.3 us, 256 447.1; v5e and v6e are DMA-bound either way).
MAX_PAGES_PER_CHUNK = 512
# Chunks shrink (halving) until the kernel's VMEM estimate fits this (TPU7x has 64 MiB). The estimate runs high:
# Qwen3 decode B=256 x 8k page 16 (2048-row tiles) is estimated 40.8 MiB at 256 pages a chunk, 56.8 at 512, and
# compiles to 32.6 and 48.6 MiB on TPU7x. 60 rather than 48 MiB lets it take 512-page chunks, one per item: layer
# us on TPU7x 1465.0 -> 1342.9 (v5e and v6e, DMA-bound, unchanged).
KV_VMEM_BUDGET = 60 * MiB
WRITE_RUNS_PER_STEP = 16  # write_kv: runs of new rows whose DMAs one loop iteration starts (unrolled)
WRITE_MAX_RUN = 16  # write_kv: rows one run copies at most (one DMA per power of two in its length)
# write_kv metadata vectors are padded to whole 16s: XLA then computes a vector in one fused op, where at
# one token it would compute the scalars op by op.
WRITE_METADATA_MULTIPLE = 16
ONE_HOT_LIMIT = 1 << 20  # sanitize_cu, write_slots: the [n, m] one-hot / masked forms up to n x m of this
# Keys scored at once: a chunk is computed up to its last sub-block holding keys the rows see. 1024 rather
# than 512 (cost model v2): TPU7x 64 x 8k decode 418 -> 374 us, 64 x 32k 1604 -> 1428; fp8 caches +1-2% on v5e/v6e.
SUB_BLOCK = 1024
# Keys a masked sub-block of a keys-major (prefill) row block holds: it is computed whole, so smaller blocks
# waste less past the causal diagonal. Qwen3 mixed 60 decode + 4 x 128 prefill, layer us v6e / TPU7x, page 16;
# page 128: 1024 (SUB_BLOCK) 359.7 / 279.5; 329.9 / 226.7, 512 342.8 / 265.2; 319.8 / 212.3, 256 340.7 / 265.7;
# 318.8 / 212.8, 128 344.9 / 268.5; 321.4 / 215.7.
MASKED_KEYS = 256
# Query rows per tile (``_default_block_q``), cost model v2, Qwen3 mixed 60 decode + 4 x 128 prefill page 128 on
# v5e / v6e / TPU7x (layer us): 1024 rows 674.1 / 383.6 / 272.0, 2048 629.4 / 353.4 / 273.8 (four prefill chunks
# straddle tiles at 1024, two at 2048: each re-reads its KV); 2048 with the tokens spread evenly over the tiles
# 649.0 / 367.9 / 265.9 (where the boundaries fall matters more than the padding they save).
TILE_ROWS = 2048
# The KV heads' software pipeline in a sub-block (``sub_block``), per chip: how many heads after its scores a
# head's softmax is issued, and how many after that its P @ V. Chosen with the cost model v2 (Qwen3 layer us,
# mixed 60 decode + 4 x 128 prefill page 128 on v5e / v6e / TPU7x; decode 64 x 2k page 16 on TPU7x): in
# program order (no pipeline) 724.4 / 413.6 / 297.1; 194.6; (0, 1), RPA v3's, 700.3 / 406.6 / 294.1; 191.6;
# (1, 1) 717.4 / 393.2 / 275.7; 185.9; (1, 2) 722.6 / 397.2 / 275.3; 182.5. v5e decode is DMA-bound either way.
PIPELINE_LAG = {"v5e": (0, 1), "v6e": (1, 1), "tpu7x": (1, 2), None: (1, 1)}
# Chips whose prefill row blocks run keys-major (``_keys_major``; None: off TPU, the tests). Cost model v2, Qwen3
# mixed 60 decode + 4 x 128 prefill, layer us v5e / v6e / TPU7x, rows on sublanes -> keys-major (1024-key masked
# blocks): page 16 629.1 / 396.3 / 326.6 -> 640.5 / 359.7 / 279.5, page 128 629.4 / 353.4 / 273.8 -> 645.8 /
# 329.9 / 226.7. v5e (no bf16 VPU) keeps rows on sublanes.
KEYS_MAJOR_CHIPS = ("v6e", "tpu7x", None)
# Chips where a cache of q's dtype has a sequence's last page copied only up to the sequence's end
# (``cache_copies``: pieces of a power of two tokens, waits in tokens); elsewhere, and for quantized caches,
# it is copied whole. Cost model v2, Qwen3 decode B=64, layer us v5e / v6e / TPU7x, whole -> partial last page:
# page 128 458.0 / 236.0 / 127.4 -> 447.9 / 230.9 / 132.4 (8.3 MB less of 359 MB), page 16 448.7 / 231.7 /
# 177.3 -> 447.6 / 230.9 / 180.9: TPU7x's kernel is bound by issuing its copies, not by their bytes, and so
# are v5e's and v6e's over fp8 / int8 caches (page 128 fp8 407.2 / 274.7 -> 414.9 / 281.1). None: off TPU
# (the tests).
PARTIAL_PAGE_CHIPS = ("v5e", "v6e", None)
# Chips whose DMA into SMEM takes a page-table row of any length. Elsewhere (v5e: only multiples of 512 bytes,
# 128 int32; an unknown chip) the rows are padded to 128 entries, an XLA op before the kernel.
SMEM_DMA_ANY_LENGTH_CHIPS = ("v6e", "tpu7x")
# write_and_attend runs one kernel for up to this many sequences, the two calls above: the fused write's per-item
# copies and waits (power-of-two pieces) cost more than the separate write_kv call once there are many items. Cost
# model v2, before partial last pages (PARTIAL_PAGE_CHIPS; FUSED_WRITE_ANY_BATCH_PAGE has later figures), layer us
# v5e / v6e / TPU7x, one kernel vs two calls: Qwen3 decode B=1 8.7 / 6.2 / 5.7 vs 12.4 / 10.4 / 10.4,
# B=8 58.2 / 33.2 / 27.4 vs 60.6 / 35.2 / 29.7, B=64 page 16 459.4 / 250.2 / 197.9 vs 450.1 / 232.8 / 179.1.
FUSED_WRITE_MAX_SEQS = 8
# Per chip, the smallest page (tokens) at which a cache of q's dtype takes the one kernel at any batch; other
# chips never. v5e waits on its DMAs, which hide the fused write's copies at every page size (partial last
# pages on, layer us, two calls -> one kernel: Qwen3 decode B=64 page 16 447.6 -> 442.4, B=256 1743.8 ->
# 1721.5, page 128 447.9 -> 442.8, B=64 x 32k 5261.8 -> 5253.4, mixed 60 decode + 4 x 128 prefill page 16
# 627.6 -> 606.9; over an fp8 cache page 16 495.6 -> 505.9). v6e hides them where a page is one copy of
# many tokens (page 128: decode B=64 230.9 -> 225.2, mixed 313.4 -> 294.3) but not at page 16 (B=64 230.9
# -> 236.1, B=256 893.5 -> 926.7); pages between 16 and 128 are not measured. TPU7x, bound by issuing its
# copies, loses at page 128 too (decode B=64 127.4 -> 137.4, mixed 211.1 -> 211.4).
FUSED_WRITE_ANY_BATCH_PAGE = {"v5e": 1, "v6e": 128}


# --------------------------------------------------------------------------- validation

def validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=None, scale=0.0, window=0,
             softcap=0.0, block_q=0, block_kv=8192, k_scale=None, v_scale=None, rows: str = "q"):
    """Raise ValueError/TypeError naming the bad argument; checks values too when they are on the host. ``rows``:
    the name of the argument q stands for (the new tokens' rows: ``new_k`` for a write)."""
    check_array(rows, q, dtypes=KV_DTYPES, ndim=3)
    check_array("k_pages", k_pages, dtypes=CACHE_DTYPES, ndim=4)
    check_array("v_pages", v_pages, dtypes=CACHE_DTYPES, ndim=4)
    check_array("kv_lens", kv_lens, dtypes=INDEX_DTYPES, ndim=1)
    check_array("page_indices", page_indices, dtypes=INDEX_DTYPES, ndim=2)
    check_array("cu_q_lens", cu_q_lens, dtypes=INDEX_DTYPES, ndim=1)
    t, hq, d = q.shape
    num_pages, page = k_pages.shape[:2]
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise ValueError(f"v_pages must have the shape of k_pages {tuple(k_pages.shape)}, got {tuple(v_pages.shape)}")
    if dtype_name(k_pages) != dtype_name(v_pages):
        raise TypeError(f"k_pages and v_pages must share a dtype, got {dtype_name(k_pages)} and {dtype_name(v_pages)}")
    if dtype_name(k_pages) not in QUANTIZED_DTYPES and dtype_name(q) != dtype_name(k_pages):
        raise TypeError(f"{rows}, k_pages and v_pages must share a dtype (or the cache be quantized: "
                        f"{' or '.join(QUANTIZED_DTYPES)}), got {dtype_name(q)}, {dtype_name(k_pages)}, "
                        f"{dtype_name(v_pages)}")
    hkv, pack = kv_heads(k_pages, d, rows)
    if pack > 1 and dtype_name(k_pages) in QUANTIZED_DTYPES:
        raise ValueError(f"a lane-packed cache (k_pages {tuple(k_pages.shape)}: {pack} heads of {d} a row) cannot be "
                         f"quantized (the scales are per KV head); store it as [P, page, Hkv, {d}]")
    validate_scales(k_pages, k_scale, v_scale)
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{rows} heads ({hq}) must be a multiple of the KV heads of k_pages ({hkv})")
    if not 1 <= page <= 1024:
        raise ValueError(f"page size (k_pages.shape[1]) must be in [1, 1024], got {page}")
    sub = _sublanes(dtype_name(q))  # pages are merged into rows in q's dtype (the compute dtype)
    if page % sub:
        raise ValueError(f"page size (k_pages.shape[1]) must be a multiple of {sub} for a {dtype_name(q)} {rows} "
                         f"(TPU sublane tile), got {page}")
    num_seqs, pps = page_indices.shape
    if tuple(kv_lens.shape) != (num_seqs,):
        raise ValueError(f"kv_lens must have shape ({num_seqs},) (one per page_indices row), got {tuple(kv_lens.shape)}")
    if tuple(cu_q_lens.shape) != (num_seqs + 1,):
        raise ValueError(f"cu_q_lens must have shape ({num_seqs + 1},) (sequences + 1), got {tuple(cu_q_lens.shape)}")
    if sinks is not None:
        check_array("sinks", sinks, dtypes=KV_DTYPES, ndim=1)
        if tuple(sinks.shape) != (hq,):
            raise ValueError(f"sinks must have shape ({hq},) (one logit per q head), got {tuple(sinks.shape)}")
    if window < 0:
        raise ValueError(f"window must be >= 0 (0 = no sliding window), got {window}")
    if softcap < 0:
        raise ValueError(f"softcap must be >= 0 (0 = no soft-capping), got {softcap}")
    if block_q < 0 or block_kv <= 0:
        raise ValueError(f"block_q must be >= 0 (0 = automatic) and block_kv > 0, got {block_q}, {block_kv}")
    # Values: only when already on the host (on device or under jit the kernel clamps, no host sync).
    cu, lens, table = host_values(cu_q_lens), host_values(kv_lens), host_values(page_indices)
    if cu is not None and cu.size:
        if cu[0] != 0:
            raise ValueError(f"cu_q_lens[0] must be 0, got {int(cu[0])}")
        if np.any(np.diff(cu) < 0):
            bad = int(np.argmax(np.diff(cu) < 0))
            raise ValueError(f"cu_q_lens must be non-decreasing, but cu_q_lens[{bad + 1}]={int(cu[bad + 1])} "
                             f"< cu_q_lens[{bad}]={int(cu[bad])}")
        if cu[-1] > t:
            raise ValueError(f"cu_q_lens[-1]={int(cu[-1])} exceeds the number of query rows {rows}.shape[0]={t}")
    if lens is not None:
        if np.any(lens < 0):
            raise ValueError(f"kv_lens must be >= 0, got {int(lens.min())} for sequence {int(np.argmin(lens))}")
        if np.any(lens > pps * page):
            s = int(np.argmax(lens > pps * page))
            raise ValueError(f"kv_lens[{s}]={int(lens[s])} exceeds what its pages hold: page_indices has {pps} "
                             f"columns x page size {page} = {pps * page} tokens")
        if cu is not None:
            q_lens = np.diff(cu)
            if np.any(q_lens > lens):
                s = int(np.argmax(q_lens > lens))
                raise ValueError(f"sequence {s} has {int(q_lens[s])} new queries but kv_lens[{s}]={int(lens[s])}; "
                                 f"the new tokens must be counted in kv_lens")
        if table is not None:
            needed = (np.arange(pps)[None, :] < -(-lens[:, None] // page))
            bad = needed & ((table < 0) | (table >= num_pages))
            if np.any(bad):
                s, j = (int(x) for x in np.argwhere(bad)[0])
                raise ValueError(f"page_indices[{s}, {j}]={int(table[s, j])} is out of range [0, {num_pages}) "
                                 f"(k_pages holds {num_pages} pages; sequence {s} needs its first "
                                 f"{int(-(-lens[s] // page))} entries)")


def kv_heads(k_pages, d: int, of: str) -> tuple[int, int]:
    """(KV heads, heads a cache row holds) of a cache for head dim ``d`` (that of ``of``).

    A cache is [P, page, Hkv, D], or, for D < 128 dividing 128, lane-packed: [P, page, Hkv * D / 128, 128],
    the same bytes (a reshape) with 128 / D heads a row. Why: XLA:TPU gives [P, page, Hkv, 64] a pages-minor
    default layout, so a kernel reading rows has that cache copied in and out around every call (GPT-OSS
    decode of 64 sequences on v6e: 1.66 ms of a 2.08 ms layer in the cost model); [..., 128] it keeps row-major.
    """
    rows, width = k_pages.shape[2], k_pages.shape[3]
    if width == d:
        return rows, 1
    if width == LANES and d < LANES and LANES % d == 0:
        return rows * (LANES // d), LANES // d
    raise ValueError(f"head_dim of {of} ({d}) does not match k_pages {tuple(k_pages.shape)}: the cache is "
                     f"[P, page, Hkv, {d}]" + (f", or lane-packed [P, page, Hkv * {d} / {LANES}, {LANES}]"
                                               if d < LANES and LANES % d == 0 else ""))


def lane_packed_shape(cache) -> tuple[int, int, int, int] | None:
    """The lane-packed shape [P, page, Hkv * D / 128, 128] (``kv_heads``) of a cache [P, page, Hkv, D] (anything
    with .shape and .dtype: a torch tensor, a jax array, a ShapeDtypeStruct), or None when it has none: D of
    128 or more or not dividing 128, Hkv not a multiple of 128 / D, or a quantized cache (scales are per KV head).
    """
    p, page, hkv, d = cache.shape
    if not 0 < d < LANES or LANES % d or (hkv * d) % LANES or dtype_name(cache) in QUANTIZED_DTYPES:
        return None
    return p, page, hkv * d // LANES, LANES


def validate_scales(k_pages, k_scale, v_scale):
    """A quantized cache needs k_scale and v_scale, float32 [Hkv] (one per KV head), positive and finite
    when their values are on the host; an unquantized cache takes none."""
    cache = dtype_name(k_pages)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if cache not in QUANTIZED_DTYPES:
            if s is not None:
                raise TypeError(f"{name} is given but the cache (k_pages) is {cache}: scales belong to a quantized "
                                f"cache ({' or '.join(QUANTIZED_DTYPES)}); pass {name}=None")
            continue
        if s is None:
            raise ValueError(f"the cache (k_pages) is {cache}, a quantized dtype: {name} (float32 [Hkv], one scale "
                             f"per KV head) is required")
        check_array(name, s, dtypes=("float32",), ndim=1)
        if tuple(s.shape) != (k_pages.shape[2],):
            raise ValueError(f"{name} must have shape ({k_pages.shape[2]},) (one scale per KV head of k_pages), "
                             f"got {tuple(s.shape)}")
        check_scale_values(name, s)


def check_scale_values(name: str, scale):
    """A quantized cache's scales must be positive and finite (checked when their values are on the host)."""
    values = host_values(scale)
    if values is not None and not (np.isfinite(values) & (values > 0)).all():
        raise ValueError(f"{name} must be positive and finite, got {values.tolist()}")


def quantize(x, scale, dtype):
    """x [..., Hkv, D] as ``dtype`` (float8_e4m3fn or int8) with one scale per KV head (scale [Hkv]):
    x / scale, rounded to nearest (ties to even) and saturated to +-448 (e4m3fn) or +-127 (int8)."""
    name = jnp.dtype(dtype).name
    bound = QUANT_MAX[name]
    y = x.astype(jnp.float32) / scale.astype(jnp.float32)[:, None]
    if name == "int8":
        y = jnp.round(y)  # jnp.round: ties to even, like the float8 cast
    return jnp.clip(y, -bound, bound).astype(dtype)


# --------------------------------------------------------------------------- work items

def _default_block_q(group: int, dtype, tokens: int) -> int:
    """Query tokens per tile: TILE_ROWS rows of (token, q head in group), a multiple of the sublane tile,
    and no more than the batch's tokens need (the q and output blocks move whole: a 1-token decode in a
    2048-row tile would move 2 x 2 MiB of padding for Qwen3's 4 x 128 heads). A sequence whose rows
    straddle two tiles is an item in each and reads its KV twice, so larger tiles cut HBM traffic;
    decode items in a tile still compute only their own row blocks."""
    sub = _sublanes(dtype)
    bq = max(1, min(TILE_ROWS // group, tokens))
    while (bq * group) % sub:
        bq += 1
    return bq


def _count_prefix(ref, first: int, n: int, pred):
    """How many of ref[first], ..., ref[first + n - 1] (sorted so that ``pred`` holds on a prefix) satisfy
    ``pred``: a branch-free binary search in scalar code, log2(n) steps."""
    pos, step = 0, 1 << max(n.bit_length() - 1, 0)
    while step and n:
        cand = pos + step
        pos = jnp.where((cand <= n) & pred(ref[first + jnp.minimum(cand, n) - 1]), cand, pos)
        step //= 2
    return pos


def _udiv(a, b: int):
    """a // b for non-negative int32 a, as unsigned division: for the small arrays around the kernels
    (at one sequence, scalars XLA computes op by op) three ops (two bitcasts and a shift, for a power of
    two) where signed division takes six."""
    return jax.lax.bitcast_convert_type(jax.lax.div(jax.lax.bitcast_convert_type(a, jnp.uint32), jnp.uint32(b)),
                                        jnp.int32)


def _searchsorted_right(sorted_values, x):
    """jnp.searchsorted(sorted_values, x, side="right") as int32. Comparing every pair is one fused op
    where the default binary search is a loop of a dozen small XLA ops around the kernel (0.35 us
    each in the cost model); past 16M pairs the binary search is the cheaper."""
    method = "compare_all" if sorted_values.shape[0] * x.shape[0] <= 1 << 24 else "scan"
    return jnp.searchsorted(sorted_values, x, side="right", method=method).astype(jnp.int32)


def sanitize_cu(cu_q_lens, t):
    """Cumulative lengths clipped to [0, T] and made non-decreasing: device-side safety, no OOB tiles.
    Values on the host (a serving loop's metadata, a constant under jit) are sanitized there: no XLA op."""
    host = host_values(cu_q_lens)
    if host is not None:
        return jnp.asarray(np.maximum.accumulate(np.clip(host.astype(np.int64), 0, t)).astype(np.int32))
    cu = jnp.clip(cu_q_lens.astype(jnp.int32), 0, t)
    n = cu.shape[0]
    if n * n > ONE_HOT_LIMIT:
        return jax.lax.cummax(cu)
    # The running max as one masked [n, n] max: one fused op where XLA:TPU's cummax is a reduce-window and
    # two more ops (65 entries on v5e: 221 bundles in 3 ops).
    i = jnp.arange(n, dtype=jnp.int32)
    return jnp.max(jnp.where(i[None, :] <= i[:, None], cu[None, :], 0), axis=1)


# --------------------------------------------------------------------------- the kernel

def current_chip() -> str | None:
    """The TPU generation compiled for (``_chips.tpu_generation``); None off TPU."""
    return tpu_generation()


def reads_e4m3_as_b11(chip: str | None = None) -> bool:
    """Whether fp8 K/V rows are converted through e4m3b11fnuz (``_values``): on v5e and v6e, which unpack no
    other fp8 of 4 exponent bits, Mosaic's e4m3fn conversion takes 4 compares and 4 selects per bf16 vreg
    (Qwen3 decode B=64 page 16 on v6e, modelled: 547.8 -> 478.9 us), and on an unknown chip (right
    everywhere); not on TPU7x, which converts e4m3fn itself (the other way measured 4.4x slower there)."""
    return (chip or current_chip()) != "tpu7x"


def _sublanes(dtype) -> int:
    """Rows of a TPU (sublane, 128) tile of ``dtype``: 8 32-bit rows, 16 of bf16, 32 of a 1-byte dtype."""
    return 8 * (4 // jnp.dtype(dtype).itemsize)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _powers_of_two(limit: int) -> list[int]:
    """1, 2, 4, ... up to limit (static), largest first."""
    return [1 << i for i in reversed(range(max(limit, 1).bit_length()))]


def _start_pieces(count, limit: int, start):
    """Start a copy of ``count`` units (traced, at most ``limit``) as one copy per power of two in it, the
    larger first: ``start(at, b)`` copies units at .. at + b - 1 (b static: DMA sizes are static)."""
    for b in _powers_of_two(limit):
        @pl.when(jnp.bitwise_and(count, b) != 0)
        def _(b=b):
            start(jnp.bitwise_and(count, ~(2 * b - 1)), b)


def _wait_units(count, limit: int, wait):
    """Wait for ``count`` (traced, at most ``limit``) units of copies. A DMA semaphore counts what has
    arrived, so the waits need not match the copies one to one: ``wait(b)`` (a wait b units long: it
    reads only its semaphore and its destination's size) once per power of two b in ``count``."""
    for b in _powers_of_two(limit):
        pl.when(jnp.bitwise_and(count, b) != 0)(functools.partial(wait, b))


def _div(a, b):
    """Division of non-negative ints (truncating), in kernels: jnp's floor division lowers through
    sign(), which Mosaic cannot lower without a TPU to ask the generation of. By a static power of two, a
    shift: signed division by a constant is four dependent scalar ops (the rounding toward zero)."""
    a = jnp.asarray(a, jnp.int32)
    if isinstance(b, int) and b > 0 and b & (b - 1) == 0:
        return jax.lax.shift_right_arithmetic(a, jnp.int32(b.bit_length() - 1))
    return jax.lax.div(a, jnp.asarray(b, jnp.int32))


def _kernel(kv_lens_ref, cu_ref,  # scalar prefetch (SMEM)
            q_ref, table_hbm, k_hbm, v_hbm,  # inputs; then new K/V rows [T * Hkv, D] (write), sinks [Hq] (has_sinks),
            *refs,  # scales [2 Hkv] (quantized); the output block [Hkv, R, D], the caches (write); scratch
            pps, scale, window, softcap, block_q, group, pages_per_block, block_sizes, has_sinks, quantized,
            e4m3_b11, lag, keys_major, exp_dtype, write, partial_pages):
    new_k_hbm, new_v_hbm = refs[:2] if write else (None, None)
    refs = refs[2 * write:]
    sinks_ref = refs[0] if has_sinks else None
    scales_ref = refs[has_sinks] if quantized else None
    o_ref, *refs = refs[has_sinks + quantized:]
    k_out, v_out = refs[:2] if write else (None, None)  # the caches again (aliased): the new rows go there
    table_smem, state, kbuf, vbuf, sems, table_sems, m_ref, l_ref, acc_ref, *extra = refs[2 * write:]
    mt_ref, acct_ref = extra[:2] if keys_major else (None, None)  # keys-major row blocks' state (``_keys_major``)
    write_sems = extra[-1] if write else None  # the cache writes' semaphores [K/V, slot]

    def is_major(size):  # the large row blocks, when keys-major
        return keys_major and size == block_sizes[-1]
    tile, num_tiles = pl.program_id(0), pl.num_programs(0)
    num_seqs = cu_ref.shape[0] - 1
    num_pages, page = k_hbm.shape[0], k_hbm.shape[1] // o_ref.shape[0]
    hkv, rows, d = o_ref.shape
    stride = table_smem.shape[0] // 2  # table_smem holds two page-table rows
    chunk = pages_per_block * page
    new_tokens = new_k_hbm.shape[0] // hkv if write else 0  # rows of new_k/new_v: T
    sub = SUB_BLOCK if chunk % SUB_BLOCK == 0 else chunk  # keys per score block: a chunk's last is partly past the end
    partial = write or partial_pages  # part of a page copied (``cache_copies``)
    unit = _word_tokens(hkv, kbuf.dtype.itemsize)  # such a copy starts and ends on whole 32-bit rows (Mosaic)

    def plan(tile, s):
        """Item (tile, s)'s rows [lo, hi) of the packed queries and the pages [first_page, end_page) they see."""
        kv_len = kv_lens_ref[s]
        q_start, q_end = cu_ref[s], cu_ref[s + 1]
        tile_start = tile * block_q
        lo = jnp.maximum(q_start, tile_start)
        hi = jnp.minimum(q_end, tile_start + block_q)
        offset = kv_len - (q_end - q_start)  # position of the sequence's first new query
        # Keys the rows can see: causal end, sliding-window start; whole pages, clamped to the table.
        kv_end = jnp.clip(offset + hi - q_start, 0, kv_len)
        kv_begin = 0 if window == 0 else jnp.clip(offset + lo - q_start - window + 1, 0, kv_end)
        first_page = _div(kv_begin, page)
        # no pages for an empty sequence (an item only when it sits between others of the tile)
        end_page = jnp.where(hi > lo, jnp.minimum(_div(kv_end + page - 1, page), pps), first_page)
        num_chunks = _div(jnp.maximum(end_page - first_page, 0) + pages_per_block - 1, pages_per_block)
        return dict(tile_start=tile_start, q_start=q_start, lo=lo, hi=hi, offset=offset, kv_end=kv_end,
                    first_page=first_page, end_page=end_page, num_chunks=num_chunks)

    def chunk_span(it_plan, c):
        """Chunk c of an item: its first page p0, its pages n (none past the item's end) and their token
        positions [start, end)."""
        p0 = jnp.minimum(it_plan["first_page"] + c * pages_per_block, pps)
        n = jnp.clip(it_plan["end_page"] - p0, 0, pages_per_block)
        return p0, n, p0 * page, (p0 + n) * page

    def table_copy(s, row):  # sequence s's page-table row (padded) -> table_smem[row * stride:]
        return pltpu.make_async_copy(table_hbm.at[s], table_smem.at[pl.ds(row * stride, table_hbm.shape[1])],
                                     table_sems.at[row])

    def page_id(at):  # table_smem[at] clamped into [0, num_pages) (a negative one read as a large unsigned)
        return jax.lax.bitcast_convert_type(
            jnp.minimum(jax.lax.bitcast_convert_type(table_smem[at], jnp.uint32), num_pages - 1), jnp.int32)

    def cache_copies(it_plan, c):
        """What chunk c copies from the cache: ``whole`` pages from p0, then ``part`` tokens of page ``col``
        (0 where it is not in the chunk). With write, the pages wholly before the sequence's first new token
        and the tokens before it of its page (new_k/new_v give the rest); on PARTIAL_PAGE_CHIPS the pages
        wholly before the sequence's end and its last page up to the end, rounded up to whole 32-bit rows
        (``_word_tokens``; the tokens past the end come along and are masked); elsewhere every page whole."""
        p0, n, _, _ = chunk_span(it_plan, c)
        if not partial:
            return p0, n, None, 0
        limit = it_plan["offset"] if write else it_plan["kv_end"]
        col = _div(jnp.maximum(limit, 0), page)
        part = limit - col * page
        if not write:
            part = jnp.minimum(_div(part + unit - 1, unit) * unit, page)
        part = jnp.where((col >= p0) & (col < p0 + n), jnp.maximum(part, 0), 0)
        return p0, jnp.clip(col - p0, 0, n), col, part

    def start_pages(it_plan, row, c, slot):
        """Start the K and V copies of chunk c (``cache_copies``) into ``slot``: a DMA for each whole page,
        pieces for the part of one (``_start_pieces``); with write, the new tokens from new_k/new_v."""
        # a table_smem row has at least pages_per_block entries of slack past pps: every read is in bounds
        p0, whole, col, part = cache_copies(it_plan, c)
        at = row * stride + p0
        for j in range(pages_per_block):
            pid = page_id(at + j)

            @pl.when(j < whole)
            def _():
                for src, dst, sem in ((k_hbm, kbuf, sems.at[0, slot]), (v_hbm, vbuf, sems.at[1, slot])):
                    pltpu.make_async_copy(src.at[pid], dst.at[slot, pl.ds(j * page * hkv, page * hkv)], sem).start()
        if not partial:
            return

        @pl.when(part > 0)
        def _():
            pid, j = page_id(row * stride + col), col - p0

            def piece(at, size):
                for src, dst, sem in ((k_hbm, kbuf, sems.at[0, slot]), (v_hbm, vbuf, sems.at[1, slot])):
                    pltpu.make_async_copy(src.at[pid, pl.ds(at * hkv, size * hkv)],
                                          dst.at[slot, pl.ds((j * page + at) * hkv, size * hkv)], sem).start()
            _start_pieces(part, page - 1 if write else page, piece)  # with write, part < page
        if not write:
            return
        offset = it_plan["offset"]

        # the new tokens the chunk holds, from new_k/new_v
        a, b = new_span(it_plan, c)

        def piece(at, size):
            src_row = (it_plan["q_start"] + a - offset + at) * hkv
            for src, dst, sem in ((new_k_hbm, kbuf, sems.at[0, slot]), (new_v_hbm, vbuf, sems.at[1, slot])):
                pltpu.make_async_copy(src.at[pl.ds(src_row, size * hkv)],
                                      dst.at[slot, pl.ds((a - p0 * page + at) * hkv, size * hkv)], sem).start()
        _start_pieces(b - a, min(chunk, new_tokens), piece)

    def new_span(it_plan, c):
        """Positions [a, b) of the sequence's new tokens that chunk c holds and the item sees (write)."""
        _, _, start, end = chunk_span(it_plan, c)
        a = jnp.maximum(it_plan["offset"], start)
        return a, jnp.maximum(jnp.minimum(it_plan["kv_end"], end), a)

    def wait_tokens(sem_of, slot):
        def wait(b):  # ``_wait_units``: b tokens of K and of V
            for i, buf in enumerate((kbuf, vbuf)):
                rows = buf.at[slot, pl.ds(0, b * hkv)]
                pltpu.make_async_copy(rows, rows, sem_of(i)).wait()
        return wait

    def wait_pages(it_plan, c, slot):
        """Wait for what ``start_pages`` copied (``_wait_units``: a unit a token, or a page where pages are
        copied whole)."""
        if not partial:
            def wait(b):
                for buf, sem in ((kbuf, sems.at[0, slot]), (vbuf, sems.at[1, slot])):
                    pages = buf.at[slot, pl.ds(0, b * page * hkv)]
                    pltpu.make_async_copy(pages, pages, sem).wait()

            _wait_units(chunk_span(it_plan, c)[1], pages_per_block, wait)
            return
        _, whole, _, part = cache_copies(it_plan, c)
        tokens = whole * page + part
        if write:  # and the new tokens, from new_k/new_v
            a, b = new_span(it_plan, c)
            tokens += b - a
        _wait_units(tokens, chunk, wait_tokens(lambda i: sems.at[i, slot], slot))

    def write_rows(it_plan, row, c, slot):
        """Start the copies of the item's own new rows in chunk c (in VMEM ``slot``) to their cache pages, a
        page at a time (a page id out of [0, num_pages): not written, as ``write_kv``); they fly until the
        slot is refilled (``wait_writes``)."""
        _, _, start, end = chunk_span(it_plan, c)
        first = it_plan["offset"] + it_plan["lo"] - it_plan["q_start"]  # positions of the item's rows
        a = jnp.clip(first, start, end)
        b = jnp.clip(first + it_plan["hi"] - it_plan["lo"], a, end)

        def page_rows(p, count):
            lo_p, hi_p = jnp.maximum(a, p * page), jnp.minimum(b, p * page + page)
            pid = table_smem[row * stride + p]
            ok = (pid >= 0) & (pid < num_pages)

            @pl.when(ok)
            def _():
                def piece(at, size):
                    for buf, dst, sem in ((kbuf, k_out, write_sems.at[0, slot]), (vbuf, v_out, write_sems.at[1, slot])):
                        pltpu.make_async_copy(buf.at[slot, pl.ds((lo_p - start + at) * hkv, size * hkv)],
                                              dst.at[pid, pl.ds((lo_p - p * page + at) * hkv, size * hkv)], sem).start()
                _start_pieces(hi_p - lo_p, min(page, new_tokens), piece)
            return count + jnp.where(ok, hi_p - lo_p, 0)

        state[PENDING + slot] = jax.lax.fori_loop(_div(a, page), _div(b + page - 1, page), page_rows, 0)

    def wait_writes(slot):
        """Wait for the cache writes from VMEM ``slot`` (before it is refilled, and at the end)."""
        _wait_units(state[PENDING + slot], chunk, wait_tokens(lambda i: write_sems.at[i, slot], slot))
        state[PENDING + slot] = 0

    # State carried from item to item (the grid runs in order, each tile's items in one loop): which
    # table_smem row holds this item's page-table row, which K/V slot its first chunk goes to, and the
    # item (tile, sequence) whose first chunk (and table row) the previous item already fetched: an
    # item's first chunk is prefetched while the previous item computes its last, so no item waits
    # for its first DMA.
    # With write, PENDING + slot counts the tokens still being copied from VMEM slot to the cache.
    ROW, SLOT, PF_TILE, PF_SEQ, PENDING = 0, 1, 2, 3, 4

    @pl.when(tile == 0)
    def _init():
        state[ROW], state[SLOT], state[PF_TILE], state[PF_SEQ] = 0, 0, -1, -1
        if write:
            state[PENDING], state[PENDING + 1] = 0, 0

    o_ref[...] = jnp.zeros_like(o_ref)  # rows no sequence owns (padding) stay 0

    def tile_sequences(t):
        """The sequences with rows in query tile t: [lo, hi), found in cu (sanitized: sorted). Empty ones at
        the end are in no tile; one between others is an item without rows."""
        start, end = t * block_q, jnp.minimum(t * block_q + block_q, cu_ref[num_seqs])
        lo = _count_prefix(cu_ref, 1, num_seqs, lambda c: c <= start)  # sequences ending by the tile's start
        hi = _count_prefix(cu_ref, 0, num_seqs, lambda c: c < end)  # sequences starting before its end
        return lo, jnp.maximum(hi, lo)

    seq_lo, seq_hi = tile_sequences(tile)
    next_lo, next_hi = tile_sequences(tile + 1)

    def step(carry):
        """One iteration of the grid step's DMA loop: chunk i of item s (its ``body``), and at the item's
        first iteration its start (page-table row, row blocks' init), at its last its end (finalize)."""
        s, i = carry
        me = plan(tile, s)
        tile_start, q_start, lo, hi = me["tile_start"], me["q_start"], me["lo"], me["hi"]
        offset, kv_end, num_chunks = me["offset"], me["kv_end"], me["num_chunks"]
        row, base = state[ROW], state[SLOT]
        prefetched = (state[PF_TILE] == tile) & (state[PF_SEQ] == s)

        first_iter = i == 0

        @pl.when(jnp.logical_not(prefetched) & first_iter)
        def _():
            table_copy(s, row).start()
            table_copy(s, row).wait()

        # The next item: the next sequence in this tile, else the next tile's first (if it has any).
        in_tile = s + 1 < seq_hi
        nxt_tile = jnp.where(in_tile, tile, tile + 1)
        nxt = jnp.where(in_tile, s + 1, next_lo)
        has_next = (in_tile | ((tile + 1 < num_tiles) & (next_lo < next_hi))) & (num_chunks > 0)
        nxt = jnp.minimum(nxt, num_seqs - 1)  # a sequence id in range even when there is no next
        nxt_plan = plan(nxt_tile, nxt)

        @pl.when(has_next & first_iter)
        def _():
            table_copy(nxt, 1 - row).start()

        # Only the row blocks holding this item's rows are touched: a decode item in a tile shared by
        # many sequences costs its own rows, not the tile's. Row r of a block is (token, head in group).
        # Items spanning at most two blocks of the smallest size (decode, short speculative runs) are
        # computed in those, so their scores and softmax cover their own rows, not 128; longer items
        # take the largest, so each K/V chunk goes through the MXU once per ``block_rows[-1]`` rows.
        row_lo, row_hi = (lo - tile_start) * group, (hi - tile_start) * group

        def span(size):
            return _div(row_lo, size), _div(row_hi + size - 1, size)

        first_small, end_small = span(block_sizes[0])
        small = end_small - first_small <= 2

        def for_blocks(fn, when=True):  # fn over the item's row blocks (none where ``when`` is false)
            for size in block_sizes:  # static sizes; one loop runs per item, the others have no trips
                first, end = span(size)
                run = when & (small == (size == block_sizes[0])) if len(block_sizes) > 1 else when
                end = jnp.where(run, end, first)
                jax.lax.fori_loop(first, end, functools.partial(fn, size), 0)

        def block_rows(size, j):
            r0 = pl.multiple_of(j * size, size)
            r = r0 + jax.lax.broadcasted_iota(jnp.int32, (size, 1), 0)
            tok = tile_start + _div(r, group)  # packed query row
            return r0, pl.ds(r0, size), r, tok, (tok >= lo) & (tok < hi)

        def block_lanes(size, j):  # block_rows' token and ownership of each row, as lane vectors [1, size]
            r = j * size + jax.lax.broadcasted_iota(jnp.int32, (1, size), 1)
            tok = tile_start + _div(r, group)
            return r, tok, (tok >= lo) & (tok < hi)

        def init_block(size, j, carry):
            _, rs, _, _, _ = block_rows(size, j)
            if is_major(size):
                mt_ref[:, :, rs] = jnp.full((hkv, 1, size), am.MASK_VALUE, jnp.float32)
                acct_ref[:, :, rs] = jnp.zeros((hkv, acct_ref.shape[1], size), jnp.float32)
                return carry
            m_ref[:, rs, :] = jnp.full((hkv, size, 1), am.MASK_VALUE, jnp.float32)
            l_ref[:, rs, :] = jnp.zeros((hkv, size, 1), jnp.float32)
            acc_ref[:, rs, :] = jnp.zeros((hkv, size, d), jnp.float32)
            return carry

        for_blocks(init_block, first_iter)

        # Iteration i starts chunk i - lead + 1 (after the last, the next item's first) and computes chunk
        # i - lead: double buffering, the next chunk flies while this one computes. An item whose first
        # chunk was not prefetched takes one issue-only iteration first (lead = 1), so the page-copy code
        # (unrolled, a DMA per page) is in the schedule once, not also at the item's start.
        lead = (jnp.logical_not(prefetched) & (num_chunks > 0)).astype(jnp.int32)
        last_iter = i + 1 == jnp.maximum(num_chunks + lead, 1)  # an item without chunks still has one

        def body(i):
            c = i - lead  # the chunk computed
            last = c + 1 == num_chunks
            slot = jax.lax.rem(base + c + 1, 2)  # the chunk started goes to this slot, chunk c is in the other

            @pl.when(last & has_next)
            def _():
                table_copy(nxt, 1 - row).wait()

            @pl.when((jnp.logical_not(last) & (num_chunks > 0)) | has_next)
            def _():
                if write:
                    wait_writes(slot)
                keys = ("first_page", "end_page") + (
                    ("offset", "kv_end", "q_start") if write else ("kv_end",) if partial else ())
                target = {k: jnp.where(last, nxt_plan[k], me[k]) for k in keys}
                start_pages(target, jnp.where(last, 1 - row, row), jnp.where(last, 0, c + 1), slot)

            @pl.when((c >= 0) & (c < num_chunks))
            def _():
                compute_chunk(c, 1 - slot, row)

        def compute_chunk(c, slot, row):
            wait_pages(me, c, slot)
            if write:
                write_rows(me, row, c, slot)
            chunk_start = chunk_span(me, c)[2]
            itemsize = kbuf.dtype.itemsize

            def compute_block(size, j, carry):
                r0, rs, _, tok, mine = block_rows(size, j)
                last_q = offset + jnp.minimum(tile_start + _div(r0 + size - 1, group), hi - 1) - q_start
                # Keys past the end of the sequence (or past the block's causal diagonal) are never
                # computed: the chunk goes through in sub-blocks, as many as hold keys the rows see.
                seen = jnp.minimum(kv_end, last_q + 1) - chunk_start
                num_sub = _div(jnp.clip(seen, 0, chunk) + sub - 1, sub)

                # Sub-blocks before the causal diagonal of the block's first own row and inside the
                # sequence are seen whole by every own row: no mask (no sliding window).
                first_q = offset + jnp.maximum(tile_start + _div(r0, group), lo) - q_start
                clear = 0 if window else jnp.clip(_div(jnp.minimum(kv_end, first_q + 1) - chunk_start, sub), 0, num_sub)

                def sub_block(masked, b, carry):
                    start = pl.multiple_of(b * sub, sub)
                    ok = v_ok = None
                    if masked:
                        k_pos = chunk_start + start + _token_order(hkv, itemsize, sub, (1, sub), 1)
                        ok = mine & am.allowed(offset + tok - q_start, k_pos, causal=True, window=window or None)
                        ok &= k_pos < kv_end
                        # Slots past the end hold what the page held there, or were not fetched: zero them
                        # so that 0 * garbage cannot give NaN.
                        v_ok = chunk_start + start + _token_order(hkv, itemsize, sub, (sub, 1), 0) < kv_end
                    # The heads run as a software pipeline (``PIPELINE_LAG``): head h's scores, head h - lag[0]'s
                    # softmax and head h - lag[0] - lag[1]'s P @ V are issued together, so the MXU and the vector
                    # units each have another head's work at hand (vLLM TPU's RPA v3 does lag (0, 1)).
                    scores, weights = {}, {}
                    for i in range(hkv + sum(lag)):
                        if i < hkv:
                            h = i
                            k, v = (_head_rows(buf, slot, h, hkv, start, sub, e4m3_b11) for buf in (kbuf, vbuf))
                            if quantized:  # dequantize in VMEM: exact in q's dtype, k_scale joins the score scale
                                k, v = _values(k, q_ref.dtype), _values(v, q_ref.dtype)
                            if masked:
                                v = jnp.where(v_ok, v, 0)
                            k_scale = scale * scales_ref[h] if quantized else scale
                            scores[h] = am.scores(q_ref[h, rs, :], k, scale=k_scale, softcap=softcap or None), v
                        if 0 <= (h := i - lag[0]) < hkv:
                            sc, v = scores.pop(h)
                            m, l, alpha, p = am.softmax_weights(m_ref[h, rs, :], l_ref[h, rs, :], sc, ok)
                            m_ref[h, rs, :], l_ref[h, rs, :] = m, l
                            weights[h] = alpha, p, v
                        if 0 <= (h := i - sum(lag)) < hkv:
                            acc_ref[h, rs, :] = am.accumulate(acc_ref[h, rs, :], *weights.pop(h))
                    return carry

                def sub_block_keys_major(masked, n, b, carry):
                    """sub_block with keys on sublanes and the block's rows on lanes (``_keys_major``): the
                    b-th block of n keys (unmasked ones from the chunk's start, masked ones after them)."""
                    start = pl.multiple_of(b * n if not masked else clear * sub + b * n, n)
                    ok = v_ok = None
                    if masked:
                        _, tok_l, mine_l = block_lanes(size, j)
                        k_pos = chunk_start + start + _token_order(hkv, itemsize, n, (n, 1), 0)
                        ok = mine_l & am.allowed(offset + tok_l - q_start, k_pos, causal=True, window=window or None)
                        ok &= k_pos < kv_end
                        v_ok = k_pos < kv_end
                    # head h + 1's scores are issued before head h's softmax step (one basic block)
                    pending = None
                    for h in range(hkv + 1):
                        if h < hkv:
                            k, v = (_head_rows(buf, slot, h, hkv, start, n, e4m3_b11) for buf in (kbuf, vbuf))
                            if quantized:
                                k, v = _values(k, q_ref.dtype), _values(v, q_ref.dtype)
                            if masked:
                                v = jnp.where(v_ok, v, 0)
                            k_scale = scale * scales_ref[h] if quantized else scale
                            t = am.scores_keys_major(k, q_ref[h, rs, :], scale=k_scale, softcap=softcap or None)
                            # V^T over rows of ones: the MXU sums the softmax denominator with P @ V
                            vt = jnp.concatenate([v.T, jnp.ones((am.ONES_ROWS, n), v.dtype)], axis=0)
                        if pending is not None:
                            g, tg, vtg = pending
                            mt_ref[g, :, rs], acct_ref[g, :, rs] = am.online_softmax_step_keys_major(
                                mt_ref[g, :, rs], acct_ref[g, :, rs], tg, ok, vtg, exp_dtype=exp_dtype)
                        pending = (h, t, vt) if h < hkv else None
                    return carry

                if is_major(size):
                    # The masked keys (causal diagonal, the sequence's end, a window) go in blocks of
                    # MASKED_KEYS: the last block a chunk computes is whole, past the keys the rows see.
                    n = MASKED_KEYS if sub % MASKED_KEYS == 0 else sub
                    num_masked = _div(jnp.maximum(jnp.clip(seen, 0, chunk) - clear * sub, 0) + n - 1, n)
                    carry = jax.lax.fori_loop(0, clear, functools.partial(sub_block_keys_major, False, sub), carry)
                    return jax.lax.fori_loop(0, num_masked, functools.partial(sub_block_keys_major, True, n), carry)
                carry = jax.lax.fori_loop(0, clear, functools.partial(sub_block, False), carry)
                return jax.lax.fori_loop(clear, num_sub, functools.partial(sub_block, True), carry)

            for_blocks(compute_block)

        body(i)

        @pl.when(last_iter)
        def _():
            state[SLOT] = jax.lax.rem(base + num_chunks, 2)
            state[ROW] = jnp.where(has_next, 1 - row, row)
            state[PF_TILE] = jnp.where(has_next, nxt_tile, -1)
            state[PF_SEQ] = nxt

        def finalize_block(size, j, carry):
            _, rs, r, _, mine = block_rows(size, j)
            major = is_major(size)
            if major:
                r = block_lanes(size, j)[0]
            for h in range(hkv):
                sink = None
                if has_sinks:  # q head h*G + (r mod G)
                    sink = jnp.full(r.shape, sinks_ref[h * group], jnp.float32)
                    for g in range(1, group):
                        sink = jnp.where(jax.lax.rem(r, group) == g, sinks_ref[h * group + g], sink)
                if major:
                    out, _ = am.finalize_keys_major(mt_ref[h, :, rs], acct_ref[h, :, rs], d, sink)
                    out = out.T
                else:
                    out, _ = am.finalize(m_ref[h, rs, :], l_ref[h, rs, :], acc_ref[h, rs, :], sink)
                if quantized:  # every value of head h carries v_scale[h]: scale the finished row once
                    out = out * scales_ref[hkv + h]
                o_ref[h, rs, :] = jnp.where(mine, out.astype(o_ref.dtype), o_ref[h, rs, :])
            return carry

        for_blocks(finalize_block, last_iter)
        return jnp.where(last_iter, s + 1, s), jnp.where(last_iter, 0, i + 1)

    # A tile's items (sequences seq_lo..seq_hi-1 have rows in it) are one loop in its grid step, an iteration
    # per chunk: an item's start and end run in its first and last iteration, beside the chunks in flight
    # (RPA v3's shape). A loop of items each looping over its chunks ran them between two DMA loops, where the
    # next item's chunk was in flight too, but cost model v2 charges code outside a DMA loop in series. Layer us
    # v5e / v6e / TPU7x, items loop -> one loop: Qwen3 decode B=64 x 8k page 256 1324.8 / 666.0 / 305.2 ->
    # 1314.8 / 658.3 / 299.4, B=64 page 16 441.7 / 229.8 / 176.5 -> 431.6 / 225.4 / 176.9; items of several
    # chunks run the item's code (about 156 bundles on TPU7x) every chunk, which compute-bound TPU7x pays:
    # B=64 x 32k page 16 (four chunks an item) 5252.8 / 2636.2 / 1314.3 -> 5243.0 / 2628.5 / 1328.3.
    jax.lax.while_loop(lambda carry: carry[0] < seq_hi, step, (seq_lo, jnp.int32(0)))

    if write:
        @pl.when(tile == num_tiles - 1)
        def _():
            wait_writes(0)
            wait_writes(1)


def _word_tokens(hkv: int, itemsize: int) -> int:
    """Fewest tokens whose dense rows (token, head) make whole 32-bit words (4 // itemsize rows a word): a
    DMA of rows starts and ends on a word (Mosaic; ``cache_copies``)."""
    pack = 4 // itemsize
    return pack // math.gcd(hkv, pack)


def _word_runs(hkv: int, itemsize: int) -> int:
    """Strided loads per KV head: when Hkv is a multiple of the rows a 32-bit word holds, every token's head h
    sits at the same place in its word and one load takes them all, else tokens t = b (mod runs) share a
    place and each residue b is one load: the period is ``_word_tokens`` (one head: one run, a dense load)."""
    return 1 if hkv == 1 else _word_tokens(hkv, itemsize)


def _head_rows(buf, slot, h, hkv, start, n, e4m3_b11: bool = False):
    """KV head h of tokens [start, start + n) of the chunk in ``slot``, [n, D] in buf's dtype (``e4m3_b11``:
    an e4m3fn cache's bytes as e4m3b11fnuz, -0 cleared; see ``_values``), from dense rows (token, head).

    Pages [page, Hkv, D] land as page * Hkv dense rows (no head padded to a sublane tile); head h is
    rows h, h + Hkv, ..., read as 32-bit words by strided sublane loads (Mosaic takes those on 32-bit
    data only) and unpacked by a shift. With several runs (``_word_runs``; ``start`` and ``n`` are
    multiples of their number) the tokens come back grouped by t mod runs, the order ``_token_order``
    gives, which the masks follow: attention does not depend on the order of its keys.
    """
    if hkv == 1:
        return buf[slot, pl.ds(start, n)]
    pack = 4 // buf.dtype.itemsize
    if pack == 1:  # 32-bit rows: load them as they are
        return buf[slot, pl.ds(start * hkv + h, n, stride=hkv), :]
    runs = _word_runs(hkv, buf.dtype.itemsize)
    # the sub-block's words: an aligned window (start * hkv is a multiple of pack and of the sublane tile)
    words = buf.bitcast(jnp.uint32).at[slot, pl.ds(pl.multiple_of(_div(start * hkv, pack), 8), n * hkv // pack)]
    parts = []
    for b in range(runs):
        first = b * hkv + h  # dense row of head h of token b
        w = words[pl.ds(first // pack, n // runs, stride=runs * hkv // pack), :]
        bits = 32 // pack
        w = w >> (bits * (first % pack))
        dtype = buf.dtype
        if e4m3_b11:  # read as e4m3b11fnuz (``_values``), -0 cleared: 0x80 is its NaN
            w, dtype = jnp.where((w & np.uint32(0xFF)) == 0x80, np.uint32(0), w), jnp.float8_e4m3b11fnuz
        parts.append(pltpu.bitcast(w.astype(jnp.dtype(f"uint{bits}")), dtype))
    return parts[0] if runs == 1 else jnp.concatenate(parts, axis=0)


def _values(x, dtype):
    """Cached K/V rows (``_head_rows``) as values in ``dtype``, exactly. fp8 rows come as e4m3b11fnuz on
    v5e and v6e (``reads_e4m3_as_b11``: their only fp8 of 4 exponent bits; TPU7x converts e4m3fn natively,
    and e4m3b11fnuz compiled there took 4.4x as long in the model): it reads an e4m3fn byte as its
    value / 16, except -0 (its NaN: ``_head_rows`` clears it) and e4m3fn's NaN codes (+-30 there, so +-480
    here: ``write_kv`` saturates finite rows at +-448, so only a NaN row gives them). Mosaic's own e4m3fn
    conversion takes 4 compares and 4 selects per bf16 vreg on v6e; this one multiply (exact, a power of
    two)."""
    if x.dtype == jnp.float8_e4m3b11fnuz:
        return x.astype(dtype) * jnp.asarray(16, dtype)
    return x.astype(dtype)


def _token_order(hkv, itemsize, n, shape, axis):
    """Token (from the start of the rows) of each row ``_head_rows`` returns, as an int32 iota of ``shape``."""
    r = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
    runs = _word_runs(hkv, itemsize)
    if runs == 1:
        return r
    per_run = n // runs
    return jax.lax.rem(r, per_run) * runs + _div(r, per_run)


def _keys_major(size: int, chip: str | None) -> bool:
    """Whether row blocks of ``size`` rows are computed keys-major (``am.online_softmax_step_keys_major``):
    keys on sublanes, the block's rows on lanes, so the softmax reductions run over sublanes and the MXU
    sums the denominator. Blocks of whole lane tiles (prefill chunks) on KEYS_MAJOR_CHIPS; sublane-tile
    blocks (decode items) keep rows on sublanes."""
    return size % LANES == 0 and chip in KEYS_MAJOR_CHIPS


def _block_sizes(rows, dtype) -> tuple[int, ...]:
    """Rows computed per step inside a tile, smallest first: one sublane tile (for decode items) and
    256 (or 128, ...) when the tile splits evenly, else the whole tile. 256 against 128 rows: prefill
    chunks of a mixed batch 459 -> 438 us on v6e (fewer, fuller MXU passes per K/V sub-block)."""
    sub = _sublanes(dtype)
    large = next((n for n in (256, 128, 64, 32, 16, 8) if n % sub == 0 and rows % n == 0), rows)
    return (sub, large) if large > sub and rows % sub == 0 else (large,)


def vmem_estimate(rows, hkv, d, page, pages_per_block, dtype, keys_major=False) -> int:
    """VMEM bytes of the blocks and scratch, with the (sublane, 128) tile padding the TPU applies."""
    item = jnp.dtype(dtype).itemsize
    sub = _sublanes(dtype)
    pad = _round_up
    lanes = pad(d, 128)
    kv = 2 * 2 * pad(pages_per_block * page * hkv, sub) * lanes * item  # K and V, two slots, dense rows
    qo = 2 * 2 * hkv * pad(rows, sub) * lanes * item  # q and o blocks, double-buffered
    stats = 2 * hkv * pad(rows, 8) * 128 * 4 + hkv * pad(rows, 8) * lanes * 4
    if keys_major:  # m [1, rows] and acc [D + ONES_ROWS, rows] per head
        stats += hkv * (8 + lanes + am.ONES_ROWS) * pad(rows, 128) * 4
    return kv + qo + stats


def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    sinks: jax.Array | None = None,
    scale: float = 0.0,
    window: int = 0,
    softcap: float = 0.0,
    block_q: int = 0,
    block_kv: int = 8192,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> jax.Array:
    """Attention of packed ragged queries over a paged KV cache; returns [T, Hq, D] in q's dtype.

    ``scale`` 0 = head_dim**-0.5 (the default), ``window`` 0 = none (else transformers' sliding
    window: key > query - window), ``softcap`` 0 = none, ``sinks`` [Hq] GPT-OSS sink logits,
    ``block_q`` query tokens per tile (0 = TILE_ROWS = 2048 rows, fewer when the batch has fewer tokens),
    ``block_kv`` tokens fetched per DMA chunk (rounded to whole pages; at most 512 pages, fewer when
    the chunk would not fit VMEM). Zero sizes: no query rows -> [0, Hq, D]; no sequences, an empty
    page table or an empty cache -> zeros (no row has a key to attend).

    A quantized cache (``k_pages``/``v_pages`` float8_e4m3fn or int8, written by ``write_kv``) needs
    ``k_scale`` and ``v_scale``, float32 [Hkv]: the cache stands for k_pages * k_scale[h] (per KV head).
    A head dim below 128 may come lane-packed (``kv_heads``), which XLA:TPU does not copy around the call.
    """
    validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks, scale, window, softcap, block_q, block_kv,
             k_scale, v_scale)
    if q.size == 0 or k_pages.size == 0 or page_indices.size == 0:
        return jnp.zeros(q.shape, q.dtype)
    return _attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks, scale, window, softcap, block_q,
                      block_kv, k_scale, v_scale)


def write_and_attend(
    q: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    sinks: jax.Array | None = None,
    scale: float = 0.0,
    window: int = 0,
    softcap: float = 0.0,
    block_q: int = 0,
    block_kv: int = 8192,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``write_kv`` then ``ragged_paged_attention`` in one kernel: (out [T, Hq, D], k_pages', v_pages').

    The kernel reads each chunk's cached tokens from the pages and the sequence's new ones from
    new_k/new_v, and copies the new rows from VMEM to their pages while it computes (the caches are
    aliased outputs: in place under jit with donated caches). Same arguments and rules as the two
    (new_k/new_v [T, Hkv, D] like q's rows; a quantized cache gets them quantized). More than
    FUSED_WRITE_MAX_SEQS sequences (on a chip of FUSED_WRITE_ANY_BATCH_PAGE, any number with a cache of q's dtype in
    pages of at least its entry's tokens), or
    a cache whose token rows split a packed 32-bit word (``fuses_write``: one KV head of bf16, fewer than four
    of a 1-byte dtype), take the two calls."""
    validate_write_and_attend(q, new_k, new_v, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks, scale, window,
                              softcap, block_q, block_kv, k_scale, v_scale)
    any_batch = k_scale is None and k_pages.shape[1] >= FUSED_WRITE_ANY_BATCH_PAGE.get(current_chip(), 1 << 31)
    if not fuses_write(k_pages) or (page_indices.shape[0] > FUSED_WRITE_MAX_SEQS and not any_batch):
        k_pages, v_pages = write_kv(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, k_scale, v_scale)
        return ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks, scale, window,
                                      softcap, block_q, block_kv, k_scale, v_scale), k_pages, v_pages
    if q.size == 0 or k_pages.size == 0 or page_indices.size == 0:
        return jnp.zeros(q.shape, q.dtype), k_pages, v_pages
    if k_scale is not None:
        new_k, new_v = quantize(new_k, k_scale, k_pages.dtype), quantize(new_v, v_scale, v_pages.dtype)
    return _attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks, scale, window, softcap, block_q,
                      block_kv, k_scale, v_scale, new_kv=(new_k, new_v))


def validate_write_and_attend(q, new_k, new_v, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=None, scale=0.0,
                              window=0, softcap=0.0, block_q=0, block_kv=8192, k_scale=None, v_scale=None):
    """``validate`` and ``validate_write``, and one new K/V row per query row."""
    validate(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks, scale, window, softcap, block_q, block_kv,
             k_scale, v_scale)
    validate_write(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, k_scale, v_scale)
    if new_k.shape[0] != q.shape[0]:
        raise ValueError(f"new_k/new_v must have one row per query row ({q.shape[0]}), got {new_k.shape[0]}")


def fuses_write(k_pages) -> bool:
    """Whether ``write_and_attend`` runs as one kernel for this cache: its token rows ([Hkv, D] per token) must
    be whole 32-bit words of rows, so that DMAs of single tokens stay on packed-row boundaries (Mosaic)."""
    return k_pages.shape[2] * jnp.dtype(k_pages.dtype).itemsize % 4 == 0


def _attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks, scale, window, softcap, block_q, block_kv,
               k_scale, v_scale, new_kv=None):
    """The attention call (validated, non-empty); with ``new_kv`` the fused write: (out, k_pages, v_pages)."""
    t, hq, d = q.shape
    # The kernel sees a cache row as one head of ``width`` lanes; a lane-packed row holds ``pack`` KV heads
    # (``kv_heads``), so its q heads are pack * G (the same q-head order).
    num_pages, page, hkv, width = k_pages.shape
    pack = width // d
    num_seqs, pps = page_indices.shape
    group = hq // hkv
    bq = block_q or _default_block_q(group, q.dtype, t)
    if (bq * group) % _sublanes(q.dtype):
        raise ValueError(f"block_q * (q heads per KV cache row) = {bq * group} must be a multiple of "
                         f"{_sublanes(q.dtype)} (TPU sublane tile)")
    rows = bq * group
    pages_per_block = max(1, min(block_kv // page, MAX_PAGES_PER_CHUNK, pps))
    block_sizes = _block_sizes(rows, q.dtype)
    keys_major = _keys_major(block_sizes[-1], current_chip())
    while pages_per_block > 1 and vmem_estimate(rows, hkv, width, page, pages_per_block, k_pages.dtype,
                                                keys_major) > KV_VMEM_BUDGET:
        pages_per_block //= 2
    num_tiles = max(1, pl.cdiv(t, bq))
    # Each item copies its page-table row into SMEM (padded to 128 entries unless ``SMEM_DMA_ANY_LENGTH_CHIPS``;
    # the kernel reads the first pps).
    pps_pad = pps if current_chip() in SMEM_DMA_ANY_LENGTH_CHIPS else _round_up(pps, 128)
    table = jnp.pad(page_indices.astype(jnp.int32), ((0, 0), (0, pps_pad - pps)))
    t_pad = num_tiles * bq

    cu = sanitize_cu(cu_q_lens, t)
    # [T, Hq, D] -> [Hkv, T*G, D]: row (token, g) of head h is q[token, h*G + g].
    qg = jnp.pad(q, ((0, t_pad - t), (0, 0), (0, 0))).reshape(t_pad, hkv, group, d)
    if pack > 1:  # q head (row, e, g) in the lanes of the row's e-th KV head, zeros elsewhere: q . row = q . k_e
        qg = qg.reshape(t_pad, hkv, pack, group // pack, d)
        qg = jnp.concatenate([jnp.pad(qg[:, :, e:e + 1], ((0, 0),) * 4 + ((e * d, width - (e + 1) * d),))
                              for e in range(pack)], axis=2).reshape(t_pad, hkv, group, width)
    qg = qg.transpose(1, 0, 2, 3).reshape(hkv, t_pad * group, width)
    # Sinks and scales are operands only when given: a stand-in array of zeros or ones would be an XLA
    # broadcast op run before the kernel (0.35 us each in the cost model).
    quantized = k_scale is not None
    smem_operands = ([sinks.astype(jnp.float32)] if sinks is not None else []) + (
        [jnp.concatenate([k_scale, v_scale]).astype(jnp.float32)] if quantized else [])

    write = new_kv is not None
    new_rows = [x.reshape(t * hkv, width) for x in new_kv] if write else []  # lane-packed: a row per head group
    major_state = [pltpu.VMEM((hkv, 1, rows), jnp.float32), pltpu.VMEM((hkv, width + am.ONES_ROWS, rows), jnp.float32)]
    kernel = functools.partial(
        _kernel, pps=pps, scale=am.resolve_scale(scale, d), window=int(window), softcap=float(softcap), block_q=bq, group=group,
        pages_per_block=pages_per_block, block_sizes=block_sizes, has_sinks=sinks is not None,
        quantized=quantized, e4m3_b11=quantized and k_pages.dtype == jnp.float8_e4m3fn and reads_e4m3_as_b11(),
        lag=PIPELINE_LAG.get(current_chip(), PIPELINE_LAG[None]), keys_major=keys_major,
        exp_dtype=am.exp_dtype(q.dtype, current_chip()), write=write,
        partial_pages=not quantized and current_chip() in PARTIAL_PAGE_CHIPS)

    block = pl.BlockSpec((hkv, rows, width), lambda i, *_: (0, i, 0))
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    vmem = vmem_estimate(rows, hkv, width, page, pages_per_block, k_pages.dtype, keys_major)
    kv_shape = (num_pages, page * hkv, width)  # the kernel's view of a cache: a page is page * Hkv dense rows
    caches = (jax.ShapeDtypeStruct(kv_shape, k_pages.dtype),) * 2 if write else ()
    out, *caches = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((hkv, t_pad * group, width), q.dtype), *caches),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(num_tiles,),
            in_specs=[block] + [any_spec] * (3 + 2 * write) + [pl.BlockSpec(memory_space=pltpu.SMEM)] * len(smem_operands),
            out_specs=(block,) + (any_spec,) * len(caches),
            scratch_shapes=[
                pltpu.SMEM((2 * (pps_pad + _round_up(pages_per_block, 128)),), jnp.int32),  # this item's, the next's
                pltpu.SMEM((6,), jnp.int32),  # state carried between items (ROW, SLOT, PF_TILE, PF_SEQ, PENDING x 2)
                pltpu.VMEM((2, pages_per_block * page * hkv, width), k_pages.dtype),
                pltpu.VMEM((2, pages_per_block * page * hkv, width), v_pages.dtype),
                pltpu.SemaphoreType.DMA((2, 2)),
                pltpu.SemaphoreType.DMA((2,)),
                pltpu.VMEM((hkv, rows, 1), jnp.float32),
                pltpu.VMEM((hkv, rows, 1), jnp.float32),
                pltpu.VMEM((hkv, rows, width), jnp.float32),
                *(major_state if keys_major else []),
                *([pltpu.SemaphoreType.DMA((2, 2))] if write else []),  # cache writes: [K/V, slot]
            ],
        ),
        input_output_aliases={4: 1, 5: 2} if write else {},  # operands: kv_lens, cu, q, table, k_pages, v_pages, ...
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("arbitrary",),
            vmem_limit_bytes=int(min(max(32 * MiB, 1.5 * vmem), 60 * MiB)),
            # Every index the kernel computes is clamped (module docstring; the strict interpreter test
            # runs bad metadata): the compiler's own per-DMA checks would cost ~16 scalar bundles a page.
            disable_bounds_checks=True,
        ),
        name="ragged_paged_attention",
    )(kv_lens.astype(jnp.int32), cu, qg, table, *(in_hbm(x.reshape(kv_shape)) for x in (k_pages, v_pages)),
      *(in_hbm(x) for x in new_rows), *smem_operands)
    out = out.reshape(hkv, t_pad, group, width)
    if pack > 1:  # p . row = [p . v_0 | p . v_1 | ...]: each q head keeps its own KV head's lanes
        out = out.reshape(hkv, t_pad, pack, group // pack, width)
        out = jnp.concatenate([out[:, :, e:e + 1, :, e * d:(e + 1) * d] for e in range(pack)], axis=2)
    out = out.reshape(hkv, t_pad, group, d).transpose(1, 0, 2, 3).reshape(t_pad, hq, d)[:t]
    return (out, *(x.reshape(k_pages.shape) for x in caches)) if write else out


# --------------------------------------------------------------------------- reference

def reference(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=None, scale=0.0, window=0, softcap=0.0,
              k_scale=None, v_scale=None):
    """Per-sequence loop on the host: gather each sequence's pages, dense _attention_math.reference_attention.
    Independent of the kernel's tiling, DMA and work-item logic. A quantized cache is dequantized on the
    host first (numpy, values x scale per KV head). Returns f32 [T, Hq, D]."""
    t, hq, d = q.shape
    page = k_pages.shape[1]
    k_pages, v_pages = (np.asarray(x).reshape(*x.shape[:2], kv_heads(x, d, "q")[0], d) for x in (k_pages, v_pages))
    if k_scale is not None:
        k_pages = np.asarray(k_pages).astype(np.float32) * np.asarray(k_scale, np.float32)[:, None]
        v_pages = np.asarray(v_pages).astype(np.float32) * np.asarray(v_scale, np.float32)[:, None]
    cu, lens, table = np.asarray(cu_q_lens), np.asarray(kv_lens), np.asarray(page_indices)
    out = np.zeros((t, hq, d), np.float32)
    for s in range(len(lens)):
        lq, lk = int(cu[s + 1] - cu[s]), int(lens[s])
        if lq == 0:
            continue
        pages = table[s, : -(-lk // page)]
        k = k_pages[pages].reshape(-1, *k_pages.shape[2:])[:lk]  # [lk, Hkv, D]
        v = v_pages[pages].reshape(-1, *v_pages.shape[2:])[:lk]
        qs = q[cu[s]: cu[s + 1]]
        o = am.reference_attention(
            jnp.swapaxes(qs, 0, 1)[None], jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None],
            scale=am.resolve_scale(scale, d), causal=True, window=window or None, softcap=softcap or None, sinks=sinks)
        out[cu[s]: cu[s + 1]] = np.asarray(jnp.swapaxes(o[0], 0, 1))
    return out


# --------------------------------------------------------------------------- writing new K/V into pages

def validate_write(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, k_scale=None, v_scale=None):
    check_array("new_k", new_k, dtypes=KV_DTYPES, ndim=3)
    check_array("new_v", new_v, dtypes=KV_DTYPES, ndim=3)
    check_array("k_pages", k_pages, dtypes=CACHE_DTYPES, ndim=4)
    d = new_k.shape[2]
    hkv, _ = kv_heads(k_pages, d, "new_k")
    if tuple(new_k.shape[1:]) != (hkv, d) or tuple(new_v.shape) != tuple(new_k.shape):
        raise ValueError(f"new_k and new_v must have shape [T, {hkv}, {d}] (the cache's heads and head_dim), "
                         f"got {tuple(new_k.shape)} and {tuple(new_v.shape)}")
    if dtype_name(new_k) != dtype_name(new_v):
        raise TypeError(f"new_k and new_v must share a dtype, got {dtype_name(new_k)} and {dtype_name(new_v)}")
    if dtype_name(k_pages) not in QUANTIZED_DTYPES and dtype_name(new_k) != dtype_name(k_pages):
        raise TypeError(f"new_k/new_v must have the cache dtype {dtype_name(k_pages)}, "
                        f"got {dtype_name(new_k)}/{dtype_name(new_v)}")
    # Same metadata rules as attention (new_k stands in for q: the new tokens' rows).
    validate(new_k, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, k_scale=k_scale, v_scale=v_scale,
             rows="new_k")
    _check_distinct_slots(host_values(kv_lens), host_values(page_indices), host_values(cu_q_lens), new_k.shape[0],
                          *k_pages.shape[:2])


def _check_distinct_slots(kv_lens, page_indices, cu_q_lens, t, num_pages, page):
    """Refuse two new tokens written to the same cache slot (page, row): the DMAs would race and
    the last writer win silently. Host values only (None: on device, unchecked, no host sync)."""
    if kv_lens is None or page_indices is None or cu_q_lens is None or t == 0 or page_indices.size == 0:
        return
    with jax.ensure_compile_time_eval(), jax.default_device(jax.devices("cpu")[0]):  # eager, on the host
        pid, off, _ = (np.asarray(a) for a in write_slots(jnp.asarray(kv_lens, jnp.int32),
                                                          jnp.asarray(page_indices, jnp.int32),
                                                          jnp.asarray(cu_q_lens, jnp.int32), t, num_pages, page))
    rows = np.flatnonzero(pid >= 0)
    slots = pid[rows].astype(np.int64) * page + off[rows]
    _, first, counts = np.unique(slots, return_index=True, return_counts=True)
    if (counts > 1).any():
        slot = slots[first[np.argmax(counts > 1)]]
        r1, r2 = rows[slots == slot][:2]
        seq = np.searchsorted(np.asarray(cu_q_lens), [r1, r2], side="right") - 1
        raise ValueError(f"new tokens {r1} (sequence {seq[0]}) and {r2} (sequence {seq[1]}) are both written to "
                         f"page {slot // page}, row {slot % page}: page_indices must give every new token its own "
                         f"cache slot (otherwise the last write silently wins)")


def write_slots(kv_lens, page_indices, cu_q_lens, t, num_pages, page, rows=None, max_run=None):
    """(page id, row in page, run) for each packed new token (``rows`` >= t entries, default t); page id
    -1 = do not write (padding rows, or a target outside the cache: a bad write is skipped rather than
    clamped onto another page). A written token's run is how many tokens from it on, itself included
    and at most ``max_run`` (default: a page), go to consecutive rows of the same page (same
    sequence): one copy can write them all. A token not written has run 1, a row past the last new
    token 0."""
    num_seqs, pps = page_indices.shape
    rows = t if rows is None else rows
    if num_seqs == 0 or pps == 0:  # no sequence, or no pages: nothing to write
        return jnp.full((rows,), -1, jnp.int32), jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.int32)
    cu = sanitize_cu(cu_q_lens, t)
    r = jnp.arange(rows, dtype=jnp.int32)
    if rows * num_seqs <= ONE_HOT_LIMIT:
        # Row r is sequence s's when cu[s] <= r < cu[s + 1] (rows past cu[-1]: none, and not written). The
        # [rows, seqs] one-hot sums are one fused op where a search and per-value gathers are several
        # (XLA:TPU gathers go element by element: 2307 bundles for 80 rows on v5e).
        member = (cu[None, :-1] <= r[:, None]) & (r[:, None] < cu[None, 1:])

        def pick(values):
            return jnp.sum(jnp.where(member, values[None, :], 0), axis=1)

        seq, start, end, length = (pick(v) for v in (jnp.arange(num_seqs, dtype=jnp.int32), cu[:-1], cu[1:], kv_lens))
    else:
        member = None
        seq = jnp.clip(_searchsorted_right(cu, r) - 1, 0, num_seqs - 1)
        start, end, length = cu[seq], cu[seq + 1], kv_lens[seq]
    pos = length - (end - start) + r - start
    col = _udiv(pos, page)  # a negative pos (refused below either way) reads as a large one
    col_in = jnp.clip(col, 0, pps - 1)
    if member is not None and rows * pps <= ONE_HOT_LIMIT and num_pages < 1 << 24:
        # Each row's table row as member @ table on the MXU, then its column picked by a one-hot: two small
        # fused ops where XLA:TPU's [S, pps] gather goes element by element (Qwen3 mixed 60 decode + 4 x 128
        # prefill on TPU7x: 14954 bundles for 576 rows). Exact: a row has one sequence (a single 1.0 term)
        # and the ids, clamped to [-1, num_pages] first (out of range stays out of range), are f32 integers.
        table = jnp.clip(page_indices, -1, num_pages).astype(jnp.float32)
        rows_table = jnp.dot(member.astype(jnp.float32), table, precision=jax.lax.Precision.HIGHEST)
        hit = jnp.arange(pps, dtype=jnp.int32)[None, :] == col_in[:, None]
        pid = jnp.sum(jnp.where(hit, rows_table, 0), axis=1).astype(jnp.int32)
    else:
        pid = page_indices[seq, col_in]
    off = pos - col * page
    ok = (r < cu[-1]) & (pos >= 0) & (col < pps) & (pid >= 0) & (pid < num_pages)
    run = jnp.minimum(jnp.minimum(end - r, page - off), max_run or page)
    run = jnp.where(ok, run, (r < cu[-1]).astype(jnp.int32))
    return jnp.where(ok, pid, -1).astype(jnp.int32), off, run


def _write_kernel(pid_ref, off_ref, run_ref, new_k, new_v, k_in, v_in, k_out, v_out, sems, *, runs_per_step,
                  max_run):
    """Walks the new rows run by run (``write_slots``; at least one row past the new tokens, run 0, ends
    the walk): a run of n rows is one DMA per power of two in n, HBM to HBM (K and V each)."""
    del k_in, v_in  # aliased: k_out/v_out are the same buffers
    t = new_k.shape[0]
    pairs = ((new_k, k_out, sems.at[0]), (new_v, v_out, sems.at[1]))

    def start(r, p, o, n):  # new rows r .. r + n - 1 -> rows o .. o + n - 1 of page p
        def piece(at, b):
            for src, dst, sem in pairs:
                pltpu.make_async_copy(src.at[pl.ds(r + at, b)], dst.at[p, pl.ds(o + at, b)], sem).start()
        _start_pieces(n, max_run, piece)

    def wait_rows(b):
        for src, _, sem in pairs:
            pltpu.make_async_copy(src.at[pl.ds(0, b)], src.at[pl.ds(0, b)], sem).wait()

    def wait(rows):  # ``_wait_units``, a unit a row
        _wait_units(rows, min(t, runs_per_step * max_run), wait_rows)

    # An iteration starts the copies of runs_per_step runs (unrolled), then waits for the previous
    # iteration's, so at most two iterations' copies are in flight.
    def body(carry):
        r, in_flight = carry
        started = jnp.int32(0)
        for _ in range(runs_per_step):
            n, p = run_ref[r], pid_ref[r]
            write = (n > 0) & (p >= 0)

            @pl.when(write)
            def _(r=r, p=p, o=off_ref[r], n=n):
                start(r, p, o, n)

            started += jnp.where(write, n, 0)
            r += n  # stays on the first row past the new tokens
        wait(in_flight)
        return r, started

    _, in_flight = jax.lax.while_loop(lambda c: run_ref[c[0]] > 0, body, (jnp.int32(0), jnp.int32(0)))
    wait(in_flight)


def write_kv(
    k_pages: jax.Array,
    v_pages: jax.Array,
    new_k: jax.Array,
    new_v: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    k_scale: jax.Array | None = None,
    v_scale: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The caches with each sequence's new tokens [T, Hkv, D] written at positions
    kv_lens - q_len ... kv_lens - 1 of its pages. Outputs alias the cache inputs
    (input_output_aliases): under jit with donated caches this is an in-place update, HBM to HBM,
    each run of tokens bound for consecutive rows of one page copied whole (``_write_kernel``). Two
    new tokens may not share a cache slot (refused when the metadata is on the host). No new tokens
    or no sequences: the caches unchanged.
    A quantized cache (float8_e4m3fn or int8) takes bf16/f32 new rows and ``k_scale``/``v_scale``
    [Hkv] float32; the rows are quantized first (``quantize``: x / scale, nearest, saturated)."""
    validate_write(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens, k_scale, v_scale)
    if new_k.shape[0] == 0 or page_indices.size == 0 or k_pages.size == 0:
        return k_pages, v_pages
    if k_scale is not None:  # [T, Hkv, D], a small elementwise op before the DMAs move 1-byte rows
        new_k, new_v = quantize(new_k, k_scale, k_pages.dtype), quantize(new_v, v_scale, v_pages.dtype)
    t = new_k.shape[0]
    new_k, new_v = (x.reshape(t, *k_pages.shape[2:]) for x in (new_k, new_v))  # lane-packed: a row per head group
    num_pages, page = k_pages.shape[:2]
    # Runs of several rows when some sequence may have several new rows; else rows one by one, so a
    # decode batch's loop body is two DMAs a row, not the code for longer runs.
    max_run = min(WRITE_MAX_RUN, t, page) if t > page_indices.shape[0] else 1
    # rows: at least one past the new tokens (the walk's end: run 0)
    slots = write_slots(kv_lens.astype(jnp.int32), page_indices.astype(jnp.int32), cu_q_lens.astype(jnp.int32), t,
                        num_pages, page, rows=_round_up(t + 1, WRITE_METADATA_MULTIPLE), max_run=max_run)
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    return pl.pallas_call(
        functools.partial(_write_kernel, runs_per_step=WRITE_RUNS_PER_STEP, max_run=max_run),
        out_shape=(jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype), jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype)),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3, grid=(1,), in_specs=[any_spec] * 4, out_specs=(any_spec, any_spec),
            scratch_shapes=[pltpu.SemaphoreType.DMA((2,))]),
        input_output_aliases={5: 0, 6: 1},  # operands: pid, off, run, new_k, new_v, k_pages, v_pages
        # Every copy is in bounds by construction (write_slots: new rows only, pages in range, off + run <= page;
        # the strict interpreter test runs bad metadata): the compiler's checks would cost scalar bundles per DMA.
        compiler_params=pltpu.CompilerParams(disable_bounds_checks=True),
        name="write_kv",
    )(*slots, new_k, new_v, k_pages, v_pages)


def reference_write(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens):
    """Host loop: numpy copies of the caches with the new tokens written (new_k/new_v already in the
    cache dtype: quantize them first for a quantized cache)."""
    k, v = np.array(k_pages), np.array(v_pages)
    page = k.shape[1]
    cu, lens, table = np.asarray(cu_q_lens), np.asarray(kv_lens), np.asarray(page_indices)
    for s in range(len(lens)):
        for i, r in enumerate(range(cu[s], cu[s + 1])):
            pos = lens[s] - (cu[s + 1] - cu[s]) + i
            k[table[s, pos // page], pos % page] = np.asarray(new_k[r]).reshape(k.shape[2:])  # lane-packed too
            v[table[s, pos // page], pos % page] = np.asarray(new_v[r]).reshape(v.shape[2:])
    return k, v
