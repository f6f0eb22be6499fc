"""Print a markdown table from `vllm bench serve` result files: python summarize.py RESULTS_DIR W1 [W2 ...]."""

from __future__ import annotations

import json
import os
import sys

LABELS = ["justapi-static", "justapi-continuous", "llama_server", "vllm"]


def main() -> None:
    folder, workloads = sys.argv[1], sys.argv[2:]
    print("| workload | engine | done/failed | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms |")
    print("|---|---|---|---|---|---|---|---|")
    for w in workloads:
        for label in LABELS:
            path = os.path.join(folder, f"{label}_{w}_r1.json")
            if not os.path.exists(path):
                continue
            r = json.load(open(path))
            failed = r.get("failed", r.get("num_prompts", 0) - r.get("completed", 0))
            print(f"| {w} | {label} | {r['completed']}/{failed} | {r['output_throughput']:.1f} | "
                  f"{r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | {r['median_tpot_ms']:.1f} | {r['p99_tpot_ms']:.1f} |")


if __name__ == "__main__":
    main()
