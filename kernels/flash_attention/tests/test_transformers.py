"""pallas_attention inside transformers: attention_forward against transformers' SDPA function,
and tiny Llama / Qwen3 / Gemma-2 / Gemma-4 text / GPT-OSS models (built from configs, random
weights) whose logits and greedy tokens match eager attention with the kernel registered.

Tolerances: logits, f32, max abs difference on the valid (non-padding) tokens <= 1e-4 (the models'
logits are O(1); the kernel and eager differ only in summation order). Greedy tokens: identical.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

NAME = "pallas_attention"
LOGIT_TOL = 1e-4
CALLS = []  # sliding_window of every call through the registered function


@pytest.fixture(scope="module")
def fa(load_kernel):
    k = load_kernel("flash_attention")
    (reg,) = k.REGISTRATIONS
    assert reg["name"] == NAME and reg["mask"] == "sdpa"
    fn = getattr(k, reg["function"])

    def counted(*args, **kwargs):
        CALLS.append(kwargs.get("sliding_window"))
        return fn(*args, **kwargs)

    AttentionInterface.register(NAME, counted)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return k


class _Module(torch.nn.Module):
    is_causal = True

    def __init__(self, hq, hkv):
        super().__init__()
        self.num_key_value_groups = hq // hkv


def _mask(b, sq, sk, pad, window=None):
    """transformers' own sdpa_mask for left padding ``pad`` [b] (keys of a cache of sk tokens)."""
    am = torch.ones(b, sk, dtype=torch.long)
    for i, p in enumerate(pad):
        am[i, :p] = 0
    from transformers.masking_utils import and_masks, causal_mask_function, padding_mask_function, sliding_window_causal_mask_function

    fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return sdpa_mask(batch_size=b, q_length=sq, kv_length=sk, q_offset=sk - sq, kv_offset=0,
                     mask_function=and_masks(fn, padding_mask_function(am.bool())), attention_mask=am.bool(),
                     allow_is_causal_skip=False)


@pytest.mark.parametrize("hq,hkv,sq,sk,pad,window,sinks,softcap", [
    (4, 2, 37, 37, [0, 9], None, False, None),      # left-padded prefill
    (8, 1, 1, 50, [3, 0], 16, True, None),            # decode, MQA, window + sinks
    (4, 4, 20, 20, [0, 0], None, False, 30.0),        # no padding (mask None), soft-cap
])
def test_attention_forward_matches_sdpa(fa, hq, hkv, sq, sk, pad, window, sinks, softcap):
    torch.manual_seed(0)
    b, d = len(pad), 64
    q, k, v = torch.randn(b, hq, sq, d), torch.randn(b, hkv, sk, d), torch.randn(b, hkv, sk, d)
    mask = None if not any(pad) and window is None else _mask(b, sq, sk, pad, window)
    if mask is not None:  # transformers' padding + causal (+ window) masks run on lengths, no mask traffic
        seq, exact = fa._mask_structure(mask[:, 0].numpy(), True, window)
        assert bool(exact) and seq[:, 0].tolist() == [max(p, sk - (window or sk)) for p in pad]
        assert not bool(fa._mask_structure(mask[:, 0].numpy(), True, (window or sk) // 2)[1])  # it can say no
    s_aux = torch.randn(hq) if sinks else None
    module = _Module(hq, hkv)
    out, w = fa.attention_forward(module, q, k, v, mask, scaling=0.11, sliding_window=window, s_aux=s_aux,
                                  softcap=softcap)
    assert w is None and out.shape == (b, sq, hq, d)
    if s_aux is None and softcap is None:
        want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.11, is_causal=mask is None)
    else:  # SDPA has no sinks/soft-cap: an explicit softmax with the extra logit column
        kk, vv = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        s = q @ kk.transpose(-1, -2) * 0.11
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        allowed = mask if mask is not None else torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        s = s.masked_fill(~allowed, -torch.inf)
        if s_aux is not None:
            s = torch.cat([s, s_aux.view(1, hq, 1, 1).expand(b, hq, sq, 1)], -1)
        p = torch.softmax(s, -1).nan_to_num(0.0)[..., :sk]
        want = (p @ vv).transpose(1, 2)
    valid = torch.ones(b, sq, dtype=torch.bool)
    for i, p in enumerate(pad):  # SDPA leaves fully masked rows undefined; ours are 0
        valid[i, : max(p - (sk - sq), 0)] = False
        assert torch.all(out[i][~valid[i]] == 0)
    torch.testing.assert_close(out[valid], want[valid], atol=2e-5, rtol=2e-5)


def test_attention_forward_irregular_mask_and_errors(fa):
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 9, 64), torch.randn(2, 2, 9, 64), torch.randn(2, 2, 9, 64)
    mask = torch.rand(2, 1, 9, 9) > 0.4  # not a padding/causal mask: the masked kernel path
    mask[:, :, :, 0] = True
    out, _ = fa.attention_forward(_Module(4, 2), q, k, v, mask, scaling=0.125)
    want, _ = sdpa_attention_forward(_Module(4, 2), q, k, v, mask, scaling=0.125)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=2e-5)
    m = _Module(4, 2)
    with pytest.raises(ValueError, match="dropout"):
        fa.attention_forward(m, q, k, v, None, dropout=0.1)
    with pytest.raises(TypeError, match="boolean mask"):
        fa.attention_forward(m, q, k, v, torch.zeros(2, 1, 9, 9))
    with pytest.raises(ValueError, match="attention_mask must have shape"):
        fa.attention_forward(m, q, k, v, mask[:, :, :8])
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        fa.attention_forward(m, q, k, v, None, sliding_window=0)
    with pytest.raises(ValueError, match=r"scaling=0.0 .* not supported"):  # the op would read 0 as its default
        fa.attention_forward(m, q, k, v, None, scaling=0.0)
    with pytest.raises(ValueError, match="multiple of the number of KV heads"):
        fa.attention_forward(m, q[:, :3], k, v, None)


def test_torch_autograd_matches_sdpa_autograd(fa):
    torch.manual_seed(2)
    q = torch.randn(1, 4, 33, 64, requires_grad=True)
    k = torch.randn(1, 2, 33, 64, requires_grad=True)
    v = torch.randn(1, 2, 33, 64, requires_grad=True)
    w = torch.randn(1, 33, 4, 64)
    out, _ = fa.attention_forward(_Module(4, 2), q, k, v, None, scaling=0.2)
    got = torch.autograd.grad((out * w).sum(), (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2, enable_gqa=True)
    want = torch.autograd.grad((ref.transpose(1, 2) * w).sum(), (q, k, v))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


COMMON = dict(vocab_size=128, hidden_size=128, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=64, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
              eos_token_id=2)


def _models():
    T = transformers
    return {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
        "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(use_sliding_window=True, sliding_window=5,
                                                          max_window_layers=1)),
        "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(sliding_window=5, attn_logit_softcapping=50.0)),
        "gemma4_text": (T.Gemma4TextConfig, T.Gemma4ForCausalLM, dict(sliding_window=5, vocab_size_per_layer_input=128,
                                                                     hidden_size_per_layer_input=8, global_head_dim=64)),
        "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2,
                                                              sliding_window=5)),
    }


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gemma4_text", "gpt_oss"])
def test_tiny_model_matches_eager(fa, family):
    C, M, extra = _models()[family]
    cfg = C(**{**COMMON, **extra})
    torch.manual_seed(0)
    ours = M._from_config(copy.deepcopy(cfg), attn_implementation=NAME).eval()
    torch.manual_seed(0)
    eager = M._from_config(copy.deepcopy(cfg), attn_implementation="eager").eval()
    if family == "gpt_oss":  # sinks start at 0 in a fresh model: make them matter
        for a, b in zip(ours.modules(), eager.modules()):
            if hasattr(a, "sinks"):
                torch.manual_seed(a.layer_idx)
                a.sinks.data.normal_()
                b.sinks.data.copy_(a.sinks.data)
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (2, 12))
    am = torch.ones_like(ids)
    am[1, :4] = 0  # left padding
    CALLS.clear()
    with torch.no_grad():
        a = ours(input_ids=ids, attention_mask=am).logits
        assert len(CALLS) == cfg.num_hidden_layers  # the kernel really ran, in every layer
        b = eager(input_ids=ids, attention_mask=am).logits
        valid = am.bool()
        assert (a[valid] - b[valid]).abs().max() <= LOGIT_TOL
        gen = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0,
                   cache_implementation="static")
        ga = ours.generate(input_ids=ids, attention_mask=am, **gen)
        gb = eager.generate(input_ids=ids, attention_mask=am, **gen)
    assert torch.equal(ga, gb)


def _sinks_case(seed, b=2, hq=4, hkv=2, s=21, d=64):
    """q, k, v and sinks (GPT-OSS's learnable s_aux), all requiring grad."""
    torch.manual_seed(seed)
    return (torch.randn(b, hq, s, d, requires_grad=True), torch.randn(b, hkv, s, d, requires_grad=True),
            torch.randn(b, hkv, s, d, requires_grad=True), torch.randn(hq, requires_grad=True))


def _sinks_reference(q, k, v, sinks, *, scale, window, softcap, seq=None):
    """(out [B, Hq, S, D], lse [B, Hq, S]) of an explicit causal softmax with the sink column, in torch.
    ``seq`` [B, 3] = (kv_start, kv_end, q_len): query row i sits at position kv_end - q_len + i and rows from
    q_len on see no key (their lse is the sink logit), as the op's doc says."""
    b, hq, s, _ = q.shape
    kk, vv = (x.repeat_interleave(hq // k.shape[1], 1) for x in (k, v))
    logits = softcap * torch.tanh(q @ kk.transpose(-1, -2) * scale / softcap)
    kv_start, kv_end, q_len = (torch.tensor([0, s, s]) if seq is None else seq.long()).reshape(-1, 3, 1, 1).unbind(1)
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    pos = kv_end - q_len + i
    seen = (j <= pos) & (j > pos - window) & (j >= kv_start) & (j < kv_end) & (i < q_len)  # [B or 1, S, S]
    logits = logits.masked_fill(~seen[:, None], -torch.inf)
    logits = torch.cat([logits, sinks.view(1, hq, 1, 1).expand(b, hq, s, 1)], -1)
    return torch.softmax(logits, -1)[..., :s] @ vv, torch.logsumexp(logits, -1)


def test_torch_autograd_with_sinks_window_softcap(fa):
    """Gradients of the torch op (q, k, v and the sinks) against torch autograd of an explicit softmax with
    the sink column."""
    q, k, v, sinks = _sinks_case(3)
    b, hq, s, d = q.shape
    w = torch.randn(b, s, hq, d)
    out, _ = fa.attention_forward(_Module(hq, k.shape[1]), q, k, v, None, scaling=0.15, sliding_window=6,
                                  softcap=4.0, s_aux=sinks)
    got = torch.autograd.grad((out * w).sum(), (q, k, v, sinks))
    ref, _ = _sinks_reference(q, k, v, sinks, scale=0.15, window=6, softcap=4.0)
    want = torch.autograd.grad((ref.transpose(1, 2) * w).sum(), (q, k, v, sinks))
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4, msg=name)


def test_torch_autograd_through_the_log_sum_exp(fa):
    """A loss on the op's log-sum-exp as well as its output: the lse's gradient reaches q, k and the sinks
    (d lse / d logits = p), against torch autograd of torch.logsumexp over the same logits with the sink column.
    With no key (Sk = 0) a row's lse is its sink logit, so the sinks take the lse's gradient whole."""
    q, k, v, sinks = _sinks_case(4)
    b, hq, s, d = q.shape
    w, u = torch.randn(b, hq, s, d), torch.randn(b, hq, s)
    out, lse = fa.attention(q, k, v, sinks, scale=0.15, window=6, softcap=4.0)
    got = torch.autograd.grad((out * w).sum() + (lse * u).sum(), (q, k, v, sinks))
    ref, ref_lse = _sinks_reference(q, k, v, sinks, scale=0.15, window=6, softcap=4.0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    want = torch.autograd.grad((ref * w).sum() + (ref_lse * u).sum(), (q, k, v, sinks))
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4, msg=name)
    _, lse = fa.attention(q, k[:, :, :0], v[:, :, :0], sinks)
    torch.testing.assert_close(lse, sinks.detach().view(1, hq, 1).expand(b, hq, s))
    (dsinks,) = torch.autograd.grad((lse * u).sum(), (sinks,))
    torch.testing.assert_close(dsinks, u.sum(dim=(0, 2)))


def test_torch_autograd_through_the_log_sum_exp_with_padding(fa):
    """As above with per-sequence padding (``seq``): left-padded keys, padded query rows (q_len < S) and rows
    whose window falls wholly in the left padding. Rows that see no key give 0 and, with sinks, their sink
    logit as lse, so their lse's gradient goes to the sinks whole; without sinks their lse is MASK_VALUE, a
    constant, whose gradient reaches nothing."""
    q, k, v, sinks = _sinks_case(5)
    b, hq, s, d = q.shape
    seq = torch.tensor([[10, 21, 15], [0, 17, 12]], dtype=torch.int32)  # sequence 0's rows 0-3 see no key
    w, u = torch.randn(b, hq, s, d), torch.randn(b, hq, s)
    out, lse = fa.attention(q, k, v, sinks, seq, scale=0.15, window=6, softcap=4.0)
    ref, ref_lse = _sinks_reference(q, k, v, sinks, scale=0.15, window=6, softcap=4.0, seq=seq)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    got = torch.autograd.grad((out * w).sum() + (lse * u).sum(), (q, k, v, sinks))
    want = torch.autograd.grad((ref * w).sum() + (ref_lse * u).sum(), (q, k, v, sinks))
    for name, a, r in zip(("dq", "dk", "dv", "dsinks"), got, want):
        torch.testing.assert_close(a, r, atol=1e-4, rtol=1e-4, msg=name)
    empty = torch.zeros(b, s, dtype=torch.bool)
    empty[0, :4] = empty[0, 15:] = empty[1, 12:] = True
    _, lse = fa.attention(q, k, v, None, seq, scale=0.15, window=6, softcap=4.0)
    rows = empty[:, None, :].expand(b, hq, s)
    assert bool((lse[rows] == fa.attention_math.MASK_VALUE).all()) and bool((lse[~rows] > -1e3).all())
    grads = torch.autograd.grad((lse * u * rows).sum(), (q, k, v))
    assert all(bool((g == 0).all()) for g in grads)
