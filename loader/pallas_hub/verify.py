"""How TPU kernels are verified on a machine without a TPU (DESIGN.md, "Verifying TPU kernels").

* interpret tier: ``interpret("fast")`` runs every Pallas call as an XLA loop on CPU (about XLA
  speed, for broad sweeps); ``interpret("strict")`` runs the TPU simulator: uninitialised memory
  reads as NaN, out-of-bounds reads raise, and races are detected.
* compile tier: ``compile_for_tpu(fn, *specs, chip=...)`` runs the real XLA:TPU + Mosaic compiler
  ahead of time on a libtpu compile-only topology and returns success or the compiler's error,
  with HBM figures from XLA and the VMEM the kernel's blocks need.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import time
from typing import Any, Callable

# libtpu guards the TPU with a process-wide lock file; compile-only use needs no TPU, and tests run
# in several processes at once.
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from .chips import CHIPS, chip as get_chip  # noqa: E402


# --------------------------------------------------------------------------- interpret tier

def strict_params(*, detect_races: bool = True) -> pltpu.InterpretParams:
    return pltpu.InterpretParams(
        out_of_bounds_reads="raise", uninitialized_memory="nan", detect_races=detect_races
    )


@contextlib.contextmanager
def interpret(mode: str = "fast", *, detect_races: bool = True):
    """Run every Pallas TPU call traced inside in interpret mode ("fast" or "strict").

    Torch ops from our kernels honour this too: the bridge only forces the fast mode when no
    mode has been chosen. Races found in strict mode fail on exit.
    """
    if mode == "fast":
        params: Any = True
    elif mode == "strict":
        params = strict_params(detect_races=detect_races)
        pltpu.reset_tpu_interpret_mode_state()
    else:
        raise ValueError(f"interpret mode must be 'fast' or 'strict', got {mode!r}")
    with pltpu.force_tpu_interpret_mode(params):
        yield
    if mode == "strict" and detect_races:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

        if ipc.races is not None and ipc.races.races_found:
            raise AssertionError("the strict TPU interpreter detected a data race")


# --------------------------------------------------------------------------- pallas_call introspection

@dataclasses.dataclass(frozen=True)
class Block:
    origin: str
    block_shape: tuple[int, ...]
    array_shape: tuple[int, ...]
    dtype: str
    index_map_jaxpr: Any = dataclasses.field(repr=False, compare=False)
    buffers: int = 2  # Pallas double-buffers pipelined blocks

    @property
    def block_bytes(self) -> int:
        return math.prod(self.block_shape) * jax.numpy.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class PallasCall:
    name: str
    grid: tuple[int, ...]  # -1 marks a dynamic dimension (its size is a traced value)
    num_scalar_prefetch: int
    inputs: tuple[Block, ...]
    outputs: tuple[Block, ...]
    scratch_bytes: int
    eqn: Any = dataclasses.field(repr=False, compare=False)

    @property
    def vmem_bytes(self) -> int:
        """VMEM the pipeline needs: every (buffered) block plus the scratch buffers."""
        return sum(b.block_bytes * b.buffers for b in self.inputs + self.outputs) + self.scratch_bytes


def _block_dims(block_shape) -> tuple[int, ...]:
    dims = []
    for d in block_shape:
        size = getattr(d, "block_size", d)  # Element/Blocked wrappers, or plain ints
        dims.append(int(size) if isinstance(size, int) else 1)  # None and Squeezed: one element
    return tuple(dims)


def _memory_space_is_vmem(block) -> bool:
    space = getattr(block.transformed_block_aval, "memory_space", None)
    return space is None or "ANY" not in str(space) and "HBM" not in str(space) and "SMEM" not in str(space)


def _sub_jaxprs(value):
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _sub_jaxprs(v)


def _walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                yield from _walk(sub)


def pallas_calls(fn: Callable, *args, **kwargs) -> list[PallasCall]:
    """Every pallas_call ``fn`` traces to (arguments may be ShapeDtypeStructs), in program order."""
    jaxpr = jax.make_jaxpr(functools.partial(fn, **kwargs))(*args).jaxpr
    calls = []
    for eqn in _walk(jaxpr):
        if eqn.primitive.name != "pallas_call":
            continue
        gm = eqn.params["grid_mapping"]
        blocks = []
        for bm in gm.block_mappings:
            if not _memory_space_is_vmem(bm):
                continue  # HBM/ANY operands are moved by the kernel's own DMAs
            pm = getattr(bm, "pipeline_mode", None)
            blocks.append(
                Block(str(bm.origin), _block_dims(bm.block_shape), tuple(bm.array_aval.shape),
                      str(bm.array_aval.dtype), bm.index_map_jaxpr, getattr(pm, "buffer_count", 2) if pm else 2)
            )
        scratch = sum(
            math.prod(a.shape) * a.dtype.itemsize
            for a in gm.scratch_avals
            if hasattr(a, "shape") and "SEMAPHORE" not in str(getattr(a, "memory_space", ""))
            and "SMEM" not in str(getattr(a, "memory_space", ""))
        )
        n_in = gm.num_inputs
        info = eqn.params.get("name_and_src_info")
        calls.append(
            PallasCall(
                name=str(getattr(info, "name", "pallas_call")),
                grid=tuple(g if isinstance(g, int) else -1 for g in gm.grid),  # -1: dynamic (traced) size
                num_scalar_prefetch=gm.num_index_operands,
                inputs=tuple(b for b in blocks if "output" not in b.origin.lower())[:n_in],
                outputs=tuple(b for b in blocks if "output" in b.origin.lower()),
                scratch_bytes=int(scratch),
                eqn=eqn,
            )
        )
    return calls


# --------------------------------------------------------------------------- compile tier

@functools.lru_cache(maxsize=None)
def tpu_devices(topology: str) -> tuple[Any, ...]:
    """Devices of a libtpu compile-only topology (no TPU needed), e.g. "v6e:2x2", "v6e:2x4"."""
    from jax.experimental import topologies

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


__all__ = [
    "CHIPS", "CompileResult", "PallasCall", "compile_for_tpu", "interpret", "pallas_calls",
    "strict_params", "tpu_devices", "tpu_mesh",
]
