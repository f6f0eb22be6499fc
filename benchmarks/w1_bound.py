"""The most output tok/s any engine computing in fp32 could reach on a workload, from its arithmetic and this
machine's measured matmul rate: every product, attention included, counted at the best rate torch's fp32 matmul
reaches here, nothing else counted (no norms, no dispatch, no memory traffic).

usage: python benchmarks/w1_bound.py [--model GGUF] [--requests 128] [--prompt 64:512] [--output 16:256]
                                     [--gflops G] [--arrival-rate R]

Defaults: W1 of docs/benchmarks.md. Lengths are uniform over the ranges (the expectation is summed, length by
length). The architecture is read from the GGUF. Per request of prompt length L and output length O:

    layers    2 FLOP per weight for each of the L + O - 1 tokens fed (the last output token is not fed back)
    head      2 FLOP per weight for each of the O positions whose logits are sampled
    attention 4 * heads * head_dim * layers FLOP per (query, visible key): QK^T and PV; query i sees i keys

``--arrival-rate R``: the requests arrive at R a second (W3's Poisson arrivals), so the run lasts at least as long as
their arrivals (requests / R), which the arithmetic alone does not count.

``--gflops``: use this rate instead of measuring (the matmul's best GFLOP/s over square sizes 1024-4096, all
threads, best of 5 each).
"""

from __future__ import annotations

import argparse
import time

import torch

from justapi.model.gguf_loader import default_model_path, open_gguf, read_model_config


def span(text: str) -> range:
    lo, _, hi = text.partition(":")
    return range(int(lo), int(hi or lo) + 1)


def matmul_gflops() -> float:
    best = 0.0
    for n in (1024, 2048, 3072, 4096):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(5):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--prompt", type=span, default=span("64:512"))
    ap.add_argument("--output", type=span, default=span("16:256"))
    ap.add_argument("--gflops", type=float, default=None)
    ap.add_argument("--arrival-rate", type=float, default=None, help="requests a second (W3: 1.2), else all at once")
    args = ap.parse_args()
    path = args.model or default_model_path()
    cfg = read_model_config(open_gguf(path), path)
    h, d = cfg.hidden_size, cfg.head_dim
    layer = h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2 + 3 * h * cfg.intermediate_size
    weights = cfg.num_layers * layer
    head = cfg.vocab_size * h
    attn = 4 * cfg.num_heads * d * cfg.num_layers  # per (query, key) pair

    prefill = decode = 0.0
    for n_in in args.prompt:
        for n_out in args.output:
            prefill += n_in * 2 * weights + 2 * head + attn * n_in * (n_in + 1) / 2
            decode += (n_out - 1) * (2 * weights + 2 * head) + attn * sum(range(n_in + 1, n_in + n_out))
    pairs = len(args.prompt) * len(args.output)
    prefill, decode = prefill / pairs * args.requests, decode / pairs * args.requests
    prompt_tokens = args.requests * sum(args.prompt) / len(args.prompt)
    output_tokens = args.requests * sum(args.output) / len(args.output)
    rate = args.gflops or matmul_gflops()
    seconds = (prefill + decode) / (rate * 1e9)
    per_decode = decode / (args.requests * (sum(args.output) / len(args.output) - 1))
    print(f"model {path}: {weights / 1e6:.1f} M layer weights, head {head / 1e6:.1f} M")
    print(f"workload: {args.requests} requests, {prompt_tokens:.0f} prompt and {output_tokens:.0f} output tokens")
    print(f"arithmetic: prefill {prefill / 1e12:.2f} TFLOP, decode {decode / 1e12:.2f} TFLOP, "
          f"{per_decode / 1e6:.0f} MFLOP per decode token")
    print(f"fp32 matmul rate: {rate:.1f} GFLOP/s ({'given' if args.gflops else 'measured'}, "
          f"{torch.get_num_threads()} threads)")
    print(f"at that rate: prefill alone {prefill / (rate * 1e9):.1f} s, all {seconds:.1f} s -> at most "
          f"{output_tokens / seconds:.0f} out tok/s; decode alone at most {rate * 1e9 / per_decode:.0f} tok/s")
    if args.arrival_rate:  # the requests cannot all be served before the last one arrives
        arrivals = args.requests / args.arrival_rate
        print(f"arrivals at {args.arrival_rate:g} a second: the last one ~{arrivals:.0f} s in -> at most "
              f"{output_tokens / max(seconds, arrivals):.0f} out tok/s")


if __name__ == "__main__":
    main()
