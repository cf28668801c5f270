"""The Hub workflow users run: manifest -> build -> publish -> fetch -> register (-> session).

* ``manifest``: the root build.toml and each kernel's kernel-builder metadata, validated.
* ``build``: a kernel's Hub variants (``build/torch-tpu``, ``build/torch-cpu``), deterministic,
  with the shared modules of ``pallas_hub/vendored/`` copied in.
* ``publish``: what a version holds, the local hub (a Hugging Face cache layout), and the upload.
* ``fetch``: trust list, version pin, digest check, lock files, import through ``kernels.get_kernel``.
* ``register``: what a kernel's ``REGISTRATIONS`` declare, into transformers' registries (undoable).
* ``session``: ``pallas_hub.load``, fetch and register in one call.
* ``declarations``: what a kernel folder declares for check, bench and demo; ``scaffold`` (with
  ``templates/``): ``pallas-hub new``, a new kernel folder with all of it.
"""

from .fetch import Hub, HubError
from .publish import LocalHub

__all__ = ["Hub", "HubError", "LocalHub"]
