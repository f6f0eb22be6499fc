"""One engine step in process, on SmolLM2 (--dtype auto): its forward pass, the whole step, and the bound the
arithmetic of a workload's steps sets.

usage: python benchmarks/step_bench.py forward [--base HEAD~1 | --disable KERNEL] [--reps 30]
       PYTHONPATH=DIR python benchmarks/step_bench.py forward --alone [--reps 30]
       python benchmarks/step_bench.py step [--steps 10] [--base REV | --disable KERNEL]
       python benchmarks/step_bench.py bound [--workload W1] [--gflops G] [--model GGUF] [--requests N]
                                             [--prompt A:B] [--output A:B] [--arrival-rate R]

``forward``: one step's forward pass (LlamaModel.forward and model/layers.py), the inputs captured from real steps
(1, 8 and 32 decode rows, a 512-token prefill chunk), best of ``--reps`` x 5 calls each (a tenth as many for the
chunk, 3 at least). A/B in one process, interleaved: the forward at a git revision (``--base``) against the working
tree's, or (``--disable KERNEL``, one of config.OPTIONAL_KERNELS, e.g. fused_silu or prefill_attention) the working
tree's over a second copy of the model loaded with that kernel off (``--disable-kernels``; its weights hold the forms
their routes then read) against the default. ``--alone``: the checkout on the path alone (1 and 8 rows, the chunk),
as one JSON line, for two checkouts whose model classes differ (``--base`` swaps only the forward function): run it
once per checkout, alternating, with PYTHONPATH naming the checkout. This VM's speed drifts by up to 3x within
minutes, so end-to-end tok/s of two separate runs cannot resolve a 10% change; the minimum over many interleaved
repetitions of the same inputs can.

``step``: where one W1-shaped engine step goes: a decode step of 28 sequences (contexts 250-450 tokens) and a mixed
step (the same 28 decodes plus a fresh 345-token prompt, W1's mean prefill per chunk step), timed and then profiled
(cProfile; the C++ kernels and oneDNN show as the built-in calls that run them), with what recording each step for
the step log and the dashboard costs. The server's defaults (continuous batching, --dtype auto). Each mixed step adds
the prompt with max_tokens=1, so the request is prefilled, samples its one token and finishes within that step: every
measured step has the same shape. With ``--base REV``: no profile; the C++ kernels as built at that git revision
(justapi/kernels/*.cpp) against the working tree's, swapped into the same engine (the model's layer ops and
attention, every packed weight's matmul, the 8-bit head's included) step by step, alternating; the median and the
best of each kind of step are printed for both, with ratios. With ``--disable amx`` (any of
config.OPTIONAL_KERNELS): the same, the two sides being a second engine loaded with that kernel off and the default
one, each with its own 28 decoding requests.

``bound``: the most output tok/s any engine computing in fp32 could reach on a workload (W1 or W3 of
benchmarks/workloads.txt; ``--requests``, ``--prompt``, ``--output``, ``--arrival-rate`` override its shape), from
its arithmetic and this machine's measured matmul rate: every product, attention included, counted at the best rate
torch's fp32 matmul reaches here (square sizes 1024-4096, all threads, best of 5 each; ``--gflops`` gives it
instead), nothing else counted (no norms, no dispatch, no memory traffic). Lengths are uniform over the ranges (the
expectation is summed, length by length); the architecture is read from the GGUF. Per request of prompt length L and
output length O:

    layers    2 FLOP per weight for each of the L + O - 1 tokens fed (the last output token is not fed back)
    head      2 FLOP per weight for each of the O positions whose logits are sampled
    attention 4 * heads * head_dim * layers FLOP per (query, visible key): QK^T and PV; query i sees i keys

With arrivals (W3's Poisson arrivals at 1.2 a second), the run lasts at least as long as they do (requests / rate),
which the arithmetic alone does not count: both bounds are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import random
import subprocess
import textwrap
import threading
import time
from pathlib import Path

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKLOADS = dict(line.split(" ", 1) for line in (Path(__file__).parent / "workloads.txt").read_text().splitlines())


# --- forward --------------------------------------------------------------------------------------------------------
def capture(llm: LLM, rows: tuple[int, ...]) -> dict:
    """The model's forward inputs (args, kwargs) of real steps by row count: decode rows, or a 512-token chunk."""
    cls = type(llm.engine.model)
    forward = cls.forward
    captured = {}

    def spy(self, *a, **k):
        captured.setdefault(a[0].shape[0], (a, k))
        return forward(self, *a, **k)

    cls.forward = spy
    try:
        llm.generate([[400 + i for i in range(20)]], SamplingParams(max_tokens=3, temperature=0))
        for n in rows:
            if 1 < n < 512:
                llm.generate([[400 + i + j for i in range(20)] for j in range(n)],
                             SamplingParams(max_tokens=30, temperature=0))
        llm.generate([[5000 + i * 7 for i in range(512)]], SamplingParams(max_tokens=1, temperature=0))  # one chunk
    finally:
        cls.forward = forward
    return {n: captured[n] for n in rows}


def best_of(sides: dict, reps: int) -> dict[str, float]:
    """Best seconds a call over ``reps`` rounds of 5 calls of each side, the sides interleaved round by round.
    ``sides``: {name: (prepare, call)}; prepare (untimed) sets a side up before its calls."""
    best = dict.fromkeys(sides, math.inf)
    for _ in range(reps):
        for name, (prepare, call) in sides.items():
            prepare()
            t = time.perf_counter()
            for _ in range(5):
                call()
            best[name] = min(best[name], (time.perf_counter() - t) / 5)
    return best


def chunk_reps(reps: int, n: int) -> int:
    return reps if n < 512 else max(3, reps // 10)


def old_version(rev: str):
    """(forward, RotaryEmbedding) as they were at ``rev``, bound to the current module's other names."""
    import justapi.model.llama as L

    show = lambda path: subprocess.run(["git", "-C", ROOT, "show", f"{rev}:{path}"], capture_output=True,  # noqa: E731
                                       text=True, check=True).stdout
    src = show("justapi/model/llama.py")
    start = src.index("    @torch.inference_mode()\n    def forward(")
    end = src.find("\ndef ", start)
    ns = dict(vars(L))
    exec(show("justapi/model/layers.py"), ns)  # noqa: S102 - our own source at another revision
    exec(textwrap.dedent(src[start : end if end >= 0 else len(src)]), ns)  # noqa: S102
    return ns["forward"], ns["RotaryEmbedding"]


def base_side(args, model, new_forward) -> tuple[str, tuple]:
    """The base's name and (forward, rope, head, layers, policy): another revision's forward, or the working tree's
    over weights loaded with ``args.disable`` off."""
    import torch

    if args.disable:
        off = LLM(default_model_path(), pool_blocks=16, disabled_kernels=(args.disable,),
                  show_progress=False).engine.model
        return f"{args.disable} off", (new_forward, model.rope, off.lm_head, off.layers, off.policy)
    old_forward, OldRope = old_version(args.base)
    # a weight wrapper the base revision may not know (quant.Int8RowWeight): the base multiplies its dense tensor (a
    # plain copy of it where it is prepacked for oneDNN); a head held without one (the units' routes) goes to the
    # base as the wrapper itself, which revisions since the kernel policy know
    head = model.lm_head
    if not isinstance(head, torch.Tensor) and hasattr(head, "dense"):
        head = head.dense.to_dense() if head.dense.is_mkldnn else head.dense
    rope = OldRope.__new__(OldRope)
    rope.__dict__.update(model.rope.__dict__)
    return args.base, (old_forward, rope, head, model.layers, model.policy)


def forward(args) -> None:
    llm = LLM(default_model_path(), pool_blocks=512, show_progress=False)
    model = llm.engine.model
    if args.alone:
        import justapi

        inputs = capture(llm, (1, 8, 512))
        best = {n: best_of({"": (lambda: None, lambda: model.forward(*a, **k))}, chunk_reps(args.reps, n))[""] * 1e3
                for n, (a, k) in inputs.items()}
        print(json.dumps({"src": justapi.__file__, "ms": best}))
        return
    new_forward = type(model).forward
    new = (new_forward, model.rope, model.lm_head, model.layers, model.policy)
    base_name, base = base_side(args, model, new_forward)
    inputs = capture(llm, (1, 8, 32, 512))
    print(f"forward pass of one step (decode rows, or a 512-token prefill chunk), {base_name} vs working tree, "
          f"best of {args.reps} x 5")

    def side(parts: tuple, a: tuple, k: dict) -> tuple:
        f, rope, head, layers, policy = parts

        def prepare():
            model.rope, model.lm_head, model.layers, model.policy = rope, head, layers, policy
        return prepare, lambda: f(model, *a, **k)

    for n, (a, k) in inputs.items():
        best = best_of({"base": side(base, a, k), "new": side(new, a, k)}, chunk_reps(args.reps, n))
        print(f"{n} rows: base {best['base'] * 1e3:.2f} ms, new {best['new'] * 1e3:.2f} ms, "
              f"new/base {best['new'] / best['base']:.3f}")


# --- step -----------------------------------------------------------------------------------------------------------
def step(args) -> None:
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
    for name, one in (("decode step (28 rows)", decode), ("mixed step (345-token prompt + 28 decodes)", mixed)):
        times = sorted(one() for _ in range(args.steps))
        median = times[len(times) // 2]
        print(f"{name}: median {median * 1e3:.1f} ms over {args.steps} steps")
        record = record_cost(engine)
        print(f"  its record for the step log and the dashboard: {record * 1e6:.1f} us ({100 * record / median:.3f}% "
              f"of the step)")
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.steps):
            one()
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

    def use(mod, one):
        def run() -> float:
            use_kernels(model, mod)
            return one()
        return run

    compare({name: (use(mod, decode), use(mod, mixed)) for name, mod in builds.items()}, steps)
    use_kernels(model, builds["working tree"])  # the working tree's build left in use


# --- bound ----------------------------------------------------------------------------------------------------------
def span(text: str) -> range:
    lo, _, hi = text.partition(":")
    return range(int(lo), int(hi or lo) + 1)


def shape_of(args) -> tuple[int, range, range, float | None]:
    """(requests, prompt lengths, output lengths, arrival rate) of ``args.workload``, with the flags given over it."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--num-requests", type=int)
    p.add_argument("--input-len", type=span)
    p.add_argument("--output-len", type=span)
    p.add_argument("--request-rate", type=float, default=None)
    w = p.parse_known_args(WORKLOADS[args.workload].split())[0]
    pick = lambda given, default: default if given is None else given  # noqa: E731
    return (pick(args.requests, w.num_requests), pick(args.prompt, w.input_len), pick(args.output, w.output_len),
            pick(args.arrival_rate, w.request_rate))


def matmul_gflops() -> float:
    import torch

    best = 0.0
    for n in (1024, 2048, 3072, 4096):
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b
        for _ in range(5):
            t = time.perf_counter()
            a @ b
            best = max(best, 2 * n ** 3 / (time.perf_counter() - t) / 1e9)
    return best


def bound(args) -> None:
    import torch

    from justapi.model.gguf_loader import open_gguf, read_model_config

    requests, prompt, output, arrival_rate = shape_of(args)
    path = args.model or default_model_path()
    cfg = read_model_config(open_gguf(path), path)
    h, d = cfg.hidden_size, cfg.head_dim
    layer = h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2 + 3 * h * cfg.intermediate_size
    weights = cfg.num_layers * layer
    head = cfg.vocab_size * h
    attn = 4 * cfg.num_heads * d * cfg.num_layers  # per (query, key) pair
    prefill = decode = 0.0
    for n_in in prompt:
        for n_out in output:
            prefill += n_in * 2 * weights + 2 * head + attn * n_in * (n_in + 1) / 2
            decode += (n_out - 1) * (2 * weights + 2 * head) + attn * sum(range(n_in + 1, n_in + n_out))
    pairs = len(prompt) * len(output)
    prefill, decode = prefill / pairs * requests, decode / pairs * requests
    output_tokens = requests * sum(output) / len(output)
    rate = args.gflops or matmul_gflops()
    seconds = (prefill + decode) / (rate * 1e9)
    per_decode = decode / (requests * (sum(output) / len(output) - 1))
    print(f"model {path}: {weights / 1e6:.1f} M layer weights, head {head / 1e6:.1f} M")
    print(f"workload: {requests} requests, {requests * sum(prompt) / len(prompt):.0f} prompt and {output_tokens:.0f} "
          "output tokens")
    print(f"arithmetic: prefill {prefill / 1e12:.2f} TFLOP, decode {decode / 1e12:.2f} TFLOP, "
          f"{per_decode / 1e6:.0f} MFLOP per decode token")
    print(f"fp32 matmul rate: {rate:.1f} GFLOP/s ({'given' if args.gflops else 'measured'}, "
          f"{torch.get_num_threads()} threads)")
    print(f"at that rate: prefill alone {prefill / (rate * 1e9):.1f} s, all {seconds:.1f} s -> at most "
          f"{output_tokens / seconds:.0f} out tok/s; decode alone at most {rate * 1e9 / per_decode:.0f} tok/s")
    if arrival_rate:  # the requests cannot all be served before the last one arrives
        arrivals = requests / arrival_rate
        print(f"arrivals at {arrival_rate:g} a second: the last one ~{arrivals:.0f} s in -> at most "
              f"{output_tokens / max(seconds, arrivals):.0f} out tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    f = sub.add_parser("forward", help="A/B of one step's forward pass, or one checkout's alone (--alone)")
    f.add_argument("--base", default="HEAD~1", help="a git revision whose forward is timed against the working tree's")
    f.add_argument("--disable", default=None, help="a kernel to turn off in the base, instead of a revision")
    f.add_argument("--alone", action="store_true", help="the checkout on the path alone, as JSON (PYTHONPATH=DIR)")
    f.add_argument("--reps", type=int, default=30)
    s = sub.add_parser("step", help="a W1-shaped decode and mixed step: times and a profile, or A/B")
    s.add_argument("--steps", type=int, default=10)
    s.add_argument("--base", default=None, help="a git revision whose kernels are timed against the working tree's")
    s.add_argument("--disable", default=None, help="a kernel (--disable-kernels) to time off against on")
    b = sub.add_parser("bound", help="the most out tok/s fp32 arithmetic allows on W1 (or W3)")
    b.add_argument("--workload", default="W1", choices=["W1", "W3"], help="its shape, from benchmarks/workloads.txt")
    b.add_argument("--model", default=None, help="a GGUF (default: SmolLM2)")
    b.add_argument("--requests", type=int, default=None)
    b.add_argument("--prompt", type=span, default=None, help="prompt tokens, N or MIN:MAX")
    b.add_argument("--output", type=span, default=None, help="output tokens, N or MIN:MAX")
    b.add_argument("--gflops", type=float, default=None, help="the fp32 matmul rate, instead of measuring it")
    b.add_argument("--arrival-rate", type=float, default=None, help="requests a second (W3: 1.2; 0: all at once)")
    args = ap.parse_args()
    {"forward": forward, "step": step, "bound": bound}[args.command](args)


if __name__ == "__main__":
    main()
