"""After / before of `peers_bench.sh` with JUSTAPI_BEFORE, with the order of the two servers cancelled out.

usage: python benchmarks/before_after.py [DIR]   (default: bench_results)

`justapi bench serve` measures its servers one after another, and on this VM the one measured second reads ~5%
slower on W1 (an A/A run with the peers up: 0.88-1.01x, docs/benchmarks.md). So `peers_bench.sh` runs each loaded
workload, and S1, twice: its main pass lists "justapi" first (peers_*.json), a second pass with a fresh seed lists
"justapi-before" first (peers_*_reversed.json). Each pass gives a ratio free of the other's prompts; their
geometric mean has the order's effect cancelled to first order. The spread of the two says how far to trust it.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

FIGURES = [("out tok/s", "output_throughput", None), ("TTFT p50", "ttft_ms", "p50"), ("TPOT p99", "tpot_ms", "p99")]
# one stream: its decode rate is 1000 / TPOT p50
FIGURES_S1 = [("TPOT p50", "tpot_ms", "p50"), ("TTFT p50", "ttft_ms", "p50")]


def figures(path: Path) -> dict[str, dict]:
    return {s["name"]: s["figures"] for s in json.loads(path.read_text())["servers"]}


def value(figs: dict, key: str, pct: str | None) -> float:
    return figs[key] if pct is None else figs[key][pct]


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_results")
    print(f"{'workload':<9}{'figure':<11}{'after listed 1st':>18}{'after listed 2nd':>18}{'geo. mean':>11}")
    for w in ("S1", "W1", "W2", "W3"):
        main_run, reversed_run = out / f"peers_{w}.json", out / f"peers_{w}_reversed.json"
        if not (main_run.exists() and reversed_run.exists()):
            continue
        passes = [figures(main_run), figures(reversed_run)]
        for label, key, pct in FIGURES_S1 if w == "S1" else FIGURES:
            ratios = [value(p["justapi"], key, pct) / value(p["justapi-before"], key, pct) for p in passes]
            mean = math.sqrt(ratios[0] * ratios[1])
            print(f"{w:<9}{label:<11}{ratios[0]:>17.3f}x{ratios[1]:>17.3f}x{mean:>10.3f}x")


if __name__ == "__main__":
    main()
