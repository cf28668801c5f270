"""Validation of the per-step model on plain bf16 matmuls, on every chip.

Per shape and chip: XLA:TPU's ``cost_analysis()`` of ``jnp.dot`` compiled for the chip
(``optimal_seconds``: its own roofline estimate), beside the v2 model of jax's Pallas TPU matmul
(512 x 512 x 512 blocks: counts from ``costmodel.estimate``, schedule from the compiled kernel) and
the v1 whole-call model it replaces; and, where libtpu can make one, libtpu's own static estimate
of the same Pallas kernel (``--xla_jf_dump_static_llo_profile_to``: it runs the kernel's scalar
program over its schedule). That flag changes ``cost_analysis()`` and crashes the TPU7x compiler
on loops, so it is used only in these separate validation compiles, never in the benchmark's.
"""

from __future__ import annotations

import functools
import time

from .. import verify  # noqa: F401
from . import compiled, costmodel, stepmodel

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

SHAPES = ((1024, 1024, 1024), (2048, 2048, 1536), (8192, 2048, 1536))
BLOCK = (512, 512, 512)


def _matmul(m, k, n, bm, bk, bn):
    from jax.experimental.pallas.ops.tpu import matmul as pallas_matmul

    fn = functools.partial(pallas_matmul.matmul, block_shape=(bm, bn), block_k=bk)
    args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((k, n), jnp.bfloat16))
    return fn, args


def compile_target(recipe, device):
    """The compile worker's program for a validation job: ("matmul", m, k, n, bm, bk, bn)."""
    fn, args = _matmul(*recipe[1:])
    sh = jax.sharding.SingleDeviceSharding(device)
    return fn, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args), ()


def _digest() -> str:
    import hashlib
    from pathlib import Path

    return hashlib.sha256(Path(__file__).read_bytes() + jax.__version__.encode()).hexdigest()[:16]


def xla_matmuls(shapes=SHAPES, chips=("v5e", "v6e", "tpu7x"), block=BLOCK, progress=print, workers: int = 1) -> list[dict]:
    from ..verify import tpu_devices
    from ..vendored._chips import chip as get_chip

    jobs = {}
    for m, k, n in shapes:
        for c in chips:
            recipe = ("matmul", m, k, n, *block)
            jobs[(m, k, n, c, False)] = compiled.Job("validate: pallas matmul", recipe, c, (), _digest())
            if c != "tpu7x":
                jobs[(m, k, n, c, True)] = compiled.Job("validate: pallas matmul", recipe, c, (), _digest(),
                                                        static_profile=True)
    profiles = compiled.profiles(list(jobs.values()), progress=progress, workers=workers)
    rows = []
    for m, k, n in shapes:
        fn, args = _matmul(m, k, n, *block)
        cost = costmodel.estimate(fn, *args)
        min_bytes, min_flops = 2 * (m * k + k * n + m * n), 2 * m * k * n
        for c in chips:
            start = time.perf_counter()
            row = {"m": m, "k": k, "n": n, "chip": c, "pallas_block": list(block), "model_flops": cost.flops,
                   "model_bytes": cost.hbm_bytes, "v1_s": cost.time(c), "min_bytes": min_bytes, "min_flops": min_flops,
                   "ideal_s": costmodel.ideal_time(min_bytes, min_flops, c)}
            dev = tpu_devices(get_chip(c).topology)[0]
            sh = jax.sharding.SingleDeviceSharding(dev)
            placed = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args)
            ca = jax.jit(jnp.dot).trace(*placed).lower(lowering_platforms=("tpu",)).compile().cost_analysis()
            ca = ca[0] if isinstance(ca, list) else ca
            row.update(xla_flops=float(ca["flops"]), xla_bytes=float(ca["bytes accessed"]),
                       xla_optimal_s=float(ca["optimal_seconds"]))
            prof = profiles.get(jobs[(m, k, n, c, False)].key, {})
            if "error" in prof or not prof:
                row["error"] = prof.get("error", "not compiled")
                rows.append(row)
                continue
            (call, op), = stepmodel.match_calls(list(cost.calls), dict(prof, ops=compiled.ops(prof)))
            ct = stepmodel.call_time(call, op["program"], c)
            for o in stepmodel.OVERHEADS:
                row[f"v2_s_{o * 1e6:g}us"] = ct.seconds(o)
            static = profiles.get(jobs[(m, k, n, c, True)].key, {}) if (m, k, n, c, True) in jobs else {}
            cycles = (static.get("static_cycles") or {}).get(op["name"])
            if cycles:
                row["static_profile_s"] = cycles / get_chip(c).clock_hz
            else:
                row["static_profile_note"] = "crashes on TPU7x" if c == "tpu7x" else static.get("error", "none")
            rows.append(row)
            progress(f"  {m}x{k}x{n} {c}: XLA optimal {row['xla_optimal_s'] * 1e6:.1f} us; v2 {row['v2_s_0us'] * 1e6:.1f} us "
                     f"at 0 us/step, {row['v2_s_0.35us'] * 1e6:.1f} at 0.35; v1 {row['v1_s'] * 1e6:.1f}; libtpu static "
                     f"{row.get('static_profile_s', 0) * 1e6:.1f} us  [{time.perf_counter() - start:.1f}s]")
    return rows
