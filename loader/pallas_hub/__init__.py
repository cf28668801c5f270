"""pallas_hub: build, verify, publish and load Pallas TPU kernels as Hugging Face Hub kernels.

``pallas_hub.load(...)`` fetches kernels through ``kernels.get_kernel`` (trust list, version pin,
digest check, lock file) and registers them into transformers; see ``pallas_hub.session.load``.
"""

__version__ = "0.1.0"


def load(*args, **kwargs):
    from .session import load as _load

    return _load(*args, **kwargs)


load.__doc__ = "Fetch and register kernels in one call; see pallas_hub.session.load."
