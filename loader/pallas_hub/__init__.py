"""pallas_hub: build, verify, publish and load Pallas TPU kernels as Hugging Face Hub kernels.

Rooms: ``hub/`` (the workflow users run: manifest, build, publish, fetch, register, session),
``verify/`` (interpret modes, ahead-of-time TPU compile, the compile matrix), ``bench/`` (the cost
model, anchors, ``pallas-hub bench``), ``vendored/`` (the single source of what every kernel
package shares: the bridge, chip figures, attention math). ``cli.py`` and ``demo.py`` sit on top.

``pallas_hub.load(...)`` fetches kernels through ``kernels.get_kernel`` (trust list, version pin,
digest check, lock file) and registers them into transformers; see ``pallas_hub.hub.session.load``.
"""

from ._version import __version__  # noqa: F401


def load(*args, **kwargs):
    from .hub.session import load as _load

    return _load(*args, **kwargs)


load.__doc__ = "Fetch and register kernels in one call; see pallas_hub.hub.session.load."
