"""``justapi bench compare``: after / before of ``benchmarks/peers_bench.sh`` with JUSTAPI_BEFORE, the order of the two
servers cancelled out.

`justapi bench serve` measures its servers one after another, and on the 2-core VM the one measured second read ~5%
slower on W1 (an A/A run with the peers up: 0.88-1.01x, docs/benchmarks.md). So `peers_bench.sh` runs each loaded
workload, and S1, twice: its main pass lists "justapi" first (peers_*.json), a second pass with a fresh seed lists
"justapi-before" first (peers_*_reversed.json). Each pass gives a ratio free of the other's prompts; their
geometric mean has the order's effect cancelled to first order. The spread of the two says how far to trust it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

FIGURES = [("out tok/s", "output_throughput", None), ("TTFT p50", "ttft_ms", "p50"), ("TPOT p99", "tpot_ms", "p99")]
# one stream: its decode rate is 1000 / TPOT p50
FIGURES_S1 = [("TPOT p50", "tpot_ms", "p50"), ("TTFT p50", "ttft_ms", "p50")]
WORKLOADS = ("S1", "W1", "W2", "W3")


def _figures(path: Path) -> dict[str, dict]:
    return {s["name"]: s["figures"] for s in json.loads(path.read_text())["servers"]}


def _value(figs: dict, key: str, pct: str | None) -> float:
    return figs[key] if pct is None else figs[key][pct]


def before_after(folder: str | Path, after: str = "justapi", before: str = "justapi-before") -> str:
    """The table of after / before for each workload whose two passes are in ``folder``: each order's ratio and
    their geometric mean."""
    out = Path(folder)
    lines = [f"{'workload':<9}{'figure':<11}{'after listed 1st':>18}{'after listed 2nd':>18}{'geo. mean':>11}"]
    for w in WORKLOADS:
        main_run, reversed_run = out / f"peers_{w}.json", out / f"peers_{w}_reversed.json"
        if not (main_run.exists() and reversed_run.exists()):
            continue
        passes = [_figures(main_run), _figures(reversed_run)]
        for path, p in zip((main_run, reversed_run), passes):
            if not {after, before} <= p.keys():
                raise ValueError(f"{path} has the servers {sorted(p)}, not both {after!r} and {before!r}")
        for label, key, pct in FIGURES_S1 if w == "S1" else FIGURES:
            ratios = [_value(p[after], key, pct) / _value(p[before], key, pct) for p in passes]
            mean = math.sqrt(ratios[0] * ratios[1])
            lines.append(f"{w:<9}{label:<11}{ratios[0]:>17.3f}x{ratios[1]:>17.3f}x{mean:>10.3f}x")
    return "\n".join(lines)
