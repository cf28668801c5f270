"""The TorchTPU device tier: every public op of every kernel, and the transformers glue, with all
tensors on TorchTPU's ``tpu`` device, brought up without hardware (``pallas_hub.verify.torchtpu``).

Bringing the device up changes process-global torch state, so each test module here runs in a
pytest process of its own: in the main run (``make test``, any ``-n``) a module is collected as one
item that runs ``python -m pytest <module>`` with PALLAS_HUB_TORCHTPU_TIER=1 and fails with that
run's report. Run one module directly with ``PALLAS_HUB_TORCHTPU_TIER=1 pytest tests/torchtpu/<module>``.
Skipped as a whole where torch_tpu is not installed.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

IN_TIER = os.environ.get("PALLAS_HUB_TORCHTPU_TIER") == "1"
ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- the main run: one process per module

class TierModuleFailed(Exception):
    pass


class TierRun(pytest.Item):
    """All tests of one tier module, run in a fresh pytest process."""

    def runtest(self):
        from pallas_hub.verify import torchtpu

        if not torchtpu.available():
            pytest.skip("torch_tpu is not installed: the TorchTPU device tier needs it (no TPU needed)")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT"))}
        env.update(PALLAS_HUB_TORCHTPU_TIER="1", TPU_SKIP_MDS_QUERY="1", JAX_PLATFORMS="cpu")
        cmd = [sys.executable, "-m", "pytest", str(self.path), "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
               "-W", "ignore::pytest.PytestUnraisableExceptionWarning"]
        try:
            run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired as e:
            raise TierModuleFailed(f"{self.path.name}: no result after 900 s\n{e.stdout or ''}") from None
        self.add_report_section("call", "tier run", run.stdout[-20000:])
        if run.returncode != 0:
            how = f"exit code {run.returncode}" if run.returncode > 0 else f"killed by signal {-run.returncode}"
            raise TierModuleFailed(f"{' '.join(cmd[2:5])}: {how}\n{run.stdout[-12000:]}\n{run.stderr[-4000:]}")

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, TierModuleFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, None, f"{self.path.name} (own process, `tpu` device)"


class TierModule(pytest.File):
    def collect(self):
        yield TierRun.from_parent(self, name="tpu-tier")


if not IN_TIER:
    def pytest_pycollect_makemodule(module_path, parent):
        return TierModule.from_parent(parent, path=module_path)


# --------------------------------------------------------------------------- inside a tier process

if IN_TIER:
    from pallas_hub.verify import torchtpu

    if not torchtpu.available():
        collect_ignore_glob = ["test_*.py"]


@pytest.fixture(scope="session", autouse=True)
def tpu_device():
    """TorchTPU's `tpu` device, brought up as its autoload does on a TPU host (no chip, no PJRT
    client), before any test of the tier runs."""
    return torchtpu.bring_up()


class OnTPU:
    """Tensors and calls on ``tpu`` in one mode: "fake" (torch_tpu's own fake kernels, each of which
    exports the kernel for TPU) or "eager" (torch_tpu's eager path, the launch taken by a checker)."""

    def __init__(self, kind: str):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.kind = kind
        self.mode = FakeTensorMode()
        self.checker = torchtpu.LaunchChecker() if kind == "eager" else None

    def empty(self, *shape, dtype=None):
        import torch

        with self.mode:
            return torch.empty(shape, dtype=dtype or torch.bfloat16, device="tpu")

    def __call__(self, package, fn):
        """fn() with the ops of ``package`` taking their `tpu` path; no CPU tensor may appear."""
        with torchtpu.tpu_kernels(torchtpu.kernel_ops(package), self.checker), self.mode, torchtpu.no_cpu_tensors():
            return fn()

    def launched(self) -> list[str]:
        """Names of the TorchTPU ops launched so far (eager mode)."""
        return [launch.name.split("::")[1] for launch in self.checker.launches]


class SavedContext:
    """What autograd hands a custom op's setup_context/backward. torch's autograd engine cannot run
    on `tpu` without a chip (its device queues come from the PJRT client), so tests call a kernel's
    registered setup_context and backward directly, as the engine would."""

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def backward(setup_context, backward_fn, inputs, output, *grads):
    """Gradients of one custom-op call, through its registered autograd functions."""
    ctx = SavedContext()
    setup_context(ctx, inputs, output)
    return backward_fn(ctx, *grads)


@pytest.fixture(params=["fake", "eager"])
def on_tpu(request):
    return OnTPU(request.param)


@pytest.fixture
def eager_tpu():
    return OnTPU("eager")


@pytest.fixture(params=["TPU v5e", "TPU v6e", "TPU v7"])
def chip(request):
    """TorchTPU reports this chip; yields the generation the kernels should tile for."""
    with torchtpu.fake_chip(request.param):
        yield {"TPU v5e": "v5e", "TPU v6e": "v6e", "TPU v7": "tpu7x"}[request.param]
