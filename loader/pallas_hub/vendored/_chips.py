"""TPU generations: the figures of one JAX device, compile-only topologies, and the generation of a device.

The single source of chip figures (``pallas_hub/vendored/``): kernels tile with them (vendored as
``_chips.py``), the compile tier takes the topologies and the cost model the speeds.

Every figure is per JAX device, which is one TensorCore: v5e and v6e have one TensorCore per chip
(one device per chip); a TPU7x chip has two TensorCores and JAX shows each as its own device
(``device_kind`` "TPU7x", ``num_cores`` 1), so a single-device program gets half the chip's HBM
bandwidth and MXU peak. None of these chips is a megacore (v4 and v5p are: there one device spans
two TensorCores and Pallas can split "parallel" grid axes over them); so no figure here assumes
a second core, and using both TensorCores of a TPU7x takes two devices (e.g. a mesh of 2).

Sources: bandwidth, bf16 peak, VMEM and MXU count/width are jax 0.10.2's own TPU info
(``jax._src.pallas.mosaic.tpu_info.get_tpu_info_for_chip(version, 1)``, which divides TPU7x's
per-chip 7.4e12 B/s and 2.31e15 FLOP/s by its 2 TensorCores; tests/test_chips.py checks these
against it). ``vmatmul_cycles``: cycles one MXU is busy per vmatmul (16 packed bf16 rows against
the loaded weights), from libtpu's static LLO profile of compute-bound kernels (v5e 16, v6e 8;
TPU7x 8 assumed, its profile is unavailable). The clock follows: peak / (MXUs x 2 x 16 x width^2 /
vmatmul_cycles); for v5e that gives 1.5 GHz, the documented clock; v6e 1.75 GHz and TPU7x 2.2 GHz
are derived this way (not published). ``step_overhead_s``: the per-step cost nothing here can
measure (0.35 us, Pallas' documented figure; libtpu's static model charges about 0.18 us on v6e and
0.37 us on v5e); benchmarks report rankings at 0, 0.35 and 0.7 us, and a TPU run calibrates it.
``topology`` is a libtpu compile-only topology for ``jax.experimental.topologies.get_topology_desc``.
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
    topology: str  # small single-host topology used for single-device programs
    peak_flops: float  # bf16 MXU peak, FLOP/s per JAX device (TensorCore)
    hbm_bandwidth: float  # bytes/s per JAX device
    vmem_bytes: int  # per TensorCore
    mxu_count: int  # MXUs per TensorCore
    mxu_dim: int  # MXU width (128 x 128 or 256 x 256)
    vmatmul_cycles: int  # cycles an MXU is busy per vmatmul (16 packed bf16 rows)
    tensorcores_per_chip: int = 1  # JAX devices per chip
    step_overhead_s: float = 0.35e-6  # per grid step / DMA-loop iteration (not measurable here)

    @property
    def vmatmul_flops(self) -> int:
        """bf16 flops of one vmatmul: 16 packed rows x width x width x 2."""
        return 2 * 16 * self.mxu_dim ** 2

    @property
    def clock_hz(self) -> float:
        """Core clock implied by the MXU peak: peak / flops per cycle of all MXUs."""
        return self.peak_flops / (self.mxu_count * self.vmatmul_flops / self.vmatmul_cycles)


CHIPS: dict[str, Chip] = {
    "v5e": Chip("v5e", "v5e:2x2", 1.97e14, 8.20e11, 128 * MiB, mxu_count=4, mxu_dim=128, vmatmul_cycles=16),
    "v6e": Chip("v6e", "v6e:2x2", 9.20e14, 1.64e12, 128 * MiB, mxu_count=2, mxu_dim=256, vmatmul_cycles=8),
    "tpu7x": Chip("tpu7x", "TPU7x:2x2x1", 2.31e15 / 2, 7.40e12 / 2, 64 * MiB, mxu_count=2, mxu_dim=256,
                  vmatmul_cycles=8, tensorcores_per_chip=2),
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
