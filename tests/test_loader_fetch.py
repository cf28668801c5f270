"""Reliability and security of fetching (issue item 6), each with its failure provoked for real."""

import json
import os
import subprocess
import sys
import types

import pytest
import torch
from fakehub import FakeHub
from doubles import build_double

from pallas_hub.hub import fetch as fetch_mod, manifest
from pallas_hub.hub.fetch import (DigestMismatch, Hub, HubError, HubUnreachable, LockFileError, LockMismatch, NoVariant,
                              UntrustedRepo,
                              VersionNotFound, fetch, read_lock, write_lock)
from pallas_hub.hub.publish import LocalHub, publish_hub

REPO = "pallas-hub-tests/double-tpu"
OTHER = "pallas-hub-tests/other-tpu"



@pytest.fixture
def hub(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    hub.publish(build_double(tmp_path / "src"), progress=None)
    hub.publish(build_double(tmp_path / "src", name="other-tpu"), progress=None)
    return hub


@pytest.fixture
def fake(tmp_path):
    from huggingface_hub import HfApi

    with FakeHub() as fake:
        fake.spec = build_double(tmp_path / "remote-src")
        fake.commit = publish_hub(fake.spec, api=HfApi(endpoint=fake.url, token="hf_fake"), progress=None)
        yield fake


def _snapshots(cache):
    return sorted(p.name for p in cache.glob("kernels--*/snapshots/*"))


def test_untrusted_repo_is_refused_with_how_to_trust_it(tmp_path):
    hub = LocalHub(tmp_path / "hub")
    spec = build_double(tmp_path / "src", mark=str(tmp_path))  # unique code, so a unique module id
    hub.publish(spec, progress=None)
    module_id = json.loads((spec.path / "build" / "torch-cpu" / "metadata.json").read_text())["id"]
    for trust in ([], [OTHER], ["pallas-hub-tests/double"], REPO):  # exact repo ids only; a bare string is not a list
        with pytest.raises(UntrustedRepo, match=r"trust=\['pallas-hub-tests/double-tpu'\] \(CLI: --trust "):
            fetch(REPO, 1, trust=trust, source=hub)
    assert module_id not in sys.modules  # nothing of it was imported
    assert fetch(REPO, 1, trust=[REPO], source=hub).module.__name__ == module_id


def test_missing_version_lists_the_versions_that_exist(hub, tmp_path, fake):
    hub.publish(build_double(tmp_path / "v3", version=3), progress=None)
    with pytest.raises(VersionNotFound, match=r"version 2 not found in local hub .*; versions there: v1, v3"):
        fetch(REPO, 2, trust=[REPO], source=hub)
    with pytest.raises(VersionNotFound, match=r"versions there: v1$"):  # (before v9 is added below)
        fetch(REPO, 2, trust=[REPO], source=Hub(endpoint=fake.url, cache_dir=tmp_path / "cache"))
    fake.repos[REPO]["branches"]["v9"] = "../../../../outside"  # a hostile server cannot steer cache paths
    with pytest.raises(HubError, match=r"gave '../../../../outside' as the commit of v9; expected 40 hex digits"):
        fetch(REPO, 9, trust=[REPO], source=Hub(endpoint=fake.url, cache_dir=tmp_path / "cache"))
    with pytest.raises(VersionNotFound, match="no such kernel repository"):
        fetch("pallas-hub-tests/nope", 1, trust=["pallas-hub-tests/nope"],
              source=Hub(endpoint=fake.url, cache_dir=tmp_path / "cache"))


def test_tampered_local_hub_is_refused_and_the_rest_stays_usable(hub, tmp_path):
    commit = hub.versions(REPO)[1]
    victim = hub.snapshot(REPO, commit) / "build" / "torch-tpu" / "_bridge.py"
    victim.write_bytes(victim.read_bytes() + b"\nimport os  # injected\n")
    with pytest.raises(DigestMismatch, match=r"build/torch-tpu does not match its digest: File hash mismatch "
                                             r"for _bridge.py.*Nothing was imported"):
        fetch(REPO, 1, trust=[REPO], source=hub)
    assert fetch(OTHER, 1, trust=[OTHER], source=hub).module  # another kernel of the same hub still loads
    meta_file = hub.snapshot(REPO, commit) / "build" / "torch-cpu" / "metadata.json"  # checked first
    meta = json.loads(meta_file.read_text())
    del meta["digest"]
    meta_file.write_text(json.dumps(meta))
    with pytest.raises(DigestMismatch, match="torch-cpu has a metadata.json with no digest, so it cannot be verified"):
        fetch(REPO, 1, trust=[REPO], source=hub)
    hub.publish(manifest.load_kernel(tmp_path / "src" / "double-tpu"), progress=None)  # republishing repairs it
    assert fetch(REPO, 1, trust=[REPO], source=hub).commit == commit


def test_tampered_download_is_refused_removed_and_the_cache_stays_usable(fake, tmp_path):
    cache = tmp_path / "cache"
    source = Hub(endpoint=fake.url, cache_dir=cache)
    fake.tamper["build/torch-tpu/__init__.py"] = b"import os\nos.system('echo pwned')\n"
    with pytest.raises(DigestMismatch, match="build/torch-tpu does not match its digest.*removed from the cache"):
        fetch(REPO, 1, trust=[REPO], source=source)
    repo = cache / "kernels--pallas-hub-tests--double-tpu"
    assert _snapshots(cache) == [] and not (repo / "refs" / "v1").exists()
    assert not [b for b in (repo / "blobs").iterdir() if b.read_bytes().startswith(b"import os")]
    fake.tamper.clear()  # the server is repaired: the same cache now fetches cleanly
    assert fetch(REPO, 1, trust=[REPO], source=source).commit == fake.commit


def test_network_down_gives_a_clear_error_and_writes_nothing(fake, tmp_path, monkeypatch):
    import socket
    import time

    from huggingface_hub import file_download

    # huggingface_hub sleeps 1 s between its resume attempts; skip the waiting, not the attempts
    fast = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    fast.sleep = lambda seconds: None
    monkeypatch.setattr(file_download, "time", fast)

    with socket.socket() as s:  # a port on loopback with nothing listening
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    cache = tmp_path / "cache"
    with pytest.raises(HubUnreachable, match=r"cannot reach the Hub at http://127\.0\.0\.1.*Nothing was written"):
        fetch(REPO, 1, trust=[REPO], source=Hub(endpoint=dead, cache_dir=cache))
    assert _snapshots(cache) == []
    # the connection drops in the middle of a file: nothing half-written is kept
    fake.broken.add("/_bridge.py")  # every copy (same bytes share one blob download)
    with pytest.raises(HubError, match="nothing was kept|Nothing was written"):
        fetch(REPO, 1, trust=[REPO], source=Hub(endpoint=fake.url, cache_dir=cache))
    assert _snapshots(cache) == [] and not list(cache.glob("kernels--*/blobs/*.incomplete"))
    fake.broken.clear()
    assert fetch(REPO, 1, trust=[REPO], source=Hub(endpoint=fake.url, cache_dir=cache)).commit == fake.commit
    # a verified commit in the cache is not downloaded again, so a failing server cannot damage it
    fake.broken.add("/_bridge.py")
    fake.requests.clear()
    assert fetch(REPO, 1, trust=[REPO], source=Hub(endpoint=fake.url, cache_dir=cache)).commit == fake.commit
    assert [p for _, p in fake.requests if "/resolve/" in p or "/tree/" in p] == []


def test_a_variant_that_does_not_fit_the_host_names_the_variants(tmp_path, monkeypatch):
    import shutil

    spec = build_double(tmp_path / "src")
    shutil.rmtree(spec.path / "build" / "torch-cpu")  # a TPU-only upload
    hub = LocalHub(tmp_path / "hub")
    hub.publish(spec, progress=None)
    with pytest.raises(NoVariant, match=r"has no build for this host's backend \(cpu\); it publishes torch-tpu\. "):
        fetch(REPO, 1, trust=[REPO], source=hub)
    # on a TorchTPU host (torch_tpu 0.2.0 leaves torch.backends.tpu unset) the loader selects torch-tpu itself
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a, **k: types.SimpleNamespace(type="tpu"))
    got = fetch(REPO, 1, trust=[REPO], source=hub)
    assert got.variant == "torch-tpu" and not hasattr(torch.backends, "tpu")  # the shim is removed afterwards


@pytest.mark.parametrize("host", ["cuda", "metal"])
def test_a_cuda_or_mps_host_is_told_at_load_time_that_no_build_fits(hub, monkeypatch, host):
    """SIMULATED hosts: torch.version.cuda / torch.backends.mps.is_available are patched so that kernels'
    backend detection sees a CUDA or Metal (MPS) host. kernels would accept a torch-universal build there
    (and the first op would refuse the tensors); we publish none, so the load itself says why."""
    from kernels.backends import _backend

    if host == "cuda":
        monkeypatch.setattr(torch.version, "cuda", "12.8")
    else:
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert _backend().name == host
    with pytest.raises(NoVariant, match=rf"no build for this host's backend \({host}\); it publishes torch-cpu, "
                                        r"torch-tpu\. .*no build for CUDA, ROCm, XPU or Metal \(MPS\) hosts"):
        fetch(REPO, 1, trust=[REPO], source=hub)


def test_torchtpu_host_prefers_the_tpu_variant(hub, monkeypatch):
    assert fetch(REPO, 1, trust=[REPO], source=hub).variant == "torch-cpu"
    monkeypatch.setattr(fetch_mod, "on_torchtpu_host", lambda: True)
    assert fetch(REPO, 1, trust=[REPO], source=hub).variant == "torch-tpu"


CHILD = """
import json, pathlib, sys, time
from pallas_hub.hub.fetch import Hub, fetch
go = pathlib.Path(sys.argv[3]).parent / "go"
(go.parent / ("ready-" + sys.argv[4])).touch()
while not go.exists():  # start together, so the downloads really overlap
    time.sleep(0.01)
assert Hub().endpoint == sys.argv[2]  # from HF_ENDPOINT, read when huggingface_hub is imported
f = fetch(sys.argv[1], 1, trust=[sys.argv[1]], source=Hub(cache_dir=sys.argv[3]))
print(json.dumps([f.commit, f.digest, str(f.path)]))
"""


def test_concurrent_fetches_of_one_kernel_do_not_corrupt_the_cache(fake, tmp_path):
    from pallas_hub.hub.fetch import verify_snapshot

    cache = tmp_path / "cache"
    env = {"PYTHONPATH": str(manifest.ROOT / "loader"), "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path),
           "PATH": "/usr/bin:/bin", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_ENDPOINT": fake.url}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, REPO, fake.url, str(cache), str(i)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    import time

    deadline = time.time() + 120
    while len(list(tmp_path.glob("ready-*"))) < 3 and time.time() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.05)
    (tmp_path / "go").touch()
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len({tuple(r) for r in results}) == 1 and results[0][0] == fake.commit
    snapshot = cache / "kernels--pallas-hub-tests--double-tpu" / "snapshots" / fake.commit
    assert verify_snapshot(snapshot, "after") == results[0][1]
    assert not list(cache.glob("kernels--*/blobs/*.incomplete"))


def test_a_lock_file_pins_commit_and_digest_and_is_honoured_offline(hub, fake, tmp_path):
    lock = tmp_path / "pallas-hub.lock"
    first = fetch(REPO, 1, trust=[REPO], source=hub)
    write_lock(lock, [first])
    entry = json.loads(lock.read_text())["kernels"][0]
    assert entry == {"repo_id": REPO, "version": 1, "commit": first.commit, "digest": first.digest}

    # v1 is republished with other code: the lock still loads the commit it pinned
    hub.publish(build_double(tmp_path / "changed", mark="changed"), progress=None)
    assert fetch(REPO, 1, trust=[REPO], source=hub).module.VERSION_MARK == "changed"
    pinned = fetch(REPO, trust=[REPO], source=hub, lock=read_lock(lock))
    assert (pinned.commit, pinned.module.VERSION_MARK) == (first.commit, "a")
    with pytest.raises(LockMismatch, match="the lock file pins v1"):
        fetch(REPO, 2, trust=[REPO], source=hub, lock=read_lock(lock))

    # a consistent rewrite (file and its metadata digest both changed) passes the digest but not the lock
    variant = hub.snapshot(REPO, first.commit) / "build" / "torch-cpu"
    meta = json.loads((variant / "metadata.json").read_text())
    meta["license"] = "changed"
    (variant / "metadata.json").write_text(json.dumps(meta))
    with pytest.raises(LockMismatch, match="the lock file pins digest sha256:.*nothing was imported"):
        fetch(REPO, trust=[REPO], source=hub, lock=read_lock(lock))

    # from a Hub: fetched once online, then offline (server gone) by lock and by version
    cache = tmp_path / "cache"
    online = fetch(REPO, 1, trust=[REPO], source=Hub(endpoint=fake.url, cache_dir=cache))
    write_lock(lock, [online])
    fake.__exit__()
    offline = Hub(endpoint=fake.url, cache_dir=cache, offline=True)
    assert fetch(REPO, trust=[REPO], source=offline, lock=read_lock(lock)).commit == online.commit
    assert fetch(REPO, 1, trust=[REPO], source=offline).commit == online.commit


def test_our_lock_file_never_takes_the_kernels_librarys_name_or_format(hub, fake, tmp_path, monkeypatch, capsys):
    """kernels.lock belongs to the kernels library (`kernels lock` writes it, `kernels download` reads it): writing
    pallas-hub's format there made `kernels download .` fail with "Cannot parse KernelLocks"."""
    from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion

    from pallas_hub import cli, load

    with pytest.raises(LockFileError, match=r"kernels.lock is the kernels library's lock file .* as pallas-hub.lock"):
        load([REPO], version=1, trust=[REPO], source=hub, write_lock_to=tmp_path / "kernels.lock", do_register=False)
    assert not (tmp_path / "kernels.lock").exists()
    assert cli.main(["fetch", REPO, "--version", "1", "--trust", REPO, "--local-hub", str(hub.root),
                     "--write-lock", str(tmp_path / "kernels.lock")]) == 1
    assert "write pallas-hub's lock file as pallas-hub.lock" in capsys.readouterr().err

    # ours, under its own name, beside a real kernels.lock: `kernels download` reads its file, we read ours
    ours = tmp_path / "pallas-hub.lock"
    source = Hub(endpoint=fake.url, cache_dir=tmp_path / "ours")
    load([REPO], version=1, trust=[REPO], source=source, write_lock_to=ours, do_register=False)
    commit = read_lock(ours)[REPO]["commit"]
    assert commit == fake.commit
    theirs = KernelLocks(locks={KernelDependency(REPO, KernelVersion.Version(1)): KernelLock(commit)}).to_json()
    (tmp_path / "kernels.lock").write_text(theirs)
    with pytest.raises(LockFileError, match=r"kernels.lock is a kernels library lock file .* not pallas-hub's "
                                            r"pallas-hub.lock"):
        read_lock(tmp_path / "kernels.lock")
    env = {**os.environ, "HF_ENDPOINT": fake.url, "HF_HUB_CACHE": str(tmp_path / "theirs"),
           "KERNELS_CACHE": str(tmp_path / "theirs"), "HF_TOKEN": "hf_fake"}
    done = subprocess.run([sys.executable, "-c", "import sys; from kernels.cli import main; sys.exit(main())", "download",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"Downloading kernel: {REPO} (revision: {commit})" in done.stderr
    assert (tmp_path / "theirs" / "kernels--pallas-hub-tests--double-tpu" / "snapshots" / commit / "build" /
            "torch-cpu" / "metadata.json").is_file()
