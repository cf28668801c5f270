"""Compile matrix of flash-attention-tpu: Qwen3-30B-A3B attention (32 q / 4 kv heads, head_dim 128,
bf16), forward and backward, 2k/8k causal prefill and decode against 8k/32k contexts; GQA 16:1 and
head_dim 256 at 8k; compiled for each TPU generation with that chip's block sizes and VMEM limit."""

import functools

import jax
import jax.numpy as jnp

from pallas_hub.verify.matrix import Config

HQ, HKV, D = 32, 4, 128
SHAPES = {  # name: (batch, q_len, kv_len)
    "prefill 2k": (1, 2048, 2048),
    "prefill 8k": (1, 8192, 8192),
    "decode vs 8k, batch 8": (8, 1, 8192),
    "decode vs 32k, batch 8": (8, 1, 32768),
}


def forward(kernel, q, k, v, **static):
    return kernel.pallas.flash_attention(q, k, v, **static)


def backward(kernel, q, k, v, **static):
    loss = lambda q, k, v: kernel.pallas.flash_attention(q, k, v, **static).astype(jnp.float32).sum()  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def specs(b, sq, sk, d=D, hq=HQ, hkv=HKV, dtype=jnp.bfloat16):
    S = jax.ShapeDtypeStruct
    return S((b, hq, sq, d), dtype), S((b, hkv, sk, d), dtype), S((b, hkv, sk, d), dtype)


def configs(kernel):
    out = []
    for chip in ("v5e", "v6e", "tpu7x"):
        for name, (b, sq, sk) in SHAPES.items():
            for label, fn in (("fwd", forward), ("fwd+bwd", backward)):
                out.append(Config(f"qwen3-30b-a3b {name} causal {label}", functools.partial(fn, kernel, chip=chip),
                                  specs(b, sq, sk), dict(causal=True), chips=(chip,)))
        # the other GQA ratio and head dim the bench races: Qwen3-235B-A22B (64 q / 4 kv heads, GQA 16:1)
        # and Gemma-3-4B's global layers (8 q / 4 kv heads, head_dim 256), 8k causal
        for name, (hq, hkv, d) in {"qwen3-235b-a22b (GQA 16:1)": (64, 4, 128),
                                   "gemma-3-4b (head_dim 256)": (8, 4, 256)}.items():
            for label, fn in (("fwd", forward), ("fwd+bwd", backward)):
                out.append(Config(f"{name} prefill 8k causal {label}", functools.partial(fn, kernel, chip=chip),
                                  specs(1, 8192, 8192, d=d, hq=hq, hkv=hkv), dict(causal=True), chips=(chip,)))
        # GPT-OSS-like sliding-window layer with sinks and soft-cap, head_dim 64, as a feature check
        out.append(Config("window 128 + sinks + softcap, D=64, 4k fwd+bwd",
                          functools.partial(_features, kernel, chip=chip),
                          specs(1, 4096, 4096, d=64, hq=64, hkv=8), chips=(chip,)))
    # (the chip is bound in the partial: compile_for_tpu's own `chip` picks the target)
    # Blocks far too large for VMEM: declared unsupported, must fail (proves the check can fail).
    out.append(Config("D=256, 2048x4096 blocks (VMEM overflow)", functools.partial(forward, kernel, chip="tpu7x"),
                      specs(1, 8192, 8192, d=256), dict(block_q=2048, block_k=4096),
                      fails_with="RESOURCE_EXHAUSTED", chips=("tpu7x",)))
    return out


def _features(kernel, q, k, v, **static):
    sinks = jnp.linspace(-1.0, 1.0, q.shape[1], dtype=jnp.float32)

    def loss(q, k, v, sinks):
        o = kernel.pallas.flash_attention(q, k, v, sinks, window=128, softcap=50.0, **static)
        return o.astype(jnp.float32).sum()

    return jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sinks)
