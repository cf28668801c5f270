"""What a program's ``pallas_call``s are: grid, blocks, scalar prefetch, scratch (from its jaxpr).

The compile tier reports VMEM from it and the cost model walks the same structures.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
from jax.extend import core as jex_core


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


def block_dims(block_shape) -> tuple[int, ...]:
    dims = []
    for d in block_shape:
        size = getattr(d, "block_size", d)  # Element/Blocked wrappers, or plain ints
        dims.append(int(size) if isinstance(size, int) else 1)  # None and Squeezed: one element
    return tuple(dims)


def _memory_space_is_vmem(block) -> bool:
    space = getattr(block.transformed_block_aval, "memory_space", None)
    name = str(space).upper()  # pl.ANY / pltpu.HBM / pltpu.SMEM print in lower case ('any', 'hbm', 'smem')
    return space is None or "ANY" not in name and "HBM" not in name and "SMEM" not in name


def sub_jaxprs(value):
    if isinstance(value, jex_core.ClosedJaxpr):
        yield value.jaxpr
    elif isinstance(value, jex_core.Jaxpr):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from sub_jaxprs(v)


def walk(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in sub_jaxprs(value):
                yield from walk(sub)


def pallas_calls(fn: Callable, *args, **kwargs) -> list[PallasCall]:
    """Every pallas_call ``fn`` traces to (arguments may be ShapeDtypeStructs), in program order."""
    jaxpr = jax.make_jaxpr(functools.partial(fn, **kwargs))(*args).jaxpr
    calls = []
    for eqn in walk(jaxpr):
        if eqn.primitive.name != "pallas_call":
            continue
        gm = eqn.params["grid_mapping"]
        blocks = []
        for bm in gm.block_mappings:
            if not _memory_space_is_vmem(bm):
                continue  # HBM/ANY operands are moved by the kernel's own DMAs
            pm = getattr(bm, "pipeline_mode", None)
            blocks.append(
                Block(str(bm.origin), block_dims(bm.block_shape), tuple(bm.array_aval.shape),
                      str(bm.array_aval.dtype), bm.index_map_jaxpr, getattr(pm, "buffer_count", 2) if pm else 2)
            )
        scratch = sum(
            math.prod(a.shape) * a.dtype.itemsize
            for a in gm.scratch_avals
            if hasattr(a, "shape") and "SEMAPHORE" not in str(getattr(a, "memory_space", "")).upper()
            and "SMEM" not in str(getattr(a, "memory_space", "")).upper()
            and hasattr(a.dtype, "itemsize")  # DMA/regular semaphores (pltpu.SemaphoreType) hold no VMEM data
        )
        n_in = gm.num_inputs
        info = eqn.params.get("name_and_src_info") or eqn.params.get("name")  # older jax, jax 0.10
        calls.append(
            PallasCall(
                name=str(getattr(info, "name", info) or "pallas_call"),
                grid=tuple(g if isinstance(g, int) else -1 for g in gm.grid),  # -1: dynamic (traced) size
                num_scalar_prefetch=gm.num_index_operands,
                inputs=tuple(b for b in blocks if "output" not in b.origin.lower())[:n_in],
                outputs=tuple(b for b in blocks if "output" in b.origin.lower()),
                scratch_bytes=int(scratch),
                eqn=eqn,
            )
        )
    return calls


