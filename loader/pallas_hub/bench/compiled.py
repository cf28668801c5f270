"""Compile each benchmarked program ahead of time for a TPU generation and keep what the cost model reads.

For one (implementation, problem, chip) the whole program (the kernels and the XLA ops around
them) is compiled by XLA:TPU + Mosaic for the chip's compile-only topology, in a worker process
started with libtpu's LLO dump flags (``llo.flags``: libtpu reads them once, when it loads). The
worker keeps, per program, a profile (JSON):

* ``hlo``: the compiled program (the HLO text libtpu wrote, compressed; see ``compiled_hlo``); ``ops(profile)`` reads its
  top-level ops (the ENTRY computation's): each runs as its own program piece on the TensorCore,
  reading its operands from HBM and writing its result there. Per op: its HBM bytes (in-place
  updates count the update, gathers what they gather), whether it is a Pallas kernel
  (``tpu_custom_call``) or offloaded to the SparseCores;
* ``programs``: per op, its schedule from the LLO dump (``llo.analyse``: kernels keep their loop
  tree, other ops the bundles one run issues);
* ``memory``: XLA's memory analysis (the temporaries the program keeps in HBM), ``cost_analysis``.

Profiles are cached under ``$PALLAS_HUB_CACHE`` (default ``~/.cache/pallas-hub``) ``/llo/<key>.json``,
``key`` a digest of everything the compile depends on (the implementation's sources, the problem's
shapes, the chip, jax/libtpu versions), so a re-run compiles only what changed.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Callable

from . import llo

PROFILE_VERSION = 2  # bump when what a profile holds changes: old cache entries are then ignored


def cache_dir() -> Path:
    return Path(os.environ.get("PALLAS_HUB_CACHE", Path.home() / ".cache" / "pallas-hub")) / "llo"


@dataclasses.dataclass(frozen=True)
class Job:
    impl: str
    problem: tuple  # the problem's recipe (problems.rebuild)
    chip: str
    options: tuple = ()  # (name, value) pairs the implementation takes (e.g. a tiling)
    sources: str = ""  # digest of the implementation's code
    static_profile: bool = False  # also libtpu's static LLO profile (validation compiles only)

    @property
    def key(self) -> str:
        import jax
        import jaxlib

        from .problems import signature

        try:
            import importlib.metadata as md

            libtpu = md.version("libtpu")
        except Exception:
            libtpu = "?"
        problem = list(self.problem) if self.impl.startswith("validate:") else signature(_rebuild(self.problem))
        reader = hashlib.sha256(Path(llo.__file__).read_bytes()).hexdigest()  # how schedules are read
        text = json.dumps([PROFILE_VERSION, reader, self.impl, problem, self.chip, list(self.options), self.sources,
                           self.static_profile, jax.__version__, jaxlib.__version__, libtpu], default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:24]

    def to_dict(self) -> dict:
        return {"impl": self.impl, "problem": list(self.problem), "chip": self.chip,
                "options": [list(o) for o in self.options], "sources": self.sources,
                "static_profile": self.static_profile}


# --------------------------------------------------------------------------- the compiled HLO

_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
                "s64": 8, "u64": 8, "f64": 8, "f8e4m3fn": 1, "f8e5m2": 1, "s4": 0.5, "u4": 0.5}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([0-9,]*)\](\{[^}]*\})?")
_FREE = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "after-all", "partition-id",
         "replica-id", "opt-barrier"}
_IN_PLACE = {"dynamic-update-slice", "scatter"}
_PARTIAL_READ = {"gather", "dynamic-slice", "slice", "slice-start"}


def _bytes(type_text: str, vmem: bool = False) -> int:
    """HBM bytes of every array in an HLO type (buffers laid out in VMEM, ``S(1)``, excluded unless ``vmem``)."""
    total = 0
    for dt, dims, layout in _ARRAY.findall(type_text):
        if layout and "S(1)" in layout and not vmem:
            continue
        total += int(math.prod(int(d) for d in dims.split(",") if d) * _DTYPE_BYTES[dt])
    return total


def _tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of a tuple type ``(a, (b, c), d)``; [type_text] if not a tuple."""
    t = type_text.strip()
    if not t.startswith("("):
        return [t]
    out, depth, start = [], 0, 1
    for i, ch in enumerate(t):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            out.append(t[start:i])
            start = i + 1
    out.append(t[start:-1])
    return out


def _output_type(opcode: str, type_text: str) -> str:
    """The buffer an op writes: an async start's or update's tuple also holds its operands (copy-start:
    (dst, src, context); call-start and custom-call-update, e.g. XLA:TPU's SparseCore gather offload:
    ((operands), result, ...)), which are not written."""
    if opcode == "copy-start":
        return _tuple_elements(type_text)[0]
    if opcode.endswith("-start") or opcode.endswith("-update"):
        parts = _tuple_elements(type_text)
        return parts[1] if len(parts) > 1 else parts[0]
    return type_text


def _instructions(hlo: str):
    """(computation name, is ENTRY, instruction text) for every instruction; an instruction's text
    may span lines (backend configs hold newlines)."""
    comp, entry, current = None, False, None
    for line in hlo.splitlines():
        head = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            comp, entry = head.group(2), bool(head.group(1))
            continue
        if line.strip() == "}" and not line.startswith("  "):
            if current:
                yield current
            comp, current = None, None
            continue
        if comp is None:
            continue
        if re.match(r"^\s+(?:ROOT\s+)?%[\w.\-]+\s*=", line):
            if current:
                yield current
            current = (comp, entry, line)
        elif current:
            current = (current[0], current[1], current[2] + "\n" + line)


def entry_ops(hlo: str) -> list[dict]:
    """The top-level ops of a compiled module, with the HBM bytes each moves."""
    instructions = list(_instructions(hlo))
    roots: dict[str, str] = {}  # computation -> opcode of its ROOT
    for comp, _, text in instructions:
        m = re.match(r"\s*ROOT\s+%?[\w.\-]+\s*=\s*.+?\s([a-z][a-z\-]*)\(", text)
        if m:
            roots[comp] = m.group(1)
    types: dict[str, str] = {}
    ops = []
    for _, entry, text in instructions:
        if not entry:
            continue
        m = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s([a-z][a-z\-]*)\((.*)", text, re.S)
        if not m:
            continue
        name, type_text, opcode, rest = m.groups()
        types[name] = type_text
        operands = re.findall(r"%([\w.\-]+)", rest.split(")")[0])
        calls = re.search(r"calls=%?([\w.\-]+)", text)
        target = re.search(r'custom_call_target="([^"]+)"', text)
        root = roots.get(calls.group(1)) if calls and opcode == "fusion" else opcode
        out = _bytes(_output_type(opcode, type_text))
        ins = [_bytes(types.get(o, "")) for o in operands]
        if opcode in _FREE or opcode.endswith("-done"):
            hbm = 0  # an async pair's bytes are counted at its start
        elif root in _IN_PLACE:  # the output aliases the buffer operand: only the update moves
            big = max(range(len(ins)), key=lambda i: ins[i]) if ins else None
            hbm = 2 * sum(b for i, b in enumerate(ins) if i != big)
        elif root in _PARTIAL_READ:  # reads what it extracts (into HBM or VMEM), not the whole operand
            size = _bytes(_output_type(opcode, type_text), vmem=True)
            hbm = out + sum(min(b, size) for b in ins)
        else:
            hbm = out + sum(ins)
        kernel = opcode == "custom-call" and bool(target) and target.group(1) == "tpu_custom_call"
        # a kernel's text without any name: identical calls (the same kernel on other operands) share one
        # compiled program, and the LLO dump holds it under the first one's name only
        same = re.sub(r"%[\w.\-]+", "%", type_text + rest) if kernel else None
        ops.append({"name": name, "opcode": opcode, "root": root, "hbm_bytes": hbm, "same": same, "kernel": kernel,
                    "offloaded": 'async_execution_thread="sparsecore"' in text, "free": opcode in _FREE})
    return ops


# --------------------------------------------------------------------------- the worker

def _rebuild(recipe):
    from .problems import rebuild

    return rebuild(recipe)


def compiled_hlo(dump: Path) -> str:
    """The compiled program's HLO text, as libtpu wrote it into the dump (its top-level program,
    ``*-TLP-hlo.txt``). Not ``compiled.as_text()``: jaxlib 0.10.2 cannot read back what libtpu 0.0.52
    compiles for programs with async ops ("async-update instruction should have 1 operands but sees 4",
    e.g. any grouped-matmul MoE layer); where it can, both give the same entry ops."""
    found = sorted(dump.glob("*-TLP-hlo.txt"))
    if len(found) != 1:
        raise RuntimeError(f"expected one compiled program (*-TLP-hlo.txt) in the LLO dump {dump}, found {len(found)}")
    return found[0].read_text()


def _compile_one(job: dict, dump: Path) -> dict:
    """In the worker: compile one program and read its LLO dump (``dump`` is where libtpu writes)."""
    import contextlib

    import jax

    from . import runner, validate
    from ..verify import tpu_devices
    from ..vendored._chips import chip as get_chip

    device = tpu_devices(get_chip(job["chip"]).topology)[0]
    if job["impl"].startswith("validate:"):
        fn, args, donate = validate.compile_target(job["problem"], device)
        context = contextlib.nullcontext
    else:
        fn, args, donate, context = runner.compile_target(job["impl"], job["problem"], job["chip"], dict(job["options"]),
                                                          device)
    for f in dump.rglob("*"):
        if f.is_file():
            f.unlink()
    start = time.perf_counter()
    with context():
        compiled = jax.jit(fn, donate_argnums=donate).trace(*args).lower(lowering_platforms=("tpu",)).compile()
    seconds = time.perf_counter() - start
    ca = compiled.cost_analysis() or {}
    ca = ca[0] if isinstance(ca, list) else ca
    mem = compiled.memory_analysis()
    hlo = compiled_hlo(dump)
    programs = {}
    for op in entry_ops(hlo):
        path = llo.op_files(str(dump)).get(op["name"]) if not op["free"] else None
        if path is None:
            continue
        program = llo.analyse(llo.read_bundles(path))
        if not op["kernel"]:  # other ops: the bundles one run issues is all the model reads
            n, static = llo.executed_bundles(program)
            program = {"executed_bundles": n, "static": static}
        programs[op["name"]] = program
    static = {}
    for path in dump.glob("profile/*.textproto"):
        for m in re.finditer(r'hlo_op_name: "([^"]+)"\s+estimated_cycles: (\d+)', path.read_text()):
            static[m.group(1)] = int(m.group(2))
    return {"version": PROFILE_VERSION, "job": job, "compile_seconds": seconds, "static_cycles": static,
            "cost_analysis": {k: float(v) for k, v in ca.items() if isinstance(v, (int, float))},
            "memory": None if mem is None else {k: int(getattr(mem, k)) for k in
                                                ("argument_size_in_bytes", "output_size_in_bytes",
                                                 "temp_size_in_bytes", "alias_size_in_bytes")},
            "hlo": base64.b64encode(zlib.compress(hlo.encode(), 6)).decode(), "programs": programs}


def ops(profile: dict) -> list[dict]:
    """The profile's top-level ops (``entry_ops`` of its compiled HLO) with their schedules (``program``)."""
    hlo = zlib.decompress(base64.b64decode(profile["hlo"])).decode()
    out = [op for op in entry_ops(hlo) if not op["free"]]
    for op in out:
        op["program"] = profile["programs"].get(op["name"])
    shared = {op["same"]: op["program"] for op in out if op["same"] is not None and op["program"] is not None}
    for op in out:  # identical kernel calls: one compiled program
        if op["program"] is None and op["same"] in shared:
            op["program"] = shared[op["same"]]
    return out


@functools.cache  # read once per process, not once per cached failure
def _harness() -> str:
    """A cached failure holds only while the code that built the program is the same (a harness bug is not the
    compiler's verdict)."""
    here = Path(__file__).parent
    return hashlib.sha256(b"".join((here / f).read_bytes() for f in ("compiled.py", "runner.py", "validate.py",
                                                                       "problems.py"))).hexdigest()[:16]


def _worker(job_file: str, dump: str) -> None:
    """python -m pallas_hub.bench.compiled JOB_FILE DUMP_DIR: compile one job, one line on stdout."""
    item = json.loads(Path(job_file).read_text())
    out = Path(item["out"])
    try:
        profile = _compile_one(item["job"], Path(dump))
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(profile))
        tmp.replace(out)
        print(f"DONE {item['key']} {profile['compile_seconds']:.1f}", flush=True)
    except Exception as e:  # report it: the caller goes on with the other programs
        from ..verify import first_line

        if not isinstance(e, (MemoryError, OSError)):  # the compiler's own verdict: the same inputs fail again
            out.write_text(json.dumps({"version": PROFILE_VERSION, "job": item["job"], "error": first_line(e),
                                       "harness": _harness()}))
        print(f"FAIL {item['key']} {first_line(e)}", flush=True)


def profiles(jobs: list[Job], *, progress: Callable = print, workers: int = 1, timeout: float = 3600) -> dict[str, dict]:
    """Profile per job key: from the cache, else compiled by up to ``workers`` processes at a time.

    Each program compiles in a fresh process: a compile's schedule must not depend on what the process
    compiled before (it did: vLLM TPU's ragged_paged_attention v3 came out with other loops after other
    programs), and libtpu reads its flags (the dump directory) once per process.
    A failed compile gives ``{"error": message}`` (never a guessed profile); the compiler's errors are cached
    like profiles (same key), a crashed or stalled process's are not. ``timeout``: seconds a process may take."""
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    result: dict[str, dict] = {}
    todo = []
    for job in jobs:
        key = job.key
        path = cache / f"{key}.json"
        if path.exists():
            try:
                cached = json.loads(path.read_text())
                if "error" not in cached or cached.get("harness") == _harness():
                    result[key] = cached
                    continue
            except json.JSONDecodeError:
                path.unlink()
        todo.append({"key": key, "job": job.to_dict(), "out": str(path)})
    if not todo:
        return result
    progress(f"  compiling {len(todo)} programs for TPU ahead of time ({len(jobs) - len(todo)} cached), "
             f"{workers} at a time, each in a fresh process")
    tmp = Path(tempfile.mkdtemp(prefix="pallas-hub-llo-"))
    running: dict = {}  # process -> (item, started, its stdout's file)
    start = time.perf_counter()
    try:
        for n, item in enumerate(todo):
            while len(running) >= max(workers, 1):
                _finish(running, result, progress, timeout, start, todo)
            job_file, dump, log = tmp / f"job{n}.json", tmp / f"dump{n}", tmp / f"job{n}.out"
            job_file.write_text(json.dumps(item))
            dump.mkdir()
            flags = llo.flags(str(dump)) + (f" --xla_jf_dump_static_llo_profile_to={dump}/profile"
                                            if item["job"]["static_profile"] else "")
            env = dict(os.environ, LIBTPU_INIT_ARGS=flags, JAX_PLATFORMS="cpu",
                       ALLOW_MULTIPLE_LIBTPU_LOAD="1", TPU_ACCELERATOR_TYPE=os.environ.get("TPU_ACCELERATOR_TYPE", ""))
            with log.open("w") as stdout:  # a file, not a pipe: output nobody reads while it runs cannot block it
                proc = subprocess.Popen([sys.executable, "-m", "pallas_hub.bench.compiled", str(job_file), str(dump)],
                                        stdout=stdout, stderr=subprocess.DEVNULL, env=env)
            running[proc] = (item, time.perf_counter(), log)
        while running:
            _finish(running, result, progress, timeout, start, todo)
    finally:
        for proc in running:
            proc.kill()
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def _finish(running: dict, result: dict, progress: Callable, timeout: float, start: float, todo: list) -> None:
    """Wait for one of the running compile processes to end (or be stopped past ``timeout``) and record it."""
    while True:
        for proc, (item, started, log) in list(running.items()):
            stalled = time.perf_counter() - started > timeout
            if proc.poll() is None and not stalled:
                continue
            if stalled:
                proc.kill()
            proc.wait()
            del running[proc]
            line = next((ln for ln in log.read_text().splitlines() if ln.startswith(("DONE ", "FAIL "))), "")
            parts = line.split(" ", 2)
            if parts[0] == "DONE":
                result[item["key"]] = json.loads(Path(item["out"]).read_text())
                what = f"{float(parts[2]):.0f}s"
            else:
                error = parts[2].strip() if len(parts) == 3 else (
                    f"the compile process stopped past {timeout:.0f}s" if stalled else
                    f"the compile process ended without a result (exit code {proc.returncode})")
                result[item["key"]] = {"error": error}
                what = "FAILED: " + error
            done = sum(t["key"] in result for t in todo)
            elapsed = time.perf_counter() - start
            eta = elapsed / done * (len(todo) - done)
            j = item["job"]
            progress(f"  [{done}/{len(todo)} {elapsed:5.0f}s, ETA {eta:4.0f}s] compiled {_name(j['problem'])} | {j['impl']} "
                     f"| {j['chip']}: {what}")
            return
        time.sleep(0.2)


def _name(recipe) -> str:
    try:
        return _rebuild(recipe).name
    except Exception:
        return " ".join(map(str, recipe))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
