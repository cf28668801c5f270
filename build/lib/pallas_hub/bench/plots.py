"""PNG plots of a bench result: a roofline chart and modelled time per shape (cost model, not measured)."""

from __future__ import annotations

from pathlib import Path

from ..vendored._chips import chip as get_chip

KIND_MARKERS = {"ours": "o", "anchor": "s"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def roofline(result: dict, path: Path, chip: str = "v6e") -> None:
    """Achieved (modelled) FLOP/s against arithmetic intensity, under the chip's roofline."""
    plt = _pyplot()
    c = get_chip(chip)
    rows = [r for r in result["rows"] if r["status"] == "ok" and r["hbm_bytes"] and r["flops"]]
    fig, ax = plt.subplots(figsize=(9, 6))
    xs = [r["flops"] / r["hbm_bytes"] for r in rows] or [1.0]
    lo, hi = min(xs + [1.0]) / 2, max(xs + [c.peak_flops / c.hbm_bandwidth]) * 4
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    ax.plot(grid, [min(c.peak_flops, x * c.hbm_bandwidth) for x in grid], "k-", lw=1.5, label=f"{chip} roofline")
    impls = sorted({r["impl"] for r in rows})
    cmap = plt.get_cmap("tab10")
    for i, name in enumerate(impls):
        sel = [r for r in rows if r["impl"] == name]
        nudge = 1 + 0.04 * (i - len(impls) / 2)  # a small shift keeps coinciding kernels visible
        ax.scatter([nudge * r["flops"] / r["hbm_bytes"] for r in sel], [r["flops"] / r["modelled_s"][chip] for r in sel],
                   marker=KIND_MARKERS.get(sel[0]["kind"], "x"), color=cmap(i % 10), label=name, s=36, alpha=0.85)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (flops / HBM byte, as modelled)")
    ax.set_ylabel(f"modelled FLOP/s on {chip}")
    ax.set_title(f"Kernels on real model shapes: modelled {chip} performance (cost model, not measured)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bars(result: dict, path: Path, chip: str = "v6e") -> None:
    """Modelled time per shape, one bar per implementation, one panel per family; missing rows marked."""
    plt = _pyplot()
    families = [f for f in ("moe", "prefill", "decode") if any(r["family"] == f for r in result["rows"])]
    fig, axes = plt.subplots(len(families), 1, figsize=(12, 3.6 * max(len(families), 1)), squeeze=False)
    cmap = plt.get_cmap("tab10")
    for ax, fam in zip(axes[:, 0], families):
        rows = [r for r in result["rows"] if r["family"] == fam]
        problems = list(dict.fromkeys(r["problem"] for r in rows))
        impls = list(dict.fromkeys(r["impl"] for r in rows))
        width = 0.8 / max(len(impls), 1)
        for j, name in enumerate(impls):
            xs, ys = [], []
            for i, p in enumerate(problems):
                r = next((r for r in rows if r["problem"] == p and r["impl"] == name), None)
                if r is None:
                    continue
                x = i + (j - (len(impls) - 1) / 2) * width
                if r["status"] == "ok":
                    xs.append(x)
                    ys.append(r["modelled_s"][chip] * 1e6)
                else:
                    ax.text(x, 0, "missing" if r["status"] == "missing" else "error", rotation=90,
                            fontsize=6, ha="center", va="bottom", transform=ax.get_xaxis_transform())
            ax.bar(xs, ys, width, label=name, color=cmap(j % 10))
        ideal = [next((r["ideal_s"][chip] * 1e6 for r in rows if r["problem"] == p and r["status"] == "ok"), None)
                 for p in problems]
        ax.scatter([i for i, v in enumerate(ideal) if v], [v for v in ideal if v], marker="_", s=400, color="k",
                   label="ideal (roofline)", zorder=3)
        ax.set_xticks(range(len(problems)))
        ax.set_xticklabels(problems, fontsize=8, rotation=15)
        ax.set_yscale("log")
        ax.set_ylabel(f"modelled {chip} time (us)")
        ax.set_title(f"{fam}: " + ", ".join(dict.fromkeys(r["model"] for r in rows)) + " (cost model, not measured)", fontsize=10)
        ax.legend(fontsize=7, ncol=3)
        ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
