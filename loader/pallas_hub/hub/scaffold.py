"""``pallas-hub new NAME``: a new kernel that builds, tests, checks, publishes and loads as generated.

It writes ``kernels/<key>/`` in the checkout with the conventions of every kernel here (a working
elementwise kernel, SiLU, for the author to replace) and adds the kernel to the hub manifest:

    build.toml                      kernel-builder metadata (backends tpu and cpu)
    CARD.md                         the Hub card
    torch-ext/<package>/pallas.py   the Pallas kernel, its validation, its plain-JAX reference
    torch-ext/<package>/__init__.py the torch op through the vendored bridge (jax_op, fake=, validate=)
    torch-ext/<package>/layers.py   a layer for kernels' kernelize
    compile_matrix.py               what `pallas-hub check` compiles per TPU generation
    bench_problems.py               what `pallas-hub bench` runs
    demo_check.py                   what `pallas-hub demo` checks
    tests/test_<key>.py             the kernel's tests (a file name no other test file here has)
    benchmarks/benchmark_<key>.py   the `kernels benchmark` script (published with the kernel)

Names follow from NAME: the Hub name ``<name>-tpu`` (``-tpu`` added if missing), the folder and manifest
key ``<name>`` with ``_`` for ``-``, the package ``<name>_tpu``, the op named like the key.
"""

from __future__ import annotations

import dataclasses
import keyword
import string
from pathlib import Path

from .manifest import KEY_RE, MANIFEST, NAME_RE, KernelSpec, Manifest, ManifestError, load_kernel, repo_id_problem

TEMPLATES = Path(__file__).resolve().parent / "templates"
# template -> where it goes in the kernel folder
FILES = {
    "build.toml": "build.toml",
    "CARD.md": "CARD.md",
    "pallas.py": "torch-ext/{package}/pallas.py",
    "__init__.py": "torch-ext/{package}/__init__.py",
    "layers.py": "torch-ext/{package}/layers.py",
    "compile_matrix.py": "compile_matrix.py",
    "bench_problems.py": "bench_problems.py",
    "demo_check.py": "demo_check.py",
    "test_kernel.py": "tests/{test_module}.py",
    "benchmark.py": "benchmarks/benchmark_{key}.py",
}


@dataclasses.dataclass(frozen=True)
class Names:
    name: str  # the Hub kernel name, "softplus-tpu"
    key: str  # folder and manifest key, "softplus"
    package: str  # "softplus_tpu"
    op: str  # the op and its JAX function, "softplus"
    repo_id: str
    test_module: str  # "test_softplus" (test file names are unique in a checkout: pytest's import mode)

    def substitutions(self) -> dict[str, str]:
        return {**dataclasses.asdict(self), "Class": "".join(part.title() for part in self.key.split("_"))}


def names(manifest: Manifest, name: str, key: str | None = None) -> Names:
    """The names of a new kernel ``name`` in ``manifest``; a ManifestError says what clashes or is malformed."""
    name = name if name.endswith("-tpu") else f"{name}-tpu"
    if not NAME_RE.match(name):
        raise ManifestError(f"kernel name {name!r} must be lowercase letters, digits and '-' (e.g. 'softplus')")
    key = key or name.removesuffix("-tpu").replace("-", "_")
    if not KEY_RE.match(key) or keyword.iskeyword(key):
        raise ManifestError(f"kernel key {key!r} must be lowercase letters, digits and '_', and not a Python keyword")
    repo_id = f"{manifest.namespace}/{name}"
    if problem := repo_id_problem(repo_id):
        raise ManifestError(problem)
    taken = {spec.repo_id: spec.key for spec in manifest.kernels.values()}
    if key in manifest.kernels or repo_id in taken:
        raise ManifestError(f"the manifest {manifest.file} already has kernel {key if key in manifest.kernels else taken[repo_id]} "
                            f"({repo_id if repo_id in taken else manifest.kernels[key].repo_id}); choose another name")
    folder = manifest.root / "kernels" / key
    if folder.exists():
        raise ManifestError(f"{folder} exists already; choose another name, or remove it")
    tests = {p.stem for p in manifest.root.rglob("test_*.py") if ".venv" not in p.parts and "site-packages" not in p.parts}
    test_module = next(m for m in (f"test_{key}", f"test_{key}_kernel", *(f"test_{key}_{i}" for i in range(2, 99)))
                       if m not in tests)
    return Names(name, key, name.replace("-", "_"), key, repo_id, test_module)


def render(template: str, names: Names) -> str:
    return string.Template((TEMPLATES / f"{template}.tmpl").read_text()).substitute(names.substitutions())


def new_kernel(manifest: Manifest, name: str, key: str | None = None) -> tuple[KernelSpec, list[Path]]:
    """Write the kernel folder and add it to the manifest; (its KernelSpec, the files written)."""
    n = names(manifest, name, key)
    folder = manifest.root / "kernels" / n.key
    rendered = {folder / target.format(**n.substitutions()): render(template, n) for template, target in FILES.items()}
    for path, text in rendered.items():  # everything rendered before anything is written
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    manifest_text = manifest.file.read_text()
    entry = f'\n[kernels.{n.key}]\npath = "kernels/{n.key}"\n'
    manifest.file.write_text(manifest_text.rstrip("\n") + "\n" + entry)
    return load_kernel(folder, n.key, manifest.source), sorted(rendered)


def next_steps(spec: KernelSpec, root: Path) -> list[str]:
    """What the author does next, as commands run from the checkout's root."""
    rel = spec.path.relative_to(root)
    return [
        f"edit {rel / 'torch-ext' / spec.package / 'pallas.py'}: _body (the kernel) and reference (plain JAX)",
        f"python -m pytest {rel}                     # the kernel's tests",
        f"pallas-hub check {spec.key}                        # the TPU compile matrix (compile_matrix.py)",
        f"pallas-hub publish {spec.key}                      # build, then publish to the local hub",
        f"pallas-hub fetch {spec.repo_id} --version {spec.version} --trust {spec.repo_id}",
        f"(the manifest entry is in {MANIFEST}; CARD.md, bench_problems.py and demo_check.py describe the template's op)",
    ]
