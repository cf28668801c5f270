"""Publishing built kernels: to a Hugging Face Hub repository of type "kernel", or to a local hub.

Both hold the same repository layout, the one `kernels` resolves (and kernel-builder uploads):
branch ``v<version>`` has ``build/<variant>/**`` and ``benchmarks/benchmark*.py``; ``main`` has the
card (``CARD.md``) as ``README.md``, with the files it links and a line naming the source repository.

The local hub is a Hugging Face cache folder (``kernels--<org>--<name>/refs/v<N>`` holding a commit
id, ``snapshots/<commit>/...`` holding the files), so ``kernels.get_kernel(repo, version=N)``
resolves it offline with ``HF_HUB_CACHE`` pointed at it. Local commits are content hashes: publishing
the same build twice changes nothing, and an older commit stays loadable for lock files that pin it.

A publish reads the build under the build folder's lock and refuses any variant that does not
verify against its own metadata (nothing partial is published). A local version is written in a
staging folder, renamed into ``snapshots/`` and only then named by ``refs/v<N>``, all under a
per-repository lock; whatever a killed publish left behind is removed by the next one.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import tempfile
from pathlib import Path

from .build import VariantError, locked, verify_variant
from .manifest import KernelSpec, ManifestError

# PALLAS_HUB_LOCAL overrides where the local hub lives.
DEFAULT_LOCAL_HUB = Path(os.environ.get("PALLAS_HUB_LOCAL") or Path.home() / ".cache" / "pallas-hub" / "hub")
REPO_TYPE = "kernel"
MANAGED = ("build/", "benchmarks/")  # what a publish owns on the version branch (stale files there are removed)


def repo_folder(repo_id: str) -> str:
    """The cache folder name huggingface_hub uses for a kernel repository."""
    return "kernels--" + repo_id.replace("/", "--")


def version_files(spec: KernelSpec, build_dir: Path | None = None) -> dict[str, bytes]:
    """What branch ``v<version>`` holds: every built variant and the benchmark scripts.

    Read under the build folder's lock; every variant folder must verify against its own metadata,
    so a half-written or edited build is refused, never published in part.
    """
    build_dir = Path(build_dir) if build_dir is not None else spec.path / "build"
    rebuild = f"rebuild it: pallas-hub build {spec.key}"
    if not build_dir.is_dir():
        raise FileNotFoundError(f"{spec.name}: nothing built in {build_dir}; run `pallas-hub build {spec.key}` first")
    files = {}
    with locked(build_dir):
        variants = sorted(p for p in build_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not variants:
            raise FileNotFoundError(f"{spec.name}: nothing built in {build_dir}; run `pallas-hub build {spec.key}` first")
        for variant in variants:
            try:
                verify_variant(variant)
            except VariantError as e:
                raise VariantError(f"{variant} {e}; nothing was published: {rebuild}") from None
            for path in sorted(variant.rglob("*")):
                rel = path.relative_to(variant)
                if path.is_file() and "__pycache__" not in rel.parts and path.suffix != ".pyc":
                    files[f"build/{variant.name}/{rel.as_posix()}"] = path.read_bytes()
    for path in sorted((spec.path / "benchmarks").glob("benchmark*.py")):
        files[f"benchmarks/{path.name}"] = path.read_bytes()
    return files


# a Markdown link or image, [text](target "title"): what a card cites, published beside it
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def main_files(spec: KernelSpec) -> dict[str, bytes]:
    """What branch ``main`` holds: the card (CARD.md) as README.md, with a line saying where the code lives
    when the source repository is known, and every file of the kernel folder that the card links (figures,
    tables), at the same relative path, so that nothing the card cites is missing on the Hub."""
    from .build import source_location

    card = spec.path / "CARD.md"
    if not card.is_file():
        return {}
    text = card.read_text()
    files = {}
    for target in _LINK.findall(text):
        if re.match(r"^([a-z][a-z0-9+.-]*:|#|/)", target):  # a URL, an anchor, an absolute path
            continue
        rel = target.split("#", 1)[0]
        path = (spec.path / rel).resolve()
        if not path.is_relative_to(spec.path.resolve()) or not path.is_file():
            raise ManifestError(f"{card} links {target!r}, which is not a file of {spec.path}; a card is published with "
                                "the files it links, so they must be in the kernel's folder")
        files[path.relative_to(spec.path.resolve()).as_posix()] = path.read_bytes()
    where = source_location(spec)
    footer = f"\n---\n\nSource: {where}. Published with pallas-hub.\n" if where else ""
    files["README.md"] = (text.rstrip("\n") + "\n" + footer).encode() if footer else card.read_bytes()
    return files


def redirected(repo: Path, commit: str) -> list[Path]:
    """The folders of a repository in a cache (``repo`` = <cache>/kernels--org--name) that are, or lie
    behind, a link, outermost first: whatever writes or deletes there would act where they point."""
    cache = repo.parent
    real = Path(os.path.realpath(cache))
    folders = [cache / ".locks", cache / ".locks" / repo.name, repo,
               *(repo / sub for sub in ("blobs", "refs", "trees", ".no_exist", "snapshots")), repo / "snapshots" / commit]
    return [p for p in folders if (p.exists() or p.is_symlink()) and os.path.realpath(p) != str(real / p.relative_to(cache))]


def file_lock(cache_dir: Path, repo_id: str):
    """An exclusive lock per repository in ``cache_dir``, held across processes (fcntl)."""
    return locked(Path(cache_dir) / ".locks" / "pallas-hub" / f"{repo_folder(repo_id)}.lock")


def _commit_id(files: dict[str, bytes]) -> str:
    h = hashlib.sha1(b"pallas-hub local commit\0")
    for rel, data in sorted(files.items()):
        h.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
    return h.hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _holds(folder: Path, files: dict[str, bytes]) -> bool:
    """True when ``folder`` holds exactly ``files``: nothing more (bytecode and links included), nothing less."""
    if not folder.is_dir() or folder.is_symlink():
        return False
    present = set()
    for p in folder.rglob("*"):
        if p.is_symlink():
            return False
        if p.is_file():
            present.add(p.relative_to(folder).as_posix())
    return present == set(files) and all((folder / rel).read_bytes() == data for rel, data in files.items())


class LocalHub:
    """A Hugging Face cache folder used as a hub: publish writes it, fetch reads it offline."""

    def __init__(self, root: Path | str | None = None):
        self.root = Path(root) if root is not None else DEFAULT_LOCAL_HUB

    def __repr__(self) -> str:
        return f"local hub {self.root}"

    def repo_dir(self, repo_id: str) -> Path:
        return self.root / repo_folder(repo_id)

    def versions(self, repo_id: str) -> dict[int, str]:
        """{version: commit} from ``refs/v<N>``."""
        refs = self.repo_dir(repo_id) / "refs"
        out = {}
        for ref in refs.glob("v*") if refs.is_dir() else []:
            if ref.name[1:].isdigit():
                out[int(ref.name[1:])] = ref.read_text().strip()
        return out

    def repos(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name[len("kernels--"):].replace("--", "/", 1) for p in self.root.glob("kernels--*--*"))

    def snapshot(self, repo_id: str, commit: str) -> Path:
        return self.repo_dir(repo_id) / "snapshots" / commit

    def _clean_leftovers(self, repo_id: str) -> None:
        """Remove what a killed publish left behind (staging folders, temporary ref files); under the lock."""
        repo = self.repo_dir(repo_id)
        for leftover in [*repo.glob("snapshots/.staging-*"), *repo.glob("snapshots/.damaged-*"), *repo.glob("refs/.*")]:
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)

    def _commit(self, repo_id: str, branch: str, files: dict[str, bytes]) -> tuple[str, bool]:
        """Write ``files`` as one commit and point ``refs/<branch>`` at it; returns (commit, changed)."""
        commit = _commit_id(files)
        target = self.snapshot(repo_id, commit)
        for link in redirected(self.repo_dir(repo_id), commit):  # a planted link: removed, never written through
            if link.is_symlink():
                link.unlink()
        if not _holds(target, files):  # content-addressed; a damaged copy is replaced, never trusted
            target.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=".staging-"))
            try:
                for rel, data in files.items():
                    (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                    (staging / rel).write_bytes(data)
                if target.exists():
                    damaged = Path(tempfile.mkdtemp(dir=target.parent, prefix=".damaged-"))
                    os.rename(target, damaged / "snapshot")
                    shutil.rmtree(damaged)
                os.rename(staging, target)  # atomic: a reader sees the whole snapshot or none
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
        ref = self.repo_dir(repo_id) / "refs" / branch
        changed = not ref.is_file() or ref.read_text().strip() != commit
        if changed:
            _write_atomic(ref, commit.encode())
        return commit, changed

    def publish(self, spec: KernelSpec, build_dir: Path | None = None, repo_id: str | None = None, progress=print) -> str:
        repo_id = repo_id or spec.repo_id
        files = version_files(spec, build_dir)
        with file_lock(self.root, repo_id):
            self._clean_leftovers(repo_id)
            commit, changed = self._commit(repo_id, f"v{spec.version}", files)
            if main := main_files(spec):
                self._commit(repo_id, "main", main)
        if progress:
            state = "published" if changed else "up to date"
            progress(f"{state}: {repo_id} v{spec.version} commit {commit[:12]} ({len(files)} files) in {self}")
        return commit


def publish_hub(spec: KernelSpec, build_dir: Path | None = None, *, repo_id: str | None = None, api=None,
                private: bool | None = None, create_pr: bool = False, progress=print) -> str:
    """Upload to a Hub repository of type "kernel" as kernel-builder does; returns the branch's commit
    (with ``create_pr``: the pull request's URL).

    Creates the repository and branch ``v<version>`` when missing, commits only files whose bytes
    differ from the branch (git blob ids compared) and deletes stale files under build/ and
    benchmarks/, so publishing an unchanged build makes no commit. CARD.md goes to main as README.md.
    ``create_pr``: open pull requests against ``v<version>`` (and ``main`` for the card) instead of
    committing, as a contributor without write access does; the repository and branch must exist.
    Nothing is sent before the build verifies and a token is found. A refused or failed request (no
    network, a token without the rights) raises a ``HubError`` that says what to do.
    """
    from huggingface_hub import HfApi, get_token

    from .fetch import HubError, as_hub_error

    api = api or HfApi()
    files = version_files(spec, build_dir)  # a build that does not verify is refused before any request
    if not (api.token or get_token()):
        raise HubError(f"no Hugging Face token, so nothing was sent to {api.endpoint}: log in with `hf auth login` or "
                       "set HF_TOKEN to a token with write access (or, with --create-pr, a token that may open pull "
                       "requests); or publish to the local hub (pallas-hub publish without --hub)")
    say = progress or (lambda *_: None)
    for warning in _provenance_warnings(spec, files):
        say(f"warning: {warning}")
    try:
        return _upload(spec, files, api, repo_id or spec.repo_id, private, create_pr, say)
    except Exception as e:
        err = as_hub_error(e, api.endpoint, "Publish to the local hub instead (pallas-hub publish without --hub), "
                                            "or retry when the Hub is reachable.")
        if err is None:
            raise
        raise err from e


def _provenance_warnings(spec: KernelSpec, files: dict[str, bytes]) -> list[str]:
    """What a Hub copy would not say about where its code comes from (read from the verified build)."""
    import json

    meta = json.loads(next(data for rel, data in sorted(files.items()) if rel.endswith("/metadata.json")))
    git = meta.get("provenance", {}).get("kernel")
    out = []
    if not meta.get("source"):
        out.append(f"{spec.name}: metadata.json names no source repository, so nothing on the Hub leads back to the "
                   "code; set [hub] source = \"https://...\" in the hub manifest (or a git remote 'origin')")
    if git is None:
        out.append(f"{spec.name}: built outside git or from files never committed: metadata.json records no commit")
    elif git.get("dirty"):
        out.append(f"{spec.name}: built from uncommitted changes (metadata.json records commit {git['commit'][:12]}, "
                   "dirty); commit them and rebuild to publish a build that its commit reproduces")
    return out


def _upload(spec: KernelSpec, files: dict[str, bytes], api, repo_id: str, private: bool | None, create_pr: bool,
            say) -> str:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete
    from huggingface_hub.errors import RepositoryNotFoundError
    from huggingface_hub.hf_api import RepoFile
    from huggingface_hub.utils.sha import git_hash

    from .fetch import HubError

    branch = f"v{spec.version}"
    if create_pr:  # creating a repository or a branch needs write access, which a pull request does not
        try:
            branches = {b.name for b in api.list_repo_refs(repo_id, repo_type=REPO_TYPE).branches}
        except RepositoryNotFoundError:
            raise HubError(f"{repo_id} does not exist at {api.endpoint}; a pull request needs the repository and its "
                           f"branch {branch}: ask its maintainers to create them, or publish without --create-pr") from None
        if branch not in branches:
            raise HubError(f"{repo_id} has no branch {branch}, and a pull request cannot create one; ask its maintainers "
                           f"to create it (its branches: {', '.join(sorted(branches))})")
    else:
        say(f"{repo_id}: creating the kernel repository if missing ({api.endpoint})")
        api.create_repo(repo_id, repo_type=REPO_TYPE, exist_ok=True, private=private)
        api.create_branch(repo_id, branch=branch, repo_type=REPO_TYPE, exist_ok=True)

    def sync(branch: str, files: dict[str, bytes], managed):
        remote = {e.path: e.blob_id for e in api.list_repo_tree(repo_id, repo_type=REPO_TYPE, revision=branch,
                                                                 recursive=True) if isinstance(e, RepoFile)}
        ops = [CommitOperationAdd(rel, data) for rel, data in files.items() if remote.get(rel) != git_hash(data)]
        ops += [CommitOperationDelete(rel) for rel in sorted(remote) if managed(rel) and rel not in files]
        if not ops:
            say(f"{repo_id}@{branch}: up to date ({len(files)} files)")
            return None
        say(f"{repo_id}@{branch}: {'opening a pull request with' if create_pr else 'committing'} {len(ops)} change(s) "
            f"({len(files)} files)")
        info = api.create_commit(repo_id, operations=ops, repo_type=REPO_TYPE, revision=branch, create_pr=create_pr,
                                 commit_message=f"pallas-hub publish {spec.name} v{spec.version}")
        if create_pr:
            say(f"{repo_id}@{branch}: pull request {info.pr_url}")
        return info

    pushed = sync(branch, files, lambda rel: rel.startswith(MANAGED))
    if main := main_files(spec):
        sync("main", main, lambda rel: False)  # main also holds what others put there: nothing is deleted
    if create_pr:
        return pushed.pr_url if pushed is not None else ""
    refs = api.list_repo_refs(repo_id, repo_type=REPO_TYPE)
    commit = next(b.target_commit for b in refs.branches if b.name == branch)
    say(f"{repo_id}: v{spec.version} is commit {commit}")
    return commit
