"""Reliability and security of the loader against a hostile server, a tampered cache and bad input
(issue 12). Each case is provoked for real: a loopback server that misbehaves (tests/fakehub.py),
links and bytecode planted in the cache, edited metadata, malformed files; processes that are
killed or run at once are in test_loader_processes.py."""

import json
import os
import py_compile
import sys

import pytest
from doubles import build_double, make_kernel
from fakehub import FakeHub

from pallas_hub import cli, load
from pallas_hub.hub import build, manifest
from pallas_hub.hub.build import VariantError
from pallas_hub.hub.fetch import (DigestMismatch, Hub, HubError, InvalidRequest, KernelImportError, LockFileError,
                                  Tampered, UnsafeResponse, discard, fetch, read_lock)
from pallas_hub.hub.publish import LocalHub, publish_hub

REPO = "pallas-hub-tests/double-tpu"
FOLDER = "kernels--pallas-hub-tests--double-tpu"



@pytest.fixture
def fake(tmp_path):
    from huggingface_hub import HfApi

    with FakeHub() as fake:
        fake.spec = build_double(tmp_path / "remote-src", mark=str(tmp_path))
        fake.commit = publish_hub(fake.spec, api=HfApi(endpoint=fake.url, token="hf_fake"), progress=None)
        yield fake


def _hub_source(fake, cache, **kw):
    return Hub(endpoint=fake.url, cache_dir=cache, **kw)


def _files_outside(root, inside):
    """Every file under ``root`` that is not under one of the folders ``inside``."""
    return sorted(str(p) for p in root.rglob("*") if p.is_file() and not any(p.is_relative_to(i) for i in inside))


# --------------------------------------------------------------------------- 1. links out of the cache

def test_a_link_out_of_the_cache_is_refused_and_what_it_points_to_is_never_deleted(fake, tmp_path):
    cache = tmp_path / "cache"
    source = _hub_source(fake, cache)
    first = fetch(REPO, 1, trust=[REPO], source=source)
    variant = cache / FOLDER / "snapshots" / first.commit / "build" / "torch-cpu"
    victim = tmp_path / "home" / "thesis.tex"
    victim.parent.mkdir()
    victim.write_text("years of work\n")

    # a file of the snapshot replaced by a link to a user file: refused, the file is untouched
    (variant / "_bridge.py").unlink()
    (variant / "_bridge.py").symlink_to(victim)
    with pytest.raises(Tampered, match=r"_bridge.py links to .*thesis.tex, not to a blob of this repository.*"
                                       r"refused as tampering.*links were removed.*not what they point to"):
        fetch(REPO, 1, trust=[REPO], source=source)
    assert victim.read_text() == "years of work\n"
    assert fetch(REPO, 1, trust=[REPO], source=source).commit == first.commit  # the next fetch downloads it again

    # a link to a user folder, and discard() called directly: links are removed, never followed
    (variant / "docs").symlink_to(victim.parent, target_is_directory=True)
    discard(cache, REPO, first.commit)
    assert victim.read_text() == "years of work\n" and not (cache / FOLDER / "snapshots" / first.commit).exists()

    # the whole snapshot folder as a link to a user folder
    snapshots = cache / FOLDER / "snapshots"
    (snapshots / first.commit).symlink_to(victim.parent, target_is_directory=True)
    with pytest.raises(Tampered, match=r"is, or lies behind, a link to .*home; the folders of a cache are never links"):
        fetch(REPO, 1, trust=[REPO], source=source)
    assert victim.read_text() == "years of work\n" and not (snapshots / first.commit).exists()

    # the blobs folder as a link to a user folder: a download would write into it, a discard delete from it
    import shutil

    shutil.rmtree(cache / FOLDER / "blobs")
    (cache / FOLDER / "blobs").symlink_to(victim.parent, target_is_directory=True)
    with pytest.raises(Tampered, match=r"blobs is, or lies behind, a link to .*home"):
        fetch(REPO, 1, trust=[REPO], source=source)
    assert [p.name for p in victim.parent.iterdir()] == ["thesis.tex"] and victim.read_text() == "years of work\n"
    assert fetch(REPO, 1, trust=[REPO], source=source).commit == first.commit


def test_a_link_planted_in_the_local_hub_is_refused_and_publishing_again_removes_it(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    spec = build_double(tmp_path / "src", mark=str(tmp_path))
    commit = hub.publish(spec, progress=None)
    victim = tmp_path / "notes.txt"
    victim.write_text("keep me\n")
    (hub.snapshot(REPO, commit) / "build" / "torch-cpu" / "notes.py").symlink_to(victim)
    with pytest.raises(Tampered, match="notes.py links to"):
        fetch(REPO, 1, trust=[REPO], source=hub)
    hub.publish(spec, progress=None)  # the damaged snapshot is replaced; the link removed, not followed
    assert victim.read_text() == "keep me\n"
    assert fetch(REPO, 1, trust=[REPO], source=hub).commit == commit


# --------------------------------------------------------------------------- 3. interrupted downloads

def test_a_snapshot_missing_a_whole_variant_is_completed_online_and_refused_offline(fake, tmp_path):
    import shutil

    cache = tmp_path / "cache"
    first = fetch(REPO, 1, trust=[REPO], source=_hub_source(fake, cache))
    snapshot = cache / FOLDER / "snapshots" / first.commit
    shutil.rmtree(snapshot / "build" / "torch-cpu")  # what a fetch killed between the variants leaves
    with pytest.raises(HubError, match=r"is incomplete in the cache .*build/torch-cpu/.*fetch it once online"):
        fetch(REPO, 1, trust=[REPO], source=_hub_source(fake, cache, offline=True))
    fake.requests.clear()
    got = fetch(REPO, 1, trust=[REPO], source=_hub_source(fake, cache))
    assert got.commit == first.commit and got.variant == "torch-cpu"
    asked = {p.split("/resolve/", 1)[1].split("/", 1)[1] for _, p in fake.requests if "/resolve/" in p}
    assert asked and all(p.startswith("build/torch-cpu/") for p in asked)  # only what was missing


# --------------------------------------------------------------------------- 4. hostile response headers

@pytest.mark.parametrize("header, value", [
    ("etag", '"../../../../x"'),  # huggingface_hub 2.4 writes blobs/<etag> without checking it
    ("etag", 'W/"../../../../x"'),
    ("commit", "0" * 40),  # another commit than the one asked for
])
def test_a_crafted_header_is_refused_before_anything_is_written(fake, tmp_path, header, value):
    cache = tmp_path / "a" / "b" / "cache"  # blobs/../../../../x would land in tmp_path/a
    target = "build/torch-tpu/__init__.py"
    (fake.etags if header == "etag" else fake.commit_headers)[target] = value
    with pytest.raises(UnsafeResponse, match=r"the server answered (ETag|X-Repo-Commit) .* refused.*nothing was kept "
                                             r"and nothing was written outside the cache"):
        fetch(REPO, 1, trust=[REPO], source=_hub_source(fake, cache))
    assert _files_outside(tmp_path, [cache, tmp_path / "remote-src"]) == []
    assert list(cache.glob(f"{FOLDER}/snapshots/*")) == []
    fake.etags.clear()
    fake.commit_headers.clear()
    assert fetch(REPO, 1, trust=[REPO], source=_hub_source(fake, cache)).commit == fake.commit


def test_a_crafted_commit_on_a_missing_file_writes_nothing_outside_the_cache(fake, tmp_path):
    cache = tmp_path / "a" / "b" / "cache"  # .no_exist/../../../../y would land in tmp_path/a
    fake.gone.add("build/torch-tpu/__init__.py")
    fake.commit_headers["build/torch-tpu/__init__.py"] = "../../../../y"
    with pytest.raises(UnsafeResponse, match=r"X-Repo-Commit '../../../../y'"):
        fetch(REPO, 1, trust=[REPO], source=_hub_source(fake, cache))
    assert _files_outside(tmp_path, [cache, tmp_path / "remote-src"]) == []


# --------------------------------------------------------------------------- 5. bytecode

EVIL = "import pathlib, os\npathlib.Path(os.environ['PWNED_FILE']).write_text('ran')\n"


def test_planted_bytecode_never_runs_and_publishing_again_removes_it(tmp_path, monkeypatch):
    monkeypatch.setenv("PWNED_FILE", str(tmp_path / "pwned"))
    hub = LocalHub(tmp_path / "hub")
    spec = build_double(tmp_path / "src", mark=str(tmp_path))
    commit = hub.publish(spec, progress=None)
    variant = hub.snapshot(REPO, commit) / "build" / "torch-cpu"
    evil = tmp_path / "evil.py"
    evil.write_text(EVIL)
    # unchecked-hash bytecode: Python runs it without looking at the source; the digest ignores bytecode
    planted = variant / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(evil), cfile=str(planted), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    got = fetch(REPO, 1, trust=[REPO], source=hub)
    assert not (tmp_path / "pwned").exists() and got.module.VERSION_MARK == str(tmp_path)
    assert not list(variant.rglob("*.pyc"))  # removed before the import, and none written by it

    planted.parent.mkdir()
    py_compile.compile(str(evil), cfile=str(planted), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    hub.publish(spec, progress=None)  # bytecode is not part of the version: the snapshot is rewritten without it
    assert not list(variant.rglob("*.pyc")) and hub.publish(spec, progress=print) == commit


# --------------------------------------------------------------------------- 6. LOCAL_KERNELS

def test_a_local_kernels_override_is_refused_before_anything_is_imported(tmp_path, monkeypatch):
    monkeypatch.setenv("PWNED_FILE", str(tmp_path / "pwned"))
    hub = LocalHub(tmp_path / "hub")
    hub.publish(build_double(tmp_path / "src", mark=str(tmp_path)), progress=None)
    override = build_double(tmp_path / "override", source=EVIL + "REGISTRATIONS = []\n")
    monkeypatch.setenv("LOCAL_KERNELS", f"pallas-hub-tests/other={tmp_path}:{REPO}={override.path / 'build'}")
    with pytest.raises(HubError, match=r"LOCAL_KERNELS points pallas-hub-tests/double-tpu at .*nothing was imported"):
        load({REPO: 1}, trust=[REPO], source=hub)
    assert not (tmp_path / "pwned").exists()
    monkeypatch.setenv("LOCAL_KERNELS", f"pallas-hub-tests/other={override.path / 'build'}")  # not this repo
    assert fetch(REPO, 1, trust=[REPO], source=hub).module.VERSION_MARK == str(tmp_path)
    assert os.environ["LOCAL_KERNELS"].startswith("pallas-hub-tests/other=")  # restored after the call


# --------------------------------------------------------------------------- 7. metadata.json

@pytest.mark.parametrize("change, message", [
    ({"id": "json"}, r"metadata id 'json', which is not the op namespace of its verified _ops.py"),
    ({"id": "_double_tpu_cpu_0123456789"}, r"metadata id '_double_tpu_cpu_0123456789', which is not the op namespace"),
    ({"kernel-depends": [{"repo-id": "pallas-hub-tests/other-tpu", "version": 1}]},
     r"declares kernel dependencies \['pallas-hub-tests/other-tpu'\], which the loader does not verify"),
])
def test_metadata_that_no_digest_covers_is_not_trusted(tmp_path, change, message):
    hub = LocalHub(tmp_path / "hub")
    commit = hub.publish(build_double(tmp_path / "src", mark=str(tmp_path)), progress=None)
    meta_file = hub.snapshot(REPO, commit) / "build" / "torch-cpu" / "metadata.json"
    meta = json.loads(meta_file.read_text())
    meta_file.write_text(json.dumps({**meta, **change}))  # the file digests still match: only metadata changed
    json_module = sys.modules["json"]
    try:
        with pytest.raises(DigestMismatch, match=message):
            fetch(REPO, 1, trust=[REPO], source=hub)
    finally:
        sys.modules["json"] = json_module  # if the old code replaced it, keep the rest of the tests sane
    assert sys.modules["json"] is json_module


# --------------------------------------------------------------------------- 8. half-written builds

def test_a_half_written_build_is_refused_and_nothing_is_published(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    spec = build_double(tmp_path / "src")
    (spec.path / "build" / "torch-cpu" / "metadata.json").unlink()  # written last: a build cut short
    with pytest.raises(VariantError, match=r"torch-cpu has no metadata.json .*nothing was published: "
                                           r"rebuild it: pallas-hub build double-tpu"):
        hub.publish(spec, progress=None)
    assert hub.versions(REPO) == {}
    build.build_kernel(spec)
    (spec.path / "build" / "torch-tpu" / "_bridge.py").unlink()  # a file gone after the build
    with pytest.raises(VariantError, match=r"torch-tpu does not match its digest: Missing file: _bridge.py"):
        hub.publish(spec, progress=None)
    with FakeHub() as fake:
        from huggingface_hub import HfApi

        with pytest.raises(VariantError, match="Missing file: _bridge.py"):
            publish_hub(spec, api=HfApi(endpoint=fake.url, token="hf_fake"), progress=None)
        assert fake.requests == []  # refused before any request
    assert hub.versions(REPO) == {}


# --------------------------------------------------------------------------- 9. strict validation

def test_a_repo_id_with_a_double_dash_is_refused_before_anything_else(fake, tmp_path):
    for repo in ("pallas-hub-tests/double--tpu", "pallas-hub--tests/double-tpu", "a/b/c", "x"):
        with pytest.raises(InvalidRequest, match=r"repo id .* (is not valid on the Hub|must look like 'org/name')"):
            fetch(repo, 1, trust=[repo], source=_hub_source(fake, tmp_path / "cache"))
    assert fake.requests[-1][1].startswith("/api/kernels/pallas-hub-tests/double-tpu")  # none for the bad ids


# --------------------------------------------------------------------------- 10. messages, not tracebacks

@pytest.fixture
def published(tmp_path):
    spec = manifest.load_kernel(make_kernel(tmp_path / "src", mark=str(tmp_path)))
    hub = tmp_path / "hub"
    assert cli.main(["publish", "--path", str(spec.path), "--local-hub", str(hub)]) == 0
    return hub


def _cli(capsys, *argv):
    code = cli.main(list(argv))  # returns: a traceback would have raised
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.startswith("pallas-hub")]  # (download progress aside)
    assert len(lines) == 1 and "Traceback" not in err, err
    return code, lines[0]


@pytest.mark.parametrize("text, message", [
    ("{not json", r"not a pallas-hub lock file \(JSONDecodeError"),
    ("", r"not a pallas-hub lock file \(JSONDecodeError"),
    ('{"kernels": {}}', r"not a pallas-hub lock file \(expected"),
    ('{"kernels": [1]}', r"kernels\[0\] must be an object"),
    ('{"kernels": [{"repo_id": 5, "commit": "x", "digest": "y"}]}', r"kernels\[0\]: repo id 5 must look like"),
    ('{"kernels": [{"repo_id": "a/b", "commit": 7, "digest": "y"}]}', r"commit 7 is not 40 hex digits"),
    ('{"kernels": [{"repo_id": "a/b", "commit": "' + "a" * 40 + '", "digest": "md5:1"}]}', r"digest 'md5:1' is not"),
    ('{"kernels": [{"repo_id": "a/b", "commit": "' + "a" * 40 + '", "digest": "sha256:' + "0" * 64
     + '", "version": "1"}]}', r"version '1' is not an integer"),
])
def test_a_malformed_lock_file_gets_a_message(published, tmp_path, capsys, text, message):
    lock = tmp_path / "pallas-hub.lock"
    lock.write_text(text)
    with pytest.raises(LockFileError, match=message + r".*write it again"):
        read_lock(lock)
    code, err = _cli(capsys, "fetch", "--lock", str(lock), "--trust", REPO, "--local-hub", str(published))
    assert code == 1 and "write it again from a fetch you trust" in err


def test_cli_usage_mistakes_get_a_message_and_a_remedy(published, capsys):
    code, err = _cli(capsys, "fetch", REPO, "--trust", REPO, "--local-hub", str(published))
    assert code == 2 and "fetch needs --version N" in err
    code, err = _cli(capsys, "fetch", "ragged_dot", "--version", "1", "--trust", "ragged_dot")
    assert code == 2 and "'ragged_dot' is the manifest's kernel ragged_dot: fetch it as pallas-hub/ragged-dot-tpu" in err
    code, err = _cli(capsys, "fetch", "--lock", "/nonexistent/pallas-hub.lock", "--trust", REPO)
    assert code == 1 and "no such lock file" in err
    with pytest.raises(cli.UsageError):  # --debug: the traceback, for whoever needs it
        cli.main(["fetch", "a--b/c", "--version", "1", "--debug"])


def test_a_kernel_whose_import_raises_gets_a_message(tmp_path, capsys):
    spec = manifest.load_kernel(make_kernel(tmp_path / "src", source="raise RuntimeError('no TPU runtime here')\n"))
    hub = tmp_path / "hub"
    assert cli.main(["publish", "--path", str(spec.path), "--local-hub", str(hub)]) == 0
    with pytest.raises(KernelImportError, match=r"importing the kernel raised RuntimeError: no TPU runtime here\. Its "
                                                r"files are the verified ones"):
        fetch(REPO, 1, trust=[REPO], source=LocalHub(hub))
    code, err = _cli(capsys, "fetch", REPO, "--version", "1", "--trust", REPO, "--local-hub", str(hub))
    assert code == 1 and "RuntimeError: no TPU runtime here" in err


def test_publish_to_the_hub_without_a_token_or_a_network_gets_a_message(tmp_path, monkeypatch, capsys):
    import socket

    monkeypatch.setenv("HF_TOKEN", "hf_revoked")  # (no token at all: tests/test_cli.py)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file either
    monkeypatch.setattr("huggingface_hub.constants.HF_TOKEN_PATH", str(tmp_path / "hf-home" / "token"))
    spec = manifest.load_kernel(make_kernel(tmp_path / "src"))
    with FakeHub() as fake:
        fake.require_token = "hf_valid"
        code, err = _cli(capsys, "publish", "--path", str(spec.path), "--endpoint", fake.url)
        assert code == 1 and "refused the request (401: not logged in" in err and "hf auth login" in err
    with socket.socket() as s:  # a port on loopback with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    monkeypatch.setenv("HF_TOKEN", "hf_fake")
    code, err = _cli(capsys, "publish", "--path", str(spec.path), "--endpoint", dead)
    assert code == 1 and f"cannot reach the Hub at {dead}" in err and "Publish to the local hub instead" in err


def test_cli_fetch_with_a_hub_that_refuses_gets_a_message(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KERNELS_CACHE", str(tmp_path / "cache"))
    fake.etags["build/torch-tpu/__init__.py"] = '"../../../../x"'
    code, err = _cli(capsys, "fetch", REPO, "--version", "1", "--trust", REPO, "--endpoint", fake.url)
    assert code == 1 and "is not a plain file name" in err
