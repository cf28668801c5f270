"""What `pallas-hub bench` runs for flash-attention-tpu: the benchmark's causal prefill problems (Qwen3-30B-A3B
and GPT-OSS-20B attention, 2k-8k tokens) beside jax's Pallas flash attention and splash attention."""

from pallas_hub.hub.declarations import BenchImpl

FAMILY = "prefill"  # problems: q [B, Hq, S, D], k/v [B, Hkv, S, D], kwargs scale


def implementation(kernel):
    def fn(q, k, v, *, scale, chip="v6e"):
        return kernel.pallas.flash_attention(q, k, v, scale=scale, causal=True, chip=chip)

    return BenchImpl(fn, per_chip=True)  # block sizes per TPU generation
