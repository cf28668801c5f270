"""Synthetic kernel packages for the loader's tests, written into temporary folders.

TEST DOUBLES: plain torch stand-ins, not Pallas kernels. They exist only to exercise the loader's
build / publish / fetch / registration mechanism (and the demo's flow) independently of the real
kernels; every result obtained with them is about the loader, never about kernel numerics.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

DOUBLE_SOURCE = '''\
"""TEST DOUBLE (plain torch, not a Pallas kernel): registers an experts, an attention and a
continuous-batching function so the loader's registration mechanism can be tested."""
import torch

CALLS = dict(experts=0, attention=0, paged=0)
VERSION_MARK = @MARK@


def experts_forward(self, hidden_states, top_k_index, top_k_weights):
    CALLS["experts"] += 1
    out = torch.zeros_like(hidden_states, dtype=torch.float32)
    for e in range(self.num_experts):
        tok, slot = (top_k_index == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        h = self._apply_gate(hidden_states[tok] @ self.gate_up_proj[e].transpose(0, 1))
        y = (h @ self.down_proj[e].transpose(0, 1)).float() * top_k_weights[tok, slot, None].float()
        out.index_add_(0, tok, y)
    return out.to(hidden_states.dtype)


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    CALLS["attention"] += 1
    causal = attention_mask is None and query.shape[2] > 1
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, is_causal=causal, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def varlen_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Packed requests (cu_seq_lens_q/k), causal bottom-right per request, as continuous batching calls it."""
    CALLS["paged"] += 1
    cu_q, cu_k = kwargs["cu_seq_lens_q"].tolist(), kwargs["cu_seq_lens_k"].tolist()
    out = query.new_zeros(1, query.shape[2], query.shape[1], query.shape[3])
    for i in range(len(cu_q) - 1):
        q = query[:, :, cu_q[i]:cu_q[i + 1]]
        k, v = key[:, :, cu_k[i]:cu_k[i + 1]], value[:, :, cu_k[i]:cu_k[i + 1]]
        lq, lk = q.shape[2], k.shape[2]
        if lq == 0:
            continue
        allowed = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scaling, enable_gqa=True)
        out[0, cu_q[i]:cu_q[i + 1]] = o[0].transpose(0, 1)
    return out, None


REGISTRATIONS = @REGISTRATIONS@
'''

FULL = [
    {"registry": "experts", "name": "double_experts", "function": "experts_forward"},
    {"registry": "attention", "name": "double_attention", "function": "attention_forward", "mask": "sdpa"},
    {"registry": "paged_attention", "name": "double_paged_flash", "function": "varlen_attention_forward",
     "mask": "flash_attention_2"},
]


DEMO_CHECK = '''
def check(kernel, out=print):
    """TEST DOUBLE's demo check: the fetched module is the double, with its declarations."""
    out("  double: fetched " + kernel.__name__)
    return [("double declares its registrations", isinstance(kernel.REGISTRATIONS, list))]
'''


def make_kernel(root: Path, name: str = "double-tpu", *, version: int = 1, org: str = "pallas-hub-tests",
                registrations=None, mark: str = "a", source: str | None = None) -> Path:
    """Write kernel package ``name`` (build.toml + torch-ext/<pkg>/__init__.py, CARD.md, demo_check.py) under
    ``root/name``."""
    path = Path(root) / name
    pkg = path / "torch-ext" / name.replace("-", "_")
    pkg.mkdir(parents=True, exist_ok=True)
    (path / "build.toml").write_text(textwrap.dedent(f"""\
        [general]
        name = "{name}"
        version = {version}
        edition = 5
        license = "Apache-2.0"
        backends = ["tpu", "cpu"]
        [general.hub]
        repo-id = "{org}/{name}"
        [torch-noarch]
        [kernel]
        """))
    regs = FULL if registrations is None else registrations
    (pkg / "__init__.py").write_text(source or DOUBLE_SOURCE.replace("@MARK@", repr(mark)).replace("@REGISTRATIONS@", repr(regs)))
    (path / "CARD.md").write_text(f"# {name}\n\nA test double.\n")
    (path / "demo_check.py").write_text(DEMO_CHECK)
    return path


def build_double(root: Path, **kw):
    """``make_kernel(root, **kw)``, loaded and built (``build/`` beside its sources); the KernelSpec."""
    from pallas_hub.hub import build, manifest

    spec = manifest.load_kernel(make_kernel(root, **kw))
    build.build_kernel(spec)
    return spec
