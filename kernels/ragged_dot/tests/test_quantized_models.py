"""Tiny pre-quantized checkpoints built here, run with experts_implementation="tokamax_ragged_dot" from the
package's REGISTRATIONS: FP8 (Qwen3-MoE, DeepSeek-V3) loaded with pallas_hub.hub.quantized.from_pretrained_fp8
(experts kept e4m3) against the same weights dequantized into a plain checkpoint under transformers'
grouped_mm; MXFP4 GPT-OSS loaded with from_pretrained_mxfp4 (blocks kept) against transformers' own
dequantizing load."""

import copy
import json
import math
import types

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file

from pallas_hub.hub.quantized import from_pretrained_fp8, from_pretrained_mxfp4
from pallas_hub.hub.register import register

B = 128
FP8 = torch.float8_e4m3fn
QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [B, B]}
COMMON = dict(vocab_size=256, hidden_size=256, num_hidden_layers=2, num_attention_heads=4, pad_token_id=0,
              bos_token_id=1, eos_token_id=2, max_position_embeddings=128)
FAMILIES = {
    # I = 96: the intermediate is off the 128 grid (gate and up scales are a block row each)
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        intermediate_size=384, moe_intermediate_size=96, num_key_value_heads=2, head_dim=64, num_experts=8,
        num_experts_per_tok=2)),
    # fp32 routing weights x routed_scaling_factor, a dense first layer and a shared expert (FP8Linear)
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
        intermediate_size=320, moe_intermediate_size=128, first_k_dense_replace=1, num_key_value_heads=4,
        q_lora_rank=96, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
        routed_scaling_factor=2.5)),
}
KEEP = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")  # router, norms, embeddings stay unquantized


def quantize_block(w):
    """[N, K] -> (e4m3, f32 scale_inv [ceil(N/128), ceil(K/128)]), w ~= e4m3 * scale_inv, edge blocks partial."""
    n, k = w.shape
    gn, gk = math.ceil(n / B), math.ceil(k / B)
    tiles = torch.zeros(gn * B, gk * B)
    tiles[:n, :k] = w.float()
    tiles = tiles.reshape(gn, B, gk, B)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (tiles / scale[:, None, :, None]).clamp(-448, 448).to(FP8).reshape(gn * B, gk * B)[:n, :k]
    return q.contiguous(), scale


def dequantize_block(q, scale):
    """The reference's own dequantization (not the loader's): tiles of the zero-padded weight times their scale."""
    n, k = q.shape
    gn, gk = scale.shape
    tiles = torch.zeros(gn * B, gk * B)
    tiles[:n, :k] = q.float()
    return (tiles.reshape(gn, B, gk, B) * scale[:, None, :, None]).reshape(gn * B, gk * B)[:n, :k].contiguous()


def checkpoints(family, root):
    """(FP8 checkpoint dir, dequantized f32 checkpoint dir): every Linear weight but the router, embeddings
    and lm_head quantized by hand (not by transformers), per expert as published checkpoints are."""
    C, M, extra = FAMILIES[family]
    torch.manual_seed(0)
    model = M(C(**{**COMMON, **extra}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.05 if p.ndim >= 2 else
                    torch.ones_like(p) if "norm" in name else 0.01 * torch.randn_like(p))
    model.save_pretrained(root / "plain")
    fp8, deq = {}, {}
    for key, t in load_file(root / "plain" / "model.safetensors").items():
        if key.endswith(".weight") and t.ndim == 2 and not any(s in key for s in KEEP):
            q, s = quantize_block(t)
            fp8[key], fp8[key.removesuffix("weight") + "weight_scale_inv"] = q, s
            deq[key] = dequantize_block(q, s)
        else:
            fp8[key] = deq[key] = t
    assert any(".experts." in k and k.endswith("scale_inv") for k in fp8), "no per-expert keys were quantized"
    config = json.loads((root / "plain" / "config.json").read_text())
    for name, tensors, quant in (("fp8", fp8, True), ("deq", deq, False)):
        (root / name).mkdir()
        save_file(tensors, root / name / "model.safetensors", metadata={"format": "pt"})
        cfg = {**config, "quantization_config": QUANT_CONFIG} if quant else config
        (root / name / "config.json").write_text(json.dumps(cfg))
    return M, root / "fp8", root / "deq"


CALLS = []


@pytest.fixture(scope="module")
def registered(load_kernel):
    """The package's REGISTRATIONS (experts and fp8_experts) through the loader, the function counting calls."""
    k = load_kernel("ragged_dot")

    def counted(self, *args):
        CALLS.append(type(self).__name__)
        return k.experts_forward(self, *args)

    with register(types.SimpleNamespace(REGISTRATIONS=k.REGISTRATIONS, experts_forward=counted), "ragged_dot"):
        yield k


@pytest.mark.parametrize("family", list(FAMILIES))
def test_fp8_model_matches_dequantized_model(registered, family, tmp_path):
    """f32: logits within 1e-4 of the dequantized checkpoint under grouped_mm, identical greedy tokens (4 new).
    bf16: ours at most 1.25x (+4e-3) as far from those f32 logits as grouped_mm in bf16 is.
    The experts stay e4m3 (FP8Experts, checkpoint bytes); transformers' own FP8 forward would need CUDA's
    Triton kernel, so every MoE layer ran ours (counted)."""
    from transformers.integrations.finegrained_fp8 import FP8Experts, FP8Linear

    M, fp8_dir, deq_dir = checkpoints(family, tmp_path)
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = M.from_pretrained(deq_dir, dtype=torch.float32, experts_implementation="grouped_mm").eval()
        ours = from_pretrained_fp8(M, fp8_dir, dtype=torch.float32, experts_implementation="tokamax_ragged_dot").eval()
        experts = [m for m in ours.modules() if isinstance(m, FP8Experts)]
        assert experts and all(m.gate_up_proj.dtype == FP8 and m.down_proj.dtype == FP8 for m in experts)
        saved = load_file(fp8_dir / "model.safetensors")
        e0 = next(n for n, m in ours.named_modules() if isinstance(m, FP8Experts))
        assert torch.equal(experts[0].gate_up_proj[1, :96].view(torch.uint8),  # expert 1's gate rows, byte for byte
                           saved[f"{e0}.1.gate_proj.weight"][:96].view(torch.uint8))
        linears = [m for m in ours.modules() if isinstance(m, FP8Linear)]
        assert linears and all(m.weight.dtype == torch.float32 for m in linears)  # dequantized for F.linear
        CALLS.clear()
        truth, got = ref(input_ids=ids).logits, ours(input_ids=ids).logits
        assert CALLS == ["FP8Experts"] * len(experts), CALLS
        err = (truth - got).abs().max().item()
        print(f"{family} f32: max |dlogits| {err:.3g}")
        assert err <= 1e-4, f"{family} f32: max |dlogits| = {err:.3g}"
        assert torch.equal(ref.generate(input_ids=ids, **kw), ours.generate(input_ids=ids, **kw))

        ref16 = M.from_pretrained(deq_dir, dtype=torch.bfloat16, experts_implementation="grouped_mm").eval()
        ours16 = from_pretrained_fp8(M, fp8_dir, dtype=torch.bfloat16, experts_implementation="tokamax_ragged_dot")
        e_ref = (ref16(input_ids=ids).logits.float() - truth).abs().max().item()
        e_ours = (ours16.eval()(input_ids=ids).logits.float() - truth).abs().max().item()
        print(f"{family} bf16: from the f32 logits, ours {e_ours:.3g}, grouped_mm {e_ref:.3g}")
        assert e_ours <= 1.25 * e_ref + 4e-3, f"{family} bf16: ours {e_ours:.3g} vs grouped_mm {e_ref:.3g} from f32"


def test_fp8_experts_module_errors(registered, tmp_path):
    """What FP8Experts configurations the kernel refuses, by name."""
    from transformers.integrations.finegrained_fp8 import FP8Experts

    M, fp8_dir, _ = checkpoints("qwen3_moe", tmp_path)
    model = from_pretrained_fp8(M, fp8_dir, dtype=torch.float32, experts_implementation="tokamax_ragged_dot")
    mod = copy.deepcopy(next(m for m in model.modules() if isinstance(m, FP8Experts)))
    x, idx, w = torch.randn(3, 256), torch.tensor([[0, 1]] * 3), torch.full((3, 2), 0.5)
    mod.block_size = [128, 64]
    with pytest.raises(ValueError, match=r"block_size must be \[128, 128\].*got \[128, 64\]"):
        registered.experts_forward(mod, x, idx, w)
    mod.block_size = [64, 64]
    with pytest.raises(ValueError, match="block_size must be 128.*got 64"):
        registered.experts_forward(mod, x, idx, w)
    mod.block_size = [128, 128]
    mod.activation_scheme = "static"
    with pytest.raises(NotImplementedError, match="activation_scheme='static'"):
        registered.experts_forward(mod, x, idx, w)
    mod.activation_scheme = "dynamic"
    mod.swiglu_alpha = 1.702
    with pytest.raises(NotImplementedError, match="softcapped or clamped SwiGLU"):
        registered.experts_forward(mod, x, idx, w)
    mod.swiglu_alpha = None
    mod.gate_up_proj_scale_inv = torch.nn.Parameter(mod.gate_up_proj_scale_inv.data[:, :1].clone())
    with pytest.raises(ValueError, match="gate_up_scale must be"):
        registered.experts_forward(mod, x, idx, w)


def test_on_the_fly_quantization_is_refused(tmp_path):
    """from_pretrained_fp8 is for pre-quantized checkpoints: a bf16 one with an FP8 config is refused by name."""
    M, _, deq_dir = checkpoints("qwen3_moe", tmp_path)
    with pytest.raises(ValueError, match="pre-quantized FP8 checkpoints"):
        from_pretrained_fp8(M, deq_dir, quantization_config=T.FineGrainedFP8Config())


def test_nan_codes_in_fp8_experts_are_refused_at_load(tmp_path):
    """An expert weight holding an e4m3fn NaN code (which v5e/v6e would read as 480) is refused by name at load."""
    M, fp8_dir, _ = checkpoints("qwen3_moe", tmp_path)
    tensors = load_file(fp8_dir / "model.safetensors")
    key = next(k for k in tensors if ".experts.3." in k and k.endswith("down_proj.weight"))
    bytes_ = tensors[key].view(torch.uint8).clone()
    bytes_[5, 7] = 0xFF
    tensors[key] = bytes_.view(FP8)
    save_file(tensors, fp8_dir / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.\d+\.mlp\.experts\.down_proj holds 1 float8_e4m3fn NaN"):
        from_pretrained_fp8(M, fp8_dir, dtype=torch.float32)


# --------------------------------------------------------------------------- MXFP4 (GPT-OSS)

FP4 = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6])
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def quantize_mxfp4(w):
    """[E, out, in] -> blocks uint8 [E, out, in/32, 16] (low nibble = even input), scales uint8 e8m0 [E, out, in/32]."""
    e, n, k = w.shape
    x = w.float().reshape(e, n, k // 32, 32)
    amax = x.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax.clamp(min=1e-30))) - 2, torch.full_like(amax, -127.0))
    code = ((x / torch.exp2(exp)).abs()[..., None] - FP4).abs().argmin(-1) | ((x < 0).long() << 3)
    code = code.to(torch.uint8).reshape(e, n, k // 32, 16, 2)
    return (code[..., 0] | (code[..., 1] << 4)).contiguous(), (exp[..., 0] + 127).to(torch.uint8).contiguous()


def test_mxfp4_gpt_oss_matches_transformers_dequantized(registered, tmp_path):
    """f32: logits within 1e-4 of transformers' dequantizing load (Mxfp4Config(dequantize=True), eager experts),
    identical greedy tokens; bf16: as close to those f32 logits as transformers' in bf16. The experts hold the
    checkpoint's blocks and scales byte for byte; they have no other forward, and every MoE layer ran ours."""
    cfg = T.GptOssConfig(vocab_size=256, hidden_size=128, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                         num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"], sliding_window=16,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = T.GptOssForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * 0.05 if p.ndim >= 2 else
                    torch.ones_like(p) if "norm" in name else 0.01 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "plain")
    tensors = {}
    for key, t in load_file(tmp_path / "plain" / "model.safetensors").items():
        if key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):  # [E, in, out] -> [E, out, in]
            tensors[key + "_blocks"], tensors[key + "_scales"] = quantize_mxfp4(t.transpose(1, 2))
        else:
            tensors[key] = t
    (tmp_path / "mxfp4").mkdir()
    save_file(tensors, tmp_path / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "mxfp4" / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))

    M, path = T.GptOssForCausalLM, tmp_path / "mxfp4"
    ids = torch.randint(3, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = M.from_pretrained(path, dtype=torch.float32, experts_implementation="eager",
                                quantization_config=T.Mxfp4Config(dequantize=True)).eval()
        ours = from_pretrained_mxfp4(M, path, dtype=torch.float32, experts_implementation="tokamax_ragged_dot").eval()
        # stored in the kernel's layout: blocks [E, in/2, out], scales [E, in/32 padded to 32 rows, out]
        experts = [m for m in ours.modules() if hasattr(m, "gate_up_proj_scales")]
        assert len(experts) == 2 and all(m.is_transposed and not hasattr(m, "gate_up_proj_blocks") for m in experts)
        blocks = tensors["model.layers.0.mlp.experts.gate_up_proj_blocks"]
        assert torch.equal(experts[0].gate_up_proj, blocks.flatten(2).transpose(1, 2))
        scales = tensors["model.layers.1.mlp.experts.down_proj_scales"]  # [E, H, I/32]
        assert experts[1].down_proj_scales.shape[1] % 32 == 0
        assert torch.equal(experts[1].down_proj_scales[:, :scales.shape[2]], scales.transpose(1, 2))
        CALLS.clear()
        truth, got = ref(input_ids=ids).logits, ours(input_ids=ids).logits
        assert CALLS == ["PackedMxfp4GptOssExperts"] * 2, CALLS
        err = (truth - got).abs().max().item()
        print(f"gpt_oss mxfp4 f32: max |dlogits| {err:.3g}")
        assert err <= 1e-4, f"gpt_oss mxfp4 f32: max |dlogits| = {err:.3g}"
        assert torch.equal(ref.generate(input_ids=ids, **kw), ours.generate(input_ids=ids, **kw))
        ref16 = M.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager",
                                  quantization_config=T.Mxfp4Config(dequantize=True)).eval()
        ours16 = from_pretrained_mxfp4(M, path, dtype=torch.bfloat16, experts_implementation="tokamax_ragged_dot").eval()
        e_ref = (ref16(input_ids=ids).logits.float() - truth).abs().max().item()
        e_ours = (ours16(input_ids=ids).logits.float() - truth).abs().max().item()
        print(f"gpt_oss mxfp4 bf16: from the f32 logits, ours {e_ours:.3g}, transformers {e_ref:.3g}")
        assert e_ours <= 1.25 * e_ref + 4e-3, f"gpt_oss bf16: ours {e_ours:.3g} vs transformers {e_ref:.3g}"
