"""Registering a kernel's functions into transformers, from what the kernel itself declares.

Each kernel package has a module-level ``REGISTRATIONS`` list, e.g.::

    REGISTRATIONS = [
        {"registry": "experts", "name": "tokamax_ragged_dot", "function": "experts_forward"},
        {"registry": "fp8_experts", "name": "tokamax_ragged_dot", "function": "experts_forward"},
        {"registry": "attention", "name": "pallas_attention", "function": "attention_forward", "mask": "sdpa"},
        {"registry": "paged_attention", "name": "pallas_paged_flash", "function": "paged_attention_forward",
         "mask": "flash_attention_2"},
    ]

* ``experts``: ``ALL_EXPERTS_FUNCTIONS`` (select with ``experts_implementation=name``).
* ``fp8_experts``: ``ALL_FP8_EXPERTS_FUNCTIONS``, which transformers consults instead for FP8Experts (FP8
  checkpoints kept quantized), with the same contract and selected by the same ``experts_implementation``:
  a name only in ``experts`` raises a KeyError on an FP8 model, so a kernel serving both declares both.
* ``attention``: ``AttentionInterface`` and, with ``mask``, ``AttentionMaskInterface`` (a function of the
  kernel or a transformers mask name such as ``"sdpa"``). Select with ``attn_implementation=name``.
* ``paged_attention``: the continuous-batching path. transformers 5.24 lets ``generate_batch`` use only
  ``sdpa``, ``paged|eager`` or a name containing "flash", and for a "flash" name model init tries to
  import a flash-attention package unless that name is recorded as already loaded
  (``modeling_flash_attention_utils._loaded_implementation``); the loader records it, and restores it
  on undo. Our function receives packed varlen queries with ``cu_seq_lens_q/k`` (no block tables
  on TPU).

Every change is undone by ``Registration.undo()``, which restores whatever was there before.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

REGISTRIES = ("experts", "fp8_experts", "attention", "paged_attention")
EXPERTS_REGISTRIES = ("experts", "fp8_experts")
# transformers 5.24's own implementations: a kernel may add names, never replace these
BUILTINS = {
    "experts": {"eager", "grouped_mm", "batched_mm", "deepgemm", "sonicmoe"},
    "fp8_experts": {"eager", "grouped_mm", "batched_mm", "deepgemm", "deepgemm_megamoe"},
    "attention": {"eager", "sdpa", "flex_attention", "paged|eager", "flash_attention_2", "flash_attention_3",
                  "flash_attention_4"},
}
_MISSING = object()


class RegistrationError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class Registered:
    kernel: str
    registry: str
    name: str
    function: str
    mask: str | None = None

    def line(self) -> str:
        mask = f" (+ mask {self.mask})" if self.mask else ""
        return f"{self.registry:<16} {self.name:<26} <- {self.kernel}.{self.function}{mask}"


class Registration:
    """What was registered, and how to put everything back (also a context manager)."""

    def __init__(self):
        self.entries: list[Registered] = []
        self._undo: list[Callable[[], None]] = []

    def names(self, registry: str) -> list[str]:
        return [e.name for e in self.entries if e.registry == registry]

    def extend(self, other: "Registration") -> None:
        self.entries += other.entries
        self._undo += other._undo
        other.entries, other._undo = [], []

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()
        self.entries = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()


def _put(registration: Registration, mapping: dict, key: str, value) -> None:
    previous = mapping.get(key, _MISSING)
    mapping[key] = value

    def restore():
        if previous is _MISSING:
            mapping.pop(key, None)
        else:
            mapping[key] = previous

    registration._undo.append(restore)


def _check_name(registry: str, name: str) -> None:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-|]+", name):
        raise RegistrationError(f"{registry}: name must be a non-empty identifier-like string, got {name!r}")
    if name in BUILTINS[registry if registry in EXPERTS_REGISTRIES else "attention"]:
        raise RegistrationError(f"{registry}: {name!r} is a transformers built-in; a kernel may not replace it")
    if registry == "attention" and any(s in name for s in ("flash", "sdpa", "flex_attention", "paged|")):
        raise RegistrationError(f"attention: name {name!r} must not contain 'flash', 'sdpa', 'flex_attention' or "
                                "'paged|' (transformers gives those names special handling at model init)")
    if registry == "paged_attention" and ("flash" not in name or re.search(r"flash.*[234]", name)):
        raise RegistrationError(f"paged_attention: name {name!r} must contain 'flash' (continuous batching accepts "
                                "only such custom names) and no '2', '3' or '4' after it (reserved for flash-attn)")


def register(module, kernel: str | None = None) -> Registration:
    """Register everything ``module.REGISTRATIONS`` declares; returns the undo handle.

    All entries are validated before anything is registered, so a bad declaration changes nothing.
    """
    import transformers.modeling_flash_attention_utils as fa_utils
    from transformers import AttentionInterface
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    kernel = kernel or getattr(module, "__name__", "kernel")
    declared = getattr(module, "REGISTRATIONS", None)
    if not isinstance(declared, list):
        raise RegistrationError(f"{kernel}: the package declares no REGISTRATIONS list")
    experts = {"experts": type(ALL_EXPERTS_FUNCTIONS)._global_mapping,
               "fp8_experts": type(ALL_FP8_EXPERTS_FUNCTIONS)._global_mapping}
    attention = AttentionInterface._global_mapping
    masks = type(ALL_MASK_ATTENTION_FUNCTIONS)._global_mapping
    plan = []
    for i, entry in enumerate(declared):
        where = f"{kernel}: REGISTRATIONS[{i}]"
        if not isinstance(entry, dict) or entry.get("registry") not in REGISTRIES:
            raise RegistrationError(f"{where}: needs 'registry' in {REGISTRIES}, got {entry!r}")
        unknown = set(entry) - {"registry", "name", "function", "mask"}
        if unknown:
            raise RegistrationError(f"{where}: unknown key(s) {sorted(unknown)}")
        registry, name = entry["registry"], entry.get("name")
        _check_name(registry, name)
        fn = getattr(module, entry.get("function") or "", None)
        if not callable(fn):
            raise RegistrationError(f"{where}: function {entry.get('function')!r} is not a callable of the package")
        mask = entry.get("mask")
        mask_fn = None
        if mask is not None:
            if registry in EXPERTS_REGISTRIES:
                raise RegistrationError(f"{where}: 'mask' applies to attention registries only")
            mask_fn = masks[mask] if mask in masks else getattr(module, mask, None)
            if not callable(mask_fn):
                raise RegistrationError(f"{where}: mask {mask!r} is neither a function of the package nor one of "
                                        f"transformers' masks {sorted(masks)}")
        plan.append((Registered(kernel, registry, name, entry["function"], mask), fn, mask_fn))

    reg = Registration()
    for record, fn, mask_fn in plan:
        if record.registry in EXPERTS_REGISTRIES:
            _put(reg, experts[record.registry], record.name, fn)
        else:
            _put(reg, attention, record.name, fn)
            if mask_fn is not None:
                _put(reg, masks, record.name, mask_fn)
        if record.registry == "paged_attention":
            _put(reg, vars(fa_utils), "_loaded_implementation", record.name)
        reg.entries.append(record)
    return reg

