"""Every kernel's benchmarks/benchmark*.py runs under `kernels benchmark`'s own runner and
synchronises the device itself (the runner only synchronises CUDA/XPU/MPS, not TPUs)."""

import shutil
import textwrap
from pathlib import Path

import pytest

from pallas_hub.hub import manifest as mf
from pallas_hub.hub.build import build_kernel

FIXTURE = mf.ROOT / "tests" / "fixtures" / "scale_add"

# The format kernel authors follow: a kernels.benchmark.Benchmark subclass whose benchmark_* methods
# end with the vendored bridge's synchronize (a no-op on CPU, a device sync on TorchTPU), imported by
# module name: a reloaded kernel package may lack the ``_bridge`` attribute although the module exists.
EXAMPLE = '''
import importlib

import torch
from kernels.benchmark import Benchmark


def synchronize(kernel, out):
    """Wait for the device (kernels benchmark does not synchronise TPUs): the vendored bridge's helper."""
    importlib.import_module(kernel.__name__ + "._bridge").synchronize(out)


class ScaleAddBenchmark(Benchmark):
    seed = 0

    def setup(self):
        self.x = torch.randn(300, 256, device=self.device)
        self.y = torch.randn(300, 256, device=self.device)

    def benchmark_scale_add(self):
        self.out = self.kernel.scale_add(self.x, self.y, 2.0)
        synchronize(self.kernel, self.out)

    def verify_scale_add(self):
        return 2.0 * self.x + self.y
'''


def _benchmark_files():
    try:
        kernels = mf.load_manifest().kernels.values()
    except mf.ManifestError:
        kernels = []
    return [(spec, path) for spec in kernels for path in sorted((spec.path / "benchmarks").glob("benchmark*.py"))]


def _run_with_kernels_runner(spec, script: Path, tmp_path: Path):
    from kernels.cli.benchmark import discover_benchmark_classes, run_benchmark_class

    build = build_kernel(spec, tmp_path / "build")
    classes = discover_benchmark_classes(script, script.parent)
    assert classes, f"{script}: no kernels.benchmark.Benchmark subclass"
    for cls in classes:
        results, _ = run_benchmark_class(cls, iterations=2, warmup=1, repo_id=str(build / "torch-cpu"),
                                         is_local=True, revision="")
        assert results, f"{script}: {cls.__name__} ran no workload"
        for name, timing in results.items():
            assert timing.verified in (True, None), f"{script}: {name} failed its verify_ method"


def test_example_benchmark_format_runs_under_kernels_runner(tmp_path):
    kernel = tmp_path / "scale_add"
    shutil.copytree(FIXTURE, kernel)
    script = kernel / "benchmarks" / "benchmark_scale_add.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent(EXAMPLE))
    _run_with_kernels_runner(mf.load_kernel(kernel), script, tmp_path)


@pytest.mark.parametrize("spec,script", _benchmark_files(), ids=lambda x: getattr(x, "name", str(x)))
def test_kernel_benchmarks_run_and_synchronise(spec, script, tmp_path):
    assert "synchronize(" in script.read_text(), (
        f"{script}: synchronise in each benchmark_ method (importlib.import_module(self.kernel.__name__ + "
        "'._bridge').synchronize(out)); "
        "kernels benchmark does not synchronise TPUs")
    _run_with_kernels_runner(spec, script, tmp_path)
