"""The main job (`pallas-hub demo`, `make demo`), end to end and without network:

build every kernel of the manifest, publish it to the local hub, fetch it back with
``kernels.get_kernel(repo, version=N)`` (trust list, digest check), register what each kernel
declares, run each kernel's own check (``kernels/<key>/demo_check.py``) on what was fetched, then a
tiny MoE model built from a config (random weights) with the experts and attention functions the
kernels registered against transformers' defaults, continuous batching with the registered paged
attention against per-prompt ``generate``, and the TPU compile matrix. Exit status 1 if anything disagrees.

No kernel is named here: every manifest kernel is built, fetched and checked by its own declaration,
and the transformers checks use whatever the kernels registered (a registry nobody fills is MISSING).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from pathlib import Path

from .hub import manifest as mf

TOL = dict(rtol=2e-4, atol=2e-4)  # f32 logits: our kernels accumulate in f32 like the defaults, in another order


def _model(impls: dict, config):
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)  # same weights for every implementation
    return Qwen3MoeForCausalLM._from_config(copy.deepcopy(config), dtype=torch.float32, **impls).eval()


def tiny_moe_config():
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                          num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, max_position_embeddings=256,
                          pad_token_id=0, bos_token_id=1, eos_token_id=None)  # no eos: fixed lengths


class _Counter:
    """Counts calls of one registry entry (the demo's proof that our function, not a default, ran)."""

    def __init__(self, mapping: dict, name: str):
        self.mapping, self.name, self.calls = mapping, name, 0

    def __enter__(self):
        self.fn = self.mapping[self.name]

        def counted(*args, **kwargs):
            self.calls += 1
            return self.fn(*args, **kwargs)

        self.mapping[self.name] = counted
        return self

    def __exit__(self, *exc):
        self.mapping[self.name] = self.fn


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def _inputs(config):
    import torch

    torch.manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (2, 11))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # left padding in the second row
    return ids, mask


def check_model(experts: str | None, attention: str | None, out=print) -> list[tuple[str, bool]]:
    """A tiny MoE model with our experts/attention vs transformers' defaults; returns (check, ok) pairs."""
    import torch
    from transformers import AttentionInterface
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    experts_map, attn_map = type(ALL_EXPERTS_FUNCTIONS)._global_mapping, AttentionInterface._global_mapping
    config = tiny_moe_config()
    checks = []
    ids, mask = _inputs(config)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    ours = {}
    if experts:
        ours["experts_implementation"] = experts
    if attention:
        ours["attn_implementation"] = attention
    default = _model({}, config)
    mine = _model(ours, config)
    out(f"model: Qwen3-MoE from a config (random weights, f32), {config.num_hidden_layers} layers, "
        f"{config.num_experts} experts top-{config.num_experts_per_tok}, batch 2 x 11 tokens with left padding")
    out(f"  default: experts={default.config._experts_implementation} attention={default.config._attn_implementation}"
        f" | ours: experts={mine.config._experts_implementation} attention={mine.config._attn_implementation}")
    with torch.no_grad():
        mine(input_ids=ids, attention_mask=mask)  # the first call at a shape compiles; time the second
        ref, t_ref = _timed(lambda: default(input_ids=ids, attention_mask=mask).logits)
        counters = [_Counter(experts_map, experts)] if experts else []
        counters += [_Counter(attn_map, attention)] if attention else []
        with contextlib.ExitStack() as stack:
            for c in counters:
                stack.enter_context(c)
            got, t_got = _timed(lambda: mine(input_ids=ids, attention_mask=mask).logits)
            toks, t_gen = _timed(lambda: mine.generate(input_ids=ids, attention_mask=mask, **gen))
        ref_toks, t_gen_ref = _timed(lambda: default.generate(input_ids=ids, attention_mask=mask, **gen))
    valid = mask.bool()
    diff = (got - ref)[valid].abs().max().item()
    close = torch.allclose(got[valid], ref[valid], **TOL)
    out(f"  logits (valid tokens): max |ours - default| = {diff:.2e} (rtol=atol={TOL['atol']:g}) "
        f"-> {'MATCH' if close else 'MISMATCH'}")
    same = torch.equal(toks, ref_toks)
    out(f"  greedy generate, 6 new tokens: {'identical' if same else 'DIFFERENT'} tokens")
    for c in counters:
        out(f"  {c.name} called {c.calls} times (forward + generate)")
    out(f"  time on this CPU (kernels in Pallas interpret mode; not TPU speed): forward {1e3 * t_got:.0f} ms "
        f"(default {1e3 * t_ref:.0f} ms), generate {1e3 * t_gen:.0f} ms incl. compiling new decode shapes "
        f"(default {1e3 * t_gen_ref:.0f} ms)")
    checks += [("MoE logits match the defaults", close), ("MoE greedy tokens match", same),
               ("our functions were called", all(c.calls > 0 for c in counters))]
    return checks


def check_continuous_batching(paged: str, experts: str | None, out=print) -> list[tuple[str, bool]]:
    """generate_batch with our paged attention (and experts) vs per-prompt generate with the defaults."""
    import torch
    from transformers import AttentionInterface, ContinuousBatchingConfig, GenerationConfig

    attn_map = AttentionInterface._global_mapping
    config = tiny_moe_config()
    ids, _ = _inputs(config)
    checks = []
    impls = {"attn_implementation": paged, **({"experts_implementation": experts} if experts else {})}
    prompts = [ids[0, :n].tolist() for n in (5, 9, 3)]
    gcfg = GenerationConfig(max_new_tokens=6, do_sample=False, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=64, use_cuda_graph=False)
    default = _model({}, config)
    with torch.no_grad():
        (ref, t_ref) = _timed(lambda: [default.generate(torch.tensor([p]), generation_config=gcfg)
                                       [0, len(p):].tolist() for p in prompts])
    mine = _model(impls, config)
    quiet = logging.getLogger("ContinuousBatchingLogger")  # its "eos_token_id not set" is intended: fixed lengths
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        with _Counter(attn_map, paged) as c, torch.no_grad():
            res, t_cb = _timed(lambda: mine.generate_batch(prompts, generation_config=gcfg,
                                                            continuous_batching_config=cb, warmup=False))
    finally:
        quiet.setLevel(level)
    got = [res[k].generated_tokens for k in sorted(res, key=lambda k: int(k.rsplit("_", 1)[1]))]  # "req_<i>"
    same = got == ref
    out(f"continuous batching (generate_batch, 3 prompts of 5/9/3 tokens, 6 new each) with {paged}: "
        f"{'identical' if same else 'DIFFERENT'} tokens vs per-prompt generate with the defaults")
    out(f"  {paged} called {c.calls} times; time {1e3 * t_cb:.0f} ms (defaults, one prompt at a time: "
        f"{1e3 * t_ref:.0f} ms), CPU interpret mode, incl. compiling new shapes")
    checks += [("continuous batching tokens match", same), ("paged attention was called", c.calls > 0)]
    return checks


ROLES = {  # transformers' registries the demo exercises, and what fills each
    "experts": "an experts function (registry 'experts', experts_implementation)",
    "attention": "an attention function (registry 'attention', attn_implementation)",
    "paged_attention": "a continuous-batching attention (registry 'paged_attention', generate_batch)",
}


def run(root: Path | None = None, local_hub: Path | None = None, compile_matrix: bool = True, out=print,
        timeout: float | None = None) -> int:
    """The demo on the manifest at ``root`` (default: found from the current folder upward); ``timeout``: per
    compile-matrix configuration (None: compile in this process, no timeout)."""
    from .hub.build import build_kernel
    from .hub.declarations import declaration
    from .hub.publish import LocalHub
    from .hub.register import Registration
    from .hub.session import load

    manifest = mf.load_manifest(root)
    specs = list(manifest.kernels.values())
    hub = LocalHub(local_hub)
    checks: list[tuple[str, bool]] = []
    out(f"== pallas-hub demo: {len(specs)} kernel(s) in {manifest.file}: "
        + (", ".join(f"{s.key} ({s.repo_id} v{s.version})" for s in specs) or "none"))

    def attempt(name: str, fn):
        """Run one step; a failure is reported and counted, and the demo goes on with the rest."""
        try:
            return fn()
        except Exception as e:
            out(f"  FAILED {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            checks.append((name, False))
            return None

    out("\n== 1. build and publish to the local hub (no network)")
    published = [s for s in specs if attempt(f"build and publish {s.key}",
                                             lambda s=s: hub.publish(s, build_kernel(s), progress=out))]

    out("\n== 2. fetch with kernels.get_kernel(repo, version=N), trusted explicitly, digests verified")
    registration = Registration()
    fetched = {}
    try:
        for spec in published:
            got = attempt(f"fetch and register {spec.key}", lambda s=spec: _timed(
                lambda: load({s.repo_id: s.version}, trust=[s.repo_id], source=hub)))
            if got is None:
                continue
            loaded, t = got
            for line in loaded.report():
                out("  " + line)
            out(f"  ({t:.1f} s)")
            fetched[spec.key] = (spec, loaded[spec.repo_id])
            registration.extend(loaded.registration)  # undone together at the end

        out("\n== 3. each kernel's own check (kernels/<key>/demo_check.py) on the kernel fetched from the local hub")
        def kernel_check(spec, module):
            declared = declaration(spec, "demo_check")
            if declared is None:
                raise mf.ManifestError(f"declares no demo check: add {spec.path / 'demo_check.py'} (see pallas-hub new)")
            return list(declared.check(module, out=out))

        for spec, module in fetched.values():
            checks += attempt(f"{spec.key} demo check", lambda s=spec, m=module: kernel_check(s, m)) or []

        roles = {r: registration.names(r) for r in ROLES}
        out("\n== 4. transformers with the registered kernels vs its defaults")
        for role, names in roles.items():
            if not names:
                out(f"  MISSING: no kernel in the manifest provides {ROLES[role]}")
        first = {r: (n[0] if n else None) for r, n in roles.items()}
        experts, attention, paged = first["experts"], first["attention"], first["paged_attention"]
        if experts or attention:
            result = attempt("MoE model with our kernels", lambda: check_model(experts, attention, out))
            checks += result or []
            if experts and attention and not (result and all(ok for _, ok in result)):
                out("  narrowing it down, one kernel at a time:")  # which of the two disagrees
                for label, e, a in (("experts alone", experts, None), ("attention alone", None, attention)):
                    sub = attempt(label, lambda e=e, a=a: check_model(e, a, out))
                    checks += [(f"{label}: {name}", ok) for name, ok in sub or []]
        if paged:
            checks += attempt("continuous batching with our kernels",
                              lambda: check_continuous_batching(paged, experts, out)) or []
        if not (experts or attention or paged):
            out("  skipped: nothing registered")
    finally:
        registration.undo()

    if compile_matrix:
        from .verify.matrix import check, report

        out("\n== 5. TPU compile matrix (libtpu compile-only topologies, no TPU needed)")
        if specs:
            status = attempt("compile matrix", lambda: report(check(specs, progress=out, timeout=timeout), progress=out))
            if status is not None:
                checks.append(("compile matrix as declared", status == 0))
        else:
            out("  no kernels in the manifest")

    out("\n== summary")
    for name, ok in checks:
        out(f"  {'ok  ' if ok else 'FAIL'} {name}")
    bad = [n for n, ok in checks if not ok]
    out("demo: " + (f"{len(bad)} check(s) FAILED" if bad else f"all {len(checks)} checks passed"))
    return 1 if bad else 0
