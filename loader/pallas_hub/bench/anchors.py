"""The anchors: the public Pallas TPU kernels a TPU user would pick instead of ours, as whole layers.

Each anchor runs through its public entry point inside the XLA program a user would write around
it (routing sort and gathers, padding, K/V head repeats, cache writes), because the benchmark
compares layers. Weights and caches are in the layout each kernel wants (arranged once, at load
time, outside what is timed). Anchors:

* MoE experts layer: jax's megablox ``gmm`` and tokamax's Mosaic ``ragged_dot`` (at their default
  tiling and at the best tiling the model finds), vLLM TPU's megablox ``gmm`` (its tuned block
  sizes) around the same routing glue as ours; vLLM TPU's ``fused_moe`` v1 (routing, both
  matmuls and the weighted sum in one kernel).
* prefill attention: jax's ``flash_attention`` and vLLM TPU's ``flash_attention`` (no GQA: K/V
  heads repeated), splash attention (one MQA kernel per K/V head).
* decode attention: jax's ``paged_attention`` (+ an XLA scatter writing the new K/V), vLLM TPU's
  ``ragged_paged_attention`` v3 (writes the new K/V itself).

``tpu_info_on_cpu`` answers kernels that ask the TPU for its properties while tracing on CPU.
"""

from __future__ import annotations

import contextlib
import functools

from .. import verify  # noqa: F401  (CPU-only JAX set-up before jax loads)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

# pages per compute block for jax's paged_attention, which has no default: 128 tokens per block,
# the setting of jax's own tests and benchmarks at page 16
PAGED_TOKENS_PER_COMPUTE_BLOCK = 128
GMM_ROW_MULTIPLE = 512  # megablox and tokamax need m to be a multiple of tile_m (128, 256 or 512)


@contextlib.contextmanager
def tpu_info_on_cpu(chip: str = "v6e"):
    """Let kernels that query the TPU while tracing (tokamax, emit_pipeline, tpu-inference) trace on CPU."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    version = {"v5e": pltpu.ChipVersion.TPU_V5E, "v6e": pltpu.ChipVersion.TPU_V6E,
               "tpu7x": pltpu.ChipVersion.TPU_7X}[chip]
    previous = tpu_info.registry.get("cpu")
    tpu_info.registry["cpu"] = lambda: pltpu.get_tpu_info_for_chip(version, 1)
    try:
        yield
    finally:
        if previous is None:
            tpu_info.registry.pop("cpu", None)
        else:
            tpu_info.registry["cpu"] = previous


# --------------------------------------------------------------------------- MoE experts layer

def route(top_k_index, num_experts: int):
    """What every grouped-matmul MoE layer does first: sort the (token, k) rows by expert."""
    k = top_k_index.shape[1]
    ids = top_k_index.reshape(-1).astype(jnp.int32)
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
    return order, order // k, group_sizes


def combine(y, order, top_k_weights):
    """Unsort the expert outputs and sum each token's top-k rows, weighted (f32 sum)."""
    t, k = top_k_weights.shape
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    rows = y[inverse].reshape(t, k, y.shape[-1]).astype(jnp.float32)
    return (rows * top_k_weights[:, :, None].astype(jnp.float32)).sum(axis=1)


def gmm_moe_layer(gmm_gate_up, gmm_down, x, top_k_index, top_k_weights, w_gate_up, w_down, *, mask_rows=False):
    """An experts layer on grouped matmuls ``gmm(lhs[m, k], rhs[g, k, n], sizes) -> [m, n]``.

    Weights [E, H, 2I] and [E, I, H] (the layout these kernels take). Rows are padded to a
    multiple of ``GMM_ROW_MULTIPLE`` (their tile_m must divide m); SiLU(gate) * up between the
    two matmuls is an XLA op. ``mask_rows``: zero the rows past the groups (tokamax leaves them unset)."""
    order, src, sizes = route(top_k_index, w_gate_up.shape[0])
    xs = x[src]
    m = xs.shape[0]
    xs = jnp.pad(xs, ((0, -m % GMM_ROW_MULTIPLE), (0, 0)))
    gate, up = jnp.split(gmm_gate_up(xs, w_gate_up, sizes), 2, axis=1)
    inter = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    y = gmm_down(inter, w_down, sizes)[:m]
    if mask_rows:
        y = jnp.where((jnp.arange(m) < sizes.sum())[:, None], y, 0)
    return combine(y, order, top_k_weights).astype(x.dtype)


def megablox(tiling=(128, 128, 128)):
    from jax.experimental.pallas.ops.tpu.megablox import ops as mb

    def gmm(lhs, rhs, sizes):
        return mb.gmm(lhs, rhs, sizes, preferred_element_type=lhs.dtype, tiling=tuple(tiling))

    return gmm


@functools.lru_cache(maxsize=None)
def _tokamax_op(tiling):
    from absl import flags
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as rd

    if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; otherwise they parse our sys.argv
        flags.FLAGS.mark_as_parsed()

    class AnyDeviceRaggedDot(rd.PallasMosaicTpuRaggedDot):
        def supported_on(self, device):  # tokamax checks the device; CPU runs it interpreted
            return True

    if tiling is None:
        return AnyDeviceRaggedDot()
    return AnyDeviceRaggedDot(config=rd.Config(tile_m=tiling[0], tile_k=tiling[1], tile_n=tiling[2]))


def tokamax(tiling=None):
    """tokamax's Mosaic ragged_dot; ``tiling=None``: its own choice (tuned table, else heuristic)."""
    op = _tokamax_op(None if tiling is None else tuple(tiling))

    def gmm(lhs, rhs, sizes):
        return op(lhs, rhs, group_sizes=sizes, preferred_element_type=lhs.dtype)

    return gmm


def vllm_gmm():
    """vLLM TPU's megablox gmm with its tuned block sizes (its table, else its default formula)."""
    from . import vllm_tpu

    g = vllm_tpu.gmm()

    def gmm(lhs, rhs, sizes):
        return g.gmm(lhs, rhs, sizes, preferred_element_type=lhs.dtype)

    return gmm


def gmm_tilings(m: int, k: int, n: int, vmem_limit: int) -> list[tuple[int, int, int]]:
    """Tilings to search for megablox/tokamax: tile_m 128-512, whole or halved k and n (multiples of
    128 dividing them), whose double-buffered blocks and f32 accumulator fit the scoped VMEM."""
    def widths(d):
        return sorted({w for w in (d, d // 2) if w and w % 128 == 0 and d % w == 0}, reverse=True)

    out = []
    for tm in (128, 256, 512):
        for tk in widths(k):
            for tn in widths(n):
                need = 2 * 2 * (tm * tk + tk * tn + tm * tn) + 4 * tm * tn
                if need <= vmem_limit * 0.9:
                    out.append((tm, tk, tn))
    return out


# scoped VMEM the compiler gives a kernel that sets no limit (megablox, tokamax, vLLM gmm set none)
DEFAULT_SCOPED_VMEM = {"v5e": 16 << 20, "v6e": 32 << 20, "tpu7x": 32 << 20}


def _subchannel_scales(w1, w2, w1_scale, w2_scale) -> dict:
    """fused_moe's quantization keywords: its scales are per output column and per ``subc`` inputs
    (w1_scale [E, 2, H / subc, 1, I], w2_scale [E, I / subc, 1, H]); per channel is subc = H (or I)."""
    if w1_scale is None:
        return {}
    return dict(w1_scale=w1_scale, w2_scale=w2_scale, subc_quant_w1_sz=w1.shape[2] // w1_scale.shape[2],
                subc_quant_w2_sz=w2.shape[1] // w2_scale.shape[1])


# fused_moe v1 takes hidden and intermediate sizes on the 128-lane grid only ("pad them with zeros outside
# the kernel"); vLLM TPU pads both to a multiple of 256 when it loads the weights (tpu-inference 0.32.0
# ``process_weights/moe_weights.py``, FUSED_MOE) and the tokens' hidden columns on each call (``layers/
# common/moe.py``). Zero columns and rows change no result: SiLU(0) * 0 = 0.
FUSED_MOE_ALIGN = 256


def fused_moe_v1_sizes(hidden: int, inter: int) -> tuple[int, int]:
    """The (hidden, intermediate) sizes vLLM TPU runs fused_moe v1 at: padded to ``FUSED_MOE_ALIGN``."""
    return -(-hidden // FUSED_MOE_ALIGN) * FUSED_MOE_ALIGN, -(-inter // FUSED_MOE_ALIGN) * FUSED_MOE_ALIGN


def _fused_moe_tokens(x, router_logits, hidden: int):
    """Tokens as fused_moe v1 takes them: hidden columns zero-padded to its weights' ``hidden`` (per call,
    as vLLM TPU does) and an even count of rows (bf16 packing); the logits padded to the same rows."""
    rows = x.shape[0] % 2
    return (jnp.pad(x, ((0, rows), (0, hidden - x.shape[1]))),
            jnp.pad(router_logits, ((0, rows), (0, 0))).astype(x.dtype))


def fused_moe_v1_layer(mesh, x, router_logits, w1, w2, w1_scale=None, w2_scale=None, *, top_k: int,
                       reference: bool = False):
    """vLLM TPU's fused_moe v1 on one device (a 1 x 1 mesh, no expert parallelism): routing by
    softmax top-k of the logits (renormalised, as Qwen3), SiLU experts, the weighted sum.
    Weights [E, 2, H', I'] and [E, I', H'] at ``fused_moe_v1_sizes`` (bf16, or quantized with
    sub-channel scales); tokens [T, H] padded around the call as vLLM TPU pads them.
    ``reference``: fused_moe v1's own plain-JAX reference (``ref_moe``, no mesh) on the same inputs and settings."""
    from . import vllm_tpu

    t, h = x.shape
    xp, logits = _fused_moe_tokens(x, router_logits, w1.shape[2])
    module = vllm_tpu.fused_moe_v1()
    call = module.ref_moe if reference else functools.partial(module.fused_ep_moe, mesh)
    out = call(xp, w1, w2, logits, top_k, renormalize_topk_logits=True, act_fn="silu", scoring_fn="softmax",
               **_subchannel_scales(w1, w2, w1_scale, w2_scale))
    return out[:t, :h]


def fused_moe_v1_blocks(tokens: int, hidden: int, inter: int, experts: int, top_k: int, weight_bytes: int = 2) -> dict:
    """The block sizes fused_moe v1 uses for this problem (its tuned table, else its default), for
    weights of ``weight_bytes`` an element (per-channel scales: no sub-channel override)."""
    from . import vllm_tpu

    vllm_tpu.install()
    from tpu_inference.kernels.fused_moe.v1 import tuned_block_sizes as tb

    t = tokens + tokens % 2
    bt, bf, bd1, bd2, btc, bfc, bd1c, bd2c = tb.get_tuned_block_sizes(hidden, inter, experts, top_k, 2, 4 // weight_bytes, t, 1)
    if t <= 2 * 8:
        bt = btc = t
    bt = min(t, bt)
    btc = min(bt, btc)
    return dict(tokens=t, bt=bt, bf=bf, bd1=bd1, bd2=bd2, btc=btc, bfc=bfc, bd1c=bd1c, bd2c=bd2c)


def fused_moe_v1_cost(top_k_index: np.ndarray, hidden: int, inter: int, experts: int, name: str,
                      weight_bytes: int = 2, channel_scales: bool = False):
    """What fused_moe v1 moves and computes for a routing, counted from its source
    (tpu-inference 0.32.0 ``kernels/fused_moe/v1/kernel.py``, one device): it routes inside the
    kernel from vector data, which ``costmodel.estimate`` cannot follow. ``hidden`` and ``inter`` are
    the sizes it runs at (``fused_moe_v1_sizes``).

    Per token block of ``bt`` tokens (a loop) and per expert (a loop inside it, over every expert,
    active or not): the expert's whole weights are fetched (w1 and w3 [H, I], w2 [I, H]), its tokens
    scattered in by one-row DMAs, both matmuls run in ``btc``-row chunks (a loop per (bf, bd) block
    with cdiv(expert tokens, btc) trips), the results gathered out to an HBM buffer; then the block's
    top-k rows are read back, weighted and written out. Loops are listed in program order (as the
    kernel's jaxpr has them) so the compiled schedule joins them. Quantized: ``weight_bytes`` an
    element and, with ``channel_scales``, one f32 scale per output column fetched beside them."""
    from .costmodel import CallCost, Cost, LoopInfo, StepType

    t0, k = top_k_index.shape
    b = fused_moe_v1_blocks(t0, hidden, inter, experts, k, weight_bytes)
    t, bt, btc = b["tokens"], b["bt"], b["btc"]
    num_bt, num_bf, num_bd1, num_bd2 = t // bt, inter // b["bf"], hidden // b["bd1"], hidden // b["bd2"]
    ids = np.concatenate([top_k_index, np.zeros((t - t0, k), top_k_index.dtype)]).astype(np.int64)
    loops = [LoopInfo(None, num_bt, False), LoopInfo(0, experts, True)]
    ffn = []  # (is ffn1, flops per iteration)
    for _ in range(num_bf):
        ffn += [(True, 2 * 2 * btc * b["bd1"] * b["bf"])] * num_bd1
        ffn += [(False, 2 * btc * b["bf"] * b["bd2"])] * num_bd2
    loops += [LoopInfo(1, None, False) for _ in ffn]
    row = hidden * 2  # bytes of one bf16 token row
    weights = 3 * hidden * inter * weight_bytes + (2 * inter + hidden) * 4 * channel_scales
    padded_e = -(-experts // 128) * 128
    iters = [num_bt, num_bt * experts] + [0] * len(ffn)
    flops = [0, 0, 0] + [0] * len(ffn)
    dma_r = [0, num_bt * (bt * padded_e * 2 + k * bt * row), 0] + [0] * len(ffn)
    dma_w = [0, num_bt * bt * row, 0] + [0] * len(ffn)
    for blk in range(num_bt):
        sizes = np.bincount(ids[blk * bt:(blk + 1) * bt].ravel(), minlength=experts)
        dma_r[2] += experts * weights + int(sizes.sum()) * row  # weights of every expert; token rows in
        dma_w[2] += int(sizes.sum()) * row  # expert outputs to the HBM buffer
        trips = -(-sizes // btc)
        for i, (_, f) in enumerate(ffn):
            iters[2 + i] += int(trips.sum())
            flops[3 + i] += int(trips.sum()) * f
    total_flops = sum(flops)
    step = StepType(1, 0, 0, tuple(flops), tuple(dma_r), tuple(dma_w), tuple(iters))
    level_flops = (0, 0, 0) + tuple(f for _, f in ffn)
    call = CallCost(name, (1,), (), sum(dma_r), sum(dma_w), 0, total_flops, num_bt * experts, None,
                    tuple(loops), (step,), level_flops)
    return Cost((call,))


# --------------------------------------------------------------------------- prefill attention

def repeat_kv(q, k, v):
    """For kernels without GQA: K/V heads repeated to the query heads (an XLA op, as transformers' sdpa path)."""
    rep = q.shape[1] // k.shape[1]
    return jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)


def jax_flash_attention(q, k, v, *, scale):
    from jax.experimental.pallas.ops.tpu import flash_attention as fa

    k, v = repeat_kv(q, k, v)
    return fa.flash_attention(q, k, v, causal=True, sm_scale=scale)


def vllm_flash_attention(q, k, v, *, scale):
    from . import vllm_tpu

    k, v = repeat_kv(q, k, v)
    return vllm_tpu.flash_attention().flash_attention(q, k, v, causal=True, sm_scale=scale)


# MaxText's splash block sizes (its base.yml: sa_block_* all 512, sa_use_fused_bwd_kernel False), what a
# JAX user training on TPU runs; splash's own default is 128 everywhere.
MAXTEXT_SPLASH_BLOCK = 512


@functools.lru_cache(maxsize=8)
def _splash_kernel(group: int, seq: int, block: int | None):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    mask = sm.MultiHeadMask([sm.CausalMask((seq, seq))] * group)
    sizes = None if block is None else sk.BlockSizes(*[min(block, seq)] * 8)  # q, kv, kv compute; dkv x3; dq x2
    with jax.ensure_compile_time_eval():  # its mask tables are cached: they must not be tracers
        return sk.make_splash_mqa_single_device(mask, block_sizes=sizes)


def splash_attention(q, k, v, *, scale, block=None):
    """Splash in its GQA form: one MQA kernel per K/V head over that head's query group; ``block`` for every
    block size (None: splash's defaults)."""
    b, hq, s, d = q.shape
    hkv = k.shape[1]
    kernel = _splash_kernel(hq // hkv, s, block)
    qg = (q * scale).reshape(b, hkv, hq // hkv, s, d)  # splash takes no softmax scale
    out = jax.vmap(jax.vmap(kernel))(qg, k, v)
    return out.reshape(b, hq, s, d)


# --------------------------------------------------------------------------- decode attention

def jax_paged_decode(q, new_k, new_v, k_pages, v_pages, lengths, page_indices, *, scale, cu_q_lens=None):
    """jax's paged_attention after writing this step's K/V into the pages with an XLA scatter.

    Pages [Hkv, P, page, D]; ``lengths`` include the new token. One query per sequence: no mixed batches."""
    if cu_q_lens is not None and list(cu_q_lens) != list(range(len(cu_q_lens))):
        raise NotImplementedError("jax's paged_attention attends one query per sequence: no prefill chunks")
    page = k_pages.shape[2]
    pos = lengths - 1
    pid = jnp.take_along_axis(page_indices, (pos // page)[:, None], axis=1)[:, 0]
    slot = pos % page
    k_pages = k_pages.at[:, pid, slot].set(jnp.swapaxes(new_k, 0, 1))
    v_pages = v_pages.at[:, pid, slot].set(jnp.swapaxes(new_v, 0, 1))
    from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

    ppcb = max(1, PAGED_TOKENS_PER_COMPUTE_BLOCK // page)
    out = paged_attention((q * scale).astype(q.dtype), k_pages, v_pages, lengths, page_indices,
                          pages_per_compute_block=ppcb)
    return out, k_pages, v_pages


def _rpa_batch(lengths, cu_q_lens):
    """RPA v3's (cu_q_lens, distribution) as vLLM TPU's runner sets them (decode requests first, then
    ``[decode, decode, all]``: the rest go to its mixed kernel; its prefill-only kernel needs one static
    chunk size, ``chunk_prefill_size``, which the runner does not pass)."""
    b = lengths.shape[0]
    cu = list(range(b + 1)) if cu_q_lens is None else [int(x) for x in cu_q_lens]
    decode = next((i for i in range(b) if cu[i + 1] - cu[i] != 1), b)
    return jnp.asarray(cu, jnp.int32), jnp.array([decode, decode, b], jnp.int32)


def _rpa(head_dim: int):
    """RPA v3's module for a head dim and its entry points' names: head dim 64 has its own variant
    (``kernel_hd64``: K and V of a head side by side in one 128-lane row), the rest the default kernel."""
    from . import vllm_tpu

    if head_dim == 64:
        return vllm_tpu.rpa_v3_hd64(), "ragged_paged_attention_hd64", "ref_ragged_paged_attention_hd64"
    return vllm_tpu.rpa_v3(), "ragged_paged_attention", "ref_ragged_paged_attention"


def vllm_rpa_decode(q, new_k, new_v, kv_cache, lengths, page_indices, *, scale, cu_q_lens=None):
    """vLLM TPU's ragged paged attention v3 on a decode or mixed batch (``cu_q_lens``: query rows per
    sequence): it writes the new K/V into its cache (``rpa_cache``) and attends."""
    module, attend, _ = _rpa(q.shape[-1])
    cu, distribution = _rpa_batch(lengths, cu_q_lens)
    out, cache = getattr(module, attend)(q, new_k, new_v, kv_cache, lengths, page_indices.reshape(-1), cu,
                                         distribution, sm_scale=scale)
    return out, cache


def vllm_rpa_reference(q, new_k, new_v, kv_cache, lengths, page_indices, *, scale, cu_q_lens=None):
    """RPA v3's own plain-JAX reference (``ref_ragged_paged_attention``) on the same inputs."""
    module, _, reference = _rpa(q.shape[-1])
    cu, distribution = _rpa_batch(lengths, cu_q_lens)
    out = getattr(module, reference)(q, new_k, new_v, kv_cache, lengths, page_indices.reshape(-1), cu, distribution,
                                     sm_scale=scale)
    return out[0] if isinstance(out, tuple) else out


def rpa_cache(k_pages, v_pages):
    """[P, page, Hkv, D] K and V pages in RPA v3's layout (``rpa_cache_shape``): K/V interleaved per
    head, packed pairs; head dim 64 (``kernel_hd64``): [K_h | V_h] in one 128-lane row, heads padded
    to whole packs."""
    p, page, hkv, d = k_pages.shape
    shape = rpa_cache_shape(k_pages.shape, k_pages.dtype)
    if d == 64:
        both = jnp.concatenate([k_pages, v_pages], axis=-1)
        both = jnp.pad(both, ((0, 0), (0, 0), (0, shape[2] * shape[3] - hkv), (0, 0)))
    else:
        both = jnp.stack([k_pages, v_pages], axis=3)  # k0 v0 k1 v1 ...
    return both.reshape(shape)


def rpa_cache_shape(kv_shape, dtype) -> tuple[int, ...]:
    """The shape of RPA v3's cache for K and V pages of shape [P, page, Hkv, D]."""
    p, page, hkv, d = kv_shape
    packing = 4 // jnp.dtype(dtype).itemsize
    if d == 64:
        return p, page, ceil_to(hkv, packing) // packing, packing, 128
    return p, page, 2 * hkv // packing, packing, d


def ceil_to(x: int, m: int) -> int:
    return -(-x // m) * m


__all__ = ["DEFAULT_SCOPED_VMEM", "GMM_ROW_MULTIPLE", "ceil_to", "combine", "fused_moe_v1_cost", "gmm_moe_layer",
           "gmm_tilings", "jax_flash_attention", "jax_paged_decode", "megablox", "route", "splash_attention",
           "tokamax", "tpu_info_on_cpu", "vllm_flash_attention", "vllm_gmm", "vllm_rpa_decode"]
