"""What a watched dashboard costs the server, in process and exactly: a W1-shaped load (prompts 64-512 tokens,
outputs 16-256, at most 32 in flight) through AsyncLLM, the server's engine front, with one page's Watch ticking
every TICK_S as /dashboard/events does. Prints the time each tick takes on the event loop (new step records,
requests and windows turned into a JSON message) and the engine thread's walks of the prefix tree, against the run's
wall time. (The unwatched cost, the step records themselves, is in benchmarks/step_profile.py.)

usage: python benchmarks/dashboard_tick.py [--requests 64] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time

from justapi import LLM, SamplingParams
from justapi.engine.async_llm import AsyncLLM
from justapi.model.gguf_loader import default_model_path
from justapi.server.dashboard import TICK_S, DashboardFeed, Watch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    args = ap.parse_args()
    engine = LLM(default_model_path(), show_progress=False).engine
    walks: list[float] = []
    walk = engine.shared_prefixes

    def timed_walk(limit):
        t0 = time.perf_counter()
        found = walk(limit)
        walks.append(time.perf_counter() - t0)
        return found

    engine.shared_prefixes = timed_walk
    feed = DashboardFeed()
    llm = AsyncLLM(engine, on_finish=feed.observe)
    llm.start()
    ticks, sizes, wall = asyncio.run(run(llm, feed, engine, args))
    llm.shutdown()
    mean = sum(ticks) / len(ticks)
    print(f"{args.requests} requests in {wall:.1f} s; {len(ticks)} ticks, {sum(sizes) / len(sizes) / 1024:.1f} KiB a "
          f"message")
    print(f"a tick on the event loop: mean {mean * 1e3:.2f} ms, max {max(ticks) * 1e3:.2f} ms; all ticks "
          f"{sum(ticks):.3f} s = {100 * sum(ticks) / wall:.2f}% of the wall time (of one core)")
    if walks:
        print(f"prefix-tree walks on the engine thread: {len(walks)}, mean {sum(walks) / len(walks) * 1e3:.2f} ms, "
              f"all {100 * sum(walks) / wall:.3f}% of the wall time")


async def run(llm: AsyncLLM, feed: DashboardFeed, engine, args) -> tuple[list[float], list[int], float]:
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    watch = Watch(llm, feed, engine.tokenizer, prompt_text=True)
    llm.watchers += 1
    ticks, sizes = [], []
    done = asyncio.Event()

    async def ticker():
        while not done.is_set():
            t0 = time.perf_counter()
            message = json.dumps(watch.tick(), separators=(",", ":"))
            ticks.append(time.perf_counter() - t0)
            sizes.append(len(message))
            await asyncio.sleep(TICK_S)

    gate = asyncio.Semaphore(args.concurrency)

    async def one(i: int) -> None:
        ids = [rng.randrange(3, vocab) for _ in range(rng.randint(64, 512))]
        params = SamplingParams(temperature=0, max_tokens=rng.randint(16, 256), ignore_eos=True)
        async with gate:
            async for _ in llm.generate(f"r{i}", ids, params):
                pass

    t0 = time.perf_counter()
    watching = asyncio.create_task(ticker())
    await asyncio.gather(*(one(i) for i in range(args.requests)))
    wall = time.perf_counter() - t0
    done.set()
    await watching
    return ticks, sizes, wall


if __name__ == "__main__":
    main()
