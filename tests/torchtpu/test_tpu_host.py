"""What a TorchTPU host looks like to the kernels and the loader: tiles follow the generation of
torch_tpu's chip (each device kind faked through torch_tpu's PCI scan), JAX's runtime is never
asked for devices, and the build variant each way of loading picks."""

import types

import pytest
import torch


@pytest.fixture
def no_jax_runtime(monkeypatch):
    """On a TorchTPU host the TPU belongs to torch_tpu: asking JAX's runtime for devices either
    fails or collides with it."""
    import jax

    def refuse(*args, **kwargs):
        raise AssertionError("jax.devices() called on a TorchTPU host")

    monkeypatch.setattr(jax, "devices", refuse)
    monkeypatch.setattr(jax, "local_devices", refuse)


def _recording(monkeypatch, module, name):
    seen, real = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    return seen


def test_ragged_dot_tiles_for_torch_tpus_chip(load_kernel, eager_tpu, chip, no_jax_runtime, monkeypatch):
    rd = load_kernel("ragged_dot", "torch-tpu")
    seen = _recording(monkeypatch, rd.pallas, "current_chip")
    lhs, rhs, gs = eager_tpu.empty(256, 128), eager_tpu.empty(4, 128, 256), eager_tpu.empty(4, dtype=torch.int64)
    eager_tpu(rd, lambda: rd.ragged_dot(lhs, rhs, gs))
    assert seen and set(seen) == {chip}
    assert eager_tpu.launched() == ["ragged_dot_jax"]


def test_flash_attention_blocks_for_torch_tpus_chip(load_kernel, eager_tpu, chip, no_jax_runtime, monkeypatch):
    fa = load_kernel("flash_attention", "torch-tpu")
    seen = _recording(monkeypatch, fa.pallas, "_chip_from_device")
    q, k = eager_tpu.empty(1, 4, 256, 128), eager_tpu.empty(1, 2, 256, 128)
    eager_tpu(fa, lambda: fa.attention(q, k, k))
    assert seen and set(seen) == {chip}


def test_the_generation_is_none_for_an_unknown_chip_without_asking_jax(no_jax_runtime):
    """This host has no TPU: torch_tpu reports "TPU", so tiles fit every generation."""
    from pallas_hub.vendored import _chips

    assert torch.tpu.get_device_name() == "TPU" and _chips.tpu_generation() is None
    assert _chips.tpu_generation(types.SimpleNamespace(device_kind="TPU v6 lite")) == "v6e"  # an explicit device


def test_variants_kernels_alone_picks_cpu_the_loader_picks_tpu(tmp_path):
    """torch_tpu 0.2.0 never sets torch.backends.tpu, which is what `kernels` checks: plain
    get_kernel resolves torch-cpu (the same code, which registers the `tpu` kernels too), the loader resolves torch-tpu."""
    import kernels
    from pallas_hub.hub import fetch as fetch_mod, manifest
    from pallas_hub.hub.build import build_kernel
    from pallas_hub.hub.manifest import ROOT
    from pallas_hub.hub.publish import LocalHub

    # the tooling's fixture kernel: importing a build of a kernel this process already loaded from
    # another path would register its op names a second time
    spec = manifest.load_kernel(ROOT / "tests" / "fixtures" / "scale_add")
    hub = LocalHub(tmp_path / "hub")
    hub.publish(spec, build_kernel(spec, tmp_path / "build"), progress=None)
    repo = spec.repo_id
    assert torch.accelerator.current_accelerator().type == "tpu" and not torch.accelerator.is_available()
    assert not hasattr(torch.backends, "tpu")

    with fetch_mod._hub_settings(hub.root, tpu=False):  # kernels alone, offline against the local hub
        plain = kernels.get_kernel(repo, version=1, trust_remote_code=[repo])
    assert "/build/torch-cpu/" in plain.__file__
    assert torch._C._dispatch_has_kernel_for_dispatch_key(plain.scale_add._qualname, "PrivateUse1")  # runs on `tpu`

    got = fetch_mod.fetch(repo, 1, trust=[repo], source=hub)
    assert got.variant == "torch-tpu" and "/build/torch-tpu/" in got.module.__file__
    assert not hasattr(torch.backends, "tpu")  # the loader's shim is gone again

    torch.backends.tpu = types.SimpleNamespace()  # what the README tells users of plain kernels to set
    try:
        with fetch_mod._hub_settings(hub.root, tpu=False):
            shimmed = kernels.get_kernel(repo, version=1, trust_remote_code=[repo])
    finally:
        del torch.backends.tpu
    assert "/build/torch-tpu/" in shimmed.__file__
