"""How TPU kernels are verified on a machine without a TPU (DESIGN.md, "Verifying TPU kernels").

* ``interpreter``: Pallas calls run on CPU, fast (``interpret("fast")``) or under the strict TPU
  simulator (``interpret("strict")``: NaN-initialised memory, out-of-bounds reads raise, races found).
* ``compiler``: the real XLA:TPU + Mosaic compiler ahead of time on libtpu's compile-only topologies
  (``compile_for_tpu``).
* ``matrix``: every configuration a kernel declares in its ``compile_matrix.py``, for every chip
  (``pallas-hub check``).
* ``introspect``: a program's ``pallas_call``s (grid, blocks, scratch), for VMEM figures and the cost model.
* ``torchtpu``: TorchTPU's ``tpu`` device without a chip (torch_tpu installed): a kernel's torch ops on
  ``tpu`` tensors under torch_tpu's fakes and through its eager path to a checked launch. Imported on
  its own (``from pallas_hub.verify import torchtpu``): it imports torch.
"""

import os

# Before anything imports jax: compile-only use needs no TPU, never opens one, and several test
# processes may load libtpu at once (it guards the TPU with a process-wide lock file).
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # libtpu (loaded with torch_tpu) never asks the cloud metadata server

from .compiler import CompileResult, compile_for_tpu, first_line, tpu_devices, tpu_mesh  # noqa: E402
from .interpreter import interpret, strict_params  # noqa: E402
from .introspect import Block, PallasCall, pallas_calls  # noqa: E402

__all__ = [
    "Block", "CompileResult", "PallasCall", "compile_for_tpu", "first_line", "interpret", "pallas_calls",
    "strict_params", "tpu_devices", "tpu_mesh",
]
