"""What `pallas-hub bench` runs for paged-attention-tpu: one decode step of a continuous batch (write the
new token's K/V into the paged cache, then attend; 1 to 256 sequences of 1k-4k tokens, pages of 16 and 128;
and mixed batches of decode sequences and prefill chunks) beside jax's paged attention and vLLM TPU's ragged paged attention v3; and on fp8 and int8 caches."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_hub.hub.declarations import BenchImpl, chip_answered

FAMILY = "decode"  # the family's cache layout [P, page, Hkv, D] is this kernel's (and transformers' paged cache);
# head dims below 128 are run lane-packed (``lane_packed``)


def implementation(kernel):
    def fn(q, new_k, new_v, k_pages, v_pages, lengths, table, k_scale=None, v_scale=None, *, scale, chip,
           cu_q_lens=None):
        # decode: one new token per sequence; a mixed batch gives its query rows per sequence. Host values, as
        # a serving loop passes them and as the anchors' adapters build theirs (constants, not an on-device iota)
        cu_q_lens = np.asarray(np.arange(q.shape[0] + 1) if cu_q_lens is None else cu_q_lens, np.int32)
        return kernel.pallas.write_and_attend(q, new_k, new_v, k_pages, v_pages, lengths, table, cu_q_lens, scale=scale,
                                              k_scale=k_scale, v_scale=v_scale)

    def lane_packed(q, new_k, new_v, k_pages, v_pages, *rest, params=None):
        """An unquantized cache of head dim below 128 is held lane-packed (``pallas.kv_heads``): the layout
        XLA:TPU keeps row-major, so it is not copied around the kernels on every call."""
        shape = kernel.pallas.lane_packed_shape(k_pages)
        if shape is None:
            return (q, new_k, new_v, k_pages, v_pages, *rest)
        k_pages, v_pages = (jax.ShapeDtypeStruct(shape, x.dtype) if isinstance(x, jax.ShapeDtypeStruct)
                            else x.reshape(shape) for x in (k_pages, v_pages))
        return (q, new_k, new_v, k_pages, v_pages, *rest)

    # an fp8 cache converts per generation (``reads_e4m3_as_b11``): answer for the modelled one
    return BenchImpl(fn, per_chip=True, prepare=lane_packed, context=chip_answered(kernel.pallas), donate=(3, 4),
                     formats=("bf16", "fp8", "int8"))
