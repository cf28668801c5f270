"""What `pallas-hub bench` runs for paged-attention-tpu: the benchmark's decode problems (one new token per
sequence over 1k-4k token contexts in a shared page pool) beside jax's paged attention."""

import jax
import jax.numpy as jnp

from pallas_hub.hub.declarations import BenchImpl

FAMILY = "decode"  # problems: q [B, Hq, D], pages [Hkv, P, page, D] (jax paged_attention's layout), lengths, table


def _transpose(x, perm):
    """jnp.transpose that also maps a ShapeDtypeStruct (bulk data stays abstract for the cost model)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(tuple(x.shape[i] for i in perm), x.dtype)
    return jnp.transpose(x, perm)


def implementation(kernel):
    def prepare(q, k_pages, v_pages, lengths, page_indices):
        # this kernel's layout [P, page, Hkv, D] is transformers' paged cache: no copy in real use
        return q, _transpose(k_pages, (1, 2, 0, 3)), _transpose(v_pages, (1, 2, 0, 3)), lengths, page_indices

    def fn(q, k_pages, v_pages, lengths, page_indices, *, scale):
        cu_q_lens = jnp.arange(q.shape[0] + 1, dtype=jnp.int32)  # decode: one new token per sequence
        return kernel.pallas.ragged_paged_attention(q, k_pages, v_pages, lengths, page_indices, cu_q_lens, scale=scale)

    return BenchImpl(fn, prepare=prepare)
