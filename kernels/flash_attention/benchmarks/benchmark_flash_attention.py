"""`kernels benchmark` for flash-attention-tpu: the torch op on Qwen3-30B-A3B attention shapes
(32 q / 4 kv heads, head_dim 128), verified against torch's SDPA.

On a CPU host the kernel runs in Pallas interpret mode, so the timings say nothing about a TPU
(modelled TPU costs: RESULTS.md beside this file, from `pallas-hub bench`). `kernels benchmark` does not synchronise TPU
devices, so every benchmark_ method ends with the vendored bridge's synchronize.
Shapes are kept modest so that the CPU interpreter finishes.

`kernels benchmark` checks with torch.allclose(out, verify_..., atol=1e-2) on the bf16 output. Above 2 one
bf16 ulp is 1.6e-2, so there the check would demand the exact rounding of the true value, which no kernel that
feeds the MXU bf16 probabilities gives (ours, jax flash, splash): its error is about half an ulp plus 3e-4
relative. v is drawn at std 0.25 (|out| <= max|v| stays below 2, where one ulp is 7.8e-3), so the check
still fails on any error larger than about one ulp. Accuracy proper is tested in tests/, against float64.
"""

import importlib

import torch
from kernels.benchmark import Benchmark

HQ, HKV, D = 32, 4, 128


def _sdpa(q, k, v, causal):
    return torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                                            enable_gqa=True).to(q.dtype)


def _synchronize(kernel, out):
    importlib.import_module(kernel.__name__ + "._bridge").synchronize(out)


class FlashAttentionBenchmark(Benchmark):
    seed = 0

    def _make(self, b, sq, sk, dtype=torch.bfloat16):
        self.q = torch.randn(b, HQ, sq, D, device=self.device, dtype=dtype)
        self.k = torch.randn(b, HKV, sk, D, device=self.device, dtype=dtype)
        self.v = (0.25 * torch.randn(b, HKV, sk, D, device=self.device)).to(dtype)  # see the module docstring

    # prefill, causal
    def setup_prefill_1k(self):
        self._make(1, 1024, 1024)

    def benchmark_prefill_1k(self):
        self.out = self.kernel.attention(self.q, self.k, self.v, None, None, None, D ** -0.5, True)[0]
        _synchronize(self.kernel, self.out)

    def verify_prefill_1k(self):
        return _sdpa(self.q, self.k, self.v, True)

    # decode against a 4k context, batch 8 (bottom-right causal = every key)
    def setup_decode_4k(self):
        self._make(8, 1, 4096)

    def benchmark_decode_4k(self):
        self.out = self.kernel.attention(self.q, self.k, self.v, None, None, None, D ** -0.5, True)[0]
        _synchronize(self.kernel, self.out)

    def verify_decode_4k(self):
        return _sdpa(self.q, self.k, self.v, False)
