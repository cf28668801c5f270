"""What `pallas-hub bench` runs for ragged-dot-tpu: whole MoE experts layers (Qwen3-30B-A3B and GPT-OSS-20B,
1 to 8192 tokens) through the path transformers runs (`experts`, the fused expert MLP), beside megablox,
tokamax and vLLM TPU's grouped matmuls and fused_moe; and with fp8, int8 and MXFP4 weights as stored."""

import contextlib

from pallas_hub.hub.declarations import BenchImpl

FAMILY = "moe"


def implementation(kernel):
    @contextlib.contextmanager
    def chip_context(chip):  # the kernel tiles for the generation it runs on: answer for the modelled one
        saved = kernel.pallas.current_chip
        kernel.pallas.current_chip = lambda: chip
        try:
            yield
        finally:
            kernel.pallas.current_chip = saved

    def fn(x, ids, weights, gate_up, down, logits, gate_up_scale=None, down_scale=None, *, top_k, chip):
        mxfp4 = str(gate_up.dtype) == "uint8"  # as from_pretrained_mxfp4 stores GPT-OSS's: [E, in/2, out], interleaved
        return kernel.experts.experts(x, ids, weights, gate_up, down, gate_up_scale=gate_up_scale,
                                      down_scale=down_scale, is_transposed=mxfp4, interleaved=mxfp4)

    return BenchImpl(fn, per_chip=True, context=chip_context, formats=("bf16", "fp8", "int8", "mxfp4"))
