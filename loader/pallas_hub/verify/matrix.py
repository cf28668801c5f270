"""The compile matrix: every declared kernel configuration x TPU generation, compiled ahead of time.

Each kernel declares its configurations in ``kernels/<key>/compile_matrix.py``::

    def configs(kernel) -> list[Config]   # kernel: the built, imported kernel package

A configuration declared supported must compile for every chip it names; one declared
unsupported (``fails_with=``) must fail with that compiler message, which proves the check can fail.

``check(specs, timeout=S)`` (what ``pallas-hub check`` runs) compiles in a worker process, so that a
configuration that compiles for longer than S seconds is stopped, reported as timed out, and the
rest goes on in a new worker; progress lines show i/N and the time left.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import select
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from ..hub import manifest as mf
from ..vendored._chips import DEFAULT_CHIPS
from .compiler import CompileResult, compile_for_tpu


@dataclasses.dataclass
class Config:
    name: str
    fn: Callable | None
    args: tuple  # ShapeDtypeStructs (pytrees allowed)
    static: dict[str, Any] = dataclasses.field(default_factory=dict)
    # None: supported, must compile. Otherwise declared unsupported: the compiler must fail with a
    # message containing this text (a crash elsewhere does not count as the expected failure).
    fails_with: str | None = None
    chips: tuple[str, ...] = DEFAULT_CHIPS
    topology: str | None = None  # e.g. "v6e:2x4" for 8-chip sharded programs (args carry shardings)


@dataclasses.dataclass
class Row:
    kernel: str
    config: Config
    result: CompileResult

    @property
    def as_expected(self) -> bool:
        expected = self.config.fails_with
        if expected is None:
            return self.result.ok
        return not self.result.ok and expected in (self.result.error or "")

    def line(self) -> str:
        verdict = self.result.summary()
        if self.config.fails_with is not None:
            verdict = ("fails as declared: " if self.as_expected else
                       f"NOT THE DECLARED FAILURE ({self.config.fails_with!r}): ") + (self.result.error or "compiled")
        return f"{self.kernel:<18} {self.config.name:<48} {self.result.chip:<6} {verdict}"


def load_configs(matrix_file: Path, kernel_module) -> list[Config]:
    spec = importlib.util.spec_from_file_location(f"_compile_matrix_{abs(hash(str(matrix_file)))}", matrix_file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return list(module.configs(kernel_module))


def _items(kernel: str, configs: list[Config], chips: tuple[str, ...] | None) -> list[tuple[str, Config, str]]:
    """(kernel, config, chip) for every chip a configuration names, filtered by ``chips``."""
    return [(kernel, c, chip) for c in configs for chip in c.chips if not chips or chip in chips]


def _compile(config: Config, chip: str) -> CompileResult:
    return compile_for_tpu(config.fn, *config.args, chip=chip, topology=config.topology, **config.static)


class _Progress:
    """``[i/N elapsed, ~left]`` in front of each row: the time left from the mean time per row so far."""

    def __init__(self, total: int, progress):
        self.total, self.progress, self.done, self.start = total, progress, 0, time.monotonic()

    def row(self, row: Row) -> None:
        self.done += 1
        if self.progress:
            elapsed = time.monotonic() - self.start
            left = elapsed / self.done * (self.total - self.done)
            self.progress(f"[{self.done:>{len(str(self.total))}}/{self.total} {_clock(elapsed)}, ~{_clock(left)} left] "
                          f"{row.line()}  [{row.result.seconds:.1f}s]")


def _clock(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 60}:{seconds % 60:02d}"


def _run_items(items: list[tuple[str, Config, str]], progress) -> list[Row]:
    counter = _Progress(len(items), progress)
    rows = []
    for kernel, config, chip in items:
        rows.append(Row(kernel, config, _compile(config, chip)))
        counter.row(rows[-1])
    return rows


def run(kernel: str, configs: list[Config], chips: tuple[str, ...] | None = None, progress=print) -> list[Row]:
    """Compile ``configs`` of one kernel in this process (no timeout); one row per configuration x chip."""
    return _run_items(_items(kernel, configs, chips), progress)


def _plan(specs: list[mf.KernelSpec], chips, build_root: Path, progress) -> list[tuple[str, Config, str]]:
    """Build and import every kernel (into ``build_root``) and list what its compile_matrix.py declares."""
    from ..hub.build import build_kernel, load_built
    from ..hub.declarations import declaration

    items = []
    for spec in specs:
        matrix = declaration(spec, "compile_matrix")
        if matrix is None:
            progress(f"{spec.name}: no compile_matrix.py, nothing declared")
            continue
        kernel = load_built(build_kernel(spec, build_root / spec.key))
        items += _items(spec.name, list(matrix.configs(kernel)), chips)
    return items


def check(specs: list[mf.KernelSpec], chips: tuple[str, ...] | None = None, progress=print,
          timeout: float | None = None) -> list[Row]:
    """Build each kernel (in a temporary folder) and compile every configuration it declares; the rows.

    ``timeout``: seconds one configuration may compile; the compiles then run in a worker process,
    which is stopped at the timeout (the row says so) and restarted for the rest. None: in this process.
    """
    if timeout is None:
        with tempfile.TemporaryDirectory(prefix="pallas-hub-check-") as tmp:
            return _run_items(_plan(specs, chips, Path(tmp), progress), progress)
    return _check_in_worker(specs, chips, progress, timeout)


# --------------------------------------------------------------------------- the worker process

def _check_in_worker(specs, chips, progress, timeout: float) -> list[Row]:
    request = {"kernels": [[str(s.path), s.key, s.source_repo] for s in specs], "chips": list(chips or ())}
    rows: list[Row] = []
    plan: list[dict] | None = None
    counter = None
    while plan is None or len(rows) < len(plan):
        worker = _Worker({**request, "skip": len(rows)})
        try:
            while plan is None or len(rows) < len(plan):
                # the plan comes after building and importing every kernel: that wait is not a compile
                try:
                    message = worker.read(None if plan is None else timeout)
                except _WorkerDied as e:
                    if plan is None:  # a kernel's sources or its compile_matrix.py fail: say which, in one message
                        raise mf.ManifestError(f"the kernels could not be built and imported for the compile matrix "
                                               f"({e})") from None
                    message, error = None, f"the compiler process died: {e}"
                else:
                    error = f"timed out: still compiling after {timeout:g}s (stopped)"
                if message is None:  # this configuration took too long or killed its process
                    item = plan[len(rows)]
                    result = CompileResult(ok=False, chip=item["chip"], topology="", seconds=timeout, error=error)
                    rows.append(Row(item["kernel"], _config(item), result))
                    counter.row(rows[-1])
                    break  # a new worker takes the rest
                if "error" in message:
                    raise mf.ManifestError(f"the kernels could not be built and imported for the compile matrix: "
                                           f"{message['error']}")
                if "plan" in message:
                    if plan is None:
                        plan = message["plan"]
                        counter = _Progress(len(plan), progress)
                        for line in message["notes"]:
                            progress(line)
                    continue
                item = plan[message["i"]]
                rows.append(Row(item["kernel"], _config(item), CompileResult(**message["result"])))
                counter.row(rows[-1])
        finally:
            worker.stop()
    return rows


def _config(item: dict) -> Config:
    """The parent's record of a configuration the worker compiled (the function stays in the worker)."""
    return Config(item["name"], None, (), fails_with=item["fails_with"], chips=(item["chip"],))


class _WorkerDied(RuntimeError):
    pass


class _Worker:
    """A Python process running ``_worker_main``: JSON lines out (the plan, then one result per row); its stderr
    goes to a file, shown only if the worker dies."""

    def __init__(self, request: dict):
        self.log = tempfile.TemporaryFile()
        package_parent = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([package_parent, *filter(None, [os.environ.get("PYTHONPATH")])]),
               "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-c", "from pallas_hub.verify.matrix import _worker_main; "
                                      "_worker_main()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                     env=env)
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.close()
        self.buffer = b""

    def read(self, timeout: float | None) -> dict | None:
        """The next message, or None after ``timeout`` seconds without one; raises if the worker died."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select([self.proc.stdout], [], [], wait)
            if not ready:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                self.proc.wait()
                self.log.seek(0)
                tail = self.log.read().decode(errors="replace").strip().splitlines()[-15:]
                raise _WorkerDied(f"exit status {self.proc.returncode}" + "".join(f"\n  {line}" for line in tail))
            self.buffer += chunk
        line, self.buffer = self.buffer.split(b"\n", 1)
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.proc.stdout.close()
        self.log.close()


def _worker_main() -> None:
    request = json.loads(sys.stdin.readline())
    out = sys.stdout
    sys.stdout = sys.stderr  # whatever a kernel prints stays out of the protocol
    specs = [mf.load_kernel(Path(path), key, source) for path, key, source in request["kernels"]]
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pallas-hub-check-") as tmp:
        try:
            items = _plan(specs, tuple(request["chips"]), Path(tmp), notes.append)
        except Exception as e:  # a kernel's sources or compile_matrix.py: where, and what
            frame = traceback.extract_tb(e.__traceback__)[-1]
            out.write(json.dumps({"error": f"{frame.filename}:{frame.lineno}: {type(e).__name__}: {e}"}) + "\n")
            out.flush()
            return
        plan = [{"kernel": k, "name": c.name, "chip": chip, "fails_with": c.fails_with} for k, c, chip in items]
        out.write(json.dumps({"plan": plan, "notes": notes}) + "\n")
        out.flush()
        for i in range(request["skip"], len(items)):
            _, config, chip = items[i]
            result = dataclasses.asdict(_compile(config, chip))
            out.write(json.dumps({"i": i, "result": result}) + "\n")
            out.flush()


def report(rows: list[Row], progress=print) -> int:
    """Print the summary (and every row not as declared); 1 if any row is not as declared, else 0."""
    bad = [r for r in rows if not r.as_expected]
    ok = sum(r.result.ok for r in rows)
    progress(f"\ncompile matrix: {len(rows)} configurations x chips, {ok} compiled, "
             f"{len(rows) - ok} failed, {len(bad)} not as declared")
    for r in bad:
        progress("  NOT AS DECLARED: " + r.line())
    return 1 if bad else 0
