"""Compile matrix of paged-attention-tpu: Qwen3-30B-A3B attention (32 q / 4 kv heads, head_dim 128).

Decode (one new token per sequence) and mixed batches (a few prefill chunks among decodes) for 64 and
256 sequences at 2k to 32k tokens of context, pages of 16 and 128 tokens, bf16 (f32 for one), and the
KV write kernel. The cache pool holds exactly the pages the batch needs (num_seqs x context / page).
Quantized caches (float8_e4m3fn, int8 with per-KV-head scales, bf16 queries): decode and mixed reads,
and the quantizing write. GPT-OSS-20B attention (64 q / 8 kv heads of 64, sinks, a 128-token window) on
its lane-packed cache [P, page, 4, 128]: decode, a mixed batch, the write. ``write_and_attend`` (the write
inside the attention kernel) on decode and mixed batches, bf16, fp8 and int8 caches, and GPT-OSS's.
"""

import jax
import jax.numpy as jnp

from pallas_hub.verify.matrix import Config

HQ, HKV, D = 32, 4, 128


def _attention(kernel, num_seqs, context, page, dtype=jnp.bfloat16, tokens=None, cache=None):
    """(fn, args) of one call; ``cache`` a quantized cache dtype (then per-KV-head scales follow)."""
    s = jax.ShapeDtypeStruct
    pps = context // page
    pages = num_seqs * pps
    t = tokens or num_seqs
    cache = cache or dtype
    args = (s((t, HQ, D), dtype), s((pages, page, HKV, D), cache), s((pages, page, HKV, D), cache),
            s((num_seqs,), jnp.int32), s((num_seqs, pps), jnp.int32), s((num_seqs + 1,), jnp.int32))
    if cache != dtype:
        args += (None, s((HKV,), jnp.float32), s((HKV,), jnp.float32))  # sinks, k_scale, v_scale
        return (lambda q, k, v, lens, table, cu, sinks, ks, vs, **static: kernel.pallas.ragged_paged_attention(
            q, k, v, lens, table, cu, sinks, k_scale=ks, v_scale=vs, **static)), args
    return kernel.pallas.ragged_paged_attention, args


def _fits(name, fn, args, static, tokens):
    """256 x 32k tokens of bf16 K+V is 16 GiB: more than v5e's 15.75 GiB of HBM. Declared, so it must fail."""
    if tokens * 2 * HKV * D * 2 < 15 * 2**30:
        return [Config(name, fn, args, static)]
    return [Config(name, fn, args, static, chips=("v6e", "tpu7x")),
            Config(name + " (cache > v5e HBM)", fn, args, static, chips=("v5e",), fails_with="RESOURCE_EXHAUSTED")]


def configs(kernel):
    out = []
    for num_seqs in (64, 256):
        for context in (2048, 8192, 32768):
            for page in (16, 128):
                fn, args = _attention(kernel, num_seqs, context, page)
                out += _fits(f"decode {num_seqs} seqs x {context // 1024}k bf16 page {page}", fn, args,
                             dict(scale=D**-0.5), num_seqs * context)
        # mixed: 4 prefill chunks of 512 tokens plus decodes, 2048 + num_seqs - 4 query rows
        for context, page in ((8192, 128), (32768, 16)):
            fn, args = _attention(kernel, num_seqs, context, page, tokens=4 * 512 + num_seqs - 4)
            out += _fits(f"mixed {num_seqs} seqs {context // 1024}k bf16 page {page}", fn, args,
                         dict(scale=D**-0.5), num_seqs * context)
    fn, args = _attention(kernel, 64, 8192, 64, jnp.float32)
    out.append(Config("decode 64 seqs x 8k f32 page 64, window 4096 softcap 30", fn, args,
                      dict(scale=D**-0.5, window=4096, softcap=30.0)))
    fn, args = _attention(kernel, 64, 2048, 256)
    out.append(Config("decode 64 seqs x 2k bf16 page 256", fn, args, dict(scale=D**-0.5)))
    for name, cache in (("fp8", jnp.float8_e4m3fn), ("int8", jnp.int8)):
        for page in (16, 128):
            fn, args = _attention(kernel, 64, 8192, page, cache=cache)
            out.append(Config(f"decode 64 seqs x 8k {name} cache page {page}", fn, args, dict(scale=D**-0.5)))
        fn, args = _attention(kernel, 256, 32768, 16, tokens=4 * 512 + 252, cache=cache)  # 8 GiB: fits v5e
        out.append(Config(f"mixed 256 seqs 32k {name} cache page 16, window 4096", fn, args,
                          dict(scale=D**-0.5, window=4096)))
    out += _gpt_oss(kernel) + _fused(kernel)
    s = jax.ShapeDtypeStruct
    meta = (s((64,), jnp.int32), s((64, 64), jnp.int32), s((65,), jnp.int32))
    new = s((2048, HKV, D), jnp.bfloat16)
    for name, dtype in (("bf16", jnp.bfloat16), ("fp8", jnp.float8_e4m3fn), ("int8", jnp.int8)):
        cache = s((64 * 64, 128, HKV, D), dtype)
        scales = () if dtype == jnp.bfloat16 else (s((HKV,), jnp.float32),) * 2
        out.append(Config(f"write_kv 2048 tokens into 64 seqs x 8k {name} page 128", kernel.pallas.write_kv,
                          (cache, cache, new, new, *meta, *scales)))
    return out


def _gpt_oss(kernel):
    """GPT-OSS-20B's attention on a lane-packed cache (``pallas.kv_heads``): 2 heads of 64 a 128-lane row."""
    s = jax.ShapeDtypeStruct
    hq, hkv, d, num_seqs, context = 64, 8, 64, 64, 8192
    out = []
    for kind, page, tokens in (("decode", 16, num_seqs), ("mixed", 128, 4 * 512 + num_seqs - 4)):
        pages = num_seqs * context // page
        cache = s((pages, page, hkv * d // 128, 128), jnp.bfloat16)
        args = (s((tokens, hq, d), jnp.bfloat16), cache, cache, s((num_seqs,), jnp.int32),
                s((num_seqs, context // page), jnp.int32), s((num_seqs + 1,), jnp.int32), s((hq,), jnp.bfloat16))
        out.append(Config(f"GPT-OSS {kind} {num_seqs} seqs x 8k lane-packed bf16 page {page}, sinks, window 128",
                          kernel.pallas.ragged_paged_attention, args, dict(scale=d**-0.5, window=128)))
    cache = s((64 * 64, 128, hkv * d // 128, 128), jnp.bfloat16)
    new = s((2048, hkv, d), jnp.bfloat16)
    meta = (s((64,), jnp.int32), s((64, 64), jnp.int32), s((65,), jnp.int32))
    out.append(Config("GPT-OSS write_kv 2048 tokens into 64 seqs x 8k lane-packed bf16 page 128", kernel.pallas.write_kv,
                      (cache, cache, new, new, *meta)))
    return out


def _fused(kernel):
    """``write_and_attend``: the new K/V rows [T, Hkv, D] before the caches, the write inside the kernel."""
    s = jax.ShapeDtypeStruct
    out = []
    for name, num_seqs, context, page, tokens, cache in (
            ("decode 64 seqs x 8k bf16 page 16", 64, 8192, 16, 64, jnp.bfloat16),
            ("decode 256 seqs x 2k bf16 page 128", 256, 2048, 128, 256, jnp.bfloat16),
            ("mixed 64 seqs x 8k bf16 page 128", 64, 8192, 128, 4 * 512 + 60, jnp.bfloat16),
            ("decode 64 seqs x 8k fp8 cache page 16", 64, 8192, 16, 64, jnp.float8_e4m3fn),
            ("mixed 64 seqs x 8k int8 cache page 16, window 4096", 64, 8192, 16, 4 * 512 + 60, jnp.int8)):
        _, (q, k, v, *meta) = _attention(kernel, num_seqs, context, page, tokens=tokens, cache=cache)
        new = s((tokens, HKV, D), jnp.bfloat16)
        fn = kernel.pallas.write_and_attend
        if cache != jnp.bfloat16:  # scales as keywords (the matrix passes positional arrays)
            fn = (lambda q, nk, nv, k, v, lens, table, cu, ks, vs, **static: kernel.pallas.write_and_attend(
                q, nk, nv, k, v, lens, table, cu, k_scale=ks, v_scale=vs, **static))
            del meta[3]  # sinks: none
        out.append(Config(f"write_and_attend {name}", fn, (q, new, new, k, v, *meta),
                          dict(scale=D**-0.5, **({"window": 4096} if "window" in name else {}))))
    hq, hkv, d, num_seqs, context, page, tokens = 64, 8, 64, 64, 8192, 16, 4 * 512 + 60
    cache = s((num_seqs * context // page, page, hkv * d // 128, 128), jnp.bfloat16)
    new = s((tokens, hkv, d), jnp.bfloat16)
    args = (s((tokens, hq, d), jnp.bfloat16), new, new, cache, cache, s((num_seqs,), jnp.int32),
            s((num_seqs, context // page), jnp.int32), s((num_seqs + 1,), jnp.int32), s((hq,), jnp.bfloat16))
    out.append(Config("write_and_attend GPT-OSS mixed 64 seqs x 8k lane-packed bf16 page 16, sinks, window 128",
                      kernel.pallas.write_and_attend, args, dict(scale=d**-0.5, window=128)))
    return out

