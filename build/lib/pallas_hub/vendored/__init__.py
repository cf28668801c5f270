"""Code every kernel package shares, kept once here and vendored by ``pallas-hub build``.

A Hub kernel may import only the standard library, torch and its own modules (jax is imported,
not declared), so what kernels share cannot be a dependency: the build copies each file of this
folder, byte for byte and under the same name, into the built package that imports it
(``_bridge.py`` into every one). The files import nothing from ``pallas_hub``, and one another
only relatively, so the copies work as they do here.

* ``_bridge.py``: the torch <-> JAX bridge (one annotated JAX function -> one torch custom op).
* ``_chips.py``: per-chip figures, compile-only topologies and the TPU generation of a device.
* ``_attention_math.py``: masking, soft-cap and online-softmax math shared by the attention kernels.
"""
