"""What each API family's translation costs: the same conversation through OpenAI's chat completions, the Responses
API, Anthropic's Messages and Ollama's chat, each driven by its own client library against one `justapi serve` on
SmolLM2-135M (a process on loopback), interleaved, whole and streamed; median latency and time to first token per
family, and the output each gave (greedy: the same text everywhere). Then JSON mode at temperature 0: the tokens
SmolLM2 spends on a `json_object` answer and whether it ends before `max_tokens`.

usage: python benchmarks/api_families.py [--rounds 20] [--max-tokens 32] [-- SERVE FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import anthropic
import httpx
import ollama
import openai

ASK = [{"role": "user", "content": "Name three colours of the rainbow."}]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become ready")


def families(url: str, model: str, max_tokens: int) -> dict:
    """Family -> (whole(): text, streamed(): (text, seconds to the first text)) through each family's client."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    an = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    ol = ollama.Client(host=url)
    opts = {"temperature": 0, "num_predict": max_tokens}

    def first_text(chunks, text_of):
        t0, first, parts = time.perf_counter(), None, []
        for c in chunks:
            piece = text_of(c)
            if piece and first is None:
                first = time.perf_counter() - t0
            parts.append(piece or "")
        return "".join(parts), first

    def responses_stream():
        t0, first, parts = time.perf_counter(), None, []
        for event in oa.responses.create(model=model, input=ASK, max_output_tokens=max_tokens, temperature=0,
                                         stream=True):
            if event.type == "response.output_text.delta":
                first = first if first is not None else time.perf_counter() - t0
                parts.append(event.delta)
        return "".join(parts), first

    def anthropic_stream():
        t0, first, parts = time.perf_counter(), None, []
        with an.messages.stream(model=model, max_tokens=max_tokens, extra_body={"temperature": 0},
                                messages=ASK) as s:
            for piece in s.text_stream:
                first = first if first is not None else time.perf_counter() - t0
                parts.append(piece)
        return "".join(parts), first

    return {
        "openai chat": (
            lambda: oa.chat.completions.create(model=model, messages=ASK, max_tokens=max_tokens,
                                               temperature=0).choices[0].message.content,
            lambda: first_text(oa.chat.completions.create(model=model, messages=ASK, max_tokens=max_tokens,
                                                          temperature=0, stream=True),
                               lambda c: c.choices[0].delta.content if c.choices else None)),
        "responses": (
            lambda: oa.responses.create(model=model, input=ASK, max_output_tokens=max_tokens,
                                        temperature=0).output_text,
            responses_stream),
        "anthropic": (
            lambda: an.messages.create(model=model, max_tokens=max_tokens, extra_body={"temperature": 0},
                                       messages=ASK).content[0].text,
            anthropic_stream),
        "ollama": (
            lambda: ol.chat(model=model, messages=ASK, options=opts).message.content,
            lambda: first_text(ol.chat(model=model, messages=ASK, options=opts, stream=True),
                               lambda c: c.message.content)),
    }


def measure(runs: dict, rounds: int) -> dict:
    """Per family: median seconds whole, median seconds to the first streamed text, the texts; interleaved."""
    got = {name: {"whole": [], "ttft": [], "texts": set()} for name in runs}
    for _ in range(rounds):
        for name, (whole, streamed) in runs.items():
            t0 = time.perf_counter()
            text = whole()
            got[name]["whole"].append(time.perf_counter() - t0)
            streamed_text, ttft = streamed()
            got[name]["ttft"].append(ttft)
            got[name]["texts"] |= {text, streamed_text}
    return {name: {"whole_ms": 1000 * statistics.median(g["whole"]), "ttft_ms": 1000 * statistics.median(g["ttft"]),
                   "texts": sorted(g["texts"])} for name, g in got.items()}


JSON_ASKS = ["hi", "List three colors.", "What is 2+2?",
             "Give me a JSON object describing a cat with its name and age.", "Describe a cat as JSON."]


def json_mode(url: str, model: str) -> list[dict]:
    """Per prompt: the tokens of SmolLM2's json_object answer (at most 400), how it ended, whether it parses."""
    oa = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    rows = []
    for ask in JSON_ASKS:
        r = oa.chat.completions.create(model=model, temperature=0, max_tokens=400,
                                       response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": ask}])
        text = r.choices[0].message.content
        rows.append({"ask": ask, "tokens": r.usage.completion_tokens, "finish_reason": r.choices[0].finish_reason,
                     "parses": _parses(text), "newlines": text.count("\n")})
    return rows


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("serve", nargs="*", help="more `justapi serve` flags, after --")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    exe = os.path.join(os.path.dirname(sys.executable), "justapi")
    proc = subprocess.Popen([exe, "serve", "--port", str(args.port), "--served-model-name", "smollm2", *args.serve],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(url, proc)
        runs = families(url, "smollm2", args.max_tokens)
        for whole, streamed in runs.values():  # warm every route once
            whole(), streamed()
        results = measure(runs, args.rounds)
        base = results["openai chat"]
        print(f"{'family':<12} {'whole ms':>9} {'vs chat':>8} {'TTFT ms':>8} {'vs chat':>8}  distinct texts")
        for name, r in results.items():
            print(f"{name:<12} {r['whole_ms']:9.1f} {r['whole_ms'] - base['whole_ms']:+8.1f} {r['ttft_ms']:8.1f} "
                  f"{r['ttft_ms'] - base['ttft_ms']:+8.1f}  {len(r['texts'])}")
        same = len({t for r in results.values() for t in r["texts"]}) == 1
        print(f"every family gave the same greedy text: {same}")
        for row in json_mode(url, "smollm2"):
            print("json_object:", json.dumps(row))
    finally:
        proc.terminate()
        proc.wait(timeout=60)


if __name__ == "__main__":
    main()
