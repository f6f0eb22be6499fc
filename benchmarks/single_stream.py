"""Single-stream speed: prefill tokens/s and decode tokens/s, for OpenAI-compatible servers and transformers.

Each server gets the same streamed /v1/completions requests: a prompt of about PROMPT_TOKENS tokens that starts
with a run number (so no prefix cache can help), DECODE_TOKENS output tokens, greedy, EOS ignored.
  prefill tok/s = prompt tokens / time to first token
  decode tok/s  = (output tokens - 1) / (time of last token - time of first token)
Best of --runs after one warm-up. transformers (``--hf``) runs in this process on the same GGUF, fp32, with its
KV cache, timed the same way.

usage: python benchmarks/single_stream.py --server justapi=http://127.0.0.1:8010 \
           --server llama.cpp=http://127.0.0.1:8002 --hf PATH.gguf
"""

from __future__ import annotations

import argparse
import json
import os
import time

import httpx

TEXT = ("The history of the printing press begins in the fifteenth century, when movable type changed how books "
        "were made and who could read them. ")


def prompt(run: int, approx_tokens: int) -> str:
    words = TEXT * (approx_tokens // 24 + 1)
    return f"Run {run}. " + " ".join(words.split()[: int(approx_tokens * 0.75)])


def measure_server(url: str, model: str | None, run: int, prompt_tokens: int, decode_tokens: int) -> dict:
    body = {"prompt": prompt(run, prompt_tokens), "max_tokens": decode_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    first = last = None
    usage = None
    chunks = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if data.get("usage"):
                usage = data["usage"]
            if any(c.get("text") for c in data.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
                chunks += 1
    n_out = usage["completion_tokens"] if usage else chunks
    n_in = usage["prompt_tokens"] if usage else None
    return {"prompt_tokens": n_in, "output_tokens": n_out, "ttft_s": first - t0,
            "prefill_tok_s": (n_in / (first - t0)) if n_in else None,
            "decode_tok_s": (n_out - 1) / (last - first)}


def measure_hf(path: str, run: int, prompt_tokens: int, decode_tokens: int, state: dict) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if "model" not in state:
        d, f = os.path.dirname(path), os.path.basename(path)
        state["tok"] = AutoTokenizer.from_pretrained(d, gguf_file=f)
        state["model"] = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32).eval()
    tok, model = state["tok"], state["model"]
    ids = torch.tensor([tok.encode(prompt(run, prompt_tokens))])
    with torch.no_grad():
        t0 = time.perf_counter()
        out = model(ids, use_cache=True)
        nxt = out.logits[0, -1].argmax().view(1, 1)
        t1 = time.perf_counter()
        past = out.past_key_values
        for _ in range(decode_tokens - 1):
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            nxt = out.logits[0, -1].argmax().view(1, 1)
        t2 = time.perf_counter()
    n = ids.shape[1]
    return {"prompt_tokens": n, "output_tokens": decode_tokens, "ttft_s": t1 - t0, "prefill_tok_s": n / (t1 - t0),
            "decode_tok_s": (decode_tokens - 1) / (t2 - t1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", action="append", default=[], help="NAME=URL of an OpenAI-compatible server")
    ap.add_argument("--model", default=None, help="model name to send (default: none)")
    ap.add_argument("--hf", default=None, help="also time transformers on this GGUF, in process")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--json", default=None, help="write all figures here")
    args = ap.parse_args()
    targets = [tuple(s.split("=", 1)) for s in args.server]
    if args.hf:
        targets.append(("transformers", None))
    results = {}
    state: dict = {}
    for name, url in targets:
        runs = []
        for run in range(args.runs + 1):  # run 0 is the warm-up
            if url is None:
                r = measure_hf(args.hf, run, args.prompt_tokens, args.decode_tokens, state)
            else:
                r = measure_server(url, args.model, run, args.prompt_tokens, args.decode_tokens)
            if run:
                runs.append(r)
        results[name] = {"prefill_tok_s": max(r["prefill_tok_s"] for r in runs),
                         "decode_tok_s": max(r["decode_tok_s"] for r in runs),
                         "prompt_tokens": runs[0]["prompt_tokens"], "output_tokens": runs[0]["output_tokens"],
                         "runs": runs}
    print(f"{'engine':<16} {'prompt tok':>10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, r in results.items():
        print(f"{name:<16} {r['prompt_tokens']:>10} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
