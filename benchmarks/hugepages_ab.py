"""Weights and KV cache on transparent huge pages or not (``--no-huge-pages``), in one process: two engines with the
server's defaults run the same W1-shaped steps, their steps interleaved so the host's drift hits both alike.

usage: python benchmarks/hugepages_ab.py [--steps 20] [--pool-blocks N]

Each engine gets 28 decoding requests (prompts of 250-450 tokens, as benchmarks/step_profile.py), then alternates
decode steps and mixed steps (a fresh 345-token prompt prefilled alongside the 28 decodes, finished in its step).
The engines' blocks are first scattered through the pool the way a busy server scatters them (requests of random
lengths added and finished), so the decode reads touch blocks far apart. Prints the median step time of each kind
for each engine, and checks that both produced the same tokens.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from justapi import LLM, SamplingParams
from justapi.model import hugepages
from justapi.model.gguf_loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pool-blocks", type=int, default=8192, help="KV blocks per engine (default: %(default)s)")
    args = ap.parse_args()
    if not hugepages.available():
        raise SystemExit("transparent huge pages are off on this machine: nothing to compare")
    engines = {name: LLM(default_model_path(), scheduled=True, max_seqs=32, pool_blocks=args.pool_blocks,
                         huge_pages=huge, show_progress=False).engine
               for name, huge in (("huge pages", True), ("4 KiB pages", False))}
    vocab = next(iter(engines.values())).model_config.vocab_size
    for engine in engines.values():
        rng = random.Random(0)
        prompt = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
        # churn: short requests of random lengths come and go, so the decoding requests' blocks end up scattered
        for i in range(96):
            engine.add_request(f"c{i}", prompt(rng.randint(16, 400)),
                               SamplingParams(temperature=0, max_tokens=rng.randint(1, 4), ignore_eos=True))
            if i % 3 == 0 and i // 3 < 28:
                engine.add_request(f"d{i // 3}", prompt(rng.randint(250, 450)),
                                   SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True))
        sched = engine.scheduler
        while sched.waiting or len(sched.running) > 28 or any(r.num_computed_tokens < r.num_prompt_tokens
                                                             for r in sched.running):
            engine.step()
        engine.counter = iter(range(1 << 30))
        engine.rng = rng
    # the decode-attention kernel's share, timed on its own: the reads that huge pages should speed up
    kernels = next(iter(engines.values())).model.kernels
    attention = {name: [] for name in engines}
    current = [None]
    if kernels is not None:
        decode_attention = kernels.decode_attention

        class Timed:  # the compiled module's attributes are read-only: hand the model a wrapper instead
            def __getattr__(self, name):
                return getattr(kernels, name)

            def decode_attention(self, *a):
                t = time.perf_counter()
                out = decode_attention(*a)
                attention[current[0]][-1] += time.perf_counter() - t
                return out

        for engine in engines.values():
            engine.model.kernels = Timed()
    outputs = {name: [] for name in engines}
    times = {(name, kind): [] for name in engines for kind in ("decode", "mixed")}

    def step(name: str, kind: str) -> None:
        engine = engines[name]
        if kind == "mixed":
            engine.add_request(f"m{next(engine.counter)}", [engine.rng.randrange(100, vocab) for _ in range(345)],
                               SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        current[0] = name
        attention[name].append(0.0)
        t = time.perf_counter()
        outs = engine.step_core()
        times[name, kind].append(time.perf_counter() - t)
        outputs[name].append(sorted((o.request_id, tuple(o.new_token_ids)) for o in outs))

    names = list(engines)
    for _ in range(3):  # warm-up
        for name in names:
            step(name, "mixed"), step(name, "decode")
    for v in list(times.values()) + list(attention.values()):
        v.clear()
    for i in range(args.steps):
        for name in names[:: 1 if i % 2 else -1]:
            step(name, "decode")
            step(name, "mixed")
    assert outputs[names[0]] == outputs[names[1]], "the two engines produced different tokens"
    running = len(engines[names[0]].scheduler.running)
    print(f"{running} decoding requests, pool of {args.pool_blocks} blocks, {args.steps} steps of each kind each")
    for kind in ("decode", "mixed"):
        a, b = (statistics.median(times[n, kind]) for n in names)
        pairs = sorted(x / y for x, y in zip(times[names[0], kind], times[names[1], kind]))
        print(f"{kind:7s} step: {names[0]} {a * 1e3:7.1f} ms, {names[1]} {b * 1e3:7.1f} ms (medians); step by step "
              f"ratio: median {statistics.median(pairs):.3f}, quartiles {pairs[len(pairs) // 4]:.3f}-"
              f"{pairs[3 * len(pairs) // 4]:.3f}")

    if kernels is not None:  # steps alternate decode, mixed: the decode steps' kernel time is at even indices
        a, b = (statistics.median(attention[n][0::2]) for n in names)
        pairs = sorted(x / y for x, y in zip(attention[names[0]][0::2], attention[names[1]][0::2]))
        print(f"decode attention (30 layers) in decode steps: {names[0]} {a * 1e3:6.1f} ms, {names[1]} "
              f"{b * 1e3:6.1f} ms (medians); step by step ratio: median {statistics.median(pairs):.3f}, quartiles "
              f"{pairs[len(pairs) // 4]:.3f}-{pairs[3 * len(pairs) // 4]:.3f}")


if __name__ == "__main__":
    main()
