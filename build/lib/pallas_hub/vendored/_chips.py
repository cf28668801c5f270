"""TPU generations: the per-chip figures and compile-only topologies, and the generation of a device.

The single source of chip figures (``pallas_hub/vendored/``): kernels tile with them (vendored as
``_chips.py``), the compile tier takes the topologies and the cost model the speeds. Figures are
per chip (DESIGN.md; jax's tpu_info for VMEM). ``topology`` is a libtpu compile-only topology name
for ``jax.experimental.topologies.get_topology_desc``.
"""

from __future__ import annotations

import dataclasses
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


def tpu_generation(device: Any = None) -> str | None:
    """'v5e', 'v6e' or 'tpu7x' for a JAX device (default: JAX's first device), None off TPU.

    Kernels choose tiles per generation with it; off TPU (interpret mode, or compiling ahead of
    time from a CPU host) they pick tiles that fit every generation.
    """
    if device is None:
        import jax

        try:
            device = jax.devices()[0]
        except RuntimeError:  # no JAX backend at all
            return None
    kind = str(getattr(device, "device_kind", "")).lower()
    if "v5 lite" in kind or "v5e" in kind:
        return "v5e"
    if "v6" in kind:
        return "v6e"
    if "7x" in kind or "v7" in kind:
        return "tpu7x"
    return None

