"""What `pallas-hub bench` runs for ragged-dot-tpu: the benchmark's MoE problems (the expert projections of
Qwen3-30B-A3B and GPT-OSS-20B, decode to prefill) beside jax's megablox gmm and tokamax's ragged_dot."""

from pallas_hub.hub.declarations import BenchImpl

FAMILY = "moe"  # problems: lhs [rows, k], rhs [experts, k, n], group_sizes [experts]


def implementation(kernel):
    def fn(lhs, rhs, group_sizes, chip="v6e"):
        return kernel.pallas.gmm(lhs, rhs, group_sizes, chip=chip)

    return BenchImpl(fn, per_chip=True)  # block sizes per TPU generation
