"""A/B of prefill attention: one prefill step's forward pass with justapi/model/attention.py's fused sequence
attention as it is at a git revision against the working tree's, on SmolLM2 with --dtype auto (bf16 KV cache),
interleaved in one process, best of --reps.

usage: python benchmarks/prefill_attention_ab.py [--base HEAD~1] [--reps 4]

Three steps are captured from real prompts: a 512-token chunk and a 345-token prompt (W1's mean chunk) with no
cached prefix, and the 188-token tail of a 700-token prompt over its 512 cached tokens. The two forward passes'
logits are compared too (largest difference).
"""

from __future__ import annotations

import argparse
import inspect
import os
import subprocess
import sys
import time
import types

import justapi.model.attention as A
import justapi.model.llama as L
from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default="HEAD~1")
    ap.add_argument("--reps", type=int, default=4)
    args = ap.parse_args()
    src = subprocess.run(["git", "-C", ROOT, "show", f"{args.base}:justapi/model/attention.py"], capture_output=True,
                         text=True, check=True).stdout
    old = types.ModuleType("base_attention")
    old.__package__ = "justapi.model"  # its relative imports (quant) resolve to the working tree's
    sys.modules[old.__name__] = old  # dataclasses look their module up
    exec(compile(src, "base_attention", "exec"), old.__dict__)  # noqa: S102 - our own source at another revision
    base_fn = old._sequence_attention_fused
    if "compute_dtype" not in inspect.signature(base_fn).parameters:  # before paged_attention took the model's dtype
        old._sequence_attention_fused = lambda q, k, v, span, scale, compute_dtype=None: base_fn(q, k, v, span, scale)
    llm = LLM(default_model_path(), scheduled=True, pool_blocks=512, show_progress=False)
    model = llm.engine.model
    forward = L.LlamaModel.forward
    captured = {}

    def spy(self, *a, **k):
        captured.setdefault(a[0].shape[0], (a, k))
        return forward(self, *a, **k)

    L.LlamaModel.forward = spy
    llm.generate([[5000 + i * 7 for i in range(512)]], SamplingParams(max_tokens=1, temperature=0))
    llm.generate([[6000 + i * 7 for i in range(700)]], SamplingParams(max_tokens=1, temperature=0))
    llm.generate([[7000 + i * 7 for i in range(345)]], SamplingParams(max_tokens=1, temperature=0))
    L.LlamaModel.forward = forward
    new_fn = A._sequence_attention_fused
    print(f"forward pass of a prefill step, attention at {args.base} vs working tree, best of {args.reps}")
    for rows in (512, 345, 188):
        a, k = captured[rows]
        best = {"base": 1e9, "new": 1e9}
        logits = {}
        for _ in range(args.reps):
            for name, fn in (("base", old._sequence_attention_fused), ("new", new_fn)):
                A._sequence_attention_fused = fn
                for span in a[2].seqs:
                    if hasattr(span, "bias"):
                        span.bias = None
                t = time.perf_counter()
                logits[name] = forward(model, *a, **k)
                best[name] = min(best[name], time.perf_counter() - t)
        A._sequence_attention_fused = new_fn
        ctx = [s.context_len for s in a[2].seqs]
        diff = (logits["new"].float() - logits["base"].float()).abs().max().item()
        print(f"{rows} new tokens (context {ctx}): base {best['base'] * 1e3:.1f} ms, new {best['new'] * 1e3:.1f} ms, "
              f"new/base {best['new'] / best['base']:.3f}; logits differ by {diff:.3g} at most")


if __name__ == "__main__":
    main()
