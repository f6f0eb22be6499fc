"""The planner's first-principles estimate of machines this project cannot run on, against published figures of the
same model shape and workload (issue 61's anchors): each anchor simulated (the engine's Scheduler on the roofline
cost of plan/hardware.py's device description) and printed beside the published figure, with the error.

Anchors (docs/plan.md has their sources):
- vLLM's nightly latency test (H200 and 8xH100 pages): Llama 3 8B at TP 1 and 70B at TP 4, a batch of 8 prompts of
  32 tokens generating 128 each, all at once; the figure is the batch's mean latency.
- SGLang's H200 benchmark (datacrunch-research/h200-benchmarks): Llama 3.3 70B at TP 4, radix cache off,
  `bench_serving --dataset-name random --random-input 1024 --random-output 1024` (lengths uniform in 1..1024) at 1,
  4 and 8 requests a second (300, 1200, 2400 prompts) and all at once (3000): output tok/s, median TTFT, median ITL.

    python benchmarks/plan_anchor.py [--only vllm|sglang]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys

from justapi.bench import report
from justapi.config import SchedulerConfig
from justapi.plan.hardware import HARDWARE, RooflineCosts, model_shape
from justapi.plan.simulator import SimRequest, Simulation

VLLM_LATENCY = [  # (model, TP, hardware, published mean latency of the batch in ms)
    ("llama-3.1-8b", 1, "h200", 833.421), ("llama-3.1-70b", 4, "h200", 2077.53),
    ("llama-3.1-8b", 1, "h100", 997.542), ("llama-3.1-70b", 4, "h100", 2444.47),
]
SGLANG_70B_H200 = [  # (rate, prompts, published output tok/s, median TTFT ms, median ITL ms)
    (1.0, 300, 537.41, 85.75, 13.64), (4.0, 1200, 2047.91, 106.06, 19.42), (8.0, 2400, 3515.02, 191.41, 70.76),
    (float("inf"), 3000, 4520.70, 91282.21, 159.01),
]


def costs(model: str, tp: int, hardware: str) -> RooflineCosts:
    return RooflineCosts(model_shape(model), HARDWARE[hardware], tp)


def config(c: RooflineCosts, max_seqs: int, chunk: int, prefix_cache: bool) -> SchedulerConfig:
    return SchedulerConfig(num_blocks=c.kv_pool_blocks(16), max_seqs=max_seqs, max_decode=max_seqs,
                           chunk_size=chunk, max_prefill=max_seqs, max_model_len=4096, prefix_cache=prefix_cache)


def vllm_latency() -> list[tuple]:
    rows = []
    rng = random.Random(0)
    for model, tp, hw, published in VLLM_LATENCY:
        c = costs(model, tp, hw)
        reqs = [SimRequest([rng.randrange(3, 100000) for _ in range(32)], 128) for _ in range(8)]
        run = Simulation(config(c, 256, 8192, True), c).run(reqs)
        rows.append((f"vLLM latency, {model} TP {tp}, {hw}, batch 8 x (32 in, 128 out)", "latency ms", published,
                     run.elapsed * 1000))
    return rows


def sglang_serving() -> list[tuple]:
    rows = []
    c = costs("llama-3.1-70b", 4, "h200")  # Llama 3.3 70B has 3.1 70B's shape
    for rate, prompts, out_tps, ttft, itl in SGLANG_70B_H200:
        rng = random.Random(1)
        t, reqs = 0.0, []
        for _ in range(prompts):
            reqs.append(SimRequest([rng.randrange(3, 100000) for _ in range(rng.randint(1, 1024))],
                                   rng.randint(1, 1024), at=t))
            t += rng.expovariate(rate) if rate != float("inf") else 0.0
        run = Simulation(config(c, 1024, 8192, False), c).run(reqs)
        figures = report.summarize(run.results, run.elapsed)
        itls = [g for r in run.results for g in r.itls]
        label = f"SGLang, 70B TP 4, h200, random 1..1024 in/out, rate {rate:g}, {prompts} prompts"
        rows += [(label, "output tok/s", out_tps, figures["output_throughput"]),
                 (label, "TTFT p50 ms", ttft, figures["ttft_ms"]["p50"]),
                 (label, "ITL p50 ms", itl, statistics.median(itls) * 1000)]
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=["vllm", "sglang"], default=None)
    args = p.parse_args(argv)
    for name in ("h200", "h100"):
        print(f"# {HARDWARE[name].describe()}")
    rows = (vllm_latency() if args.only != "sglang" else []) + (sglang_serving() if args.only != "vllm" else [])
    print("| anchor | figure | published | estimated | error |\n|---|---|---|---|---|")
    for label, figure, published, estimated in rows:
        print(f"| {label} | {figure} | {published:g} | {estimated:.1f} | {estimated / published - 1:+.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
