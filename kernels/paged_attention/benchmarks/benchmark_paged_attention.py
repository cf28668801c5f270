"""`kernels benchmark` for paged-attention-tpu: the torch op on Qwen3-30B-A3B attention shapes
(32 q / 4 kv heads, head_dim 128, bf16) over a shuffled page pool, verified against a per-sequence
torch SDPA on the gathered pages.

On a CPU host the kernel runs in Pallas interpret mode, so these timings say nothing about a TPU
(modelled TPU costs: RESULTS.md beside this file, from `pallas-hub bench`). `kernels benchmark` does not synchronise TPU devices; on
TorchTPU, time with the device synchronised. Shapes are modest so that the CPU interpreter finishes.
"""

import importlib

import torch
from kernels.benchmark import Benchmark

HQ, HKV, D, PAGE = 32, 4, 128, 64


def _reference(q, kp, vp, kv_lens, table, cu):
    out = torch.zeros_like(q)
    for s in range(len(kv_lens)):
        lq, lk = int(cu[s + 1] - cu[s]), int(kv_lens[s])
        if lq == 0:
            continue
        pages = table[s, : -(-lk // PAGE)].long()
        k = kp[pages].reshape(-1, HKV, D)[:lk].transpose(0, 1).float()
        v = vp[pages].reshape(-1, HKV, D)[:lk].transpose(0, 1).float()
        qs = q[cu[s]: cu[s + 1]].transpose(0, 1).float()  # [Hq, lq, D]
        mask = torch.arange(lk)[None, :] <= torch.arange(lq)[:, None] + (lk - lq)  # bottom-right causal
        o = torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)
        out[cu[s]: cu[s + 1]] = o.transpose(0, 1).to(q.dtype)
    return out


class PagedAttentionBenchmark(Benchmark):
    seed = 0

    def _make(self, q_lens, kv_lens):
        need = [-(-n // PAGE) for n in kv_lens]
        perm = torch.randperm(sum(need) + 3)
        self.table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
        at = 0
        for i, n in enumerate(need):
            self.table[i, :n] = perm[at: at + n]
            at += n
        self.cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
        self.kv_lens = torch.tensor(kv_lens, dtype=torch.int32)
        self.q = torch.randn(int(self.cu[-1]), HQ, D, device=self.device, dtype=torch.bfloat16)
        self.kp = torch.randn(len(perm), PAGE, HKV, D, device=self.device, dtype=torch.bfloat16)
        # values scaled so outputs stay below 1: the runner's atol=1e-2 is then above one bf16 ulp of the
        # output (prefill rows that see few keys output almost a raw V row)
        self.vp = 0.25 * torch.randn(len(perm), PAGE, HKV, D, device=self.device, dtype=torch.bfloat16)

    def _run(self):
        self.out = self.kernel.ragged_paged_attention(self.q, self.kp, self.vp, self.kv_lens, self.table, self.cu,
                                                      None, scale=D ** -0.5)
        # kernels benchmark does not synchronise TPUs: wait for the result (the vendored bridge's helper)
        importlib.import_module(self.kernel.__name__ + "._bridge").synchronize(self.out)

    def _verify(self):
        return _reference(self.q, self.kp, self.vp, self.kv_lens, self.table, self.cu)

    # decode: 16 sequences x 2k context, one new token each
    def setup_decode_16x2k(self):
        self._make([1] * 16, [2048] * 16)

    def benchmark_decode_16x2k(self):
        self._run()

    def verify_decode_16x2k(self):
        return self._verify()

    # mixed: 12 decodes at 1k plus two prefill chunks of 128 tokens
    def setup_mixed(self):
        self._make([1] * 12 + [128, 128], [1024] * 12 + [128, 640])

    def benchmark_mixed(self):
        self._run()

    def verify_mixed(self):
        return self._verify()
