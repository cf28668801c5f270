"""The benchmark: our kernels beside the anchors on real model shapes, by the TPU cost model.

* ``costmodel``: HBM bytes, MXU flops and steps a program's Pallas calls issue, and the modelled time.
* ``anchors``: the public kernels we race (jax megablox, tokamax, jax flash, splash, paged attention).
* ``runner``: the problems, ``pallas-hub bench``, and what it writes (benchmarks/results, benchmarks/README.md).
* ``plots``: the figures beside the results.
* ``timing``, ``tpu_bench``: real timings, on a host with TPU chips.
* ``bridge_overhead``: the CPU cost of the torch <-> JAX bridge, measured on this machine.

Importing this package keeps JAX on the CPU (through ``pallas_hub.verify``).
"""

from .. import verify  # noqa: F401  (JAX_PLATFORMS / ALLOW_MULTIPLE_LIBTPU_LOAD before jax loads)
