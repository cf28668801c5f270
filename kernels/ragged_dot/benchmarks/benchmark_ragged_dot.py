"""ragged-dot-tpu benchmarks.

* ``RaggedDotBenchmark`` / ``ExpertsBenchmark``: the `kernels benchmark` format (workloads
  ``setup_<w>``/``benchmark_<w>``/``verify_<w>``). On a TPU host they time the real kernels; here
  they run in interpret mode, so their times say nothing about a TPU.
* ``python benchmark_ragged_dot.py``: the TPU cost-model table (pallas_hub.bench.costmodel, MODELLED, not
  measured) for one Qwen3-30B-A3B experts layer (gate_up with its activation, then down) at 1, 64,
  256 and 4096 tokens: ours vs jax's megablox gmm and tokamax 0.0.12's mosaic ragged_dot, each at
  its default tiling and at the best tiling the model finds.
"""

from __future__ import annotations

import importlib
import itertools
import sys

import torch

try:
    from kernels.benchmark import Benchmark
except ImportError:  # the cost table does not need the kernels library
    Benchmark = object


# --------------------------------------------------------------------------- `kernels benchmark` workloads

def _synchronize(kernel, out):
    """`kernels benchmark` does not synchronise TPUs: wait with the vendored bridge's helper."""
    importlib.import_module(kernel.__name__ + "._bridge").synchronize(out)


class RaggedDotBenchmark(Benchmark):
    seed = 0

    def setup_decode(self):
        g = torch.Generator().manual_seed(self.seed)
        self.lhs = torch.randn(512, 256, generator=g)
        self.rhs = torch.randn(16, 384, 256, generator=g)  # transformers' [E, out, in]
        self.sizes = torch.bincount(torch.randint(0, 16, (512,), generator=g), minlength=16)
        self.out = None

    def benchmark_decode(self):
        self.out = self.kernel.ragged_dot(self.lhs, self.rhs, self.sizes, True)
        _synchronize(self.kernel, self.out)

    def verify_decode(self):
        ends = torch.cumsum(self.sizes, 0).tolist()
        ref = torch.zeros(512, 384)
        for i, (end, n) in enumerate(zip(ends, self.sizes.tolist())):
            ref[end - n:end] = self.lhs[end - n:end] @ self.rhs[i].T
        return ref


# --------------------------------------------------------------------------- cost-model table

QWEN3 = dict(hidden=2048, experts=128, top_k=8, inter=768)
TOKENS = (1, 64, 256, 4096)


def _problem(tokens, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    e, k = QWEN3["experts"], QWEN3["top_k"]
    ids = np.stack([rng.choice(e, k, replace=False) for _ in range(tokens)]).reshape(-1)
    return np.bincount(ids, minlength=e).astype(np.int32)


def _specs(m):
    import jax
    import jax.numpy as jnp

    h, e, i = QWEN3["hidden"], QWEN3["experts"], QWEN3["inter"]
    S = jax.ShapeDtypeStruct
    return dict(x=S((m, h), jnp.bfloat16), inter=S((m, i), jnp.bfloat16), inter2=S((m, 2 * i), jnp.bfloat16),
                gate_up=S((e, 2 * i, h), jnp.bfloat16), down=S((e, h, i), jnp.bfloat16))


def minimum(sizes):
    """Bytes: every active expert's weights once, the layer's input and output once; flops: the useful MXU work."""
    h, i = QWEN3["hidden"], QWEN3["inter"]
    m = int(sizes.sum())
    active = int((sizes > 0).sum())
    return active * 3 * h * i * 2 + 2 * m * h * 2, 2 * m * h * 3 * i


def _activation_pass(m):
    """The XLA pass the anchors need between their two matmuls (read [m, 2I], write [m, I]);
    the cost model counts kernels only, so it is added here at HBM bandwidth."""
    return m * 2 * QWEN3["inter"] * 2 + m * QWEN3["inter"] * 2


def ours(P, sizes, tiles=None):
    import jax.numpy as jnp
    from pallas_hub.bench import costmodel

    s = _specs(int(sizes.sum()))
    gs = jnp.asarray(sizes)
    (tm1, tn1), (tm2, tn2) = tiles or ((None, None), (None, None))

    def layer(x, gu, dn):
        hmid = P.gmm(x, gu, gs, transposed=True, activation="silu", tm=tm1, tn=tn1, chip="v6e")
        return P.gmm(hmid, dn, gs, transposed=True, tm=tm2, tn=tn2, chip="v6e")

    return costmodel.estimate(layer, s["x"], s["gate_up"], s["down"]), 0


def ours_fused(P, sizes):
    """Our experts path: the whole expert MLP in one kernel (what experts_forward runs)."""
    import jax.numpy as jnp
    from pallas_hub.bench import costmodel

    s = _specs(int(sizes.sum()))
    gs = jnp.asarray(sizes)
    layer = lambda x, gu, dn: P.fused_moe(x, gu, dn, gs, transposed=True, activation="silu", chip="v6e")  # noqa: E731
    return costmodel.estimate(layer, s["x"], s["gate_up"], s["down"]), 0


def megablox(sizes, tiles=((128, 128, 128), (128, 128, 128))):
    import jax.numpy as jnp
    import importlib

    mb = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
    from pallas_hub.bench import costmodel

    m = int(sizes.sum())
    mp = -(-m // 512) * 512  # megablox needs m divisible by tm: pad (rows past sum are not visited)
    s = _specs(mp)
    gs = jnp.asarray(sizes)

    def layer(x, gu, dn, mid):
        a = mb.gmm(x, gu, gs, jnp.bfloat16, tiling=tiles[0], transpose_rhs=True)
        b = mb.gmm(mid, dn, gs, jnp.bfloat16, tiling=tiles[1], transpose_rhs=True)
        return a, b

    return costmodel.estimate(layer, s["x"], s["gate_up"], s["down"], s["inter"]), _activation_pass(m)


def tokamax(sizes, tiles=None):
    import jax.numpy as jnp
    from pallas_hub.bench import costmodel
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as rd

    from ragged_dot_tpu import tokamax_anchor  # noqa: F401  (installs the CPU workarounds)

    tokamax_anchor._op()
    m = int(sizes.sum())
    mp = -(-m // 512) * 512
    s = _specs(mp)
    gs = jnp.asarray(sizes)

    class Op(rd.PallasMosaicTpuRaggedDot):
        def supported_on(self, device):
            return True

    ops = [Op(config=rd.Config(tile_m=t[0], tile_k=t[1], tile_n=t[2])) if t else Op() for t in (tiles or (None, None))]

    def layer(x, gu, dn, mid):
        a = ops[0](x, gu, group_sizes=gs, ragged_dot_dimension_numbers=rd.DLHS_RAGGED_DOT_DIM_NUMS,
                   preferred_element_type=jnp.bfloat16)
        b = ops[1](mid, dn, group_sizes=gs, ragged_dot_dimension_numbers=rd.DLHS_RAGGED_DOT_DIM_NUMS,
                   preferred_element_type=jnp.bfloat16)
        return a, b

    return costmodel.estimate(layer, s["x"], s["gate_up"], s["down"], s["inter"]), _activation_pass(m)


def _time(cost, extra_bytes, chip="v6e"):
    from pallas_hub.vendored import _chips as chips

    return cost.time(chip) + extra_bytes / chips.chip(chip).hbm_bandwidth


def _best(fn, candidates):
    best = None
    for tiles in candidates:
        try:
            cost, extra = fn(tiles)
        except Exception:  # noqa: BLE001 - a tiling the kernel refuses (divisibility, size)
            continue
        if best is None or _time(cost, extra) < _time(*best[1]):
            best = (tiles, (cost, extra))
    return best


def table(tokens=TOKENS, search=True):
    import importlib

    P = importlib.import_module("ragged_dot_tpu.pallas")
    h, i = QWEN3["hidden"], QWEN3["inter"]
    rows = []
    for t in tokens:
        sizes = _problem(t)
        min_bytes, min_flops = minimum(sizes)
        ideal = max(min_bytes / 1640e9, min_flops / 918e12)
        m = int(sizes.sum())
        runs = [("ours fused MLP (experts path)", lambda: ours_fused(P, sizes)),
                ("ours 2x gmm (auto tiles)", lambda: ours(P, sizes))]
        runs.append(("megablox gmm (128,128,128)", lambda: megablox(sizes)))
        runs.append(("tokamax mosaic (defaults)", lambda: tokamax(sizes)))
        if search:
            tms = [x for x in (128, 256, 512) if x <= max(m, 128)]
            mb_c = [((a, b, c), (a, d, e)) for a in tms for b, c in ((h, 2 * i), (512, 768))
                    for d, e in ((i, h), (i, 1024))]
            runs.append(("megablox gmm (best tiling)", lambda: _best(lambda tl: megablox(sizes, tl), mb_c)))
            runs.append(("tokamax mosaic (best tiling)", lambda: _best(lambda tl: tokamax(sizes, tl), mb_c)))
            our_c = [((a, i), (b, h)) for a in (16, 64, 128, 256, 512) for b in (64, 256, 512)]
            runs.append(("ours 2x gmm (best tiling)", lambda: _best(lambda tl: ours(P, sizes, tl), our_c)))
        for name, run in runs:
            res = run()
            tiles = ""
            if isinstance(res, tuple) and len(res) == 2 and isinstance(res[0], tuple):
                tiles, res = res
            cost, extra = res
            tt = _time(cost, extra)
            rows.append(dict(tokens=t, impl=name, tiles=str(tiles), hbm_mib=(cost.hbm_bytes + extra) / 2**20,
                             bytes_x_min=(cost.hbm_bytes + extra) / min_bytes, gflop=cost.flops / 1e9,
                             steps=cost.grid_steps, v6e_us=tt * 1e6, roofline=ideal / tt))
            print(f"{t:>5} {name:<30} {rows[-1]['hbm_mib']:9.1f} MiB  x{rows[-1]['bytes_x_min']:.3f}  "
                  f"{rows[-1]['gflop']:8.1f} GFLOP  {cost.grid_steps:7d} steps  {tt * 1e6:9.1f} us  "
                  f"roofline {ideal / tt:.3f}  {tiles}", file=sys.stderr, flush=True)
    return rows


if __name__ == "__main__":
    import os
    from pathlib import Path

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    root = Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root / "loader"))
    # import the package from a fresh build (it needs the vendored bridge and _ops)
    import tempfile

    from pallas_hub.hub import manifest
    from pallas_hub.hub.build import build_kernel

    out = build_kernel(manifest.load_kernel(root / "kernels" / "ragged_dot"), Path(tempfile.mkdtemp()))
    sys.path.insert(0, str(out / "torch-cpu"))
    tokens = tuple(int(x) for x in sys.argv[1].split(",")) if len(sys.argv) > 1 else TOKENS
    rows = table(tokens, search="--no-search" not in sys.argv)
    from tabulate import tabulate

    print(tabulate(rows, headers="keys", floatfmt=".3f"))
