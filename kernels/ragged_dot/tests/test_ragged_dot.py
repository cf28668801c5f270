"""ragged_dot: numerics (interpret mode) against jax.lax.ragged_dot and a plain reference, gradients,
the torch op, the strict TPU interpreter, the DMA pattern, and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import pallas as pl

from pallas_hub.verify import interpret

HIGHEST = jax.lax.Precision.HIGHEST
# f32: the kernel and the references differ only in summation order over k (<= 256 here).
# bf16 inputs: products are exact in f32, so the same bound holds; a bf16 *output* adds one
# rounding: 2^-8 relative.
TOL = {("float32", "float32"): 1e-4, ("bfloat16", "float32"): 1e-4, ("bfloat16", "bfloat16"): 8e-3,
       ("float32", "bfloat16"): 8e-3}


def _inputs(m, k, n, sizes, transposed, dtype, seed=0):
    ka, kw = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(ka, (m, k), jnp.float32).astype(dtype)
    shape = (len(sizes), n, k) if transposed else (len(sizes), k, n)
    rhs = jax.random.normal(kw, shape, jnp.float32).astype(dtype)
    return lhs, rhs, jnp.array(sizes, jnp.int32)


def _lax(lhs, rhs, gs, transposed):
    w = jnp.swapaxes(rhs, 1, 2) if transposed else rhs
    return jax.lax.ragged_dot(lhs, w, gs, precision=HIGHEST, preferred_element_type=jnp.float32)


def _close(out, ref, tol):
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    scale = max(1.0, float(np.abs(ref).max()))
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * scale)


CASES = [  # m, k, n, group sizes, tile_m, tile_n
    pytest.param(300, 256, 384, [100, 0, 50, 30], 64, 128, id="m-not-tile-multiple,empty,sum<m"),
    pytest.param(256, 128, 256, [0, 256, 0], 32, 256, id="all-rows-one-group"),
    pytest.param(200, 128, 128, [200], 16, 128, id="g=1"),
    pytest.param(100, 128, 256, [10, 20], 32, 128, id="sum<m-tail-tiles"),
    pytest.param(64, 128, 128, [0, 0, 0, 0], 16, 128, id="all-empty"),
    pytest.param(523, 128, 384, [7, 0, 0, 130, 1, 200, 0, 9], 0, 0, id="auto-tiles,many-groups"),
    pytest.param(40, 256, 640, [3, 1, 0, 5, 2, 0, 0, 4, 1, 6], 16, 0, id="decode-like,few-rows-per-group"),
]


DTYPE_CASES = [  # every case in f32; the mixed-precision combinations on a representative few
    pytest.param(*c.values, "float32", "float32", id=c.id + "-f32") for c in CASES] + [
    pytest.param(*CASES[i].values, dt, odt, id=CASES[i].id + f"-{dt}-{odt}")
    for i in (0, 3, 6) for dt, odt in (("bfloat16", "float32"), ("bfloat16", "bfloat16"))]


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
@pytest.mark.parametrize("m,k,n,sizes,tm,tn,dtype,out_dtype", DTYPE_CASES)
def test_matches_lax_ragged_dot_and_reference(load_kernel, m, k, n, sizes, tm, tn, transposed, dtype, out_dtype):
    P = load_kernel("ragged_dot").pallas
    lhs, rhs, gs = _inputs(m, k, n, sizes, transposed, dtype)
    with interpret("fast"):
        out = P.ragged_dot(lhs, rhs, gs, rhs_transposed=transposed, out_dtype=out_dtype, tile_m=tm, tile_n=tn)
    assert out.shape == (m, n) and out.dtype == jnp.dtype(out_dtype)
    tol = TOL[(dtype, out_dtype)]
    _close(out, _lax(lhs, rhs, gs, transposed), tol)
    _close(out, P.reference(lhs, rhs, gs, transposed, jnp.float32), tol)
    assert not np.asarray(out, np.float32)[int(sum(sizes)):].any()  # rows past sum(group_sizes) are zero


@pytest.mark.parametrize("trials", [pytest.param(3, id="3"), pytest.param(24, id="24", marks=pytest.mark.slow)])
def test_random_sweep(load_kernel, trials):
    """Random group sizes (often empty, sometimes all in one group) over random shapes, f32."""
    P = load_kernel("ragged_dot").pallas
    rng = np.random.default_rng(1)
    for trial in range(trials):
        g = int(rng.integers(1, 9))
        m = int(rng.integers(1, 400))
        sizes = rng.multinomial(int(rng.integers(0, m + 1)), rng.dirichlet(np.full(g, 0.3)))
        k, n = 128 * int(rng.integers(1, 3)), 128 * int(rng.integers(1, 4))
        transposed = bool(trial % 2)
        lhs, rhs, gs = _inputs(m, k, n, sizes.tolist(), transposed, "float32", seed=trial)
        with interpret("fast"):
            out = P.ragged_dot(lhs, rhs, gs, rhs_transposed=transposed, tile_m=int(rng.choice([8, 16, 64])))
        _close(out, _lax(lhs, rhs, gs, transposed), 1e-4)


def test_traced_group_sizes_under_jit_do_not_retrace(load_kernel):
    P = load_kernel("ragged_dot").pallas
    lhs, rhs, _ = _inputs(96, 128, 256, [0] * 4, False, "float32")
    traces = []

    @jax.jit
    def f(a, w, gs):
        traces.append(1)
        return P.ragged_dot(a, w, gs, tile_m=32)

    with interpret("fast"):
        for sizes in ([10, 0, 50, 36], [0, 0, 0, 96], [1, 2, 3, 4]):
            gs = jnp.array(sizes, jnp.int32)
            _close(f(lhs, rhs, gs), _lax(lhs, rhs, gs, False), 1e-4)
    assert len(traces) == 1


@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_gradients_match_jax_grad_of_reference(load_kernel, transposed):
    P = load_kernel("ragged_dot").pallas
    lhs, rhs, gs = _inputs(150, 128, 256, [40, 0, 70, 0, 13], transposed, "float32")
    proj = jax.random.normal(jax.random.key(7), (150, 256))

    def loss(fn):
        return lambda a, w: (fn(a, w) * proj).sum()

    with interpret("fast"):
        da, dw = jax.grad(loss(lambda a, w: P.ragged_dot(a, w, gs, rhs_transposed=transposed, tile_m=32)), (0, 1))(lhs, rhs)
    ra, rw = jax.grad(loss(lambda a, w: P.reference(a, w, gs, transposed, jnp.float32)), (0, 1))(lhs, rhs)
    _close(da, ra, 1e-4)
    _close(dw, rw, 1e-4)
    assert not np.asarray(dw)[[1, 3]].any()  # empty groups get exactly zero gradient
    assert not np.asarray(da)[123:].any()  # rows past sum(group_sizes) do not contribute


def test_bf16_gradients(load_kernel):
    P = load_kernel("ragged_dot").pallas
    lhs, rhs, gs = _inputs(64, 128, 128, [30, 0, 20], False, "bfloat16")
    with interpret("fast"):
        da, dw = jax.grad(lambda a, w: P.ragged_dot(a, w, gs, out_dtype="float32", tile_m=16).sum(), (0, 1))(lhs, rhs)
    ra, rw = jax.grad(lambda a, w: P.reference(a, w, gs, False, jnp.float32).sum(), (0, 1))(
        lhs.astype(jnp.float32), rhs.astype(jnp.float32))
    assert da.dtype == jnp.bfloat16 and dw.dtype == jnp.bfloat16
    _close(da, ra, 8e-3)  # one bf16 rounding of the gradient (dout of ones is exact in bf16)
    _close(dw, rw, 8e-3)


# --------------------------------------------------------------------------- torch op

@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_torch_op_forward_backward(load_kernel, transposed):
    kern = load_kernel("ragged_dot")
    torch.manual_seed(0)
    sizes = torch.tensor([20, 0, 33, 7], dtype=torch.int64)
    lhs = torch.randn(70, 128, requires_grad=True)
    rhs = torch.randn(4, 256, 128, requires_grad=True) if transposed else torch.randn(4, 128, 256, requires_grad=True)
    out = kern.ragged_dot(lhs, rhs, sizes, transposed)
    w = rhs.transpose(1, 2) if transposed else rhs
    bounds = torch.cumsum(sizes, 0).tolist()
    ref = torch.zeros(70, 256)
    for i, (end, size) in enumerate(zip(bounds, sizes.tolist())):
        ref[end - size:end] = lhs[end - size:end] @ w[i]
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    g = torch.randn(70, 256)
    (out * g).sum().backward()
    ga, gw = torch.autograd.grad((ref * g).sum(), (lhs, rhs))
    torch.testing.assert_close(lhs.grad, ga, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rhs.grad, gw, rtol=1e-4, atol=1e-4)


def test_torch_opcheck(load_kernel):
    kern = load_kernel("ragged_dot")
    lhs, rhs = torch.randn(40, 128), torch.randn(3, 128, 128)
    sizes = torch.tensor([10, 0, 25], dtype=torch.int32)
    torch.library.opcheck(kern.ragged_dot, (lhs, rhs, sizes, False, "float32", 16, 128),
                          test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------- strict interpreter

@pytest.mark.strict_interpret
@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_strict_interpreter_forward_and_backward(load_kernel, transposed):
    """OOB reads raise, unwritten output is NaN, races are detected: a partial last m-tile, empty
    groups, tail rows and a group straddling tiles."""
    P = load_kernel("ragged_dot").pallas
    lhs, rhs, gs = _inputs(100, 128, 256, [40, 0, 33, 0], transposed, "float32")
    with interpret("strict"):
        out = P.ragged_dot(lhs, rhs, gs, rhs_transposed=transposed, tile_m=32, tile_n=128)
        da, dw = jax.grad(lambda a, w: P.ragged_dot(a, w, gs, rhs_transposed=transposed, tile_m=32).sum(), (0, 1))(lhs, rhs)
    assert not np.isnan(np.asarray(out)).any()
    _close(out, _lax(lhs, rhs, gs, transposed), 1e-4)
    ra, rw = jax.grad(lambda a, w: P.reference(a, w, gs, transposed, jnp.float32).sum(), (0, 1))(lhs, rhs)
    _close(da, ra, 1e-4)
    _close(dw, rw, 1e-4)


@pytest.mark.strict_interpret
def test_strict_interpreter_never_reads_out_of_bounds_on_bad_device_values(load_kernel):
    """Negative sizes and sizes summing past m cannot be checked on device under jit: the kernel
    clamps them (negatives count 0, the running sum stops at m) instead of reading past lhs."""
    P = load_kernel("ragged_dot").pallas
    lhs, rhs, _ = _inputs(48, 128, 128, [0, 0, 0], False, "float32")
    gs = jnp.array([-5, 30, 1000], jnp.int32)
    with interpret("strict"):
        out = jax.jit(lambda a, w, g: P.ragged_dot(a, w, g, tile_m=16))(lhs, rhs, gs)
    clamped = jnp.array([0, 30, 18], jnp.int32)
    _close(out, _lax(lhs, rhs, clamped, False), 1e-4)


# --------------------------------------------------------------------------- DMA pattern

def _fetch_trace(P, sizes, m, tm):
    meta = P.run_metadata(P.rows_of_groups(jnp.array(sizes, jnp.int32), m), tm, len(sizes))
    n_items = int(meta[-1])
    return [int(x) for x in meta[1][:n_items]], [int(x) for x in meta[3][:n_items]]


def test_weights_are_fetched_once_per_active_group_and_never_for_empty_ones(load_kernel):
    """The rhs index map is fetch_group[i]; Pallas DMAs a block only when its index changes
    between consecutive steps, so the fetched groups are the runs of fetch_group."""
    P = load_kernel("ragged_dot").pallas
    sizes = [0, 70, 0, 0, 5, 200, 0, 1]  # groups straddling several 32-row tiles, empties, tail
    groups, fetch = _fetch_trace(P, sizes, 300, 32)
    runs = [g for i, g in enumerate(fetch) if i == 0 or fetch[i - 1] != g]
    assert runs == [1, 4, 5, 7]  # each active group once, in order; empty groups never
    assert groups.count(8) == -(-300 // 32) - 276 // 32  # rows 276-299 in no group: one zero-writing item a tile


@pytest.mark.parametrize("m,tm,g,seed", [(300, 32, 8, 0), (64, 64, 128, 1), (97, 16, 5, 2), (40, 8, 3, 3)])
def test_run_metadata_items_are_the_maximal_runs_of_tile_and_group(load_kernel, m, tm, g, seed):
    """Against a plain host walk over the rows: items cover the rows in order, each a maximal run of one
    tile and one group; rows of no group (g, or past it) form items of group g that fetch nothing new;
    decode-sized (64 rows, 128 groups: more item slots than rows); a group change every 3 rows."""
    P = load_kernel("ragged_dot").pallas
    rng = np.random.default_rng(seed)
    rows = np.sort(rng.integers(0, g + 1, m))
    if seed == 2:
        rows[-3:] = [g, g + 4, g + 9]  # past g: no group
    if seed == 3:
        rows = np.minimum(np.arange(m) // 3, g)  # a new group every 3 rows, across 8-row tiles
    bounds, item_group, item_tile, fetch_group, fetch_tile, n = (np.asarray(a) for a in P.run_metadata(
        jnp.asarray(rows, jnp.int32), tm, g))
    key = np.where((rows >= 0) & (rows < g), rows, g)
    want = [r for r in range(m) if r % tm == 0 or key[r] != key[r - 1]]
    assert int(n) == len(want) and list(bounds[:n]) == want and set(bounds[n:]) == {m}
    assert len(item_group) >= n
    last = (0, 0)
    for i in range(int(n)):
        lo, hi = bounds[i], bounds[i + 1]
        assert set(key[lo:hi]) == {item_group[i]} and set(np.arange(lo, hi) // tm) == {item_tile[i]}
        if item_group[i] < g:
            last = (item_group[i], item_tile[i])
        assert (fetch_group[i], fetch_tile[i]) == last
    # windows: runs of up to tm rows of one group from the group's first row, wherever the tiles lie
    bounds, item_group, item_row, fetch_group, fetch_item, n = (np.asarray(a) for a in P.run_metadata(
        jnp.asarray(rows, jnp.int32), tm, g, windows=4))
    first = {k: int(np.argmax(key == k)) for k in set(key)}
    want = [r for r in range(m) if (r - first[key[r]]) % tm == 0]
    assert int(n) == len(want) and list(bounds[:n]) == want and set(bounds[n:]) == {m}
    assert len(item_group) >= n
    last = (0, 0)
    for i in range(int(n)):
        lo, hi = bounds[i], bounds[i + 1]
        assert set(key[lo:hi]) == {item_group[i]} and 0 < hi - lo <= tm and item_row[i] == lo // 4 * 4
        if item_group[i] < g:
            last = (item_group[i], i)
        assert (fetch_group[i], fetch_item[i]) == last


@pytest.mark.parametrize("sizes,m,tm", [([0, 70, 0, 0, 5, 200, 0, 1], 300, 32), ([0, 0, 0], 64, 16),
                                         ([-5, 30, 1000], 48, 16), ([3] * 40, 130, 8), ([64], 64, 64)])
def test_group_metadata_items_are_each_groups_tiles_and_one_per_empty_group(load_kernel, sizes, m, tm):
    """tgmm's items against a plain host walk over the groups (sizes clamped as the kernel clamps them):
    a non-empty group's items are the tiles its rows touch, in order; an empty group (or one past m)
    has one item, which fetches the blocks of the latest item with data (nothing new)."""
    P = load_kernel("ragged_dot").pallas
    offsets, item_group, item_tile, fetch_group, fetch_tile, n = (np.asarray(a) for a in P.group_metadata(
        jnp.array(sizes, jnp.int32), m, tm))
    ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
    starts = np.concatenate([[0], ends[:-1]])
    assert list(offsets) == [0] + list(ends)
    want, last, fetch = [], (0, 0), []
    for e, (lo, hi) in enumerate(zip(starts, ends)):
        tiles = range(lo // tm, (hi - 1) // tm + 1) if hi > lo else [None]
        for t in tiles:
            want.append((e, t))
            last = (e, t) if t is not None else last
            fetch.append(last)
    assert int(n) == len(want) and len(item_group) >= int(n)
    for i, ((e, t), f) in enumerate(zip(want, fetch)):
        assert item_group[i] == e and (t is None or item_tile[i] == t)
        assert (fetch_group[i], fetch_tile[i]) == f
    assert 0 <= item_tile.min() and item_tile.max() < -(-m // tm)  # slots past the items: valid tiles


def test_all_empty_groups_items_are_tail_only(load_kernel):
    P = load_kernel("ragged_dot").pallas
    groups, fetch = _fetch_trace(P, [0, 0, 0], 64, 16)
    assert groups == [3, 3, 3, 3] and set(fetch) == {0}  # no compute; one block index for the whole grid


@pytest.mark.parametrize("chip", ["v5e", "v6e", "tpu7x"])
@pytest.mark.parametrize("m,n_weights", [(256, 1), (1024, 1), (256, 3), (8192, 2)])
def test_tiling_counts_the_weights_an_overhanging_block_moves(load_kernel, chip, m, n_weights):
    """GPT-OSS's 2880 columns (no 128-multiple divides them): a last block overhanging n moves its whole
    width of weights, so the chosen width reads at most 1.1x them where some width fitting VMEM does
    (blocks of 2432, once TPU7x's choice for the down projection, read 1.69x)."""
    P = load_kernel("ragged_dot").pallas
    n = 2880
    tm, tn = P.choose_gmm_tiling(m, 2880, n, 32, in_dtype="bfloat16", out_dtype="bfloat16", chip=chip,
                                 n_weights=n_weights, lane_n=True, divisors_only=False)
    assert tn % 128 == 0 or tn == n
    assert -(-n // tn) * tn <= 1.1 * n, (tm, tn)


# --------------------------------------------------------------------------- bad input

def test_bad_input_is_refused_with_clear_errors(load_kernel):
    P = load_kernel("ragged_dot").pallas
    lhs, rhs, gs = _inputs(32, 128, 128, [10, 10], False, "float32")
    with pytest.raises(ValueError, match="non-negative"):
        P.ragged_dot(lhs, rhs, jnp.array([-1, 5], jnp.int32))
    with pytest.raises(ValueError, match="sum to 40, more than the 32 rows"):
        P.ragged_dot(lhs, rhs, jnp.array([20, 20], jnp.int32))
    with pytest.raises(ValueError, match=r"one entry per group of rhs \(2\), got 3"):
        P.ragged_dot(lhs, rhs, jnp.array([1, 2, 3], jnp.int32))
    with pytest.raises(TypeError, match="group_sizes must have dtype one of int32, int64, .*, got float32"):
        P.ragged_dot(lhs, rhs, gs.astype(jnp.float32))
    with pytest.raises(ValueError, match="contraction mismatch"):
        P.ragged_dot(lhs[:, :64], rhs, gs)
    with pytest.raises(ValueError, match="contraction mismatch"):
        P.ragged_dot(lhs, jnp.zeros((2, 128, 64)), gs, rhs_transposed=True)
    with pytest.raises(TypeError, match="lhs must have dtype float32 or bfloat16, got float16"):
        P.ragged_dot(lhs.astype(jnp.float16), rhs, gs)
    with pytest.raises(TypeError, match="same dtype"):
        P.ragged_dot(lhs.astype(jnp.bfloat16), rhs, gs)
    with pytest.raises(TypeError, match="out_dtype"):
        P.ragged_dot(lhs, rhs, gs, out_dtype="int8")
    with pytest.raises(ValueError, match="rhs must have 3 dimensions"):
        P.ragged_dot(lhs, rhs[0], gs)
    with pytest.raises(ValueError, match="tile_m must be 0"):
        P.ragged_dot(lhs, rhs, gs, tile_m=12)
    with pytest.raises(ValueError, match=r"tile_m must be 0 \(automatic\) or a positive multiple of 16 \(lhs is bfloat16\)"):
        P.ragged_dot(lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), gs, tile_m=8)  # bf16 packs 16 rows a tile


def test_torch_bad_input(load_kernel):
    kern = load_kernel("ragged_dot")
    lhs, rhs = torch.randn(32, 128), torch.randn(2, 128, 128)
    with pytest.raises(ValueError, match="non-negative"):
        kern.ragged_dot(lhs, rhs, torch.tensor([-1, 3]))
    with pytest.raises(ValueError, match="more than the 32 rows"):
        kern.ragged_dot(lhs, rhs, torch.tensor([30, 3]))
    with pytest.raises(TypeError, match="group_sizes must have dtype"):
        kern.ragged_dot(lhs, rhs, torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError, match="contraction mismatch"):
        kern.ragged_dot(lhs, rhs[:, :, :64], torch.tensor([1, 3]), True)


# --------------------------------------------------------------------------- zero sizes, dtypes, array types

ZERO = [  # m, k, n, group sizes, rhs_transposed: jax.lax.ragged_dot's result, no kernel crash
    pytest.param(0, 128, 128, [0, 0], False, id="m=0"),
    pytest.param(12, 0, 128, [5, 7], False, id="k=0"),
    pytest.param(12, 0, 128, [5, 7], True, id="k=0-transposed"),
    pytest.param(12, 128, 0, [5, 7], False, id="n=0"),
    pytest.param(12, 128, 128, [], False, id="no-groups"),
    pytest.param(0, 0, 0, [], True, id="everything-0"),
]


@pytest.mark.parametrize("m,k,n,sizes,transposed", ZERO)
def test_zero_sizes_match_lax_ragged_dot(load_kernel, m, k, n, sizes, transposed):
    kern = load_kernel("ragged_dot")
    lhs, rhs, gs = _inputs(m, k, n, sizes, transposed, "float32")
    ref = _lax(lhs, rhs, gs, transposed)
    with interpret("fast"):
        out, vjp = jax.vjp(lambda a, w: kern.pallas.ragged_dot(a, w, gs, rhs_transposed=transposed), lhs, rhs)
        da, dw = vjp(jnp.ones_like(out))
    assert out.shape == ref.shape == (m, n) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))  # all zeros (or empty)
    assert da.shape == lhs.shape and dw.shape == rhs.shape and not np.asarray(da).any() and not np.asarray(dw).any()
    # the torch op, forward and autograd backward, gives the same
    a = torch.from_numpy(np.array(lhs)).requires_grad_()
    w = torch.from_numpy(np.array(rhs)).requires_grad_()
    t = kern.ragged_dot(a, w, torch.tensor(sizes, dtype=torch.int64), transposed)
    assert tuple(t.shape) == (m, n) and not t.any()
    t.sum().backward()
    assert a.grad.shape == a.shape and w.grad.shape == w.shape and not a.grad.any() and not w.grad.any()


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32"])
def test_group_sizes_take_every_integer_dtype_as_lax(load_kernel, dtype):
    kern = load_kernel("ragged_dot")
    lhs, rhs, _ = _inputs(40, 128, 128, [0, 0, 0], False, "float32")
    gs = jnp.array([10, 0, 25], dtype)
    ref = _lax(lhs, rhs, gs, False)  # jax.lax.ragged_dot takes any integer group_sizes
    with interpret("fast"):
        _close(kern.pallas.ragged_dot(lhs, rhs, gs, tile_m=16), ref, 1e-4)
    if dtype == "uint32":  # the torch op too
        out = kern.ragged_dot(torch.from_numpy(np.array(lhs)), torch.from_numpy(np.array(rhs)),
                              torch.tensor([10, 0, 25], dtype=getattr(torch, dtype)))
        _close(out.numpy(), ref, 1e-4)
    with pytest.raises(ValueError, match="sum to 41, more than the 40 rows"):  # host values of every dtype checked
        kern.pallas.ragged_dot(lhs, rhs, jnp.array([10, 6, 25], dtype))
    with pytest.raises(TypeError, match="group_sizes must have dtype .*, got bool"):
        kern.pallas.ragged_dot(lhs, rhs, jnp.array([True, False, True]))


def test_quantized_arrays_are_refused_by_name(load_kernel):
    """A qwix QArray has .shape and .dtype, so it used to pass validation and fail deep in pallas_call."""
    qwix = pytest.importorskip("qwix")
    kern = load_kernel("ragged_dot")
    lhs, rhs, gs = _inputs(16, 128, 128, [8, 8], False, "float32")
    q = qwix.quantize(rhs, jnp.int8, channelwise_axes=(0, 2))
    with pytest.raises(TypeError, match=r"rhs is a qwix QArray; .*jax.Array or torch.Tensor \(quantized arrays are "
                                        r"not supported yet"):
        kern.pallas.ragged_dot(lhs, q, gs)
    with pytest.raises(TypeError, match="lhs is a qwix QArray"):
        kern.pallas.ragged_dot(qwix.quantize(lhs, jnp.int8, channelwise_axes=(0,)), rhs, gs)
    with pytest.raises(TypeError, match="gate_up_proj is a qwix QArray"):
        kern.experts.experts(lhs, jnp.zeros((16, 1), jnp.int32), jnp.ones((16, 1)),
                             qwix.quantize(jnp.ones((2, 256, 128)), jnp.int8, channelwise_axes=(0, 1)),
                             jnp.ones((2, 128, 128)))


@pytest.mark.parametrize("t,top_k,e", [(0, 2, 4), (5, 0, 4), (5, 2, 0)], ids=["no-tokens", "top_k=0", "no-experts"])
def test_experts_op_zero_sizes_give_zeros(load_kernel, t, top_k, e):
    """No tokens -> [0, H]; top_k = 0 or no (local) experts: every token's output is an empty sum, 0."""
    kern = load_kernel("ragged_dot")
    h, i = 128, 128
    x = torch.randn(t, h)
    idx = torch.zeros(t, top_k, dtype=torch.int64) + e  # with no experts, ids are expert-parallel sentinels
    w = torch.ones(t, top_k)
    out = kern.experts_op(x, idx, w, torch.randn(e, 2 * i, h), torch.randn(e, h, i), None, None, "silu")
    assert tuple(out.shape) == (t, h) and out.dtype == x.dtype and not out.any()
    with pytest.raises(ValueError, match="intermediate size is 0"):
        kern.experts_op(x, idx, w, torch.randn(4, 0, h), torch.randn(4, h, 0), None, None, "silu")


# --------------------------------------------------------------------------- tokamax anchor

@pytest.mark.parametrize("transposed", [False, True], ids=["kn", "nk"])
def test_agrees_with_tokamax_mosaic_anchor(load_kernel, transposed):
    """tokamax 0.0.12's Mosaic TPU kernel, interpreted on CPU (see tokamax_anchor.py)."""
    kern = load_kernel("ragged_dot")
    from importlib import import_module

    anchor = import_module(kern.__name__ + ".tokamax_anchor")
    lhs, rhs, gs = _inputs(256, 256, 384, [100, 0, 50, 30, 0], transposed, "bfloat16")
    with interpret("fast"):
        ours = kern.pallas.ragged_dot(lhs, rhs, gs, rhs_transposed=transposed, out_dtype="float32")
        theirs = anchor.ragged_dot(lhs, rhs, gs, rhs_transposed=transposed, out_dtype=jnp.float32)
    _close(ours, theirs, 1e-4)
    assert not np.asarray(theirs)[180:].any()  # the wrapper zeroes the rows tokamax leaves uninitialised


def test_experts_op_tokamax_implementation_matches_pallas(load_kernel):
    kern = load_kernel("ragged_dot")
    torch.manual_seed(0)
    t, h, e, k, i = 24, 128, 4, 2, 128
    x = torch.randn(t, h)
    idx = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
    idx[0, 0] = e  # one expert-parallel sentinel
    w = torch.softmax(torch.randn(t, k), -1)
    gu, dn = 0.1 * torch.randn(e, 2 * i, h), 0.1 * torch.randn(e, h, i)
    ours = kern.experts_op(x, idx, w, gu, dn, None, None, "silu")
    theirs = kern.experts_op(x, idx, w, gu, dn, None, None, "silu", implementation="tokamax")
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- fused expert MLP

def _mlp_reference(x, gu, dn, sizes):
    """Per group: down(silu(x @ gate) * (x @ up)), transformers' [E, 2I, H] / [E, H, I] layout."""
    i = dn.shape[2]
    out = jnp.zeros((x.shape[0], dn.shape[1]), jnp.float32)
    start = 0
    for g, n in enumerate(sizes):
        rows = x[start:start + n].astype(jnp.float32)
        hid = jax.nn.silu(rows @ gu[g, :i].T) * (rows @ gu[g, i:].T)
        out = out.at[start:start + n].set(hid @ dn[g].T)
        start += n
    return out


@pytest.mark.parametrize("mode,i,down_t,tm,chunk,sizes", [
    ("fast", 128, True, 32, 16, [5, 0, 40, 0, 3, 9]),
    ("fast", 64, False, 32, 16, [5, 0, 40, 0, 3, 9]),
    # chunks from the 8-row tile of a group's first row, one pulled back inside the 64-row tile ([17, 60):
    # rows 16-47 then 32-63), a group starting in a tile's last 8 rows and crossing into the next
    ("fast", 128, True, 64, 32, [17, 43, 0, 3, 2, 30]),
    # prefill-sized groups in 256-row chunks of 512-row tiles (LONG_CHUNK_ROWS), a partial last tile
    ("fast", 128, True, 512, 256, [300, 0, 17, 260, 100]),
    # long layers' 1024-row tiles (LONG_TILE_ROWS): a group crossing the tile boundary at row 1024
    ("fast", 128, True, 1024, 256, [700, 0, 500, 13, 90]),
    # chunks fitted to the groups (FITTED_CHUNK_ROWS): 160 rows, not a power of two; groups of 130-150 rows
    ("fast", 128, True, 512, 160, [130, 0, 150, 141, 3, 136]),
    pytest.param("strict", 128, True, 32, 16, [5, 0, 40, 0, 3, 9], marks=pytest.mark.strict_interpret),
    pytest.param("strict", 128, True, 64, 32, [17, 43, 0, 3, 2, 30], marks=pytest.mark.strict_interpret)])
def test_fused_moe_matches_reference(load_kernel, mode, i, down_t, tm, chunk, sizes):
    """Groups straddling chunks of a tile, empty groups, tail rows, a partial tile; down in transformers'
    [E, H, I] layout or (down_t=False) the [E, I, H] view experts() takes when I is off the lane grid."""
    P = load_kernel("ragged_dot").pallas
    h, m = 128, max(120, sum(sizes) + 9)
    ks = jax.random.split(jax.random.key(3), 3)
    x = jax.random.normal(ks[0], (m, h))
    gu = 0.1 * jax.random.normal(ks[1], (len(sizes), 2 * i, h))
    dn = 0.1 * jax.random.normal(ks[2], (len(sizes), h, i))
    with interpret(mode):
        out = P.fused_moe(x, gu, dn if down_t else jnp.swapaxes(dn, 1, 2), jnp.array(sizes, jnp.int32), tm=tm,
                          chunk=chunk, down_transposed=down_t)
    assert not np.isnan(np.asarray(out)).any()
    _close(out, _mlp_reference(x, gu, dn, sizes), 1e-4)
    assert not np.asarray(out)[sum(sizes):].any()


def _gpt_oss_reference(x, gu, gu_b, dn, dn_b, sizes, alpha=1.702, limit=7.0):
    """Per group, GPT-OSS's expert MLP in f32: gate / up in alternate columns of x @ gu + b ([E, H, 2I]),
    clamped swiglu, (up + 1) * gate * sigmoid(alpha * gate), then @ dn ([E, I, H]) + b."""
    out = jnp.zeros((x.shape[0], dn.shape[2]), jnp.float32)
    start = 0
    for g, n in enumerate(sizes):
        y = x[start:start + n].astype(jnp.float32) @ gu[g] + gu_b[g]
        gate, up = jnp.minimum(y[:, 0::2], limit), jnp.clip(y[:, 1::2], -limit, limit)
        out = out.at[start:start + n].set(((up + 1) * gate * jax.nn.sigmoid(alpha * gate)) @ dn[g] + dn_b[g])
        start += n
    return out


@pytest.mark.parametrize("width", [128, 256, 384, 1920])  # one tile, whole tiles, 15 tiles
def test_deinterleave_splits_gate_and_up_lanes(load_kernel, width):
    """GPT-OSS's interleaved gate/up lanes, split in a kernel (interpret mode) by the XLU's transposes, exactly
    as strided slices, on values spanning f32's range, signs and zeros."""
    P = load_kernel("ragged_dot").pallas
    ks = jax.random.split(jax.random.key(9), 2)
    y = jax.random.normal(ks[0], (24, width)) * 10.0 ** jax.random.randint(ks[1], (24, width), -30, 31)
    y = y.at[3].set(0.0)

    def kernel(y_ref, g_ref, u_ref):
        g_ref[...], u_ref[...] = P._deinterleave(y_ref[...])
    half = jax.ShapeDtypeStruct((24, width // 2), jnp.float32)
    with interpret("fast"):
        gate, up = pl.pallas_call(kernel, out_shape=(half, half), interpret=True)(y)
    np.testing.assert_array_equal(np.asarray(gate), np.asarray(y[:, 0::2]))
    np.testing.assert_array_equal(np.asarray(up), np.asarray(y[:, 1::2]))


@pytest.mark.parametrize("width", [128, 256, 384, 1920])  # one tile, one gathering block, a narrower last one
@pytest.mark.parametrize("activation", ["swiglu_oai", "silu"])  # GPT-OSS's, and one unclamped
def test_activate_pairs_is_the_activation_of_the_split_lanes(load_kernel, width, activation):
    """Interleaved gate/up activated as pairs in a kernel (interpret mode: the roll, the activation in place,
    the MXU gathering the even lanes) is bit for bit the activation of the strided slices, rounded to bf16.
    Infinite up lanes (clamped to finite values by GPT-OSS's activation) and a NaN gate: rows whose activation
    is finite are exact, the others stay non-finite (where the down product would take them anyway)."""
    P = load_kernel("ragged_dot").pallas
    y = 4 * jax.random.normal(jax.random.key(width), (24, width))
    y = y.at[3].set(0.0).at[5, 7].set(jnp.inf).at[6, width - 1].set(-jnp.inf).at[7, 10].set(jnp.nan)

    def kernel(y_ref, o_ref):
        o_ref[...] = P._activate_pairs(y_ref[...], activation, 1.702, 7.0, jnp.bfloat16)
    with interpret("fast"):
        got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct((24, width // 2), jnp.bfloat16),
                             interpret=True)(y)
    want = np.asarray(P._activate(y[:, 0::2], y[:, 1::2], activation, 1.702, 7.0).astype(jnp.bfloat16), np.float32)
    got = np.asarray(got, np.float32)
    finite = np.isfinite(want).all(axis=1)
    assert finite[5] == finite[6] == (activation == "swiglu_oai") and not finite[7]
    np.testing.assert_array_equal(got[finite], want[finite])
    assert not np.isfinite(got[~finite]).all(axis=1).any()


def test_gpt_oss_activates_pairs_where_it_measured_faster(load_kernel):
    """activates_pairs: GPT-OSS-20B (32 experts, top-4) on v6e and TPU7x at every size; on v5e (a 128-wide
    MXU) at decode-sized groups only (64 tokens: 8 rows an expert), not at 2048 tokens. Only bf16 results
    in whole lane tiles take pairs."""
    P = load_kernel("ragged_dot").pallas
    assert all(P.activates_pairs(t * 4, 32, c) for t in (1, 2048, 8192) for c in ("v6e", "tpu7x"))
    assert P.activates_pairs(64 * 4, 32, "v5e") and not P.activates_pairs(2048 * 4, 32, "v5e")
    assert P._pairs(True, 1920, jnp.bfloat16, 8192, 32, "v6e", None)
    assert not P._pairs(True, 1920, jnp.float32, 8192, 32, "v6e", True)  # f32: the transposes, even if asked
    assert not P._pairs(True, 192, jnp.bfloat16, 8192, 32, "v6e", True)  # off the lane tiles
    assert not P._pairs(False, 1920, jnp.bfloat16, 8192, 32, "v6e", True)  # [gate; up] halves


@pytest.mark.parametrize("mode,layout,i,ti,tm,chunk,sizes", [
    # [gate; up] halves in transformers' layout, 2 tiles of 128 (down [E, H, I]: tiles in its lanes)
    ("fast", "halves", 256, 128, 64, 32, [17, 43, 0, 3, 2, 30]),
    # GPT-OSS: interleaved [E, H, 2I] with biases, 3 tiles of 64 units (128 interleaved lanes); a group
    # crossing the 64-row tile boundary, empty groups, tail rows; bf16, activated as pairs
    ("fast", "interleaved", 192, 64, 64, 32, [5, 0, 70, 0, 3, 9]),
    ("fast", "interleaved-xlu", 192, 64, 64, 32, [5, 0, 70, 0, 3, 9]),  # f32: split by transposes
    ("fast", "interleaved", 192, 192, 64, 32, [5, 0, 70, 0, 3, 9]),  # whole slabs, the same code
    # 3 tiles; the last group's second chunk pulled back over 8 rows of its first ([72, 104) then [96, 128)):
    # those rows carry each tile once
    ("fast", "halves", 384, 128, 128, 32, [20, 20, 19, 14, 0, 38]),
    pytest.param("strict", "interleaved", 192, 64, 32, 16, [5, 0, 40, 0, 3, 9], marks=pytest.mark.strict_interpret),
    pytest.param("strict", "interleaved-xlu", 192, 64, 32, 16, [5, 0, 40, 0, 3, 9], marks=pytest.mark.strict_interpret),
    pytest.param("strict", "halves", 256, 128, 64, 32, [17, 43, 0, 3, 2, 30], marks=pytest.mark.strict_interpret)])
def test_fused_moe_intermediate_tiles(load_kernel, mode, layout, i, ti, tm, chunk, sizes):
    """Experts too big for VMEM whole take their slabs ti intermediate units at a time, the down products
    summed in f32 scratch: against the f32 reference per group."""
    P = load_kernel("ragged_dot").pallas
    h, m = 128, max(120, sum(sizes) + 9)
    ks = jax.random.split(jax.random.key(5), 5)
    x = jax.random.normal(ks[0], (m, h))
    if layout == "halves":
        gu = 0.1 * jax.random.normal(ks[1], (len(sizes), 2 * i, h))
        dn = 0.1 * jax.random.normal(ks[2], (len(sizes), h, i))
        with interpret(mode):
            out = P.fused_moe(x, gu, dn, jnp.array(sizes, jnp.int32), tm=tm, chunk=chunk, ti=ti)
        ref = _mlp_reference(x, gu, dn, sizes)
    else:
        pairs = layout == "interleaved"
        dt = jnp.bfloat16 if pairs else jnp.float32
        x = x.astype(dt)
        gu = (0.1 * jax.random.normal(ks[1], (len(sizes), h, 2 * i))).astype(dt)
        dn = (0.1 * jax.random.normal(ks[2], (len(sizes), i, h))).astype(dt)
        gu_b, dn_b = ((0.5 * jax.random.normal(k, (len(sizes), n))).astype(dt) for k, n in ((ks[3], 2 * i), (ks[4], h)))
        with interpret(mode):
            out = P.fused_moe(x, gu, dn, jnp.array(sizes, jnp.int32), transposed=False, interleaved=True,
                              activation="swiglu_oai", gate_up_bias=gu_b, down_bias=dn_b, tm=tm, chunk=chunk, ti=ti,
                              pairs=pairs)
        f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
        ref = _gpt_oss_reference(f32(x), f32(gu), f32(gu_b), f32(dn), f32(dn_b), sizes)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    _close(out, ref, 1e-2 if out.dtype == jnp.bfloat16 else 1e-4)
    assert not np.asarray(out)[sum(sizes):].any()
    with pytest.raises(ValueError, match="ti=96 must divide"):
        P.fused_moe(x, gu, dn, jnp.array(sizes, jnp.int32), tm=tm, chunk=chunk, ti=96,
                    **({} if layout == "halves" else dict(transposed=False, interleaved=True)))


def _combined_reference(x, ids, w, expert, num_experts):
    """out[t] = sum over j of w[t, j] * expert(ids[t, j], x[t]) in f32, ids outside [0, E) skipped."""
    out = jnp.zeros(x.shape, jnp.float32)
    for e in range(num_experts):
        weight = jnp.where(ids == e, w.astype(jnp.float32), 0.0).sum(axis=1, keepdims=True)
        out = out + weight * expert(e, x.astype(jnp.float32))
    return out


@pytest.mark.parametrize("mode,layout,dtype,i,ti,tm,chunk,gather,t,tails", [
    # a token's rows from several groups, groups crossing the 32-row tile and the 16-row chunks, empty
    # groups, sentinel ids, an expert listed twice for one token (adjacent rows of a group); 111 rows, in no
    # whole native tiles: row tiles, unless gathered
    ("fast", "halves", "float32", 128, 128, 32, 16, False, 37, None),
    ("fast", "halves", "float32", 128, 128, 32, 16, True, 37, None),
    ("fast", "halves", "bfloat16", 128, 128, 32, 16, True, 37, None),  # rows rounded to bf16, weighted in f32
    ("fast", "halves", "float32", 256, 128, 64, 32, False, 37, None),  # intermediate tiles: added at the last one
    ("fast", "interleaved", "float32", 192, 64, 64, 32, True, 37, None),  # GPT-OSS: interleaved, biases, 3 tiles
    ("fast", "interleaved", "bfloat16", 192, 64, 64, 32, True, 37, None),  # and in bf16: activated as pairs
    ("fast", "interleaved", "float32", 192, 64, 128, 32, False, 37, None),  # one row tile, chunks pulled back in it
    ("fast", "interleaved", "float32", 192, 64, 16, 8, True, 37, None),  # groups split into 16-row windows, 3 tiles
    ("fast", "halves", "bfloat16", 128, 128, 16, 16, True, 37, None),  # whole slabs, 16-row windows
    ("fast", "halves", "float32", 128, 128, 128, 16, True, 37, None),  # all rows in one tile: no windows
    ("fast", "halves", "bfloat16", 128, 128, 64, 48, True, 37, None),  # chunks of 48 rows, 19 a group: added in a loop
    # 144 rows: windows of x's rows from a native tile, groups longer than a window, the last ones moved
    # back inside x
    ("fast", "halves", "float32", 128, 128, 32, 16, False, 48, None),
    ("fast", "halves", "bfloat16", 128, 128, 32, 16, False, 48, None),
    ("fast", "interleaved", "float32", 192, 64, 32, 16, False, 48, None),  # 3 tiles, reversed at odd windows
    # 48-row windows in 32-row chunks, tails of 8 and 16 rows: a window from a group's row 1-7 of a native
    # tile ends in 17-23 rows, a 32-row chunk pulled back 8 rows inside the window (those added once)
    ("fast", "halves", "float32", 128, 128, 48, 32, True, 100, (8, 16)),
    ("fast", "halves", "float32", 256, 128, 48, 32, True, 100, (8, 16)),  # and intermediate tiles: carried once too
    ("fast", "halves", "bfloat16", 128, 128, 32, 32, False, 48, (16,)),  # bf16 windows, the adds in the next dots
    pytest.param("strict", "halves", "bfloat16", 128, 128, 32, 16, True, 37, None, marks=pytest.mark.strict_interpret),
    pytest.param("strict", "interleaved", "float32", 192, 64, 32, 16, False, 37, None,
                 marks=pytest.mark.strict_interpret),
    pytest.param("strict", "halves", "bfloat16", 128, 128, 32, 16, False, 48, None, marks=pytest.mark.strict_interpret),
    pytest.param("strict", "halves", "bfloat16", 128, 128, 32, 32, False, 48, (16,), marks=pytest.mark.strict_interpret)])
def test_fused_moe_combines_rows_into_their_tokens(load_kernel, monkeypatch, mode, layout, dtype, i, ti, tm, chunk,
                                                   gather, t, tails):
    """With ``combine`` the fused MLP returns each token's weighted sum of its experts' rows (the MoE
    layer's unsort and top-k sum), with ``gather`` from the tokens' rows themselves: against an f32
    reference per token, from the routing sort's rows. Gathering, the sums leave VMEM in blocks of at
    most 16 rows (f32: 5 of 8 rows, bf16: 3 of 16; two DMAs in flight, a slot reused); else in one block."""
    P = load_kernel("ragged_dot").pallas
    if gather:
        monkeypatch.setattr(P, "MAX_WRITE_ROWS", 16)
    k, e, h = 3, 6, 128
    ks = jax.random.split(jax.random.key(6), 6)
    x = jax.random.normal(ks[0], (t, h)).astype(dtype)
    ids = np.array(jax.random.randint(ks[1], (t, k), 0, e))
    ids[ids == 4] = 5  # an empty group
    ids[3, :] = [2, 2, 0]  # expert 2 twice for token 3
    ids[5, 1] = e  # a sentinel: no expert
    w = jax.random.uniform(ks[2], (t, k))
    keys, order, tokens = P.sort_by_expert(jnp.asarray(ids), e)
    if layout == "halves":
        gu = (0.1 * jax.random.normal(ks[3], (e, 2 * i, h))).astype(dtype)
        dn = (0.1 * jax.random.normal(ks[4], (e, h, i))).astype(dtype)
        kw = {}

        def expert(g, xs):
            y = xs @ gu[g].astype(jnp.float32).T
            return (jax.nn.silu(y[:, :i]) * y[:, i:]) @ dn[g].astype(jnp.float32).T
    else:  # in bf16 activated as pairs, in f32 split by transposes
        gu = (0.1 * jax.random.normal(ks[3], (e, h, 2 * i))).astype(dtype)
        dn = (0.1 * jax.random.normal(ks[4], (e, i, h))).astype(dtype)
        gu_b, dn_b = ((0.5 * jax.random.normal(kk, (e, n))).astype(dtype)
                      for kk, n in zip(jax.random.split(ks[5]), (2 * i, h)))
        kw = dict(transposed=False, interleaved=True, activation="swiglu_oai", gate_up_bias=gu_b, down_bias=dn_b)

        def expert(g, xs):
            return _gpt_oss_reference(xs, *(a[g:g + 1].astype(jnp.float32) for a in (gu, gu_b, dn, dn_b)),
                                      [xs.shape[0]])
    sub = 16 if dtype == "bfloat16" else 8
    if not gather and t * k % sub == 0:  # the case holds windows that would pass x's end (moved back)
        _, grp, first, *_ = P.run_metadata(keys, tm, e, windows=sub)
        assert int(jnp.max(jnp.where(grp < e, first, 0))) > t * k - tm - sub
    with interpret(mode):
        out = P.fused_moe(x if gather else x[tokens], gu, dn, None, row_groups=keys, tm=tm, chunk=chunk, ti=ti,
                          combine=(tokens, w.reshape(-1)[order], t), gather=gather, tails=tails, **kw)
    assert out.shape == (t, h) and out.dtype == jnp.dtype(dtype)  # f32 sums rounded once to x's dtype
    ref = _combined_reference(x, ids, w, expert, e)
    if dtype == "bfloat16":  # each row rounded to bf16 as the kernel's output would be, then weighted
        ref = _combined_reference(x, ids, w, lambda g, xs: expert(g, xs).astype(jnp.bfloat16).astype(jnp.float32), e)
    _close(out, ref, 1e-4 if dtype == "float32" else 1e-2)


def test_fused_moe_combines_where_the_sums_fit(load_kernel):
    """The combine runs in the kernel wherever the tokens' sums fit VMEM beside the tiles (Qwen3-30B-A3B's
    experts at 2048 tokens on every chip and at 8192 on v6e, not on TPU7x's smaller VMEM; Gemma-4
    26B-A4B's at 2048 on TPU7x, at 8192 nowhere)."""
    P = load_kernel("ragged_dot").pallas

    def combines(tokens, chip, h=2048, i=768, k=8, dtype=jnp.bfloat16):
        tiling = P.fused_moe_tiling(tokens * k, h, i, in_dtype=dtype, out_dtype=dtype, chip=chip, groups=128)
        return P.fused_moe_combines(tokens, h, i, tiling, in_dtype=dtype, out_dtype=dtype, chip=chip)
    assert [combines(2048, c) for c in ("v5e", "v6e", "tpu7x")] == [True, True, True]
    assert combines(8192, "v6e") and not combines(8192, "tpu7x")
    assert combines(2048, "tpu7x", h=2816, i=704) and not combines(8192, "v6e", h=2816, i=704)
    assert combines(64, "v6e") and combines(2048, None)  # off TPU: v6e's speeds, the smallest VMEM

    def gathers(tokens, chip, h=2048, i=768, k=8, dtype=jnp.bfloat16, e=128, **kw):  # where the tokens' rows fit too
        tiling = P.fused_moe_tiling(tokens * k, h, i, in_dtype=dtype, out_dtype=dtype, chip=chip, groups=e, **kw)
        return P.fused_moe_gathers(tokens, h, i, tiling, rows=tokens * k, groups=e, in_dtype=dtype, out_dtype=dtype,
                                   chip=chip)
    assert gathers(2048, "v6e") and gathers(2048, "v5e") and not gathers(8192, "v6e")
    # GPT-OSS-20B's intermediate tiles copy the rows once per tile: gathered where the weights' DMA hides
    # that (256 tokens, GATHER_TILES_RIDGE), not at 2048 tokens (the rows would fit v5e's and v6e's VMEM)
    gpt_oss = dict(h=2880, i=2880, k=4, e=32, transposed=False, interleaved=True, down_transposed=False)
    assert gathers(256, "v6e", **gpt_oss) and gathers(256, "v5e", **gpt_oss)
    assert not gathers(2048, "v6e", **gpt_oss) and not gathers(2048, "v5e", **gpt_oss)
    assert P.waits_on_weights(2048 * 4, 32, jnp.bfloat16, "v6e") and not P.waits_on_weights(2048 * 4, 32, jnp.bfloat16, "v5e")


def test_fused_moe_windows_fit_a_group_where_it_combines(load_kernel):
    """A combining fused MLP takes windows of a group's rows: chunks fitted to groups of more than
    FITTED_CHUNK_ROWS rows (1 / n of the average and two native tiles, up to WINDOW_CHUNK_ROWS), windows of
    WINDOW_SLACK an average group where x's window is fetched or the chunk was fitted, all where VMEM holds
    them (else the tiling's), past the tiling's row tile if need be."""
    P = load_kernel("ragged_dot").pallas
    bf16 = jnp.bfloat16

    def windows(tokens, chip, h, i, k, e, gather=False, w_dtype=None, sum_cols=None, **kw):
        tiling = P.fused_moe_tiling(tokens * k, h, i, in_dtype=bf16, out_dtype=bf16, chip=chip, groups=e,
                                    w_dtype=w_dtype, **kw)
        return tiling[:2], P.fused_moe_windows(tokens * k, h, i, tiling, groups=e, tokens=tokens, in_dtype=bf16,
                                               w_dtype=w_dtype, gather=gather, chip=chip, sum_cols=sum_cols)
    gpt_oss = dict(h=2880, i=2880, k=4, e=32, transposed=False, interleaved=True, down_transposed=False)
    qwen3 = dict(h=2048, i=768, k=8, e=128)
    # GPT-OSS-20B at 2048 tokens (256 rows an expert): one 288-row chunk a group, 320-row windows
    assert windows(2048, "v6e", **gpt_oss) == ((1024, 256), (320, 288))
    assert windows(2048, "v5e", **gpt_oss) == ((1024, 128), (320, 288))
    # Qwen3-30B-A3B at 8192 tokens (512 rows an expert): two 288-row chunks, 640-row windows
    assert windows(8192, "v6e", **qwen3) == ((1024, 256), (640, 288))
    assert windows(8192, "v5e", **qwen3) == ((1024, 128), (640, 288))
    # at 2048 tokens (128 rows an expert) the tiling's chunk is fitted already: gathered rows keep its
    # window, x's windows are an average group's 1.25
    assert windows(2048, "v6e", gather=True, **qwen3) == ((1024, 160), (1024, 160))
    assert windows(2048, "v6e", **qwen3) == ((1024, 160), (160, 160))
    # the tokens' f32 rows of a gather at 8192 tokens do not fit beside the sums: the tiling's
    assert windows(8192, "v6e", gather=True, **qwen3) == ((1024, 256), (1024, 256))
    # quantized weights keep their chunk (its dequantized temporaries); the window still shrinks
    fp8 = windows(8192, "v6e", w_dtype=jnp.float8_e4m3fn, **qwen3)
    assert fp8[1] == (640, fp8[0][1])
    # the tiling's row tile does not cap them (it made room for an output tile): Gemma-4 26B-A4B at 8192 tokens
    # on TPU7x, 256-row tiles, summing 256 of its columns in the kernel; windows that do not fit: the tiling's
    gemma4 = dict(h=2816, i=704, k=8, e=128, down_transposed=False)
    assert windows(8192, "tpu7x", sum_cols=256, **gemma4) == ((256, 256), (640, 288))
    assert windows(8192, "tpu7x", sum_cols=1024, **gemma4) == ((256, 256), (256, 256))


def test_fused_moe_tiles_the_intermediate_where_the_layer_waits_on_weights(load_kernel):
    """GPT-OSS-20B (H = I = 2880 bf16, 32 experts, top-4, [E, H, 2I] interleaved): too big for VMEM whole
    on every chip, so tiles of the intermediate that fit 512-row tiles or longer, widest first, while the
    layer is bound by its weights' DMA (``TILED_MOE_RIDGE``); once it is compute-bound, only tiles that fill
    the MXU's width (``TILED_MXU_FILL``: 960 of 1024 on v5e and v6e; TPU7x fits none, two gmm calls: None).
    Quantized weights never tile."""
    P = load_kernel("ragged_dot").pallas

    def tiling(tokens, chip, **kw):
        return P.fused_moe_tiling(tokens * 4, 2880, 2880, in_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip=chip,
                                  transposed=False, interleaved=True, groups=32, down_transposed=False, **kw)

    assert P.moe_intermediate_tiles(2880, transposed=False, down_transposed=False, interleaved=True) == [
        2880, 960, 576, 320, 192, 64]  # 2ti lanes a multiple of 128
    assert (tiling(256, "v5e"), tiling(256, "v6e"), tiling(256, "tpu7x")) == (
        (512, 64, 960), (512, 64, 960), (512, 64, 576))
    assert (tiling(2048, "v5e"), tiling(2048, "v6e"), tiling(2048, "tpu7x")) == (
        (1024, 128, 960), (1024, 256, 960), None)
    assert (tiling(8192, "v5e"), tiling(8192, "v6e"), tiling(8192, "tpu7x")) == (
        (1024, 128, 960), (1024, 256, 960), None)
    assert tiling(64, "v6e", w_dtype=jnp.int8) is None
    # Qwen3-30B-A3B's experts fit whole everywhere: unchanged by the rule
    assert P.fused_moe_tiling(8192, 2048, 768, in_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip="tpu7x",
                              groups=128)[2] == 768


def test_fused_moe_takes_long_chunks_where_they_measured_faster(load_kernel):
    """256-row chunks for experts averaging more than LONG_CHUNK_ROWS rows on 256-wide MXUs (Qwen3-30B-A3B's
    shapes: 8192 and 2048 tokens x top-8 over 128 experts), 128 on v5e, chunks fitted to the average group up
    to FITTED_CHUNK_ROWS; when 256 rows of temporaries do not fit TPU7x's VMEM, 128 rows and still the one
    fused kernel."""
    P = load_kernel("ragged_dot").pallas

    def chunk(m, chip, h=2048, i=768):
        return P.fused_moe_tiling(m, h, i, in_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip=chip, groups=128)[1]

    assert (chunk(65536, "v6e"), chunk(65536, "tpu7x"), chunk(65536, "v5e")) == (256, 256, 128)
    assert chunk(4096, "tpu7x") == 64  # decode-sized groups (32 rows an expert) keep the short chunks
    # up to FITTED_CHUNK_ROWS rows an expert: an average group and two native tiles (128 + 32 rows)
    assert (chunk(16384, "v5e"), chunk(16384, "v6e"), chunk(16384, "tpu7x")) == (160, 160, 160)
    assert chunk(128 * (P.FITTED_CHUNK_ROWS + 1), "v6e") == 256
    assert P.fused_moe_tiling(65536, 4096, 512, in_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip="tpu7x",
                              groups=128) == (256, 128, 512)


def test_fused_moe_takes_long_tiles_for_long_layers(load_kernel):
    """1024-row tiles above LONG_TILE_ROWS rows where VMEM holds them (Qwen3-30B-A3B on v5e and v6e), halved
    back to 512 where it does not (TPU7x); shorter layers keep 512-row tiles."""
    P = load_kernel("ragged_dot").pallas

    def tm(m, chip, h=2048, i=768):
        return P.fused_moe_tiling(m, h, i, in_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip=chip, groups=128)[0]

    assert (tm(65536, "v5e"), tm(65536, "v6e"), tm(65536, "tpu7x")) == (1024, 1024, 512)
    assert (tm(P.LONG_TILE_ROWS, "v6e"), tm(2048, "v6e"), tm(100, "v6e")) == (512, 512, 112)


# --------------------------------------------------------------------------- decode experts

def _experts_reference(x, ids, wts, gu, dn, activation="silu"):
    """sum_k w * mlp_id(x) per token in f32, one (token, k) at a time; ids outside [0, E) add nothing.
    gu [E, 2I, H], dn [E, H, I] (transformers' layout); each expert output rounded to x's dtype."""
    i = dn.shape[2]
    out = np.zeros(x.shape, np.float32)
    f32 = lambda a: jnp.asarray(a, jnp.float32)  # noqa: E731
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if 0 <= e < gu.shape[0]:
                gate, up = f32(gu[e, :i]) @ f32(x[t]), f32(gu[e, i:]) @ f32(x[t])
                act = {"silu": jax.nn.silu(gate) * up, "gelu_tanh": jax.nn.gelu(gate, approximate=True) * up}[activation]
                y = (f32(dn[e]) @ act.astype(x.dtype).astype(jnp.float32)).astype(x.dtype)
                out[t] += np.asarray(y, np.float32) * float(wts[t, j])
    return out


DECODE_IDS = {  # [T, k] routings; 6 experts, 6 means "no expert here" (sentinel / bucket padding)
    "padded-bucket": [[4, 1], [1, 4], [0, 2], [6, 6], [6, 6], [6, 6], [6, 6], [6, 6]],
    "one-expert-all-tokens": [[3, 0], [3, 5], [3, 1], [3, 2], [3, 6], [3, -1], [3, 4]],
    "same-expert-twice": [[2, 2, 5]],
    "nothing-routed": [[6, -1], [-3, 6]],
}


@pytest.mark.parametrize("routing", list(DECODE_IDS))
@pytest.mark.parametrize("layout", ["transposed", "down-view", "kn"])
def test_decode_moe_matches_a_per_token_loop(load_kernel, routing, layout):
    """The decode kernel (routing, MLPs, weighting and top-k sum in one kernel) against a loop over (token, k):
    tokens sharing experts, an expert with every token, a token routed twice to one expert, sentinels
    (>= E and negative), padding rows, nothing routed at all (exact zeros); weights in transformers' layout,
    down through the [E, I, H] view (I off the lane grid), and the [E, H, 2I] / [E, I, H] layout."""
    P = load_kernel("ragged_dot").pallas
    ids = jnp.array(DECODE_IDS[routing], jnp.int32)
    t, k = ids.shape
    e, h, i = 6, 128, (64 if layout == "down-view" else 128)
    ks = jax.random.split(jax.random.key(7), 4)
    x = jax.random.normal(ks[0], (t, h))
    wts = jax.nn.softmax(jax.random.normal(ks[1], (t, k)), -1)
    gu = 0.1 * jax.random.normal(ks[2], (e, 2 * i, h))
    dn = 0.1 * jax.random.normal(ks[3], (e, h, i))
    args = dict(kn=(jnp.swapaxes(gu, 1, 2), jnp.swapaxes(dn, 1, 2), False, False),
                transposed=(gu, dn, True, True), **{"down-view": (gu, jnp.swapaxes(dn, 1, 2), True, False)})[layout]
    with interpret("fast"):
        out = P.decode_moe(x, args[0], args[1], ids, wts, transposed=args[2], down_transposed=args[3])
    if routing == "nothing-routed":
        assert out.shape == (t, h) and not np.asarray(out).any()
    _close(out, _experts_reference(x, ids, wts, gu, dn), 1e-4)


def test_decode_moe_token_routed_nowhere_stays_zero_when_its_passes_overflow(load_kernel):
    """Every token's row goes through each routed expert's MXU passes; a token routed nowhere whose passes
    overflow (inf, then NaN after the activation) still gets exact zeros, and the others their sums."""
    P = load_kernel("ragged_dot").pallas
    ids = jnp.array([[6, -1], [1, 2], [2, 6]], jnp.int32)
    e, h, i = 6, 128, 128
    ks = jax.random.split(jax.random.key(12), 4)
    x = jax.random.normal(ks[0], (3, h)).at[0].set(3e38)
    wts = jax.nn.softmax(jax.random.normal(ks[1], (3, 2)), -1)
    gu = 0.1 * jax.random.normal(ks[2], (e, 2 * i, h))
    dn = 0.1 * jax.random.normal(ks[3], (e, h, i))
    with interpret("fast"):
        out = np.asarray(P.decode_moe(x, gu, dn, ids, wts))
    assert not out[0].any()
    _close(out[1:], _experts_reference(x[1:], ids[1:], wts[1:], gu, dn), 1e-4)


@pytest.mark.parametrize("mode", ["fast", pytest.param("strict", marks=pytest.mark.strict_interpret)])
def test_decode_moe_in_bf16(load_kernel, mode):
    """bf16 weights and routing weights, gelu_tanh, a float32 output, against the per-token loop at bf16's
    tolerance; the strict interpreter checks the blocks (NaN-initialised memory, out-of-bounds reads)."""
    P = load_kernel("ragged_dot").pallas
    ids = jnp.array(DECODE_IDS["padded-bucket"], jnp.int32)
    t, k = ids.shape
    e, h, i = 6, 256, 128
    ks = jax.random.split(jax.random.key(8), 4)
    x = jax.random.normal(ks[0], (t, h)).astype(jnp.bfloat16)
    wts = jax.nn.softmax(jax.random.normal(ks[1], (t, k)), -1).astype(jnp.bfloat16)
    gu = (0.1 * jax.random.normal(ks[2], (e, 2 * i, h))).astype(jnp.bfloat16)
    dn = (0.1 * jax.random.normal(ks[3], (e, h, i))).astype(jnp.bfloat16)
    with interpret(mode):
        out = P.decode_moe(x, gu, dn, ids, wts, activation="gelu_tanh", out_dtype=jnp.float32)
    assert out.dtype == jnp.float32 and not np.isnan(np.asarray(out)).any()
    _close(out, _experts_reference(x, ids, wts, gu, dn, "gelu_tanh"), 8e-3)


def test_decode_kernel_rounds_as_the_row_tiled_path(load_kernel, monkeypatch):
    """f32 hidden states, bf16 experts, f32 routing weights: the decode kernel rounds as the row-tiled path
    (decode turned off) does, each expert output to bf16 (the weights' dtype) and its product with the
    routing weight in f32, so the two agree up to the order of f32 sums. (With bf16 routing weights XLA:CPU
    rounds the row-tiled path's f32 sum over top-k to bf16, so that pair is compared at bf16's tolerance,
    in test_decode_moe_in_bf16.)"""
    routing_dtype = jnp.float32
    kern = load_kernel("ragged_dot")
    t, k, e, h, i = 5, 3, 6, 256, 128
    ks = jax.random.split(jax.random.key(11), 5)
    ids = jnp.argsort(jax.random.uniform(ks[0], (t, e + 1)), axis=1)[:, :k]  # distinct ids, some the sentinel e
    x = jax.random.normal(ks[1], (t, h))
    wts = jax.nn.softmax(jax.random.normal(ks[2], (t, k)), -1).astype(routing_dtype)
    gu = (0.1 * jax.random.normal(ks[3], (e, 2 * i, h))).astype(jnp.bfloat16)
    dn = (0.1 * jax.random.normal(ks[4], (e, h, i))).astype(jnp.bfloat16)
    with interpret("fast"):
        ours = kern.experts.experts(x, ids, wts, gu, dn)
        monkeypatch.setattr(kern.pallas, "DECODE_TOKENS", 0)
        theirs = kern.experts.experts(x, ids, wts, gu, dn)
    assert ours.dtype == theirs.dtype == jnp.float32
    _close(ours, theirs, 1e-6)


def _launched(fn, *args):
    """The names of the Pallas kernels ``fn(*args)`` traces, in nested jaxprs too."""
    from jax.extend.core import ClosedJaxpr, Jaxpr

    def walk(jaxpr):
        for eq in jaxpr.eqns:
            if eq.primitive.name == "pallas_call":
                yield eq.params["name"]
            for v in eq.params.values():
                for sub in v if isinstance(v, (tuple, list)) else (v,):
                    if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                        yield from walk(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub)

    return set(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("variant", ["biases", "down-bias", "int8", "interleaved", "tokamax"])
def test_experts_op_keeps_what_the_decode_kernel_lacks_on_the_other_kernels(load_kernel, variant):
    """At 8 tokens, experts with biases, GPT-OSS's interleaved layout or the tokamax implementation are not
    sent to the decode kernel (it has none of them); quantized (int8) experts are (test_quantized.py checks
    its numerics)."""
    X = load_kernel("ragged_dot").experts
    t, k, e, h, i = 8, 2, 4, 128, 128
    args = [jnp.ones((t, h)), jnp.zeros((t, k), jnp.int32), jnp.ones((t, k)), jnp.ones((e, 2 * i, h)), jnp.ones((e, h, i))]
    kw = {}
    if variant in ("biases", "down-bias"):
        kw = dict(gate_up_bias=None if variant == "down-bias" else jnp.ones((e, 2 * i)), down_bias=jnp.ones((e, h)))
    elif variant == "int8":
        args[3:] = [jnp.ones((e, 2 * i, h), jnp.int8), jnp.ones((e, h, i), jnp.int8)]
        kw = dict(gate_up_scale=jnp.ones((e, 2 * i)), down_scale=jnp.ones((e, h)))
    elif variant == "interleaved":
        args[3:] = [jnp.ones((e, h, 2 * i)), jnp.ones((e, i, h))]
        kw = dict(is_transposed=True, interleaved=True, activation="swiglu_oai")
    else:
        kw = dict(implementation="tokamax")
    launched = _launched(functools.partial(X.experts, **kw), *args)
    assert launched and ("ragged_dot_decode_moe" in launched) == (variant == "int8"), launched


@pytest.mark.parametrize("t,kernel", [(8, "ragged_dot_decode_moe"), (9, "ragged_dot_fused_moe")])
def test_experts_op_takes_the_decode_kernel_up_to_eight_tokens(load_kernel, t, kernel):
    """experts() runs the decode kernel for a bucket of 8 tokens and the row-tiled one beyond, and both
    match the per-token loop (the model tests cover the decode path through transformers)."""
    kern = load_kernel("ragged_dot")
    e, h, i, k = 6, 128, 64, 2
    ks = jax.random.split(jax.random.key(9), 4)
    x = jax.random.normal(ks[0], (t, h))
    ids = jax.random.randint(ks[1], (t, k), 0, e + 1)  # some sentinels
    wts = jax.nn.softmax(jax.random.normal(ks[1], (t, k)), -1)
    gu = 0.1 * jax.random.normal(ks[2], (e, 2 * i, h))
    dn = 0.1 * jax.random.normal(ks[3], (e, h, i))
    run = functools.partial(kern.experts.experts, activation="silu")
    launched = _launched(run, x, ids, wts, gu, dn)
    assert launched == {kernel}, launched
    with interpret("fast"):
        out = run(x, ids, wts, gu, dn)
    _close(out, _experts_reference(x, ids, wts, gu, dn), 1e-4)


def test_gmm_chunks_groups_shorter_than_its_tile(load_kernel):
    """gmm takes a group's rows in chunks of the MXU's width (GPT-OSS-20B at 2048 tokens x top-4 over 32
    experts: 256 rows an expert in 512-row tiles), decode-sized groups in short chunks; and the default
    chunks give the right rows: groups straddling chunks and tiles, empty groups, rows past sum(group_sizes)."""
    P = load_kernel("ragged_dot").pallas
    assert P.gmm_chunk_rows(8192, 32, 512, "tpu7x") == 256
    assert P.gmm_chunk_rows(8192, 32, 512, "v5e") == 128
    assert P.gmm_chunk_rows(32768, 32, 256, "v6e") == 256  # at most the tile: one pass over it
    assert P.gmm_chunk_rows(256, 32, 64) == 32  # decode-sized groups: the short chunks
    assert P.chunk_tails(256, 16) == (32, 64, 128) and P.chunk_tails(32, 16) == (16,) and P.chunk_tails(16, 16) == ()
    sizes, m, k, n = [0, 150, 7, 260, 0, 130], 600, 128, 256
    assert P.gmm_chunk_rows(m, len(sizes), 512, "v5e") == 128
    ks = jax.random.split(jax.random.key(11), 2)
    lhs = jax.random.normal(ks[0], (m, k))
    rhs = 0.1 * jax.random.normal(ks[1], (len(sizes), n, k))
    gs = jnp.array(sizes, jnp.int32)
    with interpret("fast"):
        out = P.gmm(lhs, rhs, gs, transposed=True, tm=512, tn=128, chip="v5e")
    _close(out, _lax(lhs, rhs, gs, True), 1e-4)
    assert not np.asarray(out)[sum(sizes):].any()


def test_fused_moe_takes_tails_for_decode_sized_groups(load_kernel):
    """The fused MLP's last chunk of a group is cut to a tail where an average group fills at most a quarter
    of a chunk (``moe_tails``): Qwen3-30B-A3B at 64 tokens (4 rows an expert in 32-row chunks), not at 256 (16
    rows) nor at 8192 (512 rows in 288-row chunks); gathered rows, whose chunks start at the group's first
    row, where an average group fits a chunk: 256 tokens too, with a tail of three quarters of the chunk where
    that is whole native tiles (GPT-OSS-20B: 32 rows an expert in 64-row chunks)."""
    P = load_kernel("ragged_dot").pallas
    assert P.moe_tails(64 * 8, 128, 32, 16) == (16,)
    assert P.moe_tails(256 * 8, 128, 32, 16) == ()
    assert P.moe_tails(8192 * 8, 128, 288, 16) == ()
    assert P.moe_tails(256 * 8, 128, 32, 16, gathered=True) == (16,)
    assert P.moe_tails(2048 * 8, 128, 160, 16, gathered=True) == (80,)  # 128 rows an expert
    assert P.moe_tails(8192 * 8, 128, 288, 16, gathered=True) == ()
    assert P.moe_tails(256 * 4, 32, 64, 16, gathered=True) == (16, 32, 48)


def test_gathered_rows_take_a_tail_wherever_a_group_starts(load_kernel):
    """Gathered (``fused_moe(gather=True)``), a group's chunks start at its first row, not at the native tile
    holding it: the MXU work the cost model counts is each group's rows in the fewest of a 16-row tail or the
    32-row chunk (bf16; groups of 3 to 30 rows starting anywhere in their tiles, an empty one), where chunks
    from the native tile would take 192 rows for these groups' 144."""
    from pallas_hub.bench import costmodel

    P = load_kernel("ragged_dot").pallas
    sizes, h, i, k = [3, 14, 0, 16, 9, 17, 30, 5], 128, 128, 2
    e, t = len(sizes), sum(sizes) // k
    ids = np.random.default_rng(0).permutation(np.repeat(np.arange(e), sizes)).reshape(t, k)
    keys, order, tokens = P.sort_by_expert(jnp.asarray(ids, jnp.int32), e)
    ks = jax.random.split(jax.random.key(9), 3)
    x = jax.random.normal(ks[0], (t, h)).astype(jnp.bfloat16)
    gu = (0.1 * jax.random.normal(ks[1], (e, 2 * i, h))).astype(jnp.bfloat16)
    dn = (0.1 * jax.random.normal(ks[2], (e, h, i))).astype(jnp.bfloat16)
    w = jnp.ones((t, k), jnp.float32)

    def layer(x, gu, dn):
        return P.fused_moe(x, gu, dn, None, row_groups=keys, tm=64, chunk=32, tails=(16,),
                           combine=(tokens, w.reshape(-1)[order], t), gather=True)
    issued = costmodel.estimate(layer, x, gu, dn).flops
    rows = sum(16 if n <= 16 else 32 for n in sizes if n)
    assert (rows, issued) == (144, rows * 6 * h * i)
    with interpret("fast"):
        out = layer(x, gu, dn)

    def expert(g, xs):
        y = xs @ gu[g].astype(jnp.float32).T
        return ((jax.nn.silu(y[:, :i]) * y[:, i:]).astype(jnp.bfloat16).astype(jnp.float32)
                @ dn[g].astype(jnp.float32).T).astype(jnp.bfloat16).astype(jnp.float32)
    _close(out, _combined_reference(x, ids, w, expert, e), 1e-2)


def _tail_chunks(sizes, m, tm, chunk, sub, tails):
    """The chunks gmm's loop takes (``_for_group_rows`` with tails), from the group sizes: "whole" where a
    group runs a whole chunk, the row count of each tail taken, "pulled" where one is pulled back inside
    its tile."""
    taken, start = set(), 0
    for size in sizes:
        end = min(start + size, m)
        for r in range(start, end):
            lo = r % tm
            if r != start and lo:
                continue  # one piece per tile of the group
            hi = min(end - (r - lo), tm)
            first = min(lo // sub * sub, tm - chunk)
            done, rest = divmod(hi - first, chunk)
            taken |= {"whole"} if done else set()
            if rest:
                rows = min(t for t in tails + (chunk,) if t >= rest)
                taken |= {rows} | ({"pulled"} if first + done * chunk + rows > tm else set())
        start = end
    return taken


@pytest.mark.parametrize("chunks", ["short", "tails"])
@pytest.mark.parametrize("variant", ["kn", "nk", "gated", "interleaved-bias", "interleaved-bias-xlu"])
@pytest.mark.parametrize("mode", ["fast", pytest.param("strict", marks=pytest.mark.strict_interpret)])
def test_gmm_row_chunks_match_whole_tiles(load_kernel, variant, mode, chunks):
    """gmm's loop over a group's rows in chunks against one pass over each whole tile, in 64-row tiles:
    "short", 8-row chunks (decode), one pulled back inside its tile ([17, 60)); "tails", 32-row chunks
    whose groups end in the shortest tail that holds their last rows (``chunk_tails``: 8 or 16 rows, f32),
    sizes chosen so every kind of chunk runs (whole chunks, each tail, the chunk, one pulled back inside its
    tile). Groups straddling chunks and tiles, empty groups, rows past sum(group_sizes); the plain layouts,
    a [gate; up] activation, and GPT-OSS's interleaved gate/up with bias."""
    P = load_kernel("ragged_dot").pallas
    k, n = 128, 256
    if chunks == "short":
        sizes, m, chunk = [17, 43, 0, 3, 2, 30, 0], 120, 8
        assert P.chunk_tails(chunk, 8) == ()
    else:
        sizes, m, chunk = [10, 53, 0, 3, 30, 0, 70, 9, 24, 1], 250, 32
        assert P.chunk_tails(chunk, 8) == (8, 16)
        assert _tail_chunks(sizes, m, 64, chunk, 8, (8, 16)) == {"whole", 8, 16, 32, "pulled"}
    ks = jax.random.split(jax.random.key(5), 3)
    lhs = jax.random.normal(ks[0], (m, k))
    transposed = variant != "kn"
    rhs = 0.1 * jax.random.normal(ks[1], (len(sizes), n, k) if transposed else (len(sizes), k, n))
    kw = dict(transposed=transposed, tm=64, tn=128)
    if variant == "gated":
        kw.update(activation="silu")
    if variant.startswith("interleaved-bias"):
        rhs = jnp.swapaxes(rhs, 1, 2)
        pairs = variant.endswith("bias")  # activated as pairs in bf16, else split by transposes in f32
        lhs, rhs = (a.astype(jnp.bfloat16 if pairs else jnp.float32) for a in (lhs, rhs))
        kw.update(transposed=False, activation="swiglu_oai", interleaved=True, pairs=pairs,
                  bias=0.1 * jax.random.normal(ks[2], (len(sizes), n)))
        chunk = max(chunk, 16) if pairs else chunk  # bf16 rows come in 16-row tiles
    gs = jnp.array(sizes, jnp.int32)
    with interpret(mode):
        chunked = P.gmm(lhs, rhs, gs, chunk=chunk, **kw)
    with interpret("fast"):
        whole = P.gmm(lhs, rhs, gs, chunk=64, **kw)
    assert not np.isnan(np.asarray(chunked, np.float32)).any()
    _close(chunked, whole, 1e-6)
    assert not np.asarray(chunked, np.float32)[sum(sizes):].any()
    if variant in ("kn", "nk"):
        _close(chunked, _lax(lhs, rhs, gs, transposed), 1e-4)
    if variant.startswith("interleaved-bias"):  # each row's gate / up from alternate columns, clamped swiglu
        y = _lax(lhs.astype(jnp.float32), rhs.astype(jnp.float32), gs, False) + jnp.repeat(
            jnp.concatenate([kw["bias"], jnp.zeros((1, n))]), np.array(sizes + [m - sum(sizes)]), axis=0,
            total_repeat_length=m)
        ref = P._activate(y[:, 0::2], y[:, 1::2], "swiglu_oai", 1.702, 7.0)
        _close(chunked, jnp.where(jnp.arange(m)[:, None] < sum(sizes), ref, 0), 1e-2 if pairs else 1e-4)
