"""TPU cost model: what a Pallas TPU kernel moves and computes, for concrete inputs, without a TPU.

``estimate(fn, *args, **static)`` traces ``fn`` and evaluates the program up to every ``pallas_call``,
so each call's concrete operands (scalar-prefetch values included) are known. Bulk data may be
passed as ShapeDtypeStructs, and kernel outputs are never computed. For each call one compiled scan
walks the grid in Pallas pipeline order (row-major, last axis fastest) and

* evaluates every BlockSpec index map: a pipelined block moves HBM->VMEM only when its block index
  differs from the previous step's; an output block is written back when its index changes and at
  the end. Each move is the whole block (Pallas DMAs padded edge blocks whole);
* evaluates the kernel body's scalar control flow (program ids, SMEM/scalar-prefetch reads and
  writes, ``pl.when``/``lax.cond``, ``fori_loop``/``while``) on the concrete values, and counts each
  executed ``dot_general`` (MXU flops: 2 x output elements x contraction size) and each executed
  ``make_async_copy(...).start()`` (manual DMAs, with run-time sizes where the kernel computes
  them: HBM->VMEM reads, VMEM->HBM writes; remote copies apart). So skipped steps, ``pl.when``
  guarded dots, ``emit_pipeline`` (tokamax) and paged attention's page copies count as executed.
  Vector data never steers the count: a branch on vector data counts its most expensive side (an
  upper bound), and loop outputs that are vector data stay unknown.

Time per call = max(HBM bytes / bandwidth, flops / bf16 peak) + steps x per-step overhead
(``pallas_hub.vendored._chips``); steps are the grid's plus every iteration of an innermost kernel loop
that starts DMAs and waits for them (a software pipeline's steps). A function's time is the sum over
its calls. Not modelled: XLA work outside the kernels, megacore splitting of "parallel" axes, f32 MXU
passes (all flops at the bf16 peak), and inefficiency inside a step. A model, never a measured TPU time.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable

from ..verify import introspect  # importing pallas_hub.verify first keeps JAX on the CPU
from ..vendored._chips import chip as get_chip

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.extend import core as jex_core  # noqa: E402


class CostModelError(RuntimeError):
    """The kernel does something the model cannot follow (e.g. a loop bound read from vector data)."""


# --------------------------------------------------------------------------- results

@dataclasses.dataclass(frozen=True)
class OperandTraffic:
    origin: str
    kind: str  # "input", "output", "scalar_prefetch", "smem"
    block_bytes: int
    moves: int  # block transfers over the whole grid

    @property
    def bytes(self) -> int:
        return self.block_bytes * self.moves


@dataclasses.dataclass(frozen=True)
class LoopInfo:
    """A loop (scan / while) of a kernel body, in program order; ``parent`` indexes its enclosing loop."""
    parent: int | None  # None: directly in the grid step
    static_trips: int | None  # a scan's length; None for a while loop
    pipeline: bool  # starts and waits for DMAs and holds no such loop: each iteration is a DMA-loop step


@dataclasses.dataclass(frozen=True)
class StepType:
    """Grid steps that move and compute exactly the same: ``count`` of them.

    Per level (0: the grid step's own body; i + 1: loop i of ``CallCost.loops``): the MXU flops
    executed and the bytes the kernel's own DMAs read and write there; ``iterations[i]``: how often
    loop i ran in the step. ``read_bytes``/``write_bytes``: the pipelined blocks moved for the step.
    """
    count: int
    read_bytes: int
    write_bytes: int
    flops: tuple[int, ...]
    dma_read: tuple[int, ...]
    dma_write: tuple[int, ...]
    iterations: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class CallCost:
    name: str
    grid: tuple[int, ...]
    operands: tuple[OperandTraffic, ...]
    dma_read_bytes: int  # manual copies HBM -> VMEM/SMEM issued by the kernel
    dma_write_bytes: int  # manual copies VMEM/SMEM -> HBM
    remote_bytes: int  # copies to other chips (ICI), not part of the HBM time
    flops: int
    pipeline_steps: int = 0  # iterations of the kernel's own DMA loops (emit_pipeline, paged attention)
    declared: dict | None = None  # the kernel author's pl.CostEstimate (flops, bytes_accessed), if any
    loops: tuple[LoopInfo, ...] = ()
    step_types: tuple[StepType, ...] = ()
    level_flops: tuple[int, ...] = ()  # per level: flops of all its dots, once each (one iteration, all executed)
    dynamic_grid: bool = False  # the grid's size is a run-time value (its compiled loop has no static trip count)

    @property
    def grid_steps(self) -> int:
        """Pipeline steps that each pay the per-step overhead: the grid's, plus the kernel's own."""
        return math.prod(self.grid) + self.pipeline_steps

    @property
    def hbm_read_bytes(self) -> int:
        return self.dma_read_bytes + sum(o.bytes for o in self.operands if o.kind != "output")

    @property
    def hbm_write_bytes(self) -> int:
        return self.dma_write_bytes + sum(o.bytes for o in self.operands if o.kind == "output")

    @property
    def hbm_bytes(self) -> int:
        return self.hbm_read_bytes + self.hbm_write_bytes

    def time(self, chip: str) -> float:
        c = get_chip(chip)
        return max(self.hbm_bytes / c.hbm_bandwidth, self.flops / c.peak_flops) + self.grid_steps * c.step_overhead_s

    def bound(self, chip: str) -> str:
        c = get_chip(chip)
        return "memory" if self.hbm_bytes / c.hbm_bandwidth >= self.flops / c.peak_flops else "compute"


@dataclasses.dataclass(frozen=True)
class Cost:
    calls: tuple[CallCost, ...]

    hbm_read_bytes = property(lambda self: sum(c.hbm_read_bytes for c in self.calls))
    hbm_write_bytes = property(lambda self: sum(c.hbm_write_bytes for c in self.calls))
    hbm_bytes = property(lambda self: sum(c.hbm_bytes for c in self.calls))
    flops = property(lambda self: sum(c.flops for c in self.calls))
    grid_steps = property(lambda self: sum(c.grid_steps for c in self.calls))

    def time(self, chip: str) -> float:
        """Modelled seconds on one chip of generation ``chip`` (the calls run one after another)."""
        return sum(c.time(chip) for c in self.calls)

    def to_dict(self, chips=("v5e", "v6e", "tpu7x")) -> dict:
        return {
            "hbm_read_bytes": self.hbm_read_bytes, "hbm_write_bytes": self.hbm_write_bytes,
            "flops": self.flops, "grid_steps": self.grid_steps,
            "modelled_seconds": {c: self.time(c) for c in chips},
            "calls": [{"name": c.name, "grid": list(c.grid), "hbm_read_bytes": c.hbm_read_bytes,
                       "hbm_write_bytes": c.hbm_write_bytes, "flops": c.flops,
                       "dma_read_bytes": c.dma_read_bytes, "dma_write_bytes": c.dma_write_bytes,
                       "pipeline_steps": c.pipeline_steps, "declared": c.declared}
                      for c in self.calls],
        }


def ideal_time(min_bytes: float, min_flops: float, chip: str) -> float:
    c = get_chip(chip)
    return max(min_bytes / c.hbm_bandwidth, min_flops / c.peak_flops)


def roofline_fraction(cost: Cost, min_bytes: float, min_flops: float, chip: str) -> float:
    """ideal time of the problem (its minimum bytes and flops at the chip's roofline) / modelled time."""
    return ideal_time(min_bytes, min_flops, chip) / cost.time(chip)


# --------------------------------------------------------------------------- capturing the calls

def capture(fn: Callable, *args, **static) -> list[tuple[tuple, dict, str]]:
    """Trace ``fn`` and return (concrete operands, params, innermost name scope) of every pallas_call it makes,
    in order.

    The traced program is evaluated eagerly up to each pallas_call (calls such as jit and
    custom_vjp that contain kernels are inlined, a cond around a kernel takes its concrete branch).
    Arguments given as ShapeDtypeStructs, kernel outputs and everything computed from them stay
    abstract (never computed), so only what steers the kernels (group sizes, lengths, page
    tables) costs anything, at any problem size.
    """
    closed = jax.make_jaxpr(functools.partial(fn, **static))(*args)
    records: list[tuple[tuple, dict, str]] = []
    _eval_outer(closed.jaxpr, closed.consts, jax.tree_util.tree_leaves(args), records)
    return records


def _has_pallas_call(jaxpr) -> bool:
    return any(e.primitive.name == "pallas_call" for e in introspect.walk(jaxpr))


def _eval_outer(jaxpr, consts, args, records):
    env = dict(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    read = lambda v: v.val if isinstance(v, jex_core.Literal) else env[v]  # noqa: E731
    abstract = lambda e: [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in e.outvars]  # noqa: E731
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        subs = [v for v in eqn.params.values() if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr))]
        if name == "pallas_call":
            records.append((tuple(ins), dict(eqn.params), str(eqn.source_info.name_stack).rsplit("/", 1)[-1]))
            outs = abstract(eqn)  # nothing is computed
        elif not any(_has_pallas_call(j) for v in eqn.params.values() for j in introspect.sub_jaxprs(v)):
            if any(isinstance(x, jax.ShapeDtypeStruct) for x in ins):
                outs = abstract(eqn)  # data the kernels' control never sees stays abstract
            else:
                outs = eqn.primitive.bind(*ins, **eqn.params)
                outs = list(outs) if eqn.primitive.multiple_results else [outs]
        elif name == "cond":
            branch = eqn.params["branches"][int(np.clip(int(ins[0]), 0, len(eqn.params["branches"]) - 1))]
            outs = _eval_outer(branch.jaxpr, branch.consts, ins[1:], records)
        elif len(subs) == 1 and len(_jaxpr_of(subs[0]).invars) == len(ins):  # jit, custom_vjp/jvp, remat...
            outs = _eval_outer(_jaxpr_of(subs[0]), _consts_of(subs[0]), ins, records)
        else:
            raise CostModelError(f"a pallas_call inside {name!r} cannot be modelled (only jit-like calls and cond)")
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jex_core.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def estimate(fn: Callable, *args, **static) -> Cost:
    """Model the HBM traffic, MXU flops and grid steps of every pallas_call ``fn(*args, **static)`` runs.

    ``args`` are arrays or ShapeDtypeStructs: what steers the kernels (group sizes, sequence
    lengths, page tables: whatever reaches scalar prefetch or SMEM) must be concrete, the bulk
    data (activations, weights, KV caches) may be abstract, so real model sizes cost no memory.
    Raises ValueError if ``fn`` makes no pallas_call, CostModelError if a steering value is abstract.
    """
    records = capture(fn, *args, **static)
    if not records:
        raise ValueError("estimate: fn made no pallas_call, so there is no kernel to model")
    return Cost(tuple(_call_cost(ops, params, scope) for ops, params, scope in records))


# --------------------------------------------------------------------------- one call

def _space(aval) -> str:
    aval = getattr(aval, "ref", aval)  # TransformedRef -> its AbstractRef
    s = str(getattr(aval, "memory_space", None)).lower()
    if "smem" in s:
        return "smem"
    if "semaphore" in s:
        return "sem"
    if "any" in s or "hbm" in s:
        return "hbm"
    return "vmem"  # None / "default" / vmem: pipelined blocks and VMEM scratch


def _steering(value) -> bool:
    """A concrete small integer array: values that may steer a kernel once copied into SMEM."""
    return (not isinstance(value, jax.ShapeDtypeStruct) and jnp.issubdtype(value.dtype, jnp.integer)
            and math.prod(value.shape) <= 1 << 20)


def _nbytes(shape, dtype) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def _call_cost(operands: tuple, params: dict, scope: str = "") -> CallCost:
    """One call's counts; its name is the kernel's, or for an unnamed kernel the name scope around it, as XLA
    names the compiled kernel (jax's flash attention backward: ``flash_mha_bwd_dq_block_q_major=128...``)."""
    gm = params["grid_mapping"]
    kernel = params["jaxpr"]
    n_dyn = sum(1 for g in gm.grid if not isinstance(g, (int, np.integer)))
    n_idx, n_in = gm.num_index_operands, gm.num_inputs
    for i, v in enumerate(operands[:n_dyn + n_idx]):
        if isinstance(v, jax.ShapeDtypeStruct):
            what = "a dynamic grid size" if i < n_dyn else f"scalar-prefetch operand {i - n_dyn}"
            raise CostModelError(f"{what} of a pallas_call is abstract: pass the arrays it is computed from "
                                 f"as concrete values (it may come from another kernel's output, which is never computed)")
    dyn = iter(int(np.asarray(v)) for v in operands[:n_dyn])
    grid = tuple(int(g) if isinstance(g, (int, np.integer)) else next(dyn) for g in gm.grid)
    operands = operands[n_dyn:]
    prefetch = [jnp.asarray(v) for v in operands[:n_idx]]
    inputs = operands[n_idx:n_idx + n_in]

    # program_id/num_programs in the body count only the user's axes, not those vmap added
    user_axes = [a for a in range(len(grid)) if a not in set(gm.vmapped_dims)]
    body = _Body(kernel, grid, user_axes)
    # Kernel refs: *scalar_prefetch, *inputs, *outputs, *scratch. SMEM ones carry concrete values.
    invars = kernel.invars
    refs: list[Any] = []
    for i, v in enumerate(invars):
        if i < n_idx:
            refs.append(body.tracked_ref(v.aval, prefetch[i]))
        elif i < n_idx + n_in and _space(v.aval) == "smem":
            value = inputs[i - n_idx]
            if isinstance(value, jax.ShapeDtypeStruct) or tuple(v.aval.shape) != tuple(value.shape):
                raise CostModelError(f"SMEM input {i - n_idx} of a pallas_call steers the kernel but is abstract "
                                     f"or blocked: pass the arrays it is computed from as concrete values")
            refs.append(body.tracked_ref(v.aval, jnp.asarray(value)))
        elif _space(v.aval) == "smem":
            refs.append(body.tracked_ref(v.aval, jnp.zeros(v.aval.shape, v.aval.dtype)))
        elif i < n_idx + n_in and _space(v.aval) == "hbm" and _steering(inputs[i - n_idx]):
            # a small integer array left in HBM (e.g. a page table): the kernel may DMA it into SMEM
            refs.append(body.tracked_ref(v.aval, jnp.asarray(inputs[i - n_idx])))
        else:
            refs.append(_Ref(v.aval))

    pipelined = [(k, bm) for k, bm in enumerate(gm.block_mappings) if _space(bm.transformed_block_aval) == "vmem"]
    index_fns = [jex_core.jaxpr_as_fun(_discharged(bm.index_map_jaxpr)) for _, bm in pipelined]
    n_steps = math.prod(grid)
    strides = [math.prod(grid[a + 1:]) for a in range(len(grid))]
    init_state = dict(body.initial_state)
    prefetch_keys = [refs[i].key for i in range(n_idx)]

    def step(state, t):
        idx = tuple((t // s) % g for s, g in zip(strides, grid))
        pf = [state[k] for k in prefetch_keys]
        blocks = [jnp.stack([jnp.asarray(x, jnp.int32) for x in f(*idx, *pf)[:len(bm.block_shape)]])
                  if len(bm.block_shape) else jnp.zeros((0,), jnp.int32)
                  for f, (_, bm) in zip(index_fns, pipelined)]
        counts = body.run_step(idx, state, refs)
        return body.state, (counts, blocks)

    _, (counts, blocks) = jax.jit(lambda s: lax.scan(step, s, jnp.arange(n_steps, dtype=jnp.int32)))(init_state)
    counts = np.rint(np.asarray(counts, dtype=np.float64)).astype(np.int64) if body.sites \
        else np.zeros((n_steps, 0), np.int64)  # [step, site]: executions (dynamic copies: bytes)

    traffic = []
    read_at = np.zeros(n_steps, np.int64)  # pipelined block bytes moved for each step
    write_at = np.zeros(n_steps, np.int64)
    for (k, bm), b in zip(pipelined, blocks):
        b = np.asarray(b)
        changed = np.concatenate([[True], np.any(b[1:] != b[:-1], axis=1)]) if n_steps else np.zeros(0, bool)
        kind = "output" if k >= n_in else "input"
        block_bytes = _nbytes(introspect.block_dims(bm.block_shape), bm.array_aval.dtype)
        traffic.append(OperandTraffic(str(bm.origin), kind, block_bytes, int(changed.sum())))
        if kind == "input":
            read_at += block_bytes * changed
        elif n_steps:  # an output block is written back when the next step moves on, and at the end
            write_at[1:] += block_bytes * changed[1:]
            write_at[-1] += block_bytes
    for i, v in enumerate(prefetch):
        traffic.append(OperandTraffic(f"scalar_prefetch[{i}]", "scalar_prefetch", int(v.size * v.dtype.itemsize), 1))
    for k, bm in enumerate(gm.block_mappings):
        if _space(bm.transformed_block_aval) == "smem":
            traffic.append(OperandTraffic(str(bm.origin), "smem" if k < n_in else "output",
                                          _nbytes(bm.array_aval.shape, bm.array_aval.dtype), 1))

    totals = counts.sum(axis=0)
    flops = dma_r = dma_w = remote = inner = 0
    for site, n in zip(body.sites, totals):
        n = int(n)
        flops += site.flops * n
        dma_r += site.read_bytes * n
        dma_w += site.write_bytes * n
        remote += site.remote_bytes * n
        inner += site.steps * n
    info = params.get("name_and_src_info") or params.get("name")
    name = str(getattr(info, "name", info) or re.sub(r"[^\w.-]", "_", scope) or "pallas_call")
    ce = params.get("cost_estimate")
    declared = {"flops": int(ce.flops), "bytes_accessed": int(ce.bytes_accessed)} if ce is not None else None
    levels = len(body.loops) + 1
    level_flops = [0] * levels
    for site in body.sites:
        level_flops[site.level] += site.flops
    return CallCost(name, grid, tuple(traffic), dma_r, dma_w, remote, flops, inner, declared, tuple(body.loops),
                    _step_types(body, counts, read_at, write_at, levels), tuple(level_flops), n_dyn > 0)


def _step_types(body, counts, read_at, write_at, levels) -> tuple[StepType, ...]:
    """Group the grid steps by what they move and compute (per level) and how often loops ran."""
    per_level = lambda attr: np.stack(  # noqa: E731  [step, level]
        [counts @ np.array([getattr(s, attr) if s.level == lv else 0 for s in body.sites], np.int64)
         for lv in range(levels)], axis=1) if body.sites else np.zeros((len(read_at), levels), np.int64)
    loop_sites = [body.loop_index_of(i) for i in range(len(body.loops))]
    iters = counts[:, loop_sites] if loop_sites else np.zeros((len(read_at), 0), np.int64)
    table = np.concatenate([read_at[:, None], write_at[:, None], per_level("flops"), per_level("read_bytes"),
                            per_level("write_bytes"), iters], axis=1)
    if not len(table):
        return ()
    rows, n = np.unique(table, axis=0, return_counts=True)
    out = []
    for row, c in zip(rows.tolist(), n.tolist()):
        f, r, w, it = (row[2:2 + levels], row[2 + levels:2 + 2 * levels], row[2 + 2 * levels:2 + 3 * levels],
                       row[2 + 3 * levels:])
        out.append(StepType(int(c), int(row[0]), int(row[1]), tuple(f), tuple(r), tuple(w), tuple(it)))
    return tuple(out)


@functools.lru_cache(maxsize=256)
def _discharged_cached(jaxpr):
    from jax._src.state import discharge as state_discharge

    return state_discharge.discharge_state(jaxpr)


def _discharged(closed):
    """The index map as a function of values (scalar-prefetch refs read as arrays)."""
    return _discharged_cached(closed)


# --------------------------------------------------------------------------- the kernel body

class _Unknown:
    __slots__ = ()

    def __repr__(self):
        return "?"


UNKNOWN = _Unknown()
_TRACK_LIMIT = 4096  # values larger than this are vector data: never tracked


@dataclasses.dataclass(eq=False)
class _Ref:
    aval: Any
    key: int | None = None  # key into the state when its contents are tracked (SMEM)


@dataclasses.dataclass(frozen=True)
class _Site:
    flops: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    remote_bytes: int = 0
    steps: int = 0  # one iteration of a software-pipeline loop (a loop that starts and waits for DMAs)
    dynamic: bool = False  # a copy whose size is only known at run time: counts carry its bytes
    level: int = 0  # 0: the grid step's own body; i + 1: inside loop i (innermost)
    loop: int | None = None  # this site counts the iterations of loop ``loop``


_LOOPS = ("while", "scan")


def _dma_ops(jaxpr) -> set[str]:
    return {e.primitive.name for e in introspect.walk(jaxpr)} & {"dma_start", "dma_wait"}


def _body(eqn):
    return _jaxpr_of(eqn.params["body_jaxpr" if eqn.primitive.name == "while" else "jaxpr"])


_STARTS_AND_WAITS = {"dma_start", "dma_wait"}


def _is_pipeline_loop(eqn) -> bool:
    """A software pipeline's loop: its iterations start DMAs and wait for them, and no inner loop does both.
    Each iteration is a step. A loop that only starts copies (e.g. one issuing a page's DMAs a trip) is issue
    work inside the step that waits for them."""
    if eqn.primitive.name not in _LOOPS or _dma_ops(_body(eqn)) != _STARTS_AND_WAITS:
        return False
    return not any(e.primitive.name in _LOOPS and _dma_ops(_body(e)) == _STARTS_AND_WAITS
                   for e in introspect.walk(_body(eqn)))


_CALL_PARAMS = {"pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
                "custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr",
                "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr", "checkpoint": "jaxpr",
                "custom_lin": None}


def _jaxpr_of(v):
    return v.jaxpr if isinstance(v, jex_core.ClosedJaxpr) else v


def _consts_of(v):
    return list(v.consts) if isinstance(v, jex_core.ClosedJaxpr) else []


def _site_cost(eqn) -> _Site | None:
    name = eqn.primitive.name
    if name == "dot_general":
        (lc, _), _ = eqn.params["dimension_numbers"]
        lhs = eqn.invars[0].aval.shape
        out = eqn.outvars[0].aval.shape
        return _Site(flops=2 * math.prod(out) * math.prod(lhs[d] for d in lc))
    if name == "dma_start":
        from jax._src.pallas.mosaic import primitives as mp

        src, dst, _, _, device_id = mp._dma_unflatten(eqn.params["tree"], [v.aval for v in eqn.invars])
        s, d = _space(src), _space(dst)
        if not all(isinstance(n, (int, np.integer)) for n in src.shape):  # e.g. a partial edge block
            return _Site(read_bytes=int(s == "hbm"), write_bytes=int(d == "hbm"),
                         remote_bytes=int(device_id is not None), dynamic=True)
        nbytes = _nbytes(src.shape, src.dtype)
        if device_id is not None:
            return _Site(read_bytes=nbytes if s == "hbm" else 0, remote_bytes=nbytes)
        return _Site(read_bytes=nbytes if s == "hbm" else 0, write_bytes=nbytes if d == "hbm" else 0)
    return None


class _Body:
    """Evaluates a kernel body's scalar part on concrete values inside a traced scan.

    Values are jax values (scalars and small arrays), UNKNOWN (vector data), or _Ref. Tracked refs
    (SMEM) live in ``self.state`` (a dict, threaded functionally through lax control flow);
    ``self.counts`` counts executions of every cost site (dot_general, dma_start) in this step.
    """

    def __init__(self, kernel, grid, user_axes):
        self.grid = grid
        self.user_axes = user_axes
        self.kernel = kernel
        self.sites: list[_Site] = []
        self.site_index: dict[int, int] = {}
        self.loop_index: dict[int, int] = {}
        self.loops: list[LoopInfo] = []
        self._collect(kernel)
        self.initial_state: dict[int, Any] = {}
        self.state: dict[int, Any] = {}
        self.counts = None
        self.idx: tuple = ()

    def _collect(self, jaxpr, loop: int | None = None):
        """Every cost site (dots, DMA starts, loop iterations) with the loop it sits in."""
        level = 0 if loop is None else loop + 1
        for eqn in jaxpr.eqns:
            site = _site_cost(eqn)
            if site is not None and id(eqn) not in self.site_index:
                self.site_index[id(eqn)] = len(self.sites)
                self.sites.append(dataclasses.replace(site, level=level))
            inner = loop
            if eqn.primitive.name in _LOOPS:
                if id(eqn) not in self.loop_index:
                    inner = len(self.loops)
                    self.loops.append(LoopInfo(loop, eqn.params["length"] if eqn.primitive.name == "scan" else None,
                                               _is_pipeline_loop(eqn)))
                    self.loop_index[id(eqn)] = len(self.sites)
                    self.sites.append(_Site(steps=int(self.loops[-1].pipeline), level=level, loop=inner))
                else:
                    inner = self.sites[self.loop_index[id(eqn)]].loop
            for value in eqn.params.values():
                for sub in introspect.sub_jaxprs(value):
                    self._collect(sub, inner)

    def loop_index_of(self, loop: int) -> int:
        """The site counting loop ``loop``'s iterations."""
        return next(i for i, site in enumerate(self.sites) if site.loop == loop)

    def tracked_ref(self, aval, value) -> _Ref:
        key = max(self.initial_state, default=-1) + 1
        self.initial_state[key] = value
        return _Ref(aval, key)

    def run_step(self, idx, state, refs):
        self.idx = idx
        self.state = dict(state)
        # executions per site in this step (float32: dynamic copies add their bytes instead of 1)
        self.counts = jnp.zeros((len(self.sites),), jnp.float32)
        self.eval(self.kernel, [], refs)
        return self.counts

    # -- helpers
    @staticmethod
    def _known(x) -> bool:
        return not isinstance(x, (_Unknown, _Ref))

    @staticmethod
    def _trackable(aval) -> bool:
        shape = getattr(aval, "shape", None)
        return shape is not None and not hasattr(aval, "inner_aval") and math.prod(shape) <= _TRACK_LIMIT

    def _read(self, env, v):
        if isinstance(v, jex_core.Literal):
            return v.val
        return env.get(v, UNKNOWN)

    def eval(self, jaxpr, consts, args):
        env: dict = {}
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        for eqn in jaxpr.eqns:
            ins = [self._read(env, v) for v in eqn.invars]
            outs = self.eqn(eqn, ins)
            for v, x in zip(eqn.outvars, outs):
                if not isinstance(v, jex_core.DropVar):
                    env[v] = x
        return [self._read(env, v) for v in jaxpr.outvars]

    def _unknown_outs(self, eqn):
        return [_Ref(v.aval) if hasattr(v.aval, "inner_aval") else UNKNOWN for v in eqn.outvars]

    def _count_iteration(self, eqn, counts):
        site = self.loop_index.get(id(eqn))
        return counts if site is None else counts.at[site].add(1)

    def _dynamic_bytes(self, eqn, ins):
        """Bytes of a copy whose slice sizes are run-time values (unknown sizes: the whole dim)."""
        from jax._src import core as jax_core
        from jax._src.indexing import Slice
        from jax._src.pallas.mosaic import primitives as mp
        from jax._src.state.indexing import NDIndexer

        src = mp._dma_unflatten(eqn.params["tree"], ins)[0]
        ref = getattr(src, "ref", src)
        shape, dtype = list(ref.aval.shape), ref.aval.dtype
        for t in getattr(src, "transforms", ()):
            if isinstance(t, NDIndexer):
                new = []
                for idx, dim in zip(t.indices, shape):
                    if isinstance(idx, Slice):
                        new.append(idx.size if self._known(idx.size) else dim)
                    elif np.shape(idx) != ():
                        new.extend(np.shape(idx))
                shape = new + shape[len(t.indices):]
            elif all(isinstance(d, (int, np.integer)) for d in shape) and hasattr(t, "transform_type"):
                aval = t.transform_type(jax_core.ShapedArray(tuple(int(d) for d in shape), dtype))  # reshape, bitcast
                shape, dtype = list(aval.shape), aval.dtype
            else:
                raise CostModelError(f"a copy with a run-time size through {type(t).__name__} is not modelled")
        n = jnp.asarray(np.dtype(dtype).itemsize, jnp.float32)
        for d in shape:
            n = n * jnp.asarray(d, jnp.float32)
        return n

    def _dma_into_smem(self, eqn, ins):
        """A DMA into SMEM the model tracks: copy the values when the source is tracked too (e.g. a
        page table row from a concrete HBM input), else refuse (values computed from vector data)."""
        from jax._src.pallas.mosaic import primitives as mp
        from jax._src.state import discharge as sd

        src, dst = mp._dma_unflatten(eqn.params["tree"], ins)[:2]
        dref = getattr(dst, "ref", dst)
        if not (isinstance(dref, _Ref) and dref.key is not None and dref.key in self.state):
            return
        sref = getattr(src, "ref", src)
        leaves = lambda r: jax.tree_util.tree_flatten(tuple(getattr(r, "transforms", ())))  # noqa: E731
        (sl, st), (dl, dt) = leaves(src), leaves(dst)
        if not (isinstance(sref, _Ref) and sref.key is not None and sref.key in self.state
                and all(self._known(x) for x in sl + dl)):
            raise CostModelError("a DMA writes into SMEM that steers the kernel from data the model does not "
                                 "know (values the kernel computes from vector data): its control flow cannot be followed")
        value = sd._get_discharge(self.state[sref.key], sl, st)
        x = self.state[dref.key]
        _, new = sd._swap_discharge(x, jnp.asarray(value, x.dtype), dl, dt)
        self.state[dref.key] = new.astype(x.dtype)

    def eqn(self, eqn, ins):
        name, p = eqn.primitive.name, eqn.params
        if id(eqn) in self.site_index:
            site = self.site_index[id(eqn)]
            if name == "dma_start":
                self._dma_into_smem(eqn, ins)
            amount = self._dynamic_bytes(eqn, ins) if self.sites[site].dynamic else 1
            self.counts = self.counts.at[site].add(amount)
            return self._unknown_outs(eqn)
        if name == "program_id":
            return [jnp.asarray(self.idx[self.user_axes[p["axis"]]], jnp.int32)]
        if name == "num_programs":
            return [jnp.asarray(self.grid[self.user_axes[p["axis"]]], jnp.int32)]
        if name in ("get", "swap", "addupdate"):
            return self._state_op(name, eqn, ins)
        if name == "cond":
            return self._cond(eqn, ins)
        if name == "while":
            return self._while(eqn, ins)
        if name == "scan":
            return self._scan(eqn, ins)
        if name == "run_scoped":
            return self._run_scoped(eqn, ins)
        if name in _CALL_PARAMS:
            sub = p.get(_CALL_PARAMS[name] or "", None)
            if sub is None:
                sub = next((v for v in p.values() if isinstance(v, (jex_core.ClosedJaxpr, jex_core.Jaxpr))), None)
            if sub is not None and len(_jaxpr_of(sub).invars) == len(ins):
                return self.eval(_jaxpr_of(sub), _consts_of(sub), ins)
        if all(self._known(x) for x in ins) and all(self._trackable(v.aval) for v in eqn.outvars) \
                and not eqn.effects:
            try:
                out = eqn.primitive.bind(*ins, **p)
            except Exception:  # a primitive that only lowers inside a kernel: its value is unknown
                return self._unknown_outs(eqn)
            return list(out) if eqn.primitive.multiple_results else [out]
        return self._unknown_outs(eqn)

    def _state_op(self, name, eqn, ins):
        from jax._src.state import discharge as sd

        ref, rest = ins[0], ins[1:]
        tracked = isinstance(ref, _Ref) and ref.key is not None and ref.key in self.state
        if name == "get":
            idx = rest
            if tracked and all(self._known(x) for x in idx):
                return [sd._get_discharge(self.state[ref.key], idx, eqn.params["tree"])]
            return [UNKNOWN]
        val, idx = rest[0], rest[1:]
        if not (tracked and self._known(val) and all(self._known(x) for x in idx)):
            return [UNKNOWN] if name == "swap" else []
        x = self.state[ref.key]
        if name == "swap":
            old, new = sd._swap_discharge(x, jnp.asarray(val, x.dtype), idx, eqn.params["tree"])
            self.state[ref.key] = new.astype(x.dtype)
            return [old]
        self.state[ref.key] = sd._addupdate_discharge(x, jnp.asarray(val, x.dtype), idx, eqn.params["tree"]).astype(x.dtype)
        return []

    def _run_scoped(self, eqn, ins):
        jaxpr = eqn.params["jaxpr"]
        scoped = []
        added = []
        # the body's constvars are the eqn's operands; its invars are the scoped allocations
        for v in jaxpr.invars:
            if _space(v.aval) == "smem":
                key = max(list(self.state) + list(self.initial_state), default=-1) + 1 + len(added)
                self.state[key] = jnp.zeros(v.aval.shape, v.aval.dtype)
                added.append(key)
                scoped.append(_Ref(v.aval, key))
            else:
                scoped.append(_Ref(v.aval))
        outs = self.eval(jaxpr, ins, scoped)
        for key in added:
            self.state.pop(key, None)
        return outs

    # -- control flow: state and counts are threaded through lax primitives
    def _traced(self, fn, state, counts):
        """Run fn() with the given state/counts installed; return (state, counts, fn's result)."""
        saved = (self.state, self.counts)
        self.state, self.counts = dict(state), counts
        try:
            result = fn()
            return self.state, self.counts, result
        finally:
            self.state, self.counts = saved

    def _small_outs(self, outvars, outs, known_log):
        """Outputs of a branch/body as arrays: zeros where unknown; log which were known."""
        res = []
        for v, x in zip(outvars, outs):
            if not self._trackable(v.aval) or isinstance(x, _Ref):
                known_log.append(False)
                res.append(jnp.zeros((), jnp.int32))
                continue
            known_log.append(self._known(x))
            res.append(jnp.asarray(x, v.aval.dtype) if self._known(x) else jnp.zeros(v.aval.shape, v.aval.dtype))
        return tuple(res)

    def _cond(self, eqn, ins):
        index, ops = ins[0], ins[1:]
        branches = eqn.params["branches"]
        if not self._known(index):
            # data-dependent branch: count the most expensive side, keep branch 0's state
            results = [self._traced(lambda b=b: self.eval(b.jaxpr, b.consts, ops), self.state, self.counts)
                       for b in branches]
            self.state = results[0][0]
            counts = results[0][1]
            for r in results[1:]:
                counts = jnp.maximum(counts, r[1])
            self.counts = counts
            return self._unknown_outs(eqn)
        logs: list[list[bool]] = []
        keys = list(self.state)

        def make(b):
            def f(state, counts):
                log: list[bool] = []
                logs.append(log)
                st, ct, outs = self._traced(lambda: self.eval(b.jaxpr, b.consts, ops), state, counts)
                return {k: st[k] for k in keys}, ct, self._small_outs(b.jaxpr.outvars, outs, log)
            return f

        index = jnp.clip(jnp.asarray(index, jnp.int32), 0, len(branches) - 1)
        state, counts, outs = lax.switch(index, [make(b) for b in branches], self.state, self.counts)
        self.state, self.counts = dict(state), counts
        known = [all(log[i] for log in logs) for i in range(len(eqn.outvars))]
        return [o if k else u for o, k, u in zip(outs, known, self._unknown_outs(eqn))]

    def _loop_mask(self, carry_vars, init):
        return [self._trackable(v.aval) and self._known(x) for v, x in zip(carry_vars, init)]

    def _while(self, eqn, ins):
        p = eqn.params
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        cc, bc, init = ins[:p["cond_nconsts"]], ins[p["cond_nconsts"]:p["cond_nconsts"] + p["body_nconsts"]], \
            ins[p["cond_nconsts"] + p["body_nconsts"]:]
        carry_vars = bj.jaxpr.outvars
        mask = self._loop_mask(carry_vars, init)
        keys = list(self.state)
        while True:
            def full(kc, mask=mask):
                it = iter(kc)
                return [next(it) if m else UNKNOWN for m in mask]

            def cond_fun(carry, mask=mask):
                state, counts, kc = carry
                _, _, pred = self._traced(lambda: self.eval(cj.jaxpr, cj.consts, list(cc) + full(kc)), state, counts)
                if not self._known(pred[0]):
                    raise CostModelError("a while loop's condition depends on vector data; cannot count its trips")
                return pred[0]

            retry: list[list[bool]] = []

            def body_fun(carry, mask=mask):
                state, counts, kc = carry
                st, ct, outs = self._traced(lambda: self.eval(bj.jaxpr, bj.consts, list(bc) + full(kc)), state, counts)
                ct = self._count_iteration(eqn, ct)
                new_mask = [m and self._known(o) for m, o in zip(mask, outs)]
                if new_mask != mask:
                    retry.append(new_mask)
                    raise _Retry()
                return {k: st[k] for k in keys}, ct, tuple(jnp.asarray(o, v.aval.dtype) for o, v, m in zip(outs, carry_vars, mask) if m)

            kc0 = tuple(jnp.asarray(x, v.aval.dtype) for x, v, m in zip(init, carry_vars, mask) if m)
            try:
                state, counts, kc = lax.while_loop(cond_fun, body_fun, (self.state, self.counts, kc0))
            except _Retry:
                mask = retry[-1]
                continue
            self.state, self.counts = dict(state), counts
            return full(kc)

    def _scan(self, eqn, ins):
        p = eqn.params
        j, nc, ncarry, length = p["jaxpr"], p["num_consts"], p["num_carry"], p["length"]
        consts, init, xs = ins[:nc], ins[nc:nc + ncarry], ins[nc + ncarry:]
        carry_vars = j.jaxpr.invars[nc:nc + ncarry]
        x_vars = j.jaxpr.invars[nc + ncarry:]
        mask = self._loop_mask(carry_vars, init)
        keys = list(self.state)
        xs_known = [self._known(x) and math.prod(np.shape(x)) <= 64 * _TRACK_LIMIT for x in xs]
        while True:
            retry: list[list[bool]] = []

            def body(i, carry, mask=mask):
                state, counts, kc = carry
                it = iter(kc)
                c = [next(it) if m else UNKNOWN for m in mask]
                t = length - 1 - i if p["reverse"] else i
                x = [jnp.asarray(a)[t] if k else UNKNOWN for a, k in zip(xs, xs_known)]
                st, ct, outs = self._traced(lambda: self.eval(j.jaxpr, j.consts, list(consts) + c + x), state, counts)
                ct = self._count_iteration(eqn, ct)
                new_mask = [m and self._known(o) for m, o in zip(mask, outs[:ncarry])]
                if new_mask != mask:
                    retry.append(new_mask)
                    raise _Retry()
                return {k: st[k] for k in keys}, ct, tuple(jnp.asarray(o, v.aval.dtype) for o, v, m in zip(outs, carry_vars, mask) if m)

            kc0 = tuple(jnp.asarray(x, v.aval.dtype) for x, v, m in zip(init, carry_vars, mask) if m)
            try:
                state, counts, kc = lax.fori_loop(0, length, body, (self.state, self.counts, kc0))
            except _Retry:
                mask = retry[-1]
                continue
            self.state, self.counts = dict(state), counts
            it = iter(kc)
            carry_out = [next(it) if m else UNKNOWN for m in mask]
            return carry_out + [UNKNOWN] * (len(eqn.outvars) - ncarry)


class _Retry(Exception):
    pass


__all__ = ["Cost", "CallCost", "CostModelError", "OperandTraffic", "capture", "estimate", "ideal_time",
           "roofline_fraction"]
