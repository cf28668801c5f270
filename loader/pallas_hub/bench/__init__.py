"""The benchmark: our kernels against the anchors as whole layers on real model shapes, by a TPU cost model.

* ``problems``: the layers (MoE experts, causal prefill, decode step) at real shapes, with checks.
* ``anchors``, ``vllm_tpu``: the kernels we race (vLLM TPU's, jax's, tokamax's) in their layers;
  ``vllm_tpu`` is the one adapter for tpu-inference's kernels on this jax.
* ``costmodel``: what a program's Pallas calls move, compute and loop over, step by step.
* ``llo``, ``compiled``: the compiler's schedule of each compiled op (ahead of time, in a worker).
* ``stepmodel``: the per-step time model (v2) joining the two; ``validate``: it against XLA and libtpu.
* ``runner`` (``pallas-hub bench``), ``report``, ``plots``: the run and every published figure.
* ``timing``, ``tpu_bench``: real timings and calibration, on a host with TPU chips.
* ``bridge_overhead``: the CPU cost of the torch <-> JAX bridge, measured on this machine.

Importing this package keeps JAX on the CPU (through ``pallas_hub.verify``).
"""

from .. import verify  # noqa: F401  (JAX_PLATFORMS / ALLOW_MULTIPLE_LIBTPU_LOAD before jax loads)
