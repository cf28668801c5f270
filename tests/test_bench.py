"""pallas-hub bench: the runner, its outputs, the TPU timing path (stand-in device and clock), the
bridge benchmark and the cost model beside XLA:TPU's cost analysis."""

import json
import types

import jax
import jax.numpy as jnp
import pytest
import torch

from pallas_hub.bench import anchors, costmodel, timing, tpu_bench
from pallas_hub.bench import runner as bench
from pallas_hub.vendored import _bridge as bridge
from pallas_hub.hub.manifest import ROOT

TINY = bench.Model("tiny", hidden=256, experts=8, top_k=2, moe_intermediate=128, q_heads=8, kv_heads=1, head_dim=128, short="tiny")


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


def test_bench_run_writes_json_plots_and_readme(tmp_path):
    probs = [bench.moe_problem(TINY, 8, "gate_up"), bench.decode_problem(TINY, 2)]
    impls = [bench.Impl("ours: ragged_dot", "ours", "moe", None, "not in the manifest (not on main yet)"),
             bench.Impl("jax megablox gmm", "anchor", "moe", anchors.megablox_gmm),
             bench.Impl("jax paged_attention", "anchor", "decode", anchors.jax_paged_attention)]
    readme = tmp_path / "README.md"
    readme.write_text("# Benchmarks\n\nHand-written intro.\n")
    lines = []
    result = bench.run(("moe", "decode"), out_dir=tmp_path, readme=readme, bridge=False, xla=False, measure=False,
                       progress=lines.append, problem_list=probs, impl_list=impls)
    rows = {(r["problem"], r["impl"]): r for r in result["rows"]}
    assert rows[("tiny gate_up T=8", "ours: ragged_dot")]["status"] == "missing"  # never a faked row
    mb = rows[("tiny gate_up T=8", "jax megablox gmm")]
    assert mb["status"] == "ok" and mb["check"]["ok"], mb
    assert mb["flops"] >= mb["min_flops"] and mb["hbm_bytes"] >= mb["min_bytes"]
    assert 0 < mb["roofline"]["v6e"] <= 1
    pa = rows[("tiny decode B=2", "jax paged_attention")]
    assert pa["status"] == "ok" and pa["check"]["ok"], pa
    assert any("tiny gate_up T=8" in line for line in lines)  # progress while running
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(result["rows"]))
    for png in ("roofline.png", "modelled_time.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = readme.read_text()
    assert "Hand-written intro." in text and "| tiny gate_up T=8 | jax megablox gmm |" in text
    assert "| tiny gate_up T=8 | ours: ragged_dot | missing" in text
    bench.render_readme(saved, readme)  # regenerating from the JSON replaces the table, keeps the rest
    assert readme.read_text().count(bench.MARK_BEGIN) == 1 and "Hand-written intro." in readme.read_text()


def test_tpu_path_with_stand_in_device_and_clock():
    """The TPU timing path, run on CPU with a fake clock: it claims nothing about TPU speed."""
    probs = [bench.moe_problem(TINY, 8, "down")]
    impls = [bench.Impl("jax megablox gmm", "anchor", "moe", anchors.megablox_gmm)]
    model_rows = [{"problem": "tiny down T=8", "impl": "jax megablox gmm", "status": "ok", "modelled_s": {"v6e": 1e-5}}]
    synced = []
    rows = tpu_bench.time_rows(probs, impls, model_rows, chip="v6e", device="stand-in", runs=3, warmup=1,
                               clock=FakeClock([2e-5]), sync=lambda out: synced.append(out), interpret=True,
                               progress=lambda *_: None)
    (row,) = rows
    assert row["median_s"] == pytest.approx(2e-5) and row["modelled_s"] == 1e-5 and row["device"] == "stand-in"
    assert len(synced) == 4 and synced[-1].shape == (16, 256)
    layers = tpu_bench.moe_decode_layers({"eager": None}, device="cpu", batches=(1, 3), runs=2, warmup=1,
                                         config_overrides=dict(hidden_size=64, num_experts=4, num_experts_per_tok=2,
                                                               moe_intermediate_size=32),
                                         clock=FakeClock([1e-3]), progress=lambda *_: None)
    assert [r["problem"] for r in layers] == ["Qwen3-30B-A3B MoE block decode B=1", "Qwen3-30B-A3B MoE block decode B=3"]
    assert all(r["median_s"] == pytest.approx(1e-3) for r in layers)
    stand_in = types.SimpleNamespace(platform="tpu", device_kind="TPU v6 lite", __str__=lambda s: "TPU_0 (stand-in)")
    out = tpu_bench.run(probs, impls, model_rows, jax_device=stand_in, runs=2, warmup=0, clock=FakeClock([3e-5]),
                        interpret=True, progress=lambda *_: None)
    assert out["chip"] == "v6e" and out["rows"][0]["median_s"] == pytest.approx(3e-5)
    assert out["rows"][0]["modelled_s"] == 1e-5  # measured beside modelled, for the detected chip
    cpu = tpu_bench.run(probs, impls, model_rows, progress=lambda *_: None)  # JAX on CPU: refuses to time
    assert cpu["rows"] == [] and "JAX_PLATFORMS=tpu" in cpu["skipped"]
    assert tpu_bench.chip_of(types.SimpleNamespace(device_kind="TPU v6 lite")) == "v6e"
    assert tpu_bench.chip_of(types.SimpleNamespace(device_kind="cpu")) is None


def test_bridge_benchmark_zero_copy_and_no_recompiles():
    from pallas_hub.bench import bridge_overhead

    result = bridge_overhead.run(calls=20, warmup=2, progress=lambda *_: None)
    assert len(result["rows"]) == 4 and all(r["input_zero_copy"] for r in result["rows"])
    assert all(r["bridge_median_us"] > 0 and r["raw_jax_median_us"] > 0 for r in result["rows"])
    c = result["compilations"]
    assert 1 <= c["xla_compilations"] <= c["distinct_new_shapes"]  # repeated token counts hit the cache


@pytest.mark.tpu_compile
def test_cost_model_beside_xla_cost_analysis():
    (row,) = bench.xla_matmul_comparison(shapes=((1024, 1024, 1024),), chips=("v6e",), progress=lambda *_: None)
    assert row["model_flops"] == row["xla_flops"] == row["min_flops"] == 2 * 1024 ** 3
    assert row["model_bytes"] >= row["min_bytes"] and row["xla_bytes"] >= row["min_bytes"]
    # both are memory-bound here and count the same operands: the times agree within 2x
    assert 0.5 < row["model_over_xla"] < 2.0, row
    assert row["ideal_s"] <= min(row["model_s"], row["xla_optimal_s"]) * 1.0001
