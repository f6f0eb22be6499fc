"""Embeddings a second from a BERT encoder at all-MiniLM-L6-v2's geometry (6 layers, hidden 384, 12 heads, MLP 1536;
random weights in llama.cpp's GGUF layout, fp32): JustAPI's offline engine (`LLM.embed`, every prompt whole in one
step, several prompts a step) against transformers' BertModel on the same weights in batches of 32, the same process
and prompts, each best of ``--rounds``; and the largest difference between their mean-pooled vectors.

usage: python benchmarks/encoder_bench.py [--prompts 256] [--tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))

from justapi import LLM  # noqa: E402
from test_encoders import _hf_encoder  # noqa: E402  (the tests' weight mapping)
from tiny_gguf import WORDPIECE, write_tiny_encoder  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine", nargs="*", default=[], help="LLM options as name=int, e.g. chunk_size=2048")
    args = ap.parse_args()
    path = write_tiny_encoder(os.path.join(tempfile.mkdtemp(), "minilm.gguf"), num_layers=6, hidden=384,
                              num_heads=12, intermediate=1536, context_length=512)
    rng = random.Random(0)
    prompts = [[2] + [rng.randrange(5, len(WORDPIECE)) for _ in range(args.tokens - 2)] + [3]
               for _ in range(args.prompts)]
    llm = LLM(path, dtype="float32", show_progress=False, **{k: int(v) for k, v in (a.split("=") for a in args.engine)})
    model, _ = _hf_encoder(path, "bert")
    ours, theirs = [], []
    for _ in range(args.rounds):
        t = time.perf_counter()
        got = llm.embed(prompts)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        with torch.no_grad():
            ref = torch.cat([model(torch.tensor(prompts[i : i + 32])).last_hidden_state.mean(1)
                             for i in range(0, len(prompts), 32)])
        theirs.append(time.perf_counter() - t)
    ref = ref / ref.norm(dim=1, keepdim=True)
    diff = (torch.tensor(got) - ref).abs().max().item()
    print(f"{args.prompts} prompts of {args.tokens} tokens, {torch.get_num_threads()} threads: JustAPI "
          f"{args.prompts / min(ours):.1f} embeddings/s, transformers BertModel (batches of 32) "
          f"{args.prompts / min(theirs):.1f} embeddings/s; max |difference| {diff:.2e}")


if __name__ == "__main__":
    main()
