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


def _family_case(family):
    """The benchmark's own reduced case of the family's first problem (its calling convention, with an
    independent plain-JAX reference): what `pallas-hub bench` checks, here on every test run."""
    check = next(p for p in problems.problems(families=(family,)) if p.family == family).check()
    return check.args, check.kwargs, check.reference, check.tol


@pytest.mark.parametrize("key", KERNELS)
def test_each_kernel_declares_its_bench_problems_and_they_compute_the_right_thing(key, load_kernel):
    spec = manifest.load_manifest().kernels[key]
    kernel = load_kernel(key)
    raced, own = bench_declaration(spec, kernel)
    if raced is not None:
        family, impl = raced
        assert isinstance(impl, BenchImpl)
        args, kwargs, ref, tol = _family_case(family)
        if impl.prepare:
            args = impl.prepare(*args)
        with interpret("fast"), impl.context("v6e") if impl.context else contextlib.nullcontext():
            got = impl.fn(*args, chip="v6e", **kwargs)
        got = got[0] if isinstance(got, tuple) else got  # decode also returns the updated caches
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
        assert err < tol, (family, err)
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
