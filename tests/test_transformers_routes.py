"""transformers' own Hub-kernel routes, on our kernels published to a local hub.

transformers 5.24 turns these routes on only with kernels 0.18.2 <= version < 0.19 (``is_kernels_available``);
the package index here serves 0.17.2. So one test SIMULATES that version gate, and nothing else: it
replaces ``is_kernels_available`` with ``lambda: True`` before transformers imports it (in a fresh
process), and then everything runs through transformers' and kernels' own code: ``attn_implementation=
"pallas-hub/flash-attention-tpu"`` (``load_and_register_attn_kernel`` -> ``kernels.get_kernel`` from the local
hub, offline) and ``kernelize`` of GPT-OSS's decorated ``GptOssMLP`` with our ``layers.MegaBlocksMoeMLP``
(``LayerRepository`` from the local hub). The other test uses kernels 0.17.2 as installed, no simulation.
"""

import json
import os
import subprocess
import sys

import pytest

from pallas_hub.hub import manifest
from pallas_hub.hub.build import build_kernel
from pallas_hub.hub.publish import LocalHub

FLASH = "pallas-hub/flash-attention-tpu"
RAGGED = "pallas-hub/ragged-dot-tpu"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("routes")
    hub = LocalHub(root / "hub")
    for key in ("flash_attention", "ragged_dot"):
        spec = manifest.load_manifest().kernels[key]
        hub.publish(spec, build_kernel(spec, root / "build" / key), progress=None)
    return hub


GATED = r'''
import json, os, sys
hub = sys.argv[1]
os.environ.update(HF_HUB_OFFLINE="1", HF_HUB_CACHE=hub, KERNELS_CACHE=hub)
import transformers.utils as tu, transformers.utils.import_utils as iu

assert not iu.is_kernels_available(), "kernels is in transformers' range now: drop the simulation"
iu.is_kernels_available = tu.is_kernels_available = lambda *a, **k: True  # SIMULATED: kernels>=0.18.2,<0.19

import torch
from kernels import LayerRepository, Mode, kernelize, use_kernel_mapping
from transformers import (AttentionInterface, ContinuousBatchingConfig, GenerationConfig, GptOssConfig,
                          GptOssForCausalLM, Qwen3Config, Qwen3ForCausalLM)

out = {}
# 1. attn_implementation="org/repo": transformers loads the kernel and registers its flash_attn_forward
cfg = Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=64, pad_token_id=0, initializer_range=0.3)
torch.manual_seed(0)
ref = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
torch.manual_seed(0)
ours = Qwen3ForCausalLM._from_config(cfg, attn_implementation="FLASH").eval()
registered = AttentionInterface._global_mapping["FLASH"]
out["registered"] = f"{registered.__module__}.{registered.__name__}"
calls = [0]
def counted(*a, **k):
    calls[0] += 1
    return registered(*a, **k)
AttentionInterface._global_mapping["FLASH"] = counted
torch.manual_seed(1)
ids = torch.randint(3, 128, (2, 11))
mask = torch.ones_like(ids)
mask[1, :4] = 0  # left padding
gen = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
with torch.no_grad():
    a, b = ref(input_ids=ids, attention_mask=mask).logits, ours(input_ids=ids, attention_mask=mask).logits
    out["logits_diff"] = (a - b)[mask.bool()].abs().max().item()
    out["logits_scale"] = a.abs().max().item()
    out["same_tokens"] = torch.equal(ref.generate(input_ids=ids, attention_mask=mask, **gen),
                                     ours.generate(input_ids=ids, attention_mask=mask, **gen))
out["calls"] = calls[0]
# continuous batching accepts the name (it contains "flash") but would pack requests: refused, not wrong
gcfg = GenerationConfig(max_new_tokens=2, do_sample=False, pad_token_id=0)
cb = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64, use_cuda_graph=False)
with torch.no_grad():
    res = ours.generate_batch([[5, 6, 7], [8, 9]], generation_config=gcfg, continuous_batching_config=cb, warmup=False)
out["cb_errors"] = sorted({r.error or "" for r in res.values()})

# 2. kernelize: GPT-OSS's MoE block (decorated use_kernel_forward_from_hub("MegaBlocksMoeMLP")) gets our layer
cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                   max_position_embeddings=64, layer_types=["full_attention"] * 2, initializer_range=0.2, pad_token_id=0)
torch.manual_seed(0)
ref = GptOssForCausalLM._from_config(cfg).eval()
torch.manual_seed(0)
ours = GptOssForCausalLM._from_config(cfg).eval()
out["layer_name"] = getattr(type(ours.model.layers[0].mlp), "kernel_layer_name", None)
mapping = {"MegaBlocksMoeMLP": {"cpu": LayerRepository("RAGGED", layer_name="MegaBlocksMoeMLP", version=1)}}
with use_kernel_mapping(mapping, inherit_mapping=False):
    kernelize(ours, mode=Mode.INFERENCE, device="cpu")
out["forward"] = ours.model.layers[0].mlp.forward.__qualname__
with torch.no_grad():
    a, b = ref(input_ids=ids).logits, ours(input_ids=ids).logits
out["moe_diff"], out["moe_scale"] = (a - b).abs().max().item(), a.abs().max().item()
print("RESULT " + json.dumps(out))
'''.replace("FLASH", FLASH).replace("RAGGED", RAGGED)


def test_transformers_loads_our_kernels_through_its_own_hub_routes_version_gate_simulated(hub):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", GATED, str(hub.root)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    # attention: transformers registered our flash_attn_forward itself, and it ran in every layer
    assert got["registered"].endswith(".flash_attn_forward") and got["registered"].startswith("_flash_attention_tpu_")
    assert got["calls"] >= 2 and got["logits_diff"] <= 2e-4 * got["logits_scale"], got
    assert got["same_tokens"], got
    assert got["cb_errors"] == ["flash-attention-tpu does not run continuous batching (generate_batch packs requests "
                                "into one row without a mask); use paged-attention-tpu's 'paged_flash_tpu' "
                                "(pallas_hub.load registers it)"], got
    # kernelize: our layer replaced GptOssMLP.forward and matches it
    assert got["layer_name"] == "MegaBlocksMoeMLP" and got["forward"] == "MegaBlocksMoeMLP.forward", got
    assert got["moe_diff"] <= 1e-4 * got["moe_scale"], got


def test_with_kernels_0_17_the_layer_route_works_through_kernels_own_api(hub):
    """kernels 0.17.2 as installed: transformers leaves its layers undecorated (its gate is closed), so the
    user marks GptOssMLP with kernels' own replace_kernel_forward_from_hub, then kernelize as above."""
    import torch
    import transformers.utils as tu
    from kernels import LayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    from pallas_hub.hub.fetch import _hub_settings

    assert not tu.is_kernels_available()  # what closes transformers' own routes here
    from transformers import Qwen3Config, Qwen3ForCausalLM

    small = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, head_dim=64)
    with pytest.raises(ImportError, match=r"`kernels` is either not installed or uses an incompatible version"):
        Qwen3ForCausalLM._from_config(small, attn_implementation=FLASH)
    assert getattr(GptOssMLP, "kernel_layer_name", None) is None
    cfg = GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=64, num_local_experts=4, num_experts_per_tok=2,
                       max_position_embeddings=64, layer_types=["full_attention"], initializer_range=0.2)
    torch.manual_seed(0)
    ref = GptOssForCausalLM._from_config(cfg).eval()
    torch.manual_seed(0)
    ours = GptOssForCausalLM._from_config(cfg).eval()
    replace_kernel_forward_from_hub(GptOssMLP, "MegaBlocksMoeMLP")
    try:
        mapping = {"MegaBlocksMoeMLP": {"cpu": LayerRepository(RAGGED, layer_name="MegaBlocksMoeMLP", version=1)}}
        with _hub_settings(hub.root, tpu=False), use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(ours, mode=Mode.INFERENCE, device="cpu")
    finally:
        del GptOssMLP.kernel_layer_name, GptOssMLP.kernel_condition
    assert ours.model.layers[0].mlp.forward.__qualname__ == "MegaBlocksMoeMLP.forward"
    ids = torch.randint(3, 128, (2, 7))
    with torch.no_grad():
        a, b = ref(input_ids=ids).logits, ours(input_ids=ids).logits
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()
