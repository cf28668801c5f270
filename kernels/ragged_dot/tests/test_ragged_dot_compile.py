"""Ahead-of-time TPU compilation (XLA:TPU + Mosaic through libtpu, no TPU) of a representative
subset of compile_matrix.py; `pallas-hub check ragged_dot` compiles all of it."""

import pytest

from pallas_hub.hub import manifest
from pallas_hub.verify import matrix

SUBSET = {  # config name -> chips
    "qwen3-30b-a3b ragged_dot fwd T=64": ("v6e",),
    "qwen3-30b-a3b ragged_dot fwd+bwd T=256": ("v5e",),
    "qwen3-30b-a3b experts T=4096 (bucket 4096)": ("tpu7x",),
    "gemma4-26b-a4b experts T=1 (bucket 8)": ("v6e",),
    "gpt-oss-20b experts T=64": ("tpu7x",),
    "gpt-oss-20b experts T=2048": ("tpu7x",),  # interleaved gate_up in the widest blocks gmm's VMEM model allows
    "qwen3-30b-a3b experts EP=8 T=64": ("v6e",),
    "qwen3-30b-a3b fp8 experts T=64 (bucket 64)": ("tpu7x",),
    "qwen3-30b-a3b fp8 experts T=1 (bucket 8)": ("v5e",),
    "deepseek-v3 fp8 experts T=64": ("v6e",),
    "forced tile_n=4096 at k=16384 (VMEM overflow)": ("v6e",),
}


@pytest.mark.tpu_compile
def test_compile_matrix_subset(load_kernel):
    kern = load_kernel("ragged_dot")
    configs = matrix.load_configs(manifest.ROOT / "kernels" / "ragged_dot" / "compile_matrix.py", kern)
    by_name = {c.name: c for c in configs}
    assert set(SUBSET) <= set(by_name), set(SUBSET) - set(by_name)
    rows = []
    for name, chips in SUBSET.items():
        rows += matrix.run("ragged-dot-tpu", [by_name[name]], chips=chips, progress=None)
    assert len(rows) == len(SUBSET)
    bad = [r.line() for r in rows if not r.as_expected]
    assert not bad, bad
    overflow = [r for r in rows if r.config.fails_with]
    assert overflow and all("RESOURCE_EXHAUSTED" in r.result.error for r in overflow)
