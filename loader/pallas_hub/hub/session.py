"""Fetch and register in one call: ``pallas_hub.load(...)``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from .fetch import Fetched, check_lock_target, fetch, read_lock, write_lock
from .register import Registration, register


@dataclasses.dataclass
class Loaded:
    kernels: list[Fetched]
    registration: Registration

    def __getitem__(self, repo_id: str):
        return next(f.module for f in self.kernels if f.repo_id == repo_id)

    def undo(self) -> None:
        self.registration.undo()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()

    def report(self) -> list[str]:
        lines = [f"{f.repo_id} v{f.version} commit {f.commit[:12]} variant {f.variant} from {f.source}"
                 for f in self.kernels]
        return lines + ["registered " + e.line() for e in self.registration.entries]


def load(repos: list[str] | dict[str, int] | None = None, *, trust: list[str] | tuple[str, ...] = (),
         version: int | None = None, source=None, lock: str | Path | None = None, write_lock_to: str | Path | None = None,
         tpu: bool | None = None, do_register: bool = True) -> Loaded:
    """Fetch kernels (verified, through ``kernels.get_kernel``) and register what each declares.

    ``repos``: ``{"org/name": version}``, or a list of repo ids with ``version`` (or a ``lock`` file)
    for all; ``None`` means every kernel of the hub manifest found from the current folder upward, at its
    build.toml version.
    ``trust``: the explicit allow-list of repo ids (nothing is trusted by default).
    ``source``: ``LocalHub(...)`` (default: the local hub) or ``Hub(endpoint=..., cache_dir=...)``.
    ``lock``: a lock file whose commits and digests are enforced; ``write_lock_to``: record what was loaded
    (pallas-hub's own lock file, conventionally ``pallas-hub.lock``; ``kernels.lock`` is the kernels library's).
    If anything fails, whatever was registered already is undone.
    """
    if repos is None:
        from .manifest import load_manifest

        repos = {k.repo_id: k.version for k in load_manifest().kernels.values()}
    elif not isinstance(repos, dict):
        repos = {r: version for r in repos}
    if write_lock_to is not None:
        check_lock_target(write_lock_to)
    pins = read_lock(lock) if lock is not None else None
    loaded = Loaded([], Registration())
    try:
        for repo_id, v in repos.items():
            fetched = fetch(repo_id, v, trust=trust, source=source, lock=pins, tpu=tpu)
            loaded.kernels.append(fetched)
            if do_register:
                loaded.registration.extend(register(fetched.module, kernel=repo_id))
    except BaseException:
        loaded.undo()
        raise
    if write_lock_to is not None:
        write_lock(write_lock_to, loaded.kernels)
    return loaded
