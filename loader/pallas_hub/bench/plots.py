"""PNG plots of a bench result, one pair per chip (cost model, not measured):

* ``layers_<chip>.png``: modelled layer time per problem, one bar per implementation (value written at
  the bar's end), the problem's ideal time as a black tick; one panel per family, legend outside;
* ``roofline_<chip>.png``: achieved (modelled) FLOP/s against arithmetic intensity under the chip's
  roofline, for ours and the best anchor of each problem, every point labelled.
"""

from __future__ import annotations

from pathlib import Path

from ..vendored._chips import chip as get_chip

HEADLINE = "layer_s_0.35us"
FAMILIES = (("moe", "MoE experts layer"), ("prefill", "causal prefill"), ("decode", "decode step"),
            ("train", "causal attention training step"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _ok(row, chip):
    v = (row.get("chips") or {}).get(chip) or {}
    return v if v.get("status") == "ok" else None


def layers(result: dict, path: Path, chip: str) -> None:
    plt = _pyplot()
    fams = [(f, t) for f, t in FAMILIES if any(r["family"] == f for r in result["rows"])]
    impls = list(dict.fromkeys(r["impl"] for r in result["rows"]))
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(impls)}
    heights = [len({r["problem"] for r in result["rows"] if r["family"] == f}) *
               len({r["impl"] for r in result["rows"] if r["family"] == f}) for f, _ in fams]
    fig, axes = plt.subplots(len(fams), 1, figsize=(13, 0.23 * sum(heights) + 1.6 * len(fams)),
                             gridspec_kw={"height_ratios": heights or [1]}, squeeze=False)
    for ax, (fam, title) in zip(axes[:, 0], fams):
        rows = [r for r in result["rows"] if r["family"] == fam]
        probs = list(dict.fromkeys(r["problem"] for r in rows))
        names = list(dict.fromkeys(r["impl"] for r in rows))
        y, labels, ticks = 0.0, [], []
        for p in probs:
            top = y
            for name in names:
                r = next((r for r in rows if r["problem"] == p and r["impl"] == name), None)
                v = r and _ok(r, chip)
                if v:
                    ax.barh(y, v[HEADLINE] * 1e6, color=colors[name], height=0.8)
                    ax.text(v[HEADLINE] * 1e6 * 1.05, y, f"{v[HEADLINE] * 1e6:,.0f} us", va="center", fontsize=6)
                elif r is not None:
                    ax.text(1, y, "missing" if r["status"] == "missing" else "not modelled", va="center", fontsize=6)
                y += 1
            ideal = next((_ok(r, chip)["ideal_s"] for r in rows if r["problem"] == p and _ok(r, chip)), None)
            if ideal:
                ax.plot([ideal * 1e6] * 2, [top - 0.5, y - 0.5], "k-", lw=2)
            ticks.append((top + y - 1) / 2)
            labels.append(p)
            y += 0.8
        ax.set_yticks(ticks)
        ax.set_yticklabels(labels, fontsize=8)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlabel(f"modelled {chip} layer time (us), 0.35 us per step; black: ideal (roofline)")
        ax.set_title(f"{title} on {chip} (cost model, not measured)", fontsize=10)
        ax.grid(True, axis="x", which="both", alpha=0.3)
        handles = [plt.Rectangle((0, 0), 1, 1, color=colors[n]) for n in names]
        ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    roofline(result, Path(path).with_name(f"roofline_{chip}.png"), chip)


def roofline(result: dict, path: Path, chip: str) -> None:
    from .report import comparisons

    plt = _pyplot()
    c = get_chip(chip)
    picks = []
    for e in comparisons(result):
        if e["chip"] != chip:
            continue
        for impl in ("ours", e["best_impl"]):
            r = next((r for r in result["rows"] if r["problem"] == e["problem"] and
                      (r["kind"] == "ours" if impl == "ours" else r["impl"] == impl)), None)
            if r and _ok(r, chip):
                picks.append((r, _ok(r, chip)))
    fig, ax = plt.subplots(figsize=(11, 7))
    xs = [r["min_flops"] / r["min_bytes"] for r, _ in picks] or [1.0]
    lo, hi = min(xs + [1.0]) / 2, max(xs + [c.peak_flops / c.hbm_bandwidth]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(c.peak_flops, x * c.hbm_bandwidth) for x in grid], "k-", lw=1.5, label=f"{chip} roofline")
    for r, v in picks:
        x, yv = r["min_flops"] / r["min_bytes"], r["min_flops"] / v[HEADLINE]
        ours = r["kind"] == "ours"
        ax.scatter([x], [yv], marker="o" if ours else "s", color="tab:blue" if ours else "tab:orange", s=30, zorder=3)
        short = r["problem"].replace("Qwen3 ", "Q ").replace("GPT-OSS ", "G ").replace(" layer", "").replace("causal prefill ", "")
        ax.annotate(("ours " if ours else "") + short, (x, yv), fontsize=6, xytext=(3, 3 if ours else -8),
                    textcoords="offset points")
    ax.scatter([], [], marker="o", color="tab:blue", label="ours")
    ax.scatter([], [], marker="s", color="tab:orange", label="best anchor of the problem")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity of the problem (minimum flops / minimum HBM bytes)")
    ax.set_ylabel(f"useful FLOP/s on {chip} (minimum flops / modelled layer time)")
    ax.set_title(f"Layers on {chip}: modelled (cost model, not measured), 0.35 us per step", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
