"""transformers continuous batching (generate_batch + PagedAttentionCache) on the paged kernel: greedy
tokens equal plain generate's for each prompt, on tiny random Llama, Qwen3 and GPT-OSS (sliding
window 4 + sinks, so the window and sinks paths matter). Decode steps take the block-table path (the
kernel writes the new K/V into the pages itself) where the model allows it; prefill and sliding layers
the gathered path."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                          sliding_window=4)),
}


@pytest.mark.parametrize("model", MODELS)
def test_generate_batch_matches_generate(load_kernel, model):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    k = load_kernel("paged_attention")
    config_cls, model_cls, extra = (getattr(transformers, n) if isinstance(n, str) else n for n in MODELS[model])
    cfg = config_cls(**{**COMMON, **extra})
    torch.manual_seed(0)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (5, 20, 3)]
    gen = GenerationConfig(max_new_tokens=5, min_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    torch.manual_seed(0)
    base = model_cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    expected = [base.generate(torch.tensor([p]), generation_config=gen)[0, len(p):].tolist() for p in prompts]

    torch.manual_seed(0)
    m = model_cls._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    name = k.enable_continuous_batching(m)
    calls = {"block_table": 0, "gathered": 0}
    forward = k.paged_attention_forward

    def counting(module, query, key, value, attention_mask, **kwargs):
        calls["block_table" if kwargs.get("block_table") is not None else "gathered"] += 1
        return forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register(name, counting)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64, use_cuda_graph=False)
    with torch.no_grad():
        res = m.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    got = [res[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert got == expected
    assert m.config._attn_implementation == name and calls["gathered"] > 0
    if model != "gpt_oss":  # sliding layers have no block tables in transformers' CB
        assert calls["block_table"] > 0
