"""The attention math shared by flash and paged attention (pallas_hub/vendored/_attention_math.py): blockwise online softmax equals the dense reference (sinks, windows,
soft-cap, padding, fully masked rows)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_hub.vendored import _attention_math as am


def _naive(q, k, v, scale, causal, window, softcap, sink, kv_len, q_len):
    """Per-row softmax written out with numpy loops: independent of both code paths under test."""
    sq, sk = q.shape[0], k.shape[0]
    out = np.zeros_like(q, dtype=np.float64)
    for i in range(min(sq, q_len)):
        qp = kv_len - q_len + i
        logits, vals = [], []
        for j in range(kv_len):
            if (causal and j > qp) or (window is not None and j <= qp - window):
                continue
            s = float(q[i] @ k[j]) * scale
            logits.append(softcap * np.tanh(s / softcap) if softcap else s)
            vals.append(v[j])
        denominator_extra = [sink] if sink is not None else []
        if not logits:
            continue
        z = np.array(logits + denominator_extra)
        p = np.exp(z - z.max())
        p /= p.sum()
        out[i] = p[: len(logits)] @ np.array(vals)
    return out


@pytest.mark.parametrize("causal,window,softcap,sink", [(True, None, None, None), (True, 3, 5.0, 0.3),
                                                         (False, None, None, -1.0), (True, 1, None, None)])
def test_blockwise_online_softmax_matches_dense_and_naive(causal, window, softcap, sink):
    sq, sk, d, kv_len, q_len, block = 5, 11, 16, 9, 4, 4
    q, k, v = (np.asarray(jax.random.normal(jax.random.key(i), shape)) for i, shape in
               enumerate([(sq, d), (sk, d), (sk, d)]))
    m, l, acc = jnp.full((sq, 1), am.MASK_VALUE), jnp.zeros((sq, 1)), jnp.zeros((sq, d))
    q_pos = (kv_len - q_len) + jnp.arange(sq)[:, None]
    for s0 in range(0, sk, block):
        k_pos = s0 + jnp.arange(min(block, sk - s0))[None, :]
        ok = am.allowed(q_pos, k_pos, causal=causal, window=window) & (k_pos < kv_len) & (jnp.arange(sq)[:, None] < q_len)
        s = am.scores(q, k[s0:s0 + block], scale=0.25, softcap=softcap)
        m, l, acc = am.online_softmax_step(m, l, acc, s, ok, v[s0:s0 + block])
    out, _ = am.finalize(m, l, acc, sink)
    dense = am.reference_attention(q[None, None], k[None, None], v[None, None], scale=0.25, causal=causal,
                                   window=window, softcap=softcap, sinks=None if sink is None else jnp.array([sink]),
                                   q_lens=jnp.array([q_len]), kv_lens=jnp.array([kv_len]))[0, 0]
    naive = _naive(q, k, v, 0.25, causal, window, softcap, sink, kv_len, q_len)
    np.testing.assert_allclose(np.asarray(out), naive, atol=2e-6)
    np.testing.assert_allclose(np.asarray(dense), naive, atol=2e-6)
    assert np.all(np.asarray(out)[q_len:] == 0)  # padding query rows are exactly 0, not NaN
