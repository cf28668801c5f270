"""TorchTPU's ``tpu`` device without a TPU: a kernel's whole torch surface run with every tensor on ``tpu``.

What is real here (torch_tpu 0.2.0 and libtpu, no chip): the ``tpu`` device as torch_tpu's
autoload brings it up on a TPU host (``bring_up``), torch_tpu's ``jax_op`` (it exports the JAX
function for TPU, Mosaic lowering included, fingerprints and registers the module) and its fake
kernels. What is stood in for is only the launch (``tpu_torch_pallas.call_custom_kernel``, which
needs a chip): ``LaunchChecker`` compares every tensor handed to it with the parameters of the
StableHLO module that was registered for it, and returns output placeholders.

``tpu_kernels(ops, checker)`` runs inside a ``FakeTensorMode``: each bridge op runs its ``tpu``
kernel (what the dispatcher picks for a ``tpu`` tensor) instead of its pure-torch fake, so the
wrappers' torch code, the bridge's casts and torch_tpu's path all run on fake ``tpu`` tensors.
Without a checker torch_tpu's own fakes compute the outputs (each exports the kernel for TPU);
with one, torch_tpu's eager path runs up to the launch, which the checker takes.

Safety: reading a ``tpu`` tensor's data starts libtpu's PJRT client, which queries the cloud
metadata server unless TPU_SKIP_MDS_QUERY=1 (set here and by ``pallas_hub.verify``) and, without a
chip, aborts the process. So inputs come only from ``torch.empty(..., device="tpu")`` or a
FakeTensorMode, no torch op ever runs on a real ``tpu`` tensor, and ``repr`` of one does not read
it (``guard_repr``). ``bring_up`` changes process-global torch state (torch.compile's default
backend, float32 matmul precision getters, ``torch.accelerator``): use it in a process of its own
(``tests/torchtpu`` runs each module in one).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # an accidental PJRT start fails fast, without network

import torch  # noqa: E402


def available() -> bool:
    """torch_tpu is installed (the tier needs nothing else: no TPU)."""
    import importlib.util

    return importlib.util.find_spec("torch_tpu") is not None


def guard_repr() -> None:
    """repr() of a real ``tpu`` tensor reads its data (PJRT start: abort); pytest's reports, assertion
    messages and FakeTensorMode's errors all repr their arguments. Describe those tensors instead."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.Tensor.__repr__
    if getattr(original, "_tpu_guard", False):
        return

    def __repr__(self, *args, **kwargs):
        if self.device.type == "tpu" and type(self) is torch.Tensor and not isinstance(self, FakeTensor):
            return f"tensor(<tpu, not read>, size={tuple(self.shape)}, dtype={self.dtype})"
        return original(self, *args, **kwargs)

    __repr__._tpu_guard = True
    torch.Tensor.__repr__ = __repr__


def bring_up() -> torch.device:
    """The ``tpu`` device as autoload brings it up on a TPU host (``_init_device("tpu")``), no PJRT client.

    On a host without a chip autoload skips this (its PCI scan finds none); torch.accelerator then
    reports ``tpu`` while ``is_available()`` stays False. Idempotent.
    """
    import torch_tpu._loader

    guard_repr()
    torch_tpu._loader._init_device("tpu")
    return torch.device("tpu")


@contextlib.contextmanager
def fake_chip(name: str):
    """TorchTPU reports chip ``name`` ("TPU v5e", "TPU v6e", "TPU v7" ...): torch.tpu.get_device_name
    reads utils/hardware.py's PCI scan, replaced here. JAX's trace cache does not key on the chip,
    so it is cleared on the way in and out."""
    import jax
    from torch_tpu._internal.utils import hardware

    saved = hardware.get_tpu_device_name
    hardware.get_tpu_device_name = lambda: name
    jax.clear_caches()
    try:
        yield name
    finally:
        hardware.get_tpu_device_name = saved
        jax.clear_caches()


# --------------------------------------------------------------------------- the launch checker

_MLIR_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64,
                "i1": torch.bool, "i8": torch.int8, "i16": torch.int16, "i32": torch.int32, "i64": torch.int64,
                "ui8": torch.uint8, "ui32": torch.uint32, "f8E4M3FN": torch.float8_e4m3fn,
                "f8E5M2": torch.float8_e5m2}
_TENSOR_TYPE = re.compile(r"tensor<([^>]*)>(\s*\{[^}]*\})?")


@dataclasses.dataclass
class Param:
    """One parameter or result of the registered module's ``@main``: shape, dtype and attributes
    (``{tf.aliasing_output = 0 : i32}`` marks a donated input whose buffer an output reuses)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | str
    attrs: str


@dataclasses.dataclass
class Launch:
    name: str
    params: list[Param]
    results: list[Param]
    inputs: list[tuple[tuple[int, ...], torch.dtype, str]]  # (shape, dtype, device type) of each tensor passed
    donate_argnums: list[int]
    module: str  # the StableHLO text torch_tpu registered


class LaunchMismatch(AssertionError):
    """A launch was handed tensors that differ from the exported kernel's parameters."""


def module_text(serialized: bytes) -> str:
    """StableHLO text of a module as JaxCallable registers it (``Exported.mlir_module_serialized``)."""
    from jax._src.interpreters import mlir
    from jax._src.lib import _jax

    with mlir.make_ir_context():
        return str(_jax.mlir.deserialize_portable_artifact(serialized))


def _types(text: str) -> list[Param]:
    params = []
    for m in _TENSOR_TYPE.finditer(text):
        *dims, dtype = m.group(1).split("x")
        params.append(Param(tuple(int(d) for d in dims), _MLIR_DTYPES.get(dtype, dtype), (m.group(2) or "").strip()))
    return params


def main_signature(text: str) -> tuple[list[Param], list[Param]]:
    """(parameters, results) of ``func.func public @main`` in a module's text."""
    m = re.search(r"func\.func public @main\((.*?)\) -> \((.*?)\)\s*(?:attributes|\{)", text, re.S) or \
        re.search(r"func\.func public @main\((.*?)\) -> (tensor<[^>]*>(?:\s*\{[^}]*\})?)", text, re.S)
    if m is None:
        raise ValueError("no `func.func public @main` in the registered module")
    return _types(m.group(1)), _types(m.group(2))


class LaunchChecker:
    """Stands in for torch_tpu's launcher (module attribute ``tpu_torch_pallas`` of its pallas.py).

    ``register_custom_kernel`` keeps each module by (name, fingerprint): the exact bytes torch_tpu
    hands to its C++ side. ``call_custom_kernel`` records a ``Launch`` and raises ``LaunchMismatch``
    unless every tensor is on ``tpu`` and equals the module's parameter in dtype and shape (and the
    output placeholders its results); it returns fresh output placeholders (no data).
    """

    def __init__(self):
        self.modules: dict[tuple[str, str], str] = {}
        self.launches: list[Launch] = []

    def register_custom_kernel(self, name, fingerprint, *, serialized_mlir_module):
        self.modules[(name, fingerprint)] = module_text(serialized_mlir_module)

    def lookup_custom_kernel(self, name, fingerprint):
        return (name, fingerprint) in self.modules

    def call_custom_kernel(self, name, fingerprint, *, inputs, output_shapes, donate_argnums=(), device_assignment=()):
        text = self.modules[(name, fingerprint)]
        params, results = main_signature(text)
        self.launches.append(Launch(name, params, results, [(tuple(t.shape), t.dtype, t.device.type) for t in inputs],
                                    list(donate_argnums), text))
        problems = []
        if len(inputs) != len(params):
            problems.append(f"{len(inputs)} tensors passed to a kernel with {len(params)} parameters")
        for i, (t, p) in enumerate(zip(inputs, params)):
            if t.device.type != "tpu":
                problems.append(f"input {i} is on {t.device}, not tpu")
            if (t.dtype, tuple(t.shape)) != (p.dtype, p.shape):
                problems.append(f"input {i}: passed {t.dtype} {tuple(t.shape)}, kernel parameter is {p.dtype} {p.shape}")
        for i, (o, r) in enumerate(zip(output_shapes, results)):
            if (o.dtype, tuple(o.shape)) != (r.dtype, r.shape):
                problems.append(f"output {i}: placeholder {o.dtype} {tuple(o.shape)}, kernel result is {r.dtype} {r.shape}")
        if problems:
            raise LaunchMismatch(f"{name}: " + "; ".join(problems))
        # fresh placeholders: JaxCallable caches its own per kernel key, possibly from another mode
        return [torch.empty(tuple(o.shape), dtype=o.dtype, device=o.device) for o in output_shapes]

    @contextlib.contextmanager
    def installed(self):
        from torch_tpu._internal.pallas import pallas as tpu_pallas

        saved = tpu_pallas.tpu_torch_pallas
        tpu_pallas.tpu_torch_pallas = self
        try:
            yield self
        finally:
            tpu_pallas.tpu_torch_pallas = saved


# --------------------------------------------------------------------------- running ops on `tpu`

def kernel_ops(package) -> list:
    """The torch custom ops defined in a kernel package's modules (the bridge's, with ``tpu_op``)."""
    from torch._library.custom_ops import CustomOpDef

    found = {}
    for name, module in list(sys.modules.items()):
        if module is not None and (name == package.__name__ or name.startswith(package.__name__ + ".")):
            for value in vars(module).values():
                if isinstance(value, CustomOpDef):
                    found[value._qualname] = value
    return list(found.values())


@contextlib.contextmanager
def no_cpu_tensors():
    """Fail on any torch op that makes a CPU tensor: glue meant for `tpu` tensors must create its own
    on their device (``torch.arange(n)`` without ``device=`` is a CPU tensor, and a copy to the device
    or an error when mixed with device tensors)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class NoCpuTensors(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                    raise AssertionError(f"{func} made a {t.dtype} tensor {tuple(t.shape)} on cpu")
            return out

    with NoCpuTensors():
        yield


@contextlib.contextmanager
def tpu_kernels(ops, checker: LaunchChecker | None = None):
    """Inside a FakeTensorMode: ops of ``ops`` run their ``tpu`` kernel instead of their fake.

    What runs is the dispatcher's choice for dispatch key PrivateUse1. For a bridge op that is its
    ``tpu`` kernel (int64 -> int32 casts, then torch_tpu's op ``tpu_op``). Without ``checker`` only
    bridge ops are switched, and torch_tpu's own fakes compute what their ``tpu_op`` returns,
    exporting the kernel for TPU. With a checker every op is switched, torch_tpu's ops included:
    their eager path runs (export, fingerprint, registration) and each launch goes to ``checker``.
    """
    if checker is None:
        swapped = [op for op in ops if hasattr(op, "tpu_op")]
    else:
        swapped = list(ops) + [op.tpu_op for op in ops if hasattr(op, "tpu_op")]
    keyset = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
    saved = [(op, op._abstract_fn) for op in swapped]
    try:
        for op in swapped:
            op._abstract_fn = functools.partial(op._opoverload.redispatch, keyset)
        with checker.installed() if checker is not None else contextlib.nullcontext():
            yield
    finally:
        for op, fn in saved:
            op._abstract_fn = fn
