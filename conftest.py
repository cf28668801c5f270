"""Shared pytest set-up: CPU-only JAX, and building + importing kernel packages the real way."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu (loaded with torch_tpu) never asks the cloud metadata server
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test processes may compile for TPU

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def load_kernel(tmp_path_factory):
    """load_kernel("ragged_dot" | path, variant="torch-cpu") -> the built kernel module.

    Builds with pallas_hub.hub.build (shared modules vendored, unique op namespace) into a per-session temp
    folder and imports through kernels.get_local_kernel, exactly as a Hub download would be.
    """
    from pallas_hub.hub import manifest
    from pallas_hub.hub.build import build_kernel, load_built

    cache = {}

    def load(kernel, variant="torch-cpu"):
        path = Path(kernel) if os.sep in str(kernel) else ROOT / "kernels" / str(kernel)
        if path not in cache:
            spec = manifest.load_kernel(path)
            cache[path] = build_kernel(spec, tmp_path_factory.mktemp(spec.key))
        return load_built(cache[path], variant)

    return load
