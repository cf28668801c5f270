"""ragged-dot-tpu on TorchTPU's `tpu` device: ragged_dot forward and backward, experts_forward as
transformers calls it (int64 ids, expert-parallel sentinels, fp32/bf16 routing weights, Qwen3-MoE
and GPT-OSS layouts), under torch_tpu's fakes and through its eager path to a checked launch."""

import pytest
import torch
from conftest import backward
from pallas_hub.verify import torchtpu


@pytest.fixture(scope="module")
def rd(load_kernel):
    return load_kernel("ragged_dot", "torch-tpu")


def test_every_op_has_a_tpu_kernel_in_front_of_torch_tpus_jax_op(rd):
    from torch_tpu._internal.pallas.pallas import JaxCallable

    ops = torchtpu.kernel_ops(rd)
    assert {op._qualname.split("::")[1] for op in ops} == {"ragged_dot", "ragged_dot_backward", "experts"}
    for op in ops:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op._qualname, "PrivateUse1")
        assert isinstance(op.tpu_op._init_fn, JaxCallable)  # the real torch.tpu.pallas.jax_op


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_ragged_dot_forward_and_backward(rd, on_tpu, index_dtype):
    lhs, rhs = on_tpu.empty(200, 128), on_tpu.empty(4, 128, 256)  # 200 rows: not a tile multiple
    group_sizes, dout = on_tpu.empty(4, dtype=index_dtype), on_tpu.empty(200, 256)

    def step():
        inputs = (lhs, rhs, group_sizes, False, "", 0, 0)
        out = rd.ragged_dot(*inputs)
        return out, backward(rd._setup_context, rd._backward, inputs, out, dout)

    out, grads = on_tpu(rd, step)
    assert (out.device.type, tuple(out.shape), out.dtype) == ("tpu", (200, 256), torch.bfloat16)
    assert [tuple(g.shape) for g in grads[:2]] == [(200, 128), (4, 128, 256)] and set(grads[2:]) == {None}
    assert grads[0].device.type == grads[1].device.type == "tpu"
    if on_tpu.kind == "eager":
        assert on_tpu.launched() == ["ragged_dot_jax", "ragged_dot_backward_jax"]
        assert all(launch.params[2].dtype == torch.int32 for launch in on_tpu.checker.launches)


def test_ragged_dot_transposed_out_dtype_and_explicit_tiles(rd, eager_tpu):
    lhs, rhs = eager_tpu.empty(64, 256), eager_tpu.empty(3, 384, 256)  # rhs [G, N, K]
    gs = eager_tpu.empty(3, dtype=torch.int64)
    out = eager_tpu(rd, lambda: rd.ragged_dot(lhs, rhs, gs, True, "float32", 32, 128))
    assert (tuple(out.shape), out.dtype) == ((64, 384), torch.float32)
    (launch,) = eager_tpu.checker.launches
    assert launch.results[0].dtype == torch.float32 and launch.params[2].dtype == torch.int32


def _experts(family, mode, dtype):
    import transformers

    if family == "qwen3_moe":
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls

        cfg = transformers.Qwen3MoeConfig(hidden_size=128, moe_intermediate_size=128, num_experts=8,
                                          num_experts_per_tok=2)
    else:  # GPT-OSS: [E, H, 2I] interleaved gate/up, biases, clamped swiglu
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls

        cfg = transformers.GptOssConfig(hidden_size=128, intermediate_size=128, num_local_experts=8,
                                        num_experts_per_tok=2)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with mode, torch.device("tpu"):
            return cls(cfg)
    finally:
        torch.set_default_dtype(default)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("index_dtype,weights_dtype,expert_parallel", [
    (torch.int64, torch.float32, False),   # what transformers passes: int64 top_k_index, fp32 routing weights
    (torch.int64, torch.bfloat16, True),   # bf16 routing weights; ids >= num_experts are EP sentinels
    (torch.int32, torch.float32, False),
])
def test_experts_forward_as_transformers_calls_it(rd, on_tpu, family, index_dtype, weights_dtype, expert_parallel):
    experts = _experts(family, on_tpu.mode, torch.bfloat16)
    experts._is_expert_parallel = expert_parallel
    hidden = on_tpu.empty(5, 128)  # 5 tokens: padded to a bucket of 8 on the device
    top_k_index, top_k_weights = on_tpu.empty(5, 2, dtype=index_dtype), on_tpu.empty(5, 2, dtype=weights_dtype)
    out = on_tpu(rd, lambda: rd.experts_forward(experts, hidden, top_k_index, top_k_weights))
    assert (out.device.type, tuple(out.shape), out.dtype) == ("tpu", (5, 128), torch.bfloat16)
    if on_tpu.kind == "eager":
        (launch,) = on_tpu.checker.launches
        assert launch.name.endswith("::experts_jax")
        assert [p.dtype for p in launch.params[:3]] == [torch.bfloat16, torch.int32, weights_dtype]
        assert launch.params[1].shape == (8, 2)  # the bucket


def test_our_fakes_equal_torch_tpus_fakes_at_qwen3_30b_a3b_shapes(rd):
    """Our pure-torch fakes (what torch.compile and torch.export use) against torch_tpu's own, which
    export the kernel for TPU: same output shapes, dtypes and device. One Qwen3-30B-A3B experts layer
    (128 experts, hidden 2048, intermediate 768, top-8) for 64 tokens, and its grouped matmuls."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        t = lambda *s, dtype=torch.bfloat16: torch.empty(s, dtype=dtype, device="tpu")  # noqa: E731
        calls = [
            (rd.ragged_dot, (t(512, 2048), t(128, 1536, 2048), t(128, dtype=torch.int32), True, "")),
            (rd.ragged_dot, (t(512, 768), t(128, 2048, 768), t(128, dtype=torch.int32), True, "float32")),
            (rd.experts_op, (t(64, 2048), t(64, 8, dtype=torch.int32), t(64, 8, dtype=torch.float32),
                             t(128, 1536, 2048), t(128, 2048, 768))),
        ]
    for op, args in calls:
        with mode:
            ours, theirs = op(*args), op.tpu_op(*args)
        assert (ours.shape, ours.dtype, ours.device) == (theirs.shape, theirs.dtype, theirs.device)
