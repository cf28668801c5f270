"""The anchors: vLLM TPU's kernels through the one adapter, and the layers built around the anchors."""

import ast

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_hub import verify
from pallas_hub.bench import anchors, problems, vllm_tpu
from pallas_hub.hub.manifest import ROOT


def test_stubbing_tpu_inference_happens_in_the_adapter_only():
    """In the benchmark only bench/vllm_tpu.py puts modules into sys.modules (tpu-inference's vLLM-only imports)."""
    for path in sorted((ROOT / "loader" / "pallas_hub" / "bench").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules" \
                    and isinstance(node.ctx, ast.Store):
                assert path.name == "vllm_tpu.py", f"{path.relative_to(ROOT)} stubs a module"


def test_vllm_gmm_interpreted_matches_ragged_dot_and_picks_its_tiles():
    rng = np.random.default_rng(0)
    lhs = jnp.asarray(rng.standard_normal((512, 256)), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((4, 256, 256)) / 16, jnp.bfloat16)
    sizes = jnp.array([130, 33, 0, 149], jnp.int32)  # an empty group, rows past the groups
    with vllm_tpu.chip("v6e"), verify.interpret("fast"):
        out = jax.jit(lambda a, b, s: vllm_tpu.gmm().gmm(a, b, s, preferred_element_type=jnp.float32))(lhs, rhs, sizes)
    ref = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32), sizes)
    n = int(sizes.sum())
    np.testing.assert_allclose(np.asarray(out)[:n], np.asarray(ref)[:n], rtol=2e-2, atol=2e-2)
    assert vllm_tpu.gmm_tiling(32768, 2048, 1536, 128) == (512, 2048, 1536)  # its default formula


@pytest.mark.parametrize("model", ["QWEN3_30B_A3B", "GPT_OSS_20B"])  # head dim 128; 64 (RPA v3's hd64 variant)
def test_vllm_kernels_that_cannot_run_interpreted_on_this_jax_say_so(model):
    """RPA v3 and fused_moe v1 use dynamic-size DMAs that jax 0.10.2's interpreter rejects: the bench
    checks them against their own references instead (never a faked kernel check)."""
    c = problems._decode_check(getattr(problems, model), 2, 16)
    q, new_k, new_v, kp, vp, lengths, table = c.args
    with vllm_tpu.chip("v6e"), verify.interpret("fast"), pytest.raises(Exception):
        jax.jit(lambda *a: anchors.vllm_rpa_decode(*a, scale=c.kwargs["scale"]))(
            q, new_k, new_v, anchors.rpa_cache(kp, vp), lengths, table)
    ref = anchors.vllm_rpa_reference(q, new_k, new_v, anchors.rpa_cache(kp, vp), lengths, table, scale=c.kwargs["scale"])
    assert float(jnp.max(jnp.abs(ref.astype(jnp.float32) - c.reference))) < 2e-2 * float(jnp.max(jnp.abs(c.reference)))


def test_fused_moe_v1_counts_follow_its_routing():
    """Every expert's weights per token block, one ffn trip per btc-row chunk of an expert's tokens."""
    _, ids, _ = problems.routing(64, 8, 2, seed=1)
    cost = anchors.fused_moe_v1_cost(ids, 256, 256, 8, "fused-moe")
    (call,) = cost.calls
    b = anchors.fused_moe_v1_blocks(64, 256, 256, 8, 2)
    blocks = 64 // b["bt"]
    assert call.loops[1].static_trips == 8 and call.loops[1].pipeline
    (step,) = call.step_types
    assert step.iterations[:2] == (blocks, blocks * 8)
    assert step.dma_read[2] >= blocks * 8 * 3 * 256 * 256 * 2  # all weights, each block
    chunks = sum(int(-(-np.bincount(ids[i * b["bt"]:(i + 1) * b["bt"]].ravel(), minlength=8) // b["btc"]).sum())
                 for i in range(blocks))
    assert step.iterations[2] == chunks
    assert call.flops >= 2 * 64 * 2 * 3 * 256 * 256  # at least the useful work (chunks are padded)


def test_fused_moe_v1_takes_our_int8_weights_as_its_per_channel_scales():
    """The int8 rows hand fused_moe the same quantization as ours (one scale per output channel, as
    its sub-channel scales of a whole input): its own reference on them matches the dequantized layer,
    and the counted weight bytes are the int8 bytes plus the f32 scales."""
    from pallas_hub.bench import runner

    c = problems._moe_check(6, "int8")
    args = runner._moe_fused_layout(*c.args)
    x, logits, w1, w2, w1_scale, w2_scale = args
    # intermediate 128 runs at 256 (vLLM TPU's padding for fused_moe), hidden 256 as it is
    assert w1.dtype == jnp.int8 and w1_scale.shape == (8, 2, 1, 1, 256) and w2_scale.shape == (8, 1, 1, 256)
    out = runner._fused_moe_reference(*args, chip="v6e", **c.kwargs)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - c.reference)))
    assert err < c.tol * float(jnp.max(jnp.abs(c.reference)))
    wrong = runner._fused_moe_reference(*args[:4], w1_scale, w2_scale * 2, chip="v6e", **c.kwargs)
    assert float(jnp.max(jnp.abs(wrong.astype(jnp.float32) - c.reference))) > 10 * err  # the scales are used

    _, ids, _ = problems.routing(64, 8, 2, seed=1)
    reads = {}
    for wb in (2, 1):
        cost = anchors.fused_moe_v1_cost(ids, 256, 256, 8, "fused-moe", weight_bytes=wb, channel_scales=wb == 1)
        blocks = 64 // anchors.fused_moe_v1_blocks(64, 256, 256, 8, 2, weight_bytes=wb)["bt"]
        reads[wb] = cost.calls[0].step_types[0].dma_read[2] / (blocks * 8)  # per expert and token block
    # the same token rows both times; the weights 3 x 256 x 256 at 2 and at 1 byte, plus 2I + H f32 scales
    assert reads[2] - reads[1] == 3 * 256 * 256 * 2 - (3 * 256 * 256 + (2 * 256 + 256) * 4)


def test_fused_moe_v1_runs_sizes_off_its_grid_zero_padded_as_vllm_tpu_loads_them():
    """GPT-OSS (hidden = intermediate = 2880) and Gemma-4 (intermediate 704) are off fused_moe's 128-lane
    grid: the layout pads the weights to multiples of 256 once, the layer pads the tokens' hidden columns
    per call and cuts the output back. Its reference on the padded weights matches the unpadded layer
    (odd token count, sizes off every grid), and the padding is zeros."""
    from pallas_hub.bench import runner

    tokens, e, k, h, i = 5, 8, 2, 200, 72
    logits, ids, w = problems.routing(tokens, e, k, seed=3)
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((tokens, h)), jnp.bfloat16)
    gate_up = jnp.asarray(rng.standard_normal((e, 2 * i, h)) / np.sqrt(h), jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((e, h, i)) / np.sqrt(i), jnp.bfloat16)
    reference = problems.moe_reference(x, jnp.asarray(ids), jnp.asarray(w), gate_up, down)

    args = runner._moe_fused_layout(x, ids, w, gate_up, down, jnp.asarray(logits))
    _, _, w1, w2 = args
    assert anchors.fused_moe_v1_sizes(h, i) == (256, 256) and anchors.fused_moe_v1_sizes(2880, 704) == (3072, 768)
    assert w1.shape == (e, 2, 256, 256) and w2.shape == (e, 256, 256)
    assert not jnp.any(w1[:, :, h:]) and not jnp.any(w1[..., i:]) and not jnp.any(w2[:, i:]) and not jnp.any(w2[..., h:])
    np.testing.assert_array_equal(np.asarray(w1[0, 1, :h, :i]), np.asarray(gate_up[0, i:].T))  # up, transposed
    abstract = runner._moe_fused_layout(*(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
                                          (x, ids, w, gate_up, down, jnp.asarray(logits))))
    assert [a.shape for a in abstract] == [a.shape for a in args]  # the compiled programs see the same sizes

    out = runner._fused_moe_reference(*args, chip="v6e", top_k=k)
    assert out.shape == (tokens, h)
    err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - reference)))
    assert err < 2e-2 * float(jnp.max(jnp.abs(reference)))

    # counted at the sizes it runs: GPT-OSS-20B's 32 experts' weights at 3072 x 3072 and token rows of 3072
    problem = problems.moe_problem(problems.GPT_OSS_20B, 1)
    with vllm_tpu.chip("v6e"):
        (step,) = runner._fused_moe_cost(problem, "v6e", {}).calls[0].step_types
    assert step.dma_read[2] == 32 * 3 * 3072 * 3072 * 2 + 2 * 4 * 3072 * 2  # 2 tokens (one of padding) x top-4
