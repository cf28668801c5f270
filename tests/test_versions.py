"""The pinned set is a TorchTPU environment minus the hardware: torch-tpu with a libtpu it accepts,
the same pins in pyproject.toml and requirements.lock, and what is installed is what is pinned."""

import importlib.metadata
import re
import tomllib

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from pallas_hub.hub.manifest import ROOT


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def test_lock_pins_torch_tpu_and_a_libtpu_it_accepts():
    lock = _lock()
    assert lock["torch-tpu"] == "0.2.0"
    needs = {canonicalize_name(r.name): r for r in map(Requirement, importlib.metadata.requires("torch-tpu"))}
    for dependency in ("libtpu", "torch", "numpy"):
        version = lock[dependency].split("+")[0]
        assert needs[dependency].specifier.contains(version), f"torch-tpu needs {needs[dependency]}, lock has {version}"
    for dependency in needs:  # every dependency of torch-tpu is pinned
        assert dependency in lock, dependency


def test_pyproject_pins_match_the_lock_and_the_installed_versions():
    lock = _lock()
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in map(Requirement, deps):
        name = canonicalize_name(dep.name)
        assert dep.specifier.contains(lock[name].split("+")[0]), f"pyproject {dep} vs lock {lock[name]}"
    for name in ("torch-tpu", "libtpu", "jax", "torch"):
        installed = importlib.metadata.version(name)
        assert re.sub(r"\+.*", "", installed) == lock[name].split("+")[0], f"{name}: installed {installed}, lock {lock[name]}"
