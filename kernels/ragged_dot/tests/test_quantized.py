"""Quantized expert weights (fp8 e4m3 with 128x128 block scales as transformers stores them, int8 with
per-channel scales) in the experts op and gmm, against a plain NumPy dequantize-then-matmul reference;
bad scales, block sizes and array types."""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from pallas_hub.verify import interpret

B = 128


def quantize_fp8(w):
    """[E, out, in] f32 -> (e4m3, f32 scale_inv [E, ceil(out/128), ceil(in/128)]), partial edge blocks, as a
    checkpoint stores them: w ~= e4m3 * scale_inv."""
    e, n, k = w.shape
    nb, kb = -(-n // B), -(-k // B)
    pad = np.zeros((e, nb * B, kb * B), np.float32)
    pad[:, :n, :k] = w
    blocks = pad.reshape(e, nb, B, kb, B)
    scale = np.abs(blocks).max(axis=(2, 4)) / 448.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    q = (blocks / scale[:, :, None, :, None]).reshape(e, nb * B, kb * B)[:, :n, :k]
    return q.astype(ml_dtypes.float8_e4m3fn), scale


def dequantize_fp8(q, scale):
    n, k = q.shape[1:]
    full = np.repeat(np.repeat(scale, B, axis=1), B, axis=2)[:, :n, :k]
    return q.astype(np.float32) * full


def quantize_int8(w):
    scale = np.abs(w).max(axis=2) / 127.0
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    return np.clip(np.round(w / scale[:, :, None]), -127, 127).astype(np.int8), scale


def make_experts(kind, e, h, i, seed=0):
    """Quantized gate_up [E, 2I, H] (gate and up quantized as separate tensors, as in a checkpoint), down
    [E, H, I], their scales, and the dequantized f32 weights."""
    rng = np.random.default_rng(seed)
    gate, up, down = (rng.standard_normal(s).astype(np.float32) * 0.2 for s in ((e, i, h), (e, i, h), (e, h, i)))
    if kind == "fp8":
        (gq, gs), (uq, us), (dq, ds) = quantize_fp8(gate), quantize_fp8(up), quantize_fp8(down)
        deq = [dequantize_fp8(gq, gs), dequantize_fp8(uq, us), dequantize_fp8(dq, ds)]
        if gs.shape[1] == 1:  # transformers keeps at least 2 scale rows for gate_up, one per half
            gs, us = gs[:, :1], us[:, :1]
    else:
        (gq, gs), (uq, us), (dq, ds) = quantize_int8(gate), quantize_int8(up), quantize_int8(down)
        deq = [q.astype(np.float32) * s[:, :, None] for q, s in ((gq, gs), (uq, us), (dq, ds))]
    gu, gu_s = np.concatenate([gq, uq], axis=1), np.concatenate([gs, us], axis=1)
    return (jnp.asarray(gu), jnp.asarray(dq), jnp.asarray(gu_s), jnp.asarray(ds)), deq


def reference(x, idx, w, gate, up, down, dtype):
    """Plain NumPy, token by token: the dequantized weights rounded to the compute dtype (as transformers'
    dequantizing load), f32 matmuls, SiLU; sentinel ids (>= E) contribute nothing."""
    rd = lambda a: np.asarray(jnp.asarray(a).astype(dtype).astype(jnp.float32))  # noqa: E731
    gate, up, down = rd(gate), rd(up), rd(down)
    x = rd(x)
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            ex = int(idx[t, j])
            if ex >= gate.shape[0]:
                continue
            g, u = gate[ex] @ x[t], up[ex] @ x[t]
            hmid = rd(g / (1 + np.exp(-g)) * u)
            out[t] += float(w[t, j]) * rd(down[ex] @ hmid)
    return out


def routing(t, e, k, empty, seed=1):
    """Top-k ids avoiding the experts in ``empty`` (so they get no tokens), one sentinel id, weights."""
    rng = np.random.default_rng(seed)
    allowed = [x for x in range(e) if x not in empty]
    idx = np.stack([rng.choice(allowed, k, replace=False) for _ in range(t)]).astype(np.int32)
    idx[t // 2, -1] = e  # an expert-parallel sentinel: never computed
    w = rng.random((t, k)).astype(np.float32)
    return idx, w


CASES = [  # kind, E, H, I, tokens, compute dtype
    pytest.param("fp8", 5, 200, 96, 13, "float32", id="fp8-H200-I96-T13-f32"),  # off the block grid both ways
    pytest.param("fp8", 4, 256, 128, 7, "bfloat16", id="fp8-H256-I128-T7-bf16"),
    pytest.param("fp8", 3, 136, 160, 21, "float32", id="fp8-H136-I160-T21-f32"),  # up starts on its own block row
    pytest.param("int8", 5, 72, 40, 11, "float32", id="int8-H72-I40-T11-f32"),
    pytest.param("int8", 4, 256, 128, 9, "bfloat16", id="int8-H256-I128-T9-bf16"),
]


@pytest.mark.parametrize("path", ["fused-in-dots", "fused-scratch", "gmm", "gmm-row-chunks", "decode"])
@pytest.mark.parametrize("kind,e,h,i,t,dtype", CASES)
def test_quantized_experts_match_dequantized_reference(load_kernel, kind, e, h, i, t, dtype, path, monkeypatch):
    """Both ways the fused kernel converts (inside each chunk's dots, or once per expert into scratch), the
    two-kernel path and the decode kernel (every case's tokens through it)."""
    k = load_kernel("ragged_dot")
    in_dots, decoded = [], []
    real = k.pallas.dequantize_in_dots
    monkeypatch.setattr(k.pallas, "dequantize_in_dots", lambda *a: in_dots.append(path == "fused-in-dots") or in_dots[-1])
    monkeypatch.setattr(k.pallas, "DECODE_TOKENS", t if path == "decode" else 0)
    decode = k.pallas.decode_moe
    monkeypatch.setattr(k.pallas, "decode_moe", lambda *a, **kw: decoded.append(t) or decode(*a, **kw))
    (gu, dn, gus, dns), (gate, up, down) = make_experts(kind, e, h, i)
    idx, w = routing(t, e, 2, empty={1})
    x = np.random.default_rng(2).standard_normal((t, h)).astype(np.float32)
    if path.startswith("gmm"):  # the two-kernel path (experts too large for VMEM whole)
        monkeypatch.setattr(k.pallas, "fused_moe_tiling", lambda *a, **kw: None)
    calls = chunk_rows_in_big_tiles(k, monkeypatch) if path == "gmm-row-chunks" else [16, 16]
    with interpret("fast"):
        out = k.experts.experts(jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(w, dtype), gu, dn,
                                gate_up_scale=gus, down_scale=dns)
    assert out.dtype == jnp.dtype(dtype) and out.shape == (t, h)
    # the path asked for ran
    assert in_dots == ([] if path.startswith("gmm") or path == "decode" else [path == "fused-in-dots"])
    assert decoded == ([t] if path == "decode" else [])
    assert calls == [16, 16]  # (gmm-row-chunks) both projections ran the chunk loop
    assert path.startswith("gmm") or real(2 * t, e, 32, gu.dtype, None)  # decode-sized: the default converts in the dots
    ref = reference(x, idx, np.asarray(jnp.asarray(w, dtype).astype(jnp.float32)), gate, up, down, dtype)
    tol = 2e-5 if dtype == "float32" else 2e-2  # bf16: the intermediate and the down output round to bf16
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=tol, atol=tol * np.abs(ref).max())


def chunk_rows_in_big_tiles(k, monkeypatch):
    """gmm in 64-row tiles, each group's rows in chunks of one native tile: the decode loop on small tests."""
    real = k.pallas.choose_gmm_tiling
    monkeypatch.setattr(k.pallas, "choose_gmm_tiling", lambda *a, **kw: (64, real(*a, **kw)[1]))
    monkeypatch.setattr(k.pallas, "gmm_chunk_rows", lambda m, g, tm, chip=None: 16 if tm == 64 else tm)
    calls = []
    kernel = k.pallas._gmm_kernel
    monkeypatch.setattr(k.pallas, "_gmm_kernel", lambda *a, **kw: calls.append(kw["chunk"]) or kernel(*a, **kw))
    return calls


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_gmm_quantized_n_tiles_and_overhang(load_kernel, kind):
    """gmm alone with several n tiles, the last one overhanging n (its scale rows are padded), an empty
    group and rows past sum(group_sizes)."""
    P = load_kernel("ragged_dot").pallas
    rng = np.random.default_rng(3)
    g, n, kk, m = 4, 320, 136, 50
    wf = rng.standard_normal((g, n, kk)).astype(np.float32)
    q, s = quantize_fp8(wf) if kind == "fp8" else quantize_int8(wf)
    deq = dequantize_fp8(q, s) if kind == "fp8" else q.astype(np.float32) * s[:, :, None]
    x = rng.standard_normal((m, kk)).astype(np.float32)
    sizes = np.array([11, 0, 30, 4], np.int32)
    with interpret("fast"):
        out = P.gmm(jnp.asarray(x), jnp.asarray(q), jnp.asarray(sizes), transposed=True, rhs_scale=jnp.asarray(s),
                    tm=16, tn=128)
    ref = np.zeros((m, n), np.float32)
    ends = np.cumsum(sizes)
    for gi in range(g):
        ref[ends[gi] - sizes[gi]:ends[gi]] = x[ends[gi] - sizes[gi]:ends[gi]] @ deq[gi].T
    np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.strict_interpret
def test_strict_interpreter_quantized_fused_and_gmm(load_kernel, monkeypatch):
    """The strict TPU interpreter (out-of-bounds reads raise, uninitialised memory is NaN, races
    detected) on the quantized paths (fused, converting in the dots or into scratch; decode; gmm), fp8 off
    the block grid, an expert with no tokens."""
    k = load_kernel("ragged_dot")
    e, h, i, t = 3, 136, 96, 9
    (gu, dn, gus, dns), (gate, up, down) = make_experts("fp8", e, h, i, seed=4)
    idx, w = routing(t, e, 2, empty={2}, seed=5)
    x = np.random.default_rng(6).standard_normal((t, h)).astype(np.float32)
    ref = reference(x, idx, w, gate, up, down, "float32")
    for fused, in_dots, decode in ((True, True, 0), (True, False, 0), (True, None, t), (False, None, 0)):
        monkeypatch.setattr(k.pallas, "dequantize_in_dots", lambda *a, v=in_dots: v)
        monkeypatch.setattr(k.pallas, "DECODE_TOKENS", decode)  # t: the decode kernel
        if not fused:
            monkeypatch.setattr(k.pallas, "fused_moe_tiling", lambda *a, **kw: None)
        with interpret("strict"):
            out = k.experts.experts(jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), gu, dn,
                                    gate_up_scale=gus, down_scale=dns)
        np.testing.assert_allclose(np.asarray(out), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_quantized_layer_whose_sums_fit_in_some_columns(load_kernel, kind, monkeypatch):
    """Quantized weights in a layer that sums only some columns in the kernel (``pallas.fused_moe_sum_cols``,
    which since the windows' own sizing can pick it on any chip): 128 of 384 columns, in windows of a group's
    rows, an empty expert and a sentinel, against the same layer summed whole in the kernel, bit for bit, and
    the dequantized reference."""
    k = load_kernel("ragged_dot")
    e, h, i, t = 8, 384, 128, 100
    (gu, dn, gus, dns), (gate, up, down) = make_experts(kind, e, h, i, seed=3)
    idx, w = routing(t, e, 2, empty={5}, seed=7)
    x = np.random.default_rng(8).standard_normal((t, h)).astype(np.float32)
    args = (jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), gu, dn)
    monkeypatch.setattr(k.pallas, "fused_moe_tiling", lambda m, hh, ii, **kw: (64, 32, ii))
    monkeypatch.setattr(k.pallas, "fused_moe_gathers", lambda *a, **kw: False)
    with interpret("strict"):
        whole = k.experts.experts(*args, gate_up_scale=gus, down_scale=dns)
    calls, fused = [], k.pallas.fused_moe

    def spy(*a, sum_cols=None, **kw):
        calls.append(sum_cols)
        return fused(*a, sum_cols=sum_cols, **kw)
    monkeypatch.setattr(k.pallas, "fused_moe", spy)
    monkeypatch.setattr(k.pallas, "fused_moe_sum_cols", lambda *a, **kw: 128)
    with interpret("strict"):
        split = k.experts.experts(*args, gate_up_scale=gus, down_scale=dns)
    assert calls == [128]
    np.testing.assert_array_equal(np.asarray(split), np.asarray(whole))
    ref = reference(x, idx, w, gate, up, down, "float32")
    np.testing.assert_allclose(np.asarray(split), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


def test_quantized_torch_op(load_kernel):
    """The torch op takes torch.float8_e4m3fn weights and f32 scales (what FP8Experts holds)."""
    import torch

    k = load_kernel("ragged_dot")
    e, h, i, t = 4, 136, 64, 5
    (gu, dn, gus, dns), (gate, up, down) = make_experts("fp8", e, h, i, seed=7)
    idx, w = routing(t, e, 2, empty={0}, seed=8)
    x = np.random.default_rng(9).standard_normal((t, h)).astype(np.float32)
    tt = lambda a: torch.from_numpy(np.array(a.astype(jnp.float32) if a.dtype == jnp.float8_e4m3fn else a))  # noqa: E731
    out = k.experts_op(torch.from_numpy(x), torch.from_numpy(idx).long(), torch.from_numpy(w),
                       tt(gu).to(torch.float8_e4m3fn), tt(dn).to(torch.float8_e4m3fn), gate_up_scale=tt(gus),
                       down_scale=tt(dns))
    ref = reference(x, idx, w, gate, up, down, "float32")
    np.testing.assert_allclose(out.numpy(), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


# --------------------------------------------------------------------------- bad input

def test_bad_scales_block_sizes_and_array_types(load_kernel):
    X = load_kernel("ragged_dot").experts
    e, h, i, t = 4, 256, 128, 3
    (gu, dn, gus, dns), _ = make_experts("fp8", e, h, i)
    x, idx, w = jnp.zeros((t, h)), jnp.zeros((t, 2), jnp.int32), jnp.zeros((t, 2))
    call = lambda *a, **kw: X.validate(x, idx, w, *a, **kw)  # noqa: E731
    call(gu, dn, gate_up_scale=gus, down_scale=dns)  # fine
    with pytest.raises(ValueError, match="gate_up_scale is missing"):
        call(gu, dn)
    with pytest.raises(ValueError, match=r"down_scale must be \[4, 2, 1\] .* got \[4, 2, 2\]"):
        call(gu, dn, gate_up_scale=gus, down_scale=jnp.zeros((e, 2, 2)))
    with pytest.raises(ValueError, match=r"gate_up_scale must be \[4, 2, 2\]"):
        call(gu, dn, gate_up_scale=gus[:, :1], down_scale=dns)
    with pytest.raises(TypeError, match="down_scale must have dtype float32, got bfloat16"):
        call(gu, dn, gate_up_scale=gus, down_scale=dns.astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="block_size must be 128.* got 64"):
        call(gu, dn, gate_up_scale=gus, down_scale=dns, block_size=64)
    with pytest.raises(TypeError, match="gate_up_scale is given but gate_up_proj has dtype float32"):
        call(gu.astype(jnp.float32), dn.astype(jnp.float32), gate_up_scale=gus, down_scale=dns)
    with pytest.raises(TypeError, match="gate_up_proj must have dtype one of .*float8_e4m3fn, int8, uint8, got float8_e5m2"):
        call(gu.astype(jnp.float8_e5m2), dn.astype(jnp.float8_e5m2), gate_up_scale=gus, down_scale=dns)
    with pytest.raises(TypeError, match="down_proj must have dtype int8, got float8_e4m3fn"):
        call(gu.astype(jnp.int8), dn, gate_up_scale=gus, down_scale=dns)
    with pytest.raises(NotImplementedError, match="fp8 and int8 only in transformers' .E, 2I, H. / .E, H, I. layout"):
        call(jnp.swapaxes(gu, 1, 2), jnp.swapaxes(dn, 1, 2), gate_up_scale=gus, down_scale=dns, is_transposed=True)
    with pytest.raises(ValueError, match=r"down_scale must have 2 dimensions, got shape \(4, 2, 1\)"):
        call(gu.astype(jnp.int8), dn.astype(jnp.int8), gate_up_scale=jnp.zeros((e, 2 * i)), down_scale=dns)

    # MXFP4: packed [E, 2I, H/2] / [E, H, I/2] uint8 with uint8 e8m0 scales per 32 inputs
    gu4, dn4 = jnp.zeros((e, 2 * i, h // 2), jnp.uint8), jnp.zeros((e, h, i // 2), jnp.uint8)
    gus4, dns4 = jnp.zeros((e, 2 * i, h // 32), jnp.uint8), jnp.zeros((e, h, i // 32), jnp.uint8)
    call(gu4, dn4, gate_up_scale=gus4, down_scale=dns4, interleaved=True)  # fine
    with pytest.raises(TypeError, match="down_scale must have dtype uint8, got float32"):
        call(gu4, dn4, gate_up_scale=gus4, down_scale=dns4.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"gate_up_scale must be \[4, 256, 8\] for uint8"):
        call(gu4, dn4, gate_up_scale=gus4[:, :, :4], down_scale=dns4)
    # the kernel's layout (is_transposed): [E, in/2, out] with scales [E, >= in/32, out], rows past in/32 padding
    gut, dnt = jnp.swapaxes(gu4, 1, 2), jnp.swapaxes(dn4, 1, 2)
    pad = lambda a, r: jnp.pad(jnp.swapaxes(a, 1, 2), ((0, 0), (0, r), (0, 0)))  # noqa: E731
    for rows in (0, 3, 24):  # from_pretrained_mxfp4 pads to a multiple of 32 (8 -> 32: 24 rows); any padding is read past
        call(gut, dnt, gate_up_scale=pad(gus4, rows), down_scale=pad(dns4, rows), is_transposed=True, interleaved=True)
    with pytest.raises(ValueError, match=r"down_scale must be \[4, >= 4, 256\] .* got \[4, 3, 256\]"):
        call(gut, dnt, gate_up_scale=pad(gus4, 0), down_scale=pad(dns4, 0)[:, :3], is_transposed=True, interleaved=True)
    with pytest.raises(ValueError, match="MXFP4 weights need whole 32-value blocks"):  # H = 240: 7.5 blocks
        X.validate(jnp.zeros((t, 240)), idx, w, gu4[:, :, :120], jnp.zeros((e, 240, i // 2), jnp.uint8),
                   gate_up_scale=gus4, down_scale=dns4, interleaved=True)

    class QArray:  # an array-like quantized wrapper (e.g. qwix): refused by name, not deep in pallas_call
        shape, dtype, qvalue = gu.shape, gu.dtype, gu

    with pytest.raises(TypeError, match="gate_up_proj is a .*QArray: pass its quantized values as gate_up_proj and its scales as gate_up_scale"):
        call(QArray(), dn, gate_up_scale=gus, down_scale=dns)


# --------------------------------------------------------------------------- MXFP4 (GPT-OSS)

FP4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def quantize_mxfp4(w):
    """[E, N, K] -> (blocks [E, N, K/2] uint8, low nibble = even input; scales [E, N, K/32] uint8 e8m0):
    OCP MX, shared exponent floor(log2(amax)) - 2, nearest e2m1 value (by table lookup)."""
    e, n, k = w.shape
    x = w.reshape(e, n, k // 32, 32)
    amax = np.abs(x).max(-1, keepdims=True)
    exp = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).clip(-127, 127)
    codes = np.abs(x / np.exp2(exp))[..., None] - FP4[:8]
    codes = np.abs(codes).argmin(-1) | ((x < 0) << 3)
    codes = codes.reshape(e, n, k // 2, 2).astype(np.uint8)
    return (codes[..., 0] | (codes[..., 1] << 4)).astype(np.uint8), (exp[..., 0] + 127).astype(np.uint8)


def dequantize_mxfp4(blocks, scales):
    e, n, half = blocks.shape
    vals = np.stack([FP4[blocks & 15], FP4[blocks >> 4]], -1).reshape(e, n, half * 2)
    return vals * np.repeat(np.exp2(scales.astype(np.float32) - 127), 32, axis=2)


def gpt_oss_reference(x, idx, w, gate_up, gu_bias, down, dn_bias, dtype, alpha=1.702, limit=7.0):
    """GPT-OSS's experts, token by token: interleaved gate/up rows, biases, clamped swiglu."""
    rd = lambda a: np.asarray(jnp.asarray(a).astype(dtype).astype(jnp.float32))  # noqa: E731
    gate_up, down, gu_bias, dn_bias, x = rd(gate_up), rd(down), rd(gu_bias), rd(dn_bias), rd(x)
    out = np.zeros(x.shape, np.float32)
    for t in range(x.shape[0]):
        for j in range(idx.shape[1]):
            ex = int(idx[t, j])
            if ex >= gate_up.shape[0]:
                continue
            gu = gate_up[ex] @ x[t] + gu_bias[ex]
            gate, up = np.minimum(gu[0::2], limit), np.clip(gu[1::2], -limit, limit)
            h = rd((up + 1) * gate / (1 + np.exp(-alpha * gate)))
            out[t] += float(w[t, j]) * rd(down[ex] @ h + dn_bias[ex])
    return out


@pytest.mark.parametrize("dtype,stored,chunks", [("float32", False, False), ("bfloat16", False, False),
                                                ("bfloat16", True, False), ("float32", False, True)])
def test_mxfp4_gpt_oss_experts_match_dequantized_reference(load_kernel, dtype, stored, chunks, monkeypatch):
    """MXFP4 blocks/scales as GPT-OSS's checkpoint holds them, or (``stored``) as from_pretrained_mxfp4 stores
    them ([E, in/2, out], scale rows padded to 32; is_transposed). H = 288 (144 packed rows: one 128-row decode
    chunk and a tail) and I = 64, off the 128 grid; an expert with no tokens, 11 tokens, a sentinel: the
    two-kernel path against NumPy's table-lookup dequantization; ``chunks``: gmm's decode loop over a group's
    rows in 16-row chunks of 64-row tiles."""
    import torch

    from pallas_hub.hub.quantized import mxfp4_kernel_layout

    k = load_kernel("ragged_dot")
    if chunks:
        calls = chunk_rows_in_big_tiles(k, monkeypatch)
    rng = np.random.default_rng(10)
    e, h, i, t = 4, 288, 64, 11
    gate_up = rng.standard_normal((e, 2 * i, h)).astype(np.float32) * 0.3
    down = rng.standard_normal((e, h, i)).astype(np.float32) * 0.3
    (gub, gus), (dnb, dns) = quantize_mxfp4(gate_up), quantize_mxfp4(down)
    gu_bias, dn_bias = (rng.standard_normal(s).astype(np.float32) * 0.1 for s in ((e, 2 * i), (e, h)))
    idx, w = routing(t, e, 2, empty={2}, seed=11)
    x = rng.standard_normal((t, h)).astype(np.float32)
    weights = [gub, dnb, gus, dns]
    if stored:
        (gu_k, gus_k), (dn_k, dns_k) = (mxfp4_kernel_layout(torch.from_numpy(b), torch.from_numpy(s_))
                                        for b, s_ in ((gub, gus), (dnb, dns)))
        weights = [a.numpy() for a in (gu_k, dn_k, gus_k, dns_k)]
        assert weights[2].shape == (e, 32, 2 * i) and weights[0].shape == (e, h // 2, 2 * i)
    gu_arg, dn_arg, gus_arg, dns_arg = (jnp.asarray(a) for a in weights)
    with interpret("fast"):
        out = jax.jit(functools.partial(k.experts.experts, activation="swiglu_oai", interleaved=True,
                                        is_transposed=stored))(
            jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(w, dtype), gu_arg, dn_arg,
            jnp.asarray(gu_bias, dtype), jnp.asarray(dn_bias, dtype), gate_up_scale=gus_arg, down_scale=dns_arg)
    ref = gpt_oss_reference(x, idx, np.asarray(jnp.asarray(w, dtype).astype(jnp.float32)), dequantize_mxfp4(gub, gus),
                            gu_bias, dequantize_mxfp4(dnb, dns), dn_bias, dtype)
    tol = 2e-5 if dtype == "float32" else 2e-2
    np.testing.assert_allclose(np.asarray(out, np.float32), ref, rtol=tol, atol=tol * np.abs(ref).max())
    assert not chunks or calls == [16, 16]  # both projections ran the chunk loop


@pytest.mark.parametrize("mode", ["fast", "strict"])
@pytest.mark.parametrize("dtype,chip", [("float32", "v5e"), ("bfloat16", "v5e"), ("bfloat16", "v6e")])
def test_mxfp4_gmm_decodes_in_the_dots_as_in_scratch(load_kernel, dtype, chip, mode):
    """gmm on MXFP4 weights [g, k/2, n] both ways: decoded inside each chunk's dots (``in_dots``: a loop
    over 128-byte-row pieces plus a 32-row rest, per 256-column piece plus a 44-column rest) and once per
    block into scratch, in 32-row tiles of 16-row chunks: groups of 7 rows, none, 21 (straddling a tile)
    and 3, rows past the groups; f32 and bf16 (packed bf16 products on v6e). Against NumPy's dequantized
    matmul, rounded to the output dtype."""
    P = load_kernel("ragged_dot").pallas
    rng = np.random.default_rng(12)
    g, k, n, m = 4, 320, 300, 40
    blocks = rng.integers(0, 256, (g, k // 2, n)).astype(np.uint8)
    scales = rng.integers(122, 130, (g, 32, n)).astype(np.uint8)  # k/32 = 10 rows, padded to 32 (any value)
    scales[:, k // 32:] = 255
    sizes = np.array([7, 0, 21, 3], np.int32)
    w = np.stack([FP4[blocks & 15], FP4[blocks >> 4]], 2).reshape(g, k, n)  # input 2r: row r's low nibble
    w = w * np.exp2(np.repeat(scales[:, :k // 32].astype(np.float32), 32, 1) - 127)
    x = rng.standard_normal((m, k)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype).astype(jnp.float32))
    ref, r0 = np.zeros((m, n), np.float32), 0
    for e, size in enumerate(sizes):
        ref[r0:r0 + size] = x[r0:r0 + size] @ w[e]
        r0 += size
    # the default: in the dots for groups of up to 2 rows on average, and k/2 in whole 32-byte-row tiles
    assert P.mxfp4_in_dots(8, g, k) and not P.mxfp4_in_dots(8, g, k + 32) and not P.mxfp4_in_dots(12, g, k)
    outs = []
    for in_dots in (True, False):
        with interpret(mode):
            outs.append(np.asarray(P.gmm(jnp.asarray(x, dtype), jnp.asarray(blocks), jnp.asarray(sizes),
                                         rhs_scale=jnp.asarray(scales), tm=32, chunk=16, chip=chip,
                                         in_dots=in_dots).astype(jnp.float32)))
    tol = 1e-5 if dtype == "float32" else 1e-2
    for out in outs:
        np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref).max())
    with pytest.raises(ValueError, match="in_dots: MXFP4 weights with k/2 a multiple of 32"):
        P.gmm(jnp.asarray(x[:, :k - 32], dtype), jnp.asarray(blocks[:, :k // 2 - 16]), jnp.asarray(sizes),
              rhs_scale=jnp.asarray(scales), tm=32, chunk=16, chip=chip, in_dots=True)


def _decode_mxfp4(k, blocks, scales, dtype, bf16_vpu=False):
    """The kernel's MXFP4 decode of one [k/2, n] block (interpret mode): (even-input rows, odd-input rows),
    times the kernel's MXFP4_UNIT (2^-14, which its f32 sums take back)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    P = k.pallas
    kh, n = blocks.shape
    lo_hi = jax.ShapeDtypeStruct((kh, n), dtype)

    def kernel(w_ref, s_ref, lo_ref, hi_ref, s_scr):
        P._dequantize_mxfp4(lo_ref, hi_ref, w_ref, s_ref, s_scr, bf16_vpu=bf16_vpu)

    with interpret("fast"):
        return pl.pallas_call(kernel, out_shape=(lo_hi, lo_hi),
                              scratch_shapes=[pltpu.VMEM((P._round_up(scales.shape[0], 8), n), jnp.float32)])(
            jnp.asarray(blocks), jnp.asarray(scales))


@pytest.mark.parametrize("bf16_vpu", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_decode_every_code_and_extreme_scales(load_kernel, dtype, bf16_vpu):
    """Every byte (all 16 x 16 e2m1 code pairs) under e8m0 scales from 0 to 254 (2^-127 .. 2^127: zero,
    subnormal and overflowing products included), against transformers' convert_moe_packed_tensors. The
    decode holds weights times 2^-14 (scaled back here in f32, as the kernel's sums are): weights below 2^-112
    may read as zero (TPU has no subnormals); 2^127 x 4 and x 6 are inf.
    K/2 = 400 byte rows: three 128-row chunks and a 16-row tail; padded scale rows are ignored. Products in f32
    or (``bf16_vpu``, for a bf16 result) in packed bf16."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    k = load_kernel("ragged_dot")
    scale_values = np.array([0, 1, 2, 3, 100, 126, 127, 128, 200, 252, 253, 254], np.uint8)
    kh, n = 400, 300  # byte rows (25 scale rows), columns (not a multiple of 128)
    rng = np.random.default_rng(5)
    blocks = np.arange(kh * n, dtype=np.int64).reshape(kh, n) % 256  # every byte value in every column phase
    blocks = ((blocks + rng.integers(0, 256, (1, n))) % 256).astype(np.uint8)
    scales = scale_values[np.arange(25 * n).reshape(25, n) % len(scale_values)]
    padded = np.concatenate([scales, np.full((7, n), 255, np.uint8)])  # padding rows (255: NaN if used)
    assert k.pallas.MXFP4_UNIT == 2.0 ** -14
    with np.errstate(over="ignore"):
        lo, hi = (np.asarray(a, np.float32) * np.float32(2 ** 14)
                  for a in _decode_mxfp4(k, blocks, padded, getattr(jnp, dtype), bf16_vpu))
    # transformers: blocks [out, in/32, 16], scales [out, in/32] -> [in, out] (dequantized inputs along dim 0)
    tdt = getattr(torch, dtype)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks.T.reshape(n, 25, 16).copy())[None],
                                        torch.from_numpy(scales.T.copy())[None], dtype=tdt)[0].float().numpy()
    theirs = theirs.reshape(n, kh, 2) if theirs.shape[0] == n else theirs.T.reshape(n, kh, 2)
    zero_scale = np.repeat(scales, 16, 0) == 0
    for ours, ref in ((lo, theirs[:, :, 0].T), (hi, theirs[:, :, 1].T)):
        # s = 0 (2^-127, not a normal f32) decodes to 0; so do weights whose 2^-14 multiple is not normal
        flushed = zero_scale | (np.abs(ref) < 2.0 ** -112)
        np.testing.assert_array_equal(ours[~flushed], ref[~flushed])
        assert np.all((ours[flushed] == 0) | (ours[flushed] == ref[flushed])) and np.abs(ref[flushed]).max() < 2e-33
        assert np.isinf(ours).sum() == np.isinf(ref).sum() > 0 and not np.isnan(ours).any()
        assert np.all(np.signbit(ours) == np.signbit(ref))  # -0 included
    # an independent table: nibble values times 2^(s - 127) (every product exact in f64)
    vals = FP4[np.stack([blocks & 15, blocks >> 4])] * np.exp2(np.repeat(scales, 16, 0).astype(np.float64) - 127)
    with np.errstate(over="ignore"):
        vals = vals.astype(np.float32).astype(np.dtype(getattr(ml_dtypes, dtype, dtype))).astype(np.float32)
    ok = (np.abs(vals) >= 2.0 ** -112) & ~zero_scale
    np.testing.assert_array_equal(np.stack([lo, hi])[ok], vals[ok])
    assert (np.stack([lo, hi])[~ok] == 0).all()


def _dequantize_fp8_block(k, w, scales, dtype, *, block0, row_off, mode):
    """The kernel's fp8 dequantization of one weight block (interpret mode), converting as ``mode`` (e4m3_mode)."""
    from jax.experimental import pallas as pl

    def kernel(w_ref, s_ref, out_ref):
        k.pallas._dequantize(out_ref, w_ref, s_ref, block0=block0, row_off=row_off, e4m3=mode)

    with interpret("fast"):
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(w.shape, dtype))(jnp.asarray(w),
                                                                                      jnp.asarray(scales))


@pytest.mark.parametrize("mode", ["f32", "bf16", "native"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("rows,cols,block0,row_off", [(300, 600, 1, 50), (256, 384, 0, 0), (77, 130, 2, 120)])
def test_fp8_dequantize_every_code_and_block_scale(load_kernel, dtype, rows, cols, block0, row_off, mode):
    """Every float8_e4m3fn byte (subnormals, -0, the NaN codes 0x7f / 0xff) in every column phase, under a
    grid of block scales (powers of two and not, tiny to large), through the kernel's dequantization with
    the block row offsets the up half uses (``block0``, ``row_off``) and shapes off the 128 grid (pieces
    of 128 rows within a block row, 256 columns, 128 or fewer at the end), against ml_dtypes' decode times the
    scale in the destination dtype (transformers' ``_dequantize_fp8_weight``); in each way the kernel converts
    (``e4m3_mode``: the e4m3b11fnuz unpack with -0 cleared in the 32-bit words or by a compare of the values,
    or a plain conversion). The NaN codes read as NaN where the chip converts e4m3fn, +-480 times the scale
    where it unpacks e4m3b11fnuz (the documented contract)."""
    k = load_kernel("ragged_dot")
    rng = np.random.default_rng(7)
    codes = (np.arange(rows * cols).reshape(rows, cols) + rng.integers(0, 256, (rows, 1))) % 256
    w = codes.astype(np.uint8).view(ml_dtypes.float8_e4m3fn)
    nb, kb = block0 + -(-(row_off + rows) // B) + 1, -(-cols // B)  # a spare block row after the used ones
    values = np.array([1.0, 0.37, 3.1e-3, 2.0 ** -20, 1.7e4, 2.0 ** 9, 0.5, 11.0], np.float32)
    scales = values[rng.integers(0, len(values), (nb, kb))]
    out = np.asarray(_dequantize_fp8_block(k, w, scales, getattr(jnp, dtype), block0=block0, row_off=row_off, mode=mode),
                     np.float32)
    dt = np.dtype(getattr(ml_dtypes, dtype, dtype))
    full = np.repeat(np.repeat(scales, B, 0), B, 1)[block0 * B + row_off:block0 * B + row_off + rows, :cols]
    full = full.astype(dt).astype(np.float32)  # the scale in the destination dtype; w * scale is exact in f32
    nan = (codes & 0x7F) == 0x7F
    if mode != "native":
        w = np.where(nan, np.where(codes & 0x80, -480.0, 480.0), w.astype(np.float32))
        nan = np.zeros_like(nan)
    ref = (w.astype(np.float32) * full).astype(dt).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(out), nan)
    np.testing.assert_array_equal(out[~nan], ref[~nan])  # -0 compares equal to the 0 the unpack gives it
