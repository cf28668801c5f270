"""pallas-hub bench: our kernels beside the anchors on real model shapes, by the TPU cost model.

One run produces, for every kernel in the manifest and every shape of DESIGN.md "Shapes that
matter" (Qwen3-30B-A3B, and GPT-OSS-20B on fewer shapes): modelled HBM bytes, MXU flops, steps, time and roofline fraction on
v5e, v6e and TPU7x (``pallas_hub.bench.costmodel``; a model, never a TPU measurement), the CPU
interpret-mode correctness of each implementation (at a reduced shape, stated in the row), the
bridge overhead measured on this machine (``bench.bridge_overhead``) and the cost model's
comparison with XLA:TPU's own cost analysis on plain matmuls. Results go to
``benchmarks/results/bench.json``, PNG plots beside it, and the table in ``benchmarks/README.md``.

On a TPU host (``timing.tpu_host()``) the same rows are also timed for real (warm-up, median of N,
device synchronisation), and Qwen3-30B-A3B MoE decode layers are timed against transformers'
``experts_implementation="grouped_mm"``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import time
from pathlib import Path
from typing import Any, Callable

from .. import verify  # noqa: F401  (CPU-only JAX set-up before jax loads)
from . import anchors, costmodel
from ..vendored._chips import DEFAULT_CHIPS
from ..hub.manifest import ROOT

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
README = ROOT / "benchmarks" / "README.md"
BF16 = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    hidden: int
    experts: int
    top_k: int
    moe_intermediate: int
    q_heads: int
    kv_heads: int
    head_dim: int
    short: str = ""
    moe_tokens: tuple = (1, 8, 64, 256, 2048, 8192)  # decode batches and prefill lengths
    prefill_tokens: tuple = (2048, 8192)
    decode_batches: tuple = (1, 8, 64, 256)


# transformers' Qwen3MoeConfig for Qwen/Qwen3-30B-A3B (checked against its config.json fields)
QWEN3_30B_A3B = Model("Qwen3-30B-A3B", hidden=2048, experts=128, top_k=8, moe_intermediate=768,
                      q_heads=32, kv_heads=4, head_dim=128, short="Qwen3")
# openai/gpt-oss-20b's config.json (transformers' GptOssConfig defaults are the 120b: 128 experts);
# fewer shapes, to keep the run short. Gemma 4 26B-A4B is left out: its config is not available here.
GPT_OSS_20B = Model("GPT-OSS-20B", hidden=2880, experts=32, top_k=4, moe_intermediate=2880,
                    q_heads=64, kv_heads=8, head_dim=64, short="GPT-OSS",
                    moe_tokens=(1, 64, 256, 2048), prefill_tokens=(2048,), decode_batches=(1, 64))
MODELS = (QWEN3_30B_A3B, GPT_OSS_20B)
DECODE_CONTEXT = (1024, 4096)  # each sequence's context length, uniform in this range (seeded)
PAGE_SIZE = 16


# --------------------------------------------------------------------------- problems

@dataclasses.dataclass
class Problem:
    family: str  # "moe" | "prefill" | "decode"
    model: str
    name: str
    params: dict
    args: tuple  # for the cost model: bulk data abstract, steering values concrete
    kwargs: dict
    min_bytes: int
    min_flops: int
    check: Callable[[], "Check"]  # a reduced concrete case for the interpret-mode check
    check_key: tuple


@dataclasses.dataclass
class Check:
    args: tuple
    kwargs: dict
    reference: Any
    shape: str
    tol: float  # max |err| / max |reference|


def _sds(shape, dtype=BF16):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _route(tokens: int, experts: int, top_k: int, seed: int) -> np.ndarray:
    """Group sizes of ``tokens`` routed to ``top_k`` distinct uniformly random experts each."""
    rng = np.random.default_rng(seed)
    choice = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
    return np.bincount(choice.ravel(), minlength=experts).astype(np.int32)


def _moe_check(tokens: int) -> Check:
    g, top_k, k, n = 8, 2, 256, 384
    sizes = _route(tokens, g, top_k, seed=tokens)
    rows = tokens * top_k
    rng = np.random.default_rng(1)
    lhs = jnp.asarray(rng.standard_normal((rows, k)), BF16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) / math.sqrt(k), BF16)
    ref = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), jnp.asarray(sizes))
    return Check((lhs, rhs, jnp.asarray(sizes)), {}, ref, f"tokens {tokens} x top-{top_k}, {g} experts, k {k}, n {n}", 2e-2)


def moe_problem(m: Model, tokens: int, projection: str) -> Problem:
    k, n = (m.hidden, 2 * m.moe_intermediate) if projection == "gate_up" else (m.moe_intermediate, m.hidden)
    sizes = _route(tokens, m.experts, m.top_k, seed=tokens)
    rows = tokens * m.top_k
    active = int((sizes > 0).sum())
    ct = min(tokens, 16)
    return Problem(
        "moe", m.name, f"{m.short} {projection} T={tokens}",
        {"tokens": tokens, "rows": rows, "k": k, "n": n, "experts": m.experts, "active_experts": active},
        (_sds((rows, k)), _sds((m.experts, k, n)), jnp.asarray(sizes)), {},
        min_bytes=2 * (rows * k + active * k * n + rows * n), min_flops=2 * rows * k * n,
        check=functools.partial(_moe_check, ct), check_key=("moe", ct))


def _attention_reference(q, k, v, scale, lengths=None):
    """Plain f32 causal (or, with lengths, decode) GQA attention: [B, Hq, S, D] x [B, Hkv, S, D]."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, precision="highest") * scale
    qi = jnp.arange(q.shape[2])[:, None] + (k.shape[2] - q.shape[2])
    ki = jnp.arange(k.shape[2])[None, :]
    mask = ki <= qi
    if lengths is not None:
        mask = mask & (ki[None, None] < lengths[:, None, None, None])
    s = jnp.where(mask, s, -jnp.inf)
    return jnp.einsum("bhqk,bhkd->bhqd", jax.nn.softmax(s, axis=-1), v, precision="highest")


def _prefill_check(m: Model) -> Check:
    s, hq, hkv, d = 256, m.q_heads // m.kv_heads, 1, m.head_dim  # same GQA group as the model
    rng = np.random.default_rng(2)
    q, k, v = (jnp.asarray(rng.standard_normal((1, h, s, d)), BF16) for h in (hq, hkv, hkv))
    scale = 1 / math.sqrt(d)
    return Check((q, k, v), {"scale": scale}, _attention_reference(q, k, v, scale),
                 f"1 x {s} tokens, {hq} q / {hkv} kv heads, d {d}", 2e-2)


def prefill_problem(m: Model, tokens: int) -> Problem:
    hq, hkv, d = m.q_heads, m.kv_heads, m.head_dim
    return Problem(
        "prefill", m.name, f"{m.short} causal S={tokens}",
        {"batch": 1, "tokens": tokens, "q_heads": hq, "kv_heads": hkv, "head_dim": d},
        (_sds((1, hq, tokens, d)), _sds((1, hkv, tokens, d)), _sds((1, hkv, tokens, d))),
        {"scale": 1 / math.sqrt(d)},
        min_bytes=2 * (2 * hq + 2 * hkv) * tokens * d, min_flops=4 * hq * d * tokens * (tokens + 1) // 2,
        check=functools.partial(_prefill_check, m), check_key=("prefill", hq // hkv, d))


def _paged_inputs(lengths: np.ndarray, seed: int):
    """A page table with every sequence's pages scattered at random over one shared pool.

    Its width is rounded up to a multiple of jax paged_attention's pages per compute block (it
    requires that; unused entries still point at valid pages)."""
    ppcb = anchors.PAGED_PAGES_PER_COMPUTE_BLOCK
    pages_per_seq = int(math.ceil(lengths.max() / PAGE_SIZE / ppcb)) * ppcb
    total = len(lengths) * pages_per_seq
    table = np.random.default_rng(seed).permutation(total).astype(np.int32).reshape(len(lengths), pages_per_seq)
    return table, total


def _decode_check(m: Model, batch: int) -> Check:
    hq, hkv, d = m.q_heads // m.kv_heads, 1, m.head_dim
    lengths = np.array([37, 200, 129, 16][:batch], np.int32)
    table, total = _paged_inputs(lengths, seed=3)
    rng = np.random.default_rng(4)
    q = jnp.asarray(rng.standard_normal((batch, hq, d)), BF16)
    kp, vp = (jnp.asarray(rng.standard_normal((hkv, total, PAGE_SIZE, d)), BF16) for _ in range(2))
    # dense [B, Hkv, S, D] view of each sequence's pages, for the reference
    dense = lambda p: jnp.moveaxis(p[:, jnp.asarray(table)].reshape(hkv, batch, -1, d), 0, 1)  # noqa: E731
    scale = 1 / math.sqrt(d)
    ref = _attention_reference(q[:, :, None], dense(kp), dense(vp), scale, jnp.asarray(lengths))[:, :, 0]
    return Check((q, kp, vp, jnp.asarray(lengths), jnp.asarray(table)), {"scale": scale}, ref,
                 f"{batch} seqs of {', '.join(map(str, lengths))} tokens, {hq} q / {hkv} kv heads, page {PAGE_SIZE}", 2e-2)


def decode_problem(m: Model, batch: int) -> Problem:
    hq, hkv, d = m.q_heads, m.kv_heads, m.head_dim
    lengths = np.random.default_rng(batch).integers(*DECODE_CONTEXT, size=batch, endpoint=True).astype(np.int32)
    table, total = _paged_inputs(lengths, seed=batch)
    ctx = int(lengths.sum())
    cb = min(batch, 4)
    return Problem(
        "decode", m.name, f"{m.short} decode B={batch}",
        {"batch": batch, "context_tokens": ctx, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "page": PAGE_SIZE},
        (_sds((batch, hq, d)), _sds((hkv, total, PAGE_SIZE, d)), _sds((hkv, total, PAGE_SIZE, d)),
         jnp.asarray(lengths), jnp.asarray(table)), {"scale": 1 / math.sqrt(d)},
        min_bytes=2 * (2 * hkv * ctx * d + 2 * batch * hq * d), min_flops=4 * hq * d * ctx,
        check=functools.partial(_decode_check, m, cb), check_key=("decode", cb, hq // hkv, d))


def problems(models=MODELS, families=("moe", "prefill", "decode")) -> list[Problem]:
    out = []
    for m in models:
        if "moe" in families:
            out += [moe_problem(m, t, p) for p in ("gate_up", "down") for t in m.moe_tokens]
        if "prefill" in families:
            out += [prefill_problem(m, t) for t in m.prefill_tokens]
        if "decode" in families:
            out += [decode_problem(m, b) for b in m.decode_batches]
    return out


# --------------------------------------------------------------------------- implementations

@dataclasses.dataclass
class Impl:
    name: str
    kind: str  # "ours" | "anchor"
    family: str
    fn: Callable | None  # None: not available (``missing`` says why)
    missing: str | None = None
    source: str = ""  # where our kernel was built from
    prepare: Callable | None = None  # the problem's arrays into this kernel's layout, outside cost and timing
    per_chip: bool = False  # fn takes chip= and picks its tiling for that generation

    def call(self, kwargs: dict, chip: str | None = None) -> Callable:
        f = functools.partial(self.fn, **kwargs)
        return functools.partial(f, chip=chip) if self.per_chip and chip else f

    def args(self, args: tuple) -> tuple:
        return tuple(self.prepare(*args)) if self.prepare else tuple(args)


def _transpose(x, perm):
    """jnp.transpose that also maps a ShapeDtypeStruct (bulk data stays abstract)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(x.shape[i] for i in perm), x.dtype)
    return jnp.transpose(x, perm)


ANCHORS = {
    "moe": [("jax megablox gmm", anchors.megablox_gmm), ("tokamax ragged_dot (mosaic)", anchors.tokamax_ragged_dot)],
    "prefill": [("jax flash_attention", anchors.jax_flash_attention), ("jax splash_attention", anchors.splash_attention)],
    "decode": [("jax paged_attention", anchors.jax_paged_attention)],
}
OURS = {"ragged_dot": "moe", "flash_attention": "prefill", "paged_attention": "decode"}


def _ours(key: str, family: str, module) -> Impl:
    """Our kernel's JAX entry point in the problem's calling convention (see ``Problem``)."""
    import importlib

    pallas = importlib.import_module(module.__name__ + ".pallas")
    name = f"ours: {key}"
    if key == "ragged_dot":
        def fn(lhs, rhs, group_sizes, chip="v6e"):
            return pallas.gmm(lhs, rhs, group_sizes, chip=chip)

        return Impl(name, "ours", family, fn, per_chip=True)
    if key == "flash_attention":
        def fn(q, k, v, *, scale, chip="v6e"):
            return pallas.flash_attention(q, k, v, scale=scale, causal=True, chip=chip)

        return Impl(name, "ours", family, fn, per_chip=True)
    if key == "paged_attention":
        def prepare(q, k_pages, v_pages, lengths, page_indices):
            # transformers' cache layout [P, page, Hkv, D] is this kernel's own: no copy in real use
            return q, _transpose(k_pages, (1, 2, 0, 3)), _transpose(v_pages, (1, 2, 0, 3)), lengths, page_indices

        def fn(q, k_pages, v_pages, lengths, page_indices, *, scale):
            cu_q_lens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)  # decode: one new token per sequence
            return pallas.ragged_paged_attention(q, k_pages, v_pages, lengths, page_indices, cu_q_lens, scale=scale)

        return Impl(name, "ours", family, fn, prepare=prepare)
    raise NotImplementedError(f"no bench adapter for kernel {key!r}")


def _describe(path: Path) -> str:
    """The kernel folder and, when it is in this repository, the commit it was built at."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(path), "log", "-1", "--format=%h %s", "--", "."],
                              capture_output=True, text=True, timeout=10).stdout.strip()
    except Exception:
        head = ""
    return f"{path}" + (f" (last commit {head[:80]})" if head else "")


def implementations(families, kernels_dir: Path | None = None, paths=(), progress=print) -> list[Impl]:
    """Ours (built from the manifest, as ``pallas-hub check`` does, or from kernel folders given in
    ``paths``, which win) and the anchors, per family."""
    from ..hub import manifest as mf
    from ..hub.build import build_kernel, load_built

    present = dict(mf.load_manifest().kernels)
    for path in paths:
        spec = mf.load_kernel(Path(path))
        present[spec.key] = spec
    impls = []
    for key, family in OURS.items():
        if family not in families:
            continue
        name = f"ours: {key}"
        if key not in present:
            impls.append(Impl(name, "ours", family, None, "not in the manifest (not on main yet)"))
            progress(f"  {name}: not in the manifest, reported as missing")
            continue
        try:
            out = Path(kernels_dir) / key if kernels_dir else None
            progress(f"  {name}: building {present[key].path}")
            module = load_built(build_kernel(present[key], out))
            impls.append(dataclasses.replace(_ours(key, family, module), source=_describe(present[key].path)))
        except Exception as e:  # report, never fake a row
            impls.append(Impl(name, "ours", family, None, f"could not load: {verify.first_line(e)}"))
            progress(f"  {name}: {impls[-1].missing}")
    for family in families:
        impls += [Impl(n, "anchor", family, f) for n, f in ANCHORS[family]]
    return impls


# --------------------------------------------------------------------------- running

def _check(impl: Impl, problem: Problem, cache: dict) -> dict:
    key = (impl.name,) + problem.check_key
    if key not in cache:
        start = time.perf_counter()
        try:
            c = problem.check()
            with verify.interpret("fast"):
                out = jax.jit(impl.call(c.kwargs, "v6e"))(*impl.args(c.args))
            out = np.asarray(jnp.asarray(out, jnp.float32))
            ref = np.asarray(c.reference, np.float32)
            err = float(np.max(np.abs(out - ref)) / max(float(np.max(np.abs(ref))), 1e-30))
            cache[key] = {"ok": bool(np.isfinite(err) and err <= c.tol), "rel_err": err, "tol": c.tol,
                          "shape": c.shape, "seconds": time.perf_counter() - start}
        except Exception as e:
            cache[key] = {"ok": False, "error": verify.first_line(e), "seconds": time.perf_counter() - start}
    return cache[key]


def run_row(problem: Problem, impl: Impl, checks: dict, chips=DEFAULT_CHIPS) -> dict:
    row = {"family": problem.family, "model": problem.model, "problem": problem.name, "params": problem.params,
           "impl": impl.name, "kind": impl.kind, "min_bytes": problem.min_bytes, "min_flops": problem.min_flops}
    if impl.fn is None:
        return {**row, "status": "missing", "error": impl.missing}
    start = time.perf_counter()
    try:
        args = impl.args(problem.args)
        # a kernel that tiles per generation is modelled once per chip, with that chip's tiling
        costs = {c: costmodel.estimate(impl.call(problem.kwargs, c), *args)
                 for c in (chips if impl.per_chip else (None,))}
    except Exception as e:
        return {**row, "status": "error", "error": verify.first_line(e), "check": _check(impl, problem, checks)}
    cost_of = lambda c: costs.get(c, costs.get(None))  # noqa: E731
    cost = cost_of("v6e")
    row.update(
        status="ok", hbm_read_bytes=cost.hbm_read_bytes, hbm_write_bytes=cost.hbm_write_bytes,
        hbm_bytes=cost.hbm_bytes, flops=cost.flops, steps=cost.grid_steps, calls=len(cost.calls),
        modelled_s={c: cost_of(c).time(c) for c in chips},
        roofline={c: costmodel.roofline_fraction(cost_of(c), problem.min_bytes, problem.min_flops, c) for c in chips},
        ideal_s={c: costmodel.ideal_time(problem.min_bytes, problem.min_flops, c) for c in chips},
        model_seconds=time.perf_counter() - start,
    )
    declared = [c.declared for c in cost.calls]
    if declared and all(declared):  # what the kernel's author declared (pl.CostEstimate), for comparison
        row["declared"] = {"flops": sum(d["flops"] for d in declared),
                           "bytes_accessed": sum(d["bytes_accessed"] for d in declared)}
    if impl.per_chip:
        row["per_chip"] = {c: {"hbm_bytes": costs[c].hbm_bytes, "flops": costs[c].flops, "steps": costs[c].grid_steps}
                           for c in chips}
    row["check"] = _check(impl, problem, checks)
    return row


def xla_matmul_comparison(shapes=((1024, 1024, 1024), (2048, 2048, 1536), (8192, 2048, 1536)),
                          chips=DEFAULT_CHIPS, block=(512, 512, 512), progress=print) -> list[dict]:
    """The cost model on jax's Pallas matmul beside XLA:TPU's cost analysis of jnp.dot (compiled here)."""
    from jax.experimental.pallas.ops.tpu import matmul as pallas_matmul

    from ..vendored._chips import chip as get_chip

    rows = []
    for m, k, n in shapes:
        a, b = _sds((m, k)), _sds((k, n))
        bm, bn, bk = block
        cost = costmodel.estimate(functools.partial(pallas_matmul.matmul, block_shape=(bm, bn), block_k=bk), a, b)
        min_bytes, min_flops = 2 * (m * k + k * n + m * n), 2 * m * k * n
        for c in chips:
            spec = get_chip(c)
            dev = verify.tpu_devices(spec.topology)[0]
            sh = jax.sharding.SingleDeviceSharding(dev)
            start = time.perf_counter()
            placed = (jax.ShapeDtypeStruct((m, k), BF16, sharding=sh), jax.ShapeDtypeStruct((k, n), BF16, sharding=sh))
            compiled = jax.jit(jnp.dot).trace(*placed).lower(lowering_platforms=("tpu",)).compile()
            ca = compiled.cost_analysis()
            ca = ca[0] if isinstance(ca, list) else ca
            row = {"m": m, "k": k, "n": n, "chip": c, "pallas_block": list(block),
                   "xla_flops": float(ca["flops"]), "xla_bytes": float(ca["bytes accessed"]),
                   "xla_optimal_s": float(ca["optimal_seconds"]),
                   "model_flops": cost.flops, "model_bytes": cost.hbm_bytes, "model_s": cost.time(c),
                   "min_bytes": min_bytes, "min_flops": min_flops,
                   "ideal_s": costmodel.ideal_time(min_bytes, min_flops, c)}
            row["model_over_xla"] = row["model_s"] / row["xla_optimal_s"]
            rows.append(row)
            progress(f"  xla vs model {m}x{k}x{n} {c}: XLA optimal {row['xla_optimal_s'] * 1e6:.1f} us "
                     f"({row['xla_bytes'] / 1e6:.1f} MB, {row['xla_flops'] / 1e9:.2f} GF); model "
                     f"{row['model_s'] * 1e6:.1f} us ({row['model_bytes'] / 1e6:.1f} MB, {row['model_flops'] / 1e9:.2f} GF); "
                     f"ideal {row['ideal_s'] * 1e6:.1f} us  [{time.perf_counter() - start:.1f}s]")
    return rows


def run(families=("moe", "prefill", "decode"), *, out_dir: Path = RESULTS, readme: Path | None = README,
        bridge: bool = True, xla: bool = True, measure: bool | None = None, progress=print,
        problem_list: list[Problem] | None = None, impl_list: list[Impl] | None = None, paths=()) -> dict:
    """The whole benchmark; returns (and writes) the results."""
    logging.getLogger("absl").setLevel(logging.ERROR)  # tokamax logs every autotuning-cache miss
    t0 = time.perf_counter()
    from . import timing

    measure = timing.tpu_host() if measure is None else measure
    progress("== pallas-hub bench: modelled TPU cost (a model, not a measurement), "
             "CPU interpret-mode correctness" + (", TPU timings" if measure else ""))
    probs = problem_list if problem_list is not None else problems(families=families)
    impls = impl_list if impl_list is not None else implementations(families, paths=paths, progress=progress)
    rows, checks = [], {}
    for i, p in enumerate(probs):
        for impl in (x for x in impls if x.family == p.family):
            row = run_row(p, impl, checks)
            rows.append(row)
            progress(_progress_line(i + 1, len(probs), row, time.perf_counter() - t0))
    result = {"generated_by": "pallas-hub bench", "chips": list(DEFAULT_CHIPS),
              "kernel_sources": {i.name: i.source for i in impls if i.kind == "ours"},
              "models": [dataclasses.asdict(m) for m in MODELS if m.name in {p.model for p in probs}], "rows": rows,
              "note": "modelled_s and roofline are TPU cost-model outputs, not measurements"}
    if xla:
        progress("== cost model vs XLA:TPU cost analysis (plain matmuls, compiled ahead of time here)")
        result["xla_matmul"] = xla_matmul_comparison(progress=progress)
    if bridge:
        progress("== bridge overhead, measured on this machine (CPU)")
        result["bridge"] = _bridge_bench(progress)
    if measure:
        progress("== TPU timings (this host has TPU chips)")
        from . import tpu_bench

        result["tpu"] = tpu_bench.run(probs, impls, rows, progress=progress)
    result["seconds"] = time.perf_counter() - t0
    write(result, out_dir, readme)
    progress(f"== done in {result['seconds']:.0f}s: {out_dir / 'bench.json'}" + (f", {readme}" if readme else ""))
    return result


def _bridge_bench(progress):
    from . import bridge_overhead

    return bridge_overhead.run(progress=progress)


def _progress_line(i, n, row, elapsed) -> str:
    head = f"[{i}/{n} {elapsed:5.0f}s] {row['problem']:<18} {row['impl']:<30}"
    if row["status"] != "ok":
        return f"{head} {row['status'].upper()}: {row.get('error')}"
    check = row.get("check", {})
    ok = "ok" if check.get("ok") else "FAIL"
    return (f"{head} {row['hbm_bytes'] / 1e6:9.1f} MB {row['flops'] / 1e9:8.2f} GF "
            f"v6e {row['modelled_s']['v6e'] * 1e6:9.1f} us roofline {row['roofline']['v6e']:.2f}  check {ok}")


# --------------------------------------------------------------------------- outputs

def write(result: dict, out_dir: Path = RESULTS, readme: Path | None = README) -> None:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "bench.json").write_text(json.dumps(result, indent=1, default=_json_default))
    from . import plots

    plots.roofline(result, out_dir / "roofline.png")
    plots.bars(result, out_dir / "modelled_time.png")
    if readme is not None:
        render_readme(result, Path(readme))


def _json_default(x):
    if isinstance(x, (np.integer,)):
        return int(x)
    if isinstance(x, (np.floating,)):
        return float(x)
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


MARK_BEGIN = "<!-- bench:begin (generated by `pallas-hub bench` from results/bench.json; do not edit) -->"
MARK_END = "<!-- bench:end -->"


def _fmt_bytes(b):
    return f"{b / 1e6:.1f} MB" if b < 1e9 else f"{b / 1e9:.2f} GB"


def _fmt_time(s):
    return f"{s * 1e6:.1f} us" if s < 1e-3 else f"{s * 1e3:.2f} ms"


def tables(result: dict) -> str:
    """The markdown tables of a result (what the README shows)."""
    lines = ["### Kernels on real model shapes (modelled TPU cost)", "",
             "Times are TPU cost-model outputs (`pallas_hub.bench.costmodel`), not measurements. "
             "Roofline = ideal time (the problem's minimum bytes and flops at the chip's roofline) / modelled time. "
             "Check = CPU interpret-mode output vs a plain-JAX f32 reference (max |err| / max |ref|), at the reduced shape given below.",
             "",
             "Bytes, flops and steps are v6e's; kernels that tile per generation are modelled per chip.", "",
             "| problem | implementation | HBM bytes | flops | steps | v5e | v6e | TPU7x | roofline v5e / v6e / 7x | check |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['problem']} | {r['impl']} | {r['status']}: {r.get('error', '')} | | | | | | | |")
            continue
        c = r.get("check", {})
        check = (f"ok ({c['rel_err']:.1e})" if c.get("ok") else
                 f"FAIL ({c['rel_err']:.1e})" if "rel_err" in c else f"error: {c.get('error', '?')}")
        m = r["modelled_s"]
        rf = r["roofline"]
        lines.append(f"| {r['problem']} | {r['impl']} | {_fmt_bytes(r['hbm_bytes'])} | {r['flops'] / 1e9:.2f} G | "
                     f"{r['steps']} | {_fmt_time(m['v5e'])} | {_fmt_time(m['v6e'])} | {_fmt_time(m['tpu7x'])} | "
                     f"{rf['v5e']:.2f} / {rf['v6e']:.2f} / {rf['tpu7x']:.2f} | {check} |")
    sources = {k: v for k, v in result.get("kernel_sources", {}).items() if v}
    if sources:
        lines += ["", "Ours built from: " + "; ".join(f"{k}: `{v}`" for k, v in sources.items())]
    shapes = {}
    for r in result["rows"]:
        c = r.get("check") or {}
        if "shape" in c:
            shapes.setdefault(r["family"], set()).add(c["shape"])
    lines += ["", "Check shapes: " + "; ".join(f"{f}: {' | '.join(sorted(s))}" for f, s in shapes.items())]
    declared = [r for r in result["rows"] if r.get("declared")]
    if declared:
        lines += ["", "### Cost model vs the kernels' own `pl.CostEstimate`", "",
                  "What each kernel's author declares to XLA (bytes_accessed, flops) beside what the model counts "
                  "for the same call (v6e).", "",
                  "| problem | implementation | declared bytes | modelled bytes | declared flops | modelled flops |",
                  "|---|---|---|---|---|---|"]
        for r in declared:
            d = r["declared"]
            lines.append(f"| {r['problem']} | {r['impl']} | {_fmt_bytes(d['bytes_accessed'])} | {_fmt_bytes(r['hbm_bytes'])} | "
                         f"{d['flops'] / 1e9:.2f} G | {r['flops'] / 1e9:.2f} G |")
    if result.get("xla_matmul"):
        lines += ["", "### Cost model vs XLA:TPU cost analysis (plain bf16 matmuls)", "",
                  "XLA: `jnp.dot` compiled for the chip here (compile-only topology), `cost_analysis()`. "
                  "Model: `pallas_hub.bench.costmodel` on jax's Pallas TPU matmul (blocks 512x512x512).", "",
                  "| m x k x n | chip | XLA optimal_seconds | XLA bytes | model time | model bytes | model / XLA | ideal |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["xla_matmul"]:
            lines.append(f"| {r['m']}x{r['k']}x{r['n']} | {r['chip']} | {_fmt_time(r['xla_optimal_s'])} | "
                         f"{_fmt_bytes(r['xla_bytes'])} | {_fmt_time(r['model_s'])} | {_fmt_bytes(r['model_bytes'])} | "
                         f"{r['model_over_xla']:.2f} | {_fmt_time(r['ideal_s'])} |")
    if result.get("bridge"):
        b = result["bridge"]
        lines += ["", f"### Bridge overhead (measured on this machine: {b.get('machine', '')})", "",
                  f"torch custom op through the bridge vs the same jitted JAX function on JAX arrays, "
                  f"{b['rows'][0]['calls']} calls after warm-up; target: at most {b['target_overhead_us']:.0f} us above raw JAX.", "",
                  "| shape | dtype | raw JAX median / p90 | bridge median / p90 | overhead | zero-copy input |",
                  "|---|---|---|---|---|---|"]
        for r in b["rows"]:
            lines.append(f"| {tuple(r['shape'])} | {r['dtype']} | {r['raw_jax_median_us']:.1f} / {r['raw_jax_p90_us']:.1f} us | "
                         f"{r['bridge_median_us']:.1f} / {r['bridge_p90_us']:.1f} us | {r['overhead_median_us']:.1f} us "
                         f"({'within' if r['within_target'] else 'above'} target) | {'yes' if r['input_zero_copy'] else 'no'} |")
        cmp = b["compilations"]
        lines += ["", f"XLA compilations over token counts {cmp['token_counts']}: {cmp['xla_compilations']} "
                      f"({cmp['distinct_new_shapes']} new shapes).",
                  "Breakdown (8,128) f32, median: " + ", ".join(f"{k} {v:.1f} us" for k, v in b["breakdown_us"].items()) + "."]
    if result.get("tpu"):
        lines += ["", "### Measured on TPU", "", "| problem | implementation | device | measured median | modelled |", "|---|---|---|---|---|"]
        for r in result["tpu"]["rows"]:
            lines.append(f"| {r['problem']} | {r['impl']} | {r['device']} | {_fmt_time(r['median_s'])} | "
                         f"{_fmt_time(r['modelled_s']) if r.get('modelled_s') else ''} |")
    lines += ["", f"Generated in {result.get('seconds', 0):.0f} s. Plots: `results/roofline.png`, `results/modelled_time.png`."]
    return "\n".join(lines)


def render_readme(result: dict, readme: Path) -> None:
    body = f"{MARK_BEGIN}\n{tables(result)}\n{MARK_END}"
    text = readme.read_text() if readme.exists() else "# Benchmarks\n\n"
    if MARK_BEGIN in text and MARK_END in text:
        pre, rest = text.split(MARK_BEGIN, 1)
        text = pre + body + rest.split(MARK_END, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + body + "\n"
    readme.write_text(text)
