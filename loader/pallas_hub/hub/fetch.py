"""Fetching kernels: trust list, version pin, digest check, lock file, then ``kernels.get_kernel``.

Order of a fetch (nothing is imported before it is verified):

1. the repository must be on the caller's explicit allow-list (``trust``). kernels 0.17.2 alone is
   weaker: a list there also admits any "trusted publisher", and offline it skips the check entirely;
2. the version (branch ``v<N>``) is resolved to a commit, or the lock file's commit is used;
3. the whole commit is placed in a Hugging Face cache (downloaded from the Hub under a per-repository
   lock unless a verified copy is already cached, or already there in the local hub); a failed
   download leaves nothing behind;
4. every build variant is checked against the digest in its metadata.json (kernels' own ``Digest``);
   a mismatch removes the bad snapshot and refuses; a lock file's digest must match too;
5. ``kernels.get_kernel(repo, version=N | revision=commit, trust_remote_code=[repo])`` resolves the
   variant and imports it, offline, from that verified cache. On a TorchTPU host (torch_tpu 0.2.0
   does not set ``torch.backends.tpu``) the loader sets it for the call so the ``torch-tpu`` variant wins.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import threading
import types
from pathlib import Path

from .publish import REPO_TYPE, LocalHub, file_lock, repo_folder

_BYTECODE = ["*.pyc", "**/__pycache__/**"]
_ENV_LOCK = threading.RLock()  # the hub settings below are process-wide; one fetch at a time per process


class HubError(RuntimeError):
    """A fetch that was refused or failed; the message says what to do."""


class UntrustedRepo(HubError):
    pass


class VersionNotFound(HubError):
    pass


class DigestMismatch(HubError):
    pass


class HubUnreachable(HubError):
    pass


class NoVariant(HubError):
    pass


class LockMismatch(HubError):
    pass


@dataclasses.dataclass
class Fetched:
    repo_id: str
    version: int | None
    commit: str
    variant: str
    digest: str  # "sha256:..." over every variant's metadata.json (which carries the per-file digests)
    source: str
    path: Path  # the variant folder that was imported
    module: types.ModuleType

    def lock_entry(self) -> dict:
        return {"repo_id": self.repo_id, "version": self.version, "commit": self.commit, "digest": self.digest}


# --------------------------------------------------------------------------- sources

class Hub:
    """A Hugging Face Hub (default endpoint, or ``endpoint``), downloading into ``cache_dir``.

    ``offline=True`` (or ``HF_HUB_OFFLINE=1``) uses only what ``cache_dir`` already holds.
    """

    def __init__(self, endpoint: str | None = None, cache_dir: Path | str | None = None, offline: bool | None = None,
                 token: str | bool | None = None):
        from huggingface_hub import constants

        self.endpoint = endpoint or constants.ENDPOINT
        self.cache_dir = Path(cache_dir or os.environ.get("KERNELS_CACHE") or constants.HF_HUB_CACHE)
        self.offline = constants.HF_HUB_OFFLINE if offline is None else offline
        self.token = token

    def __repr__(self) -> str:
        return f"hub {self.endpoint}" + (" (offline cache)" if self.offline else "")

    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token)

    def _unreachable(self, e: Exception) -> HubUnreachable:
        return HubUnreachable(
            f"cannot reach the Hub at {self.endpoint} ({type(e).__name__}: {e}). Nothing was written. "
            "Without network, fetch from the local hub (pallas-hub publish, then --local-hub) or use a lock "
            "file with HF_HUB_OFFLINE=1 for kernels fetched before.")

    def versions(self, repo_id: str) -> dict[int, str]:
        if self.offline:
            return LocalHub(self.cache_dir).versions(repo_id)
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            refs = self._api().list_repo_refs(repo_id, repo_type=REPO_TYPE)
        except RepositoryNotFoundError:
            raise VersionNotFound(f"{repo_id}: no such kernel repository at {self.endpoint}") from None
        except Exception as e:
            if _is_network_error(e):
                raise self._unreachable(e) from None
            raise
        return {int(b.name[1:]): b.target_commit for b in refs.branches if b.name[:1] == "v" and b.name[1:].isdigit()}

    def snapshot(self, repo_id: str, commit: str) -> Path:
        path = self.cache_dir / repo_folder(repo_id) / "snapshots" / commit
        if self.offline:
            if not path.is_dir():
                raise HubError(f"{repo_id}@{commit[:12]} is not in the cache {self.cache_dir} and the Hub is offline; "
                               "fetch it once online (or publish it to the local hub)")
            return path
        if path.is_dir():  # a commit never changes: a snapshot that verifies is reused, not downloaded again
            try:
                verify_snapshot(path, f"{repo_id}@{commit[:12]}")
                return path
            except DigestMismatch:
                discard(self.cache_dir, repo_id, commit)
        try:
            # the whole commit (every variant): a partial snapshot is not usable offline by kernels later
            got = self._api().snapshot_download(repo_id, repo_type=REPO_TYPE, revision=commit,
                                                cache_dir=self.cache_dir, ignore_patterns=_BYTECODE)
        except Exception as e:
            discard(self.cache_dir, repo_id, commit)  # nothing half-written
            if _is_network_error(e):
                raise self._unreachable(e) from None
            raise HubError(f"{repo_id}@{commit[:12]}: download failed ({type(e).__name__}: {e}); nothing was kept") from e
        return Path(got)

    def pin(self, repo_id: str, version: int, commit: str) -> None:
        """Record ``refs/v<N>`` in the cache so ``get_kernel(version=N)`` resolves it offline."""
        from .publish import _write_atomic

        _write_atomic(self.cache_dir / repo_folder(repo_id) / "refs" / f"v{version}", commit.encode())


def _is_network_error(e: Exception) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import _http

    transport = getattr(getattr(_http, "httpx2", None) or getattr(_http, "httpx", None), "TransportError", OSError)
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, (transport, ConnectionError, OfflineModeIsEnabled, TimeoutError)):
            return True
        e = e.__cause__ or e.__context__
    return False


class _Local:
    """LocalHub as a fetch source."""

    def __init__(self, hub: LocalHub):
        self.hub = hub
        self.cache_dir = hub.root
        self.offline = True

    def __repr__(self) -> str:
        return repr(self.hub)

    def versions(self, repo_id: str) -> dict[int, str]:
        return self.hub.versions(repo_id)

    def snapshot(self, repo_id: str, commit: str) -> Path:
        path = self.hub.snapshot(repo_id, commit)
        if not path.is_dir():
            raise HubError(f"{repo_id}@{commit[:12]} is not in {self.hub}; publish it first (pallas-hub publish)")
        return path

    def pin(self, repo_id: str, version: int, commit: str) -> None:
        pass  # refs/v<N> is written by publish


def _as_source(source):
    if source is None:
        return _Local(LocalHub())
    if isinstance(source, LocalHub):
        return _Local(source)
    return source


# --------------------------------------------------------------------------- verification

def discard(cache_dir: Path, repo_id: str, commit: str) -> None:
    """Remove one snapshot and the blobs only it uses; other versions in the cache stay loadable."""
    repo = Path(cache_dir) / repo_folder(repo_id)
    snap = repo / "snapshots" / commit

    def blobs(folder: Path) -> set[Path]:
        return {Path(os.path.realpath(p)) for p in folder.rglob("*") if p.is_symlink()}

    mine = blobs(snap) if snap.is_dir() else set()
    others = set()
    for other in (repo / "snapshots").glob("*") if (repo / "snapshots").is_dir() else []:
        if other.name != commit:
            others |= blobs(other)
    shutil.rmtree(snap, ignore_errors=True)
    for blob in mine - others:
        blob.unlink(missing_ok=True)
    for leftover in (repo / "blobs").glob("*.incomplete") if (repo / "blobs").is_dir() else []:
        leftover.unlink(missing_ok=True)
    (repo / "trees" / f"{commit}.json").unlink(missing_ok=True)


def verify_snapshot(snapshot: Path, what: str) -> str:
    """Check every ``build/<variant>`` against its metadata digest; returns the build digest."""
    from kernels._rust import Digest, DigestValidationError, Metadata

    variants = sorted(p for p in (snapshot / "build").glob("*") if p.is_dir())
    if not variants:
        raise DigestMismatch(f"{what}: no build/<variant> folders in the snapshot")
    h = hashlib.sha256()
    for variant in variants:
        raw_file = variant / "metadata.json"
        if not raw_file.is_file():
            raise DigestMismatch(f"{what}: build/{variant.name} has no metadata.json")
        raw = raw_file.read_bytes()
        try:
            digest = Metadata.from_bytes(raw).digest
        except ValueError as e:
            raise DigestMismatch(f"{what}: build/{variant.name}/metadata.json does not parse: {e}") from None
        if digest is None:
            raise DigestMismatch(f"{what}: build/{variant.name}/metadata.json has no digest, so it cannot be verified")
        try:
            digest.validate(Digest.hash_variant(digest.algorithm, variant))
        except DigestValidationError as e:
            problems = "; ".join(str(v) for v in e.violations)
            raise DigestMismatch(f"{what}: build/{variant.name} does not match its digest: {problems}") from None
        h.update(variant.name.encode() + b"\0" + hashlib.sha256(raw).digest())
    return "sha256:" + h.hexdigest()


# --------------------------------------------------------------------------- lock files

def read_lock(path: Path | str) -> dict[str, dict]:
    """{repo_id: {"repo_id", "version", "commit", "digest"}} from a pallas-hub lock file."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), list):
        raise ValueError(f"{path}: not a pallas-hub lock file (expected {{\"kernels\": [...]}})")
    out = {}
    for entry in data["kernels"]:
        missing = {"repo_id", "commit", "digest"} - set(entry)
        if missing:
            raise ValueError(f"{path}: an entry lacks {sorted(missing)}: {entry}")
        out[entry["repo_id"]] = entry
    return out


def write_lock(path: Path | str, fetched: list[Fetched]) -> None:
    entries = sorted((f.lock_entry() for f in fetched), key=lambda e: e["repo_id"])
    Path(path).write_text(json.dumps({"pallas-hub-lock": 1, "kernels": entries}, indent=2) + "\n")


# --------------------------------------------------------------------------- the kernels call

def on_torchtpu_host() -> bool:
    """True when torch runs on TorchTPU (the "tpu" accelerator), whatever torch.backends says."""
    import torch

    try:
        accelerator = torch.accelerator.current_accelerator()
    except Exception:
        return False
    return accelerator is not None and accelerator.type == "tpu"


@contextlib.contextmanager
def _hub_settings(cache_dir: Path, tpu: bool):
    """huggingface_hub/kernels read these at import time; set them for one offline get_kernel call."""
    import torch
    from huggingface_hub import constants
    import kernels.install
    import kernels.resolver

    saved = (constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE, kernels.resolver.CACHE_DIR, kernels.install.CACHE_DIR,
             os.environ.get("KERNELS_CACHE"), getattr(torch.backends, "tpu", None))
    had_tpu = hasattr(torch.backends, "tpu")
    constants.HF_HUB_OFFLINE = True
    constants.HF_HUB_CACHE = str(cache_dir)
    kernels.resolver.CACHE_DIR = kernels.install.CACHE_DIR = str(cache_dir)
    os.environ["KERNELS_CACHE"] = str(cache_dir)
    if tpu and not had_tpu:
        torch.backends.tpu = types.SimpleNamespace()  # what kernels' backend detection looks for
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE = saved[0], saved[1]
        kernels.resolver.CACHE_DIR, kernels.install.CACHE_DIR = saved[2], saved[3]
        if saved[4] is None:
            os.environ.pop("KERNELS_CACHE", None)
        else:
            os.environ["KERNELS_CACHE"] = saved[4]
        if tpu and not had_tpu:
            del torch.backends.tpu


def fetch(repo_id: str, version: int | None = None, *, trust: list[str] | tuple[str, ...] = (), source=None,
          lock: dict[str, dict] | None = None, tpu: bool | None = None) -> Fetched:
    """Fetch, verify and import one kernel; see the module docstring for the steps.

    ``source``: a ``LocalHub`` (default: the local hub) or a ``Hub``. ``lock``: ``read_lock(...)``;
    when it names ``repo_id`` its commit and digest are used and enforced (no network needed).
    ``tpu``: load the ``torch-tpu`` variant (default: when running on TorchTPU).
    """
    from kernels import get_kernel

    from .manifest import REPO_RE

    if not isinstance(repo_id, str) or not REPO_RE.match(repo_id):
        raise ValueError(f"repo id {repo_id!r} must look like 'org/name'")
    if isinstance(trust, str) or repo_id not in set(trust):
        raise UntrustedRepo(
            f"{repo_id} is not in the trust list, so its code will not be downloaded or run. Review it, then trust it "
            f"explicitly: trust=[{repo_id!r}] (CLI: --trust {repo_id}). Trust is per repository, exact match.")
    src = _as_source(source)
    pinned = (lock or {}).get(repo_id)
    if pinned is not None:
        if version is not None and pinned.get("version") not in (None, version):
            raise LockMismatch(f"{repo_id}: version {version} was asked but the lock file pins v{pinned['version']}")
        version, commit = pinned.get("version"), pinned["commit"]
    else:
        if version is None:
            raise ValueError(f"{repo_id}: give a version (an integer, the Hub branch v<N>) or a lock file")
        if isinstance(version, bool) or not isinstance(version, int):
            raise ValueError(f"{repo_id}: version must be an integer, got {version!r}")
        available = src.versions(repo_id)
        if version not in available:
            listed = ", ".join(f"v{v}" for v in sorted(available)) or "none"
            raise VersionNotFound(f"{repo_id}: version {version} not found in {src}; versions there: {listed}")
        commit = available[version]
    if not isinstance(commit, str) or not re.fullmatch(r"[0-9a-f]{40}", commit):  # it becomes a cache path
        raise HubError(f"{repo_id}: {src} gave {commit!r} as the commit of v{version}; expected 40 hex digits")
    what = f"{repo_id}@{commit[:12]}"
    tpu = on_torchtpu_host() if tpu is None else tpu
    with _ENV_LOCK, file_lock(src.cache_dir, repo_id):
        snapshot = src.snapshot(repo_id, commit)
        try:
            digest = verify_snapshot(snapshot, what)
        except DigestMismatch as e:
            if isinstance(src, Hub):
                discard(src.cache_dir, repo_id, commit)
                raise DigestMismatch(f"{e}. The download was removed from the cache; nothing was imported.") from None
            raise DigestMismatch(f"{e}. Nothing was imported; publish the kernel again to repair {src}.") from None
        if pinned is not None and digest != pinned["digest"]:
            raise LockMismatch(f"{what}: the lock file pins digest {pinned['digest']} but {src} holds {digest}; "
                               "nothing was imported. Re-lock only if this change is expected.")
        if pinned is None:
            src.pin(repo_id, version, commit)
        with _hub_settings(src.cache_dir, tpu):
            try:
                if pinned is None:
                    module = get_kernel(repo_id, version=version, trust_remote_code=[repo_id])
                else:
                    module = get_kernel(repo_id, revision=commit, trust_remote_code=[repo_id])
            except FileNotFoundError as e:
                if "Cannot find a build variant" not in str(e):
                    raise
                have = ", ".join(sorted(p.name for p in (snapshot / "build").iterdir() if p.is_dir()))
                host = "TorchTPU (tpu)" if tpu else "this host (no TorchTPU: cpu)"
                raise NoVariant(f"{what}: no build variant fits {host}; the variants available are: {have}. "
                                "Pallas kernels need torch-tpu (TorchTPU hosts) or torch-universal (any host).") from None
    path = Path(module.__file__).parent
    if snapshot.resolve() not in path.resolve().parents:  # belt and braces: what was imported is what we verified
        raise HubError(f"{what}: kernels imported {path}, outside the verified snapshot {snapshot}")
    variant = path.relative_to(snapshot).parts[1] if path.is_relative_to(snapshot) else path.name
    return Fetched(repo_id, version, commit, variant, digest, repr(src), path, module)
