"""Cost-model table for paged-attention-tpu (MODELLED TPU times from pallas_hub.bench.costmodel, never measured).

Run: PYTHONPATH=loader python kernels/paged_attention/benchmarks/costmodel_table.py [--quick]

Rows (Qwen3-30B-A3B attention: 32 q / 4 kv heads, head_dim 128, bf16):
  * decode 64 seqs x 8k (and 2k, 32k; 256 seqs x 2k): this kernel; jax's paged_attention (decode only,
    layout [Hkv, P, page, D]); gather-then-dense (XLA gathers the pages into a contiguous copy, then this
    kernel runs on the copy: the gather's read + write of the KV is added at HBM bandwidth, since the
    cost model only models Pallas calls);
  * mixed: decodes plus prefill chunks in one call.
Roofline: minimum bytes = KV tokens the queries can see (K and V) + q + out; minimum flops = 4 x Hq x D x
(visible query-key pairs); fraction = ideal time / modelled time.
"""

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "loader"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from pallas_hub.bench import costmodel  # noqa: E402
from pallas_hub.hub import manifest  # noqa: E402
from pallas_hub.hub.build import build_kernel, load_built  # noqa: E402
from pallas_hub.vendored._chips import chip as get_chip  # noqa: E402

HQ, HKV, D = 32, 4, 128
BF16 = jnp.bfloat16
S = jax.ShapeDtypeStruct


def batch(q_lens, kv_lens, page, seed=0):
    """Concrete metadata (shuffled pages) + abstract bulk data for the cost model."""
    rng = np.random.default_rng(seed)
    q_lens, kv_lens = np.asarray(q_lens), np.asarray(kv_lens)
    need = -(-kv_lens // page)
    pps = int(need.max())
    pool = rng.permutation(int(need.sum()))
    table = np.zeros((len(kv_lens), pps), np.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = pool[at: at + n]
        at += n
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    t = int(cu[-1])
    return dict(q=S((t, HQ, D), BF16), pages=S((int(need.sum()), page, HKV, D), BF16),
                kv_lens=jnp.asarray(kv_lens, jnp.int32), table=jnp.asarray(table), cu=jnp.asarray(cu),
                q_lens=q_lens, kv=kv_lens, num_pages=int(need.sum()))


def minimum(b, window=0):
    """Bytes and flops the problem needs: visible KV (K+V), q, out; QK and PV on visible pairs."""
    kv_tokens, pairs = 0, 0
    for lq, lk in zip(b["q_lens"], b["kv"]):
        first = lk - lq
        lo = 0 if not window else max(0, first - window + 1)
        kv_tokens += lk - lo
        for i in range(lq):  # keys 0..first+i (window-limited)
            pairs += first + i + 1 - (0 if not window else max(0, first + i - window + 1))
    item = 2
    t = int(sum(b["q_lens"]))
    return kv_tokens * 2 * HKV * D * item + 2 * t * HQ * D * item, 4 * HQ * D * pairs


def ours(k, b, **static):
    return costmodel.estimate(k.pallas.ragged_paged_attention, b["q"], b["pages"], b["pages"], b["kv_lens"],
                              b["table"], b["cu"], scale=D**-0.5, **static)


def jax_paged(b, page, pages_per_compute_block):
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    n = len(b["kv"])
    pages = S((HKV, b["num_pages"], page, D), BF16)
    return costmodel.estimate(
        lambda q, kp, vp, lens, table: paged_attention(q, kp, vp, lens, table,
                                                       pages_per_compute_block=pages_per_compute_block),
        S((n, HQ, D), BF16), pages, pages, b["kv_lens"], b["table"])


def rows(k, quick):
    chip = "v6e"
    bw = get_chip(chip).hbm_bandwidth
    out = []
    decodes = [(64, 8192, 128), (64, 8192, 16)] if quick else [
        (64, 8192, 128), (64, 8192, 16), (64, 2048, 128), (64, 32768, 128), (256, 2048, 16)]
    for n, ctx, page in decodes:
        b = batch([1] * n, [ctx] * n, page)
        mb, mf = minimum(b)
        c = ours(k, b)
        out.append((f"decode {n}x{ctx // 1024}k page {page}", "paged-attention-tpu", c.time(chip),
                    costmodel.roofline_fraction(c, mb, mf, chip)))
        try:
            cj = jax_paged(b, page, pages_per_compute_block=max(1, 512 // page))
            out.append(("", "jax paged_attention", cj.time(chip), costmodel.roofline_fraction(cj, mb, mf, chip)))
        except Exception as e:  # noqa: BLE001
            out.append(("", f"jax paged_attention: {type(e).__name__}: {str(e)[:80]}", float("nan"), float("nan")))
        # gather-then-dense: on the contiguous copy, read in 512-token blocks
        g = batch([1] * n, [ctx] * n, page=512, seed=1)
        cg = ours(k, g, block_kv=512)
        gather = 2 * n * ctx * 2 * HKV * D * 2 / bw
        t = cg.time(chip) + gather
        out.append(("", "gather (XLA, 2x KV bytes) + dense", t, costmodel.ideal_time(mb, mf, chip) / t))
    mixes = [("mixed 60 decodes x 8k + 4 prefill x 512 (ctx 4k)", [1] * 60 + [512] * 4, [8192] * 60 + [4096] * 4, 128, 0),
             ("same, 128-row tiles (block_q=16, the old default)", [1] * 60 + [512] * 4, [8192] * 60 + [4096] * 4, 128, 16)]
    if not quick:
        mixes.append(("mixed 250 decodes x 2k + 6 prefill x 1k (new)", [1] * 250 + [1024] * 6, [2048] * 250 + [1024] * 6,
                      16, 0))
    for name, ql, kl, page, bq in mixes:
        b = batch(ql, kl, page)
        mb, mf = minimum(b)
        c = ours(k, b, block_q=bq)
        out.append((name + f" page {page}", "paged-attention-tpu", c.time(chip), costmodel.roofline_fraction(c, mb, mf, chip)))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    spec = manifest.load_kernel(ROOT / "kernels" / "paged_attention")
    import tempfile

    k = load_built(build_kernel(spec, Path(tempfile.mkdtemp()) / "paged"))
    print("MODELLED on v6e by pallas_hub.bench.costmodel (no TPU timing); Qwen3-30B-A3B attention, bf16")
    print(f"| {'batch':<52} | {'implementation':<36} | {'model time (us)':>15} | {'roofline':>8} |")
    print(f"|{'-' * 54}|{'-' * 38}|{'-' * 17}|{'-' * 10}|")
    for name, impl, t, frac in rows(k, args.quick):
        print(f"| {name:<52} | {impl:<36} | {t * 1e6:>15.1f} | {frac:>8.3f} |")


if __name__ == "__main__":
    main()
