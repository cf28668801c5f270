"""`pallas-hub demo`: flash-attention-tpu, as fetched from the local hub, against torch's SDPA."""

import torch


def check(kernel, out=print):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 77, 64, generator=g)  # GQA 4 / 2 heads, 77 tokens: not a block multiple
    k, v = torch.randn(2, 2, 77, 64, generator=g), torch.randn(2, 2, 77, 64, generator=g)
    got, _ = kernel.attention(q, k, v, scale=64 ** -0.5, causal=True)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    out(f"  attention, causal GQA 4/2 heads, 77 tokens, d 64, f32: max |err| / max |ref| = {err:.1e}")
    return [("flash-attention-tpu: attention matches torch's scaled_dot_product_attention", err < 1e-5)]
