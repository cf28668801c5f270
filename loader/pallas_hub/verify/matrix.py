"""The compile matrix: every declared kernel configuration x TPU generation, compiled ahead of time.

Each kernel declares its configurations in ``kernels/<key>/compile_matrix.py``::

    def configs(kernel) -> list[Config]   # kernel: the built, imported kernel package

A configuration declared supported must compile for every chip it names; one declared
unsupported (``fails_with=``) must fail with that compiler message, which proves the check can fail.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..hub import manifest as mf
from ..vendored._chips import DEFAULT_CHIPS
from .compiler import CompileResult, compile_for_tpu


@dataclasses.dataclass
class Config:
    name: str
    fn: Callable
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


def run(kernel: str, configs: list[Config], chips: tuple[str, ...] | None = None, progress=print) -> list[Row]:
    rows = []
    for config in configs:
        for chip in config.chips:
            if chips and chip not in chips:
                continue
            result = compile_for_tpu(config.fn, *config.args, chip=chip, topology=config.topology, **config.static)
            row = Row(kernel, config, result)
            rows.append(row)
            if progress:
                progress(row.line() + f"  [{result.seconds:.1f}s]")
    return rows


def check(specs: list[mf.KernelSpec], chips: tuple[str, ...] | None = None, progress=print) -> list[Row]:
    """Build each kernel (in a temporary folder) and compile every configuration it declares; the rows."""
    from ..hub.build import build_kernel, load_built

    rows = []
    with tempfile.TemporaryDirectory(prefix="pallas-hub-check-") as tmp:
        for spec in specs:
            matrix_file = spec.path / "compile_matrix.py"
            if not matrix_file.exists():
                progress(f"{spec.name}: no compile_matrix.py, nothing declared")
                continue
            kernel = load_built(build_kernel(spec, Path(tmp) / spec.key))
            rows += run(spec.name, load_configs(matrix_file, kernel), chips, progress=progress)
    return rows


def report(rows: list[Row], progress=print) -> int:
    """Print the summary (and every row not as declared); 1 if any row is not as declared, else 0."""
    bad = [r for r in rows if not r.as_expected]
    ok = sum(r.result.ok for r in rows)
    progress(f"\ncompile matrix: {len(rows)} configurations x chips, {ok} compiled, "
             f"{len(rows) - ok} failed, {len(bad)} not as declared")
    for r in bad:
        progress("  NOT AS DECLARED: " + r.line())
    return 1 if bad else 0
