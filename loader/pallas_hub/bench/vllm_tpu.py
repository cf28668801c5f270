"""vLLM TPU's Pallas kernels (the ``tpu-inference`` wheel) on a CPU host under our jax: the one adapter.

tpu-inference 0.32.0 is pure Python. Its kernel modules need jax and two modules of its own that
pull in vLLM: ``tpu_inference.logger`` and ``tpu_inference.utils`` (and its package ``__init__``
imports vLLM too). The benchmark installs the wheel without dependencies (``requirements-nodeps.txt``,
installed by the Makefile) and this module is the only place that works around what is missing:

* ``install()`` registers an empty ``tpu_inference`` package whose path is the installed one (its
  ``__init__`` never runs) and stand-ins for the two modules: a logger with ``warning_once`` and
  the five helpers the kernels import from ``utils``, which answer for the chip set by ``chip()``;
  and ``pltpu.reciprocal``, which this jax spells ``pl.reciprocal`` (the same primitive).
* ``chip(name)`` answers the kernels' trace-time questions about "the current TPU" for a chip we
  compile for from this CPU host: ``pltpu.get_tpu_info()`` (VMEM size; jax asks the default
  backend, which is the CPU here), ragged paged attention v3's ``get_tpu_version`` (which reads
  ``jax.devices()[0].device_kind``; patched where it is defined and where it was imported by name)
  and the device name keying the tuned tables ('TPU v5e' / 'TPU v6e' / 'TPU v7').

Entry points below are the kernels' own public functions, unchanged; block sizes are theirs
(``*_block_sizes`` helpers return what they pick).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import logging
import sys
import types

VERSION = "0.32.0"
DEVICE_NAME = {"v5e": "TPU v5e", "v6e": "TPU v6e", "tpu7x": "TPU v7"}
TPU_VERSION = {"v5e": 5, "v6e": 6, "tpu7x": 7}
_current: list[str] = []  # the chip stack of nested chip() contexts


class NotInstalled(RuntimeError):
    pass


class _Logger(logging.LoggerAdapter):
    _seen: set = set()

    def _once(self, level, msg, *args):
        if (level, msg, args) not in self._seen:
            self._seen.add((level, msg, args))
            self.log(level, msg, *args)

    def warning_once(self, msg, *args, **_):
        self._once(logging.DEBUG, msg, *args)  # e.g. "using default block sizes": expected here

    def info_once(self, msg, *args, **_):
        self._once(logging.DEBUG, msg, *args)

    def debug_once(self, msg, *args, **_):
        self._once(logging.DEBUG, msg, *args)


def installed_version() -> str | None:
    try:
        return importlib.metadata.version("tpu-inference")
    except importlib.metadata.PackageNotFoundError:
        return None


def _chip_now() -> str:
    if not _current:
        raise RuntimeError("a tpu-inference kernel asked for the TPU outside `with vllm_tpu.chip(name):`")
    return _current[-1]


def install() -> None:
    """Make tpu-inference's kernel modules importable (idempotent)."""
    utils = sys.modules.get("tpu_inference.utils")
    if utils is not None and getattr(utils, "_pallas_hub_stub", False):
        return
    version = installed_version()
    if version != VERSION:
        raise NotInstalled(f"tpu-inference {VERSION} is needed for vLLM TPU's kernels, found {version}: "
                           f"`make .venv/.installed` installs it (requirements-nodeps.txt, without dependencies)")
    spec = importlib.util.find_spec("tpu_inference")  # finds the package without running its __init__
    pkg = types.ModuleType("tpu_inference")
    pkg.__path__ = list(spec.submodule_search_locations)
    sys.modules["tpu_inference"] = pkg

    log = types.ModuleType("tpu_inference.logger")
    log.init_logger = lambda name: _Logger(logging.getLogger(name), {})
    utils = types.ModuleType("tpu_inference.utils")
    utils._pallas_hub_stub = True
    utils.align_to = lambda x, a: -(-x // a) * a
    utils.cdiv = lambda a, b: -(-a // b)

    def get_dtype_packing(dtype):
        import jax.numpy as jnp

        return 32 // (jnp.dtype(dtype).itemsize * 8)

    utils.get_dtype_packing = get_dtype_packing
    utils.get_device_name = lambda num_devices=None: DEVICE_NAME[_chip_now()]
    utils.get_tpu_version = lambda: TPU_VERSION[_chip_now()]
    utils.get_megacore = lambda: False  # none of v5e, v6e, TPU7x is a megacore (see _chips)
    sys.modules["tpu_inference.logger"] = log
    sys.modules["tpu_inference.utils"] = utils
    pkg.logger, pkg.utils = log, utils
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    if not hasattr(pltpu, "reciprocal"):  # RPA v3 hd64 calls pltpu.reciprocal: our jax has it as pl.reciprocal
        pltpu.reciprocal = pl.reciprocal  # (the same primitive and Mosaic lowering, tpu.reciprocal)


@contextlib.contextmanager
def chip(name: str):
    """Answer tpu-inference's trace-time TPU queries as generation ``name`` ('v5e', 'v6e', 'tpu7x')."""
    from .anchors import tpu_info_on_cpu

    install()
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel as rpa_kernel
    from tpu_inference.kernels.ragged_paged_attention.v3 import tuned_block_sizes_hd64 as rpa_hd64_sizes
    from tpu_inference.kernels.ragged_paged_attention.v3 import util as rpa_util

    _current.append(name)
    saved = [(m, m.get_tpu_version) for m in (rpa_util, rpa_kernel, rpa_hd64_sizes)]
    for m, _ in saved:
        m.get_tpu_version = lambda: TPU_VERSION[_chip_now()]
    try:
        with tpu_info_on_cpu(name):
            yield
    finally:
        for m, f in saved:
            m.get_tpu_version = f
        _current.pop()


# --------------------------------------------------------------------------- the kernels

def rpa_v3():
    """ragged_paged_attention v3: (queries[T,Hq,D], keys[T,Hkv,D], values[T,Hkv,D],
    kv_cache[P, page, 2 Hkv / packing, packing, D], kv_lens[S], page_indices[S * pages_per_seq],
    cu_q_lens[S+1], distribution[3], *, sm_scale, ...) -> (out[T,Hq,D], kv_cache). It writes the
    new tokens' K/V into the cache; jitted, donates q, k, v and the cache."""
    install()
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel

    return kernel


def rpa_v3_hd64():
    """ragged_paged_attention v3's head-dim-64 variant (GPT-OSS): ``ragged_paged_attention_hd64``, the
    arguments of ``rpa_v3``'s, kv_cache [P, page, Hkv / packing, packing, 128] holding [K_h | V_h] per head."""
    install()
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel_hd64

    return kernel_hd64


def fused_moe_v1():
    """fused_ep_moe(mesh, tokens[T,H], w1[E,2,H,I], w2[E,I,H], gating_output[T,E], top_k, *, act_fn,
    scoring_fn, bt, bf, bd1, bd2, btc, bfc, bd1c, bd2c, ep_axis_name) -> [T,H]: routing (top-k of
    the gating scores), both expert matmuls and the weighted sum, in one kernel."""
    install()
    from tpu_inference.kernels.fused_moe.v1 import kernel

    return kernel


def gmm():
    """megablox gmm(lhs[m,k], rhs[g,k,n], group_sizes[g], preferred_element_type, tiling=None, ...):
    with no tiling, its tuned table (keyed by m, k, n, groups, dtypes) or its default formula."""
    install()
    from tpu_inference.kernels.megablox import gmm as g

    return g


def gmm_tiling(m: int, k: int, n: int, groups: int, lhs_dtype: str = "bfloat16", rhs_dtype: str = "bfloat16"):
    """(tm, tk, tn) megablox gmm picks for this problem (tuned table or default)."""
    install()
    from tpu_inference.kernels.megablox import tuned_block_sizes as t

    return tuple(t.get_tuned_block_sizes(m, k, n, groups, groups, lhs_dtype, rhs_dtype, k))


def flash_attention():
    """flash_attention(q, k, v [B,H,S,D], ab=None, segment_ids=None, *, causal, sm_scale,
    block_sizes=None (-> its tuned parameters, else its default), vmem_limit_bytes): no GQA."""
    install()
    from tpu_inference.kernels.flash_attention import kernel

    return kernel
