"""The per-step model v2 on hand-made counts and schedules: the join, each term, and the arithmetic."""

import pytest

from pallas_hub.bench import stepmodel
from pallas_hub.bench.costmodel import CallCost, LoopInfo, StepType
from pallas_hub.vendored import _chips as chips


def _loop(trips, own, vmatmul=0, gated=0, children=(), dma=0):
    return {"start": 0, "end": own, "trips": trips, "own_bundles": own, "vmatmul": vmatmul,
            "vmatmul_all": 2 * vmatmul, "gated": gated, "dma_starts": dma, "children": list(children)}


def _program(loops, own=10):
    return {"bundles": own + sum(lp["own_bundles"] for lp in loops), "own_bundles": own, "vmatmul": 0,
            "vmatmul_all": 0, "dma_starts": 0, "loops": list(loops)}


def _call(step_types, loops=(), grid=None, level_flops=None):
    steps = sum(t.count for t in step_types)
    flops = sum(t.count * sum(t.flops) for t in step_types)
    return CallCost("k", grid or (steps,), (), 0, 0, 0, flops, 0, None, tuple(loops), tuple(step_types),
                    tuple(level_flops or [0] * (len(loops) + 1)))


def _step(count, read=0, write=0, flops=(0,), dma_read=None, dma_write=None, iterations=()):
    n = len(flops)
    return StepType(count, read, write, tuple(flops), tuple(dma_read or [0] * n), tuple(dma_write or [0] * n),
                    tuple(iterations))


def test_a_grid_step_is_the_larger_of_its_dma_and_its_compute_plus_the_overhead():
    """Per step: max(DMA, compute + overhead); the call itself pays one overhead (its launch) and
    the code outside its grid loop once."""
    c = chips.chip("v6e")
    mm = 2 * 16 * 256 * 256 * 128  # 64 vmatmuls on each of the 2 MXUs: 512 MXU cycles
    call = _call([_step(8, read=1 << 20, flops=(mm,)), _step(2, read=0, flops=(mm,))])
    prog = _program([_loop(12, own=300, vmatmul=64, gated=200)])  # 10 steps + 2 pipeline stages
    t = stepmodel.call_time(call, prog, "v6e")
    assert t.join_notes == []
    compute = 512 / c.clock_hz  # MXU-bound: 512 cycles > 300 bundles
    dma = (1 << 20) / c.hbm_bandwidth
    for o in stepmodel.OVERHEADS:
        expect = 10 / c.clock_hz + o + 8 * max(dma, compute + o) + 2 * (compute + o)
        assert t.seconds(o) == pytest.approx(expect)
    b = t.breakdown()
    assert b["grid_steps"] == 10 and b["dma_bound_steps"] == 8
    assert b["mxu_efficiency"] == pytest.approx(1.0)
    assert b["bundles_per_mxu_mflop"] == pytest.approx(300 / (128 * 2 * 16 * 256 * 256 / 1e6))


def test_skipped_matmuls_skip_their_gated_bundles():
    """Steps whose dots did not run (pl.when) issue only the ungated part of the body."""
    c = chips.chip("v6e")
    mm = 2 * 16 * 256 * 256 * 8
    call = _call([_step(3, flops=(mm,)), _step(5, flops=(0,))])
    t = stepmodel.call_time(call, _program([_loop(10, own=1000, vmatmul=8, gated=900)]), "v6e")
    ran, skipped = sorted(t.steps, key=lambda s: -s.issue_cycles)
    assert (ran.issue_cycles, ran.mxu_cycles) == (1000, 64)
    assert (skipped.issue_cycles, skipped.mxu_cycles) == (100, 0)
    assert t.seconds(0) == pytest.approx((10 + 3 * 1000 + 5 * 100) / c.clock_hz)


def test_alternative_matmul_regions_are_charged_for_the_path_a_step_runs():
    """Alternatives inlined in one level (``pl.when`` regions: masked and unmasked tiles, flash attention's
    pipelined pair of heads) all sit in the compiled level, a step runs one: the flops of the level's dots,
    each once (``level_flops``), say what share of its vmatmuls and gated bundles a step issued. Without
    them (an anchor counted from its source) the busiest step's flops set that scale, as before."""
    mm = 2 * 16 * 256 * 256 * 8  # one path: 8 vmatmuls, 4 on each MXU; the level compiles two such paths
    steps = [_step(4, flops=(mm,)), _step(2, flops=(0,))]
    prog = _program([_loop(8, own=1000, vmatmul=8, gated=900)])
    t = stepmodel.call_time(_call(steps, level_flops=(2 * mm,)), prog, "v6e")
    ran, skipped = sorted(t.steps, key=lambda s: -s.issue_cycles)
    assert (ran.issue_cycles, ran.mxu_cycles) == (100 + 900 / 2, 8 * 8 / 2)
    assert (skipped.issue_cycles, skipped.mxu_cycles) == (100, 0)
    assert t.breakdown()["mxu_efficiency"] == pytest.approx(1.0)
    old = stepmodel.call_time(_call(steps), prog, "v6e")
    assert max(s.mxu_cycles for s in old.steps) == 64 and old.breakdown()["mxu_efficiency"] == pytest.approx(0.5)
    # the same two paths inside a one-trip loop (no loop once compiled: its dots belong to the step)
    folded = _call([_step(4, flops=(0, mm), iterations=(1,)), _step(2, flops=(0, 0), iterations=(1,))],
                   [LoopInfo(None, 1, False)], level_flops=(0, 2 * mm))
    assert max(s.mxu_cycles for s in stepmodel.call_time(folded, prog, "v6e").steps) == 32


def test_each_dma_loop_iteration_is_a_step():
    c = chips.chip("v5e")
    loops = [LoopInfo(None, None, True)]  # a while loop starting copies: paged attention's page loop
    call = _call([_step(1, flops=(0, 0), dma_read=(0, 4 * 65536), iterations=(4,))], loops, grid=(1,))
    prog = _program([_loop(None, own=200)], own=50)  # one grid step: no grid loop
    t = stepmodel.call_time(call, prog, "v5e")
    (st,) = t.steps
    assert st.loops == [(4, 65536 / c.hbm_bandwidth, 200 / c.clock_hz)]
    for o in stepmodel.OVERHEADS:
        launch = o
        assert t.seconds(o) == pytest.approx(launch + max(0, 50 / c.clock_hz + o) + 4 * max(65536 / c.hbm_bandwidth,
                                                                                            200 / c.clock_hz + o))


def test_loops_join_by_trip_count_and_what_does_not_match_is_said():
    loops = [LoopInfo(None, 8, False), LoopInfo(None, None, False), LoopInfo(None, 1, False)]
    call = _call([_step(4, flops=(0, 0, 0, 0), iterations=(8, 3, 1))], loops)
    # compiled: the 8-trip loop, a compiler-made loop of 2 trips, the run-time loop; the 1-trip loop is gone
    prog = _program([_loop(6, own=100, children=[_loop(8, own=40), _loop(2, own=5), _loop(None, own=30)])])
    j = stepmodel.join(call, prog)
    assert j.notes == []
    assert j.levels[0].bundles == 100 + 2 * 5  # the compiler's own loop counted inside its parent
    assert j.levels[1].bundles == 40 and j.levels[2].bundles == 30
    assert j.folded == {3: 0}  # the one-trip loop's work is in the step's own bundles
    bad = stepmodel.join(call, _program([_loop(6, own=100, children=[_loop(8, own=40)])]))
    assert bad.notes == ["loop 1 (run-time trips) has no compiled loop"]
    t = stepmodel.call_time(call, prog, "v6e")
    assert t.steps[0].issue_cycles == 110 + 8 * 40 + 3 * 30


def test_a_dynamic_grid_is_the_loop_with_a_run_time_trip_count():
    call = CallCost("k", (5,), (), 0, 0, 0, 0, 0, None, (), (_step(5),), (0,), dynamic_grid=True)
    j = stepmodel.join(call, _program([_loop(None, own=70)], own=20))
    assert j.grid_loop and j.prologue == 20 and j.levels[0].bundles == 70


def test_glue_ops_and_call_matching():
    c = chips.chip("tpu7x")
    op = {"name": "gather_fusion", "hbm_bytes": 10 ** 6, "offloaded": False, "program": {"executed_bundles": 10 ** 5}}
    assert stepmodel.glue_time(op, "tpu7x", 0.35e-6) == pytest.approx(max(1e6 / c.hbm_bandwidth, 1e5 / c.clock_hz) + 0.35e-6)
    off = dict(op, offloaded=True)  # on the SparseCores: its bytes only
    assert stepmodel.glue_time(off, "tpu7x", 0) == pytest.approx(1e6 / c.hbm_bandwidth)
    a, b = _call([_step(1)]), CallCost("write_kv", (1,), (), 0, 0, 0, 0, 0, None, (), (_step(1),), (0,))
    profile = {"ops": [{"name": "write_kv.1", "kernel": True}, {"name": "k.2", "kernel": True},
                       {"name": "fusion", "kernel": False, "hbm_bytes": 8, "program": None}]}
    assert [op["name"] for _, op in stepmodel.match_calls([a, b], profile)] == ["k.2", "write_kv.1"]
    assert [op["name"] for op in stepmodel.glue_ops(profile)] == ["fusion"]
    # a custom VJP's backward kernels carry JAX's transform prefixes, and XLA may order independent kernels
    # either way: matched by name, not by position (by position, dq took dK/dV's schedule at 8192 tokens)
    fa, dq, dkv = (CallCost(n, (1,), (), 0, 0, 0, 0, 0, None, (), (_step(1),), (0,)) for n in ("fa", "fa_dq", "fa_dkv"))
    profile = {"ops": [{"name": "transpose_jvp_fa_dkv__.1", "kernel": True}, {"name": "fa_dq.2", "kernel": True},
                       {"name": "fa.3", "kernel": True}, {"name": "other.4", "kernel": True}]}
    assert stepmodel.kernel_name("transpose_jvp_fa_dkv__.1") == "fa_dkv__"
    assert [op["name"] for _, op in stepmodel.match_calls([a, fa, dq, dkv], profile)] == [
        "other.4", "fa.3", "fa_dq.2", "transpose_jvp_fa_dkv__.1"]  # "fa" is not "fa_dq"; "k" takes what is left


def test_a_kernel_whose_grid_has_no_compiled_loop_gives_no_figure(monkeypatch):
    """Were no compiled loop to match the grid, each step would be timed as the whole kernel (at 8192 tokens
    a backward's dq came out at 395 ms): the row is an error that says so, not a figure."""
    from types import SimpleNamespace

    from pallas_hub.bench import runner
    from pallas_hub.bench.costmodel import Cost

    call = _call([_step(10, flops=(0,))])
    assert stepmodel.call_time(call, _program([_loop(12, own=300)]), "v6e").grid_joined
    prog = _program([_loop(30, own=300)])
    assert not stepmodel.call_time(call, prog, "v6e").grid_joined
    monkeypatch.setattr(runner.compiled, "ops", lambda profile: [{"name": "k.1", "kernel": True, "program": prog}])
    res = runner.assemble(SimpleNamespace(min_bytes=1, min_flops=1), "v6e", Cost((call,)), {"hlo": ""})
    assert res["status"] == "error" and res["error"] == "kernel k: no compiled loop matches its grid"
