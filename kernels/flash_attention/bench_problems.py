"""What `pallas-hub bench` runs for flash-attention-tpu: causal prefill (Qwen3-30B-A3B and GPT-OSS-20B
attention, 2k and 8k tokens) beside jax's Pallas flash attention, splash and vLLM TPU's flash attention."""

from pallas_hub.hub.declarations import BenchImpl

FAMILY = "prefill"


def implementation(kernel):
    def fn(q, k, v, *, scale, chip):
        return kernel.pallas.flash_attention(q, k, v, scale=scale, causal=True, chip=chip)

    return BenchImpl(fn, per_chip=True)  # block sizes per TPU generation
