"""build.toml files: the root hub manifest and each kernel's kernel-builder (edition 5) metadata.

Parsed with tomllib and validated with errors that say which file and which field is wrong.
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from pathlib import Path

# The checkout this package was loaded from, when it was (an editable install; loader/pallas_hub/hub/ -> ../../..).
# Commands find the checkout they run in with find_root() instead: a manifest, from the current folder upward.
ROOT = Path(__file__).resolve().parents[3]
MANIFEST = "build.toml"  # the hub manifest at a checkout's root (a build.toml with a [hub] table)
BACKENDS = ("cann", "cpu", "cuda", "metal", "neuron", "rocm", "tpu", "xpu")  # kernel-builder's enum
# What a Pallas TPU kernel can be built for: TorchTPU, and CPU through Pallas' interpret mode. Each backend
# becomes one noarch variant ``torch-<backend>`` whose metadata has that backend type, as kernel-builder's are.
PALLAS_BACKENDS = ("tpu", "cpu")
NAME_RE = re.compile(r"^[a-z][-a-z0-9]*[a-z0-9]$")  # what `kernels` accepts as a kernel name
REPO_RE = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$")
KEY_RE = re.compile(r"^[a-z][a-z0-9_]*$")  # a manifest key is a folder name (kernels/<key>, build folders)


class ManifestError(ValueError):
    """A build.toml that is missing a field or has a wrong one."""


def repo_id_problem(repo_id) -> str | None:
    """Why ``repo_id`` is not a usable Hub repo id ``org/name``, or None.

    huggingface_hub's own rules (no "--" or "..", which would also make ``org/a--b`` and ``org--a/b``
    share one cache folder), plus a namespace, ASCII only.
    """
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if not isinstance(repo_id, str) or not REPO_RE.match(repo_id):
        return f"repo id {repo_id!r} must look like 'org/name' (letters, digits, '-', '_', '.')"
    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        return f"repo id {repo_id!r} is not valid on the Hub: {e}"
    return None


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """One kernel: its folder and what its build.toml says."""

    key: str  # the folder name under kernels/, e.g. "ragged_dot"
    path: Path
    name: str  # the Hub kernel name, e.g. "ragged-dot-tpu"
    version: int
    license: str
    backends: tuple[str, ...]
    repo_id: str
    upstream: str | None = None
    source_repo: str | None = None  # where the code lives (the manifest's [hub] source), for metadata.json

    @property
    def variants(self) -> dict[str, str]:
        """The build variants, ``{"torch-tpu": "tpu", "torch-cpu": "cpu"}``: one per backend of build.toml."""
        return {f"torch-{b}": b for b in PALLAS_BACKENDS if b in self.backends}

    @property
    def package(self) -> str:
        """The importable package under torch-ext/ ("ragged-dot-tpu" -> "ragged_dot_tpu")."""
        return self.name.replace("-", "_")

    @property
    def source(self) -> Path:
        return self.path / "torch-ext" / self.package


def _load(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{path}: not valid TOML: {e}") from None


def _field(table: dict, key: str, kind: type, where: str):
    if key not in table:
        raise ManifestError(f"{where}: missing field {key!r}")
    value = table[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ManifestError(f"{where}: {key!r} must be an integer, got {value!r}")
    if not isinstance(value, kind):
        raise ManifestError(f"{where}: {key!r} must be a {kind.__name__}, got {value!r}")
    return value


def load_kernel(path: Path, key: str | None = None, source_repo: str | None = None) -> KernelSpec:
    """Read and validate ``path/build.toml`` (kernel-builder edition 5, noarch TPU kernel)."""
    path = Path(path)
    file = path / "build.toml"
    data = _load(file)
    where = f"{file} [general]"
    general = data.get("general")
    if not isinstance(general, dict):
        raise ManifestError(f"{file}: missing table [general]")
    name = _field(general, "name", str, where)
    if not NAME_RE.match(name):
        raise ManifestError(f"{where}: name {name!r} must be lowercase letters, digits and '-' (e.g. 'ragged-dot-tpu')")
    version = _field(general, "version", int, where)
    if version < 0:
        raise ManifestError(f"{where}: version must be >= 0, got {version}")
    edition = _field(general, "edition", int, where)
    if edition != 5:
        raise ManifestError(f"{where}: edition must be 5 (kernel-builder), got {edition}")
    license_ = _field(general, "license", str, where)
    backends = _field(general, "backends", list, where)
    unknown = [b for b in backends if b not in BACKENDS]
    if unknown or not backends:
        raise ManifestError(f"{where}: unknown backend(s) {unknown or backends}; known: {', '.join(BACKENDS)}")
    if "tpu" not in backends:
        raise ManifestError(f"{where}: backends must include 'tpu' (these are Pallas TPU kernels)")
    if other := [b for b in backends if b not in PALLAS_BACKENDS]:
        raise ManifestError(f"{where}: backends {other} cannot run a Pallas TPU kernel; use 'tpu' (TorchTPU) and "
                            "'cpu' (Pallas interpret mode, what CPU hosts and the tests load)")
    hub = general.get("hub")
    if not isinstance(hub, dict):
        raise ManifestError(f"{file}: missing table [general.hub] with repo-id")
    repo_id = _field(hub, "repo-id", str, f"{file} [general.hub]")
    if problem := repo_id_problem(repo_id):
        raise ManifestError(f"{file} [general.hub]: {problem}")
    upstream = general.get("upstream")
    if upstream is not None and not isinstance(upstream, str):  # kernels' metadata wants a git URL string
        raise ManifestError(f"{where}: 'upstream' must be a string (the upstream git URL), got {upstream!r}")
    if "torch-noarch" not in data:
        raise ManifestError(f"{file}: missing table [torch-noarch] (TPU kernels are noarch builds)")
    spec = KernelSpec(key or path.name, path, name, version, license_, tuple(backends), repo_id, upstream, source_repo)
    if not spec.source.is_dir():
        raise ManifestError(f"{file}: expected the package at {spec.source.relative_to(path)}")
    return spec


@dataclasses.dataclass(frozen=True)
class Manifest:
    namespace: str
    kernels: dict[str, KernelSpec]
    root: Path = ROOT  # the checkout: the folder holding the manifest
    source: str | None = None  # [hub] source: the URL of the source repository

    @property
    def file(self) -> Path:
        return self.root / MANIFEST

    def select(self, keys: list[str] | None) -> list[KernelSpec]:
        if not keys:
            return list(self.kernels.values())
        by_any = {**{k.name: k for k in self.kernels.values()}, **self.kernels}
        missing = [k for k in keys if k not in by_any]
        if missing:
            raise ManifestError(f"unknown kernel(s) {missing}; the manifest has {', '.join(self.kernels)}")
        return [by_any[k] for k in keys]


def _is_manifest(file: Path) -> bool:
    try:
        return isinstance(_load(file).get("hub"), dict)
    except ManifestError:
        return False


def find_root(start: Path | str | None = None) -> Path:
    """The checkout around ``start`` (default: the current folder): the nearest folder, ``start`` or
    above, holding a ``build.toml`` with a ``[hub]`` table (a kernel's own build.toml has none)."""
    start = Path(start if start is not None else Path.cwd()).resolve()
    for folder in (start, *start.parents):
        if _is_manifest(folder / MANIFEST):
            return folder
    raise ManifestError(f"no hub manifest ({MANIFEST} with a [hub] table) in {start} or any folder above it; run "
                        "pallas-hub inside a kernel hub checkout, or pass --manifest PATH/build.toml")


def load_manifest(root: Path | str | None = None) -> Manifest:
    """The hub manifest: ``[hub] namespace`` (and optional ``source``, the repository URL) and
    ``[kernels.<key>] path`` for every kernel. ``root``: the checkout (a folder) or the manifest file
    itself; default: found from the current folder upward (``find_root``)."""
    root = Path(root) if root is not None else find_root()
    if root.is_file() or root.suffix == ".toml":
        root = root.parent
    root = root.resolve()
    file = root / MANIFEST
    data = _load(file)
    hub = data.get("hub")
    if not isinstance(hub, dict):
        raise ManifestError(f"{file}: missing table [hub] with namespace (is this a kernel's build.toml? the hub "
                            "manifest is the build.toml at the checkout's root)")
    namespace = _field(hub, "namespace", str, f"{file} [hub]")
    source = hub.get("source")
    if source is not None and not (isinstance(source, str) and re.match(r"^[a-z][a-z0-9+.-]*://\S+$", source)):
        raise ManifestError(f"{file} [hub]: source must be the URL of the source repository (e.g. "
                            f"\"https://github.com/org/repo\"), got {source!r}")
    tables = data.get("kernels", {})
    if not isinstance(tables, dict):
        raise ManifestError(f"{file}: [kernels] must be a table of [kernels.<key>] tables")
    kernels = {}
    for key, table in tables.items():
        where = f"{file} [kernels.{key}]"
        if not KEY_RE.match(key):  # it names folders (build output, temporary folders): no paths
            raise ManifestError(f"{file}: kernel key {key!r} must be lowercase letters, digits and '_' "
                                "(a folder name, e.g. 'ragged_dot')")
        if not isinstance(table, dict):
            raise ManifestError(f"{where}: must be a table with path = \"kernels/{key}\"")
        rel = _field(table, "path", str, where)
        folder = (root / rel).resolve()
        if Path(rel).is_absolute() or not folder.is_relative_to(root):
            raise ManifestError(f"{where}: path {rel!r} must be a folder inside {root}")
        spec = load_kernel(root / rel, key, source)
        if not spec.repo_id.startswith(namespace + "/"):
            raise ManifestError(f"{spec.path / 'build.toml'}: repo-id {spec.repo_id!r} is outside namespace {namespace!r}")
        kernels[key] = spec
    return Manifest(namespace, kernels, root, source)
