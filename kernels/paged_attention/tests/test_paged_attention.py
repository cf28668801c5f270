"""Ragged paged attention and the KV write kernel against independent references, in both interpret
modes, plus bad-input errors and ahead-of-time TPU compilation.

References: ``pallas.reference`` gathers each sequence's pages on the host and runs the shared dense
``attention_math.reference_attention`` per sequence (no tiling, DMA or work items); ``reference_write``
is a host loop. Tolerances: f32 1e-5 (online softmax vs one softmax: observed <= 2e-6); bf16 2.5e-2
(P is rounded to bf16 before P @ V, as on the MXU; observed <= 8e-3 on unit-normal data).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallas_hub.verify import compile_for_tpu, interpret
from pallas_hub.verify.introspect import pallas_calls

STATIC = ("scale", "window", "softcap", "block_q", "block_kv")
TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2.5e-2}


def make_case(q_lens, kv_lens, *, page=16, hq=4, hkv=2, d=128, dtype=jnp.float32, sinks=False, seed=0,
              extra_rows=3, spare_pages=5, shuffle=True):
    """Inputs for one call: a page pool with spare (never referenced) pages, each sequence's pages
    drawn from a shuffled (fragmented) permutation, table rows padded with -1 past what is needed."""
    rng = np.random.default_rng(seed)
    s = len(q_lens)
    need = [-(-l // page) for l in kv_lens]
    pps = max(max(need, default=1), 1) + 1
    num_pages = sum(need) + spare_pages
    pool = rng.permutation(num_pages) if shuffle else np.arange(num_pages)
    table = np.full((s, pps), -1, np.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = pool[at: at + n]
        at += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1]) + extra_rows
    q = jnp.asarray(rng.standard_normal((t, hq, d)), dtype)
    kp = jnp.asarray(rng.standard_normal((num_pages, page, hkv, d)), dtype)
    vp = jnp.asarray(rng.standard_normal((num_pages, page, hkv, d)), dtype)
    sk = jnp.asarray(rng.standard_normal(hq) * 2, jnp.float32) if sinks else None
    return q, kp, vp, jnp.asarray(kv_lens, jnp.int32), jnp.asarray(table), jnp.asarray(cu), sk


def check(k, args, *, mode="fast", **static):
    static.setdefault("scale", args[0].shape[-1] ** -0.5)
    with interpret(mode):
        out = jax.jit(k.pallas.ragged_paged_attention, static_argnames=STATIC)(*args, **static)
    out = np.asarray(out.astype(jnp.float32))
    ref = k.pallas.reference(*args, **{n: v for n, v in static.items()
                                       if n in ("scale", "window", "softcap", "k_scale", "v_scale")})
    assert np.isfinite(out).all()
    t_real = int(args[5][-1])
    assert np.all(out[t_real:] == 0), "padding rows must be 0"
    tol = TOL[jnp.dtype(args[0].dtype).type]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
    return out


CASES = {
    # name: (q_lens, kv_lens, make_case kwargs, kernel static kwargs)
    "decode": ([1] * 9, [1, 17, 40, 16, 33, 5, 64, 2, 30], dict(), dict(block_q=4)),  # 2-3 sequences a tile
    "prefill": ([37, 5, 20], [37, 5, 20], dict(page=64), dict(block_q=8)),
    "mixed_window_softcap_sinks": ([30, 1, 0, 7, 1], [100, 33, 0, 7, 250], dict(sinks=True),
                                   dict(window=24, softcap=20.0, block_kv=32)),  # default tiles
    "bf16_gqa4_page128": ([3, 1, 60, 1], [3, 300, 90, 129], dict(page=128, hq=8, hkv=2, dtype=jnp.bfloat16),
                          dict(block_kv=128, block_q=64)),  # 256-row tiles: two row blocks
    "bf16_mixed_window_sinks": ([1, 12, 1], [70, 40, 1], dict(dtype=jnp.bfloat16, hq=2, hkv=2, sinks=True),
                                dict(window=8, block_q=16)),
    "mha_d64_chunked_prefill": ([16, 16], [48, 80], dict(hq=2, hkv=2, d=64, shuffle=False), dict(block_q=8)),
}


@pytest.mark.parametrize("name", CASES)
def test_matches_dense_reference(load_kernel, name):
    q_lens, kv_lens, make, static = CASES[name]
    check(load_kernel("paged_attention"), make_case(q_lens, kv_lens, **make), **static)


@pytest.mark.parametrize("hkv", [1, 4])
@pytest.mark.parametrize("lag", [(0, 1), (1, 1), (1, 2), (2, 1)])
def test_every_head_pipeline_gives_the_reference(load_kernel, monkeypatch, lag, hkv):
    """The KV heads' software pipeline (``PIPELINE_LAG``, chosen per chip) only reorders the work: every
    lag, with fewer or more heads than its depth, gives the reference on a mixed bf16 batch (sinks, window)."""
    k = load_kernel("paged_attention")
    monkeypatch.setitem(k.pallas.PIPELINE_LAG, None, lag)
    jax.clear_caches()  # jit caches traces by function, not by the module constants they read
    check(k, make_case([1, 30, 1, 7], [70, 40, 129, 7], dtype=jnp.bfloat16, hq=2 * hkv, hkv=hkv, sinks=True),
          window=24, block_q=16)


LAYOUT_CASES = {  # name: (q_lens, kv_lens, make_case kwargs, kernel static kwargs); tiles of 128 or 256 rows
    "f32_window_softcap_sinks": ([130, 1, 0, 77, 3], [300, 40, 0, 77, 9], dict(sinks=True),
                                 dict(window=50, softcap=20.0, block_q=64, block_kv=64)),
    "bf16_gqa4_page128_sinks": ([3, 1, 90, 1, 40], [3, 300, 90, 129, 700],
                                dict(page=128, hq=8, hkv=2, dtype=jnp.bfloat16, sinks=True), dict(block_q=64)),
}


@pytest.mark.parametrize("layout", ["rows on sublanes", "keys-major", "keys-major bf16 exp"])
@pytest.mark.parametrize("name", LAYOUT_CASES)
def test_prefill_row_blocks_in_either_layout(load_kernel, monkeypatch, name, layout):
    """Prefill row blocks (whole lane tiles) run keys-major on KEYS_MAJOR_CHIPS, with rows on sublanes
    elsewhere (v5e), exp in bf16 on am.BF16_EXP_CHIPS: each gives the reference, with items straddling tiles,
    an empty sequence, a window, soft-capping and sinks."""
    k = load_kernel("paged_attention")
    q_lens, kv_lens, make, static = LAYOUT_CASES[name]
    args = make_case(q_lens, kv_lens, **make)
    group = args[0].shape[1] // args[1].shape[2]
    assert k.pallas._block_sizes(static["block_q"] * group, args[0].dtype)[-1] % 128 == 0  # a whole-lane block
    monkeypatch.setattr(k.pallas, "KEYS_MAJOR_CHIPS", () if layout == "rows on sublanes" else (None,))
    monkeypatch.setattr(k.pallas.am, "BF16_EXP_CHIPS", (None,) if layout.endswith("bf16 exp") else ())
    jax.clear_caches()  # jit caches traces by function, not by the module constants they read
    check(k, args, **static)


def test_tiles_shared_by_many_sequences_and_all_padding_tiles(load_kernel):
    # 8 decode sequences per tile, an empty sequence in the middle, and tiles with no sequence at all.
    k = load_kernel("paged_attention")
    args = make_case([1, 1, 0, 1, 1, 1], [3, 9, 0, 20, 1, 16], extra_rows=21)
    check(k, args, block_q=4)


def test_default_tile_no_larger_than_the_batch(load_kernel):
    # The q and output blocks move whole: a small batch gets a tile its tokens fill (up to the sublane
    # tile), a long one TILE_ROWS (2048) rows; the choice is checked against the kernel in the decode tests.
    pallas = load_kernel("paged_attention").pallas
    block_q = pallas._default_block_q
    bf16, f32 = jnp.bfloat16, jnp.float32
    assert pallas.TILE_ROWS == 2048
    assert block_q(8, bf16, 1) == 2 and block_q(8, f32, 1) == 1  # 16 / 8 rows: one sublane tile
    assert block_q(8, bf16, 64) == 64 and block_q(8, bf16, 256) == 256 and block_q(8, bf16, 5000) == 256
    assert block_q(1, bf16, 3) == 16 and block_q(5, bf16, 7) == 16 and block_q(5, bf16, 1000) == 416
    for group, dtype, t in [(1, f32, 1), (3, bf16, 2), (7, f32, 100), (7, f32, 1000), (16, bf16, 9)]:
        bq, sub, want = block_q(group, dtype, t), (16 if dtype == bf16 else 8), min(t, 2048 // group)
        assert (bq * group) % sub == 0 and want <= bq < want + sub


def test_tile_sequence_search_matches_searchsorted(load_kernel):
    # The kernel finds each tile's sequences by a branch-free binary search in cu_q_lens (scalar code).
    count = load_kernel("paged_attention").pallas._count_prefix
    rng = np.random.default_rng(0)
    for n in (1, 2, 3, 7, 8, 64, 255):
        cu = np.concatenate([[0], np.cumsum(rng.integers(0, 3, n))]).astype(np.int32)  # empty sequences too
        for x in range(int(cu[-1]) + 2):
            assert int(count(jnp.asarray(cu), 1, n, lambda c: c <= x)) == np.searchsorted(cu[1:], x, "right")
            assert int(count(jnp.asarray(cu), 0, n, lambda c: c < x)) == np.searchsorted(cu[:-1], x, "left")


@pytest.mark.slow
@pytest.mark.parametrize("page", [16, 64, 128])
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
def test_sweep(load_kernel, page, num_seqs):
    k = load_kernel("paged_attention")
    rng = np.random.default_rng(page * 100 + num_seqs)
    kv_lens = rng.integers(1, 2001, num_seqs)
    # a third decode, a third chunked prefill, a third whole prefill (capped to keep T reasonable)
    kind = rng.integers(0, 3, num_seqs)
    q_lens = np.where(kind == 0, 1, np.where(kind == 1, np.minimum(kv_lens, rng.integers(1, 64, num_seqs)),
                                             np.minimum(kv_lens, 300)))
    for dtype, extra in ((jnp.float32, dict()), (jnp.bfloat16, dict(window=256, softcap=30.0))):
        args = make_case(list(q_lens), list(kv_lens), page=page, hq=8, hkv=2, dtype=dtype, sinks=bool(extra))
        check(k, args, **extra)


# --------------------------------------------------------------------------- quantized caches (fp8 e4m3, int8)

QUANT = {"float8_e4m3fn": jnp.float8_e4m3fn, "int8": jnp.int8}


def amax_scales(pages, dtype):
    """One scale per KV head: the head's largest |value| maps to the dtype's largest value."""
    amax = np.abs(np.asarray(pages, np.float32)).max(axis=(0, 1, 3))
    return jnp.asarray(amax / {"float8_e4m3fn": 448.0, "int8": 127.0}[dtype], jnp.float32)


def host_quantize(x, scale, dtype):
    """numpy/ml_dtypes, independent of pallas.quantize: x / scale, nearest-even, saturated."""
    y = np.asarray(x, np.float32) / np.asarray(scale, np.float32)[:, None]
    if dtype == "int8":
        return np.clip(np.rint(y), -127, 127).astype(np.int8)
    return np.clip(y, -448, 448).astype(jnp.float8_e4m3fn)  # ml_dtypes' cast rounds to nearest even


def quantized_case(case, dtype, spread=True):
    """The case's cache quantized per KV head (head h's values scaled by 1 + h, so scales differ)."""
    q, kp, vp, lens, table, cu, sk = case
    if spread:
        mult = jnp.arange(1, kp.shape[2] + 1, dtype=jnp.float32)[:, None]
        kp, vp = (kp.astype(jnp.float32) * mult).astype(kp.dtype), (vp.astype(jnp.float32) * mult).astype(vp.dtype)
    ks, vs = amax_scales(kp, dtype), amax_scales(vp, dtype)
    kq, vq = (jnp.asarray(host_quantize(p, s, dtype)) for p, s in ((kp, ks), (vp, vs)))
    return (q, kq, vq, lens, table, cu, sk), (ks, vs), (kp, vp)


QUANT_CASES = {  # name: (q_lens, kv_lens, make_case kwargs, kernel static kwargs)
    "decode_page16": ([1] * 5, [1, 17, 40, 33, 5], dict(), dict(block_q=4)),
    "mixed_page32_window_softcap_sinks": ([30, 1, 0, 7, 1], [100, 33, 0, 7, 250], dict(page=32, sinks=True),
                                          dict(window=24, softcap=20.0, block_kv=64)),
    "bf16_q_gqa4_page128": ([3, 1, 60, 1], [3, 300, 90, 129], dict(page=128, hq=8, hkv=2, dtype=jnp.bfloat16),
                            dict(block_kv=128, block_q=64)),
    "bf16_q_page64_chunked_prefill_window": ([16, 1, 9], [48, 77, 9], dict(page=64, hkv=4, hq=4, d=64,
                                                                           dtype=jnp.bfloat16), dict(window=20, block_q=16)),
}


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("name", QUANT_CASES)
def test_quantized_cache_matches_dense_reference(load_kernel, name, dtype):
    """The kernel over a float8_e4m3fn / int8 cache equals dense attention over the dequantized cache
    (values x per-head scale) within the query dtype's tolerance: dequantization is exact."""
    k = load_kernel("paged_attention")
    q_lens, kv_lens, make, static = QUANT_CASES[name]
    args, (ks, vs), _ = quantized_case(make_case(q_lens, kv_lens, **make), dtype)
    assert args[1].dtype == QUANT[dtype]
    check(k, args, k_scale=ks, v_scale=vs, **static)


LAST_PAGE_CASES = {  # name: (make_case kwargs, tokens whose rows make whole 32-bit words)
    "f32_hkv3_page16": (dict(hq=6, hkv=3), 1),
    "bf16_hkv1_page16": (dict(hq=4, hkv=1, dtype=jnp.bfloat16), 2),  # a token's row is half a word
    "bf16_hkv3_page32": (dict(page=32, hq=6, hkv=3, dtype=jnp.bfloat16), 2),
    "bf16_hkv2_page128": (dict(page=128, hq=8, hkv=2, dtype=jnp.bfloat16), 1),
}


@pytest.mark.parametrize("partial", [True, False], ids=["up-to-the-end", "whole"])
@pytest.mark.parametrize("name", LAST_PAGE_CASES)
def test_a_sequence_last_page_copied_up_to_its_end_or_whole(load_kernel, monkeypatch, name, partial):
    """On PARTIAL_PAGE_CHIPS a cache of q's dtype has a sequence's last page copied only up to its end, rounded
    up to whole 32-bit rows (pieces of a power of two tokens, waited for in tokens); elsewhere whole. Either
    gives the reference, with lengths ending inside a word, on a page's last token and on its first, over
    several chunks (block_kv of two pages). The slots past the end hold an earlier chunk's keys, or under the
    strict interpreter NaN, so a key past the end that reached the softmax or P @ V would show; the strict
    one where it runs the kernel (it cannot read the 32-bit view ``_head_rows`` takes of packed rows)."""
    k = load_kernel("paged_attention")
    make, unit = LAST_PAGE_CASES[name]
    dtype = make.get("dtype", jnp.float32)
    assert k.pallas._word_tokens(make["hkv"], jnp.dtype(dtype).itemsize) == unit
    page = make.get("page", 16)
    kv_lens = [1, page - 1, page, page + 1, 3 * page + 2, 2 * page + unit + 1]
    monkeypatch.setattr(k.pallas, "PARTIAL_PAGE_CHIPS", (None,) if partial else ())
    jax.clear_caches()  # jit caches traces by function, not by the module constants they read
    packed = dtype == jnp.bfloat16 and make["hkv"] > 1
    check(k, make_case([1] * len(kv_lens), kv_lens, **make), mode="fast" if packed else "strict", block_q=8,
          block_kv=2 * page)


@pytest.mark.parametrize("b11", [True, False], ids=["e4m3b11fnuz-unpack", "e4m3fn-conversion"])
@pytest.mark.parametrize("hkv", [2, 1])
def test_fp8_cache_every_code_in_both_conversions(load_kernel, monkeypatch, b11, hkv):
    """Every finite float8_e4m3fn byte (subnormals and -0 included) in the cache, read through the
    e4m3b11fnuz unpack (v5e, v6e) or the e4m3fn conversion (TPU7x), against dense attention over the
    dequantized cache: K/V bytes cycle through the 254 finite codes, per-head scales of 1/64 and 1/128.
    With one KV head the rows are read whole (no 32-bit word extraction)."""
    k = load_kernel("paged_attention")
    monkeypatch.setattr(k.pallas, "reads_e4m3_as_b11", lambda chip=None: b11)
    jax.clear_caches()  # jit would reuse the other conversion's trace: the choice is made while tracing
    q, kp, vp, lens, table, cu, sk = make_case([1, 3, 1], [70, 40, 33], hq=2 * hkv, hkv=hkv)
    codes = np.array([c for c in range(256) if c & 0x7F != 0x7F], np.uint8)
    n = kp.size
    kq = codes[np.arange(n) % codes.size].reshape(kp.shape).view(jnp.float8_e4m3fn)
    vq = codes[(np.arange(n) * 7 + 3) % codes.size].reshape(vp.shape).view(jnp.float8_e4m3fn)
    assert (kq.view(np.uint8) == 0x80).any() and (vq.view(np.uint8) == 0x01).any()
    ks = jnp.asarray([1 / 64, 1 / 128][:hkv], jnp.float32)
    check(k, (q, jnp.asarray(kq), jnp.asarray(vq), lens, table, cu, sk), k_scale=ks, v_scale=ks[::-1])


def test_quantized_scales_are_per_kv_head(load_kernel):
    """Swapping two heads' scales changes exactly those heads' outputs: the check can fail."""
    k = load_kernel("paged_attention")
    args, (ks, vs), _ = quantized_case(make_case([2, 1], [20, 9], hq=4, hkv=2), "int8")
    out = check(k, args, k_scale=ks, v_scale=vs)
    with interpret("fast"):
        swapped = np.asarray(k.pallas.ragged_paged_attention(*args[:6], k_scale=ks, v_scale=vs[::-1], scale=128 ** -0.5))
    real = int(args[5][-1])
    assert not np.allclose(swapped[:real], out[:real], atol=1e-3)


def quant_errors(k, case, dtype, static):
    """(max, mean) |out - exact| of the kernel over a quantized cache, exact = f32 dense attention
    over the unquantized cache; ``dtype`` None = the unquantized cache itself."""
    q, kp, vp, lens, table, cu, sk = case
    exact = k.pallas.reference(q, kp, vp, lens, table, cu, sk, **{n: v for n, v in static.items() if n != "block_q"})
    args, scales = case, {}
    if dtype is not None:
        args, (ks, vs), _ = quantized_case(case, dtype, spread=False)
        scales = dict(k_scale=ks, v_scale=vs)
    with interpret("fast"):
        out = np.asarray(jax.jit(k.pallas.ragged_paged_attention, static_argnames=STATIC)(*args, **scales, **static)
                         .astype(jnp.float32))
    real = int(cu[-1])
    err = np.abs(out[:real] - exact[:real])
    return float(err.max()), float(err.mean())


ACCURACY_CASES = {  # name: make_case args, static; unit-normal bf16 q/K/V, page tables shuffled
    "decode 9 seqs, page 16": (([1] * 9, [1, 17, 40, 16, 33, 5, 64, 2, 30]), dict(), dict(block_q=8)),
    "mixed prefill/decode, page 64, window 24": (([30, 1, 7, 1], [100, 33, 7, 250]), dict(page=64),
                                                 dict(window=24)),
    "GQA 4, page 128": (([3, 1, 60, 1], [3, 300, 90, 129]), dict(page=128, hq=8, hkv=2), dict(block_q=64)),
}
# (max, mean) |error| bounds, about twice what was observed (CARD.md's table)
ACCURACY_BOUNDS = {None: (0.02, 0.001), "float8_e4m3fn": (0.3, 0.02), "int8": (0.07, 0.008)}


@pytest.mark.parametrize("name", [pytest.param(n, marks=[pytest.mark.slow] if i else [])
                                  for i, n in enumerate(ACCURACY_CASES)])
def test_quantized_cache_accuracy_vs_bf16_cache(load_kernel, name):
    """CARD.md's accuracy table (``-s`` prints the rows): error of the kernel's output against exact
    f32 attention over the original values, for a bf16 cache (bf16 q) and the same values stored in
    an fp8 / int8 cache (scale per KV head: its amax over the dtype's largest value)."""
    k = load_kernel("paged_attention")
    (q_lens, kv_lens), make, static = ACCURACY_CASES[name]
    case = make_case(q_lens, kv_lens, dtype=jnp.bfloat16, **make)
    errors = {dtype: quant_errors(k, case, dtype, dict(scale=128 ** -0.5, **static))
              for dtype in (None, "float8_e4m3fn", "int8")}
    print("".join(f"\n| {name} | {dtype or 'bfloat16'} | {mx:.2e} | {mean:.2e} |" for dtype, (mx, mean) in errors.items()))
    for dtype, (mx, mean) in errors.items():
        assert mx < ACCURACY_BOUNDS[dtype][0] and mean < ACCURACY_BOUNDS[dtype][1], (dtype, mx, mean)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("mode", ["fast", pytest.param("strict", marks=pytest.mark.strict_interpret)])
def test_write_kv_quantizes_the_new_rows(load_kernel, dtype, mode):
    """write_kv stores x / scale per head, nearest-even and saturated (host numpy reference), in the
    JAX kernel and in write_kv_; large values saturate instead of becoming NaN."""
    k = load_kernel("paged_attention")
    q, kp, vp, lens, table, cu, _ = make_case([5, 1, 0, 20], [20, 3, 0, 40], hq=2, hkv=2, dtype=jnp.bfloat16)
    ks, vs = jnp.array([0.02, 0.05], jnp.float32), jnp.array([0.01, 0.1], jnp.float32)
    new_k, new_v = q, (q * 3).at[0, 0, :4].set(1e4)  # some values far past the range: saturate
    kq, vq = (jnp.zeros(kp.shape, QUANT[dtype]) for _ in range(2))
    rk, rv = k.pallas.reference_write(kq, vq, host_quantize(new_k, ks, dtype), host_quantize(new_v, vs, dtype),
                                      lens, table, cu)
    with interpret(mode):
        ko, vo = jax.jit(k.pallas.write_kv)(kq, vq, new_k, new_v, lens, table, cu, ks, vs)
    assert ko.dtype == QUANT[dtype]
    np.testing.assert_array_equal(np.asarray(ko).astype(np.float32), rk.astype(np.float32))
    np.testing.assert_array_equal(np.asarray(vo).astype(np.float32), rv.astype(np.float32))
    assert np.abs(rv.astype(np.float32)).max() == {"float8_e4m3fn": 448, "int8": 127}[dtype]  # saturated
    tk, tv = _torch(kq, vq)
    k.write_kv_(tk, tv, *_torch(new_k, new_v, lens, table, cu, ks, vs))
    np.testing.assert_array_equal(tk.float().numpy(), rk.astype(np.float32))
    np.testing.assert_array_equal(tv.float().numpy(), rv.astype(np.float32))


def test_quantized_torch_ops_write_then_attend(load_kernel):
    """torch ops end to end on an fp8 cache: write_kv (functional) and write_kv_ (in place) agree,
    and ragged_paged_attention over the result equals the dense reference."""
    k = load_kernel("paged_attention")
    q, kp, vp, lens, table, cu, _ = make_case([4, 1, 3], [4, 30, 20], hq=4, hkv=2, d=64)
    ks, vs = torch.tensor([0.01, 0.02]), torch.tensor([0.02, 0.01])
    kc = torch.from_numpy(host_quantize(kp, ks.numpy(), "float8_e4m3fn").astype(np.float32)).to(torch.float8_e4m3fn)
    vc = torch.from_numpy(host_quantize(vp, vs.numpy(), "float8_e4m3fn").astype(np.float32)).to(torch.float8_e4m3fn)
    tq, tlens, ttable, tcu = _torch(q, lens, table, cu)
    new_k, new_v = tq[:, :2] * 0.5, tq[:, 2:]
    ko, vo = k.write_kv(kc, vc, new_k, new_v, tlens, ttable, tcu, ks, vs)
    k.write_kv_(kc, vc, new_k, new_v, tlens, ttable, tcu, k_scale=ks, v_scale=vs)
    assert kc.dtype == ko.dtype == torch.float8_e4m3fn
    np.testing.assert_array_equal(kc.float().numpy(), ko.float().numpy())
    np.testing.assert_array_equal(vc.float().numpy(), vo.float().numpy())
    out = k.ragged_paged_attention(tq, kc, vc, tlens, ttable, tcu, k_scale=ks, v_scale=vs)
    ref = k.pallas.reference(q, kc.float().numpy(), vc.float().numpy(), lens, table, cu, k_scale=ks.numpy(),
                             v_scale=vs.numpy())
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_quantized_cache_halves_the_modelled_kv_traffic(load_kernel):
    """The cost model (not a measurement) follows the kernel's page DMAs: an fp8 / int8 cache moves
    half the bytes of a bf16 one (the q/out blocks and metadata are the same small remainder)."""
    from pallas_hub.bench import costmodel

    k = load_kernel("paged_attention")
    lens = np.random.default_rng(0).integers(300, 1000, 8).astype(np.int32)
    page, hkv, d = 16, 4, 128
    table = np.random.default_rng(1).permutation(8 * 64).astype(np.int32).reshape(8, 64)
    cu = jnp.arange(9, dtype=jnp.int32)
    q = jax.ShapeDtypeStruct((8, 32, d), jnp.bfloat16)
    kv_bytes = {}
    for dtype in (jnp.bfloat16, jnp.float8_e4m3fn, jnp.int8):
        pages = jax.ShapeDtypeStruct((8 * 64, page, hkv, d), dtype)
        scales = {} if dtype == jnp.bfloat16 else dict(k_scale=jnp.ones(hkv), v_scale=jnp.ones(hkv))  # SMEM: concrete
        (call,) = costmodel.estimate(k.pallas.ragged_paged_attention, q, pages, pages, jnp.asarray(lens),
                                     jnp.asarray(table), cu, **scales).calls
        kv_bytes[jnp.dtype(dtype).name] = call.dma_read_bytes
    # K and V of each sequence's tokens, 2 bytes a value (a last page copied up to the sequence's end), and
    # its row of the page table
    kv = 2 * int(lens.sum()) * hkv * d * 2
    assert kv + 8 * 64 * 4 <= kv_bytes["bfloat16"] <= kv + 8 * 64 * 4 + 8 * 2 * hkv * d * 2, (kv, kv_bytes)
    assert kv_bytes["float8_e4m3fn"] == kv_bytes["int8"]
    assert abs(kv_bytes["float8_e4m3fn"] / kv_bytes["bfloat16"] - 0.5) < 0.01, kv_bytes


def test_quantize_kv_op_errors_name_the_argument(load_kernel):
    k = load_kernel("paged_attention")
    x, scale = torch.ones(3, 2, 64), torch.ones(2)
    assert k.quantize_kv(x, scale, "int8").dtype == torch.int8
    with pytest.raises(ValueError, match="dtype must be one of float8_e4m3fn, int8, got 'float16'"):
        k.quantize_kv(x, scale, "float16")
    with pytest.raises(ValueError, match=r"scale must have shape \(2,\) \(one per KV head"):
        k.quantize_kv(x, torch.ones(4), "float8_e4m3fn")
    with pytest.raises(TypeError, match="x must have dtype float32 or bfloat16, got int8"):
        k.quantize_kv(x.to(torch.int8), scale, "int8")
    for bad in ([0.0, 1.0], [-1.0, 1.0], [float("nan"), 1.0]):  # as write_kv's: zero would saturate, -1 flip signs
        with pytest.raises(ValueError, match="scale must be positive and finite"):
            k.quantize_kv(x, torch.tensor(bad), "int8")


def test_write_errors_name_the_new_rows(load_kernel):
    """write_kv's rows are new_k's: its metadata errors say so, not "q" (write_kv has none)."""
    k = load_kernel("paged_attention")
    kp, new = jnp.zeros((4, 16, 2, 64)), jnp.ones((4, 2, 64))
    args = (jnp.array([1, 4]), jnp.array([[0, 1], [2, 3]]), jnp.array([0, 1, 5]))
    with pytest.raises(ValueError, match=r"cu_q_lens\[-1\]=5 exceeds the number of query rows new_k.shape\[0\]=4"):
        k.pallas.write_kv(kp, kp, new, new, *args)
    with pytest.raises(ValueError, match=r"multiple of 16 for a bfloat16 new_k"):
        k.pallas.write_kv(jnp.zeros((4, 8, 2, 64), jnp.bfloat16), jnp.zeros((4, 8, 2, 64), jnp.bfloat16),
                          new.astype(jnp.bfloat16), new.astype(jnp.bfloat16), jnp.array([1, 4]), *args[1:])


QUANT_BAD = {  # name: (change, message); the cache is float8_e4m3fn unless the change says otherwise
    "quantized cache without scales": (lambda a: dict(k_scale=None), r"float8_e4m3fn, a quantized dtype: k_scale"),
    "v_scale missing": (lambda a: dict(v_scale=None), r"v_scale \(float32 \[Hkv\]"),
    "scale shape": (lambda a: dict(k_scale=jnp.ones((3,), jnp.float32)), r"k_scale must have shape \(2,\)"),
    "scale rank": (lambda a: dict(v_scale=jnp.ones((1, 2), jnp.float32)), r"v_scale must have 1 dimensions"),
    "scale dtype": (lambda a: dict(k_scale=jnp.ones((2,), jnp.bfloat16)), r"k_scale must have dtype float32"),
    "scale not positive": (lambda a: dict(v_scale=jnp.array([1.0, 0.0], jnp.float32)),
                           r"v_scale must be positive and finite"),
    "scales with an f32 cache": (lambda a: dict(k_pages=a["k_f32"], v_pages=a["k_f32"]),
                                 r"k_scale is given but the cache \(k_pages\) is float32"),
    "unsupported cache dtype": (lambda a: dict(k_pages=a["k_pages"].astype(jnp.float8_e5m2),
                                               v_pages=a["v_pages"].astype(jnp.float8_e5m2)),
                                r"k_pages must have dtype one of float32, bfloat16, float8_e4m3fn, int8, got float8_e5m2"),
    "k and v dtypes differ": (lambda a: dict(v_pages=a["v_pages"].astype(jnp.int8)),
                              r"k_pages and v_pages must share a dtype"),
}


@pytest.mark.parametrize("name", QUANT_BAD)
def test_quantized_bad_input_errors_name_the_argument(load_kernel, name):
    k = load_kernel("paged_attention")
    change, message = QUANT_BAD[name]
    args, (ks, vs), _ = quantized_case(make_case([2, 1, 3], [9, 30, 5]), "float8_e4m3fn")
    q, kp, vp, lens, table, cu, _ = args
    a = dict(q=q, k_pages=kp, v_pages=vp, kv_lens=lens, page_indices=table, cu_q_lens=cu, k_scale=ks, v_scale=vs)
    a.update(change({**a, "k_f32": jnp.zeros(kp.shape, jnp.float32)}))
    with pytest.raises((ValueError, TypeError), match=message):
        k.pallas.ragged_paged_attention(**a)
    w = dict(a, new_k=q[:, :2], new_v=q[:, 2:])
    del w["q"]
    with pytest.raises((ValueError, TypeError), match=message):
        k.pallas.write_kv(**w)
    t = dict(zip(a, _torch(*a.values())))
    with pytest.raises((ValueError, TypeError), match=message):  # the torch op checks on the host too
        k.ragged_paged_attention(**t)
    tw = dict(t, new_k=t["q"][:, :2].contiguous(), new_v=t["q"][:, 2:].contiguous())
    del tw["q"]
    with pytest.raises((ValueError, TypeError), match=message):
        k.write_kv_(**{n.replace("_pages", "_cache"): v for n, v in tw.items()})


# --------------------------------------------------------------------------- torch op, strict interpreter

def test_torch_op_int64_metadata(load_kernel):
    k = load_kernel("paged_attention")
    q, kp, vp, lens, table, cu, _ = make_case([2, 1, 5], [9, 30, 5], sinks=False)
    t = lambda a: torch.from_dlpack(np.asarray(a).copy())  # noqa: E731
    out = k.ragged_paged_attention(t(q), t(kp), t(vp), t(lens).long(), t(table).long(), t(cu).long(),
                                   None, scale=0.125)
    ref = k.pallas.reference(q, kp, vp, lens, table, cu, scale=0.125)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.strict_interpret
def test_strict_interpreter_matches_reference(load_kernel):
    k = load_kernel("paged_attention")
    args = make_case([3, 1, 0, 2], [20, 33, 0, 2], sinks=True, extra_rows=2)
    check(k, args, mode="strict", window=8, softcap=20.0, block_kv=16, block_q=8)


@pytest.mark.strict_interpret
def test_strict_interpreter_bad_metadata_never_reads_out_of_bounds(load_kernel):
    # Under jit the values are tracers, so host validation cannot see them: the device clamps.
    k = load_kernel("paged_attention")
    q, kp, vp, lens, table, cu, _ = make_case([2, 1, 3], [9, 30, 5], extra_rows=1)
    bad_table = table.at[0, 0].set(10_000).at[1, 1].set(-7)  # page ids past the pool, negative
    bad_lens = lens.at[2].set(10_000)  # more tokens than the table's pages hold
    bad_cu = jnp.array([0, 4, 2, 99], jnp.int32)  # non-monotone, past T
    with interpret("strict"):
        out = jax.jit(k.pallas.ragged_paged_attention)(q, kp, vp, bad_lens, bad_table, bad_cu)
        jax.block_until_ready(out)
        ko, vo = jax.jit(k.pallas.write_kv)(kp, vp, q[:, :2], q[:, 2:], bad_lens, bad_table, bad_cu)
        jax.block_until_ready((ko, vo))
    assert out.shape == q.shape


def _dma_kernel(idx_ref, x_hbm, o_ref, buf, sem):
    c = pltpu.make_async_copy(x_hbm.at[idx_ref[0]], buf, sem)
    c.start()
    c.wait()
    o_ref[...] = buf[...]


@pytest.mark.strict_interpret
def test_strict_interpreter_catches_an_unclamped_page_dma():
    """The check above can fail: an out-of-range page DMA raises in the strict interpreter."""
    x = jnp.ones((4, 16, 128), jnp.float32)
    f = lambda i: pl.pallas_call(  # noqa: E731
        _dma_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(1,), in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
            out_specs=pl.BlockSpec((16, 128), lambda g, i: (0, 0)),
            scratch_shapes=[pltpu.VMEM((16, 128), jnp.float32), pltpu.SemaphoreType.DMA]))(i, x)
    with interpret("strict"):
        jax.block_until_ready(f(jnp.array([3], jnp.int32)))
    with pytest.raises(Exception, match="(?i)out.of.bounds|out of range|bounds"):
        with interpret("strict"):
            jax.block_until_ready(f(jnp.array([4], jnp.int32)))


# --------------------------------------------------------------------------- writing K/V into pages

@pytest.mark.parametrize("mode", ["fast", pytest.param("strict", marks=pytest.mark.strict_interpret)])
def test_write_kv_matches_host_loop(load_kernel, mode):
    k = load_kernel("paged_attention")
    q, kp, vp, lens, table, cu, _ = make_case([5, 1, 0, 20], [20, 3, 0, 40], hq=2, hkv=2)
    new_k, new_v = q, q * 2 + 1  # [T, Hkv, D] rows; the 3 padding rows must not be written
    rk, rv = k.pallas.reference_write(kp, vp, new_k, new_v, lens, table, cu)
    with interpret(mode):
        ko, vo = jax.jit(k.pallas.write_kv)(kp, vp, new_k, new_v, lens, table, cu)
    np.testing.assert_array_equal(np.asarray(ko), rk)
    np.testing.assert_array_equal(np.asarray(vo), rv)
    assert not np.array_equal(rk, np.asarray(kp))  # the check can fail: something was written


@pytest.mark.parametrize("mode", ["fast", pytest.param("strict", marks=pytest.mark.strict_interpret)])
@pytest.mark.parametrize("page, dtype", [(16, jnp.bfloat16), (32, jnp.float32)])
def test_write_kv_copies_runs_of_new_rows(load_kernel, mode, page, dtype):
    """Prefill chunks are written as runs (consecutive rows of one page: one DMA per power of two in
    the run): runs starting mid-page, whole pages, a page's last row, more runs than one loop
    iteration takes (16), decode rows and empty sequences between them, padding rows after."""
    k = load_kernel("paged_attention")
    q_lens = [40, 1, 0, 2 * page, 3, *[1] * 14, page + 5, 0, 7]
    kv_lens = [45, 9, 4, 2 * page, page + 1, *range(20, 34), 3 * page, 2, 7]
    q, kp, vp, lens, table, cu, _ = make_case(q_lens, kv_lens, page=page, hq=2, hkv=2, dtype=dtype, extra_rows=5)
    new_k, new_v = q, -q
    rk, rv = k.pallas.reference_write(kp, vp, new_k, new_v, lens, table, cu)
    with interpret(mode):
        ko, vo = jax.jit(k.pallas.write_kv)(kp, vp, new_k, new_v, lens, table, cu)
    np.testing.assert_array_equal(np.asarray(ko), rk)
    np.testing.assert_array_equal(np.asarray(vo), rv)
    pid, off, run = (np.asarray(a) for a in k.pallas.write_slots(lens, table, cu, q.shape[0], kp.shape[0], page))
    assert run[cu[-1]:].tolist() == [0] * 5 and run.max() == page  # padding ends the walk; a whole page is one run
    assert (off + run <= page)[pid >= 0].all()


def test_metadata_one_hot_forms_match_search_and_cummax(load_kernel, monkeypatch):
    """sanitize_cu and write_slots take one-hot / masked forms up to ONE_HOT_LIMIT (one fused XLA op each) and
    cummax / searchsorted + gathers past it: both give the same answers, bad metadata included (cu_q_lens
    decreasing, negative, past T; kv_lens too short; page ids out of range, up to int32's extremes, which the
    one-hot form's f32 table must not bring back into range)."""
    pallas = load_kernel("paged_attention").pallas
    limits = (pallas.ONE_HOT_LIMIT, 0)
    rng = np.random.default_rng(3)
    cases = [([1] * 9, [1, 17, 40, 16, 33, 5, 64, 2, 30]), ([40, 1, 0, 32, 3, 1, 21, 0, 7], [45, 9, 4, 32, 17, 20, 48, 2, 7]),
             ([5], [5]), ([1], [300])]
    for q_lens, kv_lens in cases:
        q, kp, _, lens, table, cu, _ = make_case(q_lens, kv_lens, page=16, hq=2, hkv=2, extra_rows=3)
        t, num_pages = q.shape[0], kp.shape[0]
        bad_cu = np.array(cu).copy()
        if len(bad_cu) > 3:
            bad_cu[2], bad_cu[-1] = bad_cu[1] - 1, t + 9  # decreasing, past T
        bad_table = np.array(table).copy()
        bad_table[0, 0], bad_table[-1, -1] = -3, num_pages + 2
        bad_table[-1, 0], bad_table[0, -1] = np.iinfo(np.int32).max, np.iinfo(np.int32).min
        for cu_, table_, lens_ in ((cu, table, lens), (jnp.asarray(bad_cu), jnp.asarray(bad_table), lens),
                                   (cu, table, jnp.asarray(np.asarray(lens) - rng.integers(0, 3, len(q_lens))))):
            want_cu = np.maximum.accumulate(np.clip(np.asarray(cu_), 0, t))
            for limit in limits:
                monkeypatch.setattr(pallas, "ONE_HOT_LIMIT", limit)
                np.testing.assert_array_equal(np.asarray(pallas.sanitize_cu(cu_, t)), want_cu)  # on the host
                np.testing.assert_array_equal(np.asarray(jax.jit(pallas.sanitize_cu, static_argnums=1)(cu_, t)),
                                              want_cu)  # on device
                got = [np.asarray(a) for a in pallas.write_slots(lens_, table_, cu_, t, num_pages, 16, rows=t + 16)]
                if limit:
                    one_hot = got
                else:
                    for a, b, name in zip(one_hot, got, ("page id", "offset", "run")):
                        written = one_hot[0] >= 0
                        np.testing.assert_array_equal(a[written] if name == "offset" else a, b[written] if name == "offset" else b,
                                                      err_msg=name)
            if cu_ is cu and lens_ is lens:  # good metadata: every new row is written
                assert (one_hot[0] >= 0).sum() == int(np.asarray(cu)[-1])


@pytest.mark.parametrize("mode", ["fast", pytest.param("strict", marks=pytest.mark.strict_interpret)])
def test_write_kv_decode_rows_one_by_one(load_kernel, mode):
    """No more rows than sequences (a decode batch): the kernel walks rows one by one (runs of 1),
    more than one loop iteration's worth (16), past sequences without a new row."""
    k = load_kernel("paged_attention")
    q_lens = [1, 1, 0, *[1] * 17, 0]
    q, kp, vp, lens, table, cu, _ = make_case(q_lens, [5, 17, 3, *range(30, 47), 4], hq=2, hkv=2, extra_rows=0)
    assert q.shape[0] <= len(q_lens)
    rk, rv = k.pallas.reference_write(kp, vp, q, 3 * q, lens, table, cu)
    with interpret(mode):
        ko, vo = jax.jit(k.pallas.write_kv)(kp, vp, q, 3 * q, lens, table, cu)
    np.testing.assert_array_equal(np.asarray(ko), rk)
    np.testing.assert_array_equal(np.asarray(vo), rv)


def test_write_kv_in_place_on_overlapping_views(load_kernel):
    # transformers' k_cache/v_cache are views of one buffer, offset by one page (K and V pages alternate).
    k = load_kernel("paged_attention")
    buf = torch.randn(13, 16, 2, 32)
    kc, vc = buf[:12], buf[1:]
    table = torch.tensor([[0, 4], [8, -1]], dtype=torch.int32)  # K pages even; V view shifts them to odd
    lens, cu = torch.tensor([20, 3], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
    nk, nv = torch.randn(3, 2, 32), torch.randn(3, 2, 32)
    rk, rv = k.pallas.reference_write(kc.numpy(), vc.numpy(), nk.numpy(), nv.numpy(), lens.numpy(), table.numpy(),
                                      cu.numpy())
    k.write_kv_(kc, vc, nk, nv, lens, table, cu)
    np.testing.assert_array_equal(buf[:12][[0, 4, 8]].numpy(), rk[[0, 4, 8]])
    np.testing.assert_array_equal(buf[1:][[0, 4, 8]].numpy(), rv[[0, 4, 8]])


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_kv_in_place_writes_the_new_rows_only(load_kernel, index_dtype):
    """Padding rows (past cu_q_lens[-1]) and empty sequences write nothing; every other row of the
    cache keeps its bytes; nothing at all to write leaves the cache as it was."""
    k = load_kernel("paged_attention")
    q, kp, vp, lens, table, cu, _ = make_case([5, 0, 1, 20], [20, 3, 40, 40], hq=2, hkv=2, d=32)
    kc, vc = torch.from_numpy(np.array(kp)), torch.from_numpy(np.array(vp))
    new_k, new_v = torch.from_numpy(np.array(q)), torch.from_numpy(np.array(q * 2 + 1))  # 3 padding rows
    meta = [torch.from_numpy(np.array(a)).to(index_dtype) for a in (lens, table, cu)]
    rk, rv = k.pallas.reference_write(kp, vp, q, q * 2 + 1, lens, table, cu)
    k.write_kv_(kc, vc, new_k, new_v, *meta)
    np.testing.assert_array_equal(kc.numpy(), rk)
    np.testing.assert_array_equal(vc.numpy(), rv)
    assert not np.array_equal(rk, np.asarray(kp))  # something was written
    before = kc.clone()
    k.write_kv_(kc, vc, new_k[:2], new_v[:2], meta[0], meta[1], torch.zeros_like(meta[2]))  # no sequence has new rows
    assert torch.equal(kc, before)


_BITS = {"bfloat16": (np.int16, torch.bfloat16), "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
         "float8_e5m2": (np.uint8, torch.float8_e5m2)}


def _torch(*arrays):
    """Host copies as torch tensors; dtypes numpy lacks (bf16, fp8: ml_dtypes) via their bits."""
    out = []
    for a in arrays:
        a = None if a is None else np.array(a)
        if a is not None and a.dtype.name in _BITS:
            bits, dtype = _BITS[a.dtype.name]
            a = torch.from_numpy(a.view(bits)).view(dtype)
        out.append(None if a is None else torch.from_numpy(a) if isinstance(a, np.ndarray) else a)
    return out


def test_write_kv_refuses_two_new_tokens_in_one_cache_slot(load_kernel):
    """Two sequences mapping a new token to the same (page, row) used to race, the last writer
    winning silently; on the host this is refused (JAX function, torch op, write_kv_). Sharing a
    page for reading (a common prefix) while writing different rows stays fine."""
    k = load_kernel("paged_attention")
    kp = jnp.asarray(np.random.default_rng(0).standard_normal((4, 16, 2, 64)), jnp.float32)
    new = jnp.ones((3, 2, 64), jnp.float32)
    table = jnp.array([[1, 2], [3, 2]], jnp.int32)  # both sequences' second page is page 2
    cu = jnp.array([0, 1, 3], jnp.int32)
    clash = jnp.array([18, 19], jnp.int32)  # seq 0 writes position 17, seq 1 positions 17 and 18: page 2 row 1 twice
    message = r"new tokens 0 \(sequence 0\) and 1 \(sequence 1\) are both written to page 2, row 1"
    with pytest.raises(ValueError, match=message):
        k.pallas.write_kv(kp, kp, new, new, clash, table, cu)
    kc, vc, tn, tlens, ttable, tcu = _torch(kp, kp, new, clash, table, cu)
    with pytest.raises(ValueError, match=message):
        k.write_kv(kc, vc, tn, tn, tlens, ttable, tcu)
    with pytest.raises(ValueError, match=message):
        k.write_kv_(kc, vc, tn, tn, tlens, ttable, tcu)
    np.testing.assert_array_equal(kc.numpy(), np.asarray(kp))  # nothing was written
    with pytest.raises(ValueError, match=r"new tokens 0 \(sequence 0\) and 16 \(sequence 0\) are both written to "
                                         r"page 1, row 0"):  # one sequence whose table repeats a page
        k.pallas.write_kv(kp, kp, jnp.ones((32, 2, 64)), jnp.ones((32, 2, 64)), jnp.array([32]), jnp.array([[1, 1]]),
                          jnp.array([0, 32]))
    shared = jnp.array([17, 19], jnp.int32)  # seq 0 writes page 2 row 0, seq 1 rows 1 and 2: distinct slots
    rk, rv = k.pallas.reference_write(kp, kp, new, new * 2, shared, table, cu)
    vc = kc.clone()
    k.write_kv_(kc, vc, tn, tn * 2, *_torch(shared), ttable, tcu)
    np.testing.assert_array_equal(kc.numpy(), rk)
    np.testing.assert_array_equal(vc.numpy(), rv)
    # under jit there are no values to check (and no host sync to get them): the check stays silent
    jax.jit(k.pallas.validate_write)(kp, kp, new, new, clash, table, cu)


# --------------------------------------------------------------------------- lane-packed caches (head dim < 128)

def lane_packed(pages):
    """[P, page, Hkv, D] -> [P, page, Hkv * D / 128, 128]: the same bytes, 128 / D heads a row."""
    return pages.reshape(*pages.shape[:2], -1, 128)


def poison_unwritten_slots(pages, kv_lens, table):
    """NaN in every slot past a sequence's last token (what an unwritten page may hold)."""
    pages, page = np.array(pages), pages.shape[1]
    for s, n in enumerate(np.asarray(kv_lens)):
        if n % page:
            pages[np.asarray(table)[s, n // page], n % page:] = np.nan
    return jnp.asarray(pages)


PACKED_CASES = {  # name: (q_lens, kv_lens, make_case kwargs, kernel static kwargs)
    "decode_d64": ([1] * 9, [1, 17, 40, 16, 33, 5, 64, 2, 30], dict(hq=8, hkv=4, d=64), dict(block_q=4)),
    # GPT-OSS's attention (64 q / 8 kv heads of 64, sinks, a 128-token sliding window) at a small scale
    "gpt_oss_like_mixed_bf16": ([1, 37, 0, 1, 5], [300, 37, 3, 129, 90],
                                dict(hq=16, hkv=4, d=64, dtype=jnp.bfloat16, sinks=True), dict(window=64)),
    "d32_four_heads_a_row_softcap": ([3, 1, 20], [3, 50, 20], dict(page=32, hq=8, hkv=4, d=32),
                                     dict(softcap=20.0, block_kv=64)),
}


@pytest.mark.parametrize("name", PACKED_CASES)
def test_lane_packed_cache_matches_dense_reference(load_kernel, name):
    """The cache as [P, page, Hkv * D / 128, 128] (what XLA:TPU keeps row-major) gives the same attention
    as [P, page, Hkv, D], against the host reference on the unpacked cache; NaN in unwritten slots."""
    k = load_kernel("paged_attention")
    q_lens, kv_lens, make, static = PACKED_CASES[name]
    q, kp, vp, lens, table, cu, sinks = make_case(q_lens, kv_lens, **make)
    kp, vp = (poison_unwritten_slots(x, lens, table) for x in (kp, vp))
    static.setdefault("scale", q.shape[-1] ** -0.5)
    with interpret("fast"):
        out = jax.jit(k.pallas.ragged_paged_attention, static_argnames=STATIC)(
            q, lane_packed(kp), lane_packed(vp), lens, table, cu, sinks, **static)
    out = np.asarray(out.astype(jnp.float32))
    ref = k.pallas.reference(q, kp, vp, lens, table, cu, sinks, **{n: v for n, v in static.items()
                                                                    if n in ("scale", "window", "softcap")})
    assert np.isfinite(out).all() and not out[int(cu[-1]):].any()
    tol = TOL[jnp.dtype(q.dtype).type]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("mode", ["fast", pytest.param("strict", marks=pytest.mark.strict_interpret)])
def test_lane_packed_write_then_attend(load_kernel, mode):
    """write_kv and write_kv_ on a lane-packed cache write the rows [Hkv, D] of the new tokens where the
    unpacked cache has them; attention then sees them (JAX function and torch op)."""
    k = load_kernel("paged_attention")
    q, kp, vp, lens, table, cu, _ = make_case([5, 1, 0, 20], [20, 3, 0, 40], hq=4, hkv=2, d=64)
    new_k, new_v = q[:, :2], q[:, 2:] * 2 + 1
    rk, rv = k.pallas.reference_write(kp, vp, new_k, new_v, lens, table, cu)
    with interpret(mode):
        ko, vo = jax.jit(k.pallas.write_kv)(lane_packed(kp), lane_packed(vp), new_k, new_v, lens, table, cu)
    assert ko.shape == (kp.shape[0], 16, 1, 128)
    np.testing.assert_array_equal(np.asarray(ko), lane_packed(rk))
    np.testing.assert_array_equal(np.asarray(vo), lane_packed(rv))
    assert not np.array_equal(rk, np.asarray(kp))  # something was written
    kc, vc, tq, tk, tv, tlens, ttable, tcu = _torch(lane_packed(kp), lane_packed(vp), q, new_k, new_v, lens, table, cu)
    k.write_kv_(kc, vc, tk, tv, tlens, ttable, tcu)
    np.testing.assert_array_equal(kc.numpy(), lane_packed(rk))
    np.testing.assert_array_equal(vc.numpy(), lane_packed(rv))
    out = k.ragged_paged_attention(tq, kc, vc, tlens, ttable, tcu).numpy()
    ref = k.pallas.reference(q, rk, rv, lens, table, cu)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


FUSED_CASES = {  # name: (q_lens, kv_lens, make_case kwargs, kernel static kwargs, cache dtype or None)
    # decode rows and prefill chunks straddling 8-token tiles, chunks of 2 pages, new rows across page ends,
    # an empty sequence between others, a sequence whose new rows fill whole pages, padding rows
    "mixed_bf16": ([1, 1, 20, 0, 33, 1, 16], [37, 16, 150, 10, 97, 1, 48], dict(hkv=2, dtype=jnp.bfloat16),
                   dict(block_q=8, block_kv=32), None),
    "f32_one_head_window_sinks_softcap": ([3, 1, 20, 1], [3, 50, 60, 17], dict(hq=4, hkv=1, sinks=True),
                                          dict(window=24, softcap=20.0, block_kv=16), None),
    "f32_two_heads_tiles_and_chunks": ([2, 1, 17, 0, 1], [40, 16, 33, 5, 70], dict(hkv=2), dict(block_q=8, block_kv=32),
                                       None),
    "decode_page_32": ([1] * 7, [1, 31, 32, 33, 64, 65, 2], dict(page=32, hkv=2, dtype=jnp.bfloat16), {}, None),
    "int8_cache": ([1, 12, 1], [40, 12, 9], dict(hq=8, hkv=4, dtype=jnp.bfloat16), dict(block_kv=32), "int8"),
    "fp8_cache": ([2, 1, 30], [9, 70, 45], dict(hq=8, hkv=4, dtype=jnp.bfloat16), dict(block_q=8), "float8_e4m3fn"),
    "lane_packed_d64": ([1, 37, 0, 1, 5], [300, 37, 3, 129, 90], dict(hq=16, hkv=4, d=64, dtype=jnp.bfloat16),
                        dict(block_q=16), None),
    "two_calls_bf16_one_head": ([1, 9, 1], [20, 9, 33], dict(hq=2, hkv=1, dtype=jnp.bfloat16), {}, None),
    "two_calls_nine_sequences": ([1] * 8 + [5], [3, 17, 40, 16, 33, 5, 64, 2, 30], dict(hkv=2), {}, None),
}


@pytest.mark.parametrize("name, mode", [(n, "fast") for n in FUSED_CASES] + [
    pytest.param(n, "strict", marks=pytest.mark.strict_interpret) for n in FUSED_CASES
    if FUSED_CASES[n][2].get("dtype", jnp.float32) == jnp.float32])  # the strict interpreter reads no bitcast views
def test_write_and_attend_is_write_kv_then_attention(load_kernel, name, mode):
    """The fused kernel writes exactly what write_kv writes (host loop) and returns the attention over the
    written cache (host reference); unwritten slots hold NaN, so a chunk that read a new token from the cache
    instead of new_k/new_v would fail. One KV head of bf16 takes the two calls (``fuses_write``)."""
    k = load_kernel("paged_attention")
    q_lens, kv_lens, make, static, cache_dtype = FUSED_CASES[name]
    q, kp, vp, lens, table, cu, sinks = make_case(q_lens, kv_lens, **make)
    hkv, d = make["hkv"], make.get("d", 128)
    rng = np.random.default_rng(7)
    new_k, new_v = (jnp.asarray(rng.standard_normal((q.shape[0], hkv, d)), q.dtype) for _ in range(2))
    scales, host_new = (), (new_k, new_v)
    if cache_dtype:
        scales = (jnp.asarray(rng.uniform(0.01, 0.03, hkv), jnp.float32),) * 2
        kp, vp = (jnp.asarray(host_quantize(x, scales[0], cache_dtype)) for x in (kp, vp))
        host_new = tuple(host_quantize(x, scales[0], cache_dtype) for x in (new_k, new_v))
    # every slot the new tokens go to holds NaN before the write
    new_slots = [(s, p) for s in range(len(q_lens)) for p in range(kv_lens[s] - q_lens[s], kv_lens[s])]
    if not cache_dtype:
        kp, vp = (x.at[np.array([table[s, p // kp.shape[1]] for s, p in new_slots], int),
                       np.array([p % kp.shape[1] for _, p in new_slots], int)].set(np.nan) for x in (kp, vp))
    rk, rv = k.pallas.reference_write(kp, vp, *host_new, lens, table, cu)
    packed = d < 128
    args = (q, new_k, new_v, *((lane_packed(kp), lane_packed(vp)) if packed else (kp, vp)), lens, table, cu, sinks)
    static = dict(static, scale=d ** -0.5)
    assert k.pallas.fuses_write(args[3]) == (name != "two_calls_bf16_one_head")
    with interpret(mode):
        out, ko, vo = jax.jit(k.pallas.write_and_attend, static_argnames=STATIC)(*args, **static, k_scale=scales[0] if scales else None,
                                                                                 v_scale=scales[1] if scales else None)
    for got, want in ((ko, rk), (vo, rv)):
        got = np.asarray(got).reshape(want.shape)
        np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    ref = k.pallas.reference(q, rk, rv, lens, table, cu, sinks, **{n: v for n, v in static.items()
                                                                 if n in ("scale", "window", "softcap")},
                             **(dict(k_scale=scales[0], v_scale=scales[1]) if scales else {}))
    out = np.asarray(out.astype(jnp.float32))
    assert np.isfinite(out).all() and not out[int(cu[-1]):].any()
    tol = TOL[jnp.dtype(q.dtype).type]
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


def test_write_and_attend_batch_rule(load_kernel, monkeypatch):
    """More than FUSED_WRITE_MAX_SEQS sequences take the two calls, except with a cache of q's dtype in pages of
    at least the chip's FUSED_WRITE_ANY_BATCH_PAGE (one kernel: the same caches and output); a quantized cache
    takes the two there too, and so do smaller pages."""
    k = load_kernel("paged_attention")
    q_lens, kv_lens = [1] * 8 + [5], [3, 17, 40, 16, 33, 5, 64, 2, 30]
    q, kp, vp, lens, table, cu, _ = make_case(q_lens, kv_lens, hkv=2)
    new_k, new_v = q[:, :2] * 0.5, q[:, 2:] - 1
    args = (q, new_k, new_v, kp, vp, lens, table, cu)
    assert len(q_lens) > k.pallas.FUSED_WRITE_MAX_SEQS
    ks = jnp.full((2,), 0.02, jnp.float32)
    kq, vq = (jnp.asarray(host_quantize(x, ks, "int8")) for x in (kp, vp))
    results = {}
    assert kp.shape[1] == 16  # pages of 16 tokens: off the chip (None) the rule below decides
    for pages, calls in (({}, 2), ({None: 32}, 2), ({None: 16}, 1)):
        monkeypatch.setattr(k.pallas, "FUSED_WRITE_ANY_BATCH_PAGE", pages)
        jax.clear_caches()
        assert len(pallas_calls(k.pallas.write_and_attend, *args)) == calls
        quantized = pallas_calls(k.pallas.write_and_attend, q, new_k, new_v, kq, vq, lens, table, cu, k_scale=ks,
                                 v_scale=ks)
        assert len(quantized) == 2
        with interpret("fast"):
            results[calls] = [np.asarray(x) for x in jax.jit(k.pallas.write_and_attend)(*args)]
    for one, two in zip(results[1], results[2]):
        np.testing.assert_allclose(one, two, rtol=1e-6, atol=1e-6)


def test_write_and_attend_torch_op_is_the_two_ops(load_kernel):
    """The torch op on CPU tensors: the caches write_kv returns and the attention over them."""
    k = load_kernel("paged_attention")
    q, kp, vp, lens, table, cu, _ = make_case([1, 6, 1], [30, 6, 17], hq=4, hkv=2)
    new_k, new_v = q[:, :2] * 0.5, q[:, 2:] - 1
    tq, tnk, tnv, tkp, tvp, tlens, ttable, tcu = _torch(q, new_k, new_v, kp, vp, lens, table, cu)
    out, ko, vo = k.write_and_attend(tq, tnk, tnv, tkp, tvp, tlens, ttable, tcu)
    wk, wv = k.write_kv(tkp, tvp, tnk, tnv, tlens, ttable, tcu)
    torch.testing.assert_close(ko, wk, rtol=0, atol=0)
    torch.testing.assert_close(vo, wv, rtol=0, atol=0)
    torch.testing.assert_close(out, k.ragged_paged_attention(tq, wk, wv, tlens, ttable, tcu), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="one row per query row"):
        k.write_and_attend(tq, tnk[:-1], tnv[:-1], tkp, tvp, tlens, ttable, tcu)


def test_lane_packed_shape_says_which_caches_have_one(load_kernel):
    """The one rule the CB path and the bench use to build a lane-packed cache: D below 128 dividing it,
    whole rows of heads, not quantized; for a torch tensor, a jax array and a ShapeDtypeStruct alike."""
    shape_of = load_kernel("paged_attention").pallas.lane_packed_shape
    assert shape_of(jax.ShapeDtypeStruct((7, 16, 8, 64), jnp.bfloat16)) == (7, 16, 4, 128)
    assert shape_of(torch.zeros(3, 32, 4, 32)) == (3, 32, 1, 128)
    for shape, dtype in [((7, 16, 8, 128), jnp.bfloat16), ((7, 16, 8, 256), jnp.bfloat16),
                         ((7, 16, 1, 64), jnp.bfloat16), ((7, 16, 3, 32), jnp.float32),
                         ((7, 16, 8, 48), jnp.float32), ((7, 16, 8, 64), jnp.int8),
                         ((7, 16, 8, 64), jnp.float8_e4m3fn), ((7, 16, 8, 0), jnp.bfloat16)]:
        assert shape_of(jax.ShapeDtypeStruct(shape, dtype)) is None, (shape, dtype)


PACKED_BAD = {  # name: (head dim, cache shape, cache dtype, message)
    "width neither D nor 128": (64, (4, 16, 2, 96), jnp.float32,
                                r"head_dim of q \(64\) does not match k_pages \(4, 16, 2, 96\): the cache is "
                                r"\[P, page, Hkv, 64\], or lane-packed \[P, page, Hkv \* 64 / 128, 128\]"),
    "D does not divide 128": (48, (4, 16, 1, 128), jnp.float32, r"head_dim of q \(48\) does not match k_pages "
                                                                r"\(4, 16, 1, 128\): the cache is \[P, page, Hkv, 48\]$"),
    "quantized": (64, (4, 16, 1, 128), jnp.int8, r"a lane-packed cache \(k_pages \(4, 16, 1, 128\): 2 heads of 64 a "
                                                 r"row\) cannot be quantized"),
    "heads": (64, (4, 16, 3, 128), jnp.float32, r"q heads \(4\) must be a multiple of the KV heads of k_pages \(6\)"),
}


@pytest.mark.parametrize("name", PACKED_BAD)
def test_lane_packed_bad_input_errors_name_the_argument(load_kernel, name):
    k = load_kernel("paged_attention")
    d, shape, dtype, message = PACKED_BAD[name]
    q = jnp.ones((3, 4, d), jnp.float32)
    cache = jnp.zeros(shape, dtype)
    scales = dict(k_scale=jnp.ones((2,), jnp.float32), v_scale=jnp.ones((2,), jnp.float32)) if dtype == jnp.int8 else {}
    meta = jnp.array([3], jnp.int32), jnp.array([[0]], jnp.int32), jnp.array([0, 3], jnp.int32)
    with pytest.raises(ValueError, match=message):
        k.pallas.ragged_paged_attention(q, cache, cache, *meta, **scales)
    if name != "heads":  # new_k [T, Hkv, D] must be the cache's heads
        with pytest.raises(ValueError, match=message.replace("of q", "of new_k")):
            k.pallas.write_kv(cache, cache, q[:, :2], q[:, :2], *meta, **scales)
    with pytest.raises(ValueError, match=message):  # the torch op checks on the host too
        k.ragged_paged_attention(*_torch(q, cache, cache, *meta), **dict(zip(scales, _torch(*scales.values()))))


# --------------------------------------------------------------------------- zero sizes, default scale

ZERO = {  # name: (q rows, kv_lens, page_indices, cu_q_lens, num_pages); the result is zeros [T, Hq, D]
    "no query rows": (0, [5, 0], [[0, 1], [2, -1]], [0, 0, 0], 4),
    "no sequences": (3, [], np.zeros((0, 2)), [0], 4),
    "empty page table": (3, [0, 0], np.zeros((2, 0)), [0, 0, 0], 4),
    "empty cache": (3, [0], [[-1]], [0, 0], 0),
}


@pytest.mark.parametrize("name", ZERO)
def test_zero_sizes_give_zeros(load_kernel, name):
    k = load_kernel("paged_attention")
    t, lens, table, cu, num_pages = ZERO[name]
    q = jnp.ones((t, 4, 64), jnp.float32)
    kp = jnp.ones((num_pages, 16, 2, 64), jnp.float32)
    meta = jnp.array(lens, jnp.int32), jnp.array(table, jnp.int32), jnp.array(cu, jnp.int32)
    with interpret("fast"):
        out = k.pallas.ragged_paged_attention(q, kp, kp, *meta)
        ko, vo = k.pallas.write_kv(kp, kp, q[:, :2], q[:, :2], *meta)
    assert out.shape == q.shape and not np.asarray(out).any()
    np.testing.assert_array_equal(np.asarray(ko), np.asarray(kp))  # nothing to write
    tq, tkp, tlens, ttable, tcu = _torch(q, kp, *meta)
    tout = k.ragged_paged_attention(tq, tkp, tkp, tlens, ttable, tcu)
    assert tuple(tout.shape) == q.shape and not tout.any()
    k.write_kv_(tkp, tkp.clone(), tq[:, :2], tq[:, :2], tlens, ttable, tcu)
    np.testing.assert_array_equal(tkp.numpy(), np.asarray(kp))


def test_default_scale_is_head_dim_rsqrt(load_kernel):
    """``scale`` left out means head_dim**-0.5 (was 1.0). The torch op's schema default is the JAX
    function's (0.0: resolved to head_dim**-0.5 inside it), so this covers both."""
    k = load_kernel("paged_attention")
    args = make_case([2, 1], [9, 30], d=64, extra_rows=1)
    ref = k.pallas.reference(*args[:6], scale=64 ** -0.5)
    np.testing.assert_allclose(k.ragged_paged_attention(*_torch(*args[:6]), block_q=8).numpy(), ref, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- bad input

BAD = {
    "page index past the pool": (lambda a: dict(page_indices=a["page_indices"].at[1, 1].set(1000)),
                                 r"page_indices\[1, 1\]=1000 is out of range \[0, \d+\)"),
    "negative page index": (lambda a: dict(page_indices=a["page_indices"].at[0, 0].set(-1)),
                            r"page_indices\[0, 0\]=-1 is out of range"),
    "kv_lens beyond the pages": (lambda a: dict(kv_lens=a["kv_lens"].at[2].set(10_000)),
                                 r"kv_lens\[2\]=10000 exceeds what its pages hold"),
    "non-monotone cu_q_lens": (lambda a: dict(cu_q_lens=jnp.array([0, 2, 1, 6], jnp.int32)),
                               r"cu_q_lens must be non-decreasing"),
    "cu_q_lens past T": (lambda a: dict(cu_q_lens=jnp.array([0, 2, 3, 60], jnp.int32)),
                         r"cu_q_lens\[-1\]=60 exceeds the number of query rows"),
    "more queries than kv": (lambda a: dict(cu_q_lens=jnp.array([0, 2, 3, 9], jnp.int32)),
                             r"sequence 2 has 6 new queries but kv_lens\[2\]=5"),
    "head mismatch": (lambda a: dict(q=jnp.zeros((9, 3, 128))), r"multiple of the KV heads"),
    "dtype mismatch": (lambda a: dict(q=a["q"].astype(jnp.bfloat16)), r"must share a dtype"),
    "kv_lens shape": (lambda a: dict(kv_lens=jnp.zeros((2,), jnp.int32)), r"kv_lens must have shape \(3,\)"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_errors_name_the_argument(load_kernel, name):
    k = load_kernel("paged_attention")
    change, message = BAD[name]
    q, kp, vp, lens, table, cu, _ = make_case([2, 1, 3], [9, 30, 5])
    a = dict(q=q, k_pages=kp, v_pages=vp, kv_lens=lens, page_indices=table, cu_q_lens=cu)
    a.update(change(a))
    with pytest.raises((ValueError, TypeError), match=message):
        k.pallas.ragged_paged_attention(**a)
    t = {n: torch.from_dlpack(np.asarray(v.astype(jnp.float32) if v.dtype == jnp.bfloat16 else v).copy())
         for n, v in a.items()}
    if a["q"].dtype == jnp.bfloat16:
        t["q"] = t["q"].bfloat16()
    with pytest.raises((ValueError, TypeError), match=message):  # the torch op checks on the host too
        k.ragged_paged_attention(**t)


# --------------------------------------------------------------------------- ahead-of-time TPU compile

@pytest.mark.tpu_compile
@pytest.mark.parametrize("name", ["decode 64 seqs x 8k bf16 page 128", "mixed 256 seqs 32k bf16 page 16"])
def test_compiles_for_tpu(load_kernel, name):
    import importlib.util
    from pathlib import Path

    k = load_kernel("paged_attention")
    path = Path(__file__).parents[1] / "compile_matrix.py"
    spec = importlib.util.spec_from_file_location("_paged_matrix", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    chip = {"decode": "v6e", "mixed": "tpu7x"}[name.split()[0]]
    (config,) = [c for c in mod.configs(k) if c.name == name and chip in c.chips]
    result = compile_for_tpu(config.fn, *config.args, chip=chip, **config.static)
    assert result.ok, result.error


def test_write_kv_is_in_place_when_the_cache_is_donated(load_kernel):
    k = load_kernel("paged_attention")
    kp, vp = jnp.zeros((8, 16, 2, 128)), jnp.ones((8, 16, 2, 128))
    ptr = kp.unsafe_buffer_pointer(), vp.unsafe_buffer_pointer()
    with interpret("fast"):
        ko, vo = jax.jit(k.pallas.write_kv, donate_argnums=(0, 1))(
            kp, vp, jnp.full((3, 2, 128), 5.0), jnp.full((3, 2, 128), 7.0), jnp.array([3], jnp.int32),
            jnp.array([[2]], jnp.int32), jnp.array([0, 3], jnp.int32))
    assert (ko.unsafe_buffer_pointer(), vo.unsafe_buffer_pointer()) == ptr  # aliased: no copy of the cache
    assert float(ko[2, 0, 0, 0]) == 5.0 and float(vo[2, 2, 0, 0]) == 7.0 and float(ko[3, 0, 0, 0]) == 0.0
