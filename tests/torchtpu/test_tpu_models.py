"""Whole tiny models on TorchTPU's `tpu` device, with our kernels registered as the loader registers
them: a Qwen3-MoE (experts + attention) and a Llama (attention) forward with a padding mask,
through torch.export and make_fx. Weights are real, never-written `tpu` tensors (nothing is read)."""

import pytest
import torch
import transformers

COMMON = dict(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=128, max_position_embeddings=128)
MODELS = {
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2)),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
}


@pytest.fixture(scope="module")
def registered(load_kernel):
    from pallas_hub.hub.register import register

    with register(load_kernel("flash_attention", "torch-tpu")) as attention, \
            register(load_kernel("ragged_dot", "torch-tpu")) as experts:
        yield attention, experts


def _model(family):
    config_cls, model_cls, extra = MODELS[family]
    with torch.device("meta"):
        model = model_cls._from_config(config_cls(**COMMON, **extra), attn_implementation="pallas_attention",
                                       experts_implementation="tokamax_ragged_dot" if family == "qwen3_moe" else None)
    return model.to_empty(device="tpu").eval()


def _check(graph, family):
    targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
    attention = [n for n in graph.nodes if str(n.target).endswith(".attention.default")]
    assert len(attention) == 2, targets  # one per layer: our registered function ran
    assert all(n.args[5] is not None for n in attention)  # the padding mask reached the kernel op
    experts = [t for t in targets if t.endswith(".experts.default")]
    assert len(experts) == (2 if family == "qwen3_moe" else 0), targets
    assert not any("local_scalar_dense" in t or "aten.equal" in t or "aten.item" in t for t in targets)


@pytest.mark.parametrize("family", list(MODELS))
def test_forward_with_a_padding_mask_exports(registered, family):
    model = _model(family)
    ids, mask = torch.empty(2, 12, dtype=torch.long, device="tpu"), torch.empty(2, 12, dtype=torch.long, device="tpu")
    exported = torch.export.export(model, (), dict(input_ids=ids, attention_mask=mask, use_cache=False))
    _check(exported.graph, family)
    (out,) = [n for n in exported.graph.nodes if n.op == "output"]
    assert out.args[0][0].meta["val"].device.type == "tpu"  # the logits


@pytest.mark.parametrize("family", list(MODELS))
def test_forward_with_a_padding_mask_traces_with_make_fx(registered, family):
    from torch.fx.experimental.proxy_tensor import make_fx

    model = _model(family)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}  # inputs, so make_fx fakes them

    def forward(state, ids, mask):
        return torch.func.functional_call(model, state, (), dict(input_ids=ids, attention_mask=mask,
                                                                 use_cache=False)).logits

    ids, mask = torch.empty(2, 12, dtype=torch.long, device="tpu"), torch.empty(2, 12, dtype=torch.long, device="tpu")
    graph = make_fx(forward, tracing_mode="fake")(state, ids, mask).graph
    _check(graph, family)
    (out,) = [n for n in graph.nodes if n.op == "output"]
    assert out.args[0][0].meta["val"].device.type == "tpu"
