"""transformers continuous batching (``generate_batch`` / PagedAttentionCache) on this kernel.

transformers 5.x calls the attention function of a CB model with all requests packed:
query [1, Hq, Tq, D], ``cu_seq_lens_q``/``cu_seq_lens_k``, and either
  * ``block_table`` [S, max_blocks] + ``k_cache``/``v_cache`` page views [num_pages, page, Hkv, D]
    (the decode fast path; the new K/V are NOT yet in the cache: we write them), or
  * K/V already gathered per request, packed [1, Hkv, Tk, D] (prefill, mixed batches, sliding layers).
Both run the ragged paged kernel; the second re-packs this batch's gathered K/V into page-aligned
pages first (a copy of the batch's K/V, no worse than the gather transformers already did).
"""

from __future__ import annotations

import torch

CB_NAME = "paged_flash_tpu"  # CB accepts only built-in names or names containing "flash" (no 2/3 in it)
_PACK_PAGE = 16  # page size used to re-pack gathered K/V


def _pack_gathered(key, cu_k):
    """Gathered K [Hkv, Tk, D] of S requests (boundaries cu_k [S+1]) -> (pages [P, page, Hkv, D], table [S, n]).

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
    return pages.view(total, _PACK_PAGE, hkv, d), table.to(torch.int32)


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
    cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
    cu_k = kwargs["cu_seq_lens_k"].to(torch.int32)
    kv_lens = cu_k[1:] - cu_k[:-1]
    q = query[0].transpose(0, 1).contiguous()  # (Tq, Hq, D)
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    window = int(kwargs.get("sliding_window") or 0)
    softcap = float(kwargs.get("softcap") or 0.0)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        sinks = sinks.to(query.dtype)
    block_table = kwargs.get("block_table")
    if block_table is not None:
        k_cache, v_cache = kwargs["k_cache"], kwargs["v_cache"]
        table = block_table.to(torch.int32)
        write_kv_(k_cache, v_cache, key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous(),
                  kv_lens, table, cu_q)
    else:
        k_cache, table = _pack_gathered(key[0], cu_k)
        v_cache, _ = _pack_gathered(value[0], cu_k)
    out = ragged_paged_attention(q, k_cache, v_cache, kv_lens, table, cu_q, sinks, scale=scale, window=window,
                                 softcap=softcap)
    return out[None], None


def enable_continuous_batching(model=None, name: str = CB_NAME, decode_block_tables: bool = True) -> str:
    """Make ``generate_batch`` run on this kernel; returns the attn_implementation name.

    Use either ``enable_continuous_batching(model)`` on a loaded model (any attn_implementation; works
    for every model), or call it first and load with ``attn_implementation=<returned name>`` (not for
    models that list ``_compatible_flash_implementations``, e.g. GPT-OSS: transformers replaces any
    "flash" name by one of those Hub kernels at init).

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
