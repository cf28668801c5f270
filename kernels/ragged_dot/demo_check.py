"""`pallas-hub demo`: ragged-dot-tpu, as fetched from the local hub, against a plain-torch grouped matmul."""

import torch


def check(kernel, out=print):
    g = torch.Generator().manual_seed(0)
    sizes = [9, 0, 17, 11]  # 37 rows, one group empty
    lhs, rhs = torch.randn(37, 96, generator=g), torch.randn(4, 96, 80, generator=g)
    got = kernel.ragged_dot(lhs, rhs, torch.tensor(sizes))
    ref = torch.cat([x @ w for x, w in zip(lhs.split(sizes), rhs)])
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    out(f"  ragged_dot, 37 rows in 4 groups (one empty), k 96, n 80, f32: max |err| / max |ref| = {err:.1e}")
    return [("ragged-dot-tpu: ragged_dot matches a plain-torch grouped matmul", err < 1e-5)]
