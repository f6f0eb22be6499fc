"""The live dashboard: ``/dashboard``, a static page shipped in the package (server/static/, no build step, no CDN),
and ``/dashboard/events``, Server-Sent Events that feed it: every TICK_S the engine's new step records (each step's
cells, pool and prefix cache: engine.step_log), the requests in them, latency percentiles over a sliding window, the
queue, speculative acceptance by position and, for engines in worker processes, each pool's workers and the KV
transfers.

Nobody watching costs the engine only its step records (kept anyway). A watcher costs the event loop one JSON message
a tick, and the engine thread a walk of its prefix tree a second (AsyncLLM.watchers)."""

import asyncio
import collections
import dataclasses
import importlib.resources
import json
import time

from fastapi import FastAPI
from fastapi.responses import Response, StreamingResponse

from ..bench.report import percentiles_ms
from ..core.stats import PdSnapshot
from ..engine.async_llm import AsyncLLM, RequestTiming
from ..engine.output_processor import RequestOutput
from .errors import ApiError
from .metrics import api_family

STATIC = importlib.resources.files("justapi.server") / "static"
PAGES = {"": ("index.html", "text/html; charset=utf-8"), "dashboard.js": ("dashboard.js", "text/javascript"),
         "dashboard.css": ("dashboard.css", "text/css")}
TICK_S = 0.25  # how often a page gets news
WINDOW_S = 60.0  # the sliding window of throughput and latency percentiles
HISTORY_STEPS = 240  # steps a page gets when it connects, so that it does not start blank
MAX_STEPS_A_TICK = 2000  # more (a page that stalled) are skipped: the page draws the latest only
MAX_WATCHERS = 8  # pages open at once; more get 429
PREVIEW_TOKENS = 24  # of a shared prefix, decoded for its label


@dataclasses.dataclass(frozen=True)
class FinishedRequest:
    """A request as the dashboard lists it once it ended (monotonic seconds)."""

    rid: str
    finished: float
    prompt: int
    output: int
    cached: int
    ttft: float | None
    tpot: float | None
    latency: float
    reason: str | None
    api: str  # the API family it came through (server.metrics.api_family)

    @classmethod
    def of(cls, rid: str, out: RequestOutput, timing: RequestTiming) -> "FinishedRequest":
        end = timing.finished or time.monotonic()
        ttft = timing.first_token - timing.arrival if timing.first_token is not None else None
        n = len(out.token_ids)
        tpot = (end - timing.first_token) / (n - 1) if timing.first_token is not None and n > 1 else None
        return cls(rid, end, out.num_prompt_tokens, n, out.num_cached_tokens, ttft, tpot, end - timing.arrival,
                   out.stop_reason if out.stop_reason == "timeout" else out.finish_reason, api_family(rid))


class DashboardFeed:
    """What the pages share: requests that finished lately (appended by the engine thread's on_finish)."""

    def __init__(self) -> None:
        self.finished: collections.deque[tuple[int, FinishedRequest]] = collections.deque(maxlen=8192)
        self.num_finished = 0  # appended so far; each entry carries its number

    def observe(self, rid: str, out: RequestOutput, timing: RequestTiming) -> None:
        self.finished.append((self.num_finished, FinishedRequest.of(rid, out, timing)))
        self.num_finished += 1

    def since(self, count: int) -> tuple[list[FinishedRequest], int]:
        """Requests finished after the first ``count``, and the count to ask from next time."""
        entries = list(self.finished)  # one copy: the engine thread may append meanwhile
        new = [f for n, f in entries if n >= count]
        return new, entries[-1][0] + 1 if entries else count

    def window(self, now: float) -> dict:
        """Requests and latency percentiles over the window, all together and per API family."""
        recent = [f for _, f in list(self.finished) if now - f.finished <= WINDOW_S]
        families = sorted({f.api for f in recent})
        return {"seconds": WINDOW_S, **_latencies(recent),
                "by_api": {api: _latencies([f for f in recent if f.api == api]) for api in families}}


def _latencies(requests: list[FinishedRequest]) -> dict:
    return {"requests": len(requests), "ttft_ms": percentiles_ms([f.ttft for f in requests if f.ttft is not None]),
            "tpot_ms": percentiles_ms([f.tpot for f in requests if f.tpot is not None])}


class Watch:
    """One open page: where it is in the step log and the finished list, and what it was already told."""

    def __init__(self, llm: AsyncLLM, feed: DashboardFeed, tokenizer, prompt_text: bool) -> None:
        self.llm, self.feed, self.tokenizer, self.prompt_text = llm, feed, tokenizer, prompt_text
        self.seq = max(0, llm.step_log.next_seq - HISTORY_STEPS)
        self.finished_count = max(0, feed.num_finished - 64)
        self.throughput = collections.deque()  # (time, output tokens delivered so far)
        self.previews: dict[tuple[int, ...], str] = {}

    def tick(self) -> dict:
        llm, now = self.llm, time.monotonic()
        records, self.seq = llm.step_log.since(self.seq)
        records = records[-MAX_STEPS_A_TICK:]
        finished, self.finished_count = self.feed.since(self.finished_count)
        self.throughput.append((now, llm.num_output_tokens))
        while now - self.throughput[0][0] > WINDOW_S:
            self.throughput.popleft()
        (t0, n0), (t1, n1) = self.throughput[0], self.throughput[-1]
        snap = llm.stats
        msg = {"now": now, "steps": [_step(r) for r in records], "running": self._running(records),
               "finished": [dataclasses.asdict(f) for f in finished],
               "window": self.feed.window(now) | {"output_throughput": (n1 - n0) / (t1 - t0) if t1 > t0 else None},
               "waiting": llm.num_waiting, "output_tokens": llm.num_output_tokens}
        if isinstance(snap, PdSnapshot):
            msg["num_running"] = sum(w.running for w in snap.workers if w.alive)
            msg["pools"] = [dataclasses.asdict(dataclasses.replace(w, costs=None)) for w in snap.workers]
            msg["transfers"] = dataclasses.asdict(snap.counters)
        else:
            c = snap.counters
            msg["num_running"] = snap.num_running
            msg["kv_blocks_total"] = snap.kv_blocks_total
            msg["cache"] = {"blocks": snap.prefix_cache_blocks, "hits": snap.prefix_cache_hits,
                            "misses": snap.prefix_cache_misses, "disk_hits": snap.prefix_cache_disk_hits,
                            "shared": self._shared()}
            if snap.disk_tier is not None:
                msg["cache"]["disk"] = dataclasses.asdict(snap.disk_tier)
            msg["spec"] = {"proposed_at": c.spec_proposed_at, "accepted_at": c.spec_accepted_at}
            if snap.state_slots_total:  # a hybrid model's state cache
                msg["states"] = {"slots": snap.state_slots_total, "used": snap.state_slots_used,
                                 "bytes": snap.state_cache_bytes}
        return msg

    def _running(self, records) -> dict:
        """The requests in these steps' cells that are still streaming: tokens and timings so far."""
        out = {}
        for rid in {c[0] for r in records if r.work is not None for c in r.work.cells}:
            t = self.llm.timing(rid)
            if t is not None:
                out[rid] = {"prompt": t.num_prompt_tokens, "output": t.num_output_tokens, "arrival": t.arrival,
                            "first_token": t.first_token}
        return out

    def _shared(self) -> list[dict]:
        shared = []
        for tokens, hits in self.llm.shared_prefixes:
            if not self.prompt_text:  # prompts are the clients' own: shown only where the operator asked
                shared.append({"tokens": len(tokens), "requests": hits, "text": None})
                continue
            head = tokens[:PREVIEW_TOKENS]
            if head not in self.previews:
                if len(self.previews) > 64:  # the prefixes of an hour ago
                    self.previews.clear()
                self.previews[head] = self.tokenizer.decode(list(head), skip_special_tokens=False)
            shared.append({"tokens": len(tokens), "requests": hits, "text": self.previews[head]})
        return shared


def _step(r) -> dict:
    step = {"seq": r.seq, "t": r.start, "seconds": r.step, "waiting": r.num_waiting}
    w = r.work
    if w is not None:
        step |= {"cells": w.cells, "preempted": w.preempted, "finished": w.finished, "kv": w.kv_blocks,
                 "hits": w.prefix_hits, "misses": w.prefix_misses, "tokens": w.num_tokens}
    return step


def install(app: FastAPI, ready_llm, tokenizer, feed: DashboardFeed, prompt_text: bool) -> None:
    """Add the dashboard's routes: the page, its two files and the event stream (with the shared prefixes' text
    where ``prompt_text``)."""

    @app.get("/dashboard")
    async def dashboard_page():
        return _static("")

    @app.get("/dashboard/events")  # before the files' route, which would take its name
    async def dashboard_events():
        llm = ready_llm()
        if llm.watchers >= MAX_WATCHERS:
            raise ApiError(429, f"{MAX_WATCHERS} dashboards are open already", "rate_limit_error")
        watch = Watch(llm, feed, tokenizer(), prompt_text)
        llm.watchers += 1  # the event loop alone changes it; the engine thread only reads it

        async def events():
            try:
                yield "retry: 2000\n\n"
                while True:  # until the page goes: the response's send fails or is cancelled
                    yield f"data: {json.dumps(watch.tick(), separators=(',', ':'))}\n\n"
                    await asyncio.sleep(TICK_S)
            finally:
                llm.watchers -= 1

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.get("/dashboard/{name}")
    async def dashboard_file(name: str):
        if name not in PAGES:
            raise ApiError(404, f"the dashboard has no file {name!r}", "not_found_error")
        return _static(name)


def _static(name: str) -> Response:
    file, media_type = PAGES[name]
    return Response((STATIC / file).read_bytes(), media_type=media_type, headers={"Cache-Control": "no-cache"})
