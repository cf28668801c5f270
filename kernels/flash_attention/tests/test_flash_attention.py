"""flash-attention-tpu: interpret-mode numerics and gradients against the dense reference, the
schedule (skipped blocks, static bound), bad input, strict interpreter and TPU compile subsets.

Tolerances (max abs error vs the f32 reference, inputs ~N(0, 1)): f32 2e-5 (forward) and 1e-4
(gradients): summation order only; bf16 3e-2: the kernel rounds p to bf16 before P @ V, as
every TPU flash kernel does, and the output itself is bf16.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pallas_hub.verify import compile_for_tpu, interpret

F32_TOL, GRAD_TOL, BF16_TOL = 2e-5, 1e-4, 3e-2


@pytest.fixture(scope="module")
def fa(load_kernel):
    return load_kernel("flash_attention")


def _inputs(b, hq, hkv, sq, sk, d, dtype=jnp.float32, seed=0):
    ks = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(ks[0], (b, hq, sq, d), dtype)
    k = jax.random.normal(ks[1], (b, hkv, sk, d), dtype)
    v = jax.random.normal(ks[2], (b, hkv, sk, d), dtype)
    sinks = jax.random.normal(ks[3], (hq,), jnp.float32)
    return q, k, v, sinks


def _check_forward(fa, b, hq, hkv, sq, sk, d, *, dtype=jnp.float32, use_sinks=False, seq=None, mask=None, chip="",
                   **kw):
    q, k, v, sinks = _inputs(b, hq, hkv, sq, sk, d, dtype)
    sinks = sinks if use_sinks else None
    seq = None if seq is None else jnp.asarray(seq, jnp.int32)
    with interpret("fast"):
        out = fa.pallas.flash_attention(q, k, v, sinks, seq, mask, chip=chip, **kw)
    ref = fa.pallas.reference(q, k, v, sinks, seq, mask, **kw)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert not np.isnan(np.asarray(out, np.float32)).any()
    tol = F32_TOL if dtype == jnp.float32 else BF16_TOL
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), atol=tol, rtol=tol)
    return out


# Default set: small, covers every feature once, with 128-blocks so that lengths are ragged.
FAST = [
    # b, hq, hkv, sq, sk, d, extra
    (1, 4, 4, 300, 300, 64, dict(block_k=256)),  # MHA, ragged blocks, causal, 2 compute tiles per K/V block
    (2, 8, 2, 17, 300, 128, dict(window=50, softcap=5.0, use_sinks=True)),  # chunked prefill, GQA 4
    (2, 8, 1, 1, 300, 128, dict(seq=[[10, 250, 1], [0, 300, 1]])),  # MQA decode, left+right padding
    (2, 4, 2, 128, 128, 256, dict(causal=False, seq=[[5, 100, 77], [0, 128, 128]])),  # D=256, q padding
    (1, 16, 2, 130, 130, 64, dict(dtype=jnp.bfloat16, window=7, use_sinks=True)),  # GQA 8, bf16
]


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,extra", FAST)
def test_forward_matches_reference(fa, b, hq, hkv, sq, sk, d, extra):
    _check_forward(fa, b, hq, hkv, sq, sk, d, block_q=128, block_k=extra.pop("block_k", 128), **extra)


def test_fully_masked_rows_are_zero_and_mask_path(fa):
    """Left-padded rows see nothing (0, not NaN); an arbitrary mask (random, with an empty row and an
    empty sequence) goes through the masked path."""
    b, sq, sk = 3, 40, 40
    mask = jax.random.bernoulli(jax.random.key(3), 0.6, (b, sq, sk))
    mask = mask.at[0, 5].set(False).at[2].set(False)
    out = _check_forward(fa, b, 4, 2, sq, sk, 64, mask=mask, causal=False, use_sinks=True)
    assert np.all(np.asarray(out[0, :, 5]) == 0) and np.all(np.asarray(out[2]) == 0)
    out = _check_forward(fa, 2, 4, 2, sq, sk, 64, seq=[[13, 40, 40], [0, 0, 40]])
    assert np.all(np.asarray(out[0, :, :13]) == 0) and np.all(np.asarray(out[1]) == 0)


@pytest.mark.parametrize("chip,blocks", [("v6e", {}), ("v6e", dict(block_q=128, block_k=256)),
                                         ("v5e", dict(block_q=128, block_k=256))])
def test_chip_forward_bf16(fa, chip, blocks):
    """A chip's own forward on bf16 (exp in f32 on every chip), its default blocks (a 1024-row q block
    and a ragged second, one 1100-key tile) or small ones (diagonal, full and edge tiles), GQA 4 with
    sinks: within bf16 rounding of the f32 reference."""
    _check_forward(fa, 1, 8, 2, 1100, 1100, 128, dtype=jnp.bfloat16, use_sinks=True, chip=chip, **blocks)


@pytest.mark.parametrize("chip,hq,hkv", [("v6e", 16, 2), ("tpu7x", 16, 1)])
def test_whole_group_pipelined_forward(fa, chip, hq, hkv):
    """v6e / TPU7x pipeline the whole KV group (G = 8, 16) in one iteration of the head loop; its heads
    stay distinct: ragged blocks, padding on both sides, causal diagonal and sinks against the reference."""
    g = hq // hkv
    assert fa.pallas._heads_per_iteration(g, chip) == g
    assert fa.pallas._heads_per_iteration(g, "v5e") == 4 and fa.pallas._heads_per_iteration(6, "v5e") == 2
    _check_forward(fa, 2, hq, hkv, 260, 300, 128, dtype=jnp.bfloat16, use_sinks=True, chip=chip, block_q=128,
                   block_k=256, seq=[[0, 300, 260], [20, 290, 200]])


GRADS = [  # ragged blocks, GQA, window, soft-cap, sinks, padding; MQA decode
    (2, 8, 2, 140, 300, 128, dict(window=50, softcap=5.0, use_sinks=True, seq=[[3, 290, 140], [0, 300, 12]],
                                  block_k=256)),  # ragged, chunked, 2 key tiles per K/V block
    (2, 4, 1, 1, 100, 64, dict(seq=[[10, 64, 1], [0, 40, 1]])),
    # head dim 64 keys-major: [.., D, S] blocks (``_d_major``), ragged q and K/V blocks, padding on both sides
    (1, 4, 2, 260, 300, 64, dict(window=70, softcap=5.0, use_sinks=True, seq=[[5, 297, 250]], block_k=256)),
    (2, 4, 1, 130, 200, 64, dict(causal=False, seq=[[0, 200, 130], [10, 190, 100]],
                                 mask=jax.random.bernoulli(jax.random.key(5), 0.7, (2, 130, 200)))),  # a given mask
    (1, 2, 2, 150, 150, 128, dict(mask=jax.random.bernoulli(jax.random.key(6), 0.7, (1, 150, 150)))),
    # head dim 128 keys-major on [.., S, D] blocks (q and dO transposed in the dK/dV kernel): ragged q and K/V
    # blocks, padding on both sides, window, soft-cap and sinks; a given mask; the causal diagonal in 2 slabs of
    # 256 queries, unmasked tiles, a ragged last q block, keys past the queries (bottom-right) and left padding
    (1, 8, 2, 260, 300, 128, dict(window=70, softcap=5.0, use_sinks=True, seq=[[5, 297, 250]], block_k=256)),
    (2, 4, 1, 130, 200, 128, dict(causal=False, seq=[[0, 200, 130], [10, 190, 100]],
                                  mask=jax.random.bernoulli(jax.random.key(7), 0.7, (2, 130, 200)))),
    (2, 4, 2, 1100, 1300, 128, dict(block_q=512, block_k=512, seq=[[0, 1300, 1100], [40, 1260, 900]])),
    # head dim 64 ([.., D, S] views): unmasked tiles, the diagonal's slabs, a ragged last q block and K/V tile
    (1, 4, 2, 1100, 1100, 64, dict(block_q=512, block_k=512, use_sinks=True)),
    (1, 2, 1, 260, 260, 256, dict(block_k=256, softcap=5.0)),  # head dim 256: unmasked tiles, ragged blocks
    # short q blocks (row-major): masked (window, sinks), unmasked (non-causal, no padding), a given mask
    (1, 4, 2, 40, 300, 128, dict(window=50, softcap=5.0, use_sinks=True)),
    (1, 4, 2, 40, 300, 128, dict(causal=False, use_sinks=True)),
    (1, 2, 2, 40, 150, 128, dict(causal=False, mask=jax.random.bernoulli(jax.random.key(8), 0.7, (1, 40, 150)))),
]


def _grads(f, q, k, v, sinks):
    argnums = (0, 1, 2, 3) if sinks is not None else (0, 1, 2)
    w = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
    return jax.grad(lambda *a: (f(*a) * w).sum(), argnums)(q, k, v, sinks)


@pytest.mark.parametrize("b,hq,hkv,sq,sk,d,extra", GRADS)
def test_gradients_match_autodiff_of_reference(fa, b, hq, hkv, sq, sk, d, extra):
    use_sinks = extra.pop("use_sinks", False)
    seq = extra.pop("seq", None)
    seq = None if seq is None else jnp.asarray(seq, jnp.int32)
    q, k, v, sinks = _inputs(b, hq, hkv, sq, sk, d)
    sinks = sinks if use_sinks else None
    block_q, block_k = extra.pop("block_q", 128), extra.pop("block_k", 128)
    kernel = functools.partial(fa.pallas.flash_attention, seq=seq, chip="", block_q=block_q, block_k=block_k, **extra)
    with interpret("fast"):
        got = _grads(lambda q, k, v, s: kernel(q, k, v, s), q, k, v, sinks)
    want = _grads(lambda q, k, v, s: fa.pallas.reference(q, k, v, s, seq, **extra), q, k, v, sinks)
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), got, want):
        assert not np.isnan(np.asarray(a)).any(), name
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=GRAD_TOL, rtol=GRAD_TOL, err_msg=name)


# --------------------------------------------------------------------------- the schedule

def test_schedule_skips_masked_blocks_and_their_dma(fa):
    """Causal 1024 x 1024 with 128-blocks: 36 of 64 block pairs are needed; exactly 36 steps compute
    and K/V are fetched once per needed pair (never for a skipped block). The static step count is
    43: a shorter q_len shifts queries right (bottom-right), which can need up to 43 pairs; the
    spare steps repeat the last block indices (no DMA, no compute)."""
    P = fa.pallas
    seq = P._canonical_seq(None, 1, 1024, 1024)
    need = P._need(seq, nq=8, nk=8, bq=128, bk=128, causal=True, window=None)
    assert int(need.sum()) == 36
    n = P._max_items(1024, 1024, 128, 128, True, None, False)
    assert n == 43
    outer, inner, flags = (np.asarray(t) for t in P._schedule(need, n))
    assert ((flags & P.COMPUTE) != 0).sum() == 36
    pairs = list(zip(outer, inner))
    assert all(bool(need[0, o, i]) for o, i in pairs)
    fetches = 1 + sum(pairs[t] != pairs[t - 1] for t in range(1, len(pairs)))  # K/V index changes
    assert fetches == 36
    # sliding window 128: 2 kv blocks per aligned q block, 3 at worst alignment (shifted q_len)
    need_w = P._need(seq, nq=8, nk=8, bq=128, bk=128, causal=True, window=128)
    assert int(need_w.sum(-1).max()) == 2 and P._max_items(1024, 1024, 128, 128, True, 128, False) <= 8 * 3


@pytest.mark.parametrize("causal,window", [(True, None), (True, 100), (False, None), (False, 64)])
def test_schedule_bound_holds_for_random_lengths(fa, causal, window):
    """The static step count bounds the real schedule for any (kv_start, kv_end, q_len)."""
    P = fa.pallas
    rng = np.random.default_rng(0)
    for sq, sk, bq, bk in [(300, 300, 128, 128), (17, 1000, 17, 256), (1, 700, 1, 128), (513, 900, 256, 128)]:
        nq, nk = -(-sq // bq), -(-sk // bk)
        seq = np.stack([rng.integers(0, sk, 200), rng.integers(0, sk + 1, 200), rng.integers(0, sq + 1, 200)], 1)
        seq = P._canonical_seq(jnp.asarray(seq), 200, sq, sk)
        need = np.asarray(P._need(seq, nq=nq, nk=nk, bq=bq, bk=bk, causal=causal, window=window))
        fwd = np.maximum(need.sum(-1), 1).sum(-1).max()
        bwd = np.maximum(need.sum(-2), 1).sum(-1).max()
        assert fwd <= P._max_items(sq, sk, bq, bk, causal, window, False)
        assert bwd <= P._max_items(sq, sk, bq, bk, causal, window, True)


# --------------------------------------------------------------------------- bad input

def test_bad_input_errors_name_the_argument(fa):
    P = fa.pallas
    q, k, v, _ = _inputs(1, 4, 2, 8, 8, 64)
    cases = [
        ((q, k[..., :32], v[..., :32]), {}, ValueError, "head dims differ"),
        ((q[:, :3], k, v), {}, ValueError, "multiple of the number of KV heads"),
        ((q, k, v), dict(window=0), ValueError, "window must be a positive"),
        ((q.astype(jnp.float16), k, v), {}, TypeError, "q must have dtype"),
        ((q, k, v), dict(mask=jnp.ones((1, 8, 9), bool)), ValueError, "mask must have shape"),
        ((q, k, v), dict(mask=jnp.ones((1, 8, 8), jnp.float32)), TypeError, "mask must have dtype"),
        ((q, k, v), dict(sinks=jnp.zeros((3,))), ValueError, "sinks must have one value per query head"),
        ((q[..., :48], k[..., :48], v[..., :48]), {}, ValueError, "head_dim must be one of"),
        ((q, k, v), dict(block_q=100), ValueError, "block_q must be a positive multiple of 128"),
    ]
    for args, kw, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            P.flash_attention(*args, chip="", **kw)


# --------------------------------------------------------------------------- zero sizes, seq values, default scale

@pytest.mark.parametrize("b,hq,sq,sk", [(0, 4, 8, 8), (1, 4, 0, 8), (1, 0, 8, 8), (2, 4, 8, 0)],
                         ids=["batch=0", "Sq=0", "Hq=0", "Sk=0"])
@pytest.mark.parametrize("use_sinks", [False, True], ids=["", "sinks"])
def test_zero_sizes_give_empty_or_zero_outputs(fa, b, hq, sq, sk, use_sinks):
    """No query row: an empty output. No key: zeros, and the lse of a row with nothing to attend
    (the same as the kernel gives a sequence whose keys are all padding)."""
    hkv = 2
    q, k, v, sinks = _inputs(b, max(hq, hkv), hkv, sq, sk, 64)
    q, sinks = q[:, :hq], (sinks[:hq] if use_sinks else None)
    with interpret("fast"):
        out, lse = fa.pallas.flash_attention_with_lse(q, k, v, sinks, chip="")
        grads = jax.grad(lambda *a: fa.pallas.flash_attention(*a, chip="").sum(), (0, 1, 2, 3) if use_sinks else (0, 1, 2))(
            q, k, v, *(() if sinks is None else (sinks,)))
    assert out.shape == q.shape and lse.shape == q.shape[:3] and not np.asarray(out).any()
    for g, x in zip(grads, (q, k, v, sinks)):
        assert g.shape == x.shape and not np.asarray(g).any()
    if b and hq and sq and not use_sinks:  # Sk = 0, no sinks: the lse of an empty row
        np.testing.assert_array_equal(np.asarray(lse), np.float32(fa.attention_math.MASK_VALUE))
    if b and hq and sq and use_sinks:  # Sk = 0: compare the lse with all keys padded out of an 8-key sequence
        k8, v8 = _inputs(b, hq, hkv, sq, 8, 64)[1:3]
        with interpret("fast"):
            ref_out, ref_lse = fa.pallas.flash_attention_with_lse(q, k8, v8, sinks, jnp.zeros((b, 3), jnp.int32)
                                                                  .at[:, 2].set(sq), chip="")
        np.testing.assert_array_equal(np.asarray(ref_out), 0)
        np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
    # the torch op, forward and backward
    tq, tk, tv = (torch.from_numpy(np.array(x)).requires_grad_() for x in (q, k, v))
    tout, tlse = fa.attention(tq, tk, tv, None if sinks is None else torch.from_numpy(np.array(sinks)))
    assert tuple(tout.shape) == q.shape and tuple(tlse.shape) == q.shape[:3] and not tout.any()
    tout.sum().backward()
    assert all(t.grad.shape == t.shape and not t.grad.any() for t in (tq, tk, tv))


BAD_SEQ = [  # (kv_start, kv_end, q_len) of the second sequence, q/k of 8 rows/keys; the error
    ((0, 9, 8), r"seq\[1\] = \(kv_start=0, kv_end=9, q_len=8\): kv_end exceeds the 8 keys"),
    ((5, 3, 3), r"kv_start must be in \[0, kv_end\]"),
    ((-1, 8, 8), r"kv_start must be in \[0, kv_end\]"),
    ((0, 8, 9), r"q_len must be in \[0, Sq=8\]"),
    ((0, 8, -1), r"q_len must be in \[0, Sq=8\]"),
]


def test_seq_values_are_checked_on_the_host_and_clamped_on_device(fa):
    """As paged attention: values on the host (concrete arrays, CPU tensors) are refused by name;
    under jit (no values without a host sync) they are clamped into range."""
    q, k, v, _ = _inputs(len(BAD_SEQ), 4, 2, 8, 8, 64)
    good = [0, 8, 8]
    for bad, message in BAD_SEQ:
        seq = jnp.array([good, bad] + [good] * (len(BAD_SEQ) - 2), jnp.int32)
        with pytest.raises(ValueError, match=message):
            fa.pallas.flash_attention(q, k, v, seq=seq, chip="")
        with pytest.raises(ValueError, match=message):
            fa.attention(*(torch.from_numpy(np.array(x)) for x in (q, k, v)), seq=torch.tensor(np.array(seq)))
    seq = jnp.array([bad for bad, _ in BAD_SEQ], jnp.int32)
    with interpret("fast"):
        traced = jax.jit(lambda seq: fa.pallas.flash_attention(q, k, v, seq=seq, chip=""))(seq)
    clamped = jnp.array([[0, 8, 8], [3, 3, 3], [0, 8, 8], [0, 8, 8], [0, 8, 0]], jnp.int32)  # into range by hand
    ref = fa.pallas.reference(q, k, v, None, clamped)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(ref), atol=F32_TOL, rtol=F32_TOL)


def test_torch_op_default_scale_is_head_dim_rsqrt(fa):
    """``attention`` without ``scale`` uses head_dim**-0.5 (was 1.0), forward and backward; the JAX
    function behind the op resolves the default, so JAX callers get the same."""
    q, k, v, _ = _inputs(1, 4, 2, 16, 16, 64)
    tq, tk, tv = (torch.from_numpy(np.array(x)).requires_grad_() for x in (q, k, v))
    out, _ = fa.attention(tq, tk, tv)
    ref = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)  # scale D**-0.5
    torch.testing.assert_close(out, ref, atol=F32_TOL, rtol=F32_TOL)
    w = torch.randn(out.shape)
    got = torch.autograd.grad((out * w).sum(), (tq, tk, tv))
    want = torch.autograd.grad((ref * w).sum(), (tq, tk, tv))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=GRAD_TOL, rtol=GRAD_TOL)


# --------------------------------------------------------------------------- strict interpreter

@pytest.mark.strict_interpret
@pytest.mark.parametrize("shape,seq,blocks,window", [
    ((2, 4, 2, 20, 150, 64), [[5, 140, 20], [0, 150, 9]], 128, 100),  # short q blocks: row-major
    # keys-major: the causal diagonal in 2 slabs, an unmasked tile (q block 1 sees key tile 0 whole), a ragged last
    # q block and K/V tile; left padding and a shorter query run in the second sequence
    ((2, 2, 1, 1100, 1100, 128), [[0, 1100, 1100], [10, 1100, 1000]], 512, None)])
def test_strict_interpreter_forward_and_backward(fa, shape, seq, blocks, window):
    """NaN-initialised VMEM, out-of-bounds reads raise, race detection: ragged blocks, padding, sinks."""
    q, k, v, sinks = _inputs(*shape)
    seq = jnp.array(seq, jnp.int32)
    f = functools.partial(fa.pallas.flash_attention, seq=seq, chip="", block_q=blocks, block_k=blocks, window=window)
    with interpret("strict"):
        out = f(q, k, v, sinks)
        dq, dk, dv, ds = jax.grad(lambda *a: f(*a).sum(), (0, 1, 2, 3))(q, k, v, sinks)
    ref = fa.pallas.reference(q, k, v, sinks, seq, window=window)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=F32_TOL)
    want = jax.grad(lambda *a: fa.pallas.reference(*a, seq, window=window).sum(), (0, 1, 2, 3))(q, k, v, sinks)
    for a, r in zip((dq, dk, dv, ds), want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=GRAD_TOL, rtol=GRAD_TOL)


# --------------------------------------------------------------------------- TPU compile (subset of the matrix)

@pytest.mark.tpu_compile
@pytest.mark.parametrize("chip,shape,label", [("v6e", "prefill 2k", "fwd+bwd"), ("tpu7x", "decode vs 32k, batch 8", "fwd"),
                                              ("v5e", "prefill 2k", "fwd")])
def test_compile_matrix_subset(fa, chip, shape, label):
    from pallas_hub.hub import manifest
    from pallas_hub.verify import matrix

    configs = matrix.load_configs(manifest.ROOT / "kernels/flash_attention/compile_matrix.py", fa)
    (config,) = [c for c in configs if c.chips == (chip,) and c.name == f"qwen3-30b-a3b {shape} causal {label}"]
    result = compile_for_tpu(config.fn, *config.args, chip=chip, **config.static)
    assert result.ok, result.error
    assert result.vmem_bytes < result.vmem_capacity


@pytest.mark.tpu_compile
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("grad", [False, True], ids=["forward", "gradient"])
def test_prefill_takes_the_layout_xla_gives_its_arrays(fa, d, grad):
    """XLA:TPU lays [.., S, 64] out with S minor (lane-dense), [.., S, 128] row-major; the keys-major kernels
    read q, k, v (dO) and write their results in the layout their head dim has (``_d_major``), so the compiled
    program copies none of them (with [.., S, 64] blocks the forward relayouted q, k, v and its output, 4
    copies; its gradient program 7)."""
    from pallas_hub.verify import tpu_devices
    from pallas_hub.vendored._chips import chip as get_chip

    place = jax.sharding.SingleDeviceSharding(tpu_devices(get_chip("v6e").topology)[0])
    q = jax.ShapeDtypeStruct((1, 8, 2048, d), jnp.bfloat16, sharding=place)
    kv = jax.ShapeDtypeStruct((1, 2, 2048, d), jnp.bfloat16, sharding=place)
    forward = lambda q, k, v: fa.pallas.flash_attention(q, k, v, chip="v6e")  # noqa: E731
    fn = jax.grad(lambda *a: forward(*a).astype(jnp.float32).sum(), argnums=(0, 1, 2)) if grad else forward
    text = jax.jit(fn).trace(q, kv, kv).lower(lowering_platforms=("tpu",)).compile().as_text()
    kernels = ["flash_attention_dq", "flash_attention_dkv"] if grad else ["flash_attention_fwd"]
    assert all(name in text for name in kernels) and " copy(" not in text


@pytest.mark.slow  # ~35 s of compiler time before it gives up
@pytest.mark.tpu_compile
def test_compile_rejects_vmem_overflow(fa):
    from pallas_hub.hub import manifest
    from pallas_hub.verify import matrix

    configs = matrix.load_configs(manifest.ROOT / "kernels/flash_attention/compile_matrix.py", fa)
    (config,) = [c for c in configs if c.fails_with]
    result = compile_for_tpu(config.fn, *config.args, chip=config.chips[0], **config.static)
    assert not result.ok and config.fails_with in result.error


# --------------------------------------------------------------------------- slow sweep

SWEEP = [(hq, hkv, sq, sk) for hq, hkv in [(4, 4), (4, 2), (8, 2), (8, 1)]
         for sq, sk in [(1, 1), (1, 1024), (17, 17), (17, 300), (128, 128), (300, 300), (1024, 1024)]]


@pytest.mark.slow
@pytest.mark.parametrize("hq,hkv,sq,sk", SWEEP)
@pytest.mark.parametrize("feature", ["causal", "window", "softcap+sinks", "padded"])
def test_sweep(fa, hq, hkv, sq, sk, feature):
    extra = {"causal": {}, "window": dict(window=33), "softcap+sinks": dict(softcap=20.0, use_sinks=True),
             "padded": dict(seq=[[min(3, sk - 1), sk, sq], [0, max(sk - 5, 1), max(sq - 2, 1)]])}[feature]
    _check_forward(fa, 2, hq, hkv, sq, sk, 64, block_q=128, block_k=128, **extra)


@pytest.mark.slow
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_dims_and_dtypes_default_blocks(fa, d, dtype):
    _check_forward(fa, 1, 8, 2, 1000, 1000, d, dtype=dtype, window=300, use_sinks=True)


@pytest.mark.slow
def test_bf16_gradients(fa):
    """bf16 inputs: gradients within bf16 rounding of the f32 reference's (p, ds rounded to bf16 for the MXU)."""
    q, k, v, sinks = _inputs(1, 8, 2, 300, 300, 128, jnp.bfloat16)
    f = functools.partial(fa.pallas.flash_attention, chip="", block_q=128, block_k=256, window=200, softcap=30.0)
    with interpret("fast"):
        got = _grads(lambda q, k, v, s: f(q, k, v, s).astype(jnp.float32), q, k, v, sinks)
    up = lambda x: x.astype(jnp.float32)  # noqa: E731
    want = _grads(lambda q, k, v, s: fa.pallas.reference(q, k, v, s, window=200, softcap=30.0), up(q), up(k), up(v),
                  sinks)
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), got, want):
        scale = float(jnp.abs(r).max())
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(r), atol=3e-2 * scale, err_msg=name)


@pytest.mark.parametrize("extra", [dict(), dict(seq=[[0, 1100, 700], [37, 1000, 1000]]),
                                   dict(window=300, softcap=20.0, use_sinks=True)])
def test_causal_diagonal_in_slabs(fa, monkeypatch, extra):
    """Keys-major q blocks of several DIAGONAL_SLABs compute the causal diagonal's tile slab by slab, each
    slab against the keys up to its last query: against the reference with ragged blocks, chunked prefill
    (the diagonal off the tile grid), left padding, a window, soft-cap and sinks. Taken wherever a tile
    starts at or after its q block's first query: forced on every masked tile, the slabs drop keys the
    chunked rows see, so the check fails (the path runs and skips work)."""
    assert fa.pallas._diagonal_slabs(512, 512, True) == 2 and fa.pallas._diagonal_slabs(1024, 1024, True) == 4
    assert fa.pallas._diagonal_slabs(1024, 1024, False) == 0 and fa.pallas._diagonal_slabs(1024, 2048, True) == 0
    b = len(extra.get("seq", [0]))
    _check_forward(fa, b, 8, 2, 1100, 1100, 64, block_q=512, block_k=1024, **extra)
    if "seq" in extra:
        monkeypatch.setattr(fa.pallas, "_tile_on_diagonal", lambda *a, **k: jnp.bool_(True))
        with pytest.raises(AssertionError):
            _check_forward(fa, b, 8, 2, 1100, 1100, 64, block_q=512, block_k=1024, **extra)


def test_aligned_diagonal_masks_only_the_triangle(fa, monkeypatch):
    """A diagonal tile aligned with its q block (first key at the first query's position, no padding) masks
    only each slab's last block of keys, by the static causal triangle; any other diagonal tile keeps its
    positions. The rule on concrete sequences, then its effect: forced on a chunked prefill and left padding
    (queries see keys before the triangle they should not, or miss the offset) the check fails; forced off,
    a whole prefill takes the general diagonal and still matches."""
    aligned = functools.partial(fa.pallas._diagonal_aligned, bq=512)
    whole, chunked, padded = (np.asarray(s, np.int32) for s in ([0, 1100, 1100], [0, 1100, 700], [37, 1000, 1000]))
    assert bool(aligned(whole, 0, 0, 0)) and bool(aligned(whole, 0, 1, 512))
    assert not aligned(whole, 0, 2, 1024)  # the ragged last q block: rows past q_len
    assert not aligned(chunked, 0, 0, 0) and not aligned(chunked, 0, 0, 512)  # queries start at position 400
    assert not aligned(padded, 0, 0, 0)  # keys before kv_start
    _check_forward(fa, 1, 8, 2, 1100, 1100, 64, dtype=jnp.bfloat16, block_q=512, block_k=1024)
    monkeypatch.setattr(fa.pallas, "_diagonal_aligned", lambda *a, **k: jnp.bool_(False))
    _check_forward(fa, 1, 8, 2, 1100, 1100, 64, block_q=512, block_k=1024)
    monkeypatch.setattr(fa.pallas, "_diagonal_aligned", lambda *a, **k: jnp.bool_(True))
    for seq in ([[0, 1100, 700]], [[37, 1000, 1000]]):
        with pytest.raises(AssertionError):
            _check_forward(fa, 1, 8, 2, 1100, 1100, 64, block_q=512, block_k=1024, seq=seq)


def test_full_tiles_are_those_every_row_sees_whole(fa):
    """_full_tiles' run of tiles (the forward's unmasked loop) is exactly the tiles whose (row, key) pairs all may
    attend by the positions' mask, for random sequences (padding on both sides, q padding), causal or not, with and
    without a window, every q block and K/V block; tiles outside it go through the masked loop."""
    P = fa.pallas
    rng = np.random.default_rng(0)
    bq = cols = 128
    n = 3
    def sequences():
        for _ in range(12):
            sk, sq = (int(x) for x in rng.integers(1, 900, 2))
            kv_start = int(rng.integers(0, sk // 4 + 1))
            yield sk, sq, kv_start, int(rng.integers(kv_start, sk + 1)), int(rng.integers(0, sq + 1))
        for off in (0, 1, 126, 127, 128, 129):  # query row 0's position at each side of a tile's edge
            yield 700, 300, 0, 300 + off, 300
        for edge in (-1, 0, 1):  # kv_start and kv_end at each side of one
            yield 700, 300, 128 + edge, 640 + edge, 300

    for causal, window in [(True, None), (False, None), (True, 200), (False, 300)]:
        for sk, sq, kv_start, kv_end, q_len in sequences():
            seq = jnp.array([kv_start, kv_end, q_len], jnp.int32)
            for qi in range(-(-sq // bq)):
                for block0 in range(0, sk, n * cols):
                    lo, hi = P._full_tiles(seq, 0, qi, block0, n, cols, bq=bq, causal=causal, window=window)
                    for c in range(n):
                        ok = P._positions(seq, 0, qi * bq, block0 + c * cols, rows=bq, cols=cols, causal=causal,
                                          window=window)
                        assert bool(ok.all()) == bool(lo <= c < hi), (sk, sq, seq, causal, window, qi, block0, c)


def test_whole_sequences_schedule_at_trace_time(fa):
    """Without ``seq`` (every sequence whole) the step tables depend on shapes alone: worked out while tracing, they
    are constants of the program, so the gradient's program holds the kernels and no table ops (the argmax and
    cummax of ``_schedule``), which a run-time ``seq`` needs."""
    q, k, v, _ = _inputs(1, 4, 2, 300, 300, 64, jnp.bfloat16)

    def ops(seq):
        loss = lambda q, k, v: fa.pallas.flash_attention(q, k, v, seq=seq, block_q=128, block_k=128).astype(  # noqa: E731
            jnp.float32).sum()
        return [e.primitive.name for e in jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr.eqns]

    whole, given = ops(None), ops(jnp.array([[0, 300, 300]], jnp.int32))
    assert whole.count("pallas_call") == given.count("pallas_call") == 3  # forward, dq, dk/dv
    assert not {"argmax", "cummax"} & set(whole)
    assert {"argmax", "cummax"} <= set(given)


def test_prefill_takes_long_kv_blocks_where_they_fit(fa, monkeypatch):
    """The forward takes K/V blocks of LONG_BLOCK_K keys for a prefill with no window and no mask where the
    sequence has that many and they fit the chip's VMEM (Gemma-3 8k on TPU7x: G = 2, d 256), else the chip's
    block_k (Qwen3-235B, G = 16, would overflow TPU7x's limit); and the result matches the reference with
    long blocks over a ragged last block, causal and not, and with 2 heads a group (the unmasked tiles in pairs,
    an odd one left over before the diagonal)."""
    P = fa.pallas
    blocks = lambda sq, sk, g, d, chip="tpu7x", **kw: P._forward_blocks(  # noqa: E731
        sq, sk, g, d, 2, **{"block_q": None, "block_k": None, "chip": chip, "window": None, "has_mask": False, **kw})
    default = P.CHIP_BLOCKS["tpu7x"][1]
    assert default < P.LONG_BLOCK_K == 8192
    assert blocks(8192, 8192, 2, 256)[1] == blocks(8192, 8192, 8, 128)[1] == blocks(8192, 8192, 8, 128, "v6e")[1] == 8192
    assert blocks(8192, 8192, 16, 128)[1] == default  # 2 x 16 x 1024 query rows beside 8192 keys: over the limit
    assert blocks(8192, 8192, 2, 256, window=4096)[1] == blocks(8192, 8192, 2, 256, has_mask=True)[1] == default
    assert blocks(8192, 6000, 2, 256)[1] == default  # not that many keys
    assert blocks(8192, 8192, 2, 256, block_k=2048)[1] == 2048  # asked for
    assert blocks(8192, 8192, 2, 256, chip="")[1] == P.CHIP_BLOCKS[""][1]  # unknown chip: the defaults
    # small stand-ins for the chip's blocks and the long ones, in interpret mode
    monkeypatch.setitem(P.CHIP_BLOCKS, "tpu7x", (128, 256, 256, P.CHIP_BLOCKS["tpu7x"][3]))
    monkeypatch.setattr(P, "LONG_BLOCK_K", 512)
    assert blocks(1100, 1100, 4, 64)[1:4:2] == (512, 3)
    for causal, hq in ((True, 8), (False, 8), (True, 4)):  # 2 heads a group: full tiles in pairs, odd ones too
        _check_forward(fa, 1, hq, 2, 1100, 1100, 64, dtype=jnp.bfloat16, chip="tpu7x", causal=causal)


@pytest.mark.parametrize("scale", [0.3, -0.2])
def test_keys_major_scale_deferred_to_the_step(fa, scale):
    """Keys-major, the step scales unscaled dots (the max of the dots times the scale): a positive scale there,
    a negative one (whose scaled max is the dots' minimum) scaled before the max, both against the reference."""
    _check_forward(fa, 1, 4, 2, 600, 600, 64, block_q=512, block_k=512, scale=scale)


def test_logits_ring_sized_to_vmem(fa, monkeypatch):
    """The keys-major logits ring takes SCORES_AHEAD + 1 slots where they fit the chip's VMEM limit, else 2:
    Qwen3-235B (G = 16) 2k on TPU7x needs the smaller ring (3 slots overflowed its 48 MiB), Qwen3 (G = 8) keeps
    3. Each depth matches the reference, on a causal diagonal in slabs and ragged blocks."""
    P = fa.pallas
    vmem = P.CHIP_BLOCKS["tpu7x"][3]
    assert P._ring_slots(16, 1024, 2048, 128, 2, vmem) == 2
    assert P._ring_slots(8, 1024, 4096, 128, 2, vmem) == P.SCORES_AHEAD + 1 == 3
    for slots in (2, 3, 4):
        monkeypatch.setattr(P, "_ring_slots", lambda *a, slots=slots: slots)
        _check_forward(fa, 1, 8, 2, 1100, 1100, 64, dtype=jnp.bfloat16, block_q=512, block_k=1024)
