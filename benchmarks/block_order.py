"""How much of the decode batch's K/V lies in order in memory in a loaded run: of each sequence's adjacent pairs of
blocks in the decode kernel's block tables, the share whose second block is the next id (so, the cache being laid
out [kv_heads, blocks, block_size, head_dim], the next bytes of that head's K or V).

usage: python benchmarks/block_order.py [--requests 128] [--concurrency 32] [--prompt 64:512] [--output 16:256]

W1's shape by default: random prompts, EOS ignored, greedy, at most --concurrency in flight, a new request as soon
as one finishes, the engine in process with the server's defaults. One layer's tables are read per step.
`kernels_bench.py attention --block-order random|in-order` times the decode kernel at either extreme.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import justapi.model.llama as llama
from justapi.engine.llm import LLM
from justapi.model.gguf_loader import default_model_path
from justapi.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parent))
from w1_bound import span  # noqa: E402  (the lengths "LO:HI" as the range they take)


class TableCounter:
    """Wraps llama.py's paged_attention: counts the adjacent block pairs of the first layer's decode tables."""

    def __init__(self, attention, layers: int) -> None:
        self.attention, self.layers = attention, layers
        self.calls = self.pairs = self.in_order = self.reversed = 0

    def __call__(self, q, k_cache, v_cache, meta, *args, **kwargs):
        if self.calls % self.layers == 0 and meta.decode_block_tables is not None:
            block_size = k_cache.shape[2]
            for table, context in zip(meta.decode_block_tables.tolist(), meta.decode_context_lens.tolist()):
                blocks = table[: -(-context // block_size)]
                for a, b in zip(blocks, blocks[1:]):
                    self.pairs += 1
                    self.in_order += b == a + 1
                    self.reversed += b == a - 1
        self.calls += 1
        return self.attention(q, k_cache, v_cache, meta, *args, **kwargs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt", type=span, default=span("64:512"))
    ap.add_argument("--output", type=span, default=span("16:256"))
    args = ap.parse_args()

    engine = LLM(default_model_path(), show_progress=False).engine
    counter = TableCounter(llama.paged_attention, engine.model_config.num_layers)
    llama.paged_attention = counter
    rng = random.Random(0)
    work = [([rng.randrange(100, 40000) for _ in range(rng.choice(args.prompt))], rng.choice(args.output))
            for _ in range(args.requests)]
    in_flight: set[str] = set()
    sent = 0
    while sent < len(work) or in_flight:
        while sent < len(work) and len(in_flight) < args.concurrency:
            ids, out = work[sent]
            engine.add_request(f"r{sent}", ids, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
            in_flight.add(f"r{sent}")
            sent += 1
        for output in engine.step():
            if output.finished:
                in_flight.discard(output.request_id)
    share = lambda n: 100 * n / max(counter.pairs, 1)  # noqa: E731
    print(f"{args.requests} requests, at most {args.concurrency} in flight: {counter.pairs} adjacent block pairs in "
          f"the decode tables, {share(counter.in_order):.1f}% in order, {share(counter.reversed):.1f}% reversed, "
          f"{share(counter.pairs - counter.in_order - counter.reversed):.1f}% elsewhere")


if __name__ == "__main__":
    main()
