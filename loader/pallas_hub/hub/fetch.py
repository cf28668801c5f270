"""Fetching kernels: trust list, version pin, digest check, lock file, then ``kernels.get_kernel``.

Order of a fetch (nothing is imported before it is verified):

1. the repository must be on the caller's explicit allow-list (``trust``). kernels 0.17.2 alone is
   weaker: a list there also admits any "trusted publisher", and offline it skips the check entirely;
2. the version (branch ``v<N>``) is resolved to a commit, or the lock file's commit is used;
3. the whole commit is placed in a Hugging Face cache (downloaded from the Hub under a per-repository
   lock unless a complete, verified copy is already cached, or already there in the local hub); a
   failed download leaves nothing behind, an interrupted one is completed by the next fetch, and
   every response header huggingface_hub turns into a cache path is checked first;
4. every build variant is checked against the digest in its metadata.json (kernels' own ``Digest``,
   and what metadata.json says against the verified files), and every link in the snapshot must
   point at a blob of the cache; a mismatch removes the bad snapshot (never what a link points to)
   and refuses; a lock file's digest must match too;
5. ``kernels.get_kernel(repo, version=N | revision=commit, trust_remote_code=[repo])`` resolves the
   variant and imports it, offline, from that verified cache, with bytecode removed first and none
   written, and never from a ``LOCAL_KERNELS`` override. On a TorchTPU host (torch_tpu 0.2.0 does
   not set ``torch.backends.tpu``) the loader sets it for the call so the ``torch-tpu`` variant wins;
   a CPU host gets ``torch-cpu``; any other host (CUDA, ROCm, XPU, Metal) gets ``NoVariant``, which says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import shutil
import sys
import threading
import types
from pathlib import Path

from .build import VariantError, verify_variant
from .manifest import repo_id_problem
from .publish import REPO_TYPE, LocalHub, file_lock, redirected, repo_folder

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


class Tampered(DigestMismatch):
    """A snapshot holding a link that points out of the cache: never produced by a download."""


class UnsafeResponse(HubError):
    """A server response whose headers would make huggingface_hub write outside the cache."""


class KernelImportError(HubError):
    """The verified kernel raised while being imported."""


class LockFileError(HubError):
    """A lock file that cannot be read or does not have the pallas-hub form."""


class InvalidRequest(HubError, ValueError):
    """A fetch asked with a bad repo id or version."""


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

    def versions(self, repo_id: str) -> dict[int, str]:
        if self.offline:
            return LocalHub(self.cache_dir).versions(repo_id)
        from huggingface_hub.errors import RepositoryNotFoundError

        try:
            refs = self._api().list_repo_refs(repo_id, repo_type=REPO_TYPE)
        except RepositoryNotFoundError:
            raise VersionNotFound(f"{repo_id}: no such kernel repository at {self.endpoint}") from None
        except Exception as e:
            if (err := as_hub_error(e, self.endpoint, FETCH_OFFLINE)) is None:
                raise
            raise err from e
        return {int(b.name[1:]): b.target_commit for b in refs.branches if b.name[:1] == "v" and b.name[1:].isdigit()}

    def missing(self, repo_id: str, commit: str) -> list[str] | None:
        """Files of the commit absent from its cached snapshot (an interrupted download), from the tree
        listing huggingface_hub caches before it downloads; None when no listing is cached."""
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
        from huggingface_hub.utils import filter_repo_objects

        try:
            tree = get_cached_repo_tree(repo_id, repo_type=REPO_TYPE, revision=commit, cache_dir=self.cache_dir)
        except CachedRepoTreeNotFoundError:
            return None
        path = self.cache_dir / repo_folder(repo_id) / "snapshots" / commit
        expected = filter_repo_objects([f.path for f in tree], ignore_patterns=_BYTECODE)
        return [rel for rel in expected if not (path / rel).is_file()]

    def snapshot(self, repo_id: str, commit: str) -> Path:
        path = self.cache_dir / repo_folder(repo_id) / "snapshots" / commit
        what = f"{repo_id}@{commit[:12]}"
        try:  # before anything is read or downloaded: the folders a download writes into, the links in the snapshot
            _check_links(path, what)
        except Tampered as e:
            discard(self.cache_dir, repo_id, commit)
            raise Tampered(f"{e}. The links were removed from the cache (not what they point to); nothing was "
                           "imported. Fetch again to download a clean copy.") from None
        present = path.is_dir()
        missing = self.missing(repo_id, commit) if present else None
        if self.offline:
            if not present:
                raise HubError(f"{what} is not in the cache {self.cache_dir} and the Hub is offline; "
                               "fetch it once online (or publish it to the local hub)")
            if missing:
                raise HubError(f"{what} is incomplete in the cache {self.cache_dir} (an interrupted download lacks "
                               f"{', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}) and the Hub is offline; "
                               "fetch it once online to complete it")
            return path
        if present and missing == []:  # a commit never changes: a complete snapshot that verifies is reused
            try:
                verify_snapshot(path, what)
                return path
            except DigestMismatch:
                discard(self.cache_dir, repo_id, commit)
        guard_hf_downloads()
        try:
            # the whole commit (every variant): a partial snapshot is not usable offline by kernels later.
            # Files already in a partial snapshot are kept (verified below with the rest), the others fetched.
            got = self._api().snapshot_download(repo_id, repo_type=REPO_TYPE, revision=commit,
                                                cache_dir=self.cache_dir, ignore_patterns=_BYTECODE)
        except Exception as e:
            discard(self.cache_dir, repo_id, commit)  # nothing half-written
            unsafe = _in_chain(e, UnsafeResponse)
            if unsafe is not None:
                raise UnsafeResponse(f"{what}: {unsafe}; nothing was kept and nothing was written outside the cache") from e
            if _is_network_error(e):
                raise as_hub_error(e, self.endpoint, FETCH_OFFLINE) from e
            raise HubError(f"{what}: download failed ({type(e).__name__}: {e}); nothing was kept") from e
        for leftover in (self.cache_dir / repo_folder(repo_id) / "blobs").glob("*.incomplete"):
            leftover.unlink(missing_ok=True)  # a killed download's part: never used again (under the lock)
        return Path(got)

    def pin(self, repo_id: str, version: int, commit: str) -> None:
        """Record ``refs/v<N>`` in the cache so ``get_kernel(version=N)`` resolves it offline."""
        from .publish import _write_atomic

        _write_atomic(self.cache_dir / repo_folder(repo_id) / "refs" / f"v{version}", commit.encode())


FETCH_OFFLINE = ("Without network, fetch from the local hub (pallas-hub publish, then --local-hub) or use a lock "
                 "file with HF_HUB_OFFLINE=1 for kernels fetched before.")


def _in_chain(e: BaseException | None, kind) -> BaseException | None:
    """The first exception of type ``kind`` in ``e``'s cause/context chain."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, kind):
            return e
        e = e.__cause__ or e.__context__
    return None


def _is_network_error(e: Exception) -> bool:
    from huggingface_hub.errors import OfflineModeIsEnabled
    from huggingface_hub.utils import _http

    transport = getattr(getattr(_http, "httpx2", None) or getattr(_http, "httpx", None), "TransportError", OSError)
    return _in_chain(e, (transport, ConnectionError, OfflineModeIsEnabled, TimeoutError)) is not None


def as_hub_error(e: Exception, endpoint: str, offline_remedy: str) -> HubError | None:
    """A Hub API failure as a HubError with a reason and a remedy; None if ``e`` is none of these."""
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    if isinstance(e, HubError):
        return None
    if _is_network_error(e):
        return HubUnreachable(f"cannot reach the Hub at {endpoint} ({type(e).__name__}: {e}). Nothing was written. "
                              + offline_remedy)
    if isinstance(e, LocalTokenNotFoundError):
        return HubError(f"no Hugging Face token found ({e}); log in with `hf auth login` or set HF_TOKEN")
    http = _in_chain(e, HfHubHTTPError)
    status = getattr(getattr(http, "response", None), "status_code", None)
    if status in (401, 403):
        why = "not logged in or the token is invalid" if status == 401 else "the token may not do this"
        return HubError(f"the Hub at {endpoint} refused the request ({status}: {why}). Log in with `hf auth login` "
                        "or set HF_TOKEN to a token with write access to the repository's namespace.")
    if status is not None:
        return HubError(f"the Hub at {endpoint} answered {status}: {str(http).splitlines()[0]}")
    return None


# huggingface_hub 2.4 names cache files after these response headers (blobs/<etag>, .locks/.../<etag>.lock,
# .no_exist/<commit>/..., snapshots/<commit>/...) without checking them: "../../x" would be written outside
# the cache, before any digest is checked. Only plain names pass.
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,254}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _refuse_unsafe_headers(response) -> None:
    """httpx response hook: refuse a Hub file response whose commit or ETag is not a plain name."""
    commit = response.headers.get("X-Repo-Commit")
    if commit is None:  # huggingface_hub uses the ETag of a file response only, which always carries the commit
        return
    asked = re.search(r"/resolve/([0-9a-f]{40})/", response.request.url.path)
    if not _COMMIT.fullmatch(commit) or (asked is not None and asked.group(1) != commit):
        raise UnsafeResponse(f"the server answered X-Repo-Commit {commit!r} for {response.request.url.path}, which is "
                             "not the 40-hex commit asked for; refused")
    for name in ("X-Linked-Etag", "ETag"):
        etag = response.headers.get(name)
        if etag is not None and not _SAFE_NAME.fullmatch(etag.lstrip("W/").strip('"')):  # as huggingface_hub strips it
            raise UnsafeResponse(f"the server answered {name} {etag!r} for {response.request.url.path}, which is not a "
                                 "plain file name (huggingface_hub would write a file outside the cache); refused")


def guard_hf_downloads() -> None:
    """Add ``_refuse_unsafe_headers`` to every HTTP client huggingface_hub makes (once; idempotent).

    It wraps the client factory in use (huggingface_hub's default or one the user set), so the check
    survives huggingface_hub re-creating its client; it refuses nothing a well-formed Hub sends.
    """
    from huggingface_hub import set_client_factory
    from huggingface_hub.utils import _http

    current = getattr(_http, "_GLOBAL_CLIENT_FACTORY", _http.default_client_factory)
    if getattr(current, "pallas_hub_guard", False):
        return

    def guarded_client():
        client = current()
        hooks = client.event_hooks
        client.event_hooks = {**hooks, "response": [*hooks.get("response", []), _refuse_unsafe_headers]}
        return client

    guarded_client.pallas_hub_guard = True
    set_client_factory(guarded_client)


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

def _links(folder: Path):
    """(link, first hop) for every symbolic link under ``folder``, never following one."""
    for dirpath, dirnames, filenames in os.walk(folder):
        real_dir = os.path.realpath(dirpath)
        for name in dirnames + filenames:
            link = os.path.join(dirpath, name)
            if os.path.islink(link):
                yield Path(link), Path(os.path.normpath(os.path.join(real_dir, os.readlink(link))))


def _check_links(snapshot: Path, what: str) -> None:
    """Refuse a repository whose folders in the cache are links (a download would write, and a discard
    delete, wherever they point), or a snapshot with a link anywhere but to a file of its blobs."""
    repo = snapshot.parents[1]
    if bad := redirected(repo, snapshot.name):
        raise Tampered(f"{what}: {bad[0]} is, or lies behind, a link to {os.path.realpath(bad[0])}; the folders of a "
                       "cache are never links: refused as tampering")
    blobs = Path(os.path.realpath(repo)) / "blobs"
    cache = os.path.realpath(repo.parent) + os.sep
    for link, hop in _links(snapshot) if snapshot.is_dir() else ():
        target = os.path.realpath(link)
        if hop.parent != blobs or not os.path.isfile(target) or not target.startswith(cache):
            raise Tampered(f"{what}: {link.relative_to(snapshot)} links to {target}, not to a blob of this repository in "
                           "the cache; refused as tampering")


def discard(cache_dir: Path, repo_id: str, commit: str) -> None:
    """Remove one snapshot and the blobs only it uses; other versions in the cache stay loadable.

    Links are removed, never followed: a folder of the repository that is a link is unlinked first,
    and only entries of the repository's own blobs folder are deleted.
    """
    repo = Path(cache_dir) / repo_folder(repo_id)
    for link in redirected(repo, commit):  # outermost first; what lies behind a removed link is gone with it
        if link.is_symlink():
            link.unlink()
    snap = repo / "snapshots" / commit
    blobs = repo / "blobs"

    def used(folder: Path) -> set[Path]:
        if folder.is_symlink() or not folder.is_dir():
            return set()
        return {hop for _, hop in _links(folder) if hop.parent == Path(os.path.realpath(blobs))}

    mine = used(snap)
    others = set()
    for other in (repo / "snapshots").iterdir() if (repo / "snapshots").is_dir() else []:
        if other.name != commit:
            others |= used(other)
    shutil.rmtree(snap, ignore_errors=True)  # removes links, does not follow them
    if blobs.is_dir():
        for blob in mine - others:
            if blob.is_symlink() or blob.is_file():
                blob.unlink(missing_ok=True)
        for leftover in blobs.glob("*.incomplete"):
            leftover.unlink(missing_ok=True)
    (repo / "trees" / f"{commit}.json").unlink(missing_ok=True)


def verify_snapshot(snapshot: Path, what: str) -> str:
    """Check every ``build/<variant>`` (``build.verify_variant``) and every link; returns the build digest."""
    _check_links(snapshot, what)
    variants = sorted(p for p in (snapshot / "build").glob("*") if p.is_dir())
    if not variants:
        raise DigestMismatch(f"{what}: no build/<variant> folders in the snapshot")
    h = hashlib.sha256()
    for variant in variants:
        try:
            raw = verify_variant(variant)
        except VariantError as e:
            raise DigestMismatch(f"{what}: build/{variant.name} {e}") from None
        h.update(variant.name.encode() + b"\0" + hashlib.sha256(raw).digest())
    return "sha256:" + h.hexdigest()


def remove_bytecode(folder: Path) -> None:
    """Delete every ``__pycache__`` folder and ``*.pyc`` under ``folder``: no digest covers bytecode, and
    Python would run a planted one instead of the verified source."""
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in [d for d in dirnames if d == "__pycache__"]:
            dirnames.remove(name)
            cache = os.path.join(dirpath, name)
            if os.path.islink(cache):
                os.unlink(cache)
            else:
                shutil.rmtree(cache)
        for name in filenames:
            if name.endswith(".pyc"):
                os.unlink(os.path.join(dirpath, name))


# --------------------------------------------------------------------------- lock files

# pallas-hub's lock file: its own name, since `kernels.lock` is the kernels library's (written by `kernels lock`,
# read by `kernels download` and kernels.load_kernel, in a format that pins commits but no digests).
LOCK_FILE = "pallas-hub.lock"
KERNELS_LOCK_FILE = "kernels.lock"


def read_lock(path: Path | str) -> dict[str, dict]:
    """{repo_id: {"repo_id", "version", "commit", "digest"}} from a pallas-hub lock file, checked strictly."""
    remedy = (f"write it again from a fetch you trust: pallas-hub fetch REPO --version N --trust REPO --write-lock "
              f"{LOCK_FILE}")
    try:
        data = json.loads(Path(path).read_bytes())
    except FileNotFoundError:
        raise LockFileError(f"{path}: no such lock file; {remedy}") from None
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise LockFileError(f"{path}: not a pallas-hub lock file ({type(e).__name__}: {e}); {remedy}") from None
    if isinstance(data, list):  # kernels' KernelLocks: [{"dependency": ..., "lock": {"commit": ...}}]
        raise LockFileError(f"{path} is a kernels library lock file (`kernels lock`; it pins commits, no digests), "
                            f"not pallas-hub's {LOCK_FILE}; use it with `kernels download`, and {remedy}")
    if not isinstance(data, dict) or not isinstance(data.get("kernels"), list):
        raise LockFileError(f"{path}: not a pallas-hub lock file (expected {{\"kernels\": [...]}}); {remedy}")
    out = {}
    for i, entry in enumerate(data["kernels"]):
        where = f"{path}: kernels[{i}]"
        if not isinstance(entry, dict):
            raise LockFileError(f"{where} must be an object with repo_id, version, commit and digest; {remedy}")
        version = entry.get("version")
        problem = (repo_id_problem(entry.get("repo_id"))
                   or (None if isinstance(entry.get("commit"), str) and _COMMIT.fullmatch(entry["commit"])
                       else f"commit {entry.get('commit')!r} is not 40 hex digits")
                   or (None if isinstance(entry.get("digest"), str) and re.fullmatch(r"sha256:[0-9a-f]{64}", entry["digest"])
                       else f"digest {entry.get('digest')!r} is not sha256:<64 hex digits>")
                   or (None if version is None or (isinstance(version, int) and not isinstance(version, bool) and version >= 0)
                       else f"version {version!r} is not an integer"))
        if problem:
            raise LockFileError(f"{where}: {problem}; {remedy}")
        if entry["repo_id"] in out:
            raise LockFileError(f"{where}: {entry['repo_id']} is pinned twice; {remedy}")
        out[entry["repo_id"]] = entry
    return out


def check_lock_target(path: Path | str) -> None:
    """Refuse to write pallas-hub's lock where the kernels library's lock file belongs (before anything is fetched)."""
    if Path(path).name == KERNELS_LOCK_FILE:
        raise LockFileError(f"{path}: {KERNELS_LOCK_FILE} is the kernels library's lock file (`kernels download` reads it "
                            f"in its own format); write pallas-hub's lock file as {LOCK_FILE}")


def write_lock(path: Path | str, fetched: list[Fetched]) -> None:
    check_lock_target(path)
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
             sys.dont_write_bytecode)
    saved_env = {k: os.environ.get(k) for k in ("KERNELS_CACHE", "LOCAL_KERNELS")}
    had_tpu = hasattr(torch.backends, "tpu")
    constants.HF_HUB_OFFLINE = True
    constants.HF_HUB_CACHE = str(cache_dir)
    kernels.resolver.CACHE_DIR = kernels.install.CACHE_DIR = str(cache_dir)
    os.environ["KERNELS_CACHE"] = str(cache_dir)
    os.environ.pop("LOCAL_KERNELS", None)  # kernels would import an override folder, unverified
    sys.dont_write_bytecode = True  # the verified snapshot stays exactly as verified
    if tpu and not had_tpu:
        torch.backends.tpu = types.SimpleNamespace()  # what kernels' backend detection looks for
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE, constants.HF_HUB_CACHE = saved[0], saved[1]
        kernels.resolver.CACHE_DIR, kernels.install.CACHE_DIR = saved[2], saved[3]
        sys.dont_write_bytecode = saved[4]
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if tpu and not had_tpu:
            del torch.backends.tpu


def host_backend() -> str:
    """The backend kernels resolves variants for on this host ("cpu", "cuda", "rocm", "metal", "xpu", "tpu", ...)."""
    from kernels.backends import _backend

    return _backend().name


def no_variant_message(what: str, have: list[str], backend: str) -> str:
    """Why a kernel has no build for this host, and what to do (a Pallas kernel runs on TPU or CPU only)."""
    return (f"{what} has no build for this host's backend ({backend}); it publishes {', '.join(have) or 'none'}. "
            "Pallas TPU kernels run on TorchTPU (torch-tpu) or on CPU in Pallas interpret mode (torch-cpu, slow, "
            "exact); there is no build for CUDA, ROCm, XPU or Metal (MPS) hosts. Use a TPU VM with TorchTPU, or load the "
            "CPU build explicitly (kernels: get_kernel(..., backend=\"cpu\")) and pass CPU tensors.")


def _local_override(repo_id: str) -> str | None:
    """The folder ``LOCAL_KERNELS`` (kernels' override, ``repo=path:repo=path``) gives for ``repo_id``."""
    for entry in os.environ.get("LOCAL_KERNELS", "").split(":"):
        repo, sep, path = entry.partition("=")
        if sep and repo == repo_id:
            return path
    return None


def fetch(repo_id: str, version: int | None = None, *, trust: list[str] | tuple[str, ...] = (), source=None,
          lock: dict[str, dict] | None = None, tpu: bool | None = None) -> Fetched:
    """Fetch, verify and import one kernel; see the module docstring for the steps.

    ``source``: a ``LocalHub`` (default: the local hub) or a ``Hub``. ``lock``: ``read_lock(...)``;
    when it names ``repo_id`` its commit and digest are used and enforced (no network needed).
    ``tpu``: load the ``torch-tpu`` variant (default: when running on TorchTPU).
    """
    if problem := repo_id_problem(repo_id):
        raise InvalidRequest(problem)
    if isinstance(trust, str) or repo_id not in set(trust):
        raise UntrustedRepo(
            f"{repo_id} is not in the trust list, so its code will not be downloaded or run. Review it, then trust it "
            f"explicitly: trust=[{repo_id!r}] (CLI: --trust {repo_id}). Trust is per repository, exact match.")
    if (override := _local_override(repo_id)) is not None:
        raise HubError(f"LOCAL_KERNELS points {repo_id} at {override}, code the loader cannot verify; nothing was "
                       "imported. Unset LOCAL_KERNELS to load the published kernel, or load the folder yourself "
                       "with kernels.get_local_kernel.")
    src = _as_source(source)
    pinned = (lock or {}).get(repo_id)
    if pinned is not None:
        if version is not None and pinned.get("version") not in (None, version):
            raise LockMismatch(f"{repo_id}: version {version} was asked but the lock file pins v{pinned['version']}")
        version, commit = pinned.get("version"), pinned["commit"]
    else:
        if version is None:
            raise InvalidRequest(f"{repo_id}: give a version (an integer, the Hub branch v<N>; CLI: --version N) "
                                 "or a lock file (--lock FILE)")
        if isinstance(version, bool) or not isinstance(version, int):
            raise InvalidRequest(f"{repo_id}: version must be an integer, got {version!r}")
        available = src.versions(repo_id)
        if version not in available:
            listed = ", ".join(f"v{v}" for v in sorted(available)) or "none"
            raise VersionNotFound(f"{repo_id}: version {version} not found in {src}; versions there: {listed}")
        commit = available[version]
    if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):  # it becomes a cache path
        raise HubError(f"{repo_id}: {src} gave {commit!r} as the commit of v{version}; expected 40 hex digits")
    what = f"{repo_id}@{commit[:12]}"
    with _ENV_LOCK, file_lock(src.cache_dir, repo_id):
        snapshot = src.snapshot(repo_id, commit)
        try:
            digest = verify_snapshot(snapshot, what)
        except DigestMismatch as e:
            if isinstance(src, Hub):
                discard(src.cache_dir, repo_id, commit)
                raise type(e)(f"{e}. The download was removed from the cache; nothing was imported.") from None
            raise type(e)(f"{e}. Nothing was imported; publish the kernel again to repair {src}.") from None
        if pinned is not None and digest != pinned["digest"]:
            raise LockMismatch(f"{what}: the lock file pins digest {pinned['digest']} but {src} holds {digest}; "
                               "nothing was imported. Re-lock only if this change is expected.")
        if pinned is None:
            src.pin(repo_id, version, commit)
        try:
            remove_bytecode(snapshot / "build")
        except OSError as e:
            raise HubError(f"{what}: cannot remove bytecode from the verified snapshot ({e}); nothing was imported, "
                           "since Python would run it instead of the verified source") from None
        from kernels import get_kernel  # (imports torch: only once there is something verified to load)

        tpu = on_torchtpu_host() if tpu is None else tpu
        with _hub_settings(src.cache_dir, tpu):
            try:
                if pinned is None:
                    module = get_kernel(repo_id, version=version, trust_remote_code=[repo_id])
                else:
                    module = get_kernel(repo_id, revision=commit, trust_remote_code=[repo_id])
            except FileNotFoundError as e:
                if "Cannot find a build variant" not in str(e):
                    raise KernelImportError(f"{what}: kernels could not load the verified snapshot ({e})") from e
                have = sorted(p.name for p in (snapshot / "build").iterdir() if p.is_dir())
                raise NoVariant(no_variant_message(what, have, "tpu" if tpu else host_backend())) from None
            except Exception as e:
                raise KernelImportError(
                    f"{what}: importing the kernel raised {type(e).__name__}: {e}. Its files are the verified ones, so the "
                    "kernel itself fails here: pin a version that works, or report it to the kernel's publisher.") from e
    path = Path(module.__file__).parent
    if snapshot.resolve() not in path.resolve().parents:  # belt and braces: what was imported is what we verified
        raise HubError(f"{what}: kernels imported {path}, outside the verified snapshot {snapshot}")
    variant = path.relative_to(snapshot).parts[1] if path.is_relative_to(snapshot) else path.name
    return Fetched(repo_id, version, commit, variant, digest, repr(src), path, module)
