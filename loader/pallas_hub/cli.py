"""pallas-hub: scaffold, build, check, publish, fetch and list Pallas TPU kernels, and run the demo.

Commands work on the checkout they run in: its hub manifest (build.toml with a [hub] table) is found
from the current folder upward, or given with --manifest.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ._version import __version__
from .hub import manifest as mf

DEFAULT_TIMEOUT = 300.0  # seconds one compile-matrix configuration may compile (pallas-hub check --timeout)


class UsageError(ValueError):
    """A command line that cannot work as given; the message says how to fix it."""


def _manifest(args) -> mf.Manifest:
    return mf.load_manifest(getattr(args, "manifest", None))


def _manifest_hint(args, name: str) -> str:
    """For a manifest kernel key or name given where a repo id belongs: which repo id was meant."""
    try:
        spec = _manifest(args).select([name])[0]
    except (mf.ManifestError, OSError):
        return ""
    return f"; {name!r} is the manifest's kernel {spec.key}: fetch it as {spec.repo_id}"


def _specs(args) -> list[mf.KernelSpec]:
    if getattr(args, "path", None):
        return [mf.load_kernel(Path(p)) for p in args.path]
    return _manifest(args).select(args.kernels)


def cmd_new(args) -> int:
    from .hub.scaffold import new_kernel, next_steps

    manifest = _manifest(args)
    spec, files = new_kernel(manifest, args.name, args.key)
    print(f"created {spec.path} ({spec.repo_id} v{spec.version}, package {spec.package}): {len(files)} files, "
          f"and [kernels.{spec.key}] in {manifest.file}")
    for path in files:
        print(f"  {path.relative_to(manifest.root)}")
    print("next:")
    for line in next_steps(spec, manifest.root):
        print(f"  {line}")
    return 0


def cmd_build(args) -> int:
    from .hub.build import build_kernel

    for spec in _specs(args):
        out = build_kernel(spec)
        print(f"built {spec.name} v{spec.version} -> {out}")
    return 0


def cmd_check(args) -> int:
    chips = tuple(args.chips.split(",")) if args.chips else None
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    specs = _specs(args)
    if not specs:
        print("the manifest declares no kernels yet; add one with: pallas-hub new NAME")
        return 0
    from .verify.matrix import check, report

    return report(check(specs, chips, timeout=args.timeout))


def _hub(args):
    from .hub.fetch import Hub
    from .hub.publish import LocalHub

    if getattr(args, "hub", False) or getattr(args, "endpoint", None):
        return Hub(endpoint=args.endpoint)
    return LocalHub(args.local_hub)


def cmd_publish(args) -> int:
    from .hub.build import build_kernel
    from .hub.publish import LocalHub, publish_hub

    target = _hub(args)
    if args.create_pr and isinstance(target, LocalHub):
        raise UsageError("--create-pr opens pull requests on the Hub: add --hub (or --endpoint URL)")
    for spec in _specs(args):
        out = build_kernel(spec)
        if isinstance(target, LocalHub):
            target.publish(spec, out)
        else:
            from huggingface_hub import HfApi

            publish_hub(spec, out, api=HfApi(endpoint=target.endpoint), private=args.private, create_pr=args.create_pr)
    return 0


def cmd_fetch(args) -> int:
    from .hub.fetch import read_lock
    from .hub.session import load

    if not args.repos and not args.lock:
        raise UsageError("fetch needs repo ids (org/name) or --lock FILE")
    if args.version is None and not args.lock:
        raise UsageError("fetch needs --version N (the Hub branch vN), or --lock FILE to fetch what a lock file pins")
    for repo in args.repos:
        if problem := mf.repo_id_problem(repo):
            raise UsageError(problem + _manifest_hint(args, repo))
    repos = args.repos or list(read_lock(args.lock))
    with load(repos, version=args.version, trust=args.trust or [], source=_hub(args), lock=args.lock,
              write_lock_to=args.write_lock, do_register=False) as loaded:
        for line in loaded.report():
            print(line)
        for f in loaded.kernels:
            declared = getattr(f.module, "REGISTRATIONS", None)
            print(f"  {f.repo_id} declares: {declared}")
    if args.write_lock:
        print(f"lock written: {args.write_lock}")
    return 0


def cmd_list(args) -> int:
    from .hub.build import variant_files
    from .hub.fetch import HubError, HubUnreachable, VersionNotFound
    from .hub.publish import LocalHub

    local = LocalHub(args.local_hub)
    remote = None
    if args.hub or args.endpoint:
        from .hub.fetch import Hub

        remote = Hub(endpoint=args.endpoint)
    manifest = _manifest(args)
    print(f"manifest {manifest.file}: namespace {manifest.namespace}, {len(manifest.kernels)} kernel(s)")
    for spec in manifest.kernels.values():
        build = spec.path / "build"
        fresh = all((build / v / rel).is_file() and (build / v / rel).read_bytes() == data
                    for v in spec.variants for rel, data in variant_files(spec, v).items())
        built = "built, up to date" if fresh else ("built, STALE" if build.is_dir() else "not built")
        print(f"{spec.key:<18} {spec.repo_id:<36} v{spec.version:<3} {built}")
        versions = local.versions(spec.repo_id)
        print(f"{'':18} {local}: " + (", ".join(f"v{v} {c[:12]}" for v, c in sorted(versions.items())) or "not published"))
        if remote is not None:
            try:
                versions = remote.versions(spec.repo_id)
            except VersionNotFound:
                versions = {}
            except HubUnreachable as e:  # said once, not once per kernel
                print(f"{'':18} {remote}: unreachable; the Hub's versions are not listed. {e}")
                remote = None
                continue
            except HubError as e:  # this repository only (a refused token, ...)
                print(f"{'':18} {remote}: {e}")
                continue
            print(f"{'':18} {remote}: " + (", ".join(f"v{v} {c[:12]}" for v, c in sorted(versions.items())) or "none"))
    others = [r for r in local.repos() if r not in {s.repo_id for s in manifest.kernels.values()}]
    if others:
        print("also in the local hub: " + ", ".join(f"{r} ({', '.join(f'v{v}' for v in sorted(local.versions(r)))})"
                                                    for r in others))
    return 0


def cmd_demo(args) -> int:
    """The main job: build, publish locally, fetch, register, run transformers, compile matrix."""
    from . import demo

    return demo.run(_manifest(args).root, local_hub=args.local_hub, compile_matrix=not args.no_compile,
                    timeout=DEFAULT_TIMEOUT)


def cmd_bench(args) -> int:
    from .bench import runner

    families = tuple(args.families.split(",")) if args.families else runner.FAMILIES
    chips = tuple(args.chips.split(",")) if args.chips else runner.DEFAULT_CHIPS
    problems = impls = None
    if args.problem:  # exact names, as the tables print them
        problems = runner.problems(families=families)
        unknown = sorted(set(args.problem) - {p.name for p in problems})
        if unknown:
            raise UsageError(f"no problem named {', '.join(map(repr, unknown))} in {','.join(families)}; the "
                             f"problems are: {'; '.join(p.name for p in problems)}")
        problems = [p for p in problems if p.name in args.problem]
    if args.impl:  # any implementation whose name contains one of the texts
        impls = runner.implementations(families, paths=args.path or ())
        impls = [i for i in impls if any(text in i.name for text in args.impl)]
        if not impls:
            raise UsageError(f"no implementation's name contains {' or '.join(map(repr, args.impl))}")
    result = runner.run(families, bridge=not args.no_bridge, xla=not args.no_xla, paths=args.path or (), chips=chips,
                        workers=args.workers, problem_list=problems, impl_list=impls)
    return 0 if all(r.get("check", {}).get("ok", True) for r in result["rows"] if r["status"] == "ok") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pallas-hub", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"pallas-hub {__version__}")
    debug_help = "on failure, show the traceback too"
    manifest_help = "the hub manifest (build.toml) to work on (default: found from the current folder upward)"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    parser.add_argument("--manifest", type=Path, help=manifest_help)
    common = argparse.ArgumentParser(add_help=False)  # --debug and --manifest also after the command
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug_help)
    common.add_argument("--manifest", type=Path, default=argparse.SUPPRESS, help=manifest_help)
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name, **kw):
        return sub.add_parser(name, parents=[common], **kw)

    def kernel_args(p):
        p.add_argument("kernels", nargs="*", help="kernel keys or Hub names from build.toml (default: all)")
        p.add_argument("--path", action="append", help="a kernel folder outside the manifest (repeatable)")

    p = command("new", help="start a new kernel: kernels/<key>/ with a working Pallas kernel, its tests and "
                "declarations, and its manifest entry")
    p.add_argument("name", help="the kernel's Hub name, e.g. softplus ('-tpu' is added: softplus-tpu)")
    p.add_argument("--key", help="the folder and manifest key (default: the name without -tpu, '_' for '-')")
    p.set_defaults(fn=cmd_new)
    p = command("build", help="build kernels into kernels/<name>/build/{torch-tpu,torch-cpu}")
    kernel_args(p)
    p.set_defaults(fn=cmd_build)
    p = command("check", help="compile every declared configuration for each TPU generation")
    kernel_args(p)
    p.add_argument("--chips", help="comma-separated subset of v5e,v6e,tpu7x")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help=f"seconds one configuration may compile before it is stopped and reported (default {DEFAULT_TIMEOUT:g})")
    p.set_defaults(fn=cmd_check)
    def hub_args(p, remote_help):
        p.add_argument("--local-hub", type=Path, help="the local hub folder (default: $PALLAS_HUB_LOCAL or "
                       "~/.cache/pallas-hub/hub)")
        p.add_argument("--hub", action="store_true", help=remote_help)
        p.add_argument("--endpoint", help="a Hub endpoint other than huggingface.co (implies --hub)")

    p = command("publish", help="build, then publish to the local hub (default) or the Hub (--hub)")
    kernel_args(p)
    hub_args(p, "upload to the Hugging Face Hub (repo type kernel; needs a write token)")
    p.add_argument("--private", action="store_true", default=None, help="create the Hub repository private")
    p.add_argument("--create-pr", action="store_true", help="open pull requests on the Hub instead of committing "
                   "(needs the repository and its branch vN to exist)")
    p.set_defaults(fn=cmd_publish)
    p = command("fetch", help="fetch and verify kernels through kernels.get_kernel, optionally lock them")
    p.add_argument("repos", nargs="*", help="repo ids org/name")
    p.add_argument("--version", type=int, help="the version (branch v<N>) to fetch")
    p.add_argument("--trust", action="append", help="a repo id you trust (repeatable); nothing is trusted by default")
    p.add_argument("--lock", help="a pallas-hub lock file (pallas-hub.lock): fetch exactly the commits and digests it pins")
    p.add_argument("--write-lock", help="write what was fetched to this lock file (pallas-hub.lock; kernels.lock is the "
                   "kernels library's and is refused)")
    hub_args(p, "fetch from the Hugging Face Hub instead of the local hub")
    p.set_defaults(fn=cmd_fetch)
    p = command("list", help="the manifest's kernels: built, published (local hub; --hub for the Hub), versions")
    hub_args(p, "also list the versions on the Hugging Face Hub")
    p.set_defaults(fn=cmd_list)
    p = command("bench", help="ours against the anchors as whole layers on real model shapes (TPU cost model), "
                "checks, bridge overhead; a subset run writes benchmarks/results/partial/ only")
    p.add_argument("--families", help="comma-separated subset of moe,prefill,decode,train")
    p.add_argument("--chips", help="comma-separated subset of v5e,v6e,tpu7x")
    p.add_argument("--workers", type=int, default=1, help="programs compiled at a time, each in its own process (default 1)")
    p.add_argument("--no-bridge", action="store_true", help="skip the bridge overhead measurement")
    p.add_argument("--no-xla", action="store_true", help="skip the XLA:TPU matmul comparison")
    p.add_argument("--path", action="append", help="one of our kernel folders to bench instead of the manifest's (repeatable)")
    p.add_argument("--problem", action="append", help="only this problem, by its exact name in the tables (repeatable)")
    p.add_argument("--impl", action="append", help="only implementations whose name contains this text, e.g. ours "
                   "or vLLM (repeatable)")
    p.set_defaults(fn=cmd_bench)
    p = command("demo", help="the main job (see README)")
    p.add_argument("--local-hub", type=Path, help="the local hub folder to publish to and fetch from")
    p.add_argument("--no-compile", action="store_true", help="skip the TPU compile matrix")
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:
        from .hub.build import VariantError
        from .hub.fetch import HubError
        from .hub.register import RegistrationError

        # documented failures: one line with the reason and the remedy (--debug: the traceback too)
        if args.debug or not isinstance(e, (UsageError, mf.ManifestError, VariantError, OSError, HubError,
                                            RegistrationError)):
            raise
        print(f"pallas-hub: {' '.join(str(e).split())}", file=sys.stderr)
        return 1 if isinstance(e, (HubError, RegistrationError)) else 2


if __name__ == "__main__":
    sys.exit(main())
