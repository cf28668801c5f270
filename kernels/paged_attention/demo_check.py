"""`pallas-hub demo`: paged-attention-tpu, as fetched from the local hub, against plain torch attention over
each sequence's gathered pages."""

import torch


def check(kernel, out=print):
    g = torch.Generator().manual_seed(0)
    page, hkv, hq, d = 16, 2, 4, 64
    kv_lens, q_lens = [37, 5, 20], [1, 5, 3]  # a decode step, a whole prompt, a prefill chunk
    table = torch.randperm(12, generator=g)[:9].reshape(3, 3).int()  # each sequence's pages, scattered
    k_pages, v_pages = torch.randn(12, page, hkv, d, generator=g), torch.randn(12, page, hkv, d, generator=g)
    q = torch.randn(sum(q_lens), hq, d, generator=g)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()]).int()
    got = kernel.ragged_paged_attention(q, k_pages, v_pages, torch.tensor(kv_lens).int(), table, cu, scale=d ** -0.5)
    refs = []
    for s, (lk, lq) in enumerate(zip(kv_lens, q_lens)):
        k, v = (p[table[s]].reshape(-1, hkv, d)[:lk].transpose(0, 1) for p in (k_pages, v_pages))  # [Hkv, lk, D]
        visible = torch.arange(lk)[None, :] <= torch.arange(lk - lq, lk)[:, None]  # bottom-right causal
        o = torch.nn.functional.scaled_dot_product_attention(q[cu[s]:cu[s + 1]].transpose(0, 1), k, v,
                                                             attn_mask=visible, enable_gqa=True)
        refs.append(o.transpose(0, 1))
    ref = torch.cat(refs)
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    out(f"  ragged_paged_attention, 3 sequences (decode, prompt, chunk) over scattered pages of {page}: "
        f"max |err| / max |ref| = {err:.1e}")
    return [("paged-attention-tpu: ragged_paged_attention matches plain torch attention", err < 1e-5)]
