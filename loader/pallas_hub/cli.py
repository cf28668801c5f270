"""pallas-hub: build, check, publish, fetch and list Pallas TPU kernels, and run the demo."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from .hub import manifest as mf

FIXTURE = mf.ROOT / "tests" / "fixtures" / "scale_add"


def _specs(args) -> list[mf.KernelSpec]:
    if getattr(args, "path", None):
        return [mf.load_kernel(Path(p)) for p in args.path]
    return mf.load_manifest().select(args.kernels)


def cmd_build(args) -> int:
    from .hub.build import build_kernel

    for spec in _specs(args):
        out = build_kernel(spec)
        print(f"built {spec.name} v{spec.version} -> {out}")
    return 0


def cmd_check(args) -> int:
    chips = tuple(args.chips.split(",")) if args.chips else None
    specs = _specs(args)
    if not specs:
        print("the manifest declares no kernels yet; checking the fixture kernel")
        specs = [mf.load_kernel(FIXTURE)]
    from .verify.matrix import check, report

    return report(check(specs, chips))


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
    for spec in _specs(args):
        out = build_kernel(spec)
        if isinstance(target, LocalHub):
            target.publish(spec, out)
        else:
            from huggingface_hub import HfApi

            publish_hub(spec, out, api=HfApi(endpoint=target.endpoint), private=args.private)
    return 0


def cmd_fetch(args) -> int:
    from .hub.fetch import read_lock
    from .hub.session import load

    if not args.repos and not args.lock:
        raise mf.ManifestError("give repo ids (org/name) or --lock FILE")
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
    from .hub.build import VARIANTS, variant_files
    from .hub.publish import LocalHub

    local = LocalHub(args.local_hub)
    remote = None
    if args.hub or args.endpoint:
        from .hub.fetch import Hub

        remote = Hub(endpoint=args.endpoint)
    manifest = mf.load_manifest()
    print(f"manifest {mf.ROOT / 'build.toml'}: namespace {manifest.namespace}, {len(manifest.kernels)} kernel(s)")
    for spec in manifest.kernels.values():
        build = spec.path / "build"
        fresh = all((build / v / rel).is_file() and (build / v / rel).read_bytes() == data
                    for v in VARIANTS for rel, data in variant_files(spec, v).items())
        built = "built, up to date" if fresh else ("built, STALE" if build.is_dir() else "not built")
        print(f"{spec.key:<18} {spec.repo_id:<36} v{spec.version:<3} {built}")
        versions = local.versions(spec.repo_id)
        print(f"{'':18} {local}: " + (", ".join(f"v{v} {c[:12]}" for v, c in sorted(versions.items())) or "not published"))
        if remote is not None:
            try:
                versions = remote.versions(spec.repo_id)
                print(f"{'':18} {remote}: " + (", ".join(f"v{v} {c[:12]}" for v, c in sorted(versions.items())) or "none"))
            except Exception as e:
                print(f"{'':18} {remote}: {e}")
    others = [r for r in local.repos() if r not in {s.repo_id for s in manifest.kernels.values()}]
    if others:
        print("also in the local hub: " + ", ".join(f"{r} ({', '.join(f'v{v}' for v in sorted(local.versions(r)))})"
                                                    for r in others))
    return 0


def cmd_demo(args) -> int:
    """The main job: build, publish locally, fetch, register, run transformers, compile matrix."""
    from . import demo

    return demo.run(local_hub=args.local_hub, compile_matrix=not args.no_compile)


def cmd_bench(args) -> int:
    from .bench import runner

    families = tuple(args.families.split(",")) if args.families else runner.FAMILIES
    chips = tuple(args.chips.split(",")) if args.chips else runner.DEFAULT_CHIPS
    result = runner.run(families, bridge=not args.no_bridge, xla=not args.no_xla, paths=args.path or (), chips=chips,
                        workers=args.workers)
    return 0 if all(r.get("check", {}).get("ok", True) for r in result["rows"] if r["status"] == "ok") else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pallas-hub", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    def kernel_args(p):
        p.add_argument("kernels", nargs="*", help="kernel keys or Hub names from build.toml (default: all)")
        p.add_argument("--path", action="append", help="a kernel folder outside the manifest (repeatable)")

    p = sub.add_parser("build", help="build kernels into kernels/<name>/build/{torch-tpu,torch-universal}")
    kernel_args(p)
    p.set_defaults(fn=cmd_build)
    p = sub.add_parser("check", help="compile every declared configuration for each TPU generation")
    kernel_args(p)
    p.add_argument("--chips", help="comma-separated subset of v5e,v6e,tpu7x")
    p.set_defaults(fn=cmd_check)
    def hub_args(p, remote_help):
        p.add_argument("--local-hub", type=Path, help="the local hub folder (default: $PALLAS_HUB_LOCAL or "
                       "~/.cache/pallas-hub/hub)")
        p.add_argument("--hub", action="store_true", help=remote_help)
        p.add_argument("--endpoint", help="a Hub endpoint other than huggingface.co (implies --hub)")

    p = sub.add_parser("publish", help="build, then publish to the local hub (default) or the Hub (--hub)")
    kernel_args(p)
    hub_args(p, "upload to the Hugging Face Hub (repo type kernel; needs a write token)")
    p.add_argument("--private", action="store_true", default=None, help="create the Hub repository private")
    p.set_defaults(fn=cmd_publish)
    p = sub.add_parser("fetch", help="fetch and verify kernels through kernels.get_kernel, optionally lock them")
    p.add_argument("repos", nargs="*", help="repo ids org/name")
    p.add_argument("--version", type=int, help="the version (branch v<N>) to fetch")
    p.add_argument("--trust", action="append", help="a repo id you trust (repeatable); nothing is trusted by default")
    p.add_argument("--lock", help="a pallas-hub lock file: fetch exactly the commits and digests it pins")
    p.add_argument("--write-lock", help="write what was fetched to this lock file")
    hub_args(p, "fetch from the Hugging Face Hub instead of the local hub")
    p.set_defaults(fn=cmd_fetch)
    p = sub.add_parser("list", help="the manifest's kernels: built, published (local hub; --hub for the Hub), versions")
    hub_args(p, "also list the versions on the Hugging Face Hub")
    p.set_defaults(fn=cmd_list)
    p = sub.add_parser("bench", help="ours against the anchors as whole layers on real model shapes (TPU cost model), "
                                     "checks, bridge overhead; a subset run writes benchmarks/results/partial/ only")
    p.add_argument("--families", help="comma-separated subset of moe,prefill,decode")
    p.add_argument("--chips", help="comma-separated subset of v5e,v6e,tpu7x")
    p.add_argument("--workers", type=int, default=1, help="compile worker processes (default 1)")
    p.add_argument("--no-bridge", action="store_true", help="skip the bridge overhead measurement")
    p.add_argument("--no-xla", action="store_true", help="skip the XLA:TPU matmul comparison")
    p.add_argument("--path", action="append", help="one of our kernel folders to bench instead of the manifest's (repeatable)")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("demo", help="the main job (see README)")
    p.add_argument("--local-hub", type=Path, help="the local hub folder to publish to and fetch from")
    p.add_argument("--no-compile", action="store_true", help="skip the TPU compile matrix")
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (mf.ManifestError, FileNotFoundError) as e:
        print(f"pallas-hub: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        from .hub.fetch import HubError
        from .hub.register import RegistrationError

        if not isinstance(e, (HubError, RegistrationError)):
            raise
        print(f"pallas-hub: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
