"""The real-TPU path of ``pallas-hub bench``: time every row, calibrate the model, and time
transformers' MoE layers.

Runs only when the host has TPU chips (``timing.tpu_host()``), or in tests with a stand-in device
and clock. Every layer row of the modelled run is timed on the problem's real shapes (random data)
with warm-up, the median of N runs and a device synchronisation after each (decode caches are
donated and fed back, as in serving); the measured time is put beside the modelled one.
``calibrate`` then fits the model's two unmeasurable constants, the cost per grid step (and per
XLA op) and per DMA-loop iteration, to the timings, and re-ranks ours against the best anchor at
the fitted costs. Qwen3-30B-A3B-shaped MoE decode layers (transformers'
``Qwen3MoeSparseMoeBlock``) are timed at batch 1, 64 and 256 with
``experts_implementation="grouped_mm"`` and with our experts kernel when the manifest has one.
"""

from __future__ import annotations

from typing import Any, Callable

from . import timing
from ..hub.fetch import on_torchtpu_host
from ..vendored._bridge import synchronize
from ..vendored._chips import tpu_generation

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

MOE_DECODE_BATCHES = (1, 64, 256)


chip_of = tpu_generation  # 'v5e', 'v6e' or 'tpu7x' for a JAX TPU device, else None


def materialize(args: tuple, seed: int = 0) -> tuple:
    """Concrete arrays for a problem's arguments: random data where only a shape was given."""
    key = jax.random.key(seed)
    out = []
    for i, a in enumerate(args):
        if isinstance(a, jax.ShapeDtypeStruct):
            out.append(jax.random.normal(jax.random.fold_in(key, i), a.shape, jnp.float32).astype(a.dtype) * 0.1)
        else:
            out.append(jnp.asarray(a))
    return tuple(out)


def _modelled(model_rows, problem, impl, chip):
    row = next((r for r in model_rows if r["problem"] == problem and r["impl"] == impl and r.get("status") == "ok"), None)
    v = ((row or {}).get("chips") or {}).get(chip) or {}
    return row, v if v.get("status") == "ok" else None


def time_rows(problems, impls, model_rows, *, chip: str | None, device: str, runs: int = 20, warmup: int = 3,
              clock: Callable[[], float] | None = None, sync: Callable[..., None] = synchronize,
              interpret: bool = False, progress=print) -> list[dict]:
    """Time each (problem, implementation) that has a function; the modelled time rides along."""
    from .. import verify

    rows = []
    for i, p in enumerate(problems):
        data = materialize(p.args, seed=i)
        for impl in (x for x in impls if x.family == p.family and x.fn is not None):
            _, v = _modelled(model_rows, p.name, impl.name, chip)
            options = runner_options(v)
            fn = jax.jit(impl.call(p.kwargs, chip, options), donate_argnums=impl.donate)
            args = list(impl.args(data, p.params))

            def step(*_):  # donated caches come back updated: feed them to the next call
                out = fn(*args)
                for pos, i_arg in enumerate(impl.donate):
                    args[i_arg] = out[1 + pos]
                return out

            kw = {"clock": clock} if clock else {}
            try:
                with impl.tracing(chip or "v6e"):
                    if interpret:
                        with verify.interpret("fast"):
                            t = timing.measure(step, runs=runs, warmup=warmup, device=device, sync=sync, **kw)
                    else:
                        t = timing.measure(step, runs=runs, warmup=warmup, device=device, sync=sync, **kw)
            except Exception as e:
                rows.append({"problem": p.name, "impl": impl.name, "device": device, "error": verify.first_line(e)})
                continue
            modelled = v and v.get("layer_s_0.35us")
            rows.append({"problem": p.name, "impl": impl.name, **t.to_dict(), "chip": chip, "modelled_s": modelled})
            progress(f"  measured {p.name:<26} {impl.name:<36} {t.median_s * 1e6:9.1f} us"
                     + (f" (modelled {modelled * 1e6:.1f} us)" if modelled else ""))
    return rows


def runner_options(chip_result: dict | None) -> dict:
    """The options (e.g. a searched tiling) a modelled row ran with, as the implementation takes them."""
    from .runner import _options

    return _options((chip_result or {}).get("options") or {})


def calibrate(model_rows: list[dict], measured: list[dict], chip: str) -> dict:
    """Fit the per-step cost (grid steps and XLA ops) and the per-DMA-loop-iteration cost to TPU timings.

    Model per row: measured ~= modelled at 0 us + a x steps + b x loop iterations (least squares,
    a, b >= 0); then each ranking of ours against the best anchor is redone at (a, b)."""
    import numpy as np

    xs, ys, keys = [], [], []
    for m in measured:
        row, v = _modelled(model_rows, m.get("problem"), m.get("impl"), chip)
        if v is None or "median_s" not in m or "calls" not in v:
            continue
        steps = sum(k["grid_steps"] for k in v["calls"]) + v["glue"]["ops"]
        loops = sum(k.get("loop_steps", 0) for k in v["calls"])
        xs.append((steps, loops))
        ys.append(m["median_s"] - v["layer_s_0us"])
        keys.append((row["problem"], row["impl"], row["kind"], v["layer_s_0us"], steps, loops))
    if len(xs) < 2:
        return {"rows": len(xs), "note": "too few timed rows to calibrate"}
    a_, b_ = np.linalg.lstsq(np.asarray(xs, float), np.asarray(ys, float), rcond=None)[0]
    a_, b_ = max(float(a_), 0.0), max(float(b_), 0.0)
    fitted = {k: k[3] + a_ * k[4] + b_ * k[5] for k in keys}
    err = [abs(fitted[k] - (y + k[3])) / (y + k[3]) for k, y in zip(keys, ys)]
    rankings = []
    for prob in dict.fromkeys(k[0] for k in keys):
        ours = [t for k, t in fitted.items() if k[0] == prob and k[2] == "ours"]
        anchors = [(t, k[1]) for k, t in fitted.items() if k[0] == prob and k[2] == "anchor"]
        if ours and anchors:
            best = min(anchors)
            rankings.append({"problem": prob, "best_anchor": best[1], "anchor_over_ours": best[0] / ours[0]})
    return {"rows": len(xs), "step_cost_us": a_ * 1e6, "dma_loop_iteration_cost_us": b_ * 1e6,
            "median_relative_error": float(np.median(err)), "rankings": rankings}


def moe_decode_layers(experts_impls: dict[str, Callable | None], *, device: str, batches=MOE_DECODE_BATCHES,
                      config_overrides: dict | None = None, runs: int = 20, warmup: int = 3,
                      clock: Callable[[], float] | None = None, sync: Callable[..., None] = synchronize,
                      progress=print) -> list[dict]:
    """Time one Qwen3-30B-A3B MoE block per decode step under each experts implementation.

    ``experts_impls`` maps an implementation name to the function to register in transformers'
    ALL_EXPERTS_FUNCTIONS (None for built-ins such as "grouped_mm").
    """
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    shape = dict(hidden_size=2048, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768)
    shape.update(config_overrides or {})
    config = Qwen3MoeConfig(**shape, experts_implementation="grouped_mm")
    torch.manual_seed(0)
    layer = Qwen3MoeSparseMoeBlock(config).to(device=device, dtype=torch.bfloat16).eval()
    rows = []
    for name, fn in experts_impls.items():
        if fn is not None:
            ALL_EXPERTS_FUNCTIONS.register(name, fn)
        config._experts_implementation = name
        for b in batches:
            x = torch.randn(b, 1, shape["hidden_size"], device=device, dtype=torch.bfloat16)
            kw = {"clock": clock} if clock else {}
            with torch.inference_mode():
                t = timing.measure(layer, x, runs=runs, warmup=warmup, device=device, sync=sync, **kw)
            rows.append({"problem": f"Qwen3-30B-A3B MoE block decode B={b}", "impl": f"transformers experts={name}",
                         **t.to_dict(), "config": shape})
            progress(f"  measured MoE block B={b:<4} experts={name:<24} {t.median_s * 1e6:9.1f} us")
    return rows


def run(problems, impls, model_rows, *, progress=print, jax_device=None, **kw) -> dict[str, Any]:
    """On a TPU host: time every row and the MoE decode layers (grouped_mm vs ours).

    ``jax_device`` (default: JAX's first device) and ``kw`` (clock, sync, runs, warmup, interpret)
    exist so the path can be exercised with stand-ins."""
    jax_device = jax_device or jax.devices()[0]
    if jax_device.platform != "tpu":
        msg = (f"this host has TPU chips but JAX runs on {jax_device.platform}: "
               "run with JAX_PLATFORMS=tpu to time on the TPU")
        progress("  " + msg)
        return {"device": str(jax_device), "rows": [], "skipped": msg}
    chip = chip_of(jax_device)
    rows = time_rows(problems, impls, model_rows, chip=chip, device=str(jax_device), progress=progress, **kw)
    calibration = calibrate(model_rows, rows, chip)
    progress(f"  calibration: {calibration}")
    if not on_torchtpu_host():  # torch_tpu missing, or installed on a host whose chip it did not bring up
        progress("  TorchTPU's `tpu` device is not up: transformers' MoE layers are not timed")
    else:
        experts: dict[str, Callable | None] = {"grouped_mm": None}
        ours = _our_experts_forward()
        if ours is not None:
            experts["pallas_hub_ragged_dot"] = ours
        rows += moe_decode_layers(experts, device="tpu", progress=progress)
    return {"device": str(jax_device), "chip": chip, "rows": rows, "calibration": calibration,
            "note": "measured on this TPU host: median of N runs after warm-up, synchronised"}


def _our_experts_forward():
    """The experts function our ragged_dot kernel declares in REGISTRATIONS, if the manifest has it."""
    from ..hub import manifest as mf
    from ..hub.build import build_kernel, load_built

    spec = mf.load_manifest().kernels.get("ragged_dot")
    if spec is None:
        return None
    module = load_built(build_kernel(spec))
    for reg in getattr(module, "REGISTRATIONS", []):
        if reg.get("registry") == "experts":
            return getattr(module, reg["function"])
    return None
