"""Where one W1-shaped engine step goes, in process: a decode step of 28 sequences (contexts 250-450 tokens) and a
mixed step (the same 28 decodes plus a fresh 345-token prompt, W1's mean prefill per chunk step), timed and then
profiled (cProfile; the C++ kernels and oneDNN show as the built-in calls that run them), with what recording each step
for the step log and the dashboard costs.

usage: python benchmarks/step_profile.py [--steps 10] [--base REV | --disable KERNEL]

The server's defaults (continuous batching, --dtype auto). Each mixed step adds the prompt with max_tokens=1, so the
request is prefilled, samples its one token and finishes within that step: every measured step has the same shape.

With ``--base REV``: no profile; the C++ kernels as built at that git revision (justapi/kernels/*.cpp) against the
working tree's, swapped into the same engine (the model's layer ops and attention, every packed weight's matmul,
the 8-bit head's included) step by step, alternating; the median and the best of each kind of step are printed for
both, with ratios.
With ``--disable amx`` (any of config.OPTIONAL_KERNELS): the same, the two sides being a second engine loaded with
that kernel off (``--disable-kernels``) and the default one, each with its own 28 decoding requests.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import threading
import time

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--base", default=None, help="a git revision whose kernels are timed against the working tree's")
    ap.add_argument("--disable", default=None, help="a kernel (--disable-kernels) to time off against on")
    args = ap.parse_args()
    engine = LLM(default_model_path(), max_seqs=32, show_progress=False).engine
    decode, mixed = steps_of(engine)
    if args.base:
        compare_kernels(engine, args.base, args.steps, decode, mixed)
        return
    if args.disable:
        off = LLM(default_model_path(), max_seqs=32, disabled_kernels=(args.disable,),
                  show_progress=False).engine
        compare({f"{args.disable} off": steps_of(off), "default": (decode, mixed)}, args.steps)
        return
    for name, step in (("decode step (28 rows)", decode), ("mixed step (345-token prompt + 28 decodes)", mixed)):
        times = sorted(step() for _ in range(args.steps))
        median = times[len(times) // 2]
        print(f"{name}: median {median * 1e3:.1f} ms over {args.steps} steps")
        record = record_cost(engine)
        print(f"  its record for the step log and the dashboard: {record * 1e6:.1f} us ({100 * record / median:.3f}% "
              f"of the step)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            step()
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def record_cost(engine, reps: int = 2000) -> float:
    """Seconds to record the last step as the step log keeps it: its cells, appended one per request as
    Scheduler.update records them, then EngineCore's StepWork (the cells' tuple, the pool split, the counters)."""
    record = engine.scheduler.record
    cells = list(record.cells)
    t0 = time.perf_counter()
    for _ in range(reps):
        record.begin_update()
        for rid, kind, start, n, accepted in cells:
            record.cell(rid, kind, start, n, accepted)
        engine._step_work(0.0, [])
    return (time.perf_counter() - t0) / reps


def steps_of(engine):
    """(decode, mixed): each runs one step of its kind on ``engine`` (28 requests decoding) and returns its time."""
    for thread in threading.enumerate():  # the KV pool faulted in first: its thread takes a core while it runs
        if thread.name == "justapi-prefault":
            thread.join()
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    decoding = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
    for i in range(28):
        engine.add_request(f"d{i}", prompt(rng.randint(250, 450)), decoding)
    while not (len(engine.scheduler.running) == 28
               and all(r.num_computed_tokens >= r.num_prompt_tokens for r in engine.scheduler.running)):
        engine.step()
    counter = iter(range(1 << 30))

    def mixed() -> float:
        engine.add_request(f"m{next(counter)}", prompt(345),
                           SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t

    def decode() -> float:
        t = time.perf_counter()
        engine.step()
        return time.perf_counter() - t

    for _ in range(3):  # warm-up
        mixed(), decode()
    return decode, mixed


def compare(sides: dict, steps: int) -> None:
    """Steps of each kind, ``sides`` {name: (decode, mixed)} alternating, the median and best of each printed."""
    first, last = list(sides)
    for kind, name in enumerate(("decode step (28 rows)", "mixed step (345-token prompt + 28 decodes)")):
        times = {k: [] for k in sides}
        for i in range(steps):
            for k in list(sides)[:: 1 if i % 2 else -1]:
                times[k].append(sides[k][kind]())
        (old, new), (old_min, new_min) = ([sorted(t)[len(t) // 2] for t in times.values()],
                                          [min(t) for t in times.values()])
        print(f"{name}, median of {steps} (best): {first} {old * 1e3:.1f} ms ({old_min * 1e3:.1f}), {last} "
              f"{new * 1e3:.1f} ms ({new_min * 1e3:.1f}), {new / old:.2f}x ({new_min / old_min:.2f}x)")


def compare_kernels(engine, rev: str, steps: int, decode, mixed) -> None:
    from kernels_bench import build_at, use_kernels  # benchmarks/ is on the path when this runs as a script

    model = engine.model
    builds = {rev: build_at(rev), "working tree": model.kernels}

    def use(mod, step):
        def run() -> float:
            use_kernels(model, mod)
            return step()
        return run

    compare({name: (use(mod, decode), use(mod, mixed)) for name, mod in builds.items()}, steps)
    use_kernels(model, builds["working tree"])  # the working tree's build left in use


if __name__ == "__main__":
    main()
