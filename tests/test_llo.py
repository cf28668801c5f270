"""The LLO schedule reader and the compiled-program reader, on hand-written dumps and on a real compile."""

import json

import pytest

from pallas_hub.bench import compiled, llo


def _bundle(addr, text, marker="", depth=0):
    return f"  {hex(addr) if addr else '0':>6} {marker:>2}: {'>' * depth} {{ {text} }}"


def _builder():
    """(lines, add): a dump's header, and add(text, marker, depth, comment) appending bundle number len - 3."""
    lines = ["= control target key start", "= control target key end", ""]

    def add(text, marker="", depth=0, comment=""):
        lines.append(_bundle(len(lines) - 3, text, marker, depth) + (f" /* {comment} */" if comment else ""))

    return lines, add


def _program():
    """A grid loop (10 trips) whose body holds a predicated region with the matmuls, and a nested
    loop with a run-time bound (a while loop: exit test ``x != 0``)."""
    lines, add = _builder()

    add("%s1 = smov 0")
    add("%s2 = smov 0", comment="Start region 1")
    add("%s3 = sadd.s32 1, %s2", "LB", 1, comment="Start region 2")  # 2: grid loop body starts
    add("%d = dma.hbm_to_vmem [thread:$0] %s3, /*size_in_granules=*/64", depth=1)
    add("%p4 = scmp.eq.s32.totalorder %s3, 0", depth=1)
    add("%5 = sbr.rel (%p4) target = $region3", depth=1)  # 5: skips the matmul region (6..9)
    add("%v6 = vmatmul.mubr.bf16.gmra.mxu0 %v1", depth=1)
    add("%v7 = vmatmul.mubr.bf16.gmra.mxu1 %v1", depth=1)
    add("%v8 = vmatmul.mubr.bf16.gmra.mxu0 %v1", depth=1)
    add("%v9 = vadd.f32 %v6, %v7", depth=1)
    add("%s10 = smov 5", depth=1, comment="Start region 3")  # 10
    add("%s11 = sadd.s32 1, %s10", "LB", 2, comment="Start region 4")  # 11: inner loop body
    add("%p12 = scmp.ne.s32.totalorder %s11, 0", depth=2)
    add("%13 = sbr.rel (!%p12) target = $region4", depth=2)
    add("", depth=2)  # a delay slot
    add("%p15 = scmp.ge.s32.totalorder %s3, 10 /* loop exit test */", depth=1)
    add("%16 = sbr.rel (!%p15) target = $region2", depth=1)
    add("", depth=1)
    add("", depth=1)
    add("%19 = vsyncpa [#allocation1], 0")
    return "\n".join(lines) + "\n"


def test_loops_trips_matmuls_and_gated_work(tmp_path):
    path = tmp_path / "1-mm.1-02-final_bundles.txt"
    path.write_text(_program())
    prog = llo.analyse(llo.read_bundles(str(path)))
    assert prog["bundles"] == 20
    (grid,) = prog["loops"]
    assert (grid["start"], grid["end"], grid["trips"]) == (2, 18, 10)  # body to the back branch's delay slots
    (inner,) = grid["children"]
    assert inner["trips"] is None  # `x != 0` is no trip count
    assert inner["own_bundles"] == 4
    assert grid["own_bundles"] == 17 - 4
    assert (grid["vmatmul"], grid["vmatmul_all"]) == (2, 3)  # busiest MXU, all MXUs
    assert grid["gated"] == 4  # bundles 6..9: the region the forward branch at 5 skips
    assert grid["dma_starts"] == 1
    assert prog["own_bundles"] == 3
    assert llo.executed_bundles(prog) == (3 + 10 * (13 + 4), False)  # the run-time loop counted once
    assert llo.op_files(str(tmp_path)) == {"mm.1": str(path)}


def _alternatives(enclosed: bool) -> str:
    """A loop (4 trips) whose matmuls sit in two sibling predicated regions (pl.when alternatives, e.g. an
    unmasked and a masked tile), inside one region that skips both when ``enclosed``."""
    lines, add = _builder()

    add("%s1 = smov 0", comment="Start region 1")
    add("%s2 = sadd.s32 1, %s1", "LB", 1, comment="Start region 2")  # 1: the loop body starts
    add("%p3 = scmp.eq.s32.totalorder %s2, 0", depth=1)
    add("%4 = sbr.rel (%p3) target = $region5" if enclosed else "%s4 = smov 2", depth=1)  # 3: skips 4..11
    add("%5 = sbr.rel (%p3) target = $region3", depth=1)  # 4: the first alternative (5..7)
    add("%v6 = vmatmul.mubr.bf16.gmra.mxu0 %v1", depth=1)
    add("%v7 = vmatmul.mubr.bf16.gmra.mxu1 %v1", depth=1)
    add("%v8 = vadd.f32 %v6, %v7", depth=1)
    add("%9 = sbr.rel (!%p3) target = $region4", depth=1, comment="Start region 3")  # 8: the second (9..10)
    add("%v10 = vmatmul.mubr.bf16.gmra.mxu0 %v1", depth=1)
    add("%v11 = vmul.f32 %v10, %v10", depth=1)
    add("%s12 = smov 1", depth=1, comment="Start region 4")  # 11
    add("%s13 = sadd.s32 1, %s12", depth=1, comment="Start region 5")  # 12
    add("%p14 = scmp.ge.s32.totalorder %s2, 4 /* loop exit test */", depth=1, comment="Start region 6")
    add("%15 = sbr.rel (!%p14) target = $region2", depth=1)
    add("", depth=1)
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("enclosed,gated", [(False, 3 + 2), (True, 12 - 4)])
def test_gated_work_of_sibling_alternatives(tmp_path, enclosed, gated):
    """Matmuls in sibling predicated regions (a step runs one of them) are gated work, both regions'
    bundles and no more; a region holding them all is the gated work (the smallest such)."""
    path = tmp_path / "1-alt.1-02-final_bundles.txt"
    path.write_text(_alternatives(enclosed))
    (loop,) = llo.analyse(llo.read_bundles(str(path)))["loops"]
    assert (loop["start"], loop["trips"], loop["vmatmul_all"]) == (1, 4, 3)
    assert loop["gated"] == gated


HLO = """HloModule jit_f, is_scheduled=true

%fused_computation.1 (param_0: bf16[64,128], param_1: s32[4], param_2: bf16[4,128]) -> bf16[64,128] {
  %param_0 = bf16[64,128]{1,0} parameter(0)
  ROOT %dynamic-update-slice.1 = bf16[64,128]{1,0} dynamic-update-slice(%param_0, %param_2, %c)
}

%fused_computation.2 (param_0.1: bf16[4096,128], param_1.1: s32[8]) -> bf16[8,128] {
  ROOT %gather.1 = bf16[8,128]{1,0} gather(%param_0.1, %param_1.1)
}

ENTRY %main (cache: bf16[64,128], upd: bf16[4,128], idx: s32[4], x: bf16[4096,128], ids: s32[8]) -> bf16[8,128] {
  %cache = bf16[64,128]{1,0} parameter(0)
  %upd = bf16[4,128]{1,0} parameter(1)
  %idx = s32[4]{0} parameter(2)
  %x = bf16[4096,128]{1,0} parameter(3)
  %ids = s32[8]{0} parameter(4)
  %fusion.1 = bf16[64,128]{1,0} fusion(%cache, %idx, %upd), kind=kLoop, calls=%fused_computation.1
  %copy-start = (bf16[4,128]{1,0:S(1)}, bf16[4,128]{1,0}, u32[]) copy-start(%upd)
  %copy-done = bf16[4,128]{1,0:S(1)} copy-done(%copy-start)
  %slice-start = ((bf16[4096,128]{1,0}), bf16[512,128]{1,0:S(1)}, s32[]{:S(2)}) slice-start(%x), slice={[512:1024], [0:128]}
  %slice-done = bf16[512,128]{1,0:S(1)} slice-done(%slice-start)
  %slice.2 = bf16[16,128]{1,0:S(1)} slice(%x), slice={[0:16], [0:128]}
  %gather_fusion = bf16[8,128]{1,0} fusion(%x, %ids), kind=kCustom, calls=%fused_computation.2
  %offload = ((), (), (s32[16]{0})) custom-call-start(), async_execution_thread="sparsecore"
  %offload.update = ((bf16[4096,128]{1,0}, s32[8]{0}), bf16[8,128]{1,0}, (s32[16]{0})) custom-call-update(%offload, %x, %ids)
  %offload.done = bf16[8,128]{1,0} custom-call-done(%offload.update)
  %k.1 = bf16[8,128]{1,0:S(1)} custom-call(%gather_fusion, %copy-done), custom_call_target="tpu_custom_call", backend_config={"custom_call_config":
"xprof_metadata":"{}"
}}, metadata={op_name="k"}
  ROOT %add.3 = bf16[8,128]{1,0} add(%k.1, %gather_fusion)
}
"""


def test_entry_ops_bytes_in_place_partial_reads_vmem_and_multiline_instructions():
    ops = {op["name"]: op for op in compiled.entry_ops(HLO)}
    assert ops["cache"]["free"] and ops["cache"]["hbm_bytes"] == 0
    assert ops["fusion.1"]["root"] == "dynamic-update-slice"
    assert ops["fusion.1"]["hbm_bytes"] == 2 * (4 * 128 * 2 + 4 * 4)  # the update (and indices), not the cache
    assert ops["copy-start"]["hbm_bytes"] == 4 * 128 * 2  # into VMEM (S(1)): only the HBM side counts
    assert ops["copy-done"]["hbm_bytes"] == 0
    # XLA's prefetch of part of an operand into VMEM (an async slice): the part read, not the whole operand
    assert ops["slice-start"]["hbm_bytes"] == 512 * 128 * 2 and ops["slice-done"]["hbm_bytes"] == 0
    assert ops["slice.2"]["hbm_bytes"] == 16 * 128 * 2
    assert ops["gather_fusion"]["hbm_bytes"] == 2 * 8 * 128 * 2 + 8 * 4  # the rows gathered, not the table
    # an offloaded gather's update: the result, not the operands its tuple repeats, plus what it reads
    assert ops["offload.update"]["hbm_bytes"] == 8 * 128 * 2 + 16 * 4 + 4096 * 128 * 2 + 8 * 4
    assert ops["offload.done"]["hbm_bytes"] == 0
    assert ops["k.1"]["kernel"]  # an instruction spanning lines (backend config with newlines)
    assert ops["add.3"]["hbm_bytes"] == 2 * 8 * 128 * 2  # the kernel's output sits in VMEM


def test_identical_kernel_calls_share_their_compiled_program():
    """Two calls of one kernel on other operands compile to one program, dumped under the first call's name
    (a layer in parts of its tokens): both get its schedule; a kernel of other shapes does not."""
    hlo = """HloModule jit_f, is_scheduled=true

ENTRY %main (a: bf16[8,128], b: bf16[8,128], c: bf16[16,128]) -> bf16[8,128] {
  %a = bf16[8,128]{1,0} parameter(0)
  %b = bf16[8,128]{1,0} parameter(1)
  %c = bf16[16,128]{1,0} parameter(2)
  %k.1 = bf16[8,128]{1,0} custom-call(%a), custom_call_target="tpu_custom_call", backend_config={"kernel":"x"}
  %k.2 = bf16[8,128]{1,0} custom-call(%b), custom_call_target="tpu_custom_call", backend_config={"kernel":"x"}
  %k.3 = bf16[16,128]{1,0} custom-call(%c), custom_call_target="tpu_custom_call", backend_config={"kernel":"x"}
  ROOT %add.1 = bf16[8,128]{1,0} add(%k.2, %k.1)
}
"""
    import base64
    import zlib

    program = {"bundles": 7}
    profile = {"hlo": base64.b64encode(zlib.compress(hlo.encode())).decode(), "programs": {"k.2": program}}
    ops = {op["name"]: op for op in compiled.ops(profile)}
    assert ops["k.1"]["program"] == ops["k.2"]["program"] == program
    assert ops["k.3"]["program"] is None


@pytest.mark.tpu_compile
def test_a_compiled_pallas_matmul_matches_its_hand_count(tmp_path, monkeypatch):
    """jax's Pallas matmul, 2048^2 x 2048 in 512^3 blocks, compiled for v6e in a worker process:
    one flattened grid loop of 64 steps + 2 pipeline stages; 512^3 per step = 128 vmatmuls of
    16 x 256 x 256 (64 per MXU); the XLA program around it is the kernel alone."""
    monkeypatch.setenv("PALLAS_HUB_CACHE", str(tmp_path))
    job = compiled.Job("validate: pallas matmul", ("matmul", 2048, 2048, 2048, 512, 512, 512), "v6e", (), "test")
    prof = compiled.profiles([job], progress=lambda *_: None)[job.key]
    assert "error" not in prof, prof
    (kernel,) = [op for op in compiled.ops(prof) if op["kernel"]]
    (grid,) = kernel["program"]["loops"]
    assert grid["trips"] == 66
    assert (grid["vmatmul"], grid["vmatmul_all"]) == (64, 128)
    assert 0 < grid["gated"] < grid["own_bundles"]
    assert (tmp_path / "llo" / f"{job.key}.json").exists()  # cached: a second call compiles nothing
    assert compiled.profiles([job], progress=lambda *_: None)[job.key] == json.loads(
        (tmp_path / "llo" / f"{job.key}.json").read_text())


@pytest.mark.tpu_compile
def test_each_program_compiles_in_a_fresh_process(tmp_path, monkeypatch):
    """A compile's schedule must not depend on what its process compiled before (vLLM TPU's
    ragged_paged_attention v3 did): one process per program, a failing one reported beside the others."""
    monkeypatch.setenv("PALLAS_HUB_CACHE", str(tmp_path))
    launched = []
    popen = compiled.subprocess.Popen
    monkeypatch.setattr(compiled.subprocess, "Popen", lambda *a, **kw: launched.append(a) or popen(*a, **kw))
    good = [compiled.Job("validate: pallas matmul", ("matmul", 256, 256, n, 128, 128, 128), "v6e", (), "test")
            for n in (256, 384)]
    bad = compiled.Job("validate: pallas matmul", ("matmul", 256, 256, 256, 100, 128, 128), "v6e", (), "test")
    profs = compiled.profiles(good + [bad], progress=lambda *_: None, workers=1)
    assert len(launched) == 3
    for job, n in zip(good, (256, 384)):
        (kernel,) = [op for op in compiled.ops(profs[job.key]) if op["kernel"]]
        assert kernel["program"]["loops"][0]["trips"] == 2 * 2 * n // 128 + 2  # the (m, n, k) grid + 2 pipeline stages
    assert "100" in profs[bad.key]["error"] or "divis" in profs[bad.key]["error"], profs[bad.key]
