"""The throughput–latency chart of a sweep: TTFT p99 and TPOT p99 against achieved output throughput."""

from __future__ import annotations


def pyplot():
    """matplotlib's pyplot, drawing to files only; a one-line error where it is not installed (it comes with the
    bench extra, so that the server's own install does not pull it)."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("charts need matplotlib: pip install 'justapi[bench]'") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def draw_sweep(sweep: dict, path: str) -> None:
    """``sweep``: {"servers": [{"name", "points": [{"rate", "figures"}...]}...]} → a two-panel PNG at ``path``."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for server in sweep["servers"]:
        pts = [p for p in server["points"] if p["figures"]["completed"] > 0]
        x = [p["figures"]["output_throughput"] for p in pts]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms")):
            y = [p["figures"][key]["p99"] for p in pts]
            ax.plot(x, y, marker="o", label=server["name"])
            for xi, yi, p in zip(x, y, pts):
                if yi is not None:
                    rate = "inf" if p["rate"] == float("inf") else f"{p['rate']:g}"
                    ax.annotate(f"{rate}/s", (xi, yi), textcoords="offset points", xytext=(3, 3), fontsize=7)
    for ax, title in zip(axes, ("TTFT p99", "TPOT p99")):
        ax.set_xlabel("output throughput (tok/s)")
        ax.set_ylabel(f"{title} (ms)")
        ax.set_title(f"{title} vs throughput")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(sweep.get("title", "justapi bench sweep"), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
