"""transformers continuous batching (``generate_batch`` / PagedAttentionCache) on this kernel.

transformers 5.x calls the attention function of a CB model with all requests packed:
query [1, Hq, Tq, D], ``cu_seq_lens_q``/``cu_seq_lens_k``, and either
  * ``block_table`` [S, max_blocks] + ``k_cache``/``v_cache`` page views [num_pages, page, Hkv, D]
    (the decode fast path; the new K/V are NOT yet in the cache: we write them), or
  * K/V already gathered per request, packed [1, Hkv, Tk, D] (prefill, mixed batches, sliding layers).
Both run the ragged paged kernel; the second re-packs this batch's gathered K/V into page-aligned
pages first (a copy of the batch's K/V, no worse than the gather transformers already did).

transformers' paged cache has no dtype option (it is the model's dtype); ``enable_continuous_batching(
model, kv_cache_dtype="float8_e4m3fn")`` gives it one (``QuantizedPagedAttentionCache``).
"""

from __future__ import annotations

import functools
from unittest import mock

import torch

from . import _attention_math as am
from .pallas import lane_packed_shape

CB_NAME = "paged_flash_tpu"  # CB accepts only built-in names or names containing "flash" (no 2/3 in it)
_PACK_PAGE = 16  # page size used to re-pack gathered K/V


def _pack_gathered(key, cu_k):
    """Gathered K [Hkv, Tk, D] of S requests (boundaries cu_k [S+1]) -> (pages [P, page, Hkv, D], table [S, n]);
    for D below 128 the pages come lane-packed, [P, page, Hkv * D / 128, 128] (``pallas.kv_heads``: the
    layout XLA:TPU keeps row-major, so these per-call pages are not relaid out around the kernel).

    Every size follows from the shapes alone: each request starts a new page, so it wastes less than
    one, and n = cdiv(Tk, page) columns and P = n + S + 1 pages always suffice (the last one takes the
    tokens past cu_k[-1], and no table row reads it). So the packing runs on the tensors' device,
    without a host sync, and traces.
    """
    hkv, tk, d = key.shape
    num_seqs = cu_k.shape[0] - 1
    width = max(-(-tk // _PACK_PAGE), 1)
    total = width + num_seqs + 1
    cu = cu_k.to(torch.int64)
    n_pages = (cu[1:] - cu[:-1] + _PACK_PAGE - 1) // _PACK_PAGE
    first = torch.cumsum(n_pages, 0) - n_pages  # each request's first page
    t = torch.arange(tk, device=key.device)
    seq = (torch.searchsorted(cu, t, right=True) - 1).clamp(0, max(num_seqs - 1, 0))  # request of each token
    dest = torch.where(t < cu[-1], first[seq] * _PACK_PAGE + t - cu[seq], (total - 1) * _PACK_PAGE + t % _PACK_PAGE)
    pages = key.new_zeros(total * _PACK_PAGE, hkv, d)
    pages[dest] = key.transpose(0, 1)
    table = (first[:, None] + torch.arange(width, device=key.device)[None, :]).clamp(max=total - 1)
    pages = pages.view(total, _PACK_PAGE, hkv, d)
    return pages.view(lane_packed_shape(pages) or pages.shape), table.to(torch.int32)


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function for continuous batching; returns ((1, Tq, Hq, D), None)."""
    from . import ragged_paged_attention, write_kv_

    if "cu_seq_lens_q" not in kwargs:  # not continuous batching (plain forward/generate): the model's eager
        import sys

        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is None:
            raise ValueError(f"{CB_NAME} runs continuous batching (generate_batch); outside it, it falls back to the "
                             f"model's eager_attention_forward, which {type(module).__module__} does not define")
        return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout:
        raise ValueError(f"{CB_NAME} is an inference kernel: dropout must be 0, got {dropout}")
    scale = am.transformers_scale(scaling, query.shape[-1], CB_NAME)
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs["cu_seq_lens_k"].to(torch.int32)
    kv_lens = cu_k[1:] - cu_k[:-1]
    q = query[0].transpose(0, 1).contiguous()  # (Tq, Hq, D)
    window = int(kwargs.get("sliding_window") or 0)
    softcap = float(kwargs.get("softcap") or 0.0)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.to(query.dtype)
    block_table = kwargs.get("block_table")
    scales = {}
    if block_table is not None:
        k_cache, v_cache = kwargs["k_cache"], kwargs["v_cache"]
        table = block_table.to(torch.int32)
        scales = dict(k_scale=kwargs.get("k_scale"), v_scale=kwargs.get("v_scale"))  # a quantized cache's
        write_kv_(k_cache, v_cache, key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(),
                  kv_lens, table, cu_q, **scales)
    else:  # K/V gathered by transformers (dequantized by QuantizedPagedAttentionCache for a quantized cache)
        k_cache, table = _pack_gathered(key[0], cu_k)
        v_cache, _ = _pack_gathered(value[0], cu_k)
    out = ragged_paged_attention(q, k_cache, v_cache, kv_lens, table, cu_q, sinks, scale=scale, window=window,
                                 softcap=softcap, **scales)
    return out[None], None


def enable_continuous_batching(model=None, name: str = CB_NAME, decode_block_tables: bool = True,
                               kv_cache_dtype=None, kv_scale=None) -> str:
    """Make ``generate_batch`` run on this kernel; returns the attn_implementation name.

    Use either ``enable_continuous_batching(model)`` on a loaded model (any attn_implementation; works
    for every model), or call it first and load with ``attn_implementation=<returned name>`` (not for
    models that list ``_compatible_flash_implementations``, e.g. GPT-OSS: transformers replaces any
    "flash" name by one of those Hub kernels at init).

    ``kv_cache_dtype`` ("float8_e4m3fn" or "int8", or the torch dtype; needs ``model``): the paged cache
    of this model's ``generate_batch`` holds 1-byte K/V (half of bf16's bytes) with ``kv_scale``: a float
    or a tensor broadcastable to [num_hidden_layers, 2, num_key_value_heads] (layer, K/V, KV head),
    the value a stored 1 stands for. For float8_e4m3fn it defaults to 1.0 (vLLM's default when a
    checkpoint has no scales); int8 needs it (e.g. per-head amax / 127 from calibration).

    The one place holding the workarounds transformers 5.x needs (see CARD.md):
      1. register ``paged_attention_forward`` (and ``eager_mask``: outside CB it runs the model's eager
         attention, so plain ``generate`` keeps working) under ``name``, a
         name containing "flash" (CB accepts only those besides its built-ins);
      2. init calls ``lazy_import_flash_attention(name)`` for "flash" names, which tries to load a Hub
         flash kernel and raises: mark ``name`` as already loaded (private
         ``modeling_flash_attention_utils._loaded_implementation``; our function never uses those helpers);
         with ``model`` given, its config is switched directly (``config._attn_implementation``), so
         init-time checks never see the name;
      3. ``decode_block_tables``: CB passes block tables (the decode fast path) only for FA2/FA3 on
         CUDA/XPU; for ``name`` keep transformers' own allocator check, skip the device check.
    """
    import transformers.generation.continuous_batching.initialization as cb_init
    import transformers.modeling_flash_attention_utils as mfau
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    if "flash" not in name:
        raise ValueError(f"continuous batching accepts custom attention names only if they contain 'flash', got {name!r}")
    if kv_cache_dtype is not None:
        if model is None:
            raise ValueError("kv_cache_dtype needs the model: call enable_continuous_batching(model, kv_cache_dtype=...)")
        model._paged_tpu_kv_cache = KvCacheQuantization.for_model(model.config.get_text_config(), kv_cache_dtype,
                                                                  kv_scale)
        _install_quantized_cache()
    elif model is not None:
        model._paged_tpu_kv_cache = None
    AttentionInterface.register(name, paged_attention_forward)
    AttentionMaskInterface.register(name, eager_mask)
    mfau._loaded_implementation = name
    if model is not None:
        model.config._attn_implementation = name
    current = cb_init.ensure_decode_fast_path_is_available
    original = getattr(current, "_paged_tpu_original", current)

    def ensure_decode_fast_path_is_available(config, cb_config, user_requested):
        if not decode_block_tables or config._attn_implementation != name:
            return original(config, cb_config, user_requested)
        types = cb_init.group_layers_by_attn_type(config)
        if not all(cb_init.ATTN_TYPE_TO_ALLOCATOR[t].supports_block_table for t in types):
            cb_config.max_blocks_per_request = 0  # sliding-window layers: gathered path only

    ensure_decode_fast_path_is_available._paged_tpu_original = original
    cb_init.ensure_decode_fast_path_is_available = ensure_decode_fast_path_is_available
    return name


# --------------------------------------------------------------------------- a quantized paged cache

class KvCacheQuantization:
    """The cache dtype and scales [num_layers, 2 (K, V), Hkv] float32 of one model's paged cache."""

    def __init__(self, dtype: torch.dtype, scales: torch.Tensor):
        self.dtype, self.scales = dtype, scales

    @classmethod
    def for_model(cls, config, kv_cache_dtype, kv_scale):
        from . import pallas

        name = str(kv_cache_dtype).removeprefix("torch.")
        if name not in pallas.QUANTIZED_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(pallas.QUANTIZED_DTYPES)} (or None for the "
                             f"model's dtype), got {kv_cache_dtype!r}")
        if kv_scale is None:
            if name == "int8":
                raise ValueError("kv_cache_dtype='int8' needs kv_scale (no default suits int8: e.g. each KV head's "
                                 "calibrated amax / 127)")
            kv_scale = 1.0
        from transformers.generation.continuous_batching.utils import find_num_key_value_heads

        shape = (config.num_hidden_layers, 2, find_num_key_value_heads(config))  # as the paged cache counts them
        scale = torch.as_tensor(kv_scale, dtype=torch.float32)
        try:
            scales = torch.broadcast_to(scale, shape).contiguous()
        except RuntimeError:
            raise ValueError(f"kv_scale must be a float or broadcastable to [num_hidden_layers, 2, "
                             f"num_key_value_heads] = {list(shape)}, got shape {list(scale.shape)}") from None
        if not (torch.isfinite(scales) & (scales > 0)).all():
            raise ValueError("kv_scale must be positive and finite")
        return cls(getattr(torch, name), scales)


@functools.cache
def _quantized_cache_class():
    """``QuantizedPagedAttentionCache``: transformers' PagedAttentionCache holding 1-byte K/V. Built on
    first use, so importing this package never imports transformers."""
    from transformers.generation.continuous_batching import cache as cache_module

    class QuantizedPagedAttentionCache(cache_module.PagedAttentionCache):
        """Pages in ``kv_quant.dtype``. Decode steps with block tables: the scales go to the attention
        function (kwargs k_scale/v_scale), which quantizes the new K/V as it writes them (``write_kv_``).
        Other steps (transformers writes and gathers the K/V itself): the new K/V are quantized before
        transformers writes them, and what it returns is dequantized to the model's dtype. Those
        writes and gathers move bytes: the allocators' token views (private ``_kv_token_views``,
        transformers 5.x) are replaced by uint8 views of the same memory, since torch has no fp8
        index_copy_ on CPU."""

        def __init__(self, *args, kv_quant: KvCacheQuantization, dtype: torch.dtype, **kwargs):
            sizer = cache_module.PagedAttentionMemoryHandler

            def memory_handler(*args, **kwargs):  # transformers sizes activations at the cache's width
                handler = sizer(*args, **kwargs)  # (the same dtype there); here they keep the model's
                handler.activation_dtype = dtype
                return handler

            with mock.patch.object(cache_module, "PagedAttentionMemoryHandler", memory_handler):
                super().__init__(*args, dtype=kv_quant.dtype, **kwargs)
            self.activation_dtype = dtype
            self.kv_scales = kv_quant.scales.to(self.device)
            for allocator in self.cache_allocators.values():
                if not hasattr(allocator, "_kv_token_views"):
                    raise NotImplementedError(f"{type(allocator).__name__} has no _kv_token_views: this transformers "
                                              f"version's paged cache cannot be quantized by this kernel package")
                allocator._kv_token_views = {layer: (k.view(torch.uint8), v.view(torch.uint8))
                                             for layer, (k, v) in allocator._kv_token_views.items()}

        def update(self, key_states, value_states, layer_idx, kwargs):
            from . import quantize_kv

            k_scale, v_scale = self.kv_scales[layer_idx]
            if kwargs.get("block_table") is not None:
                kwargs["k_scale"], kwargs["v_scale"] = k_scale, v_scale
                return super().update(key_states, value_states, layer_idx, kwargs)
            name = str(self.dtype).removeprefix("torch.")
            # [1, Hkv, T, D] <-> the op's [T, Hkv, D]; the allocators take and give bytes
            key_states, value_states = (quantize_kv(x[0].transpose(0, 1), s, name).view(torch.uint8).transpose(0, 1)[None]
                                        for x, s in ((key_states, k_scale), (value_states, v_scale)))
            key_states, value_states = super().update(key_states, value_states, layer_idx, kwargs)
            return tuple((x.view(self.dtype).to(torch.float32) * s[None, :, None, None]).to(self.activation_dtype)
                         for x, s in ((key_states, k_scale), (value_states, v_scale)))

    return QuantizedPagedAttentionCache


def _install_quantized_cache():
    """Once: continuous batching creates a model's paged cache with the model's KvCacheQuantization,
    if ``enable_continuous_batching`` gave it one (``model._paged_tpu_kv_cache``)."""
    from transformers.generation.continuous_batching import continuous_api

    manager = continuous_api.ContinuousBatchingManager
    if getattr(manager._create_batch_processor, "_paged_tpu_original", None) is not None:
        return
    original = manager._create_batch_processor

    @functools.wraps(original)
    def _create_batch_processor(self):
        kv_quant = getattr(self.model, "_paged_tpu_kv_cache", None)
        if kv_quant is None:
            return original(self)
        quantized = functools.partial(_quantized_cache_class(), kv_quant=kv_quant)
        with mock.patch.object(continuous_api, "PagedAttentionCache", quantized):
            return original(self)

    _create_batch_processor._paged_tpu_original = original
    manager._create_batch_processor = _create_batch_processor
