"""flash-attention-tpu on TorchTPU's `tpu` device: the attention op forward and backward, and
attention_forward as transformers calls it, with and without a padding mask (which stays on the
device: no host sync, so it traces)."""

import types

import pytest
import torch
from conftest import backward
from pallas_hub.verify import torchtpu


@pytest.fixture(scope="module")
def fa(load_kernel):
    return load_kernel("flash_attention", "torch-tpu")


def _module(hq, hkv):
    return types.SimpleNamespace(is_causal=True, num_key_value_groups=hq // hkv, training=False)


def test_the_kernel_imports_with_torch_tpus_jax_op(fa):
    """torch_tpu's jax_op refuses JAX functions without a return annotation (flash did not import at all)."""
    assert {op._qualname.split("::")[1] for op in torchtpu.kernel_ops(fa)} == {"attention", "attention_backward"}


@pytest.mark.parametrize("variant", ["plain", "sinks+window+softcap", "lengths", "mask"])
def test_attention_forward_and_backward(fa, on_tpu, variant):
    b, hq, hkv, s, d = 2, 4, 2, 200, 128  # 200: not a block multiple
    q, k, v = on_tpu.empty(b, hq, s, d), on_tpu.empty(b, hkv, s, d), on_tpu.empty(b, hkv, s, d)
    sinks = on_tpu.empty(hq, dtype=torch.float32) if variant == "sinks+window+softcap" else None
    seq = on_tpu.empty(b, 3, dtype=torch.int64) if variant == "lengths" else None
    mask = on_tpu.empty(b, s, s, dtype=torch.bool) if variant == "mask" else None
    window, softcap = (64, 30.0) if sinks is not None else (0, 0.0)
    inputs = (q, k, v, sinks, seq, mask, 0.088, True, window, softcap, 0, 0, False)

    # the log-sum-exp's gradient: None (autograd's for an unused output when not materialized) or a tensor
    grad_lse = None if variant == "plain" else on_tpu.empty(b, hq, s, dtype=torch.float32)

    def step():
        out, lse = fa.attention(*inputs)
        return out, lse, backward(fa._setup_context, fa._autograd_backward, inputs, (out, lse), on_tpu.empty(b, hq, s, d),
                                  grad_lse)

    out, lse, grads = on_tpu(fa, step)
    assert (tuple(out.shape), out.dtype, tuple(lse.shape), lse.dtype) == ((b, hq, s, d), torch.bfloat16, (b, hq, s),
                                                                          torch.float32)
    assert [tuple(g.shape) for g in grads[:3]] == [(b, hq, s, d), (b, hkv, s, d), (b, hkv, s, d)]
    assert (grads[3] is not None) == (sinks is not None)
    if on_tpu.kind == "eager":
        assert on_tpu.launched() == ["attention_jax", "attention_backward_jax"]
        if seq is not None:
            assert all(launch.params[3].dtype == torch.int32 for launch in on_tpu.checker.launches)


@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("sq", [1, 37])  # decode and a prefill that is no block multiple
def test_attention_forward_as_transformers_calls_it(fa, on_tpu, padding, sq):
    b, hq, hkv, sk, d = 2, 8, 2, 37, 128
    q, k, v = on_tpu.empty(b, hq, sq, d), on_tpu.empty(b, hkv, sk, d), on_tpu.empty(b, hkv, sk, d)
    mask = on_tpu.empty(b, 1, sq, sk, dtype=torch.bool) if padding else None
    out, weights = on_tpu(fa, lambda: fa.attention_forward(_module(hq, hkv), q, k, v, mask, scaling=0.1,
                                                           sliding_window=16))
    assert (tuple(out.shape), out.device.type, weights) == ((b, sq, hq, d), "tpu", None)
    if on_tpu.kind == "eager":
        (launch,) = on_tpu.checker.launches
        assert [p.dtype for p in launch.params] == [torch.bfloat16] * 3 + ([torch.bool] if padding else [])


def test_attention_forward_with_a_padding_mask_traces_without_host_syncs(fa):
    """make_fx on `tpu` fakes: a host sync (torch.equal, .item(), bool() of a tensor) would raise here."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        args = [torch.empty(s, dtype=t, device="tpu") for s, t in (((2, 4, 37, 128), torch.bfloat16),
                                                                   ((2, 2, 37, 128), torch.bfloat16),
                                                                   ((2, 2, 37, 128), torch.bfloat16),
                                                                   ((2, 1, 37, 37), torch.bool))]

    def forward(q, k, v, mask):
        return fa.attention_forward(_module(4, 2), q, k, v, mask)[0]

    graph = make_fx(forward, tracing_mode="fake")(*args).graph
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    assert any(t.endswith(".attention.default") for t in targets), targets
    assert not any("local_scalar_dense" in t or "aten.equal" in t for t in targets), targets
