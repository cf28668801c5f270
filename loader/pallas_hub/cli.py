"""pallas-hub: build, check and (as the loader grows) publish, fetch and register Pallas TPU kernels."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from . import manifest as mf

FIXTURE = mf.ROOT / "tests" / "fixtures" / "scale_add"


def _specs(args) -> list[mf.KernelSpec]:
    if getattr(args, "path", None):
        return [mf.load_kernel(Path(p)) for p in args.path]
    return mf.load_manifest().select(args.kernels)


def cmd_build(args) -> int:
    from .build import build_kernel

    for spec in _specs(args):
        out = build_kernel(spec)
        print(f"built {spec.name} v{spec.version} -> {out}")
    return 0


def check(specs: list[mf.KernelSpec], chips: tuple[str, ...] | None = None) -> list:
    """Compile every declared configuration of ``specs`` for every chip; returns the rows."""
    from . import matrix
    from .build import build_kernel, load_built

    rows = []
    with tempfile.TemporaryDirectory(prefix="pallas-hub-check-") as tmp:
        for spec in specs:
            matrix_file = spec.path / "compile_matrix.py"
            if not matrix_file.exists():
                print(f"{spec.name}: no compile_matrix.py, nothing declared")
                continue
            kernel = load_built(build_kernel(spec, Path(tmp) / spec.key))
            rows += matrix.run(spec.name, matrix.load_configs(matrix_file, kernel), chips)
    return rows


def report(rows) -> int:
    bad = [r for r in rows if not r.as_expected]
    ok = sum(r.result.ok for r in rows)
    print(f"\ncompile matrix: {len(rows)} configurations x chips, {ok} compiled, "
          f"{len(rows) - ok} failed, {len(bad)} not as declared")
    for r in bad:
        print("  NOT AS DECLARED:", r.line())
    return 1 if bad else 0


def cmd_check(args) -> int:
    chips = tuple(args.chips.split(",")) if args.chips else None
    specs = _specs(args)
    if not specs:
        print("the manifest declares no kernels yet; checking the fixture kernel")
        specs = [mf.load_kernel(FIXTURE)]
    return report(check(specs, chips))


def cmd_demo(args) -> int:
    """The main job. Until the loader lands it is the TPU compile report of every kernel."""
    print("== TPU compile matrix (libtpu compile-only topologies, no TPU needed)")
    return cmd_check(argparse.Namespace(kernels=None, path=None, chips=None))


def cmd_bench(args) -> int:
    from . import bench

    families = tuple(args.families.split(",")) if args.families else ("moe", "prefill", "decode")
    result = bench.run(families, bridge=not args.no_bridge, xla=not args.no_xla, paths=args.path or ())
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
    p = sub.add_parser("bench", help="ours beside the anchors on real model shapes (TPU cost model), checks, bridge overhead")
    p.add_argument("--families", help="comma-separated subset of moe,prefill,decode")
    p.add_argument("--no-bridge", action="store_true", help="skip the bridge overhead measurement")
    p.add_argument("--no-xla", action="store_true", help="skip the XLA:TPU matmul comparison")
    p.add_argument("--path", action="append", help="one of our kernel folders to bench instead of the manifest's (repeatable)")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("demo", help="the main job (see README)")
    p.set_defaults(fn=cmd_demo)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except mf.ManifestError as e:
        print(f"pallas-hub: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
