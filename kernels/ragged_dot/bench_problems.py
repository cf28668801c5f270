"""What `pallas-hub bench` runs for ragged-dot-tpu: whole MoE experts layers (Qwen3-30B-A3B and GPT-OSS-20B,
1 to 8192 tokens) through the path transformers runs (`experts`, the fused expert MLP), beside megablox,
tokamax and vLLM TPU's grouped matmuls and fused_moe; and with fp8, int8 and MXFP4 weights as stored."""

import jax
import jax.numpy as jnp

from pallas_hub.hub.declarations import BenchImpl, chip_answered

FAMILY = "moe"


def implementation(kernel):
    def prepare(x, ids, weights, gate_up, down, logits, *scales, params):
        """The weights as transformers stores them for the model: GptOssExperts' [E, H, 2I] with gate
        and up in alternate columns and [E, I, H] (on TPU, [E, 2I, H] with H = 2880 off the lane grid
        is laid out {1,2,0}, and the kernel would be handed a copy of the whole weight each call)."""
        if params.get("storage") != "transposed-interleaved":
            return (x, ids, weights, gate_up, down, logits, *scales)

        def gate_up_stored(a):  # [E, 2I, H] = [gate; up] -> [E, H, 2I] = g0, u0, g1, u1, ...
            e, i2, h = a.shape
            return jnp.swapaxes(a.reshape(e, 2, i2 // 2, h), 1, 2).reshape(e, i2, h).swapaxes(1, 2)

        def lazily(f, a):  # bulk data may be abstract (ShapeDtypeStructs): only its shape changes
            return jax.eval_shape(f, a) if isinstance(a, jax.ShapeDtypeStruct) else f(a)

        return (x, ids, weights, lazily(gate_up_stored, gate_up), lazily(lambda a: jnp.swapaxes(a, 1, 2), down),
                logits, *scales)

    def fn(x, ids, weights, gate_up, down, logits, gate_up_scale=None, down_scale=None, *, top_k, chip):
        # transformers' [E, H, 2I] / [E, I, H], gate and up interleaved: GPT-OSS (bf16 from ``prepare``; MXFP4 as
        # from_pretrained_mxfp4 stores it, [E, in/2, out]); else [E, 2I, H] / [E, H, I]
        stored = str(gate_up.dtype) == "uint8" or gate_up.shape[1:] == (x.shape[1], 2 * down.shape[1])
        return kernel.experts.experts(x, ids, weights, gate_up, down, gate_up_scale=gate_up_scale,
                                      down_scale=down_scale, is_transposed=stored, interleaved=stored)

    # the kernel tiles (and converts fp8) for the generation it runs on: answer for the modelled one
    return BenchImpl(fn, per_chip=True, prepare=prepare, context=chip_answered(kernel.pallas),
                     formats=("bf16", "fp8", "int8", "mxfp4"))
