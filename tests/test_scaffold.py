"""`pallas-hub new`: a kernel scaffolded in a checkout of its own passes, as generated, its tests, the compile
matrix, the build, the publish to a local hub and the fetch, and loads: through pallas_hub.load, through
kernels.get_kernel, into a transformers model through kernelize, in the demo and in the bench declarations."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from pallas_hub import cli, demo
from pallas_hub.hub import manifest
from pallas_hub.hub.declarations import bench_declaration
from pallas_hub.hub.fetch import _hub_settings
from pallas_hub.hub.publish import LocalHub
from pallas_hub.hub.scaffold import FILES

REPO = "pallas-hub-tests/softplus-tpu"


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    root = tmp_path / "checkout"
    root.mkdir()
    (root / "build.toml").write_text('# a hub of its own\n[hub]\nnamespace = "pallas-hub-tests"\n')
    monkeypatch.chdir(root)
    return root


def _cli(*argv):
    code = cli.main(list(argv))
    assert code == 0, argv
    return code


@pytest.mark.tpu_compile
def test_a_new_kernel_passes_everything_as_generated_and_loads_from_the_local_hub(checkout, tmp_path, capsys):
    hub = tmp_path / "local-hub"
    _cli("new", "softplus")
    out = capsys.readouterr().out
    folder = checkout / "kernels" / "softplus"
    assert f"created {folder} ({REPO} v1, package softplus_tpu): {len(FILES)} files" in out
    assert "[kernels.softplus]" in (checkout / "build.toml").read_text()
    assert (checkout / "build.toml").read_text().startswith("# a hub of its own\n")  # the rest kept as it was
    spec = manifest.load_manifest().kernels["softplus"]

    # its tests, as generated, with this repository's pytest configuration (markers, strict)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
                           str(manifest.ROOT / "pyproject.toml"), "--rootdir", str(checkout), str(folder)],
                          cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout and "failed" not in done.stdout, done.stdout[-3000:]

    # the compile matrix (one chip, to keep this short), build, publish, fetch
    assert cli.main(["check", "softplus", "--chips", "v6e"]) == 0
    assert "not as declared" in capsys.readouterr().out
    _cli("publish", "softplus", "--local-hub", str(hub))
    _cli("fetch", REPO, "--version", "1", "--trust", REPO, "--local-hub", str(hub))
    assert f"{REPO} v1 commit" in capsys.readouterr().out

    # loaded: by the loader (verified) and by kernels itself, from the local hub
    from pallas_hub import load

    x = torch.randn(37, 1000, generator=torch.Generator().manual_seed(0))
    with load({REPO: 1}, trust=[REPO], source=LocalHub(hub)) as loaded:
        k = loaded[REPO]
        assert loaded.kernels[0].variant == "torch-cpu"
        torch.testing.assert_close(k.softplus(x), torch.nn.functional.silu(x), rtol=1e-5, atol=1e-5)  # the template's op

    # ... and into a transformers model, through kernels' kernelize with the generated layer (kernels 0.17.2 route)
    from kernels import LayerRepository, Mode, kernelize, replace_kernel_forward_from_hub, use_kernel_mapping
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.activations import SiLUActivation

    cfg = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=32, max_position_embeddings=32)
    torch.manual_seed(0)
    ref = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    model = Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa").eval()
    had = getattr(SiLUActivation, "kernel_layer_name", None)
    replace_kernel_forward_from_hub(SiLUActivation, "SiLU")
    try:
        with _hub_settings(hub, tpu=False), use_kernel_mapping(
                {"SiLU": {"cpu": LayerRepository(REPO, layer_name="SiLU", version=1)}}, inherit_mapping=False):
            kernelize(model, mode=Mode.INFERENCE, device="cpu")
    finally:
        if had is None:
            del SiLUActivation.kernel_layer_name, SiLUActivation.kernel_condition
    assert model.model.layers[0].mlp.act_fn.forward.__qualname__ == "SiLU.forward"
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-4)

    # the demo runs its demo check; the bench declarations compute what they claim
    lines = []
    assert demo.run(checkout, local_hub=hub, compile_matrix=False, out=lines.append) == 0
    text = "\n".join(lines)
    assert "softplus-tpu: softplus matches its plain-JAX reference" in text and "MISSING" in text  # registers nothing
    from pallas_hub.hub.build import build_kernel, load_built

    kernel = load_built(build_kernel(spec, tmp_path / "bench-build"))
    raced, own = bench_declaration(spec, kernel)
    assert raced is None and [p.name for p in own] == ["softplus bf16 8192x4096", "softplus bf16 64x4096"]
    case = own[0].check()
    from pallas_hub.verify import interpret

    with interpret("fast"):
        got = np.asarray(own[0].fn(*case.args, **case.kwargs))
    np.testing.assert_allclose(got, np.asarray(case.reference), rtol=case.tol, atol=case.tol)


def test_new_refuses_what_would_clash_and_keeps_test_file_names_unique(checkout, capsys):
    _cli("new", "softplus")
    assert cli.main(["new", "softplus"]) == 2
    assert "already has kernel softplus" in capsys.readouterr().err
    assert cli.main(["new", "Soft_Plus"]) == 2
    assert "must be lowercase letters, digits and '-'" in capsys.readouterr().err
    assert cli.main(["new", "class"]) == 2  # the op would be named like a Python keyword
    assert "not a Python keyword" in capsys.readouterr().err
    # another kernel whose key would reuse test_softplus.py (pytest imports test files by name): renamed
    _cli("new", "soft-plus-two", "--key", "softplus2")
    (checkout / "kernels" / "softplus2" / "tests" / "test_softplus2.py").rename(
        checkout / "kernels" / "softplus2" / "tests" / "test_gelu.py")
    _cli("new", "gelu")
    assert (checkout / "kernels" / "gelu" / "tests" / "test_gelu_kernel.py").is_file()
    assert len(manifest.load_manifest().kernels) == 3
