"""A soak run (issue 53 item 7): tens of thousands of mixed requests against one `justapi serve` for a long run, and
what it must leave behind: no request lost, no KV block owned by a request once the server is idle, a flat RSS and a
p99 latency that does not drift.

    .venv/bin/python benchmarks/soak.py --minutes 30 [--concurrency 16] [--seed 0] [--json FILE]
        [--url http://127.0.0.1:8000 [--pid PID]] [-- SERVE FLAGS]

Without --url the script starts its own server on a free loopback port (SmolLM2, SERVE_FLAGS plus the flags after
--) and stops it at the end. --concurrency workers each send one request after another, its kind and fields drawn by
a generator seeded with --seed and the request's number (the mix: KINDS): completions and chats, whole and streamed;
streams the client closes after a few chunks; whole requests it gives up on by an httpx timeout shorter than them;
requests with a server-side `timeout`; malformed bodies (MALFORMED: each must get a 4xx with an OpenAI error body);
extreme but valid values (EDGE: a 200 with every field, or such a 4xx); structured output (a JSON schema, a choice),
checked where it finished; slow readers; embeddings. max_tokens is 4..64 throughout. Every request ends ok, 4xx (as
expected), cancelled (by us) or lost: a 5xx or 429, a 4xx where a 200 was due or without an OpenAI error body, a
200 where a 4xx was due, a connection error, no answer within --timeout, an answer missing a field or breaking its
constraint.

Every --sample-every seconds: the server's RSS (VmRSS of /proc/PID/status), its /metrics gauges and how long GET
/health takes. At the end traffic stops, /metrics is polled until nothing runs or waits, and the KV blocks still owned
by requests are read two ways: justapi_kv_blocks_used - prefix_cache_blocks (an idle server's blocks should all be
the prefix cache's) and the gauge justapi_kv_blocks_used_by_requests (the running requests' blocks). Both must be 0.
The latency of the ok whole completions and chats is split into tenths of the run by start time (p50, p99 each) and
the drift is the last tenth's p99 over the first's. Exit status 1 if a request was lost or a block is still owned.

Other work on the machine skews every figure (the load average before and after is printed): on 2 cores with another
busy process the server's two OpenMP threads wait on each other at every barrier and its steps take ~50x longer, so
requests time out; `-- --threads 1` keeps a soak on a shared machine meaningful.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import httpx

BIN = Path(sys.executable).parent
# a small pool (128 blocks of 16 tokens) so 16 requests of ~20-400 tokens preempt one another (~30 times a minute
# here) and the prefix cache evicts all run long: both paths must hand their blocks back
SERVE_FLAGS = ["--pool-blocks", "128", "--max-seqs", "16", "--log-level", "warning"]
KINDS = {  # kind: weight in the mix
    "completion": 3, "chat": 3, "stream": 3, "cancel_stream": 2, "cancel_timeout": 2, "deadline": 1,
    "malformed": 3, "edge": 1, "structured": 2, "slow_reader": 1, "embeddings": 1,
}
OUTCOMES = ("ok", "4xx", "cancelled", "lost")
GAUGES = ("justapi_requests_running", "justapi_requests_waiting", "justapi_kv_blocks_used", "justapi_kv_blocks_total",
          "justapi_kv_blocks_used_by_requests", "prefix_cache_blocks", "justapi_preemptions_total",
          "justapi_engine_steps_total")  # steps: the step log (a ring of 16384) grows RSS until it is full
C, CH, E = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
HI = b'"messages": [{"role": "user", "content": "Hi"}]'
MALFORMED = [  # (what, path, raw body): each must get a 4xx with an OpenAI error body
    ("truncated JSON", C, b'{"prompt": "Hello", "max_tokens": 8'),
    ("not UTF-8", C, b'{"prompt": "\xff\xfe", "max_tokens": 8}'),
    ("not an object", CH, b"[1, 2, 3]"),
    ("empty body", C, b""),
    ("prompt of the wrong type", C, b'{"prompt": {"text": "Hello"}, "max_tokens": 8}'),
    ("max_tokens of the wrong type", C, b'{"prompt": "Hello", "max_tokens": "eight"}'),
    ("messages of the wrong type", CH, b'{"messages": "Hello", "max_tokens": 8}'),
    ("unknown model", C, b'{"model": "no-such-model", "prompt": "Hello", "max_tokens": 8}'),
    ("negative max_tokens", C, b'{"prompt": "Hello", "max_tokens": -5}'),
    ("zero max_tokens", CH, b"{" + HI + b', "max_tokens": 0}'),
    ("max_tokens past the context", C, b'{"prompt": "Hello", "max_tokens": 1000000000}'),
    ("NaN temperature", C, b'{"prompt": "Hello", "max_tokens": 8, "temperature": NaN}'),
    ("infinite temperature", C, b'{"prompt": "Hello", "max_tokens": 8, "temperature": 1e999}'),
    ("negative temperature", CH, b"{" + HI + b', "max_tokens": 8, "temperature": -1}'),
    ("top_p above 1", C, b'{"prompt": "Hello", "max_tokens": 8, "top_p": 1.5}'),
    ("token id past the vocabulary", C, b'{"prompt": [1, 2, 99999999], "max_tokens": 8}'),
    ("negative token id", C, b'{"prompt": [-1, 5], "max_tokens": 8}'),
    ("empty prompt list", C, b'{"prompt": [], "max_tokens": 8}'),
    ("empty messages", CH, b'{"messages": [], "max_tokens": 8}'),
    ("unknown role", CH, b'{"messages": [{"role": "wizard", "content": "Hi"}], "max_tokens": 8}'),
    ("n past the limit", C, b'{"prompt": "Hello", "max_tokens": 8, "n": 100000}'),
    ("logprobs past the limit", C, b'{"prompt": "Hello", "max_tokens": 8, "logprobs": 1000}'),
    ("invalid JSON schema", CH, b"{" + HI + b', "max_tokens": 8, "response_format": {"type": "json_schema", '
                                          b'"json_schema": {"name": "x", "schema": {"type": "nonsense"}}}}'),
    ("empty choice list", CH, b"{" + HI + b', "max_tokens": 8, "structured_outputs": {"choice": []}}'),
    ("structured output with ignore_eos", CH, b"{" + HI + b', "max_tokens": 8, "ignore_eos": true, '
                                                        b'"structured_outputs": {"choice": ["a", "b"]}}'),
    ("stream_options without stream", C, b'{"prompt": "Hi", "max_tokens": 8, '
                                         b'"stream_options": {"include_usage": true}}'),
    ("empty embedding input", E, b'{"input": ""}'),
    ("embedding token id past the vocabulary", E, b'{"input": [99999999]}'),
]
EDGE = [  # (what, path, raw body): valid but extreme; a 200 with every field, or a 4xx with an OpenAI error body
    ("temperature 1e-40", C, b'{"prompt": "Hello", "max_tokens": 8, "temperature": 1e-40}'),
    ("unknown field (ignored)", CH, b"{" + HI + b', "max_tokens": 8, "frobnicate": 1}'),
    ("temperature 1e300", C, b'{"prompt": "Hello", "max_tokens": 8, "temperature": 1e300}'),
    ("top_k past the vocabulary", C, b'{"prompt": "Hello", "max_tokens": 8, "top_k": 10000000}'),
    ("min_p 1", C, b'{"prompt": "Hello", "max_tokens": 8, "min_p": 1.0}'),
    ("penalties at 2", CH, b"{" + HI + b', "max_tokens": 8, "presence_penalty": 2, "frequency_penalty": 2}'),
    ("empty prompt", C, b'{"prompt": "", "max_tokens": 8}'),
    ("max_tokens 1", CH, b"{" + HI + b', "max_tokens": 1}'),
    ("stop token id past the vocabulary", C, b'{"prompt": "Hello", "max_tokens": 8, "stop_token_ids": [99999999]}'),
    ("seed past 64 bits", C, b'{"prompt": "Hello", "max_tokens": 8, "seed": 99999999999999999999999}'),
    ("non-BMP text", CH, '{"messages": [{"role": "user", "content": "\U0001F600 \u202e x"}], '
                         '"max_tokens": 8}'.encode()),
    ("embeddings of token ids", E, b'{"input": [[1, 2, 3], [4]]}'),
    ("embedding of 1 dimension", E, b'{"input": "hi", "dimensions": 1}'),
]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "string", "maxLength": 20}, "n": {"type": "integer"}},
          "required": ["answer", "n"], "additionalProperties": False}
CHOICES = ["yes", "no", "maybe"]
WORDS = ("the a of and to in is it that was for on are with as his they be at one have this from or had by word but "
         "what some we can out other were all there when up use your how said an each she which do their time if will "
         "way about many then them write would like so these her long make thing see him two has look more day could "
         "go come did number sound no most people my over know water than call first who may down side been now find "
         "paris tokyo river mountain seven eleven blue green cat dog server memory block cache stream").split()


class Lost(Exception):
    """A request the server answered wrongly or not at all; the message says what came back."""


@dataclass
class Req:
    kind: str
    path: str
    body: dict | bytes  # bytes: sent as they are (malformed or extreme JSON text)
    what: str = ""  # the malformed or extreme variant
    expect: str = "ok"  # ok: a 200; 4xx: a 4xx; any: either
    stream: bool = False
    stop_after: int | None = None  # close the stream after this many events
    pace: float = 0.0  # seconds between reading events: a slow reader
    client_timeout: float | None = None  # give up after this long, as a client would
    check: Callable[[str], str | None] | None = None  # why a finished text breaks its constraint, else None

    def fields(self) -> dict:
        """The body as a dict ({} if it is no JSON object)."""
        if isinstance(self.body, dict):
            return self.body
        try:
            data = json.loads(self.body)
        except ValueError:
            return {}
        return data if isinstance(data, dict) else {}


# --- the requests ---------------------------------------------------------------------------------------------------
def prompt_text(rng: random.Random, prefixes: list[str]) -> str:
    """5..200 random words, half of them after one of a few shared prefixes (prefix-cache hits, splits, evictions)."""
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 200)))
    return rng.choice(prefixes) + " " + words if rng.random() < 0.5 else words


def generation(s: Soak, rng: random.Random, chat: bool) -> tuple[str, dict]:
    """A completion's or a chat's path and body: max_tokens 4..64 and a draw of the other sampling fields."""
    text = prompt_text(rng, s.prefixes)
    body = {"model": s.model, "max_tokens": rng.randint(4, 64), "temperature": rng.choice([0.0, 0.7, 1.0])}
    body.update({"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text})
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice(["\n", ".", " the"])]
    if rng.random() < 0.2:
        body["ignore_eos"] = True
    if rng.random() < 0.1:
        body.update({"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2})
    if rng.random() < 0.1:
        body.update(top_p=0.9, top_k=40)
    return (CH if chat else C), body


def long_generation(s: Soak, rng: random.Random, stream: bool) -> tuple[str, dict]:
    """A request that runs its full 64 tokens (sometimes two choices of it): for cancelling in flight."""
    path, body = generation(s, rng, rng.random() < 0.5)
    body.update(max_tokens=64, ignore_eos=True, stream=stream, n=rng.choice([1, 1, 1, 2]))
    body.pop("stop", None)
    return path, body


def make(kind: str, s: Soak, rng: random.Random) -> Req:
    """The request of one kind."""
    if kind in ("completion", "chat"):
        path, body = generation(s, rng, kind == "chat")
        if kind == "completion" and rng.random() < 0.1:
            body["n"] = 2
        return Req(kind, path, body)
    if kind == "stream":
        path, body = generation(s, rng, rng.random() < 0.5)
        body.update(stream=True, n=rng.choice([1, 1, 1, 2]))
        if rng.random() < 0.5:
            body["stream_options"] = {"include_usage": True}
        return Req(kind, path, body, stream=True)
    if kind == "cancel_stream":
        return Req(kind, *long_generation(s, rng, True), stream=True, stop_after=rng.randint(1, 8))
    if kind == "cancel_timeout":
        return Req(kind, *long_generation(s, rng, False), client_timeout=rng.uniform(0.05, 1.0))
    if kind == "deadline":
        path, body = long_generation(s, rng, False)
        return Req(kind, path, dict(body, timeout=rng.uniform(0.05, 0.5)))
    if kind == "slow_reader":
        path, body = generation(s, rng, rng.random() < 0.5)
        body.update(stream=True, max_tokens=min(body["max_tokens"], 32))
        return Req(kind, path, body, stream=True, pace=rng.uniform(0.05, 0.3))
    if kind in ("malformed", "edge"):
        what, path, raw = rng.choice(MALFORMED if kind == "malformed" else EDGE)
        return Req(kind, path, raw, what=what, expect="4xx" if kind == "malformed" else "any")
    if kind == "embeddings":
        inputs = [prompt_text(rng, s.prefixes) for _ in range(rng.randint(1, 4))]
        return Req(kind, E, {"model": s.model, "input": inputs})
    return structured(s, rng)


def structured(s: Soak, rng: random.Random) -> Req:
    """A JSON schema or a choice, whole or streamed, its answer checked where it finished (not cut by max_tokens)."""
    path, body = generation(s, rng, rng.random() < 0.7)
    for key in ("ignore_eos", "stop"):  # the first is refused with a constraint, the second would cut the JSON
        body.pop(key, None)
    body.update(max_tokens=64, stream=rng.random() < 0.3)
    if rng.random() < 0.5:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
        return Req("structured", path, body, what="json_schema", stream=body["stream"], check=schema_problem)
    body["structured_outputs"] = {"choice": CHOICES}
    return Req("structured", path, body, what="choice", stream=body["stream"],
               check=lambda text: None if text in CHOICES else f"{text!r} is not one of {CHOICES}")


def schema_problem(text: str) -> str | None:
    """Why ``text`` does not match SCHEMA, or None."""
    try:
        data = json.loads(text)
    except ValueError:
        return f"not JSON: {text!r}"
    ok = (isinstance(data, dict) and set(data) == {"answer", "n"} and isinstance(data["answer"], str)
          and len(data["answer"]) <= 20 and isinstance(data["n"], int) and not isinstance(data["n"], bool))
    return None if ok else f"does not match the schema: {text!r}"


# --- sending and judging --------------------------------------------------------------------------------------------
async def send(s: Soak, req: Req) -> str:
    """Send one request and say how it ended (ok, 4xx, cancelled); Lost if it went wrong."""
    if req.stream:
        return await send_stream(s, req)
    content = req.body if isinstance(req.body, bytes) else json.dumps(req.body).encode()
    try:
        r = await s.client.post(req.path, content=content, headers={"Content-Type": "application/json"},
                                timeout=req.client_timeout or s.timeout)
    except httpx.TimeoutException:
        if req.client_timeout is not None:
            return "cancelled"  # we gave up, as a client would; the server must abort it
        raise
    return judge(req, r)


def judge(req: Req, r: httpx.Response) -> str:
    """ok or 4xx as the request expects; Lost for anything else."""
    if r.status_code == 200 and req.expect != "4xx":
        check_answer(req, strict_json(r.text, "answer"))
        return "ok"
    if 400 <= r.status_code < 500 and r.status_code != 429 and req.expect != "ok":
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = None
        if not isinstance(message, str) or not message:
            raise Lost(f"HTTP {r.status_code} without an OpenAI error body: {r.text[:300]!r}")
        return "4xx"
    raise Lost(f"HTTP {r.status_code}: {r.text[:300]}")


def strict_json(text: str, what: str):
    """``text`` parsed as JSON proper; Lost if it is not (NaN and Infinity included, which Python would take)."""

    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")

    try:
        return json.loads(text, parse_constant=refuse)
    except ValueError as e:
        raise Lost(f"{what} is not JSON ({e}): {text[:300]!r}") from None


def check_answer(req: Req, data: dict) -> None:
    """Lost if a 200 answer lacks a field OpenAI's clients read, or breaks its request's constraint."""
    body = req.fields()
    if req.path == E:
        return check_embeddings(body, data)
    try:
        texts = [c["message"]["content"] if req.path == CH else c["text"] for c in data["choices"]]
        reasons = [c["finish_reason"] for c in data["choices"]]
        tokens = data["usage"]["completion_tokens"]
    except (KeyError, TypeError) as e:
        raise Lost(f"answer without {e}: {json.dumps(data)[:300]}") from None
    n, cap = body.get("n", 1), body.get("max_tokens")
    if len(texts) != n or not all(isinstance(t, str) for t in texts) or not set(reasons) <= {"stop", "length"}:
        raise Lost(f"malformed choices: {json.dumps(data)[:300]}")
    if isinstance(cap, int) and not 0 <= tokens <= n * cap:
        raise Lost(f"{tokens} completion tokens for n={n} x max_tokens={cap}")
    if req.check is not None and reasons[0] == "stop" and (why := req.check(texts[0])):
        raise Lost(f"finished output breaks its constraint: {why}")


def check_embeddings(body: dict, data: dict) -> None:
    """Lost unless there is one finite vector per input, all of one length."""
    inputs = body.get("input")
    count = 1 if isinstance(inputs, str) or (inputs and isinstance(inputs[0], int)) else len(inputs or [])
    try:
        vectors = [d["embedding"] for d in data["data"]]
    except (KeyError, TypeError) as e:
        raise Lost(f"answer without {e}: {json.dumps(data)[:300]}") from None
    sizes = {len(v) for v in vectors}
    finite = all(isinstance(x, (int, float)) and math.isfinite(x) for v in vectors for x in v)
    if len(vectors) != count or len(sizes) != 1 or 0 in sizes or not finite:
        raise Lost(f"{len(vectors)} vectors (sizes {sorted(sizes)}, finite {finite}) for {count} inputs")


async def send_stream(s: Soak, req: Req) -> str:
    """A streamed request read event by event; closed early after stop_after events, paced by pace."""
    events, texts, reasons, done = 0, [], {}, False
    async with s.client.stream("POST", req.path, json=req.body, timeout=s.timeout) as r:
        if r.status_code != 200:
            await r.aread()
            raise Lost(f"HTTP {r.status_code}: {r.text[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue  # read on: nothing may follow but the end
            index, text, finish = stream_event(line[6:], req.path == CH)
            texts += [text] if index == 0 else []
            reasons.update({index: finish} if finish else {})
            events += 1
            if req.stop_after is not None and events >= req.stop_after:
                return "cancelled"  # leaving the block closes the connection: the server must abort the request
            if req.pace:
                await asyncio.sleep(req.pace)
    n = req.body.get("n", 1)
    if not done or sorted(reasons) != list(range(n)) or not set(reasons.values()) <= {"stop", "length"}:
        raise Lost(f"stream ended early: {events} events, [DONE] {done}, finish_reasons {reasons} of {n} choices")
    if req.check is not None and reasons[0] == "stop" and (why := req.check("".join(texts))):
        raise Lost(f"finished output breaks its constraint: {why}")
    return "ok"


def stream_event(data: str, chat: bool) -> tuple[int, str, str | None]:
    """One SSE event's choice index, text and finish_reason; Lost if it is an error or malformed."""
    event = strict_json(data, "SSE event")
    try:
        if "error" in event:
            raise Lost(f"error event: {data[:300]}")
        if not event["choices"]:  # the usage event
            return -1, "", None
        c = event["choices"][0]  # one choice an event, as OpenAI streams them
        return c["index"], (c["delta"].get("content") or "") if chat else c["text"], c["finish_reason"]
    except (KeyError, TypeError, AttributeError, IndexError) as e:
        raise Lost(f"SSE event without {e}: {data[:300]}") from None


# --- the run --------------------------------------------------------------------------------------------------------
class Soak:
    """One run's client, counts, latencies and lost requests."""

    def __init__(self, client: httpx.AsyncClient, args, pid: int | None, model: str) -> None:
        self.client, self.pid, self.model = client, pid, model
        self.seed, self.timeout = args.seed, args.timeout
        rng = random.Random(args.seed)
        self.prefixes = [" ".join(rng.choice(WORDS) for _ in range(60)) for _ in range(4)]
        self.start = time.monotonic()
        self.end = self.start + args.minutes * 60  # brought forward if the server dies
        self.min_requests = args.min_requests
        self.died_at: float | None = None
        self.sent = 0
        self.counts: dict[str, Counter] = defaultdict(Counter)
        self.latencies: list[tuple[float, float]] = []  # (start s, latency s) of ok whole completions and chats
        self.lost: list[dict] = []
        self.lost_why: Counter = Counter()  # what came back, up to its first colon: "HTTP 500", "no answer within 60 s"

    async def one(self, i: int) -> None:
        """Request number ``i``: drawn, sent, judged, counted."""
        rng = random.Random(f"{self.seed}:{i}")
        req = make(rng.choices(list(KINDS), weights=list(KINDS.values()))[0], self, rng)
        t0 = time.monotonic()
        why = None
        try:
            outcome = await asyncio.wait_for(send(self, req), self.timeout)
        except Lost as e:
            outcome, why = "lost", str(e)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            outcome, why = "lost", f"no answer within {self.timeout:g} s"
        except httpx.HTTPError as e:
            outcome, why = "lost", f"{type(e).__name__}: {e}"
        self.counts[req.kind][outcome] += 1
        if outcome == "ok" and req.kind in ("completion", "chat"):
            self.latencies.append((t0 - self.start, time.monotonic() - t0))
        if why is not None:
            self.note_lost(req, t0, why)

    def note_lost(self, req: Req, t0: float, why: str) -> None:
        """Count it by what came back; keep the first 100 whole (body and answer) and say the first 20 at once."""
        self.lost_why[why.split(":")[0]] += 1
        body = req.body.decode(errors="replace") if isinstance(req.body, bytes) else json.dumps(req.body)
        entry = {"kind": req.kind, "what": req.what, "t_s": round(t0 - self.start, 2), "path": req.path,
                 "body": body, "why": why}
        if len(self.lost) < 100:
            self.lost.append(entry)
        if len(self.lost) <= 20:
            print(f"LOST {json.dumps(entry)}", file=sys.stderr, flush=True)

    def going(self) -> bool:
        """Whether to send another request: until the end of the run and at least --min-requests sent, unless the
        server is gone."""
        if self.died_at is not None:
            return False
        return time.monotonic() < self.end or self.sent < self.min_requests

    async def worker(self) -> None:
        """Requests one after another until the end of the run."""
        while self.going():
            self.sent += 1
            await self.one(self.sent - 1)


async def sample(s: Soak) -> dict:
    """RSS, the /metrics gauges and /health's latency, now."""
    t0 = time.perf_counter()
    try:
        status = (await s.client.get("/health", timeout=s.timeout)).status_code
    except httpx.HTTPError as e:
        status = type(e).__name__
    health_ms = (time.perf_counter() - t0) * 1000
    try:
        gauges = parse_metrics((await s.client.get("/metrics", timeout=s.timeout)).text)
    except httpx.HTTPError:
        gauges = {}
    return {"t_s": round(time.monotonic() - s.start, 1), "rss_mib": rss_mib(s.pid),
            "children_rss_mib": sum(filter(None, map(rss_mib, descendants(s.pid)))), "health_ms": round(health_ms, 2),
            "health_status": status, **{k: gauges.get(k) for k in GAUGES}}


def parse_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text page."""
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if line and not line.startswith("#") and "{" not in name:
            out[name] = float(value)
    return out


def descendants(pid: int | None) -> list[int]:
    """The processes ``pid`` started, and theirs (grammar compilers, engine workers): their memory is the server's
    too."""
    out, todo = [], [pid] if pid else []
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            try:
                kids = [int(k) for k in task.read_text().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def rss_mib(pid: int | None) -> float | None:
    """VmRSS of ``pid`` in MiB (None without a pid, or once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


async def sampler(s: Soak, every: float) -> list[dict]:
    """A sample every ``every`` seconds until the end; the run ends early if the server process is gone (every
    request after would be lost in a tight loop)."""
    samples = []
    while time.monotonic() < s.end:
        samples.append(await sample(s))
        if s.pid is not None and samples[-1]["rss_mib"] is None:  # gone, or a zombie (no VmRSS)
            s.died_at, s.end = samples[-1]["t_s"], time.monotonic()
            print(f"the server (pid {s.pid}) is gone at {s.died_at} s: traffic stops", file=sys.stderr)
        await asyncio.sleep(min(every, max(0.0, s.end - time.monotonic())))
    return samples


async def wait_idle(s: Soak, limit_s: float = 120) -> tuple[dict, float]:
    """Poll until nothing runs or waits (the aborts of our last cancellations included); the last sample and the
    seconds it took."""
    t0 = time.monotonic()
    while True:
        last = await sample(s)
        idle = last["justapi_requests_running"] == 0 and last["justapi_requests_waiting"] == 0
        if idle or s.died_at is not None or time.monotonic() - t0 > limit_s:
            return last, time.monotonic() - t0
        await asyncio.sleep(0.5)


async def soak(args, url: str, pid: int | None) -> dict:
    """The whole run against the server at ``url``: traffic, samples, then the idle check."""
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        s = Soak(client, args, pid, model)
        samples = asyncio.create_task(sampler(s, args.sample_every))
        await asyncio.gather(*(s.worker() for _ in range(args.concurrency)))
        drained = time.monotonic() - s.start
        idle, idle_wait = await wait_idle(s)
        return summarize(s, await samples, idle, idle_wait, drained, args)


# --- figures --------------------------------------------------------------------------------------------------------
def pct(values: list[float], p: float) -> float | None:
    """The p-th percentile (nearest rank), None if there are no values."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] if xs else None


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """The least-squares slope of (seconds, value) points, per hour."""
    if len(points) < 2:
        return None
    mt = sum(t for t, _ in points) / len(points)
    mv = sum(v for _, v in points) / len(points)
    var = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (v - mv) for t, v in points) / var * 3600 if var else None


def windows(s: Soak, run_s: float, count: int = 10) -> list[dict]:
    """p50 / p99 of the ok whole completions and chats, by start time in ``count`` windows of the run."""
    width = run_s / count
    split: list[list[float]] = [[] for _ in range(count)]
    for t, latency in s.latencies:
        split[min(count - 1, int(t / width))].append(latency)
    return [{"from_s": round(i * width, 1), "to_s": round((i + 1) * width, 1), "requests": len(xs),
             "p50_s": pct(xs, 50), "p99_s": pct(xs, 99)} for i, xs in enumerate(split)]


def kv_idle(idle: dict) -> dict:
    """The KV blocks requests still own once the server is idle, both ways."""
    used, cached = idle["justapi_kv_blocks_used"], idle["prefix_cache_blocks"]
    return {"idle": idle["justapi_requests_running"] == 0 and idle["justapi_requests_waiting"] == 0,
            "blocks_used": used, "prefix_cache_blocks": cached,
            "owned_by_requests": None if used is None or cached is None else used - cached,
            "gauge_used_by_requests": idle["justapi_kv_blocks_used_by_requests"],
            "how": "justapi_kv_blocks_used - prefix_cache_blocks (and the gauge justapi_kv_blocks_used_by_requests), "
                   "from /metrics once running == waiting == 0"}


def summarize(s: Soak, samples: list[dict], idle: dict, idle_wait: float, drained: float, args) -> dict:
    """Every figure of the run, as the JSON has them."""
    run_s = args.minutes * 60
    rss = [(x["t_s"], x["rss_mib"]) for x in samples + [idle] if x["rss_mib"] is not None]
    children = [x["children_rss_mib"] for x in samples + [idle] if x["rss_mib"] is not None]
    health = [x["health_ms"] for x in samples]
    wins = windows(s, run_s)
    p99s = [w["p99_s"] for w in wins if w["p99_s"] is not None]
    return {
        "requests": s.sent, "requests_per_s": s.sent / drained,
        "by_kind": {k: {o: s.counts[k][o] for o in OUTCOMES} for k in KINDS},
        "lost": sum(c["lost"] for c in s.counts.values()), "lost_by_what": dict(s.lost_why.most_common()),
        "lost_examples": s.lost,
        "rss_mib": {"first": rss[0][1] if rss else None, "last": rss[-1][1] if rss else None,
                    "max": max(v for _, v in rss) if rss else None,
                    "growth_per_hour_after_warmup": slope_per_hour([p for p in rss if p[0] >= run_s / 10]),
                    "children_first": children[0] if children else None,
                    "children_last": children[-1] if children else None},
        "kv_when_idle": kv_idle(idle), "idle_wait_s": round(idle_wait, 2), "drained_at_s": round(drained, 1),
        "preemptions": idle["justapi_preemptions_total"],
        "server_died_at_s": s.died_at,
        "health_ms": {"p99": pct(health, 99), "max": max(health, default=None), "samples": len(health),
                      "not_200": sum(1 for x in samples if x["health_status"] != 200)},
        "latency_windows": wins, "p99_drift": p99s[-1] / p99s[0] if len(p99s) >= 2 and p99s[0] else None,
        "samples": samples + [idle],
    }


def report(res: dict, head: str) -> str:
    """The text table."""
    lines = [head, f"{res['requests']} requests ({res['requests_per_s']:.1f}/s), drained at {res['drained_at_s']} s",
             f"{'kind':15} " + " ".join(f"{o:>9}" for o in OUTCOMES)]
    for kind, row in res["by_kind"].items():
        lines.append(f"{kind:15} " + " ".join(f"{row[o]:9d}" for o in OUTCOMES))
    total = {o: sum(r[o] for r in res["by_kind"].values()) for o in OUTCOMES}
    lines.append(f"{'all':15} " + " ".join(f"{total[o]:9d}" for o in OUTCOMES))
    r, kv, h = res["rss_mib"], res["kv_when_idle"], res["health_ms"]
    fmt = lambda v, f=".1f": "n/a" if v is None else format(v, f)  # noqa: E731
    why = ", ".join(f"{k} x{n}" for k, n in res["lost_by_what"].items())
    lines += [f"lost: {res['lost']}" + (f" ({why})" if why else ""),
              f"RSS MiB: first {fmt(r['first'])}, last {fmt(r['last'])}, max {fmt(r['max'])}; after the first tenth "
              f"{fmt(r['growth_per_hour_after_warmup'], '+.1f')} MiB/h; its child processes first "
              f"{fmt(r['children_first'])}, last {fmt(r['children_last'])}",
              f"KV blocks owned by requests when idle: {fmt(kv['owned_by_requests'], '.0f')} (used "
              f"{fmt(kv['blocks_used'], '.0f')} - prefix cache {fmt(kv['prefix_cache_blocks'], '.0f')}; gauge "
              f"used_by_requests {fmt(kv['gauge_used_by_requests'], '.0f')}; idle {kv['idle']} after "
              f"{res['idle_wait_s']} s); preemptions {fmt(res['preemptions'], '.0f')}",
              f"/health ms: p99 {fmt(h['p99'])}, max {fmt(h['max'])} over {h['samples']} samples, "
              f"{h['not_200']} not 200",
              "ok whole completions and chats, latency by start time: window  requests  p50 s  p99 s"]
    for w in res["latency_windows"]:
        lines.append(f"  {w['from_s']:7.0f}-{w['to_s']:<7.0f} {w['requests']:8d}  {fmt(w['p50_s'], '.3f'):>6} "
                     f"{fmt(w['p99_s'], '.3f'):>6}")
    lines.append(f"p99 drift (last window / first): {fmt(res['p99_drift'], '.2f')}")
    return "\n".join(lines)


# --- the server and the machine -------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(flags: list[str], log_path: Path) -> tuple[subprocess.Popen, str]:
    """``justapi serve`` on a free loopback port, once GET /health answers 200."""
    port = free_port()
    cmd = [str(BIN / "justapi"), "serve", "--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 900  # a first start may compile the kernels
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the server exited ({proc.returncode}); see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    stop_server(proc)
    sys.exit(f"the server did not answer /health with 200 within 900 s; see {log_path}")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # it died on its own
        pass
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def machine() -> dict:
    """The CPU, the commit (and whether the tree differs from it) and the command line."""
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown")
    repo = Path(__file__).resolve().parent.parent
    git = lambda *a: subprocess.run(["git", *a], cwd=repo, capture_output=True, text=True).stdout.strip()  # noqa: E731
    return {"cpu": cpu, "cores": os.cpu_count(), "commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "command": shlex.join([sys.executable, *sys.argv])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, required=True, help="how long traffic runs (30 for the real soak)")
    ap.add_argument("--min-requests", type=int, default=0,
                    help="send at least this many, past --minutes if need be (a count that does not depend on speed)")
    ap.add_argument("--concurrency", type=int, default=16, help="requests in flight (the server's --max-seqs here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="write every figure here")
    ap.add_argument("--url", help="drive this server instead of starting one")
    ap.add_argument("--pid", type=int, help="with --url: the server's pid, for its RSS")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take before it counts lost")
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between RSS / metrics / health samples")
    ap.add_argument("serve_args", nargs="*", help="extra flags for justapi serve, after --")
    args = ap.parse_args()

    load_before = Path("/proc/loadavg").read_text().split()[:3]  # other work on the machine skews every figure
    proc, log = None, Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = start_server([*SERVE_FLAGS, *args.serve_args], log)
        pid = proc.pid
    try:
        res = asyncio.run(soak(args, url, pid))
    finally:
        if proc is not None:
            stop_server(proc)
    res["machine"] = dict(machine(), loadavg_before=load_before,
                          loadavg_after=Path("/proc/loadavg").read_text().split()[:3])
    res["server"] = {"url": url, "pid": pid, "own": proc is not None, "log": str(log) if proc else None,
                     "flags": [*SERVE_FLAGS, *args.serve_args] if proc else None}
    m = res["machine"]
    head = (f"soak: {args.minutes:g} min, concurrency {args.concurrency}, seed {args.seed}; {m['cpu']}, "
            f"{m['commit'][:7]}{' (dirty)' if m['dirty'] else ''}; load average {m['loadavg_before'][0]} before, "
            f"{m['loadavg_after'][0]} after")
    print(report(res, head))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    owned = res["kv_when_idle"]["owned_by_requests"]
    gauge = res["kv_when_idle"]["gauge_used_by_requests"]
    sys.exit(1 if res["lost"] or owned != 0 or gauge not in (0, None) else 0)


if __name__ == "__main__":
    main()
