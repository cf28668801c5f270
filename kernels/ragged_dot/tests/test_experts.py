"""experts_forward inside tiny transformers MoE models, against experts_implementation="grouped_mm"."""

import copy

import numpy as np
import pytest
import torch
import transformers as T
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

NAME = "tokamax_ragged_dot"
COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM, dict(
        intermediate_size=64, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, head_dim=16)),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM, dict(
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2)),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16)),
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(intermediate_size=32, num_experts=8, num_experts_per_tok=2)),
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM, dict(
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, num_key_value_heads=4)),
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM, dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, head_dim=16, sliding_window=8)),
    "gemma4_text": (T.Gemma4TextConfig, T.Gemma4ForCausalLM, dict(
        intermediate_size=64, head_dim=16, enable_moe_block=True, num_experts=8, top_k_experts=2,
        moe_intermediate_size=32, vocab_size_per_layer_input=256, hidden_size_per_layer_input=8, sliding_window=8,
        global_head_dim=16)),
}
# f32: both paths compute the same sums in a different order (observed <= 1e-6 on these models).
TOL = {torch.float32: 1e-4}


CALLS = []


@pytest.fixture(scope="module")
def kern(load_kernel):
    k = load_kernel("ragged_dot")

    def counted(self, *args):  # the package's function, counting calls so a test can't pass by falling back
        CALLS.append(type(self).__name__)
        return k.experts_forward(self, *args)

    ALL_EXPERTS_FUNCTIONS.register(NAME, counted)
    return k


def _models(family):
    """f32 grouped_mm model with perturbed random weights, and ours with the same weights."""
    C, M, extra = FAMILIES[family]
    cfg = C(**{**COMMON, **extra})
    torch.manual_seed(0)
    ref = M._from_config(copy.deepcopy(cfg), experts_implementation="grouped_mm").eval()
    ours = M._from_config(copy.deepcopy(cfg), experts_implementation=NAME).eval()
    with torch.no_grad():  # tiny random init leaves some weights at 0: make every expert matter
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_and_greedy_tokens_match_grouped_mm(kern, family):
    """f32: logits within 1e-4 of grouped_mm and identical greedy tokens. bf16: ours is at most
    1.25x (+4e-3) as far from the f32 logits as grouped_mm in bf16 is (we keep the epilogue in
    f32; transformers rounds to bf16 before the activation, which on GPT-OSS costs it 0.27)."""
    ref, ours = _models(family)
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    n_experts = sum(hasattr(m, "gate_up_proj") for m in ours.modules())
    with torch.no_grad():
        CALLS.clear()
        truth, b = ref(input_ids=ids).logits, ours(input_ids=ids).logits
        assert len(CALLS) == n_experts, CALLS  # our function ran for every MoE layer
        err = (truth - b).abs().max().item()
        assert err <= TOL[torch.float32], f"{family} f32: max |dlogits| = {err:.3g}"
        kw = dict(max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(input_ids=ids, **kw), ours.generate(input_ids=ids, **kw))
        ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
        e_ref = (ref(input_ids=ids).logits.float() - truth).abs().max().item()
        e_ours = (ours(input_ids=ids).logits.float() - truth).abs().max().item()
        assert e_ours <= 1.25 * e_ref + 4e-3, f"{family} bf16: ours {e_ours:.3g} vs grouped_mm {e_ref:.3g} from f32"


def _qwen3_experts(kern, dtype=torch.float32, hidden=64, intermediate=32, experts=8, std=0.1):
    """A Qwen3-MoE experts module (top-2) whose weights are seeded normals of ``std``."""
    cfg = T.Qwen3MoeConfig(**{**COMMON, "hidden_size": hidden}, intermediate_size=64,
                           moe_intermediate_size=intermediate, num_experts=experts, num_experts_per_tok=2, head_dim=16)
    cfg._experts_implementation = "grouped_mm"
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    torch.manual_seed(0)
    mod = Qwen3MoeExperts(cfg).to(dtype)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(std * torch.randn_like(p))
    return mod


def _routing(t, e, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    return idx, torch.softmax(torch.randn(t, k, generator=g), -1)


def test_decode_loop_compiles_once_per_bucket(kern):
    """Batch sizes 1..64 in one decode loop: the op is traced (compiled) once per token bucket."""
    mod = _qwen3_experts(kern, hidden=80)  # a hidden size no other test uses: nothing cached yet
    grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    before = kern.experts.TRACES["experts"]
    with torch.no_grad():
        for t in range(1, 65):
            x = torch.randn(t, 80)
            idx, w = _routing(t, 8, 2, seed=t)
            out = kern.experts_forward(mod, x, idx, w)
            if t in (1, 17, 64):
                torch.testing.assert_close(out, grouped(mod, x, idx, w), rtol=1e-5, atol=1e-5)
    compiles = kern.experts.TRACES["experts"] - before
    assert compiles == len({kern.experts.bucket(t) for t in range(1, 65)}) == 4, compiles


def test_expert_parallel_sentinels(kern):
    """Two EP ranks of 4 local experts each, ids of the other rank's experts turned into the
    sentinel 4 (as transformers' EP router does): each rank's output plus the other's is the
    full layer, and a rank whose tokens all went elsewhere returns exact zeros."""
    full = _qwen3_experts(kern)
    grouped = ALL_EXPERTS_FUNCTIONS["grouped_mm"]
    x = torch.randn(13, 64)
    idx, w = _routing(13, 8, 2, seed=3)
    total = torch.zeros(13, 64)
    with torch.no_grad():
        for rank in range(2):
            local = copy.deepcopy(full)
            lo = 4 * rank
            local.gate_up_proj = torch.nn.Parameter(full.gate_up_proj[lo:lo + 4].clone())
            local.down_proj = torch.nn.Parameter(full.down_proj[lo:lo + 4].clone())
            local.num_experts = 4
            local._is_expert_parallel = True
            mine = (idx >= lo) & (idx < lo + 4)
            local_idx = torch.where(mine, idx - lo, torch.full_like(idx, 4))
            local_w = torch.where(mine, w, torch.zeros_like(w))
            total += kern.experts_forward(local, x, local_idx, local_w)
        torch.testing.assert_close(total, grouped(full, x, idx, w), rtol=1e-5, atol=1e-5)
        nothing = kern.experts_forward(local, x, torch.full_like(idx, 4), torch.zeros_like(w))
        assert torch.equal(nothing, torch.zeros_like(nothing))


def test_unsupported_experts_and_bad_ids_are_refused(kern):
    mod = _qwen3_experts(kern)
    x = torch.randn(3, 64)
    idx, w = _routing(3, 8, 2)
    with pytest.raises(ValueError, match=r"expert ids in \[8, 8\] but there are 8 experts"):
        kern.experts_forward(mod, x, torch.full_like(idx, 8), w)
    with pytest.raises(ValueError, match="expert ids in"):
        kern.experts_forward(mod, x, torch.full_like(idx, -1), w)
    mod.act_fn = torch.nn.ReLU()
    with pytest.raises(NotImplementedError, match="activation ReLU"):
        kern.experts_forward(mod, x, idx, w)
    mod.has_post_expert_norm = True
    with pytest.raises(NotImplementedError, match="post-expert norm"):
        kern.experts_forward(mod, x, idx, w)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        kern.experts_op(torch.randn(8, 32), idx[:1].expand(8, 2).contiguous(), w[:1].expand(8, 2).contiguous(),
                        mod.gate_up_proj, mod.down_proj)


def test_experts_op_with_intermediate_off_the_lane_grid(kern):
    """I = 64 (not a multiple of 128) with H = 128: the fused kernel reads down through its
    [E, I, H] view (see experts.py); compared with transformers' grouped_mm."""
    mod = _qwen3_experts(kern, hidden=128, intermediate=64)
    with torch.no_grad():
        x = torch.randn(11, 128)
        idx, w = _routing(11, 8, 2, seed=5)
        torch.testing.assert_close(kern.experts_forward(mod, x, idx, w),
                                   ALL_EXPERTS_FUNCTIONS["grouped_mm"](mod, x, idx, w), rtol=1e-5, atol=1e-5)


def test_experts_op_with_gpt_oss_widths_in_concatenated_layout(kern):
    """H = I = 2880 with [gate; up] concatenated (GPT-OSS's sizes, Qwen3's layout): no 128-multiple divides
    I, so no fused-activation tile fits; gate_up runs as one plain pass, the activation after it."""
    mod = _qwen3_experts(kern, hidden=2880, intermediate=2880, experts=4, std=0.02)
    with torch.no_grad():
        x = torch.randn(5, 2880)
        idx, w = _routing(5, 4, 2, seed=3)
        with pytest.raises(ValueError, match="no .tm, tn. tiling"):  # what the fused-activation pass would need
            kern.pallas.choose_gmm_tiling(10, 2880, 2880, 4, in_dtype="float32", out_dtype="float32", chip="v6e",
                                          n_weights=2, lane_n=False, divisors_only=True)
        torch.testing.assert_close(kern.experts_forward(mod, x, idx, w),
                                   ALL_EXPERTS_FUNCTIONS["grouped_mm"](mod, x, idx, w), rtol=1e-4, atol=1e-4)


def test_gpt_oss_experts_in_intermediate_tiles(kern, monkeypatch):
    """GPT-OSS's interleaved, biased experts in the fused kernel a tile of the intermediate at a time (as
    experts too big for VMEM whole take it: 960 of 2880 units on v6e), here 64 of 192 units; compared
    with transformers' grouped_mm on the same module."""
    C, M, extra = FAMILIES["gpt_oss"]
    model = M._from_config(C(**{**COMMON, **extra, "hidden_size": 128, "intermediate_size": 192}),
                           experts_implementation="grouped_mm")
    mod = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in mod.parameters():
            p.copy_(0.1 * torch.randn_like(p))
    tilings = []

    def tiled(m, h, i, **kw):  # the chosen tiling, then its intermediate split in three
        tm, chunk, _ = real(m, h, i, **kw)
        tilings.append((kw["interleaved"], i, 64))
        return tm, chunk, 64

    real = kern.pallas.fused_moe_tiling
    monkeypatch.setattr(kern.pallas, "fused_moe_tiling", tiled)
    with torch.no_grad():
        x = torch.randn(23, 128)  # 46 rows over 8 experts: past the decode path, a shape no other test traces
        idx, w = _routing(23, 8, 2, seed=7)
        torch.testing.assert_close(kern.experts_forward(mod, x, idx, w),
                                   ALL_EXPERTS_FUNCTIONS["grouped_mm"](mod, x, idx, w), rtol=1e-4, atol=1e-4)
    assert tilings == [(True, 192, 64)]


def test_no_tokens_give_an_empty_output(kern):
    """An empty batch (e.g. an expert-parallel rank that received no tokens) gives [0, H], as grouped_mm."""
    mod = _qwen3_experts(kern)
    x, idx, w = torch.randn(0, 64), torch.zeros(0, 2, dtype=torch.int64), torch.zeros(0, 2)
    with torch.no_grad():
        out = kern.experts_forward(mod, x, idx, w)
        assert out.shape == (0, 64) and out.dtype == x.dtype
        torch.testing.assert_close(out, ALL_EXPERTS_FUNCTIONS["grouped_mm"](mod, x, idx, w))


@pytest.mark.parametrize("gather", [True, False])
def test_a_layer_whose_sums_do_not_fit_combines_in_parts(kern, monkeypatch, gather):
    """Where the tokens' f32 sums do not fit VMEM whole, the layer runs as parts of its tokens that each
    combine in the kernel (``experts.combining_parts``), here forced to 3 parts of 37 tokens (13, 13, 11),
    their rows gathered in the kernel or by XLA: the output of the whole layer bit for bit, and grouped_mm's."""
    import jax.numpy as jnp
    from pallas_hub.verify import interpret

    if not gather:
        monkeypatch.setattr(kern.pallas, "fused_moe_gathers", lambda *a, **kw: False)
    mod = _qwen3_experts(kern)
    x = torch.randn(37, 64)
    idx, w = _routing(37, 8, 2, seed=11)
    args = [jnp.asarray(a.detach().numpy()) for a in (x, idx, w, mod.gate_up_proj, mod.down_proj)]
    with interpret("strict"):
        whole = kern.experts.experts(*args)
    decided, combined = [], []
    real_parts, real_fused = kern.experts.combining_parts, kern.pallas.fused_moe

    def three(*a, **kw):
        n, tiling_of = real_parts(*a, **kw)
        decided.append(n)
        return 3, tiling_of

    def fused(*a, combine=None, **kw):
        combined.append(None if combine is None else combine[2])
        assert kw["gather"] == gather
        return real_fused(*a, combine=combine, **kw)
    monkeypatch.setattr(kern.experts, "combining_parts", three)
    monkeypatch.setattr(kern.pallas, "fused_moe", fused)
    with interpret("strict"):
        parts = kern.experts.experts(*args)
    assert decided == [1] and combined == [13, 13, 11]  # it would have combined whole
    assert bool(jnp.all(parts == whole))
    with torch.no_grad():
        reference = ALL_EXPERTS_FUNCTIONS["grouped_mm"](mod, x, idx, w)
    torch.testing.assert_close(torch.from_numpy(np.array(parts)), reference, rtol=1e-5, atol=1e-5)


def test_layers_combine_in_parts_only_where_the_parts_pay(kern):
    """At 8192 tokens the sums of Gemma-4 26B-A4B and GPT-OSS-20B fit no chip's VMEM whole. Kept whole, the
    kernel sums the columns whose sums fit beside its windows, XLA the rest. On v5e GPT-OSS runs in two parts
    that combine whole, each still compute-bound with the experts' weights fetched once a part, but Gemma-4,
    whose kernel sums most of its columns (2048 of 2816), stays whole; on v6e and TPU7x parts would wait on
    those fetches. Qwen3-30B-A3B at 8192 tokens combines whole on v6e."""
    P, E = kern.pallas, kern.experts
    bf = "bfloat16"

    def parts(chip, t=8192, k=8, e=128, h=2816, i=704, **layout):
        layout = layout or dict(transposed=True, interleaved=False, down_transposed=i % 128 == 0)
        tiling = P.fused_moe_tiling(t * k, h, i, in_dtype=bf, out_dtype=bf, w_dtype=bf, groups=e, chip=chip, **layout)
        n, tiling_of = E.combining_parts(t, k, e, h, i, tiling, in_dtype=bf, w_dtype=bf, chip=chip, **layout)
        if n > 1:
            assert P.fused_moe_combines(-(-t // n), h, i, tiling_of(-(-t // n)), in_dtype=bf, out_dtype=bf, chip=chip)
        return n
    assert [parts(c) for c in ("v5e", "v6e", "tpu7x")] == [1, 1, 1]
    gpt_oss = dict(k=4, e=32, h=2880, i=2880, transposed=False, interleaved=True, down_transposed=False)
    assert [parts(c, **gpt_oss) for c in ("v5e", "v6e")] == [2, 1]
    assert parts("v6e", h=2048, i=768) == 1

    def sum_cols(chip, t=8192, k=8, e=128, h=2816, i=704, **layout):
        layout = layout or dict(transposed=True, interleaved=False, down_transposed=i % 128 == 0)
        tiling = P.fused_moe_tiling(t * k, h, i, in_dtype=bf, out_dtype=bf, w_dtype=bf, groups=e, chip=chip, **layout)
        return P.fused_moe_sum_cols(t, h, i, tiling, rows=t * k, groups=e, in_dtype=bf, out_dtype=bf, w_dtype=bf,
                                    chip=chip)
    # kept whole, the layer sums the columns whose sums fit beside its windows: Gemma-4's 2048 of 2816 on v6e,
    # 256 on TPU7x (whose VMEM is half v6e's); Qwen3's fit whole on v6e, 512 of 2048 on TPU7x; GPT-OSS-20B's
    # 896 of 2880 on v6e, beside 1280-row windows (with its 1024-row tiles' windows 1280 would fit)
    assert [sum_cols("v6e"), sum_cols("tpu7x")] == [2048, 256]
    assert [sum_cols("v6e", h=2048, i=768), sum_cols("tpu7x", h=2048, i=768)] == [2048, 512]
    assert sum_cols("v6e", k=4, e=32, h=2880, i=2880, transposed=False, interleaved=True, down_transposed=False) == 896
    # a layer whose sums fit whole sums them all; one whose windows leave no room for 128 columns, none
    assert sum_cols("v6e", t=2048) == 2816 and sum_cols("tpu7x", t=65536) == 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("hidden", [384, 320])
def test_a_layer_whose_sums_fit_in_some_columns_sums_those_in_the_kernel(kern, monkeypatch, dtype, hidden):
    """Where only some columns' f32 sums fit VMEM (``pallas.fused_moe_sum_cols``), the kernel sums those and
    its rows' other columns go through XLA's unsort and top-k sum, written beside them in place (a hidden size
    off the lane grid: concatenated); here 128 and 256 of 384 or 320 columns, in windows
    of a group's rows (so a window's first chunk reads back rows of the groups before it), with tokens routed
    to expert-parallel sentinels (rows of no group, which the kernel never writes: NaN in the strict
    interpreter) and an empty expert. Against the layer summed whole in the kernel, bit for bit, and grouped_mm."""
    import jax.numpy as jnp
    from pallas_hub.verify import interpret

    P = kern.pallas
    mod = _qwen3_experts(kern, hidden=hidden, intermediate=64)
    x = torch.randn(100, hidden)
    idx, w = _routing(100, 8, 2, seed=13)
    idx[idx == 5] = 7  # expert 5 gets no rows
    idx[::9, 1] = 8  # an expert-parallel sentinel: never computed, contributes zero
    jdt = getattr(jnp, dtype)
    args = [jnp.asarray(x.numpy()).astype(jdt), jnp.asarray(idx.numpy()), jnp.asarray(w.numpy()),
            *(jnp.asarray(p.detach().numpy()).astype(jdt) for p in (mod.gate_up_proj, mod.down_proj))]
    real_tiling, real_fused = P.fused_moe_tiling, P.fused_moe
    monkeypatch.setattr(P, "fused_moe_tiling", lambda m, h, i, **kw: (64, 32, i))  # 200 rows in windows of <= 64
    monkeypatch.setattr(P, "fused_moe_gathers", lambda *a, **kw: False)
    with interpret("strict"):
        whole = kern.experts.experts(*args)
    calls = []

    def fused(*a, sum_cols=None, **kw):
        calls.append((sum_cols, kw["tm"], kw["combine"] is not None))
        return real_fused(*a, sum_cols=sum_cols, **kw)
    monkeypatch.setattr(P, "fused_moe", fused)
    for cols in (128, 256):
        monkeypatch.setattr(P, "fused_moe_sum_cols", lambda *a, cols=cols, **kw: cols)
        with interpret("strict"):
            split = kern.experts.experts(*args)
        assert calls[-1][0] == cols and calls[-1][2] and calls[-1][1] < 200  # windows: items of a group's rows
        assert bool(jnp.all(split == whole)), float(jnp.max(jnp.abs(split.astype(float) - whole.astype(float))))
    sentinel = idx == 8  # grouped_mm's equivalent: any expert at weight 0
    with torch.no_grad():
        reference = ALL_EXPERTS_FUNCTIONS["grouped_mm"](mod.to(getattr(torch, dtype)), x.to(getattr(torch, dtype)),
                                                        idx.masked_fill(sentinel, 0), w.masked_fill(sentinel, 0))
    rtol, atol = (1e-5, 1e-5) if dtype == "float32" else (2e-2, 5e-2)  # bf16: an ulp of outputs up to 8
    torch.testing.assert_close(torch.from_numpy(np.array(split.astype(jnp.float32))), reference.float(), rtol=rtol,
                               atol=atol)
