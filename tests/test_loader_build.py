"""build.toml validation and the build: deterministic bytes, kernels' own metadata and digest format."""

import json
import textwrap

import pytest

from pallas_hub.hub import build, manifest

FIXTURE = manifest.ROOT / "tests" / "fixtures" / "scale_add"

GOOD = """\
[general]
name = "ok-tpu"
version = 1
edition = 5
license = "Apache-2.0"
backends = ["tpu"]
[general.hub]
repo-id = "org/ok-tpu"
[torch-noarch]
[kernel]
"""


def _kernel(tmp_path, text):
    (tmp_path / "torch-ext" / "ok_tpu").mkdir(parents=True)
    (tmp_path / "build.toml").write_text(textwrap.dedent(text))
    return tmp_path


@pytest.mark.parametrize("change, message", [
    (("license = \"Apache-2.0\"\n", ""), "missing field 'license'"),
    (("name = \"ok-tpu\"", "name = \"Ok_TPU\""), "name 'Ok_TPU' must be lowercase"),
    (("version = 1", "version = \"1\""), "'version' must be an integer"),
    (("version = 1", "version = 1.5"), "'version' must be an integer"),
    (("backends = [\"tpu\"]", "backends = [\"tpu\", \"gpu\"]"), "unknown backend(s) ['gpu']"),
    # a Pallas TPU kernel has no CUDA build: kernels would resolve it on CUDA hosts, where the ops refuse every tensor
    (("backends = [\"tpu\"]", "backends = [\"tpu\", \"cuda\"]"), "backends ['cuda'] cannot run a Pallas TPU kernel"),
    (("[torch-noarch]\n", ""), "missing table [torch-noarch]"),
    (("repo-id = \"org/ok-tpu\"", "repo-id = \"ok-tpu\""), "must look like 'org/name'"),
    (("edition = 5", "edition = [5"), "not valid TOML"),
    # each of these passed build and publish, and failed every fetch later
    (("backends = [\"tpu\"]", "backends = [\"tpu\"]\nupstream = 5"), "'upstream' must be a string"),
    (("org/ok-tpu", "org/ok--tpu"), "is not valid on the Hub: Cannot have -- or .. in repo_id"),
    (("org/ok-tpu", "org--ok/tpu"), "is not valid on the Hub"),  # would share a cache folder with org/ok--tpu
    (("org/ok-tpu", "org/ok..tpu"), "is not valid on the Hub"),
])
def test_bad_build_toml_is_refused_with_the_field_named(tmp_path, change, message):
    manifest.load_kernel(_kernel(tmp_path / "good", GOOD))  # the unchanged file is accepted
    with pytest.raises(manifest.ManifestError, match=None) as e:
        manifest.load_kernel(_kernel(tmp_path / "bad", GOOD.replace(*change)))
    assert message in str(e.value) and "build.toml" in str(e.value)


def test_an_upstream_that_kernels_refuses_fails_the_build_not_the_fetch(tmp_path):
    spec = manifest.load_kernel(_kernel(tmp_path, GOOD.replace('backends = ["tpu"]', 'backends = ["tpu"]\nupstream = "x"')))
    with pytest.raises(manifest.ManifestError, match=r"build.toml: kernels refuses the metadata built from it: .*"
                                                     r"invalid git URL `x`"):
        build.build_kernel(spec)
    assert not (spec.path / "build" / "torch-tpu").exists()


@pytest.mark.parametrize("kernels_table, message", [
    ('[kernels."../x"]\npath = "k"\n', r"kernel key '../x' must be lowercase letters"),  # `check` built into tmp/../x
    ('[kernels.k]\npath = "../outside"\n', r"path '../outside' must be a folder inside"),
    ('[kernels.k]\npath = "/tmp"\n', r"path '/tmp' must be a folder inside"),
    ('[kernels]\nk = "k"\n', r"\[kernels.k\]: must be a table"),
])
def test_manifest_keys_and_paths_cannot_leave_the_repository(tmp_path, kernels_table, message):
    _kernel(tmp_path / "k", GOOD.replace("org/", "pallas-hub-tests/"))
    (tmp_path / "build.toml").write_text('[hub]\nnamespace = "pallas-hub-tests"\n' + kernels_table)
    with pytest.raises(manifest.ManifestError, match=message):
        manifest.load_manifest(tmp_path)


def test_manifest_kernel_outside_the_namespace_is_refused(tmp_path):
    _kernel(tmp_path / "k", GOOD)
    (tmp_path / "build.toml").write_text('[hub]\nnamespace = "other"\n[kernels.k]\npath = "k"\n')
    with pytest.raises(manifest.ManifestError, match="outside namespace 'other'"):
        manifest.load_manifest(tmp_path)


def test_building_twice_gives_identical_bytes_and_kernels_digest_validates(tmp_path):
    from kernels._rust import Digest, Metadata

    spec = manifest.load_kernel(FIXTURE)
    a, b = build.build_kernel(spec, tmp_path / "a"), build.build_kernel(spec, tmp_path / "b")
    files_a = {p.relative_to(a): p.read_bytes() for p in sorted(a.rglob("*")) if p.is_file()}
    files_b = {p.relative_to(b): p.read_bytes() for p in sorted(b.rglob("*")) if p.is_file()}
    assert files_a == files_b and len(files_a) == 22
    assert spec.variants == {"torch-tpu": "tpu", "torch-cpu": "cpu"}  # never torch-universal (every host accepts it)
    for variant, backend in spec.variants.items():
        raw = (a / variant / "metadata.json").read_bytes()
        meta = json.loads(raw)
        assert (meta["name"], meta["version"], meta["backend"], meta["python-depends"]) == \
            ("scale-add-tpu", 1, {"type": backend}, [])
        parsed = Metadata.from_bytes(raw)  # kernels' own (Rust) parser
        parsed.digest.validate(Digest.hash_variant(parsed.digest.algorithm, a / variant))
        assert set(parsed.digest.files) == {str(p.relative_to(a / variant)) for p in (a / variant).rglob("*.py")}
    ids = {json.loads((a / v / "metadata.json").read_bytes())["id"] for v in spec.variants}
    assert len(ids) == 2  # one unique id (= sys.modules key and op namespace) per variant


def test_the_same_build_imported_from_two_folders_shares_its_ops(tmp_path):
    """A local build and its Hub download (two folders) define the same op names: the second import
    must not re-register them, which leaves the first module's ops with a dangling dispatcher handle
    (torch: "no schema registered" or a crash, seen in the suite when two tests loaded one kernel)."""
    import gc

    import torch

    spec = manifest.load_kernel(FIXTURE)
    first = build.load_built(build.build_kernel(spec, tmp_path / "a"))
    second = build.load_built(build.build_kernel(spec, tmp_path / "b"))
    assert first is not second and first.__file__ != second.__file__
    assert first.scale_add is second.scale_add
    del second
    gc.collect()
    x, y = torch.randn(5, 130), torch.randn(5, 130)
    torch.testing.assert_close(first.scale_add(x, y, 0.5), x * 0.5 + y)


# every kernel gets the shared modules it imports, byte for byte from pallas_hub/vendored/, and no others
VENDORED = {
    "ragged_dot": {"_bridge.py", "_chips.py"},
    "flash_attention": {"_bridge.py", "_chips.py", "_attention_math.py"},
    "paged_attention": {"_bridge.py", "_chips.py", "_attention_math.py"},  # the bridge asks _chips for TorchTPU's chip
}


@pytest.mark.parametrize("key", sorted(VENDORED))
def test_shared_modules_are_vendored_byte_for_byte_where_imported(key, tmp_path):
    spec = manifest.load_manifest().kernels[key]
    shared = build.shared_modules()
    assert set(shared) == {"_bridge.py", "_chips.py", "_attention_math.py"}
    assert not set(shared) & {p.name for p in spec.source.iterdir()}, "a kernel keeps a copy of a shared module"
    out = build.build_kernel(spec, tmp_path)
    for variant in spec.variants:
        for package in (out / variant, out / variant / spec.package):
            present = {p.name for p in package.glob("_*.py")} - {"_ops.py", "__init__.py"}
            assert present == VENDORED[key]
            for name in present:
                assert (package / name).read_bytes() == (build.VENDORED / name).read_bytes()


def test_fixture_gets_only_the_bridge_and_its_imports_and_a_source_copy_is_refused(tmp_path):
    spec = manifest.load_kernel(FIXTURE)
    assert {n for n in build.package_files(spec) if n.startswith("_")} - {"__init__.py"} == {"_bridge.py", "_chips.py"}
    import shutil

    copy = tmp_path / "k"
    shutil.copytree(FIXTURE, copy, ignore=shutil.ignore_patterns("build"))
    spec = manifest.load_kernel(copy)
    (spec.source / "_chips.py").write_text("CHIPS = {}\n")
    with pytest.raises(ValueError, match="_chips.py is generated by the build"):
        build.package_files(spec)


def test_shared_imports_are_found_in_every_form():
    shared = {"_a.py": b"from ._b import x\n", "_b.py": b"", "_c.py": b"", "_bridge.py": b""}
    files = {"__init__.py": b"from . import _c as c, pallas  # comment\n", "pallas.py": b"from ._a import y\n"}
    assert build.imported_shared(files, shared) == ["_a.py", "_b.py", "_bridge.py", "_c.py"]
    assert build.imported_shared({"x.py": b"import os\n"}, shared) == ["_bridge.py"]


def test_variants_follow_the_backends_and_a_stale_variant_is_removed(tmp_path):
    spec = manifest.load_kernel(_kernel(tmp_path, GOOD))
    (spec.path / "build" / "torch-universal").mkdir(parents=True)  # what an older pallas-hub built
    out = build.build_kernel(spec)
    assert sorted(p.name for p in out.iterdir()) == ["torch-tpu"]  # backends = ["tpu"]: no CPU build either
    both = manifest.load_kernel(_kernel(tmp_path / "both", GOOD.replace('["tpu"]', '["tpu", "cpu"]')))
    assert sorted(p.name for p in build.build_kernel(both).iterdir()) == ["torch-cpu", "torch-tpu"]


def _git(folder, *args):
    import subprocess

    subprocess.run(["git", "-C", str(folder), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True,
                   capture_output=True)


def test_metadata_names_the_source_repository_and_the_commit_it_was_built_from(tmp_path):
    from kernels._rust import Metadata

    root = tmp_path / "hub"
    (root / "kernels").mkdir(parents=True)
    (root / "build.toml").write_text('[hub]\nnamespace = "org"\nsource = "https://example.org/org/hub"\n'
                                     '[kernels.ok]\npath = "kernels/ok"\n')
    _kernel(root / "kernels" / "ok", GOOD)
    (root / "kernels" / "ok" / "torch-ext" / "ok_tpu" / "__init__.py").write_text("X = 1\n")
    spec = manifest.load_manifest(root).kernels["ok"]
    meta = lambda: Metadata.from_bytes(build.variant_files(spec, "torch-tpu")["metadata.json"])  # noqa: E731
    assert meta().source == "https://example.org/org/hub" and meta().provenance.kernel is None  # not in git
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "kernel")
    head = lambda: __import__("subprocess").run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,  # noqa: E731
                                                text=True).stdout.strip()
    first = head()
    got = meta().provenance
    assert (got.kernel.commit, got.kernel.dirty, got.kernel_builder.version) == (first, False, "pallas-hub 0.1.0")
    (root / "README.md").write_text("elsewhere\n")  # a commit that does not touch the kernel: same build, same bytes
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "docs")
    assert head() != first and meta().provenance.kernel.commit == first
    (spec.source / "__init__.py").write_text("X = 2\n")  # uncommitted change to the kernel
    assert meta().provenance.kernel.dirty
    with pytest.raises(manifest.ManifestError, match=r"source must be the URL"):
        (root / "build.toml").write_text('[hub]\nnamespace = "org"\nsource = "not a url"\n')
        manifest.load_manifest(root)
