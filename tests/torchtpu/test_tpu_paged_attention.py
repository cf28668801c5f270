"""paged-attention-tpu on TorchTPU's `tpu` device: the ragged paged op with int32 and int64
metadata, the KV writes (functional, and in place without host syncs or cache copies), and
paged_attention_forward as transformers' continuous batching calls it: decode (block tables into
the paged cache), prefill, mixed batches and sliding-window layers (K/V gathered per request)."""

import pytest
import torch

HQ, HKV, D, PAGE, PAGES = 8, 2, 128, 16, 12


@pytest.fixture(scope="module")
def pa(load_kernel):
    return load_kernel("paged_attention", "torch-tpu")


def _paged_cache(on_tpu):
    """One layer's K and V page views as transformers' paged cache makes them: offset views of one
    buffer whose pages alternate between K and V (cache_allocators/full_attention.py)."""
    flat = on_tpu.empty((PAGES + 1) * PAGE, HKV, D)
    return flat.view(-1, PAGE, HKV, D)[:PAGES], flat[PAGE:].view(-1, PAGE, HKV, D)[:PAGES]


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_ragged_paged_attention(pa, on_tpu, index_dtype):
    q, kp, vp = on_tpu.empty(19, HQ, D), on_tpu.empty(PAGES, PAGE, HKV, D), on_tpu.empty(PAGES, PAGE, HKV, D)
    kv_lens, table, cu = (on_tpu.empty(*s, dtype=index_dtype) for s in ((3,), (3, 4), (4,)))
    sinks = on_tpu.empty(HQ)
    out = on_tpu(pa, lambda: pa.ragged_paged_attention(q, kp, vp, kv_lens, table, cu, sinks, scale=0.1, window=8))
    assert (tuple(out.shape), out.dtype, out.device.type) == ((19, HQ, D), torch.bfloat16, "tpu")
    if on_tpu.kind == "eager":
        (launch,) = on_tpu.checker.launches
        assert [p.dtype for p in launch.params[3:6]] == [torch.int32] * 3


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_kv_functional(pa, on_tpu, index_dtype):
    kp, vp = on_tpu.empty(PAGES, PAGE, HKV, D), on_tpu.empty(PAGES, PAGE, HKV, D)
    new_k, new_v = on_tpu.empty(5, HKV, D), on_tpu.empty(5, HKV, D)
    kv_lens, table, cu = (on_tpu.empty(*s, dtype=index_dtype) for s in ((2,), (2, 4), (3,)))
    k, v = on_tpu(pa, lambda: pa.write_kv(kp, vp, new_k, new_v, kv_lens, table, cu))
    assert tuple(k.shape) == tuple(v.shape) == (PAGES, PAGE, HKV, D)
    if on_tpu.kind == "eager":
        (launch,) = on_tpu.checker.launches
        assert [p.dtype for p in launch.params[4:]] == [torch.int32] * 3


def test_write_and_attend(pa, on_tpu):
    """The fused op: one launch writes the new rows and attends; the caches come back as new tensors."""
    kp, vp = on_tpu.empty(PAGES, PAGE, HKV, D), on_tpu.empty(PAGES, PAGE, HKV, D)
    q, new_k, new_v = on_tpu.empty(5, HQ, D), on_tpu.empty(5, HKV, D), on_tpu.empty(5, HKV, D)
    kv_lens, table, cu = (on_tpu.empty(*s, dtype=torch.int64) for s in ((2,), (2, 4), (3,)))
    out, k, v = on_tpu(pa, lambda: pa.write_and_attend(q, new_k, new_v, kp, vp, kv_lens, table, cu))
    assert (tuple(out.shape), tuple(k.shape), tuple(v.shape)) == ((5, HQ, D), (PAGES, PAGE, HKV, D), (PAGES, PAGE, HKV, D))
    assert out.device.type == k.device.type == "tpu"
    if on_tpu.kind == "eager":
        (launch,) = on_tpu.checker.launches
        assert [p.dtype for p in launch.params[5:8]] == [torch.int32] * 3


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.int8])
def test_quantized_cache_write_and_attend(pa, on_tpu, cache_dtype):
    """A 1-byte cache with per-KV-head scales: the functional write (quantizing) and the read."""
    kp, vp = (on_tpu.empty(PAGES, PAGE, HKV, D, dtype=cache_dtype) for _ in range(2))
    ks, vs = on_tpu.empty(HKV, dtype=torch.float32), on_tpu.empty(HKV, dtype=torch.float32)
    q, new_k, new_v = on_tpu.empty(5, HQ, D), on_tpu.empty(5, HKV, D), on_tpu.empty(5, HKV, D)
    kv_lens, table, cu = (on_tpu.empty(*s, dtype=torch.int32) for s in ((2,), (2, 4), (3,)))
    k, v = on_tpu(pa, lambda: pa.write_kv(kp, vp, new_k, new_v, kv_lens, table, cu, ks, vs))
    assert (k.dtype, v.dtype, tuple(k.shape)) == (cache_dtype, cache_dtype, (PAGES, PAGE, HKV, D))
    out = on_tpu(pa, lambda: pa.ragged_paged_attention(q, k, v, kv_lens, table, cu, k_scale=ks, v_scale=vs))
    assert (tuple(out.shape), out.dtype, out.device.type) == ((5, HQ, D), torch.bfloat16, "tpu")
    if on_tpu.kind == "eager":
        write, attend = on_tpu.checker.launches
        assert write.params[0].dtype == attend.params[1].dtype == cache_dtype


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_write_kv_in_place_launches_only_the_small_target_op(pa, eager_tpu, index_dtype):
    k_cache, v_cache = _paged_cache(eager_tpu)
    new_k, new_v = eager_tpu.empty(5, HKV, D), eager_tpu.empty(5, HKV, D)
    kv_lens, table, cu = (eager_tpu.empty(*s, dtype=index_dtype) for s in ((2,), (2, 4), (3,)))
    eager_tpu(pa, lambda: pa.write_kv_(k_cache, v_cache, new_k, new_v, kv_lens, table, cu))
    (launch,) = eager_tpu.checker.launches  # the targets, on the device: never a cache
    assert launch.name.endswith("::write_targets_jax") and len(launch.inputs) == 3
    assert [p.dtype for p in launch.params] == [torch.int32] * 3 and launch.results[0].shape == (5,)


def test_quantized_write_kv_in_place_launches_the_target_and_quantize_ops(pa, eager_tpu):
    k_cache, v_cache = (eager_tpu.empty(PAGES, PAGE, HKV, D, dtype=torch.float8_e4m3fn) for _ in range(2))
    ks, vs = eager_tpu.empty(HKV, dtype=torch.float32), eager_tpu.empty(HKV, dtype=torch.float32)
    new_k, new_v = eager_tpu.empty(5, HKV, D), eager_tpu.empty(5, HKV, D)
    kv_lens, table, cu = (eager_tpu.empty(*s, dtype=torch.int32) for s in ((2,), (2, 4), (3,)))
    eager_tpu(pa, lambda: pa.write_kv_(k_cache, v_cache, new_k, new_v, kv_lens, table, cu, ks, vs))
    names = sorted(launch.name.rsplit("::", 1)[1] for launch in eager_tpu.checker.launches)
    assert names == ["quantize_kv_jax", "quantize_kv_jax", "write_targets_jax"]
    assert {launch.results[0].dtype for launch in eager_tpu.checker.launches
            if launch.name.endswith("quantize_kv_jax")} == {torch.float8_e4m3fn}


def test_write_kv_in_place_hands_torch_tpu_only_in_place_row_writes(pa):
    """What torch_tpu is given per call: the small target op, then one index_put_ of the T new rows
    into each cache (in place: torch_tpu runs in-place ops with the buffer donated, its default). No
    host sync, no cache-sized copy or temporary."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch_tpu._internal import execution_mode

    assert execution_mode.disable_inplace_buffer_donation is False
    with FakeTensorMode():
        args = [torch.empty(s, dtype=t, device="tpu") for s, t in (
            ((PAGES, PAGE, HKV, D), torch.bfloat16), ((PAGES, PAGE, HKV, D), torch.bfloat16),
            ((5, HKV, D), torch.bfloat16), ((5, HKV, D), torch.bfloat16),
            ((2,), torch.int64), ((2, 4), torch.int64), ((3,), torch.int64))]
    unquantized = lambda kc, vc, nk, nv, lens, table, cu: pa.write_kv_(kc, vc, nk, nv, lens, table, cu)  # noqa: E731
    graph = make_fx(unquantized, tracing_mode="fake")(*args).graph  # make_fx wants every parameter given
    calls = [n for n in graph.nodes if n.op == "call_function"]
    targets = [str(n.target) for n in calls]
    assert not any("local_scalar_dense" in t or "copy" in t or "clone" in t for t in targets), targets
    writes = [n for n in calls if str(n.target) == "aten.index_put_.default"]
    caches = [n for n in graph.nodes if n.op == "placeholder"][:2]
    assert [w.args[0] for w in writes] == caches
    cache_sized = [n for n in calls if tuple(getattr(n.meta.get("val"), "shape", ())) == (PAGES, PAGE, HKV, D)]
    assert cache_sized == writes, [str(n.target) for n in cache_sized]


def _cb_kwargs(on_tpu, index_dtype, tq, tk, decode):
    """What transformers' continuous batching passes for 3 requests."""
    kwargs = dict(cu_seq_lens_q=on_tpu.empty(4, dtype=index_dtype), cu_seq_lens_k=on_tpu.empty(4, dtype=index_dtype))
    if decode:
        k_cache, v_cache = _paged_cache(on_tpu)
        kwargs.update(block_table=on_tpu.empty(3, 4, dtype=index_dtype), k_cache=k_cache, v_cache=v_cache)
    return kwargs


@pytest.mark.parametrize("case,tq,tk,window,index_dtype", [
    ("decode", 3, 3, None, torch.int32),       # block tables: the new K/V are written into the cache first
    ("decode", 3, 3, None, torch.int64),
    ("prefill", 40, 40, None, torch.int32),    # K/V gathered per request, re-packed into pages on the device
    ("mixed", 22, 61, None, torch.int64),      # one prefill and two decodes, with cached tokens
    ("sliding", 22, 61, 4, torch.int32),       # sliding-window layers take the gathered path
])
def test_paged_attention_forward_as_continuous_batching_calls_it(pa, on_tpu, case, tq, tk, window, index_dtype):
    query = on_tpu.empty(1, HQ, tq, D)
    key, value = on_tpu.empty(1, HKV, tk, D), on_tpu.empty(1, HKV, tk, D)
    kwargs = _cb_kwargs(on_tpu, index_dtype, tq, tk, decode=case == "decode")
    if window:
        kwargs.update(sliding_window=window, s_aux=on_tpu.empty(HQ, dtype=torch.float32))
    out, weights = on_tpu(pa, lambda: pa.paged_attention_forward(object(), query, key, value, None, scaling=0.1,
                                                                 **kwargs))
    assert (tuple(out.shape), out.device.type, weights) == ((1, tq, HQ, D), "tpu", None)
    if on_tpu.kind == "eager":
        want = ["write_targets_jax", "ragged_paged_attention_jax"] if case == "decode" else ["ragged_paged_attention_jax"]
        assert on_tpu.launched() == want
        assert [p.dtype for p in on_tpu.checker.launches[-1].params[3:6]] == [torch.int32] * 3
