"""build.toml validation and the build: deterministic bytes, kernels' own metadata and digest format."""

import json
import textwrap

import pytest

from pallas_hub import build, manifest

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
    (("[torch-noarch]\n", ""), "missing table [torch-noarch]"),
    (("repo-id = \"org/ok-tpu\"", "repo-id = \"ok-tpu\""), "must look like 'org/name'"),
    (("edition = 5", "edition = [5"), "not valid TOML"),
])
def test_bad_build_toml_is_refused_with_the_field_named(tmp_path, change, message):
    manifest.load_kernel(_kernel(tmp_path / "good", GOOD))  # the unchanged file is accepted
    with pytest.raises(manifest.ManifestError, match=None) as e:
        manifest.load_kernel(_kernel(tmp_path / "bad", GOOD.replace(*change)))
    assert message in str(e.value) and "build.toml" in str(e.value)


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
    assert files_a == files_b and len(files_a) == 18
    for variant, backend in build.VARIANTS.items():
        raw = (a / variant / "metadata.json").read_bytes()
        meta = json.loads(raw)
        assert (meta["name"], meta["version"], meta["backend"], meta["python-depends"]) == \
            ("scale-add-tpu", 1, {"type": backend}, [])
        parsed = Metadata.from_bytes(raw)  # kernels' own (Rust) parser
        parsed.digest.validate(Digest.hash_variant(parsed.digest.algorithm, a / variant))
        assert set(parsed.digest.files) == {str(p.relative_to(a / variant)) for p in (a / variant).rglob("*.py")}
    ids = {json.loads((a / v / "metadata.json").read_bytes())["id"] for v in build.VARIANTS}
    assert len(ids) == 2  # one unique id (= sys.modules key and op namespace) per variant
