"""Send a workload to one OpenAI-compatible server over streaming HTTP and time every token.

Each request streams (SSE) with ``stream_options.include_usage`` so the server's own token counts come back;
``ignore_eos`` keeps output lengths as asked on servers that honour it (JustAPI, vLLM, llama.cpp's server).
Only ``base_url`` is contacted. The whole run stops at ``time_limit`` seconds: requests still going then are
cancelled and counted as failed ("time limit").
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from .workloads import Job, Turn


@dataclass
class RequestResult:
    ok: bool
    kind: str = ""
    error: str = ""
    response_id: str = ""  # the server's id of the response (JustAPI's engine runs its choice i as ID-i)
    start: float = 0.0  # monotonic seconds
    end: float = 0.0
    ttft: float | None = None  # seconds to the first content token
    chunk_times: list[float] = field(default_factory=list)  # arrival of every chunk that carried text
    output_tokens: int = 0  # the server's usage.completion_tokens, else chunks with text
    prompt_tokens: int = 0  # the server's usage.prompt_tokens, 0 if it reports none
    usage_reported: bool = False
    text: str = ""
    prompt: str = ""  # a completion's prompt as sent (the planner places its KV blocks: plan.profile)

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def timing(self) -> dict:
        """What a reader of the server's step log needs to place this request in it (monotonic seconds)."""
        return {"id": self.response_id, "ok": self.ok, "start": self.start, "ttft": self.ttft, "end": self.end,
                "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens}


async def model_name(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model the server lists at /v1/models, or "default" if it lists none."""
    try:
        r = await client.get(base_url + "/v1/models", timeout=10)
        data = r.json().get("data") or []
        if r.status_code == 200 and data and isinstance(data[0].get("id"), str):
            return data[0]["id"]
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return "default"


async def _send(client: httpx.AsyncClient, base_url: str, model: str, turn: Turn, history: list[dict],
                temperature: float, timeout: float, kind: str, extra_body: dict | None = None) -> RequestResult:
    """One streamed request; ``extra_body`` is merged into its body last."""
    res = RequestResult(ok=False, kind=kind, start=time.monotonic())
    common = {"model": model, "max_tokens": turn.max_tokens, "temperature": temperature, "stream": True,
              "stream_options": {"include_usage": True}, "ignore_eos": True, **(extra_body or {})}
    if turn.prompt is not None:
        url, body, chat = base_url + "/v1/completions", {**common, "prompt": turn.prompt}, False
        res.prompt = turn.prompt
    else:
        messages = turn.messages if turn.messages is not None else history + [{"role": "user", "content": turn.user}]
        url, body, chat = base_url + "/v1/chat/completions", {**common, "messages": messages}, True
    pieces: list[str] = []
    try:
        async with client.stream("POST", url, json=body, timeout=timeout) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode("utf-8", "replace")[:300]
                res.error = f"HTTP {r.status_code}: {detail}"
                res.end = time.monotonic()
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                now = time.monotonic()
                try:
                    event = json.loads(payload)
                except json.JSONDecodeError:
                    res.error = f"bad SSE event: {payload[:200]}"
                    break
                if "error" in event:
                    res.error = f"server error: {json.dumps(event['error'])[:300]}"
                    break
                res.response_id = res.response_id or str(event.get("id") or "")
                for choice in event.get("choices") or ():
                    piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                    if piece:
                        if res.ttft is None:
                            res.ttft = now - res.start
                        res.chunk_times.append(now)
                        pieces.append(piece)
                usage = event.get("usage")
                if usage:
                    res.usage_reported = True
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    except (httpx.HTTPError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.end = time.monotonic()
    res.text = "".join(pieces)
    if not res.usage_reported:
        res.output_tokens = len(res.chunk_times)
    # a request whose tokens all decode to no text (e.g. skipped special tokens) still succeeded if usage says so
    res.ok = not res.error and (res.ttft is not None or res.output_tokens > 0)
    if not res.ok and not res.error:
        res.error = "no tokens received"
    return res


async def _run_job(client, base_url, model, job: Job, temperature, timeout, results: list[RequestResult],
                   extra_body: dict | None = None):
    history: list[dict] = []
    body = {**job.fields, **(extra_body or {})}
    for i, turn in enumerate(job.turns):
        res = await _send(client, base_url, model, turn, history, temperature, timeout, job.kind, body)
        results.append(res)
        if not res.ok:  # a conversation cannot go on without the answer it extends
            skipped = len(job.turns) - i - 1
            results += [RequestResult(ok=False, kind=job.kind, error="skipped: an earlier turn failed",
                                      start=res.end, end=res.end) for _ in range(skipped)]
            return
        if turn.user is not None:  # a chat turn's user message (not the request's user field)
            history += [{"role": "user", "content": turn.user}, {"role": "assistant", "content": res.text}]


async def run_workload(base_url: str, jobs: list[Job], starts: list[float], *, max_concurrency: int | None = None,
                       temperature: float = 0.0, request_timeout: float = 300.0, time_limit: float = 900.0,
                       model: str | None = None, extra_body: dict | None = None,
                       ) -> tuple[list[RequestResult], float, str]:
    """Send ``jobs`` at ``starts`` (seconds); returns the results, the wall time and the model name used.
    ``extra_body``: fields merged into every request (a response_format, say; it may override ignore_eos)."""
    base_url = base_url.rstrip("/")
    results: list[RequestResult] = []
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        model = model or await model_name(client, base_url)
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        t0 = time.monotonic()

        async def launch(job: Job, at: float):
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            if gate is None:
                await _run_job(client, base_url, model, job, temperature, request_timeout, results, extra_body)
            else:
                async with gate:
                    await _run_job(client, base_url, model, job, temperature, request_timeout, results, extra_body)

        tasks = [asyncio.create_task(launch(j, at)) for j, at in zip(jobs, starts)]
        done, pending = await asyncio.wait(tasks, timeout=time_limit)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        elapsed = time.monotonic() - t0
        sent = sum(len(j.turns) for j in jobs)
        missing = sent - len(results)
        now = time.monotonic()
        results += [RequestResult(ok=False, error="time limit", start=now, end=now) for _ in range(missing)]
    return results, elapsed, model


def read_step_log(url: str, since: int) -> list[dict]:
    """A JustAPI server's step records from ``since`` on (GET /engine/steps, page by page)."""
    steps = []
    with httpx.Client(base_url=url.rstrip("/"), timeout=60) as client:
        while True:
            r = client.get("/engine/steps", params={"since": since})
            r.raise_for_status()
            page = r.json()
            steps += page["steps"]
            if not page["steps"]:
                return steps
            since = page["next"]
