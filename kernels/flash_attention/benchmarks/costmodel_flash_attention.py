"""Modelled TPU cost of flash-attention-tpu next to jax's Pallas flash_attention and splash attention.

Every figure is the cost model's (pallas_hub.bench.costmodel: HBM bytes the Pallas pipelines move, MXU
flops executed, grid steps x 0.35 us), never a TPU measurement. Shapes: Qwen3-30B-A3B attention,
32 q / 4 kv heads, head_dim 128, bf16, batch 1 (prefill) or 8 (decode).

* ours: K/V read once per KV group (GQA native), only needed blocks scheduled.
* jax flash_attention: no GQA, so K/V are repeated to 32 heads first (the repeat itself, XLA work,
  is not counted: only the kernel is); block sizes 512 (q) x 512/512 (k major/minor) for a fair fight.
* splash: MQA kernel per KV head (vmapped over the 4 KV heads, as its reference does for GQA),
  CausalMask or FullMask, blocks 512 x 1024 (v6e-sized).

Roofline fraction = ideal time (minimum flops at MXU peak, or minimum bytes at HBM bandwidth,
whichever is larger) / modelled time. Minimum flops count only the allowed (query, key) pairs.

    PYTHONPATH=loader python kernels/flash_attention/benchmarks/costmodel_flash_attention.py [--chips v6e]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path

from pallas_hub.bench import costmodel  # sets JAX_PLATFORMS=cpu first

import jax
import jax.numpy as jnp

HQ, HKV, D = 32, 4, 128
CASES = {  # name: (batch, Sq, Sk, causal)
    "prefill 8k causal": (1, 8192, 8192, True),
    "prefill 8k non-causal": (1, 8192, 8192, False),
    "prefill 2k causal": (1, 2048, 2048, True),
    "decode b8 vs 8k": (8, 1, 8192, True),
    "decode b8 vs 32k": (8, 1, 32768, True),
}


def load_package():
    """The kernel's Pallas module, built the way a Hub download is (shared modules vendored)."""
    import tempfile

    from pallas_hub.hub import manifest
    from pallas_hub.hub.build import build_kernel, load_built

    spec = manifest.load_kernel(Path(__file__).resolve().parents[1])
    return load_built(build_kernel(spec, Path(tempfile.mkdtemp(prefix="flash-costmodel-")))).pallas


def specs(b, sq, sk, hkv=HKV):
    S = jax.ShapeDtypeStruct
    return S((b, HQ, sq, D), jnp.bfloat16), S((b, hkv, sk, D), jnp.bfloat16), S((b, hkv, sk, D), jnp.bfloat16)


def ours(pallas, chip, causal):
    return functools.partial(pallas.flash_attention, causal=causal, chip=chip)


def jax_flash(sq, sk, causal):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    bq, bk = min(512, sq), min(512, sk)
    blocks = fa.BlockSizes(block_q=bq, block_k_major=bk, block_k=bk, block_b=1, block_q_major_dkv=bq,
                           block_k_major_dkv=bk, block_k_dkv=bk, block_q_dkv=bq, block_k_major_dq=bk,
                           block_k_dq=bk, block_q_dq=bq)

    # Its causal mask is top-left aligned: for one decode query (bottom-right: every key visible)
    # the equivalent is no mask. Our cases are Sq == Sk or Sq == 1.
    assert sq in (1, sk)
    causal = causal and sq == sk

    def f(q, k, v):  # no GQA: every q head needs its own K/V head
        return fa.flash_attention(q, k, v, causal=causal, sm_scale=D ** -0.5, block_sizes=blocks)

    return f


def splash(sq, sk, causal):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    g = HQ // HKV
    mask = sa.CausalMask((sq, sk), offset=sk - sq) if causal else sa.FullMask((sq, sk))
    bq, bkv = min(512, sq), min(1024, sk)
    blocks = sa.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
                           block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv)
    kernel = sa.make_splash_mqa_single_device(sa.MultiHeadMask([mask] * g), block_sizes=blocks)

    def f(q, k, v):  # GQA as splash's own reference: the MQA kernel per KV head
        b, _, sq_, d = q.shape
        qg = q.reshape(b, HKV, g, sq_, d) * D ** -0.5
        return jax.vmap(jax.vmap(kernel))(qg, k, v)

    return f


def with_backward(fn):
    """forward + backward (dq, dk, dv) of fn, as jax.grad runs them."""
    def f(q, k, v):
        return jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))(q, k, v)
    return f


def min_cost(b, sq, sk, causal, backward=False):
    pairs = sum(min(sk, sk - sq + i + 1) for i in range(sq)) if causal else sq * sk
    flops = 4 * b * HQ * pairs * D
    bytes_ = 2 * (2 * b * HQ * sq * D + 2 * b * HKV * sk * D)  # read q, k, v; write o (bf16)
    if backward:  # flash backward: 5 matmuls (QK^T recomputed, dP, dV, dQ, dK) on top of the forward's 2
        flops, bytes_ = flops * 7 // 2, bytes_ * 5 // 2  # + read o, do; write dq, dk, dv
    return bytes_, flops


def row(name, chip, impl, fn, args, min_bytes, min_flops):
    try:
        cost = costmodel.estimate(fn, *args)
    except Exception as e:  # an anchor that cannot run a shape says so in the table
        return dict(case=name, chip=chip, impl=impl, error=f"{type(e).__name__}: {str(e)[:80]}")
    t = cost.time(chip)
    return dict(case=name, chip=chip, impl=impl, us=t * 1e6, frac=costmodel.roofline_fraction(cost, min_bytes, min_flops, chip),
                hbm_mb=cost.hbm_bytes / 2**20, gflop=cost.flops / 1e9, steps=cost.grid_steps)


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--chips", default="v5e,v6e,tpu7x")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--no-anchors", action="store_true")
    ap.add_argument("--backward", action="store_true", help="forward + backward (jax.grad) instead of forward")
    a = ap.parse_args(argv)
    pallas = load_package()
    rows = []
    for chip in a.chips.split(","):
        for name in a.cases.split(","):
            b, sq, sk, causal = CASES[name]
            if a.backward and sq == 1:
                continue  # decode has no backward worth modelling
            mb, mf = min_cost(b, sq, sk, causal, a.backward)
            wrap = with_backward if a.backward else (lambda f: f)
            name = name + (" fwd+bwd" if a.backward else "")
            start = len(rows)
            rows.append(row(name, chip, "ours", wrap(ours(pallas, chip, causal)), specs(b, sq, sk), mb, mf))
            if not a.no_anchors:
                rows.append(row(name, chip, "jax flash (K/V repeated)", wrap(jax_flash(sq, sk, causal)),
                                specs(b, sq, sk, hkv=HQ), mb, mf))
                rows.append(row(name, chip, "splash (MQA per KV head)", wrap(splash(sq, sk, causal)),
                                specs(b, sq, sk), mb, mf))
            print(_fmt(rows[start:]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return rows


def _fmt(rows):
    out = []
    for r in rows:
        if "error" in r:
            out.append(f"| {r['case']} | {r['chip']} | {r['impl']} | n/a: {r['error']} |||||")
        else:
            out.append(f"| {r['case']} | {r['chip']} | {r['impl']} | {r['us']:.1f} | {r['frac']:.2f} | "
                       f"{r['hbm_mb']:.1f} | {r['gflop']:.1f} | {r['steps']} |")
    return "\n".join(out)


if __name__ == "__main__":
    print("| case | chip | kernel | modelled us | roofline frac | HBM MiB | GFLOP | grid steps |")
    print("|---|---|---|---|---|---|---|---|")
    main()
