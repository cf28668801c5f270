"""The compile tier: the real XLA:TPU + Mosaic compiler, ahead of time, on a machine without a TPU.

``compile_for_tpu(fn, *specs, chip=...)`` compiles on a libtpu compile-only topology and returns
success or the compiler's error, with HBM figures from XLA and the VMEM the kernel's blocks need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable

import jax

from ..vendored._chips import chip as get_chip
from .introspect import pallas_calls


# What libtpu prints on stderr when it starts on a host that is not a TPU VM: jax fills TPU_ACCELERATOR_TYPE and
# TPU_WORKER_HOSTNAMES with "WARNING: could not determine ..." texts, which libtpu then reports as errors
# (E0000 ... INVALID_ARGUMENT ... unexpected worker hostname), with a source trace. Harmless for compile-only use.
_LIBTPU_START_NOISE = re.compile(r"could not determine TPU|Logging before InitGoogle|Source Location Trace|"
                                 r"^\S+\.cc:\d+$")


@contextlib.contextmanager
def _without_libtpu_start_noise():
    """Capture stderr at the file-descriptor level (libtpu writes there from C++) and pass on every line
    but libtpu's start-up noise."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().decode(errors="replace").splitlines()
                    if line.strip() and not _LIBTPU_START_NOISE.search(line.strip())]
            if kept:
                print("\n".join(kept), file=sys.stderr)


@functools.lru_cache(maxsize=None)
def tpu_devices(topology: str) -> tuple[Any, ...]:
    """Devices of a libtpu compile-only topology (no TPU needed), e.g. "v6e:2x2", "v6e:2x4"."""
    from jax.experimental import topologies

    with _without_libtpu_start_noise():
        return tuple(topologies.get_topology_desc(topology_name=topology, platform="tpu").devices)


def tpu_mesh(axis_names: tuple[str, ...], shape: tuple[int, ...], topology: str) -> jax.sharding.Mesh:
    import numpy as np

    devices = tpu_devices(topology)
    n = math.prod(shape)
    if n > len(devices):
        raise ValueError(f"topology {topology} has {len(devices)} chips, mesh {shape} needs {n}")
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), axis_names)


@dataclasses.dataclass
class CompileResult:
    ok: bool
    chip: str
    topology: str
    error: str | None = None  # the compiler's message, first line
    seconds: float = 0.0
    hbm: dict[str, int] = dataclasses.field(default_factory=dict)  # from XLA's memory analysis
    vmem_bytes: int | None = None  # what the Pallas blocks + scratch need (largest call)
    vmem_capacity: int | None = None

    def summary(self) -> str:
        if not self.ok:
            return f"FAILED: {self.error}"
        parts = []
        if self.vmem_bytes is not None:
            parts.append(f"VMEM {self.vmem_bytes / 2**20:.2f}/{self.vmem_capacity / 2**20:.0f} MiB")
        if self.hbm:
            parts.append("HBM in {argument} out {output} temp {temp} MiB".format(
                **{k: f"{v / 2**20:.1f}" for k, v in self.hbm.items()}))
        return "compiled" + (" (" + ", ".join(parts) + ")" if parts else "")


def first_line(error: BaseException) -> str:
    for line in str(error).splitlines():
        line = line.strip()
        if line:
            return f"{type(error).__name__}: {line[:200]}"
    return type(error).__name__


def _place(spec, device):
    if isinstance(spec, jax.ShapeDtypeStruct) and spec.sharding is None:
        return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
    return spec


def compile_for_tpu(fn: Callable, *args, chip: str = "v6e", topology: str | None = None, **static) -> CompileResult:
    """Compile ``fn(*args, **static)`` for a TPU generation with XLA:TPU and Mosaic, ahead of time.

    ``args`` are ShapeDtypeStructs (pytrees allowed); those without a sharding are placed on the
    topology's first chip, so single-chip programs need nothing else. Sharded programs pass
    structs with shardings over ``tpu_mesh(..., topology)``. ``static`` are bound as constants.
    Never raises for a compiler error: the result says what failed.
    """
    spec = get_chip(chip)
    topology = topology or spec.topology
    result = CompileResult(ok=False, chip=spec.name, topology=topology, vmem_capacity=spec.vmem_bytes)
    start = time.perf_counter()
    try:
        device = tpu_devices(topology)[0]
        placed = jax.tree_util.tree_map(lambda s: _place(s, device), args)
        f = functools.partial(fn, **static)
        calls = pallas_calls(f, *args)
        if calls:
            result.vmem_bytes = max(c.vmem_bytes for c in calls)
    except Exception as e:  # tracing failed: not the compiler's verdict, so say so
        result.error = "tracing failed, " + first_line(e)
        result.seconds = time.perf_counter() - start
        return result
    try:
        compiled = jax.jit(f).trace(*placed).lower(lowering_platforms=("tpu",)).compile()
        mem = compiled.memory_analysis()
        if mem is not None:
            result.hbm = {
                "argument": mem.argument_size_in_bytes,
                "output": mem.output_size_in_bytes,
                "temp": mem.temp_size_in_bytes,
            }
        result.ok = True
    except Exception as e:  # the compiler's verdict is the result
        result.error = first_line(e)
    result.seconds = time.perf_counter() - start
    return result
