"""Wall-clock timing with device synchronisation: the real-TPU path of ``pallas-hub bench``.

On a TPU host the benchmark runner times kernels with warm-up, N timed runs and a device
synchronisation after every run (median and percentiles). Everywhere else this module still runs,
with any callable as device work and any clock, which is how it is tested here. Nothing measured on
CPU says anything about TPU speed.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import statistics
import time
from typing import Any, Callable

from ..vendored._bridge import synchronize


@dataclasses.dataclass(frozen=True)
class Timing:
    median_s: float
    p10_s: float
    p90_s: float
    runs: int
    warmup: int
    device: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def measure(fn: Callable[..., Any], *args, warmup: int = 5, runs: int = 50, device: str = "tpu",
            sync: Callable[..., None] = synchronize, clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Time ``fn(*args)``: ``warmup`` untimed runs, then ``runs`` timed runs, each ending with ``sync(out)``."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    for _ in range(warmup):
        sync(fn(*args))
    times = []
    for _ in range(runs):
        start = clock()
        sync(fn(*args))
        times.append(clock() - start)
    return Timing(statistics.median(times), percentile(times, 10), percentile(times, 90), runs, warmup, device)


def tpu_host() -> bool:
    """True on a machine with TPU chips (their device files), without initialising any runtime."""
    if os.environ.get("PALLAS_HUB_TPU", "").lower() in ("0", "false", "no"):
        return False
    return bool(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))
