"""Compile matrix of ragged-dot-tpu: what `pallas-hub check ragged_dot` compiles for v5e, v6e and TPU7x.

ragged_dot (forward, the gate_up layer), its backward, and the whole experts op at real MoE
shapes (transformers' weight layouts, bf16) for 1, 64, 256 and 4096 tokens (top-k rows each; 1 token,
bucket 8, is the decode kernel, the others the row-tiled fused kernel);
quantized experts (fp8 e4m3 with transformers' 128x128 block scale_inv, int8 per channel) at
Qwen3-30B-A3B's shapes (fused kernel) and DeepSeek-V3's (two grouped matmuls); GPT-OSS-20B's MXFP4
experts in the layout ``from_pretrained_mxfp4`` stores (the checkpoint's own layout took 565 s to compile
for v5e, with a 270 MiB HBM relayout copy of gate_up: that is why the loader re-lays it out once).
"""

import functools

import jax
import jax.numpy as jnp

from pallas_hub.verify.matrix import Config

# name: (hidden, experts, top_k, moe_intermediate, activation); checked against the models' configs
MODELS = {
    "qwen3-30b-a3b": (2048, 128, 8, 768, "silu"),
    "gemma4-26b-a4b": (2816, 128, 8, 704, "gelu_tanh"),
}
TOKENS = (1, 64, 256, 4096)
S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16


def _rd_specs(m, h, e, i):
    return S((m, h), BF16), S((e, 2 * i, h), BF16), S((e,), jnp.int32)  # gate_up layer, [E, 2I, H] as is


def _experts_specs(t, h, e, k, i, weights_dtype=jnp.float32):
    return (S((t, h), BF16), S((t, k), jnp.int32), S((t, k), weights_dtype), S((e, 2 * i, h), BF16),
            S((e, h, i), BF16))


def _quantized_specs(t, h, e, k, i, wdt):
    """hidden, ids, routing weights, gate_up [E, 2I, H], down [E, H, I] in ``wdt``, and their scales."""
    if wdt == jnp.int8:  # per output channel
        scales = (S((e, 2 * i), jnp.float32), S((e, h), jnp.float32))
    else:  # transformers' FP8: scale_inv per 128x128 block
        scales = (S((e, -(-2 * i // 128), -(-h // 128)), jnp.float32), S((e, -(-h // 128), -(-i // 128)), jnp.float32))
    return (S((t, h), BF16), S((t, k), jnp.int32), S((t, k), jnp.float32), S((e, 2 * i, h), wdt),
            S((e, h, i), wdt)) + scales


def configs(kernel):
    P, X = kernel.pallas, kernel.experts

    def forward(lhs, rhs, gs):
        return P.ragged_dot(lhs, rhs, gs, rhs_transposed=True)

    def backward(lhs, rhs, gs):
        return jax.grad(lambda a, w: forward(a, w, gs).astype(jnp.float32).sum(), (0, 1))(lhs, rhs)

    out = []
    for model, (h, e, k, i, act) in MODELS.items():
        for t in TOKENS:
            m = t * k
            out.append(Config(f"{model} ragged_dot fwd T={t}", forward, _rd_specs(m, h, e, i)))
            out.append(Config(f"{model} ragged_dot fwd+bwd T={t}", backward, _rd_specs(m, h, e, i)))
            tb = X.bucket(t)
            out.append(Config(f"{model} experts T={t} (bucket {tb})", X.experts, _experts_specs(tb, h, e, k, i),
                              dict(activation=act)))
    # GPT-OSS-20B: transposed, interleaved gate/up with biases, clamped swiglu, bf16 routing weights
    # (64 tokens: the fused kernel in tiles of the intermediate, decode-sized row chunks; 2048: 256 rows an
    # expert, the fused kernel in 960-unit tiles on v6e, two grouped matmuls on v5e and TPU7x)
    h, e, k, i = 2880, 32, 4, 2880
    for t in (64, 2048):
        out.append(Config(
            f"gpt-oss-20b experts T={t}", X.experts,
            (S((t, h), BF16), S((t, k), jnp.int32), S((t, k), BF16), S((e, h, 2 * i), BF16), S((e, i, h), BF16),
             S((e, 2 * i), BF16), S((e, h), BF16)),
            dict(activation="swiglu_oai", alpha=1.702, limit=7.0, is_transposed=True, interleaved=True)))
    # Quantized experts: dequantized in VMEM, bf16 MXU (the FP8 path transformers' FP8Experts takes)
    def quantized(x, ids, w, gu, dn, gus, dns, activation="silu"):
        return X.experts(x, ids, w, gu, dn, activation=activation, gate_up_scale=gus, down_scale=dns)

    h, e, k, i, _ = MODELS["qwen3-30b-a3b"]
    for t in (1, 64, 4096):
        tb = X.bucket(t)
        out.append(Config(f"qwen3-30b-a3b fp8 experts T={t} (bucket {tb})", quantized,
                          _quantized_specs(tb, h, e, k, i, jnp.float8_e4m3fn)))
    for t in (1, 64):  # 1: the decode kernel, dequantizing each routed expert into VMEM
        out.append(Config(f"qwen3-30b-a3b int8 experts T={t}", quantized, _quantized_specs(X.bucket(t), h, e, k, i, jnp.int8)))
    # DeepSeek-V3: 256 experts of H=7168, I=2048 do not fit VMEM whole: two grouped matmuls, fp8 weights
    out.append(Config("deepseek-v3 fp8 experts T=64", quantized, _quantized_specs(64, 7168, 256, 8, 2048, jnp.float8_e4m3fn)))
    # GPT-OSS-20B's MXFP4 experts as from_pretrained_mxfp4 stores them (mxfp4_kernel_layout): blocks
    # [E, in/2, out] uint8, e8m0 scales [E, in/32 padded to 32 rows, out], biases; interleaved gate/up
    h, e, k, i = 2880, 32, 4, 2880
    rows = -(-h // 32 // 32) * 32

    def mxfp4(x, ids, w, gu, dn, gub, dnb, gus, dns):
        return X.experts(x, ids, w, gu, dn, gub, dnb, gate_up_scale=gus, down_scale=dns, activation="swiglu_oai",
                         alpha=1.702, limit=7.0, is_transposed=True, interleaved=True)

    for t in (1, 64):
        out.append(Config(f"gpt-oss-20b mxfp4 experts T={t}", mxfp4, (
            S((t, h), BF16), S((t, k), jnp.int32), S((t, k), BF16), S((e, h // 2, 2 * i), jnp.uint8),
            S((e, i // 2, h), jnp.uint8), S((e, 2 * i), BF16), S((e, h), BF16), S((e, rows, 2 * i), jnp.uint8),
            S((e, rows, h), jnp.uint8))))
    # Expert parallelism: Qwen3-30B-A3B's 128 experts over 8 chips (16 local), tokens replicated.
    from jax.sharding import NamedSharding, PartitionSpec

    from pallas_hub.vendored._chips import EIGHT_CHIP_TOPOLOGY
    from pallas_hub.verify import tpu_mesh

    mesh = tpu_mesh(("ep",), (8,), EIGHT_CHIP_TOPOLOGY)
    rep, shard = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("ep"))
    h, e, k, i, _ = MODELS["qwen3-30b-a3b"]
    for t in (1, 64, 4096):  # 1: the decode kernel on each rank's 16 experts
        specs = [S(a.shape, a.dtype, sharding=rep if n < 3 else shard)
                 for n, a in enumerate(_experts_specs(t, h, e, k, i))]
        out.append(Config(f"qwen3-30b-a3b experts EP=8 T={t}", functools.partial(X.experts_sharded, mesh),
                          tuple(specs), dict(activation="silu"), chips=("v6e",), topology=EIGHT_CHIP_TOPOLOGY))
    # Declared unsupported, to prove the check can fail: forced 4096-wide tiles of a k=16384 weight
    # (2 x 128 MiB weight buffers) exceed every chip's VMEM.
    out.append(Config(
        "forced tile_n=4096 at k=16384 (VMEM overflow)",
        lambda a, w, g: P.ragged_dot(a, w, g, tile_m=128, tile_n=4096),
        (S((1024, 16384), BF16), S((4, 16384, 4096), BF16), S((4,), jnp.int32)),
        fails_with="RESOURCE_EXHAUSTED"))
    return out
