"""Every published figure is what the model gives at HEAD (the staleness check, fast).

benchmarks/results/bench.json is the one source: benchmarks/README.md, kernels/*/benchmarks/RESULTS.md
and each CARD.md's generated block must equal a re-render of it; the inputs it was made from (our
kernels' sources, the anchors, the cost model, the chip table, the library versions) must be HEAD's;
and a few rows' counts, recomputed now, must match. When this fails, run `pallas-hub bench`.
"""

import json

import pytest

from pallas_hub.bench import costmodel, report, runner
from pallas_hub.hub.manifest import ROOT

RESULT = ROOT / "benchmarks" / "results" / "bench.json"
STALE = "the published benchmark figures are stale: run `pallas-hub bench` (or `make bench`) and commit the result"


@pytest.fixture(scope="module")
def result():
    if not RESULT.exists():
        pytest.fail(f"{RESULT.relative_to(ROOT)} is missing: {STALE}")
    return json.loads(RESULT.read_text())


def test_published_files_are_renderings_of_the_results(result):
    assert result["families"] == list(runner.FAMILIES) and result["chips"] == list(runner.DEFAULT_CHIPS)
    for path, text in report.rendered(result).items():
        assert path.exists() and path.read_text() == text, f"{path.relative_to(ROOT)} differs from bench.json: {STALE}"
    for path in report.rendered(result):
        assert str(ROOT) not in path.read_text(), f"{path.relative_to(ROOT)} holds an absolute path"


def test_rendering_does_not_depend_on_the_order_of_keys(result):
    """bench.json is written with sorted keys: what a run publishes must equal a re-render of the file."""
    def reverse(x):
        if isinstance(x, dict):
            return {k: reverse(x[k]) for k in reversed(list(x))}
        return [reverse(v) for v in x] if isinstance(x, list) else x

    assert report.rendered(reverse(result)) == report.rendered(result)


def test_the_results_were_made_from_head(result):
    now = runner.inputs_digest()
    for key in ("cost_model", "kernels", "anchors", "versions"):
        assert result["inputs"][key] == now[key], f"{key} changed since bench.json was made: {STALE}"


@pytest.mark.parametrize("problem, impl", [("Qwen3 decode B=8 page 16", "jax paged_attention"),
                                          ("Qwen3 decode B=8 page 16", "ours: paged_attention"),
                                          ("Qwen3 MoE layer T=8", "ours: ragged_dot")])
def test_counts_recomputed_now_match(result, problem, impl):
    (row,) = [r for r in result["rows"] if r["problem"] == problem and r["impl"] == impl]
    prob = next(p for p in runner.problems() if p.name == problem)
    (im,) = [i for i in runner.implementations((prob.family,), progress=lambda *_: None) if i.name == impl]
    for chip in ("v6e",) if im.per_chip else ("v5e",):
        with im.tracing(chip):
            cost = costmodel.estimate(im.call(prob.kwargs, chip), *im.args(prob.args, prob.params))
        saved = row["chips"][chip]
        assert (cost.hbm_bytes, cost.flops, cost.grid_steps) == (saved["hbm_bytes"], saved["flops"],
                                                                 saved["grid_steps"]), STALE


def test_quantized_rows_stand_beside_their_bf16_layer(result):
    """Each quantized row of the published bench is set beside ours on the bf16 problem of the same shape
    (the bf16 problem may name a storage layout; a quantized one takes its weights as given)."""
    lines = report.quantized_table(result, "moe")
    rows = [line for line in lines[2:] if line.startswith("| ")]
    assert rows and all(line.count("x)") == len(result["chips"]) for line in rows), rows


def test_our_kernels_modelled_mxu_work_covers_their_flops(result):
    """The step model joins each kernel's loops to its compiled loops; a loop it cannot match is counted once,
    which can leave a kernel's matmuls under-counted (a nested loop in the fused experts' first step did:
    MXU efficiency 2.51, a layer published 1.7x too fast). So no kernel of ours may execute more flops than
    its modelled vmatmuls hold, beyond rounding, and only the known MXFP4 gmm may carry a join note."""
    for row in result["rows"]:
        if row["kind"] != "ours":
            continue
        for chip, v in row["chips"].items():
            for call in v.get("calls", []):
                where = f"{row['problem']} on {chip}: {call['name']}"
                assert (call.get("mxu_efficiency") or 0) <= 1.06, f"{where} executes more flops than its vmatmuls"
                if "mxfp4" not in row["problem"]:
                    assert not call.get("join_notes"), f"{where}: {call['join_notes']}"
