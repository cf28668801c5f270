"""The compiled schedule of a TPU program piece, read from libtpu's LLO dump (no TPU needed).

XLA:TPU compiles every HLO op of a program (a fusion, a sort, a Pallas kernel's custom call) into
VLIW bundles for the TensorCore; with ``LIBTPU_INIT_ARGS=--xla_jf_dump_to=DIR
--xla_jf_dump_llo_text=true`` it writes, per op, the final schedule
(``<ts>-<op name>-NN-final_bundles.txt``: after scheduling and register allocation). One bundle is
one issue cycle. This module turns such a file into the numbers the cost model needs:

* loops: a backward ``sbr.rel ... target = $regionN`` to an earlier region closes a loop whose body
  runs from that region to the branch and its empty delay slots; its trip count is the immediate
  of the "loop exit test" compare feeding the branch (None when the bound is a register: a
  data-dependent loop). A Pallas grid is one flattened loop of ``steps + 2`` trips (the pipeline's
  prologue and epilogue iterations); ``fori_loop``/``while`` inside a kernel are nested loops.
* per loop body, excluding nested loops ("own"): bundles, vmatmul issued per MXU (one vmatmul is
  16 packed bf16 rows against an MXU-wide square of weights: the MXU's unit of work, so MXU
  efficiency follows the tile shape), DMA starts, and ``gated``: the own bundles of the smallest
  predicated region (a forward branch: ``pl.when``, a skipped pipeline stage) that holds every own
  vmatmul, i.e. the work that is skipped when the loop's matmuls are; where no one region does, the
  outermost regions that hold some (alternatives: sibling ``pl.when`` bodies, of which a step runs one).

``flags(dump_dir)`` gives the LIBTPU_INIT_ARGS; libtpu reads them once, when it loads, so the
compile must run in a fresh process (``bench.compiled`` does that).
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import os
import re

# only the passes this module reads: the dump of every pass is ~40x larger
PASS_REGEX = "final_bundles"


def flags(dump_dir: str) -> str:
    return " ".join([f"--xla_jf_dump_to={dump_dir}", "--xla_jf_dump_llo_text=true",
                     f"--xla_jf_dump_llo_pass_label_regex={PASS_REGEX}"])


_BUNDLE = re.compile(r"^\s*(0x[0-9a-f]+|\d+)\s+(?:LH|LB|LE|PB|PF|CT)?\s*:\s*>*\s*\{")
_REGION_START = re.compile(r"Start(?:/End empty)? region (\d+)")
_BRANCH = re.compile(r"sbr\.rel\s*\(([^)]*)\)\s*target\s*=\s*\$region(\d+)")
_VMATMUL = re.compile(r"=\s*vmatmul[\w.\[\]]*?\.mxu(\d+)")
_DMA_START = re.compile(r"=\s*dma\.(?!done)[a-z_]+")


def _strip_comments(text: str) -> str:
    prev = None
    while prev != text:  # comments nest one level in these dumps: remove the innermost first
        prev = text
        text = re.sub(r"/\*(?:(?!/\*|\*/).)*\*/", "", text, flags=re.S)
    return text


def read_bundles(path: str) -> list[str]:
    """The text of every bundle (continuation lines joined), in address order."""
    bundles: list[str] = []
    with open(path) as f:
        for line in f:
            if _BUNDLE.match(line):
                bundles.append(line)
            elif bundles:
                bundles[-1] += line
    return bundles


@dataclasses.dataclass
class Loop:
    start: int  # first bundle of the body (bundle indices)
    end: int  # last bundle of one iteration (the back branch's last delay slot)
    trips: int | None  # None: a run-time bound
    children: list["Loop"] = dataclasses.field(default_factory=list)
    own_bundles: int = 0
    vmatmul: int = 0  # own, on the busiest MXU
    vmatmul_all: int = 0  # own, all MXUs
    gated: int = 0  # own bundles of the smallest predicated region holding every own vmatmul
    dma_starts: int = 0

    @property
    def bundles(self) -> int:
        return self.end - self.start + 1

    def to_dict(self) -> dict:
        return {"start": self.start, "end": self.end, "trips": self.trips, "own_bundles": self.own_bundles,
                "vmatmul": self.vmatmul, "vmatmul_all": self.vmatmul_all, "gated": self.gated,
                "dma_starts": self.dma_starts, "children": [c.to_dict() for c in self.children]}


def _trip_count(bundles: list[str], branch: int, target: int, pred: str) -> int | None:
    """The loop's trip count: N of the exit test ``iv >= N`` (counted loops); None for any other
    exit condition (a register bound, a while condition such as ``x != 0``)."""
    for k in range(branch, target - 1, -1):
        m = re.search(rf"%{re.escape(pred)}\s*=\s*scmp\.([a-z]+)\.s32[.a-z]*\s+%\w+,\s*(-?\d+|%\w+)", bundles[k])
        if m:
            ok = m.group(1) == "ge" and re.fullmatch(r"\d+", m.group(2)) and int(m.group(2)) > 0
            return int(m.group(2)) if ok else None
    return None


def _gating(forward: list[tuple[int, int]], lp: "Loop", mm: list[int]) -> list[tuple[int, int]]:
    """The predicated regions of loop ``lp`` that gate its matmuls (bundles ``mm``, sorted): the smallest
    one holding them all; else (alternatives, e.g. a masked and an unmasked tile in sibling ``pl.when``
    regions) the outermost regions that hold any."""
    regions = [(a, b) for a, b in forward if lp.start <= a and b <= lp.end + 1]
    whole = [r for r in regions if r[0] <= mm[0] and mm[-1] < r[1]]
    if whole:
        return [min(whole, key=lambda r: r[1] - r[0])]
    holding = [r for r in regions if bisect.bisect_left(mm, r[1]) > bisect.bisect_left(mm, r[0])]
    return [r for r in holding if not any(o != r and o[0] <= r[0] and r[1] <= o[1] for o in holding)]


def analyse(bundles: list[str]) -> dict:
    """Loops (nested), their own bundles, vmatmul, gated work and DMA starts; and the straight-line rest."""
    region_at: dict[int, int] = {}
    for i, b in enumerate(bundles):
        for r in _REGION_START.findall(b):
            region_at.setdefault(int(r), i)
    code = [_strip_comments(b) for b in bundles]
    mxu = [[int(u) for u in _VMATMUL.findall(c)] for c in code]
    dmas = [len(_DMA_START.findall(c)) for c in code]
    empty = [c.split("{", 1)[1].strip().startswith("}") for c in code]
    loops: list[Loop] = []
    forward: list[tuple[int, int]] = []  # (first skipped bundle, target): predicated regions
    for i, c in enumerate(code):
        for m in _BRANCH.finditer(c):
            target = region_at.get(int(m.group(2)))
            if target is None:
                continue
            if target > i:
                forward.append((i + 1, target))
                continue
            j = i + 1
            while j < len(bundles) and empty[j] and j - i <= 8:  # the branch's delay slots
                j += 1
            loops.append(Loop(target, j - 1, _trip_count(code, i, target, m.group(1).lstrip("!%"))))
    loops.sort(key=lambda lp: (lp.start, -lp.end))
    roots: list[Loop] = []
    stack: list[Loop] = []
    for lp in loops:
        while stack and not (stack[-1].start <= lp.start and lp.end <= stack[-1].end):
            stack.pop()
        (stack[-1].children if stack else roots).append(lp)
        stack.append(lp)

    def own_indices(lo, hi, children):
        inner = set()
        for ch in children:
            inner.update(range(ch.start, ch.end + 1))
        return [k for k in range(lo, hi + 1) if k not in inner]

    def fill(lp: Loop):
        for ch in lp.children:
            fill(ch)
        own = own_indices(lp.start, lp.end, lp.children)
        own_set = set(own)
        lp.own_bundles = len(own)
        per_unit: dict[int, int] = {}
        for k in own:
            for u in mxu[k]:
                per_unit[u] = per_unit.get(u, 0) + 1
        lp.vmatmul = max(per_unit.values(), default=0)
        lp.vmatmul_all = sum(per_unit.values())
        lp.dma_starts = sum(dmas[k] for k in own)
        mm = [k for k in own if mxu[k]]
        if mm:
            lp.gated = len(own_set.intersection(k for a, b in _gating(forward, lp, mm) for k in range(a, b)))

    for lp in roots:
        fill(lp)
    top = own_indices(0, len(bundles) - 1, roots)
    per_unit: dict[int, int] = {}
    for k in top:
        for u in mxu[k]:
            per_unit[u] = per_unit.get(u, 0) + 1
    return {"bundles": len(bundles), "own_bundles": len(top), "vmatmul": max(per_unit.values(), default=0),
            "vmatmul_all": sum(per_unit.values()), "dma_starts": sum(dmas[k] for k in top),
            "loops": [lp.to_dict() for lp in roots]}


def executed_bundles(program: dict) -> tuple[int, bool]:
    """Bundles one run of a program piece issues with every static loop expanded, predicated
    regions taken (an upper bound); and whether every trip count was static (else 1 is assumed)."""
    static = True

    def run(lp) -> int:
        nonlocal static
        trips = lp["trips"]
        if trips is None:
            static, trips = False, 1
        return trips * (lp["own_bundles"] + sum(run(c) for c in lp["children"]))

    return program["own_bundles"] + sum(run(lp) for lp in program["loops"]), static


def op_files(dump_dir: str) -> dict[str, str]:
    """HLO op name -> its final_bundles file (program prologue/epilogue pieces left out)."""
    files = {}
    for path in sorted(glob.glob(os.path.join(dump_dir, "*final_bundles.txt"))):
        m = re.match(r"^\d+-(.+)-\d+-final_bundles\.txt$", os.path.basename(path))
        if m and "schedule-analysis" not in path and not m.group(1).startswith("<") and m.group(1) != "TLP":
            files[m.group(1)] = path
    return files
