"""pallas-hub bench: our kernels against the anchors as whole layers on real model shapes (TPU cost model).

For every problem (``bench.problems``) and implementation (ours from the manifest, the anchors of
``bench.anchors``; the training step races every prefill implementation differentiated, ``training_step``),
on v5e, v6e and TPU7x:

1. counts: ``costmodel.estimate`` follows the layer's kernels on the problem's real routing,
   lengths and page tables (per grid step: blocks moved, DMAs, dots executed, loop iterations);
   anchors with a tiling to choose also get the best tiling this model finds (``search_tiling``);
2. schedule: the whole layer is compiled ahead of time for the chip (``bench.compiled``, cached):
   the XLA ops around the kernels with their HBM bytes and the kernels' VLIW schedules;
3. time: ``bench.stepmodel`` (v2: per step, DMA vs compiled compute, plus the XLA glue), at 0,
   0.35 and 0.7 us per step; beside it the whole-call model it replaces (v1, kernels only);
4. numerics: each implementation in CPU interpret mode at a reduced shape against a plain-JAX
   reference (kernels that cannot run interpreted on this jax: their own reference instead, said so).

Results: ``benchmarks/results/bench.json``; ``bench.report`` renders every published figure from it
(benchmarks/README.md, kernels/*/benchmarks/RESULTS.md, the generated block of each CARD.md) and
the plots. A run of a subset of the families writes ``benchmarks/results/partial/`` only.
On a TPU host (``timing.tpu_host()``) the rows are also timed for real (``tpu_bench``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib
import json
import logging
import os
import pickle
import time
from pathlib import Path
from typing import Any, Callable

from .. import verify  # noqa: F401  (CPU-only JAX set-up before jax loads)
from . import anchors, compiled, costmodel, stepmodel
from .problems import MODELS, Problem, problems, rebuild, signature
from ..vendored._chips import DEFAULT_CHIPS, chip as get_chip
from ..hub.manifest import ROOT

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
FAMILIES = ("moe", "prefill", "decode", "train")
DIFFERENTIATED = {"train": "prefill"}  # a family raced by another's implementations, differentiated (training_step)
BENCH_FILES = ("anchors.py", "compiled.py", "costmodel.py", "llo.py", "problems.py", "runner.py",
               "stepmodel.py", "validate.py", "vllm_tpu.py")


# --------------------------------------------------------------------------- implementations

@dataclasses.dataclass
class Impl:
    name: str
    kind: str  # "ours" | "anchor"
    family: str
    fn: Callable | None  # fn(*args in this implementation's layout, chip=, **problem kwargs, **options)
    missing: str = ""  # why fn is None
    source: str = ""  # ours: the kernel folder it was built from
    prepare: Callable | None = None  # (*arrays, params=) -> this layout (load time: outside cost and timing)
    search: Callable | None = None  # (problem, chip) -> options: the best tiling the model finds
    context: Callable | None = None  # chip -> context manager the tracing runs in
    cost: Callable | None = None  # (problem, args, chip, options) -> Cost, when estimate cannot follow the kernel
    reference: Callable | None = None  # not runnable interpreted: the library's own reference, same signature
    donate: tuple = ()  # arguments the layer updates in place (decode caches)
    needs_device: bool = False  # fn takes device= (a mesh of one TPU device)
    per_chip: bool = True  # counts depend on the chip (tiling, block sizes)
    formats: tuple = ("bf16",)  # the problems' storage formats it takes (problems.QUANT_FORMATS)
    digest: str = ""  # its sources, for the compile cache and the staleness check
    note: str = ""
    no_backward: str = ""  # why a prefill cannot be differentiated (its training-step row says so)

    def call(self, kwargs: dict, chip: str, options: dict | None = None, **extra) -> Callable:
        return functools.partial(self.fn, chip=chip, **kwargs, **(options or {}), **extra)

    def args(self, args: tuple, params: dict) -> tuple:
        return tuple(self.prepare(*args, params=params)) if self.prepare else tuple(args)

    def tracing(self, chip: str):
        stack = contextlib.ExitStack()
        stack.enter_context(anchors.tpu_info_on_cpu(chip))
        if self.context is not None:
            stack.enter_context(self.context(chip))
        return stack


def training_step(impl: Impl) -> Impl:
    """``impl`` (a prefill) as a training step: fn(q, k, v, do) -> (out, dq, dk, dv), the same transform (JAX's
    vjp of its forward) for ours and every anchor, so each runs the backward its library defines."""
    fn = impl.fn
    carried = [f for f in ("prepare", "reference", "cost", "search", "donate") if getattr(impl, f)]
    if carried:  # each takes or models the forward's arguments only
        return dataclasses.replace(impl, family="train", fn=None,
                                   missing=f"its {', '.join(carried)} cannot be carried into a training step")

    def train(q, k, v, do, **kwargs):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, **kwargs), q, k, v)
        return (out,) + vjp(do)

    if impl.no_backward:
        return dataclasses.replace(impl, family="train", fn=None, missing=f"no backward: {impl.no_backward}")
    return dataclasses.replace(impl, family="train", fn=None if fn is None else train)


def _map(x, fn_array, fn_shape):
    """Apply a layout change to an array, or to a ShapeDtypeStruct's shape (bulk data stays abstract)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(fn_shape(tuple(x.shape)), x.dtype)
    return fn_array(x)


def _transpose(x, perm):
    return _map(x, lambda a: jnp.transpose(a, perm), lambda s: tuple(s[i] for i in perm))


def _moe_gmm_layout(x, ids, w, gate_up, down, logits, params=None):
    """Weights in the layout grouped matmuls take: [E, H, 2I] and [E, I, H]."""
    return x, ids, w, _transpose(gate_up, (0, 2, 1)), _transpose(down, (0, 2, 1))


def _pad(x, widths: dict):
    """Zero-pad axes of an array (or a ShapeDtypeStruct's shape) at their ends: {axis: new size}."""
    def shape(s):
        return tuple(widths.get(d, n) for d, n in enumerate(s))

    return _map(x, lambda a: jnp.pad(a, [(0, n - a.shape[d]) for d, n in enumerate(shape(a.shape))]), shape)


def _moe_fused_layout(x, ids, w, gate_up, down, logits, gate_up_scale=None, down_scale=None, params=None):
    """fused_moe v1's inputs: tokens, router logits, w1 [E, 2, H', I'], w2 [E, I', H'] zero-padded to the
    sizes vLLM TPU loads them at (``anchors.fused_moe_v1_sizes``); int8 per-channel scales as its
    sub-channel scales of one channel's whole input (w1_scale [E, 2, 1, 1, I'], w2_scale [E, 1, 1, H']:
    the same quantization as ours)."""
    def w1(a):  # [E, 2I, H] -> [E, 2, I, H] -> [E, 2, H, I]
        e, i2, h = a.shape
        return jnp.transpose(a.reshape(e, 2, i2 // 2, h), (0, 1, 3, 2))

    hp, ip = anchors.fused_moe_v1_sizes(down.shape[1], down.shape[2])
    w1s = _map(gate_up, w1, lambda s: (s[0], 2, s[2], s[1] // 2))
    out = (x, logits, _pad(w1s, {2: hp, 3: ip}), _pad(_transpose(down, (0, 2, 1)), {1: ip, 2: hp}))
    if gate_up_scale is None:
        return out
    e, i2 = gate_up_scale.shape  # f32 already, as fused_moe takes them
    w1_scale = _map(gate_up_scale, lambda a: a.reshape(e, 2, 1, 1, i2 // 2), lambda s: (e, 2, 1, 1, i2 // 2))
    w2_scale = _map(down_scale, lambda a: a.reshape(e, 1, 1, -1), lambda s: (e, 1, 1, s[1]))
    return out + (_pad(w1_scale, {4: ip}), _pad(w2_scale, {3: hp}))


def _moe_anchor(grouped_matmul_of, mask_rows=False):
    """An experts layer on a grouped matmul whose tiling is an option (None: its own choice)."""
    def fn(x, ids, w, gate_up, down, *, chip, top_k, tiling=(None, None)):
        return anchors.gmm_moe_layer(grouped_matmul_of(tiling[0]), grouped_matmul_of(tiling[1]), x, ids, w, gate_up,
                                     down, mask_rows=mask_rows)

    return fn


def _gmm_shapes(problem: Problem) -> tuple[int, list[tuple[int, int]]]:
    p = problem.params
    m = anchors.ceil_to(p["tokens"] * p["top_k"], anchors.GMM_ROW_MULTIPLE)
    return m, [(p["hidden"], 2 * p["intermediate"]), (p["intermediate"], p["hidden"])]


def search_tiling(grouped_matmul_of) -> Callable:
    """The tiling per projection that the model finds best on a chip, among ``anchors.gmm_tilings``.

    Each candidate is counted by ``costmodel.estimate`` on the real group sizes and ranked by the
    per-step model with compute at the MXU rate its tile shape allows (tile edges against the MXU
    width; the compiled schedule is only read for the winner) and 0.35 us per step."""
    counted: dict = {}

    def best(problem: Problem, chip: str) -> dict:
        c = get_chip(chip)
        m, projections = _gmm_shapes(problem)
        sizes = jnp.asarray(np.bincount(np.asarray(problem.args[1]).ravel(), minlength=problem.params["experts"]),
                            jnp.int32)
        picks = []
        for k, n in projections:
            best_t = None
            for tiling in anchors.gmm_tilings(m, k, n, anchors.DEFAULT_SCOPED_VMEM[chip]):
                key = (problem.name, k, n, tiling)
                if key not in counted:
                    gmm = grouped_matmul_of(tiling)
                    try:
                        with anchors.tpu_info_on_cpu(chip):
                            counted[key] = costmodel.estimate(gmm, jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
                                                              jax.ShapeDtypeStruct((problem.params["experts"], k, n),
                                                                                   jnp.bfloat16), sizes)
                    except Exception:  # a tiling the kernel refuses
                        counted[key] = None
                cost = counted[key]
                if cost is None:
                    continue
                t = _proxy_seconds(cost, tiling, c)
                if best_t is None or t < best_t[0]:
                    best_t = (t, tiling)
            picks.append(best_t[1] if best_t else None)
        return {"tiling": tuple(picks)}

    return best


def _proxy_seconds(cost, tiling, c) -> float:
    """Per-step time with compute = flops at the MXU rate the tile shape allows (no schedule needed)."""
    tm, tk, tn = tiling
    eff = (tm / anchors.ceil_to(tm, 16)) * (tk / anchors.ceil_to(tk, c.mxu_dim)) * (tn / anchors.ceil_to(tn, c.mxu_dim))
    total = 0.0
    for call in cost.calls:
        for st in call.step_types:
            b = st.read_bytes + st.write_bytes + sum(st.dma_read) + sum(st.dma_write)
            total += st.count * max(b / c.hbm_bandwidth, sum(st.flops) / (c.peak_flops * eff) + c.step_overhead_s)
    return total


def _anchor_digest() -> str:
    """What the anchors' rows depend on: the anchor packages' versions, how they are called (anchors.py,
    vllm_tpu.py) and the adapters here that lay the problems out for them."""
    from importlib import metadata

    h = hashlib.sha256()
    for name in ("jax", "tokamax", "tpu-inference"):
        try:
            h.update(f"{name}={metadata.version(name)}\0".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{name}=none\0".encode())
    for f in ("anchors.py", "vllm_tpu.py", "runner.py"):
        h.update((Path(__file__).parent / f).read_bytes())
    return h.hexdigest()


def anchor_impls(families) -> list[Impl]:
    from . import vllm_tpu

    digest = _anchor_digest()
    out = []
    if "moe" in families:
        mb, tk = (lambda t: anchors.megablox(t or (128, 128, 128))), anchors.tokamax
        out += [
            Impl("jax megablox gmm", "anchor", "moe", _moe_anchor(mb), prepare=_moe_gmm_layout, per_chip=False,
                 note="default tiling (128, 128, 128)"),
            Impl("jax megablox gmm (best tiling)", "anchor", "moe", _moe_anchor(mb), prepare=_moe_gmm_layout,
                 search=search_tiling(mb)),
            Impl("tokamax ragged_dot", "anchor", "moe", _moe_anchor(tk, mask_rows=True), prepare=_moe_gmm_layout,
                 per_chip=False, note="its own config (tuned table, else heuristic)"),
            Impl("tokamax ragged_dot (best tiling)", "anchor", "moe", _moe_anchor(tk, mask_rows=True),
                 prepare=_moe_gmm_layout, search=search_tiling(tk)),
            Impl("vLLM TPU megablox gmm (tuned)", "anchor", "moe", _moe_anchor(lambda t: anchors.vllm_gmm()),
                 prepare=_moe_gmm_layout, context=vllm_tpu.chip, note="tpu-inference's tuned block sizes"),
            Impl("vLLM TPU fused_moe v1", "anchor", "moe", _fused_moe_fn, prepare=_moe_fused_layout,
                 context=vllm_tpu.chip, cost=_fused_moe_cost, reference=_fused_moe_reference, needs_device=True,
                 formats=("bf16", "int8"), note="routing, experts and weighted sum in one kernel; its block sizes"),
        ]
    if "prefill" in families:
        out += [
            Impl("jax flash_attention", "anchor", "prefill", _anchor_fn(anchors.jax_flash_attention), per_chip=False,
                 note="default blocks; K/V heads repeated (no GQA)"),
            Impl("jax splash_attention", "anchor", "prefill", _anchor_fn(anchors.splash_attention), per_chip=False,
                 note="default blocks; one MQA kernel per K/V head"),
            Impl("jax splash_attention (MaxText blocks)", "anchor", "prefill",
                 _anchor_fn(functools.partial(anchors.splash_attention, block=anchors.MAXTEXT_SPLASH_BLOCK)),
                 per_chip=False, note=f"every block {anchors.MAXTEXT_SPLASH_BLOCK} (MaxText's defaults; its dq and "
                                      "dK/dV kernels unfused, as splash's default); one MQA kernel per K/V head"),
            Impl("vLLM TPU flash_attention", "anchor", "prefill", _anchor_fn(anchors.vllm_flash_attention),
                 context=vllm_tpu.chip, note="its tuned parameters; K/V heads repeated (no GQA)",
                 no_backward="tpu-inference's flash_attention is an inference kernel (no custom VJP: JAX cannot "
                             "differentiate its pallas_call)"),
        ]
    if "decode" in families:
        out += [
            Impl("jax paged_attention", "anchor", "decode", _anchor_fn(anchors.jax_paged_decode), prepare=_jax_paged_layout,
                 donate=(3, 4), per_chip=False, note="128-token compute blocks; K/V written by an XLA scatter"),
            Impl("vLLM TPU ragged_paged_attention v3", "anchor", "decode", _anchor_fn(anchors.vllm_rpa_decode),
                 prepare=_rpa_layout, context=vllm_tpu.chip, donate=(3,), reference=_anchor_fn(anchors.vllm_rpa_reference),
                 note="its default block sizes; writes the new K/V itself"),
        ]
    for impl in out:
        impl.digest = digest
    return out


def _anchor_fn(f):
    def fn(*args, chip, **kwargs):
        return f(*args, **kwargs)

    return fn


def _fused_moe_fn(x, logits, w1, w2, *scales, chip, device=None, top_k):
    import numpy as onp

    device = device or jax.devices()[0]
    mesh = jax.sharding.Mesh(onp.array([device]).reshape(1, 1), ("data", "model"))
    return anchors.fused_moe_v1_layer(mesh, x, logits, w1, w2, *scales, top_k=top_k)


def _fused_moe_reference(x, logits, w1, w2, *scales, chip, top_k):
    return anchors.fused_moe_v1_layer(None, x, logits, w1, w2, *scales, top_k=top_k, reference=True)


def _fused_moe_cost(problem: Problem, chip: str, options: dict):
    p = problem.params
    quantized = p["format"] != "bf16"
    hidden, inter = anchors.fused_moe_v1_sizes(p["hidden"], p["intermediate"])
    return anchors.fused_moe_v1_cost(np.asarray(problem.args[1]), hidden, inter, p["experts"], "fused-moe",
                                     weight_bytes=problem.args[3].dtype.itemsize,
                                     channel_scales=quantized)


def _jax_paged_layout(q, new_k, new_v, k_pages, v_pages, lengths, table, params=None):
    return q, new_k, new_v, _transpose(k_pages, (2, 0, 1, 3)), _transpose(v_pages, (2, 0, 1, 3)), lengths, table


def _rpa_layout(q, new_k, new_v, k_pages, v_pages, lengths, table, params=None):
    if isinstance(k_pages, jax.ShapeDtypeStruct):
        cache = jax.ShapeDtypeStruct(anchors.rpa_cache_shape(k_pages.shape, k_pages.dtype), k_pages.dtype)
    else:
        cache = anchors.rpa_cache(k_pages, v_pages)
    return q, new_k, new_v, cache, lengths, table


def _kernel_specs(paths=()) -> dict:
    """The manifest's kernels, with kernel folders in ``paths`` in place of (or beside) them."""
    from ..hub import manifest as mf

    specs = dict(mf.load_manifest().kernels)
    for path in paths:
        spec = mf.load_kernel(Path(path))
        specs[spec.key] = spec
    return specs


def raced_kernels(paths=()) -> dict:
    """key -> (spec, family) of every kernel whose bench_problems.py races one of the benchmark's families."""
    from ..hub.declarations import declaration

    out = {}
    for key, spec in sorted(_kernel_specs(paths).items()):
        family = getattr(declaration(spec, "bench_problems"), "FAMILY", None)
        if family is not None:
            out[key] = (spec, family)
    return out


def kernel_digest(spec) -> str:
    """What our row of a kernel depends on: its package sources and how the benchmark calls it."""
    from ..hub.build import package_files, source_digest

    h = hashlib.sha256(source_digest(spec, package_files(spec)).encode())
    h.update((Path(spec.path) / "bench_problems.py").read_bytes())
    return h.hexdigest()


def implementations(families=FAMILIES, paths=(), progress=print, built: dict | None = None) -> list[Impl]:
    """Ours (each kernel that declares a family in its bench_problems.py, built from the manifest or from
    kernel folders in ``paths``, which win) and the anchors; for "train", every prefill one as a training step.

    ``built``: key -> an existing build folder (the compile workers reuse the parent's builds)."""
    from ..hub.build import build_kernel, load_built
    from ..hub.declarations import bench_declaration

    impls = []
    wanted = set(families) | {DIFFERENTIATED[f] for f in families if f in DIFFERENTIATED}
    for key, (spec, family) in raced_kernels(paths).items():
        if family not in wanted:
            continue
        name = f"ours: {key}"
        try:
            digest = kernel_digest(spec)
            out = Path(built[key]) if built and key in built else compiled.cache_dir().parent / "builds" / f"{key}-{digest[:16]}"
            if not (built and key in built):
                progress(f"  {name}: building {spec.path.relative_to(ROOT) if spec.path.is_relative_to(ROOT) else spec.path}")
                build_kernel(spec, out)
            (_, b), _ = bench_declaration(spec, load_built(out))
            impls.append(Impl(name, "ours", family, b.fn, source=str(out), prepare=b.prepare, context=b.context,
                              donate=tuple(b.donate), per_chip=b.per_chip, formats=tuple(b.formats), digest=digest))
        except Exception as e:  # report, never fake a row
            impls.append(Impl(name, "ours", family, None, f"could not load: {verify.first_line(e)}"))
            progress(f"  {name}: {impls[-1].missing}")
    try:
        impls += anchor_impls(wanted)
    except Exception as e:  # e.g. tpu-inference missing: its rows say so
        progress(f"  anchors: {verify.first_line(e)}")
        raise
    impls += [training_step(i) for f, base in DIFFERENTIATED.items() if f in families for i in impls if i.family == base]
    return [i for i in impls if i.family in families]


@functools.lru_cache(maxsize=1)
def _worker_impls() -> dict[tuple[str, str], Impl]:
    built = json.loads(os.environ.get("PALLAS_HUB_BENCH_BUILT", "{}"))
    return {(i.family, i.name): i for i in implementations(FAMILIES, progress=lambda *_: None, built=built)}


def compile_target(impl_name: str, recipe, chip: str, options: dict, device):
    """(fn, args placed on ``device``, donated argnums, () -> the context to trace it in) of one benchmarked
    program, for the compile worker."""
    problem = rebuild(recipe)
    impl = _worker_impls()[problem.family, impl_name]
    sh = jax.sharding.SingleDeviceSharding(device)
    with impl.tracing(chip):
        args = impl.args(problem.args, problem.params)
    placed = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh) for a in args)
    extra = {"device": device} if impl.needs_device else {}
    return (impl.call(problem.kwargs, chip, _options(options), **extra), placed, impl.donate,
            functools.partial(impl.tracing, chip))


def _options(options: dict) -> dict:
    return {k: tuple(tuple(x) if isinstance(x, list) else x for x in v) if isinstance(v, list) else v
            for k, v in options.items()}


# --------------------------------------------------------------------------- one row

def _stored(kind: str, impl: Impl, name: str, parts, compute: Callable, keep: Callable = lambda value: True):
    """``compute()``, or what it gave in an earlier run with the same inputs: the implementation's sources
    (``impl.digest``), ``parts`` (problem, chip, options), the bench's own sources and the library versions
    (``inputs_digest``), as the compile cache keys a program. So a run after a change to one kernel counts
    only that kernel's rows again. Stored only when ``keep(value)`` (a failed check is retried next run) and
    the implementation has a digest (an ad-hoc one, as in tests, has none)."""
    if not impl.digest:
        return compute()
    model, versions = _bench_sources()
    text = json.dumps([COUNTS_VERSION, kind, name, impl.digest, parts, model, versions], default=str)
    path = compiled.cache_dir().parent / "counts" / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.pkl"
    try:
        return pickle.loads(path.read_bytes())
    except Exception:  # not stored yet, or unreadable: computed again
        pass
    value = compute()
    if keep(value):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(pickle.dumps(value))
            tmp.replace(path)
        except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
            logging.getLogger(__name__).warning("not stored (%s): %s", kind, e)
    return value


COUNTS_VERSION = 1  # bump when what a stored count or check holds changes


def _check(impl: Impl, problem: Problem, cache: dict) -> dict:
    key = (impl.name.removesuffix(" (best tiling)"),) + problem.check_key  # the best tiling shares its kernel's check
    if key not in cache:
        cache[key] = _stored("check", impl, key[0], list(problem.check_key), lambda: _run_check(impl, problem),
                             keep=lambda c: c.get("ok"))
    return cache[key]


def _run_check(impl: Impl, problem: Problem) -> dict:
    start = time.perf_counter()
    try:
        c = problem.check()
        args = impl.args(c.args, problem.params)
        kwargs = c.kwargs
        if impl.reference is not None:  # plain JAX (it may branch on values): run eagerly
            with impl.tracing("v6e"):
                out = impl.reference(*args, chip="v6e", **kwargs)
            kind = "reference"
        else:
            with verify.interpret("fast"), impl.tracing("v6e"):
                out = jax.jit(functools.partial(impl.fn, chip="v6e", **kwargs))(*args)
            kind = "interpret"
        # a tuple reference (a training step's out, dq, dk, dv) checks each output; else the first output
        refs = c.reference if isinstance(c.reference, tuple) else (c.reference,)
        outs = out[:len(refs)] if isinstance(out, tuple) else (out,)
        err = max(float(np.max(np.abs(np.asarray(jnp.asarray(o, jnp.float32)) - np.asarray(r, np.float32)))
                        / max(float(np.max(np.abs(np.asarray(r, np.float32)))), 1e-30))
                  for o, r in zip(outs, refs, strict=True))  # fewer outputs than the reference: an error
        return {"ok": bool(np.isfinite(err) and err <= c.tol), "rel_err": err, "tol": c.tol, "shape": c.shape,
                "kind": kind, "seconds": time.perf_counter() - start}
    except Exception as e:
        return {"ok": False, "error": verify.first_line(e), "seconds": time.perf_counter() - start}


def _counts(impl: Impl, problem: Problem, chip: str, options: dict):
    return _stored("counts", impl, impl.name, [list(problem.recipe), chip if impl.per_chip else None, options],
                   lambda: _count(impl, problem, chip, options))


def _count(impl: Impl, problem: Problem, chip: str, options: dict):
    kwargs = problem.kwargs
    if impl.cost is not None:
        return impl.cost(problem, chip, options)
    with impl.tracing(chip):
        args = impl.args(problem.args, problem.params)
        return costmodel.estimate(impl.call(kwargs, chip, options), *args)


def _call_summary(call, ct: stepmodel.CallTime | None, chip: str) -> dict:
    out = {"name": call.name, "hbm_bytes": call.hbm_bytes, "flops": call.flops, "grid_steps": call.grid_steps,
           "v1_s": call.time(chip), "declared": call.declared}
    if ct is not None:
        out.update({f"v2_s_{o * 1e6:g}us": ct.seconds(o) for o in stepmodel.OVERHEADS})
        out.update(ct.breakdown(), join_notes=ct.join_notes)
    return out


def assemble(problem: Problem, chip: str, cost, profile: dict | None) -> dict:
    """One (row, chip): the v2 layer time at each overhead, its parts, and v1 beside it."""
    res: dict[str, Any] = {"v1_kernel_s": cost.time(chip), "hbm_bytes": cost.hbm_bytes, "flops": cost.flops,
                           "grid_steps": cost.grid_steps, "ideal_s": costmodel.ideal_time(problem.min_bytes,
                                                                                         problem.min_flops, chip)}
    if profile is None or "error" in profile:
        res.update(status="error", error=(profile or {}).get("error", "not compiled"))
        res["calls"] = [_call_summary(call, None, chip) for call in cost.calls]
        return res
    profile = dict(profile, ops=compiled.ops(profile))
    pairs = stepmodel.match_calls(list(cost.calls), profile)
    times, calls = [], []
    for call, op in pairs:
        ct = stepmodel.call_time(call, op["program"] if op else None, chip) if op and op.get("program") else None
        times.append(ct)
        calls.append(_call_summary(call, ct, chip))
    if any(t is None for t in times):
        res.update(status="error", error="a kernel of the program has no compiled schedule", calls=calls)
        return res
    unjoined = [t.name for t in times if not t.grid_joined]
    if unjoined:  # never a figure the model could not ground
        res.update(status="error", error=f"kernel {unjoined[0]}: no compiled loop matches its grid", calls=calls)
        return res
    glue = stepmodel.glue_ops(profile)
    extra_kernels = len(stepmodel.kernel_ops(profile)) - len(pairs)
    res.update(status="ok", calls=calls, compile_seconds=profile.get("compile_seconds"),
               glue={"ops": len(glue), "hbm_bytes": sum(op["hbm_bytes"] for op in glue),
                     "temp_bytes": (profile.get("memory") or {}).get("temp_size_in_bytes"),
                     "top": [{"name": op["name"], "hbm_bytes": op["hbm_bytes"],
                              "us": stepmodel.glue_time(op, chip, 0.0) * 1e6, "offloaded": op["offloaded"]}
                             for op in sorted(glue, key=lambda o: -stepmodel.glue_time(o, chip, 0.0))[:6]]},
               extra_kernels=extra_kernels)
    for o in stepmodel.OVERHEADS:
        k = sum(t.seconds(o) for t in times)
        g = sum(stepmodel.glue_time(op, chip, o) for op in glue)
        tag = f"{o * 1e6:g}us"
        res[f"kernel_s_{tag}"], res[f"glue_s_{tag}"], res[f"layer_s_{tag}"] = k, g, k + g
    res["roofline"] = res["ideal_s"] / res["layer_s_0.35us"]
    res["bound"] = "DMA" if sum(x["dma_s"] for x in calls) >= sum(x["compute_s"] for x in calls) else "compute"
    return res


# --------------------------------------------------------------------------- the run

@functools.cache
def _bench_sources() -> tuple[str, dict]:
    """(digest of the bench's sources and the chip table, versions of the compiler and libraries)."""
    from importlib import metadata

    h = hashlib.sha256()
    for f in BENCH_FILES:
        h.update((Path(__file__).parent / f).read_bytes())
    h.update((Path(__file__).parents[1] / "vendored" / "_chips.py").read_bytes())
    versions = {}
    for name in ("jax", "jaxlib", "libtpu", "tokamax", "tpu-inference"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return h.hexdigest()[:16], versions


def inputs_digest(paths=()) -> dict:
    """What the published figures depend on: our kernels' sources (the manifest's, or ``paths``), the
    anchors, the cost model and the chip table, and the versions of the compiler and libraries."""
    model, versions = _bench_sources()
    return {"cost_model": model, "versions": versions,
            "kernels": {f"ours: {k}": kernel_digest(spec)[:16] for k, (spec, _) in raced_kernels(paths).items()},
            "anchors": _anchor_digest()[:16]}


def run(families=FAMILIES, *, out_dir: Path = RESULTS, bridge: bool = True, xla: bool = True,
        measure: bool | None = None, progress=print, problem_list: list[Problem] | None = None,
        impl_list: list[Impl] | None = None, paths=(), chips=DEFAULT_CHIPS, workers: int = 1,
        publish: bool | None = None) -> dict:
    """The whole benchmark; returns the results and writes them.

    ``publish`` (default: a full run of every family on every chip with the manifest's kernels)
    writes ``bench.json`` and re-renders every published file; otherwise the result goes to
    ``out_dir/partial/`` and nothing published changes."""
    logging.getLogger("absl").setLevel(logging.ERROR)  # tokamax logs every autotuning-cache miss
    t0 = time.perf_counter()
    from . import timing

    measure = timing.tpu_host() if measure is None else measure
    full = tuple(families) == FAMILIES and tuple(chips) == DEFAULT_CHIPS and problem_list is None \
        and impl_list is None and not paths
    publish = full if publish is None else publish
    progress("== pallas-hub bench: modelled TPU cost of whole layers (a model, not a measurement), "
             "CPU interpret-mode correctness" + (", TPU timings" if measure else ""))
    probs = problem_list if problem_list is not None else problems(families=families)
    impls = impl_list if impl_list is not None else implementations(families, paths=paths, progress=progress)
    pairs = [(p, i) for p in probs for i in impls if i.family == p.family and p.format in i.formats]

    progress(f"== counts: {len(pairs)} rows x {len(chips)} chips (cost model on the real routing, lengths, pages)")
    checks: dict = {}
    rows, plan = [], []
    for n, (p, impl) in enumerate(pairs):
        start = time.perf_counter()
        row = {"family": p.family, "model": p.model, "problem": p.name, "params": p.params, "impl": impl.name,
               "kind": impl.kind, "note": impl.note, "min_bytes": p.min_bytes, "min_flops": p.min_flops}
        if impl.fn is None:
            rows.append({**row, "status": "missing", "error": impl.missing})
            continue
        per_chip: dict[str, Any] = {}
        cost_cache: dict = {}
        for c in chips:
            try:
                options = impl.search(p, c) if impl.search else {}
                key = (json.dumps(options, default=str), c if impl.per_chip else None)
                if key not in cost_cache:
                    cost_cache[key] = _counts(impl, p, c, options)
                per_chip[c] = {"options": options, "cost": cost_cache[key]}
                plan.append((row, c, compiled.Job(impl.name, p.recipe, c, tuple(sorted(options.items())),
                                                  impl.digest)))
            except Exception as e:
                per_chip[c] = {"error": verify.first_line(e)}
        row["check"] = _check(impl, p, checks)
        row["_per_chip"] = per_chip
        row["count_seconds"] = time.perf_counter() - start
        rows.append(row)
        elapsed = time.perf_counter() - t0
        progress(f"  [{n + 1}/{len(pairs)} {elapsed:5.0f}s, ETA {elapsed / (n + 1) * (len(pairs) - n - 1):4.0f}s] "
                 f"{p.name:<26} {impl.name:<36} counted in {row['count_seconds']:.1f}s, "
                 f"check {_check_word(row['check'])}")

    progress(f"== compiling {len(plan)} programs ahead of time (TPU compile-only topologies, LLO schedules)")
    built = {i.name.split(": ", 1)[1]: i.source for i in impls if i.kind == "ours" and i.source}
    os.environ["PALLAS_HUB_BENCH_BUILT"] = json.dumps(built)
    profiles = compiled.profiles([job for _, _, job in plan], progress=progress, workers=workers)

    progress("== timing (per-step model v2, XLA glue, at 0 / 0.35 / 0.7 us per step)")
    by_name = {p.name: p for p in probs}
    for row in rows:
        per_chip = row.pop("_per_chip", None)
        if per_chip is None:
            continue
        row["chips"] = {}
        for c, entry in per_chip.items():
            if "error" in entry:
                row["chips"][c] = {"status": "error", "error": entry["error"]}
                continue
            job = next(j for r, cc, j in plan if r is row and cc == c)
            res = assemble(by_name[row["problem"]], c, entry["cost"], profiles.get(job.key))
            res["options"] = entry["options"]
            row["chips"][c] = res
        oks = [v for v in row["chips"].values() if v.get("status") == "ok"]
        row["status"] = "ok" if oks else "error"
        if not oks:
            row["error"] = next((v.get("error") for v in row["chips"].values() if v.get("error")), "")
        progress(_progress_line(row))

    result = {"generated_by": "pallas-hub bench", "chips": list(chips), "families": list(families),
              "overheads_us": [o * 1e6 for o in stepmodel.OVERHEADS], "inputs": inputs_digest(paths),
              "chip_figures": {c: _chip_dict(c) for c in chips},
              "models": [dataclasses.asdict(m) for m in MODELS if m.name in {p.model for p in probs}],
              "rows": rows, "note": "times are TPU cost-model outputs, not measurements"}
    if xla:
        progress("== validation: the model on plain Pallas matmuls beside XLA:TPU's cost analysis")
        from . import validate

        result["xla_matmul"] = validate.xla_matmuls(progress=progress, chips=chips, workers=workers)
    if bridge:
        progress("== bridge overhead, measured on this machine (CPU)")
        from . import bridge_overhead

        result["bridge"] = bridge_overhead.run(progress=progress)
    if measure:
        progress("== TPU timings (this host has TPU chips)")
        from . import tpu_bench

        result["tpu"] = tpu_bench.run(probs, impls, rows, progress=progress)
    result["seconds"] = time.perf_counter() - t0
    write(result, out_dir, publish=publish)
    return result


def _chip_dict(c: str) -> dict:
    spec = get_chip(c)
    return {**dataclasses.asdict(spec), "clock_hz": spec.clock_hz, "vmatmul_flops": spec.vmatmul_flops}


def _check_word(check: dict) -> str:
    if check.get("ok"):
        return "ok" if check.get("kind") != "reference" else "reference ok"
    return "FAIL" if "rel_err" in check else f"error ({check.get('error', '?')})"


def _progress_line(row) -> str:
    head = f"  {row['problem']:<26} {row['impl']:<36}"
    if row["status"] != "ok":
        return f"{head} {row['status'].upper()}: {row.get('error')}"
    parts = []
    for c, v in row["chips"].items():
        parts.append(f"{c} {v['layer_s_0.35us'] * 1e6:9.1f} us" if v.get("status") == "ok" else f"{c} error")
    return head + "  ".join(parts)


def write(result: dict, out_dir: Path = RESULTS, *, publish: bool = True) -> Path:
    """bench.json and every published file (``publish``), else ``out_dir/partial/`` only."""
    out_dir = Path(out_dir)
    target = out_dir if publish else out_dir / "partial"
    target.mkdir(parents=True, exist_ok=True)
    name = "bench.json" if publish else f"bench-{'-'.join(result['families'])}-{'-'.join(result['chips'])}.json"
    path = target / name
    path.write_text(json.dumps(result, indent=1, default=_json_default, sort_keys=True) + "\n")
    if publish:
        from . import report

        report.publish(result, out_dir)
    return path


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    if isinstance(x, tuple):
        return list(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")
