"""TPU generations: compile-only topologies and the per-chip figures the cost model uses.

Figures are per chip (DESIGN.md; jax's tpu_info for VMEM). ``topology`` is a libtpu compile-only
topology name for ``jax.experimental.topologies.get_topology_desc``.
"""

from __future__ import annotations

import dataclasses

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
