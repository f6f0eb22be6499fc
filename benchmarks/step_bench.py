"""One engine step in process, on SmolLM2 (--dtype auto): its forward pass and the whole step.

usage: python benchmarks/step_bench.py forward [--base HEAD~1 | --disable KERNEL] [--reps 30]
       PYTHONPATH=DIR python benchmarks/step_bench.py forward --alone [--reps 30]
       python benchmarks/step_bench.py step [--steps 10] [--base REV | --disable KERNEL]
       python benchmarks/step_bench.py compile [--reps 30]

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

``compile``: whether ``torch.compile`` (inductor's C++ backend) would serve a decode step better than the project's
own kernels and one-call decode step. The C++ kernels are pybind calls dynamo cannot trace, so inductor is given the
forward it can trace whole: the pure-torch path (``JUSTAPI_KERNELS=0``; ``prepack`` off, as inductor cannot read
oneDNN's opaque packed weights). Three processes, one after another, each timing 1, 8 and 32 decode rows (best of
``--reps`` x 5): that path eager, that path compiled (``dynamic=False``, a graph per row count, compile time
printed), and the default engine. Each side's greedy picks are checked against its own eager forward.

(What a workload could reach at most on this machine: benchmarks/bounds.py.)
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
import sys
import textwrap
import threading
import time

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """The base's name and (forward, rope, head, layers, policy, native decode layers): another revision's forward,
    or the working tree's over weights loaded with ``args.disable`` off."""
    import torch

    if args.disable:
        off = LLM(default_model_path(), pool_blocks=16, disabled_kernels=(args.disable,),
                  show_progress=False).engine.model
        return f"{args.disable} off", (new_forward, model.rope, off.lm_head, off.layers, off.policy, off.decode_layers)
    old_forward, OldRope = old_version(args.base)
    # a weight wrapper the base revision may not know (quant.Int8RowWeight): the base multiplies its dense tensor (a
    # plain copy of it where it is prepacked for oneDNN); a head held without one (the units' routes) goes to the
    # base as the wrapper itself, which revisions since the kernel policy know
    head = model.lm_head
    if not isinstance(head, torch.Tensor) and hasattr(head, "dense"):
        head = head.dense.to_dense() if head.dense.is_mkldnn else head.dense
    rope = OldRope.__new__(OldRope)
    rope.__dict__.update(model.rope.__dict__)
    return args.base, (old_forward, rope, head, model.layers, model.policy, None)


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
    new = (new_forward, model.rope, model.lm_head, model.layers, model.policy, model.decode_layers)
    base_name, base = base_side(args, model, new_forward)
    inputs = capture(llm, (1, 8, 32, 512))
    print(f"forward pass of one step (decode rows, or a 512-token prefill chunk), {base_name} vs working tree, "
          f"best of {args.reps} x 5")

    def side(parts: tuple, a: tuple, k: dict) -> tuple:
        f, rope, head, layers, policy, native = parts

        def prepare():
            model.rope, model.lm_head, model.layers, model.policy = rope, head, layers, policy
            model.decode_layers = native
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


# --- compile --------------------------------------------------------------------------------------------------------
COMPILE_SIDES = {"torch eager": ("0", False), "torch compiled": ("0", True), "default": ("1", False)}


def compile_sides(args) -> None:
    """Each side in its own process (the kernels are chosen once a process), its JSON line collected and printed."""
    import tempfile

    results = {}
    for name, (kernels, _) in COMPILE_SIDES.items():
        # a fresh inductor cache: the compile time printed is a cold start's
        env = dict(os.environ, JUSTAPI_KERNELS=kernels, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp())
        out = subprocess.run([sys.executable, __file__, "compile", "--side", name, "--reps", str(args.reps)],
                             env=env, capture_output=True, text=True, check=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])
        print(name, json.dumps(results[name]), flush=True)
    ours = results["default"]["ms"]
    for name, r in results.items():
        ratios = " / ".join(f"{r['ms'][n] / ours[n]:.2f}x" for n in ours)
        print(f"{name:15s} ms at {'/'.join(ours)} rows: " + " / ".join(f"{r['ms'][n]:.2f}" for n in ours)
              + f"  ({ratios} the default's)" + (f", compiled in {r['compile_s']:.1f} s" if r["compile_s"] else ""))


def compile_side(args) -> None:
    import torch

    compiled = COMPILE_SIDES[args.side][1]
    llm = LLM(default_model_path(), pool_blocks=512, show_progress=False,
              disabled_kernels=("prepack",) if args.side != "default" else ())
    model = llm.engine.model
    inputs = capture(llm, (1, 8, 32))
    # the KV caches as ordinary tensors: inductor cannot write into inference-mode ones
    plain = lambda c: type(c)(plain(x) for x in c) if isinstance(c, (list, tuple)) else c.clone()  # noqa: E731
    caches = plain(inputs[1][0][3])
    inputs = {n: ((*a[:3], caches, *a[4:]), k) for n, (a, k) in inputs.items()}
    call, seconds = model.forward, 0.0
    if compiled:
        torch._dynamo.config.recompile_limit = 64  # one graph per row count and metadata shape
        raw = type(model).forward.__wrapped__  # outside inference mode, for the same reason as the caches
        call = torch.compile(lambda *a, **k: raw(model, *a, **k), dynamic=False)
        t = time.perf_counter()
        with torch.no_grad():
            for a, k in inputs.values():
                call(*a, **k), call(*a, **k)
        seconds = time.perf_counter() - t
    with torch.no_grad():
        same = {n: torch.equal(call(*a, **k).argmax(-1), model.forward(*a, **k).argmax(-1))
                for n, (a, k) in inputs.items()}
        ms = {n: best_of({"": (lambda: None, lambda: call(*a, **k))}, args.reps)[""] * 1e3
              for n, (a, k) in inputs.items()}
    print(json.dumps({"side": args.side, "compile_s": round(seconds, 1), "ms": ms, "same_greedy": same}))


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
    c = sub.add_parser("compile", help="torch.compile of the pure-torch forward against the default engine")
    c.add_argument("--reps", type=int, default=30)
    c.add_argument("--side", choices=COMPILE_SIDES, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.command == "compile":
        (compile_side if args.side else compile_sides)(args)
        return
    {"forward": forward, "step": step}[args.command](args)


if __name__ == "__main__":
    main()
