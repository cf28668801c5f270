"""paged-attention-tpu: ragged paged attention (continuous batching) as a Pallas TPU kernel.

* ``ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=None, scale=0.0, window=0,
  softcap=0.0, block_q=0, block_kv=512)``: torch op (scale 0.0 = head_dim**-0.5); see
  ``pallas.ragged_paged_attention`` for layouts.
* ``write_kv(...)`` -> (k_pages', v_pages'): functional torch op writing new tokens into their pages
  (the JAX kernel aliases the cache: in place under jit with donation); ``write_kv_`` updates the
  torch caches in place (on CPU: zero-copy in, one ``copy_`` of each cache out).
* ``paged_attention_forward``: the transformers attention function for continuous batching,
  ``enable_continuous_batching()``: registers it (see CARD.md).
"""

import torch

from . import pallas
from ._bridge import jax_op
from ._ops import add_op_namespace_prefix
from .transformers_cb import CB_NAME, enable_continuous_batching, paged_attention_forward


def _fake_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=None, scale=0.0, window=0,
                    softcap=0.0, block_q=0, block_kv=512):
    return torch.empty_like(q)


def _fake_write(k_pages, v_pages, new_k, new_v, kv_lens, page_indices, cu_q_lens):
    return torch.empty_like(k_pages), torch.empty_like(v_pages)


ragged_paged_attention = jax_op(add_op_namespace_prefix("ragged_paged_attention"), pallas.ragged_paged_attention,
                                fake=_fake_attention, validate=pallas.validate)
write_kv = jax_op(add_op_namespace_prefix("write_kv"), pallas.write_kv, fake=_fake_write,
                  returns=tuple[torch.Tensor, torch.Tensor], validate=pallas.validate_write)


def write_kv_(k_cache, v_cache, new_k, new_v, kv_lens, page_indices, cu_q_lens):
    """Write the new tokens into the torch caches ``k_cache``/``v_cache`` in place.

    Runs the functional ``write_kv`` op (zero-copy in on CPU) and copies back only the pages it
    wrote: k_cache and v_cache may be overlapping views of one buffer (transformers' paged cache
    interleaves layers' K and V pages), so copying whole caches back would undo each other's writes.
    """
    import jax.numpy as jnp
    import numpy as np

    pid, _ = pallas.write_slots(jnp.asarray(kv_lens.cpu().numpy(), jnp.int32),
                                jnp.asarray(page_indices.cpu().numpy(), jnp.int32),
                                jnp.asarray(cu_q_lens.cpu().numpy(), jnp.int32),
                                new_k.shape[0], k_cache.shape[0], k_cache.shape[1])
    pid = np.asarray(pid)
    pages = torch.from_numpy(np.unique(pid[pid >= 0]).astype(np.int64)).to(k_cache.device)
    k, v = write_kv(k_cache, v_cache, new_k, new_v, kv_lens, page_indices, cu_q_lens)
    k_cache[pages] = k[pages]
    v_cache[pages] = v[pages]


REGISTRATIONS = [{"registry": "paged_attention", "name": CB_NAME, "function": "paged_attention_forward"}]
__all__ = ["ragged_paged_attention", "write_kv", "write_kv_", "paged_attention_forward",
           "enable_continuous_batching", "CB_NAME", "pallas"]
