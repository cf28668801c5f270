"""Every manifest kernel declares what `pallas-hub bench` runs (bench_problems.py) and what `pallas-hub demo`
checks (demo_check.py); nothing is keyed on kernel names. A declared family adapter is run here on a small
case in the family's calling convention (the one the benchmark's anchors take) against plain JAX, and a
kernel's own problems run their checks, so a declaration that would bench the wrong thing fails here."""

import contextlib

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_hub.bench import problems
from pallas_hub.hub import manifest
from pallas_hub.hub.declarations import BenchImpl, bench_declaration, declaration
from pallas_hub.verify import interpret

KERNELS = sorted(manifest.load_manifest().kernels)


def _family_cases(family, formats):
    """The benchmark's own reduced cases of the family's problems in ``formats``, one per format and storage (its
    calling convention, with an independent plain-JAX reference; the problem, whose params go to ``prepare``):
    what `pallas-hub bench` checks, here on every test run."""
    first = {}
    for p in problems.problems(families=(family,)):
        if p.family == family and p.format in formats:
            first.setdefault((p.format, p.params.get("storage")), p)
    for p in first.values():
        check = p.check()
        yield check.args, check.kwargs, check.reference, check.tol, p


@pytest.mark.parametrize("key", KERNELS)
def test_each_kernel_declares_its_bench_problems_and_they_compute_the_right_thing(key, load_kernel):
    spec = manifest.load_manifest().kernels[key]
    kernel = load_kernel(key)
    raced, own = bench_declaration(spec, kernel)
    if raced is not None:
        family, impl = raced
        assert isinstance(impl, BenchImpl) and "bf16" in impl.formats
        assert set(impl.formats) <= {"bf16", *problems.QUANT_FORMATS}, impl.formats
        cases = list(_family_cases(family, impl.formats))  # the quantized formats it declares too: scales appended
        assert {p.format for *_, p in cases} == set(impl.formats)
        for args, kwargs, ref, tol, p in cases:
            if impl.prepare:
                args = impl.prepare(*args, params=p.params)
            with interpret("fast"), impl.context("v6e") if impl.context else contextlib.nullcontext():
                got = impl.fn(*args, chip="v6e", **kwargs)
            got = got[0] if isinstance(got, tuple) else got  # decode also returns the updated caches
            err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
            assert err < tol, (p.name, err)
    for problem in own:
        jax.eval_shape(lambda *a: problem.fn(*a, **problem.kwargs), *problem.args)  # abstract, as the cost model
        assert problem.min_bytes > 0 and problem.min_flops >= 0
        case = problem.check()
        with interpret("fast"):
            got = np.asarray(problem.fn(*case.args, **case.kwargs), np.float32)
        ref = np.asarray(case.reference, np.float32)
        assert np.max(np.abs(got - ref)) <= case.tol * np.max(np.abs(ref)), problem.name


@pytest.mark.parametrize("key", KERNELS)
def test_each_kernel_declares_its_demo_check(key):
    module = declaration(manifest.load_manifest().kernels[key], "demo_check")
    assert module is not None and callable(module.check)


def test_a_kernel_that_declares_no_bench_problems_is_refused_not_skipped(tmp_path):
    from doubles import make_kernel

    spec = manifest.load_kernel(make_kernel(tmp_path))
    with pytest.raises(manifest.ManifestError, match=r"bench_problems.py: missing; a kernel declares what"):
        bench_declaration(spec, None)
    (spec.path / "bench_problems.py").write_text('FAMILY = "matmul"\n')
    with pytest.raises(manifest.ManifestError, match=r"FAMILY must be one of \('moe', 'prefill', 'decode'\)"):
        bench_declaration(manifest.load_kernel(spec.path, key="other"), None)


def test_the_benchmarks_dequantization_is_the_checkpoints():
    """The quantized checks' reference decodes weights as checkpoints mean them: MXFP4 as transformers'
    own converter does; fp8 blocks and int8 channels on a hand-made case."""
    import torch
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, 6, 64 // 2), dtype=np.uint8)  # [E, out, in/2]
    scales = rng.integers(120, 131, (2, 6, 64 // 32), dtype=np.uint8)
    theirs = convert_moe_packed_tensors(torch.from_numpy(blocks.reshape(2, 6, 2, 16)), torch.from_numpy(scales),
                                        dtype=torch.float32).transpose(1, 2)  # theirs is [E, in, out]
    np.testing.assert_array_equal(np.asarray(problems.dequantize_weight("mxfp4", blocks, scales)), theirs.numpy())

    w = jnp.ones((1, 130, 260), jnp.float8_e4m3fn)  # blocks of 128 x 128, the last ones partial
    s = jnp.arange(1, 7, dtype=jnp.float32).reshape(1, 2, 3)
    got = np.asarray(problems.dequantize_weight("fp8", w, s))
    assert got[0, 127, 127] == 1 and got[0, 127, 128] == 2 and got[0, 128, 0] == 4 and got[0, 129, 259] == 6
    w8 = jnp.asarray([[[3, -2], [1, 127]]], jnp.int8)
    np.testing.assert_array_equal(problems.dequantize_weight("int8", w8, jnp.asarray([[0.5, 2.0]])),
                                  [[[1.5, -1.0], [2.0, 254.0]]])
