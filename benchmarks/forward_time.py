"""Best-of times of one step's forward pass on SmolLM2 (--dtype auto): 1 and 8 decode rows and a 512-token prefill
chunk, the inputs captured from real steps. For comparing two checkouts whose model classes differ (forward_ab.py
swaps only the forward function): run it once per checkout, alternating, with PYTHONPATH naming the checkout.

usage: PYTHONPATH=DIR python benchmarks/forward_time.py [--reps 30] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import time

import justapi
from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    llm = LLM(default_model_path(), pool_blocks=512, show_progress=False)
    model = llm.engine.model
    cls = type(model)
    forward = cls.forward
    captured = {}

    def spy(self, *a, **k):
        captured.setdefault(a[0].shape[0], (a, k))
        return forward(self, *a, **k)

    cls.forward = spy
    llm.generate([[400 + i for i in range(20)]], SamplingParams(max_tokens=3, temperature=0))
    llm.generate([[400 + i + j for i in range(20)] for j in range(8)], SamplingParams(max_tokens=30, temperature=0))
    llm.generate([[5000 + i * 7 for i in range(512)]], SamplingParams(max_tokens=1, temperature=0))
    cls.forward = forward
    best = {}
    for n in (1, 8, 512):
        a, k = captured[n]
        times = []
        for _ in range(args.reps if n < 512 else max(3, args.reps // 10)):
            t = time.perf_counter()
            for _ in range(5):
                forward(model, *a, **k)
            times.append((time.perf_counter() - t) / 5)
        best[n] = min(times) * 1e3
    print(json.dumps({"src": justapi.__file__, "ms": best}))


if __name__ == "__main__":
    main()
