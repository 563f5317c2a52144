"""PNG plots of benchmark runs: latency vs request rate, throughput vs request rate, isolated vs colocated (the
ratios colocated / isolated of output throughput and P99 TPOT, per label and rate).

A run is one record of a result JSON's ``runs`` (``serve.py``); a series is the runs of one ``(label,
condition)``, e.g. ``blink isolated``. ``request_rate`` is a number or ``"inf"`` (as vLLM writes it, so
``float()`` reads both); rates are categories on the x axis, ``inf`` (everything at once) last.
"""
from __future__ import annotations

from pathlib import Path

LATENCY_PNG, THROUGHPUT_PNG, COLOCATION_PNG = "latency_vs_rate.png", "throughput_vs_rate.png", \
    "isolated_vs_colocated.png"


def series(runs: list[dict]) -> dict[str, list[dict]]:
    """``"<label> <condition>"`` -> its runs in increasing rate order."""
    grouped: dict[str, list[dict]] = {}
    for run in runs:
        grouped.setdefault(f"{run['label']} {run['condition']}", []).append(run)
    return {name: sorted(rs, key=lambda r: float(r["request_rate"])) for name, rs in grouped.items()}


def write_plots(runs: list[dict], plot_dir) -> list[Path]:
    """Write the PNGs for ``runs`` into ``plot_dir`` (created); the colocation plot only when some run is
    colocated. Returns the paths written. Needs matplotlib (the bench extra): ``ImportError`` naming it otherwise."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("plots need matplotlib, which the bench extra installs: pip install 'blink-serve[bench]'",
                          name="matplotlib") from e

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    rates = sorted({float(r["request_rate"]) for r in runs})
    x = {rate: i for i, rate in enumerate(rates)}
    labels = ["inf" if rate == float("inf") else f"{rate:g}" for rate in rates]
    written = []

    def save(fig, name):
        fig.tight_layout()
        fig.savefig(plot_dir / name, dpi=120)
        plt.close(fig)
        written.append(plot_dir / name)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, metric, title in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for name, rs in series(runs).items():
            xs = [x[float(r["request_rate"])] for r in rs]
            line, = ax.plot(xs, [r[f"median_{metric}_ms"] for r in rs], marker="o", label=f"{name} P50")
            ax.plot(xs, [r[f"p99_{metric}_ms"] for r in rs], marker="x", linestyle="--", color=line.get_color(),
                    label=f"{name} P99")
        ax.set(title=f"{title} vs request rate", xlabel="request rate (req/s)", ylabel=f"{title} (ms)", yscale="log")
        ax.set_xticks(range(len(rates)), labels)
        ax.legend(fontsize=7)
    save(fig, LATENCY_PNG)

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rs in series(runs).items():
        ax.plot([x[float(r["request_rate"])] for r in rs], [r["output_throughput"] for r in rs], marker="o",
                label=name)
    ax.set(title="Output token throughput vs request rate", xlabel="request rate (req/s)", ylabel="tokens/s",
           yscale="log")
    ax.set_xticks(range(len(rates)), labels)
    ax.legend(fontsize=7)
    save(fig, THROUGHPUT_PNG)

    pairs = colocation_pairs(runs)
    if pairs:
        fig, ax = plt.subplots(figsize=(max(6, len(pairs)), 4))
        positions = range(len(pairs))
        for offset, key, name in ((-0.2, "output_throughput", "output tokens/s"), (0.2, "p99_tpot_ms", "P99 TPOT")):
            ax.bar([i + offset for i in positions], [col[key] / iso[key] if iso[key] else 0 for iso, col in pairs],
                   0.4, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(positions, [f"{iso['label']} @ {iso['request_rate']}" for iso, _ in pairs], rotation=30,
                      ha="right", fontsize=7)
        ax.set(title=f"colocated ({pairs[0][1]['interference']} hogs) / isolated", ylabel="ratio")
        ax.legend(fontsize=7)
        save(fig, COLOCATION_PNG)
    return written


def colocation_pairs(runs: list[dict]) -> list[tuple[dict, dict]]:
    """``(isolated run, colocated run)`` of the same label and rate, in label then rate order."""
    isolated = {(r["label"], float(r["request_rate"])): r for r in runs if r["condition"] == "isolated"}
    colocated = {(r["label"], float(r["request_rate"])): r for r in runs if r["condition"] == "colocated"}
    return [(isolated[key], colocated[key]) for key in sorted(isolated) if key in colocated]
