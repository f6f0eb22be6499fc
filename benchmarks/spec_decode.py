"""Speculative decoding (prompt lookup, --spec-method ngram) against plain decoding, in process, on SmolLM2.

usage: python benchmarks/spec_decode.py [--gamma 4] [--max-tokens 128] [--dtype auto|float32]
Workloads: a copy-heavy one ("rewrite this text with one change", where the answer repeats the prompt) and a
free-writing one (nothing to copy). Each runs single stream (requests one at a time) and 8 at once. Prints decode
tok/s with and without speculation, the speed-up, the acceptance rate and the mean accepted length.
"""

from __future__ import annotations

import argparse
import time

from justapi import LLM, SamplingParams
from justapi.model.gguf_loader import default_model_path

TEXT = ("The committee met on Tuesday to review the budget for the new library. After a long discussion, the members "
        "agreed to fund the children's reading room and postpone the roof repairs until spring. The chair thanked "
        "the volunteers who had collected more than four hundred signatures in support of longer opening hours.")
COPY = [f"Rewrite this text exactly, but change {w}:\n\n{TEXT}" for w in
        ("Tuesday to Friday", "library to museum", "spring to autumn", "budget to plan",
         "four hundred to five hundred", "volunteers to students", "chair to mayor", "roof to windows")]
FREE = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle works.",
        "Describe your ideal weekend.", "Write a poem about autumn rain.", "What makes a good teacher?",
        "Explain photosynthesis to a child.", "Describe a busy market.", "Write a letter to a future self."]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, concurrent: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), concurrent):
        tokens += sum(len(r.token_ids) for r in llm.generate(prompts[i : i + concurrent], params))
    return time.perf_counter() - t0, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    path = default_model_path()
    opts = dict(scheduled=True, pool_blocks=2048, dtype=args.dtype, show_progress=False)
    plain = LLM(path, **opts)
    spec = LLM(path, spec_method="ngram", gamma=args.gamma, spec_max_batch=64, **opts)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"SmolLM2-135M, --dtype {args.dtype}, gamma {args.gamma}, {args.max_tokens} output tokens a request, greedy")
    print("workload  concurrent  plain tok/s  ngram tok/s  speed-up  acceptance  mean accepted length")
    for name, texts in (("copy", COPY), ("free", FREE)):
        prompts = [plain.apply_chat_template([{"role": "user", "content": t}]) for t in texts]
        plain.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
        spec.generate(prompts[:1], SamplingParams(max_tokens=4))
        for concurrent in (1, 8):
            st = spec.engine.scheduler.stats
            d0, a0, s0 = st.spec_draft_tokens, st.spec_accepted_tokens, st.spec_steps
            tp, n_plain = run(plain, prompts, params, concurrent)
            ts, n_spec = run(spec, prompts, params, concurrent)
            d, a, s = st.spec_draft_tokens - d0, st.spec_accepted_tokens - a0, st.spec_steps - s0
            print(f"{name:8}  {concurrent:>10}  {n_plain / tp:>11.1f}  {n_spec / ts:>11.1f}  {tp / ts:>7.2f}x  "
                  f"{(a / d if d else 0):>10.2f}  {((a + s) / s if s else 0):>20.2f}")


if __name__ == "__main__":
    main()
