"""Every manifest kernel declares what `pallas-hub bench` runs (bench_problems.py) and what `pallas-hub demo`
checks (demo_check.py); nothing is keyed on kernel names. A declared family adapter is run here on a small
case in the family's calling convention (the one the benchmark's anchors take) against plain JAX, and a
kernel's own problems run their checks, so a declaration that would bench the wrong thing fails here."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_hub.hub import manifest
from pallas_hub.hub.declarations import BenchImpl, bench_declaration, declaration
from pallas_hub.vendored._attention_math import reference_attention
from pallas_hub.verify import interpret

KERNELS = sorted(manifest.load_manifest().kernels)


def _family_case(family):
    """(args, kwargs, reference) of a small problem in the family's calling convention."""
    rng = np.random.default_rng(0)
    if family == "moe":
        sizes = np.array([5, 0, 19, 8], np.int32)
        lhs = jnp.asarray(rng.standard_normal((32, 256)), jnp.float32)
        rhs = jnp.asarray(rng.standard_normal((4, 256, 128)) / 16, jnp.float32)
        ref = jax.lax.ragged_dot(lhs, rhs, jnp.asarray(sizes), precision="highest")
        return (lhs, rhs, jnp.asarray(sizes)), {}, ref
    if family == "prefill":
        q, k, v = (jnp.asarray(rng.standard_normal((1, h, 200, 128)), jnp.float32) for h in (4, 1, 1))
        return (q, k, v), {"scale": 128 ** -0.5}, reference_attention(q, k, v, scale=128 ** -0.5)
    assert family == "decode"
    lengths = np.array([37, 130, 16], np.int32)
    table = rng.permutation(27).astype(np.int32).reshape(3, 9)
    q = jnp.asarray(rng.standard_normal((3, 4, 128)), jnp.float32)
    kp, vp = (jnp.asarray(rng.standard_normal((1, 27, 16, 128)), jnp.float32) for _ in range(2))
    dense = lambda p: jnp.moveaxis(p[:, jnp.asarray(table)].reshape(1, 3, -1, 128), 0, 1)  # noqa: E731
    ref = reference_attention(q[:, :, None], dense(kp), dense(vp), scale=128 ** -0.5, kv_lens=lengths)[:, :, 0]
    return (q, kp, vp, jnp.asarray(lengths), jnp.asarray(table)), {"scale": 128 ** -0.5}, ref


@pytest.mark.parametrize("key", KERNELS)
def test_each_kernel_declares_its_bench_problems_and_they_compute_the_right_thing(key, load_kernel):
    spec = manifest.load_manifest().kernels[key]
    kernel = load_kernel(key)
    raced, own = bench_declaration(spec, kernel)
    if raced is not None:
        family, impl = raced
        assert isinstance(impl, BenchImpl)
        args, kwargs, ref = _family_case(family)
        if impl.prepare:
            args = impl.prepare(*args)
        with interpret("fast"):
            got = impl.fn(*args, **kwargs, **({"chip": "v6e"} if impl.per_chip else {}))
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref)))
        assert err < 1e-4, (family, err)
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
