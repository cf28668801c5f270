"""What a kernel folder declares for pallas-hub beside its package, one module per command:

``kernels/<key>/compile_matrix.py`` (``pallas-hub check``)
    ``configs(kernel) -> list[pallas_hub.verify.matrix.Config]``: the configurations to compile per TPU generation.
``kernels/<key>/bench_problems.py`` (``pallas-hub bench``), either or both of
    ``FAMILY = "moe" | "prefill" | "decode"`` and ``implementation(kernel) -> BenchImpl``: race the
    benchmark's whole-layer problems of that family (real model shapes, pallas_hub.bench.problems) and
    its anchors, calling this kernel as ``BenchImpl`` says (the family's calling convention, below);
    ``problems(kernel) -> list[BenchProblem]``: problems of the kernel's own (no anchor to race); their
    checks run in tests/test_declarations.py, but the benchmark does not model them yet.

The families' calling conventions (``chip`` is the TPU generation being modelled):
    moe      ``fn(x [T, H], ids [T, k], weights [T, k], gate_up [E, 2I, H], down [E, H, I], logits [T, E],
             *, top_k, chip) -> [T, H]`` (one experts layer, transformers' weight layout)
    prefill  ``fn(q [1, Hq, S, D], k, v [1, Hkv, S, D], *, scale, chip) -> [1, Hq, S, D]`` (causal); a prefill
             also races the training step (family "train"): the benchmark differentiates ``fn`` with jax.vjp,
             as it does every anchor's, so ``fn`` must be differentiable in q, k and v
    decode   ``fn(q [B, Hq, D], new_k, new_v [B, Hkv, D], k_pages, v_pages [P, page, Hkv, D], lengths [B],
             table [B, pages], *, scale, chip) -> (out [B, Hq, D], k_pages, v_pages)`` (write the new
             token's K/V at ``lengths - 1``, then attend over ``[0, lengths)``; the caches are donated)
    Quantized problems (``BenchImpl.formats``; pallas_hub.bench.problems.QUANT_FORMATS) append the scales:
    moe ``gate_up_scale, down_scale`` after ``logits`` (the weights as checkpoints store them: fp8 e4m3
    with f32 [E, out/128, in/128] block scales, int8 with f32 [E, out]; MXFP4 as from_pretrained_mxfp4 stores
    it, uint8 [E, in/2, out] with uint8 e8m0 [E, in/32 padded to 32 rows, out], gate_up's columns interleaved
    gate, up, ... as GPT-OSS's are); decode
    ``k_scale, v_scale`` (f32 [Hkv]) after ``table``, the caches in fp8 e4m3 or int8.
``kernels/<key>/demo_check.py`` (``pallas-hub demo``)
    ``check(kernel, out=print) -> list[tuple[str, bool]]``: the kernel fetched from the local hub against
    an independent reference; each (name, ok) is one line of the demo's summary.

``kernel`` is always the built package as ``kernels.get_kernel`` imports it. None of these files is
published: they describe how this repository checks the kernel (``benchmarks/benchmark*.py`` is what
ships, for ``kernels benchmark``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from .manifest import KernelSpec, ManifestError

FAMILIES = ("moe", "prefill", "decode")  # the families a kernel may declare (the bench derives "train" from prefill)


@dataclasses.dataclass
class BenchImpl:
    """How the benchmark calls this kernel on its family's problems:
    ``fn(*prepare(*args, params=problem.params), chip=, **kwargs)``."""

    fn: Callable
    per_chip: bool = False  # the kernel's counts depend on the chip (tiling per TPU generation)
    prepare: Callable | None = None  # (*arrays, params=) -> this kernel's layout, outside cost and timing
    context: Callable | None = None  # chip -> a context manager the kernel is traced in (e.g. its chip answered)
    donate: tuple = ()  # argument positions the layer updates in place (the decode caches)
    formats: tuple = ("bf16",)  # the storage formats of the family's problems it takes (quantized: scales appended)


def chip_answered(module: ModuleType) -> Callable:
    """A ``BenchImpl.context`` for a kernel that asks ``module.current_chip()`` which TPU generation it
    runs on (to tile, or to pick a conversion): traced for a modelled chip, it is told that one."""

    @contextlib.contextmanager
    def context(chip: str):
        saved = module.current_chip
        module.current_chip = lambda: chip
        try:
            yield
        finally:
            module.current_chip = saved

    return context


@dataclasses.dataclass
class BenchCheck:
    """A reduced concrete case of a problem, run in interpret mode against ``reference``."""

    args: tuple
    kwargs: dict
    reference: Any
    shape: str  # what the case is, for the report
    tol: float  # max |err| / max |reference|


@dataclasses.dataclass
class BenchProblem:
    """One problem of the kernel's own: ``fn(*args, **kwargs)`` with bulk data as ShapeDtypeStructs (what the
    cost model sees) and steering values concrete; the minimum bytes and flops it needs (the roofline)."""

    name: str
    fn: Callable
    args: tuple
    kwargs: dict
    min_bytes: int
    min_flops: int
    check: Callable[[], BenchCheck]
    params: dict = dataclasses.field(default_factory=dict)
    per_chip: bool = False


def declaration(spec: KernelSpec, name: str) -> ModuleType | None:
    """``kernels/<key>/<name>.py`` imported (once per process and file), or None when the kernel has none."""
    path = Path(spec.path) / f"{name}.py"
    if not path.is_file():
        return None
    module_name = f"_pallas_hub_{name}_{spec.key}_{abs(hash(str(path.resolve()))):x}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    loader_spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[module_name] = module
    try:
        loader_spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


def bench_declaration(spec: KernelSpec, kernel) -> tuple[tuple[str, BenchImpl] | None, list[BenchProblem]]:
    """((family, how to call the kernel) or None, the kernel's own problems) from its bench_problems.py;
    a kernel declaring neither is a ManifestError (the benchmark would skip it silently)."""
    module = declaration(spec, "bench_problems")
    where = spec.path / "bench_problems.py"
    if module is None:
        raise ManifestError(f"{where}: missing; a kernel declares what `pallas-hub bench` runs (see "
                            "pallas_hub/hub/declarations.py, or what `pallas-hub new` generates)")
    family = getattr(module, "FAMILY", None)
    raced = None
    if family is not None:
        if family not in FAMILIES or not callable(getattr(module, "implementation", None)):
            raise ManifestError(f"{where}: FAMILY must be one of {FAMILIES} with an implementation(kernel) -> BenchImpl; "
                                f"got FAMILY = {family!r}")
        raced = (family, module.implementation(kernel))
    own = list(module.problems(kernel)) if callable(getattr(module, "problems", None)) else []
    if raced is None and not own:
        raise ManifestError(f"{where}: declares no problems: set FAMILY and implementation(kernel), or problems(kernel)")
    return raced, own
