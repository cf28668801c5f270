"""Bridge overhead, measured on this machine: a torch custom op through the bridge (``pallas_hub.vendored._bridge``) against
the same jitted JAX function called on JAX arrays.

Per shape and dtype: ``calls`` timed calls after a warm-up, median and p90 in microseconds, the
overhead (bridge median - raw median), and whether the input reaches JAX without a copy. Then the
number of XLA compilations across a loop of changing token counts (one per new shape is the most
there should be; repeats must hit the cache).

    python -m pallas_hub.bench.bridge_overhead [--calls 1000] [--json out.json]

This is CPU dispatch cost (the CPU path of the bridge); on TorchTPU the op is torch_tpu's jax_op.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from ..vendored._bridge import jax_op, to_jax  # (importing pallas_hub.bench keeps JAX on the CPU)
from .timing import percentile

import jax  # noqa: E402
import torch  # noqa: E402

TARGET_OVERHEAD_US = 30.0
SHAPES = ((8, 128), (1024, 1024))
DTYPES = ("bfloat16", "float32")
TOKEN_COUNTS = (1, 7, 8, 64, 1, 7, 8, 64, 300, 1)


def scale_shift(x: jax.Array) -> jax.Array:
    return x * 2 + 1


_OP = None


def _op():
    global _OP
    if _OP is None:
        _OP = jax_op("pallas_hub_bench::scale_shift", scale_shift, fake=lambda x: torch.empty_like(x))
    return _OP


def _time_us(call, calls: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        call()
    out = []
    for _ in range(calls):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1e6)
    return out


class _CompileCounter:
    def __init__(self):
        self.count = 0

    def __call__(self, event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        from jax._src import monitoring

        monitoring.unregister_event_duration_listener(self)


def run(calls: int = 1000, warmup: int = 100, progress=print) -> dict:
    op = _op()
    raw = jax.jit(scale_shift)
    rows = []
    for shape in SHAPES:
        for dtype in DTYPES:
            t = torch.randn(shape, dtype=getattr(torch, dtype))
            x = jax.device_put(to_jax(t))  # as jit places the argument
            zero_copy = x.unsafe_buffer_pointer() == t.data_ptr()
            expect = (t.float() * 2 + 1).to(t.dtype)
            if not torch.equal(op(t), expect):
                raise AssertionError(f"bridged op gave a wrong result for {shape} {dtype}")
            raw_us = _time_us(lambda: raw(x).block_until_ready(), calls, warmup)
            bridge_us = _time_us(lambda: op(t), calls, warmup)  # DLPack export waits for the result
            row = {
                "shape": list(shape), "dtype": dtype, "calls": calls,
                "raw_jax_median_us": statistics.median(raw_us), "raw_jax_p90_us": percentile(raw_us, 90),
                "bridge_median_us": statistics.median(bridge_us), "bridge_p90_us": percentile(bridge_us, 90),
                "input_zero_copy": bool(zero_copy),
            }
            row["overhead_median_us"] = row["bridge_median_us"] - row["raw_jax_median_us"]
            row["within_target"] = row["overhead_median_us"] <= TARGET_OVERHEAD_US
            rows.append(row)
            progress(f"  bridge {shape} {dtype}: raw {row['raw_jax_median_us']:.1f} us, bridge "
                     f"{row['bridge_median_us']:.1f} us (p90 {row['bridge_p90_us']:.1f}), overhead "
                     f"{row['overhead_median_us']:.1f} us, zero-copy input: {zero_copy}")
    breakdown = _breakdown(calls, warmup)
    progress("  bridge overhead breakdown (8,128) f32, median us: " +
             ", ".join(f"{k} {v:.1f}" for k, v in breakdown.items()))
    with _CompileCounter() as counter:
        for n in TOKEN_COUNTS:
            op(torch.randn(n, 128, dtype=torch.bfloat16) + 0.5)  # fresh token counts, new shapes
    # the (8,128) and (1024,1024) shapes above were compiled already; these shapes are new except 8
    new_shapes = len({n for n in TOKEN_COUNTS} - {8})
    compiles = {"token_counts": list(TOKEN_COUNTS), "distinct_new_shapes": new_shapes,
                "xla_compilations": counter.count}
    progress(f"  bridge compilations over token counts {TOKEN_COUNTS}: {counter.count} "
             f"for {new_shapes} new shapes")
    return {"target_overhead_us": TARGET_OVERHEAD_US, "rows": rows, "compilations": compiles,
            "breakdown_us": breakdown,
            "machine": _machine()}


def _breakdown(calls: int, warmup: int) -> dict:
    """Where the bridge's time goes, piece by piece, on a small tensor."""
    from ..vendored._bridge import _interpret_mode, to_torch

    t = torch.randn(8, 128)
    x = jax.device_put(to_jax(t))
    raw = jax.jit(scale_shift)
    y = raw(x).block_until_ready()
    noop = torch.library.custom_op("pallas_hub_bench::noop", lambda a: a.clone(), mutates_args=(),
                                   schema="(Tensor a) -> Tensor")

    def in_interpret_mode():
        with _interpret_mode():
            raw(x).block_until_ready()

    med = lambda f: statistics.median(_time_us(f, calls, warmup))  # noqa: E731
    return {
        "torch custom-op dispatch (no-op op)": med(lambda: noop(t)) - med(lambda: t.clone()),
        "torch->jax view (NumPy, zero-copy)": med(lambda: to_jax(t)),
        "jit call on a JAX array": med(lambda: raw(x).block_until_ready()),
        "jit call inside the interpret-mode context": med(in_interpret_mode),
        "view + jit call on it": med(lambda: raw(to_jax(t)).block_until_ready()),
        "jit call + DLPack export of its fresh output": med(lambda: to_torch([raw(x)], [t])),
        "jax->torch DLPack export of a ready array": med(lambda: to_torch([y], [t])),
    }


def _machine() -> str:
    import os
    import platform

    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    result = run(args.calls, args.warmup)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
