"""pallas-hub bench: the runner end to end, its outputs, the TPU timing path (stand-in device and
clock) and calibration, the bridge benchmark and the model beside XLA:TPU's and libtpu's estimates."""

import dataclasses
import json
import types

import jax
import jax.numpy as jnp
import pytest
import torch

from pallas_hub.bench import problems, report, timing, tpu_bench
from pallas_hub.bench import runner as bench
from pallas_hub.vendored import _bridge as bridge
from pallas_hub.hub.manifest import ROOT

TINY = problems.Model("tiny", hidden=256, experts=8, top_k=2, moe_intermediate=128, q_heads=8, kv_heads=1, head_dim=128,
                      short="tiny", moe_tokens=(8,), prefill_tokens=(256,), decode=((2, 16),))


class FakeClock:
    """Advances by ``tick`` seconds every time it is read twice (start, stop)."""

    def __init__(self, ticks):
        self.ticks = list(ticks)
        self.now = 0.0
        self.reads = 0

    def __call__(self):
        if self.reads % 2:
            self.now += self.ticks[(self.reads // 2) % len(self.ticks)]
        self.reads += 1
        return self.now


def test_measure_warms_up_synchronises_and_takes_the_median():
    calls, synced = [], []
    t = timing.measure(lambda x: calls.append(x) or x, 7, warmup=3, runs=5, device="stand-in",
                       sync=synced.append, clock=FakeClock([1.0, 5.0, 2.0, 4.0, 3.0]))
    assert len(calls) == 8 and len(synced) == 8  # every run, warm-up included, is synchronised
    assert t.median_s == 3.0 and t.runs == 5 and t.warmup == 3 and t.device == "stand-in"
    assert t.p10_s == pytest.approx(1.4) and t.p90_s == pytest.approx(4.6)
    with pytest.raises(ValueError, match="runs"):
        timing.measure(lambda: None, runs=0)


def test_synchronize_waits_on_jax_arrays_and_accelerator_tensors(monkeypatch):
    waited, synced = [], []

    class Pending:
        def block_until_ready(self):
            waited.append(self)

    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: synced.append(str(device)))
    on_tpu = types.SimpleNamespace(device=types.SimpleNamespace(type="tpu", __str__=lambda s: "tpu:0"))
    bridge.synchronize((Pending(), [on_tpu, on_tpu]), torch.ones(2), None)
    assert len(waited) == 1
    assert len(synced) == 1  # one device, synchronised once
    bridge.synchronize(torch.ones(3))  # CPU tensors: nothing to wait for
    assert len(synced) == 1


def _impls(*names):
    impls = {i.name: i for i in bench.implementations(("moe", "decode"), progress=lambda *_: None)}
    return [impls[n] for n in names]


def test_bench_run_models_layers_and_a_partial_run_publishes_nothing(tmp_path, monkeypatch):
    """A subset run end to end (counts, ahead-of-time compile with the LLO dump, v2 timing, checks):
    it writes results/partial/ only; rendering it into a repository splices the generated blocks."""
    monkeypatch.setenv("PALLAS_HUB_CACHE", str(tmp_path / "cache"))
    probs = [problems.moe_problem(TINY, 8), problems.decode_problem(TINY, 2, 16)]
    impls = [bench.Impl("ours: ragged_dot", "ours", "moe", None, "not in the manifest (not on main yet)")]
    impls += _impls("jax megablox gmm", "jax paged_attention")
    lines = []
    result = bench.run(("moe", "decode"), out_dir=tmp_path, bridge=False, xla=False, measure=False, chips=("v6e",),
                       progress=lines.append, problem_list=probs, impl_list=impls)
    assert not (tmp_path / "bench.json").exists()  # a partial run never replaces the full results
    saved = json.loads((tmp_path / "partial" / "bench-moe-decode-v6e.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"], default=list))
    rows = {(r["problem"], r["impl"]): r for r in result["rows"]}
    assert rows[("tiny MoE layer T=8", "ours: ragged_dot")]["status"] == "missing"  # never a faked row
    for key in (("tiny MoE layer T=8", "jax megablox gmm"), ("tiny decode B=2 page 16", "jax paged_attention")):
        r = rows[key]
        assert r["status"] == "ok" and r["check"]["ok"], r
        v = r["chips"]["v6e"]
        assert v["layer_s_0us"] < v["layer_s_0.35us"] < v["layer_s_0.7us"]
        assert v["layer_s_0.35us"] == pytest.approx(v["kernel_s_0.35us"] + v["glue_s_0.35us"])
        assert v["glue"]["ops"] > 0 and v["ideal_s"] <= v["layer_s_0us"]
        assert all(not k["join_notes"] for k in v["calls"]), v["calls"]
    assert any("ETA" in line for line in lines)  # progress while running
    # publishing the result into a repository: generated blocks replace old ones, the rest is kept
    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "README.md").write_text("# Benchmarks\n\nHand-written intro.\n")
    (root / "kernels" / "ragged_dot" / "benchmarks").mkdir(parents=True)
    (root / "kernels" / "ragged_dot" / "CARD.md").write_text(f"# card\n\n{report.BEGIN}\nold\n{report.END}\n\ntail\n")
    report.publish(result, tmp_path, root=root)
    text = (root / "benchmarks" / "README.md").read_text()
    assert "Hand-written intro." in text and "| tiny MoE layer T=8 | jax megablox gmm |" in text
    assert "| tiny MoE layer T=8 | ours: ragged_dot | missing" in text
    card = (root / "kernels" / "ragged_dot" / "CARD.md").read_text()
    assert "old" not in card and card.endswith("tail\n") and card.count(report.BEGIN) == 1
    assert (root / "kernels" / "ragged_dot" / "benchmarks" / "RESULTS.md").exists()
    assert report.rendered(result, root) == {p: p.read_text() for p in report.rendered(result, root)}  # idempotent
    for png in ("layers_v6e.png", "roofline_v6e.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_second_run_counts_and_checks_only_what_changed(tmp_path, monkeypatch):
    """Counts and checks are stored under everything they depend on, as compiles are: a second run with the
    same sources counts and checks nothing again and gives the same rows; a changed implementation (its
    digest) is counted and checked again. So a bench after a change to one kernel recounts that kernel only."""
    monkeypatch.setenv("PALLAS_HUB_CACHE", str(tmp_path / "cache"))
    calls = []
    count, check = bench._count, bench._run_check
    monkeypatch.setattr(bench, "_count", lambda impl, *a: calls.append(("count", impl.name)) or count(impl, *a))
    monkeypatch.setattr(bench, "_run_check", lambda impl, *a: calls.append(("check", impl.name)) or check(impl, *a))
    impls = _impls("jax paged_attention")
    assert impls[0].digest

    def run():
        result = bench.run(("decode",), out_dir=tmp_path, bridge=False, xla=False, measure=False, chips=("v6e",),
                           progress=lambda *_: None, problem_list=[problems.decode_problem(TINY, 2, 16)],
                           impl_list=impls)
        (row,) = result["rows"]
        assert row["status"] == "ok" and row["check"]["ok"], row
        return row["check"], row["chips"]["v6e"]["layer_s_0.35us"]

    first = run()
    assert calls == [("count", "jax paged_attention"), ("check", "jax paged_attention")]
    assert run() == first and len(calls) == 2  # the same row, nothing counted or checked again
    impls[0].digest = "changed sources"
    run()
    assert calls[2:] == calls[:2]


def test_tpu_path_with_stand_in_device_and_clock():
    """The TPU timing path, run on CPU with a fake clock: it claims nothing about TPU speed."""
    probs = [problems.moe_problem(TINY, 8), problems.decode_problem(TINY, 2, 16)]
    impls = _impls("jax megablox gmm", "jax paged_attention")
    ok = {"status": "ok", "chips": {"v6e": {"status": "ok", "layer_s_0.35us": 1e-5, "options": {}}}}
    model_rows = [{"problem": p.name, "impl": i.name, **ok} for p, i in zip(probs, impls)]
    synced = []
    rows = tpu_bench.time_rows(probs, impls, model_rows, chip="v6e", device="stand-in", runs=3, warmup=1,
                               clock=FakeClock([2e-5]), sync=lambda out: synced.append(out), interpret=True,
                               progress=lambda *_: None)
    assert [r["median_s"] for r in rows] == pytest.approx([2e-5, 2e-5])
    assert all(r["modelled_s"] == 1e-5 and r["device"] == "stand-in" for r in rows)
    assert len(synced) == 8 and synced[3].shape == (8, 256)  # layer output [tokens, hidden]
    layers = tpu_bench.moe_decode_layers({"eager": None}, device="cpu", batches=(1, 3), runs=2, warmup=1,
                                         config_overrides=dict(hidden_size=64, num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32),
                                         clock=FakeClock([1e-3]), progress=lambda *_: None)
    assert [r["problem"] for r in layers] == ["Qwen3-30B-A3B MoE block decode B=1", "Qwen3-30B-A3B MoE block decode B=3"]
    assert all(r["median_s"] == pytest.approx(1e-3) for r in layers)
    stand_in = types.SimpleNamespace(platform="tpu", device_kind="TPU v6 lite", __str__=lambda s: "TPU_0 (stand-in)")
    out = tpu_bench.run(probs[:1], impls[:1], model_rows, jax_device=stand_in, runs=2, warmup=0, clock=FakeClock([3e-5]),
                        interpret=True, progress=lambda *_: None)
    assert out["chip"] == "v6e" and out["rows"][0]["median_s"] == pytest.approx(3e-5)
    assert out["rows"][0]["modelled_s"] == 1e-5  # measured beside modelled, for the detected chip
    cpu = tpu_bench.run(probs, impls, model_rows, progress=lambda *_: None)  # JAX on CPU: refuses to time
    assert cpu["rows"] == [] and "JAX_PLATFORMS=tpu" in cpu["skipped"]
    assert tpu_bench.chip_of(types.SimpleNamespace(device_kind="TPU v6 lite")) == "v6e"
    assert tpu_bench.chip_of(types.SimpleNamespace(device_kind="cpu")) is None


def test_calibration_recovers_the_per_step_costs():
    """Timings made from known per-step (0.3 us) and per-iteration (1.1 us) costs give them back."""
    rows, measured = [], []
    for i, (base, steps, loops, kind) in enumerate([(10e-6, 40, 0, "ours"), (20e-6, 400, 10, "anchor"),
                                                    (5e-6, 7, 90, "anchor"), (50e-6, 1000, 500, "ours")]):
        v = {"status": "ok", "layer_s_0us": base, "glue": {"ops": 2},
             "calls": [{"grid_steps": steps - 2, "loop_steps": loops}]}
        rows.append({"problem": f"p{i // 2}", "impl": f"i{i}", "kind": kind, "status": "ok", "chips": {"v6e": v}})
        measured.append({"problem": f"p{i // 2}", "impl": f"i{i}", "median_s": base + steps * 0.3e-6 + loops * 1.1e-6})
    cal = tpu_bench.calibrate(rows, measured, "v6e")
    assert cal["rows"] == 4
    assert cal["step_cost_us"] == pytest.approx(0.3) and cal["dma_loop_iteration_cost_us"] == pytest.approx(1.1)
    assert cal["median_relative_error"] == pytest.approx(0, abs=1e-9)
    assert [r["problem"] for r in cal["rankings"]] == ["p0", "p1"]


def test_bridge_benchmark_zero_copy_and_no_recompiles():
    from pallas_hub.bench import bridge_overhead

    result = bridge_overhead.run(calls=20, warmup=2, progress=lambda *_: None)
    assert len(result["rows"]) == 4 and all(r["input_zero_copy"] for r in result["rows"])
    assert all(r["bridge_median_us"] > 0 and r["raw_jax_median_us"] > 0 for r in result["rows"])
    c = result["compilations"]
    assert 1 <= c["xla_compilations"] <= c["distinct_new_shapes"]  # repeated token counts hit the cache


@pytest.mark.tpu_compile
def test_the_model_beside_xla_and_libtpus_own_estimate(tmp_path, monkeypatch):
    """A Pallas matmul (v2: counts + its compiled schedule) against XLA's cost analysis of jnp.dot and
    libtpu's static estimate of the same kernel (a validation compile with the profile flag)."""
    from pallas_hub.bench import validate

    monkeypatch.setenv("PALLAS_HUB_CACHE", str(tmp_path))
    (row,) = validate.xla_matmuls(shapes=((2048, 2048, 2048),), chips=("v6e",), progress=lambda *_: None)
    assert row["model_flops"] == row["xla_flops"] == row["min_flops"] == 2 * 2048 ** 3
    assert row["model_bytes"] >= row["min_bytes"] and row["xla_bytes"] >= row["min_bytes"]
    assert row["ideal_s"] <= min(row["v2_s_0us"], row["xla_optimal_s"]) * 1.0001
    # the per-step model at 0 us per step tracks the compiler's own estimate of the kernel
    assert 0.8 < row["v2_s_0us"] / row["static_profile_s"] < 1.25, row
    assert row["v2_s_0us"] < row["v2_s_0.35us"] < row["v2_s_0.7us"]


def test_a_long_context_decode_problem_gives_every_sequence_its_length():
    """Decode rows with one context length (issue 14's 8k and 32k rows): every sequence holds it, the table
    covers it, the name says it, and a compile worker rebuilds the same problem from its recipe."""
    m = problems.Model("tiny", hidden=256, experts=8, top_k=2, moe_intermediate=128, q_heads=8, kv_heads=2,
                       head_dim=128, short="tiny", moe_tokens=(), prefill_tokens=(), decode=((3, 16, 2048), (3, 16)))
    long, short = problems.problems(models=(m,), families=("decode",))
    assert long.name == "tiny decode B=3 page 16 context 2k" and short.name == "tiny decode B=3 page 16"
    lengths, table = long.args[5], long.args[6]
    assert (lengths == 2048).all() and table.shape[1] * 16 >= 2048 and long.params["context_tokens"] == 3 * 2048
    assert not (short.args[5] == short.args[5][0]).all()  # seeded uniform in DECODE_CONTEXT
    again = problems.rebuild(long.recipe)
    assert again.name == long.name and problems.signature(again) == problems.signature(long)
    assert problems.rebuild(short.recipe).recipe == short.recipe


def test_the_training_step_differentiates_every_prefill_and_checks_each_gradient():
    """The training family races each prefill implementation under one transform (jax.vjp of its forward):
    its check compares out, dq, dk and dv each against plain JAX, so a wrong gradient fails it; a prefill
    with no backward gets a row that says why. The least a step computes is 3x the forward's flops; the least
    it moves is q, k, v and do read, out, dq, dk and dv written. Unnamed kernels (jax's flash attention
    backward) take the name scope around them, as XLA names them, so they are matched to their schedules."""
    train = problems.train_problem(TINY, 256)
    prefill = problems.prefill_problem(TINY, 256)
    assert train.family == "train" and train.min_flops == 3 * prefill.min_flops
    assert train.min_bytes == 2 * (4 * 8 + 4 * 1) * 256 * 128  # q, k, v, do read; out, dq, dk, dv written
    assert problems.signature(problems.rebuild(train.recipe)) == problems.signature(train)
    impls = {i.name: i for i in bench.implementations(("train",), progress=lambda *_: None) if i.kind == "anchor"}
    assert all(i.family == "train" for i in impls.values())
    assert impls["vLLM TPU flash_attention"].fn is None
    assert impls["vLLM TPU flash_attention"].missing.startswith("no backward: tpu-inference's flash_attention")
    splash = impls["jax splash_attention (MaxText blocks)"]
    check = bench._run_check(splash, train)
    assert check["ok"] and check["rel_err"] < 1e-2, check
    names = [c.name for c in bench._count(impls["jax flash_attention"], train, "v6e", {}).calls]
    assert names[0] == "pallas_call" and names[1].startswith("flash_mha_bwd_dkv_block_q_major_128")
    assert names[2].startswith("flash_mha_bwd_dq_block_q_major_128"), names
    cost = bench._count(splash, train, "v6e", {})
    assert [c.name for c in cost.calls] == ["splash_mqa_fwd_residuals", "splash_mqa_dkv_no_residuals",
                                            "splash_mqa_dq_no_residuals"]

    def reference(q, k, v):
        return problems.attention_reference(q, k, v, 1 / 128 ** 0.5)

    @jax.custom_vjp
    def wrong_dq(q, k, v):  # the reference, whose backward drops dq
        return reference(q, k, v).astype(q.dtype)

    def backward(vjp, do):
        dq, dk, dv = vjp(do.astype(jnp.float32))
        return jnp.zeros_like(dq), dk, dv

    wrong_dq.defvjp(lambda q, k, v: (wrong_dq(q, k, v), jax.vjp(reference, q, k, v)[1]), backward)
    bad = bench.training_step(bench.Impl("wrong dq", "anchor", "prefill", lambda q, k, v, **_: wrong_dq(q, k, v)))
    check = bench._run_check(bad, train)
    assert not check["ok"] and check["rel_err"] > 0.5, check
    short = bench.Impl("out only", "anchor", "train", lambda q, k, v, do, **_: wrong_dq(q, k, v))
    assert not bench._run_check(short, train)["ok"]  # a reference output left unchecked is an error
    assert "prepare cannot be carried" in bench.training_step(dataclasses.replace(bad, prepare=lambda *a, **k: a)).missing
