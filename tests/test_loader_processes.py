"""Real processes: fetches and publishes killed with SIGKILL at known points (the next call must
repair), and five publishers and five fetchers of one kernel at once (nothing incomplete may be
published or accepted). The kill points are reached for real: the loopback Hub holds a request
(tests/fakehub.py), the kernel's import waits, or the publishing process pauses inside one call."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from doubles import DOUBLE_SOURCE, FULL, make_kernel
from fakehub import FakeHub

from pallas_hub import cli
from pallas_hub.hub import build, manifest
from pallas_hub.hub.build import VariantError
from pallas_hub.hub.fetch import Hub, VersionNotFound, fetch, verify_snapshot
from pallas_hub.hub.publish import LocalHub, _commit_id, publish_hub, version_files

REPO = "pallas-hub-tests/double-tpu"
FOLDER = "kernels--pallas-hub-tests--double-tpu"
# the kernel waits inside its own import when asked to: a fetch can be killed while importing
PAUSING = ("import os as _os, pathlib as _pathlib, time as _time\n"
           "if _os.environ.get('PAUSE_IN_IMPORT'):\n"
           "    _pathlib.Path(_os.environ['PAUSE_IN_IMPORT']).touch()\n"
           "    _time.sleep(600)\n")


def _env(tmp_path, **extra):
    return {"PYTHONPATH": str(manifest.ROOT / "loader"), "JAX_PLATFORMS": "cpu", "HOME": str(tmp_path),
            "PATH": "/usr/bin:/bin", "HF_HUB_DISABLE_PROGRESS_BARS": "1", **extra}


def _wait_for(condition, proc, what, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the process ended before {what}: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def _kill(proc):
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL


def _consistent(hub: LocalHub, repo: str) -> dict[int, str]:
    """Every version of the local hub names a snapshot that verifies (what a fetch would accept)."""
    versions = hub.versions(repo)
    for version, commit in versions.items():
        verify_snapshot(hub.snapshot(repo, commit), f"v{version}")
    return versions


# --------------------------------------------------------------------------- fetch, killed

FETCH = """
import os, sys
from pallas_hub.hub.fetch import Hub, fetch
fetch(sys.argv[1], 1, trust=[sys.argv[1]], source=Hub(endpoint=os.environ["HF_ENDPOINT"], cache_dir=sys.argv[2]))
print("done")
"""


@pytest.fixture
def remote(tmp_path):
    from huggingface_hub import HfApi

    source = PAUSING + DOUBLE_SOURCE.replace("@MARK@", repr("remote")).replace("@REGISTRATIONS@", repr(FULL))
    spec = manifest.load_kernel(make_kernel(tmp_path / "src", source=source))
    build.build_kernel(spec)
    with FakeHub() as fake:
        fake.commit = publish_hub(spec, api=HfApi(endpoint=fake.url, token="hf_fake"), progress=None)
        yield fake


@pytest.mark.parametrize("point", ["listing the files", "in the middle of a file", "between the two variants",
                                   "importing the kernel"])
def test_a_fetch_killed_at_any_point_is_repaired_by_the_next_fetch(remote, tmp_path, point):
    cache = tmp_path / "cache"
    resolve = f"/kernels/{REPO}/resolve/{remote.commit}/"
    marker = tmp_path / "importing"
    extra = {}
    if point == "listing the files":
        remote.hold.add(f"/api/kernels/{REPO}/tree/")
    elif point == "in the middle of a file":
        remote.half.add("/_bridge.py")  # every copy of it: half the bytes, then nothing
    elif point == "between the two variants":
        remote.hold.add(resolve + "build/torch-tpu/")  # torch-cpu (first in order) completes, torch-tpu never starts
    else:
        extra["PAUSE_IN_IMPORT"] = str(marker)
    child = subprocess.Popen([sys.executable, "-c", FETCH, REPO, str(cache)], env=_env(
        tmp_path, HF_ENDPOINT=remote.url, **extra), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    snapshot = cache / FOLDER / "snapshots" / remote.commit
    if point == "importing the kernel":
        _wait_for(marker.exists, child, point)
    elif point == "between the two variants":  # wait for torch-cpu to land whole (no fixed sleep: loaded machines)
        first = [f for f in remote.files(REPO, remote.commit) if f.startswith("build/torch-cpu/")]
        _wait_for(lambda: remote.waiting and all((snapshot / f).is_file() for f in first), child, point)
    else:
        _wait_for(lambda: remote.waiting, child, point)
        time.sleep(0.3)  # let the other downloads of the pool land
    _kill(child)
    remote.hold.clear()
    remote.half.clear()

    if point == "between the two variants":  # the state the issue describes: one variant whole, the other absent
        assert (snapshot / "build" / "torch-cpu" / "metadata.json").is_file()
        assert not (snapshot / "build" / "torch-tpu").exists()
    got = fetch(REPO, 1, trust=[REPO], source=Hub(endpoint=remote.url, cache_dir=cache))
    assert (got.commit, got.variant, got.module.VERSION_MARK) == (remote.commit, "torch-cpu", "remote")
    assert verify_snapshot(snapshot, "repaired") == got.digest
    assert not list(cache.glob(f"{FOLDER}/blobs/*.incomplete"))
    remote.__exit__()  # and the repaired cache works offline
    assert fetch(REPO, 1, trust=[REPO], source=Hub(endpoint=remote.url, cache_dir=cache, offline=True)).commit == \
        remote.commit


# --------------------------------------------------------------------------- publish, killed

PUBLISH = """
import os, pathlib, sys, time
point, n, marker = sys.argv[1], int(sys.argv[2]), pathlib.Path(sys.argv[3])
from pallas_hub import cli
from pallas_hub.hub import publish

def pause():
    marker.touch()
    time.sleep(600)

if point == "build":  # pause before writing the n-th file of the build
    write, calls = pathlib.Path.write_bytes, []
    def write_bytes(self, data):
        calls.append(self)
        if len(calls) == n:
            pause()
        return write(self, data)
    pathlib.Path.write_bytes = write_bytes
elif point == "snapshot":  # the staging folder is written, not yet renamed into snapshots/
    rename = publish.os.rename
    def paused_rename(src, dst):
        if ".staging-" in str(src):
            pause()
        return rename(src, dst)
    publish.os.rename = paused_rename
elif point == "ref":  # the snapshot is in place, refs/v1 not yet written
    write_atomic = publish._write_atomic
    def paused(path, data):
        if path.parent.name == "refs":
            pause()
        return write_atomic(path, data)
    publish._write_atomic = paused
sys.exit(cli.main(sys.argv[4:]))
"""


@pytest.mark.parametrize("point", ["build", "snapshot", "ref"])
def test_a_publish_killed_at_any_point_is_repaired_by_the_next_publish(tmp_path, point):
    spec = manifest.load_kernel(make_kernel(tmp_path / "src", mark=str(tmp_path)))
    hub = LocalHub(tmp_path / "hub")
    per_variant = len(build.variant_files(spec, "torch-tpu"))
    marker = tmp_path / "paused"
    argv = ["publish", "--path", str(spec.path), "--local-hub", str(hub.root)]
    child = subprocess.Popen([sys.executable, "-c", PUBLISH, point, str(per_variant + 3), str(marker), *argv],
                             env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(marker.exists, child, f"the pause at {point}")
    _kill(child)

    assert _consistent(hub, REPO) == {}  # nothing half-published is visible
    with pytest.raises(VersionNotFound):
        fetch(REPO, 1, trust=[REPO], source=hub)
    if point == "build":  # the second variant is half-written: publishing it as it is is refused
        assert not (spec.path / "build" / "torch-cpu" / "metadata.json").exists()
        with pytest.raises(VariantError, match="torch-cpu has no metadata.json"):
            hub.publish(spec, progress=None)
    if point == "snapshot":
        assert list(hub.repo_dir(REPO).glob("snapshots/.staging-*"))

    assert cli.main(argv) == 0  # the next publish repairs
    assert not list(hub.repo_dir(REPO).glob("snapshots/.*")) and not list(hub.repo_dir(REPO).glob("refs/.*"))
    assert _consistent(hub, REPO) == {1: _commit_id(version_files(spec))}
    assert fetch(REPO, 1, trust=[REPO], source=hub).module.VERSION_MARK == str(tmp_path)


# --------------------------------------------------------------------------- five at once

WORKER = """
import json, pathlib, sys, time
import kernels, torch  # imported before the start, so publishing and fetching overlap
from pallas_hub import cli
from pallas_hub.hub.fetch import LocalHub, VersionNotFound, fetch
go, repo, hub, argv = pathlib.Path(sys.argv[1]), sys.argv[3], LocalHub(sys.argv[4]), sys.argv[5:]
(go.parent / ("ready-" + sys.argv[2])).touch()
while not go.exists():
    time.sleep(0.005)
seen = []
for i in range(6):
    if i % 2 == 0:
        assert cli.main(argv) == 0
        continue
    try:
        f = fetch(repo, 1, trust=[repo], source=hub)
    except VersionNotFound:  # nothing published yet by anyone
        continue
    seen.append([f.commit, f.module.VERSION_MARK, sorted(p.name for p in f.path.parent.iterdir())])
print(json.dumps(seen))
"""


def test_five_processes_publishing_and_fetching_at_once_never_publish_or_accept_an_incomplete_build(tmp_path):
    spec = manifest.load_kernel(make_kernel(tmp_path / "src", mark=str(tmp_path)))
    hub = LocalHub(tmp_path / "hub")
    go = tmp_path / "go"
    argv = ["publish", "--path", str(spec.path), "--local-hub", str(hub.root)]
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(go), str(i), REPO, str(hub.root), *argv],
                              env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(5)]
    _wait_for(lambda: len(list(tmp_path.glob("ready-*"))) == len(procs), procs[-1], "every process to start")
    go.touch()
    seen = []
    for proc in procs:  # each publishes three times, fetching in between, while the others do the same
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]
        seen += json.loads(out.strip().splitlines()[-1])

    build.build_kernel(spec)
    expected = _commit_id(version_files(spec))  # what one publish alone writes
    assert _consistent(hub, REPO) == {1: expected}
    main = (hub.repo_dir(REPO) / "refs" / "main").read_text()  # the card
    assert {p.name for p in hub.repo_dir(REPO).glob("snapshots/*")} == {expected, main}  # no other version made
    assert len(seen) >= 10 and all(
        commit == expected and mark == str(tmp_path) and variants == ["torch-cpu", "torch-tpu"]
        for commit, mark, variants in seen), seen
