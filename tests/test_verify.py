"""The verification harness on the fixture kernel: fast and strict interpret tiers, and the compile tier."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.experimental import pallas as pl

from pallas_hub import cli
from pallas_hub.hub import manifest
from pallas_hub.verify import matrix
from pallas_hub.verify import compile_for_tpu, interpret, pallas_calls, tpu_devices

FIXTURE = "tests/fixtures/scale_add"
SHAPES = [(7, 128), (1000, 256), (4100, 1024)]  # tiny, not a multiple of the block, a ragged edge block


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_fast_interpret_matches_reference(load_kernel, shape, dtype):
    k = load_kernel(FIXTURE)
    kx, ky = jax.random.split(jax.random.key(0))
    x, y = jax.random.normal(kx, shape, dtype), jax.random.normal(ky, shape, dtype)
    with interpret("fast"):
        out = k.pallas.scale_add(x, y, alpha=-1.25, block_rows=512)
    tol = 1e-6 if dtype == jnp.float32 else 8e-3  # f32: fused multiply-add rounding; bf16: one ulp
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(k.pallas.reference(x, y, -1.25), np.float32),
                               rtol=tol, atol=tol)


@pytest.mark.strict_interpret
def test_strict_interpret_matches_reference_through_torch(load_kernel):
    k = load_kernel(FIXTURE)
    x, y = torch.randn(300, 128), torch.randn(300, 128)  # 3 blocks of 128 rows, the last one ragged
    with interpret("strict"):
        out = k.scale_add(x, y, 0.5, 128)
    torch.testing.assert_close(out, 0.5 * x + y)


def _copy_kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...]


@pytest.mark.strict_interpret
def test_strict_interpret_catches_out_of_bounds_reads():
    x = jnp.ones((64, 128), jnp.float32)
    bad = lambda a: pl.pallas_call(  # noqa: E731  block index i + 8 walks off the end of x
        _copy_kernel, out_shape=jax.ShapeDtypeStruct((16, 128), jnp.float32), grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i + 8, 0))], out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(a)
    with interpret("fast"):  # the fast interpreter does not notice
        jax.block_until_ready(bad(x))
    with pytest.raises(Exception, match="(?i)out.of.bounds"):
        with interpret("strict"):
            jax.block_until_ready(bad(x))


def _half_kernel(x_ref, o_ref):
    o_ref[:4, :] = x_ref[:4, :]  # rows 4..7 of each block are never written


@pytest.mark.strict_interpret
def test_strict_interpret_shows_unwritten_output_as_nan():
    x = jnp.ones((16, 128), jnp.float32)
    f = lambda a: pl.pallas_call(  # noqa: E731
        _half_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(2,),
        in_specs=[pl.BlockSpec((8, 128), lambda i: (i, 0))], out_specs=pl.BlockSpec((8, 128), lambda i: (i, 0)))(a)
    with interpret("strict"):
        out = np.asarray(f(x))
    assert np.all(out[:4] == 1) and np.all(np.isnan(out[4:8]))


@pytest.mark.tpu_compile
def test_fixture_matrix_compiles_as_declared(load_kernel):
    k = load_kernel(FIXTURE)
    configs = matrix.load_configs(manifest.ROOT / FIXTURE / "compile_matrix.py", k)
    rows = matrix.run("scale-add-tpu", configs, progress=None)
    assert {r.result.chip for r in rows} == {"v5e", "v6e", "tpu7x"}
    assert all(r.as_expected for r in rows), [r.line() for r in rows if not r.as_expected]
    overflow = [r for r in rows if r.config.fails_with]
    assert overflow and all("RESOURCE_EXHAUSTED" in r.result.error for r in overflow)
    ok = [r for r in rows if r.result.ok]
    assert ok and all(r.result.hbm["argument"] > 0 and 0 < r.result.vmem_bytes < r.result.vmem_capacity for r in ok)


@pytest.mark.tpu_compile
def test_check_exits_non_zero_when_a_supported_configuration_fails(load_kernel, capsys):
    k = load_kernel(FIXTURE)
    f = k.pallas.scale_add
    big = (jax.ShapeDtypeStruct((65536, 1024), jnp.float32),) * 2
    rows = matrix.run("scale-add-tpu", [matrix.Config("overflow declared supported", f, big, dict(block_rows=65536), chips=("v6e",))],
                      progress=None)
    assert matrix.report(rows) == 1
    assert "NOT AS DECLARED" in capsys.readouterr().out
    assert cli.main(["check", "--path", str(manifest.ROOT / FIXTURE), "--chips", "v6e"]) == 0


@pytest.mark.tpu_compile
def test_eight_chip_topology_and_sharded_compile():
    assert len(tpu_devices("v6e:2x4")) == 8
    from pallas_hub.verify import tpu_mesh

    mesh = tpu_mesh(("x",), (8,), "v6e:2x4")
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    spec = jax.ShapeDtypeStruct((64, 128), jnp.float32, sharding=sharding)
    result = compile_for_tpu(lambda a: a * 2, spec, topology="v6e:2x4")
    assert result.ok, result.error


def test_pallas_calls_reports_grid_and_blocks(load_kernel):
    k = load_kernel(FIXTURE)
    spec = jax.ShapeDtypeStruct((1000, 256), jnp.bfloat16)
    (call,) = pallas_calls(k.pallas.scale_add, spec, spec, alpha=1.0, block_rows=128)
    assert call.grid == (8,) and call.name == "scale_add"
    assert [b.block_shape for b in call.inputs + call.outputs] == [(128, 256)] * 3
    assert call.vmem_bytes == 3 * 2 * 128 * 256 * 2
