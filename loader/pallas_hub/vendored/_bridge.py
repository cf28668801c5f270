"""The torch <-> JAX bridge: one annotated JAX function becomes one ``torch.library`` custom op.

This file is the single source (``pallas_hub/vendored/``): ``pallas-hub build`` copies it, byte
for byte, into every kernel package as ``_bridge.py`` (a Hub kernel may only import the standard
library, torch and its own modules; jax is imported, not declared).

The op's schema comes from ``fn``'s annotations, on every host, and TorchTPU's ``jax_op`` rules
apply to ``fn``: every parameter annotated with ``jax.Array`` (or ``jax.Array | None``) or a POD
type (int, float, bool, str; non-array parameters are static), and a return annotation of
``jax.Array`` or a tuple of them. Two execution paths behind one op:

* tensors on the TorchTPU ``tpu`` device (a kernel for dispatch key PrivateUse1, registered where
  torch_tpu is installed): int64 arrays are cast to int32 on the device, then
  ``torch.tpu.pallas.jax_op(name + "_jax", fn)`` exports ``fn`` for TPU (traced under an abstract
  mesh of TorchTPU's chip, so Mosaic and the kernels' tiling see the real generation) and launches it.
* CPU tensors (every test here): zero-copy into JAX, ``fn`` jitted with its Pallas calls in TPU
  interpret mode, DLPack back. int64 arrays become int32 (JAX runs without x64); an output that
  aliases an input or another output is cloned, so torch may write to it in place.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import types
import typing
import warnings
from typing import Any, Callable, Sequence

import torch

SUPPORTED_DEVICES = ("cpu", "tpu")
_POD = (int, float, bool, str)


# --------------------------------------------------------------------------- signatures

def _param_kind(annotation: Any, name: str, fn_name: str) -> str:
    """'array', 'optional_array' or 'static' for one annotated parameter of a JAX function."""
    import jax

    if annotation is jax.Array:
        return "array"
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        (inner,) = [a for a in args if a is not type(None)]
        if inner is jax.Array:
            return "optional_array"
    if annotation in _POD:
        return "static"
    raise TypeError(
        f"{fn_name}: parameter {name!r} is annotated {annotation!r}; a bridged JAX function takes "
        f"only jax.Array, jax.Array | None, int, float, bool or str (TorchTPU's jax_op rules)"
    )


_TORCH_ANNOTATION = {"array": torch.Tensor, "optional_array": typing.Optional[torch.Tensor]}


def _is_array_result(annotation: Any) -> bool:
    import jax

    if annotation is jax.Array:
        return True
    args = typing.get_args(annotation)
    return typing.get_origin(annotation) is tuple and bool(args) and all(a is jax.Array for a in args)


@functools.lru_cache(maxsize=None)
def _signature(fn: Callable) -> tuple[inspect.Signature, dict[str, str]]:
    sig = inspect.signature(inspect.unwrap(fn), eval_str=True)
    kinds = {}
    for p in sig.parameters.values():
        if p.annotation is inspect.Parameter.empty:
            raise TypeError(f"{fn.__name__}: parameter {p.name!r} has no type annotation (jax_op needs them all)")
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{fn.__name__}: *args/**kwargs cannot be bridged ({p.name!r})")
        kinds[p.name] = _param_kind(p.annotation, p.name, fn.__name__)
    if not _is_array_result(sig.return_annotation):
        raise TypeError(f"{fn.__name__}: return annotation must be jax.Array or tuple[jax.Array, ...] "
                        f"(TorchTPU's jax_op refuses the function otherwise), got {sig.return_annotation!r}")
    return sig, kinds


def torch_signature(fn: Callable, returns: Any) -> inspect.Signature:
    """``fn``'s signature with jax.Array replaced by torch.Tensor: the custom op's schema source."""
    sig, kinds = _signature(fn)
    params = [p.replace(annotation=_TORCH_ANNOTATION.get(kinds[p.name], p.annotation)) for p in sig.parameters.values()]
    return sig.replace(parameters=params, return_annotation=returns)


# --------------------------------------------------------------------------- argument checks

def dtype_name(x: Any) -> str:
    """'bfloat16', 'float32', 'int32' ... for a torch tensor, a jax array or a ShapeDtypeStruct."""
    return str(x.dtype).removeprefix("torch.")


def _is_array(x: Any) -> bool:
    """A torch tensor, jax array (or tracer), numpy array or ShapeDtypeStruct: what a kernel takes.
    Array-like wrappers (a qwix QArray has .shape and .dtype) are not: they would fail deep inside
    pallas_call."""
    if isinstance(x, torch.Tensor):
        return True
    import jax
    import numpy as np

    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def check_array(name: str, x: Any, *, dtypes: Sequence[str] | None = None, ndim: int | None = None) -> None:
    """Raise a ValueError/TypeError that names ``name`` when ``x`` is not a plain array or has the
    wrong rank or dtype."""
    if not _is_array(x):
        kind = type(x).__name__
        if type(x).__module__ != "builtins":
            kind = f"{type(x).__module__.split('.')[0]} {kind}"  # e.g. "qwix QArray"
        quantized = " (quantized arrays are not supported yet: dequantize first)" if hasattr(x, "qvalue") else ""
        raise TypeError(f"{name} is a {kind}; this kernel takes a plain jax.Array or torch.Tensor{quantized}")
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(x.shape)}")
    if dtypes is not None and dtype_name(x) not in dtypes:
        allowed = " or ".join(dtypes) if len(dtypes) <= 2 else "one of " + ", ".join(dtypes)
        raise TypeError(f"{name} must have dtype {allowed}, got {dtype_name(x)}")


def host_values(x: Any):
    """``x``'s values as a numpy array when they are already on the host, else None.

    Host means a CPU torch tensor, a numpy array or a concrete JAX array on CPU. Never reads a
    device array (that would be a host sync on the hot path); tracers and fake/meta tensors have
    no values. Kernels check metadata values with this and clamp on device where it gives None.
    """
    import jax
    import numpy as np

    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            return None
        try:
            return x.detach().numpy()
        except (RuntimeError, TypeError):  # FakeTensor, functional tensors under torch.compile
            return None
    if isinstance(x, jax.core.Tracer):
        return None
    if isinstance(x, jax.Array):
        return np.asarray(x) if all(d.platform == "cpu" for d in x.devices()) else None
    return x if isinstance(x, np.ndarray) else None


def check_devices(tensors: dict[str, Any], *, allow_meta: bool = False) -> str:
    """The device type all ``tensors`` (name -> tensor or None) share; errors name the culprit."""
    device = None
    for name, value in tensors.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if value.device.type not in SUPPORTED_DEVICES and not (allow_meta and value.device.type == "meta"):
            raise ValueError(
                f"{name} is on device {value.device}; this kernel runs on 'tpu' (TorchTPU) "
                f"or 'cpu' (TPU interpret mode)"
            )
        if device is None:
            device = (name, value.device)
        elif value.device != device[1]:
            raise ValueError(f"{name} is on {value.device} but {device[0]} is on {device[1]}; all tensors must share a device")
    return device[1].type if device else "cpu"


# --------------------------------------------------------------------------- CPU path

def _interpret_mode():
    """Interpret every Pallas call on CPU, unless the caller already chose a mode.

    Tests select the strict TPU simulator with ``pltpu.force_tpu_interpret_mode(InterpretParams(...))``;
    that choice lives in JAX's config (shared by every vendored copy of this file) and wins.
    """
    from jax.experimental.pallas import tpu as pltpu

    return contextlib.nullcontext() if interpreting() else pltpu.force_tpu_interpret_mode(True)


def interpreting() -> bool:
    """Whether Pallas TPU calls traced now are interpreted (a mode chosen through JAX's config: tests, the
    CPU path), so a kernel wrapper can leave out what only the TPU compiler takes (memory-space types)."""
    try:
        from jax._src import config as jax_config

        return jax_config.pallas_tpu_interpret_mode_context_manager.value is not None
    except (ImportError, AttributeError):  # a JAX without that config: the CPU path forces the fast mode
        return False


def in_hbm(x):
    """``x`` kept in HBM for a Pallas call that DMAs only parts of it: XLA:TPU would otherwise copy an operand
    small enough to fit into VMEM before the call. Only traced values compiled for a TPU carry the constraint:
    the interpreter takes no memory-space types and an eager value has no such form."""
    import jax
    from jax.experimental.pallas import tpu as pltpu

    if interpreting() or not isinstance(x, jax.core.Tracer):
        return x
    return pltpu.with_memory_space_constraint(x, pltpu.HBM)


def _as_jax_dtype(t: torch.Tensor) -> torch.Tensor:
    """An int64 tensor as int32 on its own device: JAX runs without x64, so that is the dtype of the
    kernel's parameter (on TorchTPU, torch_tpu would hand the launch the int64 tensor unconverted).
    A device cast, no host sync; out-of-range values are refused on CPU only, where they are on the host."""
    return t.to(torch.int32) if t.dtype == torch.int64 else t


def to_jax(t: torch.Tensor, name: str = "a tensor"):
    """A CPU torch tensor (the argument ``name``, for errors) as something a jitted JAX function takes without
    copying it.

    That is a NumPy view of the tensor's memory (bfloat16 through ml_dtypes): JAX's CPU client
    wraps an aligned host buffer in place, and this path costs about half of a DLPack import plus
    the first use of the imported array (measured by pallas_hub.bench.bridge_overhead). Dtypes NumPy cannot
    view go through DLPack, which also shares memory.
    """
    import jax
    import jax.numpy as jnp

    if t.dtype == torch.int64 and t.numel():
        if t.max() > torch.iinfo(torch.int32).max or t.min() < torch.iinfo(torch.int32).min:
            raise ValueError(f"{name} has int64 values out of int32 range, which cannot be passed to a TPU kernel "
                             f"(shape {tuple(t.shape)}, values {int(t.min())} to {int(t.max())})")
    t = _as_jax_dtype(t)
    if t.numel() == 0:  # nothing to share
        return jnp.zeros(tuple(t.shape), dtype=jnp.dtype(dtype_name(t)))
    t = t.detach().contiguous()
    if t.dtype == torch.bfloat16:
        import ml_dtypes

        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    try:
        return t.numpy()
    except TypeError:  # float8 and other dtypes NumPy lacks
        return jax.dlpack.from_dlpack(t)


def to_torch(outputs, inputs: Sequence[torch.Tensor]):
    """JAX outputs back as torch tensors without copies, except where a copy keeps torch safe.

    JAX may forward an input buffer straight to an output (an op that returns an argument) or
    return one buffer twice; torch must never see an output that aliases an input or another
    output, so those (and only those) are cloned.
    """
    taken = {t.data_ptr() for t in inputs if t.numel()}
    result = []
    for out in outputs:
        t = torch.from_dlpack(out) if out.size else torch.empty(out.shape, dtype=getattr(torch, str(out.dtype)))
        if t.numel() and t.data_ptr() in taken:
            t = t.clone()
        taken.add(t.data_ptr())
        result.append(t)
    return result


# --------------------------------------------------------------------------- the op

def _tpu_jax_op():
    """TorchTPU's jax_op, or None on hosts without torch_tpu."""
    try:
        from torch.tpu.pallas import jax_op  # type: ignore[import-not-found]

        return jax_op
    except (ImportError, AttributeError):
        pass
    try:
        from torch_tpu._internal.pallas import jax_op  # type: ignore[import-not-found]

        return jax_op
    except ImportError:
        return None


def _validated(fn: Callable, validate: Callable) -> Callable:
    @functools.wraps(fn)  # keeps fn's annotated signature, which jax_op inspects
    def checked_fn(*args, **kwargs):
        validate(*args, **kwargs)
        return fn(*args, **kwargs)

    return checked_fn


def _on_torch_tpu_chip(fn: Callable) -> Callable:
    """``fn`` traced under an abstract mesh whose device is TorchTPU's chip, so Mosaic's lowering
    rules that ask for the generation and the kernels' tiling (``_chips.tpu_generation``) see the
    real chip and never JAX's runtime (which does not own the TPU on a TorchTPU host). torch_tpu's
    own scaled_mm kernels export the same way."""
    from ._chips import torch_tpu_device_kind, traced_device_kind

    @functools.wraps(fn)  # jax_op reads fn's annotations through __wrapped__
    def on_chip(*args, **kwargs):
        import jax

        kind = torch_tpu_device_kind()
        if kind is None or traced_device_kind() is not None:
            return fn(*args, **kwargs)
        mesh = jax.sharding.AbstractMesh((1,), ("_tpu",), abstract_device=jax.sharding.AbstractDevice(kind, 1, "tpu"))
        with jax.sharding.use_abstract_mesh(mesh):
            return fn(*args, **kwargs)

    return on_chip


def jax_op(
    qualname: str,
    fn: Callable,
    *,
    fake: Callable,
    returns: Any = torch.Tensor,
    validate: Callable | None = None,
):
    """Register ``fn`` (an annotated JAX function) as the torch custom op ``qualname``.

    ``fake`` computes output metadata in pure torch (for torch.compile, FakeTensor, meta);
    ``validate`` takes the op's arguments and raises ValueError/TypeError naming the bad one,
    before anything is traced (it also runs under FakeTensor, so compile-time errors are clear).
    ``returns`` is the torch return annotation (``torch.Tensor`` or a tuple of them).
    Autograd: ``op.register_autograd(backward, setup_context=...)`` on the returned op.
    ``op.tpu_op`` (where torch_tpu is installed) is the TorchTPU op behind the `tpu` kernel.
    """
    import jax

    identity = _op_identity(returns, fn, fake, validate)
    registered = _registered_op(qualname)
    if identity is not None and getattr(registered, "_bridge_identity", None) == identity:
        return registered
    sig, kinds = _signature(fn)
    static = tuple(n for n, k in kinds.items() if k == "static")
    if validate is not None:  # JAX callers (and the TPU path) get the same checks at trace time
        fn = _validated(fn, validate)
    jitted = jax.jit(fn, static_argnames=static)
    tensor_sig = torch_signature(fn, returns)
    multi = typing.get_origin(returns) in (tuple, typing.Tuple)

    def checked(args, kwargs, allow_meta=False) -> inspect.BoundArguments:
        bound = tensor_sig.bind(*args, **kwargs)
        bound.apply_defaults()
        check_devices({n: v for n, v in bound.arguments.items() if kinds[n] != "static"}, allow_meta=allow_meta)
        if validate is not None:
            validate(*bound.args, **bound.kwargs)
        return bound

    def cpu_impl(*args, **kwargs):
        bound = checked(args, kwargs)
        jargs, tensors = {}, []
        for name, value in bound.arguments.items():
            if kinds[name] != "static" and value is not None:
                tensors.append(value)
                value = to_jax(value, name)
            jargs[name] = value
        with _interpret_mode():
            out = jitted(**jargs)
        outs = to_torch(out if multi else (out,), tensors)
        return tuple(outs) if multi else outs[0]

    def fake_impl(*args, **kwargs):
        bound = checked(args, kwargs, allow_meta=True)
        return fake(*bound.args, **bound.kwargs)

    cpu_impl.__signature__ = tensor_sig
    fake_impl.__signature__ = tensor_sig
    schema = torch.library.infer_schema(cpu_impl, mutates_args=())
    op = torch.library.custom_op(qualname, cpu_impl, mutates_args=(), schema=schema)
    op.register_fake(fake_impl)

    tpu_jax_op = _tpu_jax_op()
    if tpu_jax_op is not None:  # torch_tpu installed: `tpu` tensors run the kernel exported for TPU
        with warnings.catch_warnings():  # torch_tpu 0.2.0 marks jax_op experimental, once per op
            warnings.filterwarnings("ignore", message=r".*jax_op is experimental")
            launch = tpu_jax_op(qualname + "_jax", _on_torch_tpu_chip(fn))

        def tpu_impl(*args, **kwargs):
            bound = checked(args, kwargs)
            return launch(**{n: v if kinds[n] == "static" or v is None else _as_jax_dtype(v)
                             for n, v in bound.arguments.items()})

        tpu_impl.__signature__ = tensor_sig
        op.register_kernel("privateuseone")(tpu_impl)  # PrivateUse1: the `tpu` device once torch_tpu brings it up
        op.tpu_op = launch  # torch_tpu's op (its own fake exports fn for TPU); tests check what it launches
    op.jax_fn = fn  # the JAX function, for benchmarks and AOT compilation
    op._bridge_identity = identity
    return op


def _op_identity(returns: Any, *functions: Callable | None) -> tuple | None:
    """What makes two ``jax_op`` calls the same op: the same return annotation and the same code
    (module, name, bytecode, constants) for fn, fake and validate; None (never the same) when one of
    them is not a plain function (a partial, a closure: its captured values could differ)."""
    key = [returns]
    for f in functions:
        code = getattr(f, "__code__", None)
        if f is not None and (code is None or getattr(f, "__closure__", None)):
            return None
        key.append(None if f is None else (f.__module__, f.__qualname__, code.co_code, code.co_consts))
    return tuple(key)


def _registered_op(qualname: str):
    """The live custom op already registered as ``qualname``, if any.

    The same kernel build imported twice in one process (a local build and its Hub download, two
    cache folders) defines the same ops: the namespace is the build's content digest. Registering a
    name again makes torch destroy the first registration, and the op objects the first module
    already handed out keep a dangling dispatcher handle: calling them fails with an internal assert
    ("no schema registered") or crashes. So the second import gets the first's op, when the code is
    the same (``_op_identity``)."""
    from torch._library import custom_ops

    return custom_ops.OPDEFS.get(qualname)


# --------------------------------------------------------------------------- benchmarks

def synchronize(*values: Any) -> None:
    """Wait until the device work producing ``values`` (tensors, JAX arrays, tuples of them) is done.

    ``kernels benchmark`` synchronises only CUDA/XPU/MPS, so on TorchTPU it would time dispatch;
    kernel benchmarks call this after each run, as
    ``importlib.import_module(self.kernel.__name__ + "._bridge").synchronize(self.out)``.
    JAX arrays are waited on directly; torch tensors on an accelerator through
    ``torch.accelerator.synchronize`` (or ``torch.<device>.synchronize``), else by copying one
    element to the host, which waits for its producer. CPU tensors are already done.
    """
    flat: list[Any] = []
    stack = list(values)
    while stack:
        v = stack.pop()
        if isinstance(v, (tuple, list)):
            stack.extend(v)
        elif v is not None:
            flat.append(v)
    synced = set()
    for v in flat:
        if hasattr(v, "block_until_ready"):
            v.block_until_ready()
            continue
        device = getattr(v, "device", None)
        kind = getattr(device, "type", "cpu")
        if kind in ("cpu", "meta") or str(device) in synced:
            continue
        synced.add(str(device))
        accelerator = getattr(torch, "accelerator", None)
        try:
            accelerator.synchronize(device)
            continue
        except Exception:  # no torch.accelerator, or the backend does not implement it
            pass
        backend = getattr(torch, kind, None)
        if backend is not None and hasattr(backend, "synchronize"):
            backend.synchronize()
        else:
            v.reshape(-1)[:1].to("cpu")
