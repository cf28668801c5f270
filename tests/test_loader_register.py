"""Registration from each package's REGISTRATIONS into transformers' registries, undo, the one-call
load, and the demo flow, all driven by the plain-torch TEST DOUBLE kernel (tests/doubles.py)."""

import types

import pytest
from doubles import FULL, make_kernel
from transformers import AttentionInterface
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask, sdpa_mask
import transformers.modeling_flash_attention_utils as fa_utils

from pallas_hub import demo, load
from pallas_hub.hub import build, manifest
from pallas_hub.hub.fetch import UntrustedRepo
from pallas_hub.hub.publish import LocalHub
from pallas_hub.hub.register import RegistrationError, register

EXPERTS = type(ALL_EXPERTS_FUNCTIONS)._global_mapping
ATTENTION = AttentionInterface._global_mapping
MASKS = type(ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping
REPO = "pallas-hub-tests/double-tpu"


def _module(regs, **fns):
    def f(*a, **k):
        return None

    return types.SimpleNamespace(__name__="k", REGISTRATIONS=regs, experts_forward=f, attention_forward=f,
                                 varlen_attention_forward=f, **fns)


def _snapshot():
    return dict(EXPERTS), dict(ATTENTION), dict(MASKS), fa_utils._loaded_implementation


def test_register_and_undo_restores_every_registry():
    before = _snapshot()
    EXPERTS["double_experts"] = previous = object()  # a name someone registered earlier is restored, not deleted
    try:
        m = _module(FULL)
        reg = register(m)
        assert EXPERTS["double_experts"] is m.experts_forward
        assert ATTENTION["double_attention"] is m.attention_forward and MASKS["double_attention"] is sdpa_mask
        assert ATTENTION["double_paged_flash"] is m.varlen_attention_forward
        assert MASKS["double_paged_flash"] is flash_attention_mask
        assert fa_utils._loaded_implementation == "double_paged_flash"  # model init will not look for flash-attn
        assert [e.registry for e in reg.entries] == ["experts", "attention", "paged_attention"]
        reg.undo()
        assert EXPERTS["double_experts"] is previous
    finally:
        del EXPERTS["double_experts"]
    assert _snapshot() == before


@pytest.mark.parametrize("entry, message", [
    ({"registry": "kv_cache", "name": "x", "function": "experts_forward"}, "needs 'registry'"),
    ({"registry": "experts", "name": "x", "function": "missing"}, "is not a callable of the package"),
    ({"registry": "experts", "name": "grouped_mm", "function": "experts_forward"}, "built-in"),
    ({"registry": "attention", "name": "my_flash", "function": "attention_forward"}, "must not contain 'flash'"),
    ({"registry": "attention", "name": "x", "function": "attention_forward", "mask": "nope"}, "mask 'nope'"),
    ({"registry": "paged_attention", "name": "paged_tpu", "function": "varlen_attention_forward"}, "must contain 'flash'"),
    ({"registry": "paged_attention", "name": "flash_v2", "function": "varlen_attention_forward"}, "no '2', '3' or '4'"),
    ({"registry": "experts", "name": "x", "function": "experts_forward", "extra": 1}, "unknown key"),
])
def test_a_bad_declaration_registers_nothing(entry, message):
    before = _snapshot()
    with pytest.raises(RegistrationError, match=message):
        register(_module([FULL[0], entry]))  # the good first entry is not registered either
    assert _snapshot() == before


def test_load_fetches_and_registers_in_one_call_and_undoes_on_failure(tmp_path):
    spec = manifest.load_kernel(make_kernel(tmp_path / "src"))
    build.build_kernel(spec)
    hub = LocalHub(tmp_path / "hub")
    hub.publish(spec, progress=None)
    before = _snapshot()
    with load({REPO: 1}, trust=[REPO], source=hub, write_lock_to=tmp_path / "lock") as loaded:
        assert loaded[REPO].REGISTRATIONS == FULL and ALL_EXPERTS_FUNCTIONS["double_experts"]
        assert any("double_experts" in line for line in loaded.report())
    assert _snapshot() == before and (tmp_path / "lock").is_file()
    with pytest.raises(UntrustedRepo):  # the second kernel is refused: the first one's registrations are undone
        load([REPO, "pallas-hub-tests/other"], version=1, trust=[REPO], source=hub)
    assert _snapshot() == before


def _root(tmp_path, **kw):
    make_kernel(tmp_path / "kernels", **kw)
    (tmp_path / "build.toml").write_text('[hub]\nnamespace = "pallas-hub-tests"\n'
                                         '[kernels.double]\npath = "kernels/double-tpu"\n')
    return tmp_path


def test_demo_flow_matches_transformers_defaults_with_the_test_double(tmp_path):
    lines = []
    before = _snapshot()
    assert demo.run(_root(tmp_path), local_hub=tmp_path / "hub", compile_matrix=False, out=lines.append) == 0
    text = "\n".join(lines)
    assert "pallas-hub-tests/double-tpu v1 commit" in text and "from local hub" in text
    assert "registered experts          double_experts" in text
    assert "-> MATCH" in text and "identical tokens vs per-prompt generate" in text and "all 6 checks passed" in text
    assert "MISSING" not in text and _snapshot() == before


WRONG = '''
import torch
def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    return torch.zeros_like(hidden_states)  # wrong on purpose
def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
        is_causal=attention_mask is None and query.shape[2] > 1, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None
REGISTRATIONS = [{"registry": "experts", "name": "double_experts", "function": "experts_forward"},
                 {"registry": "attention", "name": "double_attention", "function": "attention_forward", "mask": "sdpa"}]
'''


def test_demo_reports_missing_roles_and_fails_on_a_mismatch(tmp_path):
    lines = []
    root = _root(tmp_path, source=WRONG)
    make_kernel(root / "kernels", name="bad-tpu", registrations=[{"registry": "experts", "name": "grouped_mm",
                                                                  "function": "experts_forward"}])
    with open(root / "build.toml", "a") as f:
        f.write('[kernels.bad]\npath = "kernels/bad-tpu"\n')
    assert demo.run(root, local_hub=tmp_path / "hub", compile_matrix=False, out=lines.append) == 1
    text = "\n".join(lines)
    assert "FAILED fetch and register bad: RegistrationError: experts: 'grouped_mm' is a transformers built-in" in text
    assert "FAIL experts alone: MoE logits match the defaults" in text  # the narrowing names the culprit
    assert "ok   attention alone: MoE logits match the defaults" in text
    assert "MISSING: no kernel in the manifest provides a continuous-batching attention" in text
    assert "-> MISMATCH" in text and "FAIL MoE logits match the defaults" in text


def test_demo_runs_every_kernels_own_check_and_a_kernel_without_one_fails(tmp_path):
    """No kernel is skipped: one that registers nothing still gets its demo_check.py run, and one without a
    demo check fails the demo, naming the file to add."""
    lines = []
    root = _root(tmp_path)
    quiet = make_kernel(root / "kernels", name="quiet-tpu", registrations=[])
    silent = make_kernel(root / "kernels", name="silent-tpu", registrations=[])
    (silent / "demo_check.py").unlink()
    with open(root / "build.toml", "a") as f:
        f.write('[kernels.quiet]\npath = "kernels/quiet-tpu"\n[kernels.silent]\npath = "kernels/silent-tpu"\n')
    assert demo.run(root, local_hub=tmp_path / "hub", compile_matrix=False, out=lines.append) == 1
    text = "\n".join(lines)
    assert text.count("  double: fetched _") == 2 and "_quiet_tpu_cpu_" in text  # double and quiet checked
    assert f"FAILED silent demo check: ManifestError: declares no demo check: add {silent / 'demo_check.py'}" in text
    assert "demo: 1 check(s) FAILED" in text
