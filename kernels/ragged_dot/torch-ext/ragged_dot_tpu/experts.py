"""transformers' experts contract in one op: route, gate_up + activation (fused), down, weight, unsort, sum.

``experts_forward(self, hidden_states[T, H], top_k_index[T, k], top_k_weights[T, k]) -> [T, H]`` is
what ``ALL_EXPERTS_FUNCTIONS.register("tokamax_ragged_dot", experts_forward)`` plugs in. It reads
the weights and the activation off ``self`` and makes one custom-op call whose JAX body is
``experts`` below. Token counts are padded to a bucket (padding rows are routed to no expert, so
they cost no weight traffic, and above 8 tokens no MXU work), so a decode loop compiles once per bucket,
not once per batch size. Expert ids outside [0, num_experts) are expert-parallel sentinels: never
computed, they contribute zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import torch

from . import pallas
from ._bridge import check_array, dtype_name, jax_op
from ._ops import add_op_namespace_prefix

TRACES = {"experts": 0}  # how many times the experts op was traced (= compiled): see bucket()


def bucket(num_tokens: int) -> int:
    """Padded token count: 8, 16, 32, ... 1024, then multiples of 1024 (4 shapes for 1..64 tokens)."""
    if num_tokens <= 8:
        return 8
    if num_tokens <= 1024:
        return 1 << (num_tokens - 1).bit_length()
    return -(-num_tokens // 1024) * 1024


# --------------------------------------------------------------------------- the JAX function

def validate_scales(gate_up_proj, down_proj, gate_up_scale, down_scale, is_transposed=False, interleaved=False,
                    block_size=pallas.FP8_BLOCK):
    """Quantized expert weights: their dtype, layout, block size and scales (shapes and dtypes)."""
    quantized = dtype_name(gate_up_proj) in pallas.QUANT_DTYPES
    for name, scale in (("gate_up_scale", gate_up_scale), ("down_scale", down_scale)):
        if scale is not None and not quantized:
            raise TypeError(f"{name} is given but gate_up_proj has dtype {dtype_name(gate_up_proj)}; scales go with "
                            f"quantized weights ({', '.join(pallas.QUANT_DTYPES)})")
        if scale is None and quantized:
            raise ValueError(f"{name} is missing: {dtype_name(gate_up_proj)} weights need their scales "
                             f"({pallas.QUANT_DTYPES[dtype_name(gate_up_proj)]})")
    if not quantized:
        return
    wdt = dtype_name(gate_up_proj)
    if wdt != "uint8" and (is_transposed or interleaved):
        raise NotImplementedError("quantized experts: fp8 and int8 only in transformers' [E, 2I, H] / [E, H, I] "
                                  "layout (is_transposed=False) with concatenated [gate; up]")
    if wdt == "float8_e4m3fn" and block_size != pallas.FP8_BLOCK:
        raise ValueError(f"block_size must be {pallas.FP8_BLOCK} (128x128 blocks, the layout of Qwen3-FP8 and "
                         f"DeepSeek-V3 checkpoints), got {block_size}")
    e, i2, h = gate_up_proj.shape
    i = down_proj.shape[2]
    b = pallas.FP8_BLOCK
    cdiv = lambda a: -(-a // b)  # noqa: E731
    if wdt == "float8_e4m3fn":  # gate_up: of the concatenated tensor, or gate and up quantized apart
        gu_shapes = {(e, cdiv(i2), cdiv(h)), (e, max(2 * cdiv(i), 2), cdiv(h))}
        dn_shapes = {(e, cdiv(h), cdiv(i))}
    elif wdt == "uint8":  # MXFP4: packed input widths (2 values per byte), 16 bytes per scale
        gu_in, dn_in = (gate_up_proj.shape[1], down_proj.shape[1]) if is_transposed else (h, i)
        if gu_in % 16 or dn_in % 16:
            raise ValueError(f"MXFP4 weights need whole 32-value blocks: gate_up_proj {tuple(gate_up_proj.shape)} "
                             f"and down_proj {tuple(down_proj.shape)} must have packed input widths that are "
                             "multiples of 16 bytes")
        if is_transposed:  # [E, in/32, out], or with padding rows after them (from_pretrained_mxfp4 pads)
            for name, scale, w, n in (("gate_up_scale", gate_up_scale, gate_up_proj, gu_in),
                                      ("down_scale", down_scale, down_proj, dn_in)):
                check_array(name, scale, dtypes=("uint8",), ndim=3)
                if scale.shape[0] != e or scale.shape[1] < n // 16 or scale.shape[2] != w.shape[2]:
                    raise ValueError(f"{name} must be [{e}, >= {n // 16}, {w.shape[2]}] (e8m0 per 32 inputs, rows "
                                     f"past {n // 16} are padding) for MXFP4 weights {tuple(w.shape)}, got "
                                     f"{list(scale.shape)}")
            return
        else:
            gu_shapes, dn_shapes = {(e, i2, h // 16)}, {(e, down_proj.shape[1], i // 16)}
    else:
        gu_shapes, dn_shapes = {(e, i2)}, {(e, h)}
    scale_dtype = "uint8" if wdt == "uint8" else "float32"
    for name, scale, shapes in (("gate_up_scale", gate_up_scale, gu_shapes), ("down_scale", down_scale, dn_shapes)):
        check_array(name, scale, dtypes=(scale_dtype,), ndim=len(next(iter(shapes))))
        if tuple(scale.shape) not in shapes:
            want = " or ".join(str(list(x)) for x in sorted(shapes))
            raise ValueError(f"{name} must be {want} for {wdt} weights of shape {tuple(gate_up_proj.shape)} / "
                             f"{tuple(down_proj.shape)} ({pallas.QUANT_DTYPES[wdt]}), got {list(scale.shape)}")


def validate(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias=None,
             down_bias=None, activation="silu", alpha=1.702, limit=7.0, is_transposed=False,
             interleaved=False, implementation="pallas", gate_up_scale=None, down_scale=None,
             block_size=pallas.FP8_BLOCK):
    check_array("hidden_states", hidden_states, dtypes=pallas.DTYPES, ndim=2)
    check_array("top_k_index", top_k_index, dtypes=("int32", "int64"), ndim=2)
    check_array("top_k_weights", top_k_weights, dtypes=pallas.DTYPES, ndim=2)
    for name, w in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if hasattr(w, "qvalue"):  # an array-like quantized wrapper (qwix QArray): say what the op takes instead
            raise TypeError(f"{name} is a {type(w).__module__.split('.')[0]} {type(w).__name__}: pass its quantized "
                            f"values as {name} and its scales as {name.removesuffix('_proj')}_scale "
                            f"({'; '.join(f'{k}: {v}' for k, v in pallas.QUANT_DTYPES.items())})")
    check_array("gate_up_proj", gate_up_proj, dtypes=pallas.DTYPES + tuple(pallas.QUANT_DTYPES), ndim=3)
    check_array("down_proj", down_proj, dtypes=(dtype_name(gate_up_proj),), ndim=3)
    if activation not in pallas.ACTIVATIONS[1:]:
        raise ValueError(f"activation must be one of {pallas.ACTIVATIONS[1:]}, got {activation!r}")
    if implementation not in ("pallas", "tokamax"):
        raise ValueError(f"implementation must be 'pallas' or 'tokamax', got {implementation!r}")
    t, h = hidden_states.shape
    if tuple(top_k_index.shape) != tuple(top_k_weights.shape) or top_k_index.shape[0] != t:
        raise ValueError(f"top_k_index {tuple(top_k_index.shape)} and top_k_weights {tuple(top_k_weights.shape)} "
                         f"must both be [num_tokens={t}, top_k]")
    e = gate_up_proj.shape[0]
    pack = 2 if dtype_name(gate_up_proj) == "uint8" else 1  # MXFP4: two inputs per byte
    # [E, 2I, H] / [E, H, I] (transformers' default), or [E, H, 2I] / [E, I, H] when is_transposed
    gu_in, gu_out = (gate_up_proj.shape[1] * pack, gate_up_proj.shape[2]) if is_transposed else \
        (gate_up_proj.shape[2] * pack, gate_up_proj.shape[1])
    dn_in, dn_out = (down_proj.shape[1] * pack, down_proj.shape[2]) if is_transposed else \
        (down_proj.shape[2] * pack, down_proj.shape[1])
    if gu_in != h or dn_out != h:
        raise ValueError(f"hidden size mismatch: hidden_states has {h}, gate_up_proj {tuple(gate_up_proj.shape)} "
                         f"and down_proj {tuple(down_proj.shape)} (is_transposed={is_transposed})")
    if down_proj.shape[0] != e or gu_out != 2 * dn_in:
        raise ValueError(f"gate_up_proj {tuple(gate_up_proj.shape)} must hold [gate; up] for the intermediate size "
                         f"of down_proj {tuple(down_proj.shape)} and the same number of experts")
    if dn_in == 0 and e:
        raise ValueError(f"the experts' intermediate size is 0 (down_proj {tuple(down_proj.shape)}); an expert MLP "
                         f"needs at least one intermediate unit")
    for name, b, width in (("gate_up_bias", gate_up_bias, gu_out), ("down_bias", down_bias, h)):
        if b is not None:
            check_array(name, b, dtypes=pallas.DTYPES, ndim=2)
            if tuple(b.shape) != (e, width):
                raise ValueError(f"{name} must be [{e}, {width}], got {tuple(b.shape)}")
    if implementation == "tokamax" and (gate_up_bias is not None or interleaved):
        raise NotImplementedError("implementation='tokamax' supports concatenated experts without bias only")
    validate_scales(gate_up_proj, down_proj, gate_up_scale, down_scale, is_transposed, interleaved, block_size)
    if implementation == "tokamax" and gate_up_scale is not None:
        raise NotImplementedError("implementation='tokamax' takes unquantized weights only")


# Where the tokens' f32 sums do not fit VMEM beside the fused MLP's tiles (``pallas.fused_moe_combines``), the
# layer can run as layers over parts of its tokens that each combine in the kernel: no [T * k, H] result then
# crosses HBM, and XLA's unsort gather and top-k sum go (on v5e, with no SparseCore to offload the gather to,
# bound by its bundles: Gemma-4 26B-A4B at 8192 tokens, 1691.8 us for 738 MB). But every part fetches every
# active expert's weights again, so the parts must keep the MXU busier than the HBM: MXU work per weight byte
# at least the chip's flops per HBM byte (``pallas.waits_on_weights`` at PARTS_RIDGE). Measured with the cost
# model at 8192 tokens (layer us, whole -> parts): v5e Gemma-4 (2 parts) 8465.8 -> 7070.4, GPT-OSS-20B (2)
# 12697.1 -> 10751.6; parts forced where the rule keeps the layer whole: v6e Gemma-4 2719.8 -> 2624.3 (the one
# gain it leaves), GPT-OSS 4136.0 -> 6087.0; TPU7x Qwen3-30B-A3B 1275.3 -> 1803.6, Gemma-4 1730.5 -> 2087.6.
# Where the kernel sums at least half the columns kept whole (``pallas.fused_moe_sum_cols``), XLA's share of
# the combine is the smaller and the layer stays whole: v5e Gemma-4 (2048 of 2816 columns) 7070.4 in parts,
# 6918.1 whole; GPT-OSS (896 of 2880) 10751.6 in parts, 11724.6 whole (at 06c45be).
MAX_PARTS = 4
PARTS_RIDGE = 1.0


def combining_parts(t: int, k: int, e: int, h: int, i: int, tiling, *, in_dtype, w_dtype, chip=None, **layout):
    """(parts, tiling_of) for a fused layer of ``t`` tokens at ``tiling``: 1 where it combines whole, sums most
    of its columns whole or no part would pay (see MAX_PARTS); else the fewest parts up to MAX_PARTS whose fused
    MLP combines, and tiling_of(tokens) their tiling."""
    sizes = dict(in_dtype=in_dtype, out_dtype=in_dtype, w_dtype=w_dtype, chip=chip)

    def tiling_of(n):
        return pallas.fused_moe_tiling(n * k, h, i, groups=e, **sizes, **layout)
    if pallas.fused_moe_combines(t, h, i, tiling, **sizes):
        return 1, tiling_of
    if 2 * pallas.fused_moe_sum_cols(t, h, i, tiling, rows=t * k, groups=e, **sizes) >= h:
        return 1, tiling_of
    for parts in range(2, MAX_PARTS + 1):
        n = -(-t // parts)
        if pallas.waits_on_weights(n * k, e, w_dtype, chip, ridge=PARTS_RIDGE):
            break
        part = tiling_of(n)
        if part is not None and pallas.fused_moe_combines(n, h, i, part, **sizes):
            return parts, tiling_of
    return 1, tiling_of


def experts(hidden_states: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array, gate_up_proj: jax.Array,
            down_proj: jax.Array, gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
            activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, is_transposed: bool = False,
            interleaved: bool = False, implementation: str = "pallas", gate_up_scale: jax.Array | None = None,
            down_scale: jax.Array | None = None, block_size: int = pallas.FP8_BLOCK) -> jax.Array:
    """The whole experts computation of one MoE layer (see the module docstring), in JAX.

    Mirrors transformers' grouped_mm numerics: the intermediate and the down output are in the
    weights' dtype, the routing weights multiply in the promoted dtype, top-k sums in f32.
    No tokens, top_k = 0 or no (local) experts: zeros [T, H], no kernel runs.

    Quantized weights (transformers' [E, 2I, H] / [E, H, I] layout) come with their scales:
    float8_e4m3fn with f32 ``*_scale`` = transformers' ``*_scale_inv`` per ``block_size`` (128) x 128
    block, [E, ceil(out/128), ceil(in/128)]; int8 with f32 per-output-channel scales [E, out].
    MXFP4 (GPT-OSS) as uint8: weights [E, 2I, H/2] / [E, H, I/2] (the checkpoint's ``*_blocks`` with
    the last two dims merged), uint8 e8m0 scales [E, 2I, H/32] / [E, H, I/32] (``*_scales``); or, with
    ``is_transposed``, the layout the kernel reads: [E, H/2, 2I] / [E, I/2, H] with scales [E, H/32, 2I] /
    [E, I/32, H], optionally with padding rows after them (``from_pretrained_mxfp4`` pads to a multiple of 32:
    XLA:TPU keeps these shapes row-major, so no call copies them; the checkpoint's layout is transposed
    per call, or bitcast where XLA's layout already has it so).
    They are dequantized in VMEM (w * scale, rounded to hidden_states' dtype, as transformers'
    dequantizing load does) and the matmuls run in hidden_states' dtype.
    """
    validate(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, gate_up_bias, down_bias, activation,
             alpha, limit, is_transposed, interleaved, implementation, gate_up_scale, down_scale,
             block_size)  # JAX callers get the op's errors
    TRACES["experts"] += 1
    t, h = hidden_states.shape
    k = top_k_index.shape[1]
    e = gate_up_proj.shape[0]
    if t * k * e * h == 0:  # nothing routed anywhere: every output row is an empty sum
        return jnp.zeros((t, h), hidden_states.dtype)
    quantized = gate_up_scale is not None
    wdt = hidden_states.dtype if quantized else gate_up_proj.dtype  # compute dtype
    transposed = not is_transposed  # transformers' [E, out, in] is our rhs_transposed layout
    inter_size = down_proj.shape[2] if transposed else down_proj.shape[1]
    # the whole expert MLP in one kernel (the intermediate never leaves VMEM) when each expert's slabs fit,
    # whole or a tile of the intermediate at a time
    down, down_t = down_proj, transposed
    if transposed and inter_size % 128 and h % 128 == 0 and not quantized:
        # TPU's default layout of [E, H, I] with I off the 128-lane grid is minor-to-major
        # {1,2,0}, i.e. physically [E, I, H]: take that view (a layout bitcast, no copy) rather
        # than have XLA relayout the whole weight for the kernel (Gemma-4: I = 704).
        down, down_t = jnp.swapaxes(down_proj, 1, 2), False
    tiling = None if implementation != "pallas" or pallas.is_mxfp4(gate_up_proj) else pallas.fused_moe_tiling(
        t * k, h, inter_size, in_dtype=wdt, out_dtype=wdt, transposed=transposed, interleaved=interleaved,
        w_dtype=gate_up_proj.dtype, groups=e, down_transposed=down_t)
    fused = tiling is not None
    whole = fused and tiling[2] == inter_size
    if whole and t <= pallas.DECODE_TOKENS and gate_up_bias is None and down_bias is None and not interleaved:
        # decode: routing, weighting and the top-k sum inside the kernel too (no gathers or unsort around it)
        return pallas.decode_moe(hidden_states.astype(wdt), gate_up_proj, down, top_k_index, top_k_weights,
                                 transposed=transposed, down_transposed=down_t, activation=activation, alpha=alpha,
                                 limit=limit, out_dtype=hidden_states.dtype, gate_up_scale=gate_up_scale,
                                 down_scale=down_scale)
    if quantized and pallas.is_mxfp4(gate_up_proj) and not is_transposed:  # the kernel reads [E, in/2, out]
        gate_up_proj, down_proj, gate_up_scale, down_scale = (
            jnp.swapaxes(a, 1, 2) for a in (gate_up_proj, down_proj, gate_up_scale, down_scale))
        transposed = False

    def layer(top_k_index, top_k_weights, first, tiling):
        """The output rows of tokens first .. first + len(top_k_index) (all of them: first = 0), the fused MLP at
        ``tiling`` (None: two gmm calls)."""
        t = top_k_index.shape[0]
        fused, sum_cols = tiling is not None, None
        # one sort gives the (token, k) rows in expert order and each sorted row's expert: the kernels take
        # their work items from the latter (pallas.run_metadata), no group sizes needed
        row_groups, order, tokens = pallas.sort_by_expert(top_k_index, e)
        x = hidden_states.astype(wdt)[tokens + first if first else tokens]
        if implementation == "tokamax":
            from . import tokamax_anchor

            group_sizes = jnp.bincount(row_groups, length=e + 1)[:e].astype(jnp.int32)

            hh = tokamax_anchor.ragged_dot(x, gate_up_proj, group_sizes, rhs_transposed=transposed,
                                           out_dtype=jnp.float32)
            gate, up = jnp.split(hh, 2, axis=1)
            inter = pallas._activate(gate, up, activation, alpha, limit).astype(wdt)
            y = tokamax_anchor.ragged_dot(inter, down_proj, group_sizes, rhs_transposed=transposed, out_dtype=wdt)
            valid = (jnp.arange(x.shape[0]) < group_sizes.sum())[:, None]
            y = jnp.where(valid, y, 0)  # tokamax leaves rows past sum(group_sizes) uninitialised
        elif fused:
            tm, chunk, ti = tiling
            # where it pays the kernel also unsorts, weights and sums each token's rows
            # (``fused_moe_combines``; where only some columns' sums fit VMEM, those: ``fused_moe_sum_cols``), and
            # gathers the rows' x from the tokens' rows in VMEM (``fused_moe_gathers``)
            sizes = dict(in_dtype=wdt, out_dtype=wdt, w_dtype=gate_up_proj.dtype)
            cols = pallas.fused_moe_sum_cols(t, h, inter_size, tiling, rows=t * k, groups=e, **sizes)
            combine, sum_cols = cols > 0, cols if 0 < cols < h else None
            gather = cols == h and pallas.fused_moe_gathers(t, h, inter_size, tiling, rows=t * k, groups=e, **sizes)
            if combine:  # its items are windows of a group's rows
                tm, chunk = pallas.fused_moe_windows(t * k, h, inter_size, tiling, groups=e, tokens=t, gather=gather,
                                                     in_dtype=wdt, w_dtype=gate_up_proj.dtype, sum_cols=sum_cols)
            y = pallas.fused_moe(hidden_states[first:first + t].astype(wdt) if gather else x, gate_up_proj, down, None,
                                 row_groups=row_groups, transposed=transposed, activation=activation,
                                 interleaved=interleaved, alpha=alpha, limit=limit, gate_up_bias=gate_up_bias,
                                 down_bias=down_bias, out_dtype=wdt, down_transposed=down_t,
                                 gate_up_scale=gate_up_scale, down_scale=down_scale, tm=tm, chunk=chunk, ti=ti,
                                 combine=(tokens, top_k_weights.reshape(-1)[order], t) if combine else None,
                                 gather=gather, sums_dtype=hidden_states.dtype, sum_cols=sum_cols)
            if combine and sum_cols is None:  # no [T * k, H] result left the kernel
                return y
            if combine:  # the sums of the first sum_cols columns, and the rows' others (rows of no group: garbage)
                sums, y = y
        else:  # experts too big for VMEM whole in a compute-bound layer (TILED_MOE_RIDGE, TILED_MXU_FILL), MXFP4:
            # two gmm calls
            inter = pallas.gmm(x, gate_up_proj, None, row_groups=row_groups, transposed=transposed,
                               activation=activation, interleaved=interleaved, alpha=alpha, limit=limit,
                               bias=gate_up_bias, out_dtype=wdt, rhs_scale=gate_up_scale)
            y = pallas.gmm(inter, down_proj, None, row_groups=row_groups, transposed=transposed, bias=down_bias,
                           out_dtype=wdt, rhs_scale=down_scale)
        # unsort by gathering each (token, k) row back, weight in the promoted dtype (as grouped_mm),
        # sum over k in f32: one XLA fusion reading y once, no [S, H] temporary. The rows come back k-major,
        # [k, T, H]: splitting the leading dim keeps TPU's (8, 128) tiling, where [T, k, H] with k < 8 (GPT-OSS:
        # 4) is a relayout XLA materializes in f32 (at 8192 tokens on v6e 345 us of a 4820 us layer).
        inverse = jnp.argsort(order)  # a sort: a scatter of T*k indices is far slower on TPU (257 against 24 us at 64k)
        prod = jnp.promote_types(y.dtype, top_k_weights.dtype)
        picked = inverse.reshape(t, k).T.reshape(-1)
        rows = y[picked].reshape(k, t, y.shape[1]).astype(prod)
        if sum_cols is not None:
            rows = jnp.where((row_groups[picked] < e).reshape(k, t, 1), rows, 0)
        out = (rows * top_k_weights.T[:, :, None].astype(prod)).astype(jnp.float32).sum(axis=0)
        out = out.astype(hidden_states.dtype)
        if sum_cols is None:
            return out
        if h % 128:  # off the lane grid XLA copied the sums to update them (GPT-OSS-20B at 8192 tokens on v6e,
            # two 48 MB slices: 4094.3 us, against 3763.6 concatenated)
            return jnp.concatenate([sums[:, :sum_cols], out], axis=1)
        return sums.at[:, sum_cols:].set(out)  # in place: the kernel left these columns

    if fused and implementation == "pallas":
        parts, part_tiling = combining_parts(t, k, e, h, inter_size, tiling, in_dtype=wdt, w_dtype=gate_up_proj.dtype,
                                             transposed=transposed, interleaved=interleaved, down_transposed=down_t)
        if parts > 1:  # a layer of its own for each part of the tokens, which combines in the kernel
            n = -(-t // parts)
            return jnp.concatenate([layer(top_k_index[a:a + n], top_k_weights[a:a + n], a, part_tiling(min(n, t - a)))
                                    for a in range(0, t, n)])
    return layer(top_k_index, top_k_weights, 0, tiling)


def _fake(hidden_states, *args, **kwargs):
    return torch.empty_like(hidden_states)


experts_op = jax_op(add_op_namespace_prefix("experts"), experts, fake=_fake, validate=validate)


# --------------------------------------------------------------------------- transformers' side

def activation_of(module) -> tuple[str, float, float, bool]:
    """(activation, alpha, limit, interleaved) of a transformers experts module, or NotImplementedError."""
    name = type(module).__name__
    if getattr(module, "has_post_expert_norm", False):
        raise NotImplementedError(f"{name}: experts with a post-expert norm are not supported by ragged-dot-tpu")
    if not getattr(module, "has_gate", True):
        raise NotImplementedError(f"{name}: ungated experts (up_proj only) are not supported by ragged-dot-tpu")
    interleaved = not getattr(module, "is_concatenated", True)
    gate_fn = getattr(type(module), "_apply_gate", None)
    default_gate = getattr(gate_fn, "__name__", "") == "_default_apply_gate"
    if is_fp8_experts(module):  # FP8Experts' own _apply_gate: act_fn(gate) * up unless one of these is set
        variants = {a: getattr(module, a, None) for a in ("gate_softcap", "swiglu_alpha", "limit")}
        if any(v is not None for v in variants.values()):
            raise NotImplementedError(f"{name}: FP8 experts with {variants} (softcapped or clamped SwiGLU) are not "
                                      "supported by ragged-dot-tpu")
        default_gate = True
    if hasattr(module, "alpha") and hasattr(module, "limit") and not default_gate:
        # GPT-OSS: clamp gate above and up both ways, (up + 1) * gate * sigmoid(alpha * gate)
        if "GptOss" not in name and "gpt_oss" not in type(module).__module__:
            raise NotImplementedError(f"{name}: a custom _apply_gate with alpha/limit that is not GPT-OSS's")
        return "swiglu_oai", float(module.alpha), float(module.limit), interleaved
    if not default_gate:
        raise NotImplementedError(f"{name}: a custom _apply_gate is not supported by ragged-dot-tpu "
                                  "(supported: act_fn(gate) * up with SiLU or GELU-tanh, and GPT-OSS's swiglu)")
    if interleaved:
        raise NotImplementedError(f"{name}: interleaved gate/up with the default gate is not supported")
    act = getattr(module, "act_fn", None)
    cls = type(act).__name__
    if cls in ("SiLUActivation", "SiLU"):
        return "silu", 0.0, 0.0, False
    if cls in ("GELUTanh", "PytorchGELUTanh", "NewGELUActivation", "FastGELUActivation") or (
            cls == "GELU" and getattr(act, "approximate", "none") == "tanh"):
        return "gelu_tanh", 0.0, 0.0, False
    hidden_act = getattr(getattr(module, "config", None), "hidden_act", None)
    raise NotImplementedError(
        f"{name}: activation {cls} (config.hidden_act={hidden_act!r}) is not supported by ragged-dot-tpu; "
        "supported: SiLU ('silu'/'swish'), GELU-tanh ('gelu_pytorch_tanh'/'gelu_new'/'gelu_fast'), GPT-OSS swiglu")


def is_fp8_experts(module) -> bool:
    """transformers' FP8Experts (finegrained FP8): weights with ``*_scale_inv`` beside them."""
    return hasattr(module, "gate_up_proj_scale_inv") or hasattr(module, "up_proj_scale_inv")


def fp8_scales(module) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(gate_up_proj_scale_inv, down_proj_scale_inv, block size) of an FP8Experts module, or a clear error
    for what the kernel does not take."""
    name = type(module).__name__
    if dtype_name(module.gate_up_proj) != "float8_e4m3fn":
        raise NotImplementedError(f"{name}: expert weights of dtype {dtype_name(module.gate_up_proj)} (e.g. FP4-packed "
                                  "expert_dtype='fp4') are not supported by ragged-dot-tpu; float8_e4m3fn is")
    if getattr(module, "activation_scheme", "dynamic") != "dynamic":
        raise NotImplementedError(f"{name}: activation_scheme={module.activation_scheme!r} (static activation scales) "
                                  "is not supported by ragged-dot-tpu; 'dynamic' is")
    block = getattr(module, "block_size", None)
    if block is None or len(block) != 2 or block[0] != block[1]:
        raise ValueError(f"{name}: block_size must be [128, 128] (block-wise FP8 scales), got {block!r}")
    return module.gate_up_proj_scale_inv, module.down_proj_scale_inv, int(block[0])


def expert_weights(module):
    """(gate_up, down, gate_up_scale, down_scale, block size) the op takes from a transformers experts module:
    plain weights; FP8Experts' e4m3 weights and ``*_scale_inv``; MXFP4 uint8 weights and ``*_scales``
    (pallas_hub's PackedMxfp4GptOssExperts: [E, in/2, out] and [E, in/32 padded, out], ``is_transposed``)."""
    if hasattr(module, "gate_up_proj_scales"):
        return (module.gate_up_proj, module.down_proj, module.gate_up_proj_scales, module.down_proj_scales,
                pallas.FP8_BLOCK)
    if is_fp8_experts(module):
        return (module.gate_up_proj, module.down_proj) + fp8_scales(module)
    return module.gate_up_proj, module.down_proj, None, None, pallas.FP8_BLOCK


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor, implementation: str = "pallas") -> torch.Tensor:
    """transformers' experts function (same contract as grouped_mm_experts_forward), one op call.

    Also registered in ``ALL_FP8_EXPERTS_FUNCTIONS``: for FP8Experts it passes the e4m3 weights and
    their ``*_scale_inv`` block scales as stored (dequantized in VMEM, activations not quantized)."""
    activation, alpha, limit, interleaved = activation_of(self)
    gate_up, down, gate_up_scale, down_scale, block = expert_weights(self)
    num_experts = gate_up.shape[0]
    if top_k_index.device.type == "cpu" and top_k_index.numel():  # host values: check them (no sync)
        lo, hi = int(top_k_index.min()), int(top_k_index.max())
        if lo < 0 or (hi >= num_experts and not getattr(self, "_is_expert_parallel", False)):
            raise ValueError(f"top_k_index holds expert ids in [{lo}, {hi}] but there are {num_experts} experts "
                             "(ids >= num_experts are only allowed as expert-parallel sentinels)")
    t = hidden_states.shape[0]
    pad = bucket(t) - t
    if pad:  # padding tokens route to no expert: no weights fetched, no MXU work, zero output
        hidden_states = torch.nn.functional.pad(hidden_states, (0, 0, 0, pad))
        top_k_index = torch.nn.functional.pad(top_k_index, (0, 0, 0, pad), value=num_experts)
        top_k_weights = torch.nn.functional.pad(top_k_weights, (0, 0, 0, pad))
    has_bias = getattr(self, "has_bias", False)
    out = experts_op(
        hidden_states, top_k_index, top_k_weights, gate_up, down,
        self.gate_up_proj_bias if has_bias else None, self.down_proj_bias if has_bias else None,
        activation, alpha, limit, bool(getattr(self, "is_transposed", False)), interleaved, implementation,
        gate_up_scale, down_scale, block)
    return out[:t] if pad else out


# --------------------------------------------------------------------------- expert parallelism (JAX)

def experts_sharded(mesh, hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj, *,
                    axis: str = "ep", **kwargs):
    """Expert parallelism: experts split over mesh axis ``axis``, tokens replicated.

    Each shard turns the ids of other shards' experts into its local sentinel (never computed,
    zero contribution), runs the one-op experts computation on its local experts, and the partial
    outputs are summed over the axis (psum). ``kwargs`` go to ``experts`` (activation, ...).
    """
    from jax.sharding import PartitionSpec as P

    def local(x, idx, w, gu, dn):
        e_local = gu.shape[0]
        lo = jax.lax.axis_index(axis) * e_local
        mine = (idx >= lo) & (idx < lo + e_local)
        local_idx = jnp.where(mine, idx - lo, e_local)
        local_w = jnp.where(mine, w, jnp.zeros_like(w))
        out = experts(x, local_idx, local_w, gu, dn, **kwargs)
        return jax.lax.psum(out.astype(jnp.float32), axis).astype(x.dtype)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), P(axis), P(axis)), out_specs=P(),
                         check_vma=False)(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
