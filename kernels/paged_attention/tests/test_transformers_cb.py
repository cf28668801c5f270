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
    # head dim 64: the pages built for gathered K/V are lane-packed ([P, page, 1, 128])
    "gpt_oss_head_dim_64": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2,
                                                                      sliding_window=4, head_dim=64)),
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
    if not model.startswith("gpt_oss"):  # sliding layers have no block tables in transformers' CB
        assert calls["block_table"] > 0


def _fake_quantized(x, scale, dtype):
    """Plain torch, independent of the kernel's quantize: the values a [B, Hkv, S, D] tensor has after
    a round trip through a ``dtype`` cache with per-head ``scale`` [Hkv]."""
    s = scale[None, :, None, None]
    y = x.float() / s
    if dtype == torch.int8:
        y = torch.round(y).clamp(-127, 127)
    else:
        y = y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (y * s).to(x.dtype)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "int8"])
def test_generate_batch_on_a_quantized_paged_cache(load_kernel, dtype):
    """enable_continuous_batching(model, kv_cache_dtype=...): the paged cache holds 1-byte K/V with
    per-(layer, K/V, KV head) scales; greedy tokens equal plain generate with eager attention over K/V
    rounded through the same quantization (plain torch). Both the block-table path (decode: the kernel
    writes quantized rows) and the gathered path (transformers writes, the cache class quantizes) run."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    k = load_kernel("paged_attention")
    cfg = transformers.Qwen3Config(**COMMON)
    torch.manual_seed(0)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (5, 20, 3)]
    gen = GenerationConfig(max_new_tokens=5, min_new_tokens=5, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # scales [layers, K/V, KV heads]: small enough that values use the whole range, distinct per layer and head
    kv_scale = torch.tensor([[[0.004, 0.006], [0.003, 0.005]], [[0.005, 0.004], [0.006, 0.003]]])
    if dtype == "float8_e4m3fn":
        kv_scale = kv_scale / 40
    torch_dtype = getattr(torch, dtype)

    import transformers.models.qwen3.modeling_qwen3 as qwen3

    def fake_quant_eager(module, query, key, value, attention_mask, **kwargs):
        ks, vs = kv_scale[module.layer_idx]
        return qwen3.eager_attention_forward(module, query, _fake_quantized(key, ks, torch_dtype),
                                             _fake_quantized(value, vs, torch_dtype), attention_mask, **kwargs)

    transformers.AttentionInterface.register("fake_quant_eager", fake_quant_eager)
    transformers.masking_utils.AttentionMaskInterface.register("fake_quant_eager",
                                                               transformers.masking_utils.eager_mask)
    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="fake_quant_eager").eval()
    expected = [base.generate(torch.tensor([p]), generation_config=gen)[0, len(p):].tolist() for p in prompts]

    torch.manual_seed(0)
    m = transformers.Qwen3ForCausalLM._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    name = k.enable_continuous_batching(m, kv_cache_dtype=dtype, kv_scale=kv_scale)
    seen = {"block_table": set(), "gathered": set()}
    forward = k.paged_attention_forward

    def recording(module, query, key, value, attention_mask, **kwargs):
        if kwargs.get("block_table") is not None:
            seen["block_table"].add(kwargs["k_cache"].dtype)
        else:
            seen["gathered"].add(key.dtype)
        return forward(module, query, key, value, attention_mask, **kwargs)

    transformers.AttentionInterface.register(name, recording)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64, use_cuda_graph=False)
    try:
        with torch.no_grad():
            res = m.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, warmup=False)
    finally:
        k.enable_continuous_batching(m)  # back to the model's dtype for the cache
    got = [res[f"req_{i}"].generated_tokens for i in range(len(prompts))]
    assert got == expected
    assert seen == {"block_table": {torch_dtype}, "gathered": {torch.float32}}  # decode read the 1-byte pages


def test_quantized_cache_option_errors(load_kernel):
    k = load_kernel("paged_attention")
    m = transformers.Qwen3ForCausalLM._from_config(transformers.Qwen3Config(**COMMON), attn_implementation="eager")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of float8_e4m3fn, int8"):
        k.enable_continuous_batching(m, kv_cache_dtype="float8_e5m2")
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' needs kv_scale"):
        k.enable_continuous_batching(m, kv_cache_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"kv_scale must be a float or broadcastable to \[num_hidden_layers, 2, "
                                         r"num_key_value_heads\] = \[2, 2, 2\], got shape \[3\]"):
        k.enable_continuous_batching(m, kv_cache_dtype="float8_e4m3fn", kv_scale=torch.ones(3))
    with pytest.raises(ValueError, match="kv_scale must be positive and finite"):
        k.enable_continuous_batching(m, kv_cache_dtype="float8_e4m3fn", kv_scale=0.0)
    with pytest.raises(ValueError, match="kv_cache_dtype needs the model"):
        k.enable_continuous_batching(kv_cache_dtype="float8_e4m3fn")


def test_continuous_batching_refuses_a_zero_scaling(load_kernel):
    """scaling=0.0 is refused before anything runs: the op would read its scale of 0 as head_dim ** -0.5."""
    k = load_kernel("paged_attention")
    q = torch.zeros(1, 2, 3, 64)
    with pytest.raises(ValueError, match=r"scaling=0.0 .* not supported"):
        k.paged_attention_forward(None, q, q, q, None, scaling=0.0, cu_seq_lens_q=torch.tensor([0, 3]),
                                  cu_seq_lens_k=torch.tensor([0, 3]))
