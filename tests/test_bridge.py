"""The torch <-> JAX bridge (pallas_hub/vendored/_bridge.py, vendored into every kernel as _bridge.py)."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from pallas_hub.vendored import _bridge as bridge

FIXTURE = "tests/fixtures/scale_add"


# --------------------------------------------------------------------------- zero-copy DLPack

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dlpack_is_zero_copy_both_ways(dtype):
    t = torch.randn(64, 128).to(dtype)
    a = jax.device_put(bridge.to_jax(t))  # what jit does with the argument
    assert a.unsafe_buffer_pointer() == t.data_ptr()  # torch -> jax shares memory
    out = jnp.asarray(a) * 2
    (back,) = bridge.to_torch([out], [t])
    assert back.data_ptr() == out.unsafe_buffer_pointer()  # jax -> torch shares memory
    torch.testing.assert_close(back, t * 2)


def test_int64_becomes_int32_and_out_of_range_is_refused():
    a = jnp.asarray(bridge.to_jax(torch.tensor([0, 5, 2**31 - 1], dtype=torch.int64)))
    assert a.dtype == jnp.int32 and a.tolist() == [0, 5, 2**31 - 1]
    with pytest.raises(ValueError, match="int32 range"):
        bridge.to_jax(torch.tensor([2**31], dtype=torch.int64))
    with pytest.raises(ValueError, match=r"page_indices has int64 values out of int32 range.*values 0 to 1099511627776"):
        bridge.to_jax(torch.tensor([0, 2**40], dtype=torch.int64), "page_indices")  # the op's argument, named


def test_empty_tensors_cross_the_bridge():
    a = bridge.to_jax(torch.empty(0, 128))
    assert a.shape == (0, 128)
    (t,) = bridge.to_torch([jnp.zeros((0, 3))], [])
    assert t.shape == (0, 3)


# --------------------------------------------------------------------------- ops built with the bridge

def _gather_rows(x: jax.Array, idx: jax.Array) -> jax.Array:
    return x[idx]


def _passthrough(x: jax.Array, y: jax.Array) -> tuple[jax.Array, jax.Array]:
    return x, x  # JAX forwards the input buffer: torch must get two fresh, independent tensors


def _gather_rows_fake(x, idx):
    return x.new_empty((idx.shape[0], x.shape[1]))


gather_rows = bridge.jax_op("pallas_hub_test::gather_rows", _gather_rows, fake=_gather_rows_fake)
passthrough = bridge.jax_op(
    "pallas_hub_test::passthrough", _passthrough, returns=tuple[torch.Tensor, torch.Tensor],
    fake=lambda x, y: (torch.empty_like(x), torch.empty_like(x)),
)


def test_int64_indices_and_non_contiguous_inputs():
    x = torch.randn(16, 8).t()  # non-contiguous (8, 16)
    idx = torch.tensor([7, 0, 3, 3], dtype=torch.int64)
    torch.testing.assert_close(gather_rows(x, idx), x[idx])


def test_outputs_never_alias_inputs_or_each_other():
    x, y = torch.randn(4, 128), torch.randn(4, 128)
    keep = x.clone()
    a, b = passthrough(x, y)
    assert len({a.data_ptr(), b.data_ptr(), x.data_ptr()}) == 3
    a.add_(1.0)
    b.mul_(0.0)
    torch.testing.assert_close(x, keep)  # in-place writes to outputs leave the input intact
    torch.testing.assert_close(a, keep + 1.0)


def test_registering_the_same_code_again_returns_the_registered_op():
    assert bridge.jax_op("pallas_hub_test::gather_rows", _gather_rows, fake=_gather_rows_fake) is gather_rows

    def _first_row(x: jax.Array) -> jax.Array:
        return x[:1]

    def _last_row(x: jax.Array) -> jax.Array:
        return x[-1:]

    first = bridge.jax_op("pallas_hub_test::edge_row", _first_row, fake=lambda x: x[:1].clone())
    other = bridge.jax_op("pallas_hub_test::edge_row", _last_row, fake=lambda x: x[:1].clone())
    assert other is not first  # different code under one name: the new definition wins, as in torch
    x = torch.arange(6.0).reshape(3, 2)
    torch.testing.assert_close(other(x), x[-1:])


def test_unannotated_or_unsupported_parameters_are_refused():
    def no_annotation(x):
        return x

    def bad_annotation(x: jax.Array, shape: tuple) -> jax.Array:
        return x

    def no_return_annotation(x: jax.Array):  # TorchTPU's jax_op refuses it: flash-attention once did not import
        return x

    with pytest.raises(TypeError, match="'x' has no type annotation"):
        bridge.jax_op("pallas_hub_test::bad1", no_annotation, fake=lambda x: x)
    with pytest.raises(TypeError, match="'shape' is annotated"):
        bridge.jax_op("pallas_hub_test::bad2", bad_annotation, fake=lambda x, shape: x)
    with pytest.raises(TypeError, match="no_return_annotation: return annotation must be jax.Array"):
        bridge.jax_op("pallas_hub_test::bad3", no_return_annotation, fake=lambda x: x)


def test_devices_are_checked_by_name():
    cpu, meta = torch.zeros(2), torch.zeros(2, device="meta")
    assert bridge.check_devices({"x": cpu, "bias": None}) == "cpu"
    with pytest.raises(ValueError, match="x is on device meta"):
        bridge.check_devices({"x": meta})
    with pytest.raises(ValueError, match="y is on meta but x is on cpu"):
        bridge.check_devices({"x": cpu, "y": meta}, allow_meta=True)
    with pytest.raises(TypeError, match="y must be a torch.Tensor"):
        bridge.check_devices({"x": cpu, "y": [1.0]})


class _ArrayLike:
    """Something with .shape and .dtype that is no array (as a qwix QArray, which also has .qvalue)."""

    shape, dtype = (2, 3), jnp.float32

    def __init__(self, quantized):
        if quantized:
            self.qvalue = jnp.zeros(self.shape, jnp.int8)


def test_check_array_takes_arrays_and_refuses_array_likes_by_name():
    for x in (torch.zeros(2, 3), jnp.zeros((2, 3)), np.zeros((2, 3), np.float32), jax.ShapeDtypeStruct((2, 3), jnp.float32)):
        bridge.check_array("x", x, dtypes=("float32",), ndim=2)
    jax.jit(lambda a: bridge.check_array("x", a, dtypes=("float32",), ndim=2))(jnp.zeros((2, 3)))  # tracers too
    with pytest.raises(TypeError, match=r"w is a test_bridge _ArrayLike; this kernel takes a plain jax.Array or "
                                        r"torch.Tensor \(quantized arrays are not supported yet"):
        bridge.check_array("w", _ArrayLike(quantized=True))
    with pytest.raises(TypeError, match=r"w is a test_bridge _ArrayLike; this kernel takes a plain jax.Array or torch.Tensor$"):
        bridge.check_array("w", _ArrayLike(quantized=False))
    with pytest.raises(TypeError, match=r"w is a list;"):
        bridge.check_array("w", [1.0, 2.0])


def test_host_values_reads_only_what_is_already_on_the_host():
    np.testing.assert_array_equal(bridge.host_values(torch.tensor([1, 2], dtype=torch.uint32)), [1, 2])
    np.testing.assert_array_equal(bridge.host_values(jnp.array([3, 4])), [3, 4])
    np.testing.assert_array_equal(bridge.host_values(np.array([5])), [5])
    assert bridge.host_values(torch.zeros(2, device="meta")) is None
    with torch._subclasses.fake_tensor.FakeTensorMode():
        assert bridge.host_values(torch.zeros(2)) is None  # torch.compile / FakeTensor: no data
    seen = []
    jax.jit(lambda a: seen.append(bridge.host_values(a)))(jnp.zeros(2))
    assert seen == [None]  # a tracer: the values exist only on device


def test_with_torch_tpu_installed_the_op_fronts_torch_tpus_real_jax_op():
    """torch_tpu (installed here, no TPU) registers the TorchTPU op; ours keeps its schema and CPU path
    and sends `tpu` tensors to it (what it launches is checked by tests/torchtpu)."""
    pytest.importorskip("torch_tpu")
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch_tpu._internal.pallas.pallas import JaxCallable

    tpu_op = gather_rows.tpu_op
    assert tpu_op._qualname == "pallas_hub_test::gather_rows_jax" and isinstance(tpu_op._init_fn, JaxCallable)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("pallas_hub_test::gather_rows", "PrivateUse1")
    ours, theirs = gather_rows._opoverload._schema, tpu_op._opoverload._schema
    assert [(a.name, str(a.type)) for a in ours.arguments] == [(a.name, str(a.type)) for a in theirs.arguments]
    x, idx = torch.randn(5, 4), torch.tensor([4, 1])
    torch.testing.assert_close(gather_rows(x, idx), x[idx])  # CPU: interpret path, not TorchTPU's
    with FakeTensorMode():  # torch_tpu's own fake exports the JAX function for TPU; ours is pure torch
        fx, fidx = torch.empty(5, 4), torch.empty(2, dtype=torch.int32)
        a, b = gather_rows(fx, fidx), tpu_op(fx, fidx)
    assert (a.shape, a.dtype) == (b.shape, b.dtype) == ((2, 4), torch.float32)


# --------------------------------------------------------------------------- the bridge inside a built kernel

def test_kernel_package_ships_its_own_bridge_and_unique_namespace(load_kernel):
    k = load_kernel(FIXTURE)
    # submodules by name, not as k._bridge: a package loaded again while they are still in sys.modules (an
    # earlier test's load of the same build) does not get them back as attributes
    own, ops = (importlib.import_module(f"{k.__name__}.{m}") for m in ("_bridge", "_ops"))
    assert own.__file__ != bridge.__file__
    assert open(own.__file__).read() == open(bridge.__file__).read()  # vendored from the single source
    assert ops._OPS_NAME.startswith("_scale_add_tpu_cpu_")
    assert k.scale_add._qualname == f"{ops._OPS_NAME}::scale_add"


def test_opcheck_and_autograd(load_kernel):
    k = load_kernel(FIXTURE)
    x = torch.randn(37, 128, requires_grad=True)
    y = torch.randn(37, 128, requires_grad=True)
    torch.library.opcheck(k.scale_add, (x, y, 1.5, 16))
    out = k.scale_add(x, y, 1.5, 16)
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 1.5))
    torch.testing.assert_close(y.grad, torch.ones_like(y))


def test_torch_compile_fullgraph(load_kernel):
    k = load_kernel(FIXTURE)
    x, y = torch.randn(40, 256), torch.randn(40, 256)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(a, b):
        return torch.relu(k.scale_add(a, b, 2.0, 8)) + 1

    torch.testing.assert_close(f(x, y), torch.relu(2.0 * x + y) + 1)


def test_bad_input_names_the_argument(load_kernel):
    k = load_kernel(FIXTURE)
    x = torch.randn(8, 128)
    with pytest.raises(TypeError, match="x must have dtype float32 or bfloat16, got int32"):
        k.scale_add(x.int(), x)
    with pytest.raises(ValueError, match=r"same shape, got \(8, 128\) and \(4, 128\)"):
        k.scale_add(x, x[:4])
    with pytest.raises(TypeError, match="same dtype"):
        k.scale_add(x, x.bfloat16())
    with pytest.raises(ValueError, match="block_rows must be a positive multiple of 8"):
        k.scale_add(x, x, 1.0, 12)
    with pytest.raises(ValueError, match="y is on meta but x is on cpu"):
        k.scale_add(x, x.to("meta"))
