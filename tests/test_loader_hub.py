"""Publishing: the local hub (a Hugging Face cache layout) and the Hub API (against a loopback fake
Hub), then downloading back through kernels.get_kernel and comparing bytes."""

from pathlib import Path

import pytest
from fakehub import FakeHub
from doubles import make_kernel

from pallas_hub import cli
from pallas_hub.hub import build, manifest
from pallas_hub.hub.fetch import Hub, fetch
from pallas_hub.hub.publish import LocalHub, publish_hub, version_files

REPO = "pallas-hub-tests/double-tpu"


@pytest.fixture
def kernel(tmp_path):
    spec = manifest.load_kernel(make_kernel(tmp_path / "src"))
    (spec.path / "benchmarks").mkdir()
    (spec.path / "benchmarks" / "benchmark_double.py").write_text("# published with the kernel\n")
    build.build_kernel(spec)
    return spec


def _tree(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}


def test_local_hub_layout_is_idempotent_and_keeps_versions(kernel, tmp_path, capsys):
    hub = LocalHub(tmp_path / "hub")
    c1 = hub.publish(kernel)
    assert hub.publish(kernel) == c1 and "up to date" in capsys.readouterr().out
    repo = tmp_path / "hub" / "kernels--pallas-hub-tests--double-tpu"
    assert (repo / "refs" / "v1").read_text() == c1
    snap = _tree(repo / "snapshots" / c1)
    assert snap == version_files(kernel) and {"build/torch-tpu/metadata.json", "build/torch-cpu/__init__.py",
                                              "build/torch-cpu/double_tpu/__init__.py"} <= set(snap)
    assert (repo / "snapshots" / (repo / "refs" / "main").read_text() / "README.md").read_bytes().startswith(b"# double")
    v2 = manifest.load_kernel(make_kernel(tmp_path / "src2", version=2, mark="v2"))
    build.build_kernel(v2)
    c2 = hub.publish(v2)
    assert c2 != c1 and hub.versions(REPO) == {1: c1, 2: c2}
    assert fetch(REPO, 1, trust=[REPO], source=hub).module.VERSION_MARK == "a"
    assert fetch(REPO, 2, trust=[REPO], source=hub).module.VERSION_MARK == "v2"


def test_publish_to_the_hub_api_and_download_back_through_kernels_get_kernel(kernel, tmp_path, monkeypatch, capsys):
    from huggingface_hub import HfApi, constants
    from kernels import get_kernel

    with FakeHub() as fake:
        api = HfApi(endpoint=fake.url, token="hf_fake")
        commit = publish_hub(kernel, api=api)
        assert fake.files(REPO, "v1") == version_files(kernel)
        assert "benchmarks/benchmark_double.py" in version_files(kernel)
        assert fake.files(REPO, "main") == {"README.md": (kernel.path / "CARD.md").read_bytes()}
        n_commits = sum(1 for m, p in fake.requests if p.endswith("/commit/v1"))
        assert publish_hub(kernel, api=api) == commit  # idempotent: no new commit
        assert sum(1 for m, p in fake.requests if p.endswith("/commit/v1")) == n_commits
        assert "up to date" in capsys.readouterr().out

        # a file gone from the build disappears from the branch; a new one is uploaded
        extra = kernel.source / "extra.py"
        extra.write_text("X = 1\n")
        build.build_kernel(kernel)
        publish_hub(kernel, api=api)
        assert "build/torch-tpu/extra.py" in fake.files(REPO, "v1")
        extra.unlink()
        build.build_kernel(kernel)
        commit = publish_hub(kernel, api=api)
        assert "build/torch-tpu/extra.py" not in fake.files(REPO, "v1") and fake.files(REPO, "v1") == version_files(kernel)

        # the real kernels client, online, against the loopback Hub (HF_ENDPOINT is read at import: patch)
        monkeypatch.setattr(constants, "ENDPOINT", fake.url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", fake.url + "/{repo_id}/resolve/{revision}/{filename}")
        monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf-cache"))
        module = get_kernel(REPO, version=1, trust_remote_code=[REPO])
        variant = Path(module.__file__).parent
        assert variant.as_posix().endswith(f"/snapshots/{commit}/build/torch-cpu")
        assert _tree(variant) == _tree(kernel.path / "build" / "torch-cpu")
        assert any(p.endswith(f"/tree/{commit}/build") for _, p in fake.requests)  # variants listed online

        # and the loader's own fetch from the same server: every variant downloaded and verified
        got = fetch(REPO, 1, trust=[REPO], source=Hub(endpoint=fake.url, cache_dir=tmp_path / "cache"))
        assert got.commit == commit and _tree(got.path.parent.parent) == version_files(kernel)


def test_cli_publish_fetch_list(kernel, tmp_path, capsys):
    hub = str(tmp_path / "hub")
    assert cli.main(["publish", "--path", str(kernel.path), "--local-hub", hub]) == 0
    lock = tmp_path / "pallas-hub.lock"
    assert cli.main(["fetch", REPO, "--version", "1", "--local-hub", hub]) == 1  # not trusted
    assert "--trust pallas-hub-tests/double-tpu" in capsys.readouterr().err
    assert cli.main(["fetch", REPO, "--version", "1", "--trust", REPO, "--local-hub", hub,
                     "--write-lock", str(lock)]) == 0
    out = capsys.readouterr().out
    assert "pallas-hub-tests/double-tpu v1 commit" in out and "tokamax" not in out and lock.is_file()
    assert cli.main(["fetch", "--lock", str(lock), "--trust", REPO, "--local-hub", hub]) == 0
    assert cli.main(["list", "--local-hub", hub]) == 0
    out = capsys.readouterr().out
    assert "manifest" in out and "also in the local hub: pallas-hub-tests/double-tpu (v1)" in out


def test_cli_publish_and_list_against_a_hub_endpoint(kernel, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    monkeypatch.setenv("HOME", str(tmp_path))  # no real token file is read
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "cache"))  # never the user's Hugging Face cache
    with FakeHub() as fake:
        assert cli.main(["publish", "--path", str(kernel.path), "--endpoint", fake.url]) == 0
        assert fake.files(REPO, "v1") == version_files(kernel)
        assert cli.main(["fetch", REPO, "--version", "1", "--trust", REPO, "--endpoint", fake.url]) == 0
        assert f"from hub {fake.url}" in capsys.readouterr().out
    assert (tmp_path / "cache" / "kernels--pallas-hub-tests--double-tpu").is_dir()
