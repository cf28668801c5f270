"""The per-step TPU time model (v2): what each grid step moves, timed against what the compiler scheduled.

Inputs, for one program on one chip:

* per Pallas call, from ``costmodel.estimate`` (the program's real scalar values): the grid steps
  grouped by type (``StepType``): the pipelined blocks each moves, per loop level the MXU flops its
  dots execute and the bytes its own DMAs move, and how often each loop of the kernel body runs;
* per call, from the compiled kernel (``compiled``/``llo``: libtpu's final VLIW schedule): per
  loop level the bundles one iteration issues, the vmatmuls it issues per MXU, and the bundles
  that sit in the predicated region gating its matmuls;
* the XLA ops around the kernels (``compiled.entry_ops``), and the chip (``_chips``).

Model. A loop level's compute time is max(issue, MXU) cycles at the chip clock: issue = bundles
executed (the gated part in proportion to the flops its dots executed, out of those of all the dots
compiled into the level: inlined alternatives, e.g. masked and unmasked tiles, are not all run),
MXU = vmatmul per MXU x cycles per vmatmul (in the same proportion). A grid step costs
``max(DMA, compute + overhead)``, DMA = bytes / bandwidth of the blocks it moves and the copies it
starts: the DMA engine moves the next step's blocks while the core computes and pays the per-step
cost. Each iteration of a DMA loop inside a step (a loop whose iterations start copies and wait for
them: paged attention's chunks, emit_pipeline) is a step of its own, costed the same way. An XLA op costs
``max(bytes / bandwidth, bundles / clock) + overhead``. The program is the sum. ``overhead`` is
the one constant nothing here can measure: results are given at 0, 0.35 and 0.7 us. (Fitted to
libtpu's own static estimate of small-block Pallas matmuls, this form charges about 0.18 us per
step on v6e and 0.37 us on v5e: ``bench.validate``.)

Joining the two views: the kernel's loops (jaxpr ``scan``/``while``, in program order) are matched
to the compiled loops (in address order) level by level, by trip count (a static trip count must
agree; a run-time one matches a run-time one). A jaxpr loop with no compiled loop was unrolled
(its work is in the parent's bundles); a compiled loop with no jaxpr loop (a loop the compiler
made) is counted inside its parent, times its trips. The match is reported per call.
"""

from __future__ import annotations

import dataclasses

from ..vendored._chips import chip as get_chip
from .costmodel import CallCost

OVERHEADS = (0.0, 0.35e-6, 0.7e-6)  # seconds per grid step / DMA-loop iteration / XLA op


# --------------------------------------------------------------------------- joining the views

@dataclasses.dataclass
class Level:
    """One loop level of a kernel as compiled: per iteration (own work, nested loops apart)."""
    bundles: int  # issued per iteration, including compiler-made loops inside (times their trips)
    gated: int  # of which in the predicated region gating the level's matmuls
    vmatmul: int  # per iteration on the busiest MXU
    vmatmul_all: int


@dataclasses.dataclass
class Join:
    levels: dict[int, Level]  # cost level (0 = grid step, i + 1 = jaxpr loop i) -> compiled level
    folded: dict[int, int]  # cost level -> the cost level whose compiled code holds it (unrolled loops)
    prologue: int  # bundles outside the grid loop (once per call)
    grid_loop: bool
    notes: list[str]
    grid_joined: bool = True  # False: a grid of several steps matched no compiled loop (its steps cannot be timed)

    @property
    def exact(self) -> bool:
        return not self.notes


def _inline(loop: dict) -> tuple[int, int, int]:
    """(bundles, vmatmul, vmatmul_all) of a compiler-made loop, its nested loops and trips included."""
    b, v, va = loop["own_bundles"], loop["vmatmul"], loop["vmatmul_all"]
    for ch in loop["children"]:
        cb, cv, cva = _inline(ch)
        b, v, va = b + cb, v + cv, va + cva
    t = loop["trips"] or 1
    return b * t, v * t, va * t


def _level(loop: dict, unmatched: list[dict]) -> Level:
    b, v, va = loop["own_bundles"], loop["vmatmul"], loop["vmatmul_all"]
    for ch in unmatched:
        cb, cv, cva = _inline(ch)
        b, v, va = b + cb, v + cv, va + cva
    return Level(b, loop["gated"], v, va)


def _compatible(trips: tuple[int | None, int | None], trips_llo: int | None) -> bool:
    """A kernel loop (its static trip count, and the count it always ran per parent iteration)
    can be a compiled loop of ``trips_llo`` trips (None: a run-time count)."""
    static, observed = trips
    if static is not None:
        return trips_llo is not None and abs(trips_llo - static) <= 1
    return trips_llo is None or trips_llo == observed


def _align(jl: list[int], ll: list[dict], trips) -> list[tuple[int | None, dict | None]]:
    """Order-preserving alignment of jaxpr loops ``jl`` (indices) with compiled loops ``ll``."""
    n, m = len(jl), len(ll)
    ok = [[_compatible(trips[jl[i]], ll[j]["trips"]) for j in range(m)] for i in range(n)]
    best = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            match = best[i + 1][j + 1] + 1 if ok[i][j] else -1
            best[i][j] = max(match, best[i + 1][j], best[i][j + 1])
    out, i, j = [], 0, 0
    while i < n or j < m:
        if i < n and j < m and ok[i][j] and best[i][j] == best[i + 1][j + 1] + 1:
            out.append((jl[i], ll[j]))
            i, j = i + 1, j + 1
        elif i < n and (j == m or best[i][j] == best[i + 1][j]):
            out.append((jl[i], None))
            i += 1
        else:
            out.append((None, ll[j]))
            j += 1
    return out


def _observed_trips(call: CallCost, i: int) -> int | None:
    """Iterations of loop i per iteration of its parent, when that was the same in every step."""
    parent = call.loops[i].parent
    ratios = set()
    for st in call.step_types:
        outer = 1 if parent is None else st.iterations[parent]
        if outer:
            if st.iterations[i] % outer:
                return None
            ratios.add(st.iterations[i] // outer)
    return ratios.pop() if len(ratios) == 1 else None


def join(call: CallCost, program: dict) -> Join:
    """Match a call's loop levels (costmodel) to its compiled loops (llo)."""
    steps = sum(t.count for t in call.step_types)
    notes: list[str] = []
    top = program["loops"]
    grid_loop = None
    if steps > 1 or call.dynamic_grid:
        cands = [lp for lp in top if lp["trips"] is None] if call.dynamic_grid else \
            [lp for lp in top if lp["trips"] in (steps + 2, steps + 1, steps)]
        if cands:
            grid_loop = max(cands, key=lambda lp: lp["end"] - lp["start"])
        elif steps > 1:
            notes.append(f"no compiled loop of {steps} (+2) trips for the grid")
    if grid_loop is not None:
        prologue = program["own_bundles"] + sum(_inline(lp)[0] for lp in top if lp is not grid_loop)
        root = grid_loop
    else:  # one grid step: the straight-line program is the step
        prologue = 0
        root = {"own_bundles": program["own_bundles"], "vmatmul": program["vmatmul"],
                "vmatmul_all": program["vmatmul_all"], "gated": 0, "children": top, "trips": 1}
    levels: dict[int, Level] = {}
    folded: dict[int, int] = {}
    children_of: dict[int | None, list[int]] = {}
    for i, lp in enumerate(call.loops):
        children_of.setdefault(lp.parent, []).append(i)
    loop_trips = [(lp.static_trips, _observed_trips(call, i)) for i, lp in enumerate(call.loops)]

    def fold_subtree(i: int, into: int):
        folded[i + 1] = into
        for c in children_of.get(i, []):
            fold_subtree(c, into)

    def effective(children: list[int], into: int) -> list[int]:
        """A one-trip loop is no loop once compiled: its work, and its loops, belong to ``into``."""
        out = []
        for i in children:
            if call.loops[i].static_trips == 1:
                folded[i + 1] = into
                out += effective(children_of.get(i, []), into)
            else:
                out.append(i)
        return out

    def walk(cost_level: int, jaxpr_children: list[int], compiled: dict):
        pairs = _align(effective(jaxpr_children, cost_level), compiled["children"], loop_trips)
        unmatched_llo = [lc for j, lc in pairs if j is None]
        levels[cost_level] = _level(compiled, unmatched_llo)
        for j, lc in pairs:
            if j is None:
                continue
            if lc is None:  # unrolled, or compiled with a static trip count it did not always run:
                trips = call.loops[j].static_trips  # either way its compiled work is counted in this level
                if not any(u["trips"] is not None for u in unmatched_llo):
                    notes.append(f"loop {j} ({'run-time' if trips is None else trips} trips) has no compiled loop")
                fold_subtree(j, cost_level)
            else:
                walk(j + 1, children_of.get(j, []), lc)
        if unmatched_llo and any(lc["trips"] is None for lc in unmatched_llo):
            notes.append("a compiled loop with a run-time trip count matches no kernel loop (counted once)")

    walk(0, children_of.get(None, []), root)
    return Join(levels, folded, prologue, grid_loop is not None, notes, grid_loop is not None or steps <= 1)


# --------------------------------------------------------------------------- timing

@dataclasses.dataclass
class StepTime:
    """One step type of one call: what bounds it, per step (seconds)."""
    count: int
    dma_s: float
    compute_s: float
    issue_cycles: float
    mxu_cycles: float
    loops: list  # per DMA loop run in the step: (iterations, DMA s per iteration, compute s per iteration)

    @property
    def loop_steps(self) -> float:
        return sum(n for n, _, _ in self.loops)

    @property
    def loop_dma_s(self) -> float:
        return sum(n * d for n, d, _ in self.loops)

    @property
    def loop_compute_s(self) -> float:
        return sum(n * k for n, _, k in self.loops)

    def seconds(self, overhead: float) -> float:
        """The per-step cost is the core's: the DMA engine moves the next blocks meanwhile."""
        return max(self.dma_s, self.compute_s + overhead) + sum(n * max(d, k + overhead) for n, d, k in self.loops)


@dataclasses.dataclass
class CallTime:
    name: str
    steps: list[StepTime]
    prologue_s: float
    join_notes: list[str]
    vmatmul_flops: float  # flops the MXU performed (issued vmatmuls x their size): efficiency = flops / this
    issued_bundles: float
    flops: int
    grid_joined: bool = True  # False: no compiled loop matched the grid, so each step would be the whole kernel

    def seconds(self, overhead: float) -> float:
        """The code outside the grid loop, one overhead for the call's launch (as every XLA op pays), the steps."""
        return self.prologue_s + overhead + sum(s.count * s.seconds(overhead) for s in self.steps)

    def grid_steps(self) -> int:
        return sum(s.count for s in self.steps)


    def loop_steps(self) -> float:
        return sum(s.count * s.loop_steps for s in self.steps)

    def breakdown(self) -> dict:
        """Totals: DMA, compute and step counts, and what bounds the steps (for reading a row)."""
        dma = sum(s.count * (s.dma_s + s.loop_dma_s) for s in self.steps)
        comp = sum(s.count * (s.compute_s + s.loop_compute_s) for s in self.steps)
        dma_bound = sum(s.count for s in self.steps if s.dma_s >= s.compute_s)
        return {"dma_s": dma, "compute_s": comp, "prologue_s": self.prologue_s, "grid_steps": self.grid_steps(),
                "loop_steps": self.loop_steps(), "dma_bound_steps": dma_bound,
                "bundles_per_mxu_mflop": (self.issued_bundles / (self.vmatmul_flops / 1e6)) if self.vmatmul_flops else None,
                "mxu_efficiency": (self.flops / self.vmatmul_flops) if self.vmatmul_flops else None,
                "step_types": [{"count": s.count, "dma_s": s.dma_s, "compute_s": s.compute_s,
                                "issue_cycles": s.issue_cycles, "mxu_cycles": s.mxu_cycles, "loop_steps": s.loop_steps,
                                "loop_dma_s": s.loop_dma_s, "loop_compute_s": s.loop_compute_s}
                               for s in sorted(self.steps, key=lambda s: -s.count * s.seconds(0.0))[:8]]}


def call_time(call: CallCost, program: dict | None, chip: str) -> CallTime:
    """Per-step time of one kernel call on ``chip`` from its counts and its compiled schedule."""
    c = get_chip(chip)
    bw, clock = c.hbm_bandwidth, c.clock_hz
    if program is None:
        raise ValueError(f"no compiled schedule for kernel {call.name!r}")
    j = join(call, program)
    n_levels = len(call.loops) + 1
    parent = [0] + [0 if lp.parent is None else lp.parent + 1 for lp in call.loops]
    pipeline = [False] + [lp.pipeline for lp in call.loops]

    def owner(level):  # the DMA loop (a level) or the grid step (0) whose step this level's work is part of
        while level and not pipeline[level]:
            level = parent[level]
        return level

    def home(level):  # the compiled level holding this cost level
        return j.folded.get(level, level)

    # a level's matmul work when all of it runs: the flops of all the dots compiled into the level, each
    # once (``level_flops``; a loop folded into it times its static trips), or the most one iteration
    # executed in any step where that is larger or the level's dots are unknown. Alternatives inlined in
    # one level (pl.when regions, e.g. masked and unmasked tiles) all sit in its vmatmuls and gated
    # bundles, while a step runs one of them.
    per_iter = [0.0] * n_levels
    compiled_flops = [0.0] * n_levels
    known = [True] * n_levels  # False: a loop with a run-time trip count was unrolled into the level
    trips_to_home = [1] * n_levels  # a folded loop: its static trips times those of its folded parents
    for lv in range(1, n_levels):
        if home(lv) != lv:
            t = call.loops[lv - 1].static_trips
            known[home(lv)] &= t is not None
            trips_to_home[lv] = (t or 1) * (trips_to_home[parent[lv]] if home(parent[lv]) == home(lv) else 1)
    for lv, f in enumerate(call.level_flops):
        compiled_flops[home(lv)] += f * trips_to_home[lv]
    executed = []
    for st in call.step_types:
        iters = [1] + list(st.iterations)
        exec_flops = [0.0] * n_levels
        for lv in range(n_levels):
            exec_flops[home(lv)] += st.flops[lv]
        executed.append((st, iters, exec_flops))
        for lv in j.levels:
            if iters[lv]:
                per_iter[lv] = max(per_iter[lv], exec_flops[lv] / iters[lv])
    for lv in j.levels:
        if known[lv]:
            per_iter[lv] = max(per_iter[lv], compiled_flops[lv])
    steps, issued, vm_flops = [], 0.0, 0.0
    for st, iters, exec_flops in executed:
        issue = [0.0] * n_levels  # cycles per owner
        mxu = [0.0] * n_levels
        dma = [0.0] * n_levels
        n_iter = [0.0] * n_levels
        for lv, lev in j.levels.items():
            n = iters[lv]
            if not n:
                continue
            phi = exec_flops[lv] / (n * per_iter[lv]) if per_iter[lv] else 1.0
            o = owner(lv)
            b = n * (lev.bundles - lev.gated + phi * lev.gated)
            issue[o] += b
            mxu[o] += n * phi * lev.vmatmul * c.vmatmul_cycles
            issued += st.count * b
            vm_flops += st.count * n * phi * lev.vmatmul_all * c.vmatmul_flops
        for lv in range(n_levels):
            dma[owner(lv)] += st.dma_read[lv] + st.dma_write[lv]
            if pipeline[lv]:
                n_iter[lv] = iters[lv]
        dma_s = (st.read_bytes + st.write_bytes + dma[0]) / bw
        compute_s = max(issue[0], mxu[0]) / clock
        loops = [(n_iter[lv], dma[lv] / n_iter[lv] / bw, max(issue[lv], mxu[lv]) / n_iter[lv] / clock)
                 for lv in range(1, n_levels) if pipeline[lv] and n_iter[lv]]
        steps.append(StepTime(st.count, dma_s, compute_s, issue[0], mxu[0], loops))
    return CallTime(call.name, steps, j.prologue / clock, j.notes, vm_flops, issued, call.flops, j.grid_joined)


def glue_time(op: dict, chip: str, overhead: float) -> float:
    """An XLA op: max(bytes / bandwidth, bundles / clock) + overhead (SparseCore-offloaded: bytes only)."""
    c = get_chip(chip)
    t = op["hbm_bytes"] / c.hbm_bandwidth
    prog = op.get("program")
    if prog and not op.get("offloaded"):
        t = max(t, prog["executed_bundles"] / c.clock_hz)
    return t + overhead


def kernel_ops(profile: dict) -> list[dict]:
    return [op for op in profile["ops"] if op["kernel"]]


def glue_ops(profile: dict) -> list[dict]:
    return [op for op in profile["ops"] if not op["kernel"] and op["hbm_bytes"] + (
        (op.get("program") or {}).get("executed_bundles", 0)) > 0]


def kernel_name(op_name: str) -> str:
    """A compiled kernel's name as its pallas_call named it: without XLA's suffix (".1") and the prefixes JAX's
    transforms add (a kernel in a custom VJP's backward is named ``transpose_jvp_<name>_``)."""
    base = op_name.rsplit(".", 1)[0]
    while base.startswith(("jvp_", "transpose_")):
        base = base.split("_", 1)[1]
    return base


def match_calls(calls: list[CallCost], profile: dict) -> list[tuple[CallCost, dict | None]]:
    """Pair the traced kernel calls with the compiled kernels: by name, then the rest in order (XLA may order
    independent kernels either way: a backward's dq and dK/dV)."""
    remaining = list(kernel_ops(profile))
    picks: dict[int, dict] = {}
    for same in (lambda op, name: kernel_name(op).rstrip("_") == name,  # exact names first: "k" is not "k_dq"
                 lambda op, name: kernel_name(op).startswith(name)):
        for i, call in enumerate(calls):
            pick = None if i in picks else next((op for op in remaining if same(op["name"], call.name)), None)
            if pick is not None:
                remaining.remove(pick)
                picks[i] = pick
    for i in range(len(calls)):
        if i not in picks and remaining:
            picks[i] = remaining.pop(0)
    return [(call, picks.get(i)) for i, call in enumerate(calls)]
