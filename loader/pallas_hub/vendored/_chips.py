"""TPU generations: the per-chip figures and compile-only topologies, and the generation of a device.

The single source of chip figures (``pallas_hub/vendored/``): kernels tile with them (vendored as
``_chips.py``), the compile tier takes the topologies and the cost model the speeds. Figures are
per chip (DESIGN.md; jax's tpu_info for VMEM). ``topology`` is a libtpu compile-only topology name
for ``jax.experimental.topologies.get_topology_desc``.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from typing import Any

MiB = 1 << 20


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    topology: str  # small single-host topology used for single-chip programs
    peak_flops: float  # bf16 MXU peak, FLOP/s per chip
    hbm_bandwidth: float  # bytes/s per chip
    vmem_bytes: int  # per TensorCore
    step_overhead_s: float = 0.35e-6  # per grid step of a Pallas pipeline


CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", "v5e:2x2", 197e12, 819e9, 128 * MiB),
    "v6e": Chip("v6e", "v6e:2x2", 918e12, 1640e9, 128 * MiB),
    "tpu7x": Chip("tpu7x", "TPU7x:2x2x1", 2307e12, 7.4e12, 64 * MiB),
}
DEFAULT_CHIPS = ("v5e", "v6e", "tpu7x")
EIGHT_CHIP_TOPOLOGY = "v6e:2x4"  # for sharded (expert-parallel) programs


def chip(name: str) -> Chip:
    try:
        return CHIPS[name.lower()]
    except KeyError:
        raise ValueError(f"unknown TPU generation {name!r}; known: {', '.join(CHIPS)}") from None


# TorchTPU names a chip by its PCI id (torch.tpu.get_device_name()); JAX and Mosaic by PJRT's device kind
TORCH_TPU_DEVICE_KINDS = {"TPU v4": "TPU v4", "TPU v5e": "TPU v5 lite", "TPU v5p": "TPU v5", "TPU v6e": "TPU v6 lite",
                          "TPU v7": "TPU7x"}


def torch_tpu_device_kind() -> str | None:
    """JAX's device kind ("TPU v6 lite", "TPU7x" ...) of TorchTPU's chip; None without torch_tpu or a known chip.

    torch.tpu.get_device_name() reads PCI ids (torch_tpu's utils/hardware.py): no PJRT client and no
    JAX runtime, so it is safe while JAX traces a kernel on a host whose TPU belongs to torch_tpu.
    """
    if "torch_tpu" not in sys.modules:
        return None
    import torch

    try:
        with warnings.catch_warnings():  # experimental in torch_tpu 0.2.0: it warns on every call
            warnings.simplefilter("ignore")
            name = torch.tpu.get_device_name()
    except Exception:  # a torch_tpu without it, or no `tpu` device module
        return None
    return TORCH_TPU_DEVICE_KINDS.get(name)


def traced_device_kind() -> str | None:
    """The device kind of the abstract mesh JAX is tracing under (what Mosaic's lowering reads too), if any."""
    import jax

    try:
        device = jax.sharding.get_abstract_mesh().abstract_device
    except AttributeError:  # a JAX without abstract devices
        return None
    return getattr(device, "device_kind", None)


def tpu_generation(device: Any = None) -> str | None:
    """'v5e', 'v6e' or 'tpu7x' for a JAX device or device kind, None off TPU.

    Kernels choose tiles per generation with it; off TPU (interpret mode, or compiling ahead of
    time from a CPU host) they pick tiles that fit every generation. Without ``device``: the
    abstract mesh being traced under (the bridge's TorchTPU path traces under one of TorchTPU's
    chip), else TorchTPU's chip, else JAX's first device. With torch_tpu loaded JAX's runtime is
    never asked: on a TorchTPU host the TPU belongs to torch_tpu.
    """
    if device is None:
        device = traced_device_kind() or torch_tpu_device_kind()
        if device is None:
            if "torch_tpu" in sys.modules:
                return None
            import jax

            try:
                device = jax.devices()[0]
            except RuntimeError:  # no JAX backend at all
                return None
    kind = str(getattr(device, "device_kind", device)).lower()
    if "v5 lite" in kind or "v5e" in kind:
        return "v5e"
    if "v6" in kind:
        return "v6e"
    if "7x" in kind or "v7" in kind:
        return "tpu7x"
    return None
