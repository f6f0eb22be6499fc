"""``justapi bench offline``: the same workload run in process (no HTTP), static batching next to continuous.

Requests are all queued at once. Multi-turn conversations run in rounds: every conversation's turn k, then turn
k + 1 with the answers appended. For the static baseline it also reports the seeds' batch utilisation

    U = sum_i L_i / (N * max_i L_i)   per batch of N requests with output lengths L_i

(1.0 when every request of a batch generates as long as the longest; continuous batching has no such waste).
"""

from __future__ import annotations

import time

from .client import RequestResult
from .workloads import Job


def run_offline(engine, jobs: list[Job], time_limit: float, temperature: float = 0.0,
                timeline: list[dict] | None = None) -> tuple[list[RequestResult], float]:
    """Run ``jobs`` through ``engine`` (an EngineCore); returns per-request results and the wall time. Appends each
    step that computed something to ``timeline`` where one is given (bench.timeline's entries)."""
    from .timeline import step_entry

    histories: list[list[dict]] = [[] for _ in jobs]
    results: list[RequestResult] = []
    t0 = time.monotonic()
    rounds = max(len(j.turns) for j in jobs)
    for k in range(rounds):
        live: dict[str, tuple[RequestResult, int]] = {}
        for i, job in enumerate(jobs):
            if k >= len(job.turns):
                continue
            res = _add_turn(engine, f"bench-{k}-{i}", job, k, histories[i], temperature)
            if res.error:  # refused
                results.append(res)
            else:
                live[f"bench-{k}-{i}"] = (res, i)
        while engine.has_unfinished and time.monotonic() - t0 < time_limit:
            t_step = time.monotonic()
            outs = engine.step()
            if timeline is not None and engine.last_step.cells:
                timeline.append(step_entry(t_step - t0, time.monotonic() - t_step, engine.last_step))
            for out in outs:
                res, i = live[out.request_id]
                now = time.monotonic()
                if out.new_token_ids:
                    if res.ttft is None:
                        res.ttft = now - res.start
                    res.chunk_times.append(now)
                if out.finished:
                    res.ok, res.end, res.output_tokens, res.text = True, now, len(out.token_ids), out.text
                    turn = jobs[i].turns[k]
                    if turn.user is not None:
                        histories[i] += [{"role": "user", "content": turn.user},
                                         {"role": "assistant", "content": out.text}]
        for rid, (res, _) in live.items():
            if not res.ok:
                engine.abort_request(rid)
                res.error, res.end = "time limit", time.monotonic()
            results.append(res)
        if time.monotonic() - t0 >= time_limit:
            break
    done = len(results)
    results += [RequestResult(ok=False, error="time limit") for _ in range(sum(len(j.turns) for j in jobs) - done)]
    return results, time.monotonic() - t0


def _add_turn(engine, rid: str, job: Job, k: int, history: list[dict], temperature: float) -> RequestResult:
    """Queue turn ``k`` of ``job`` (a prompt, or the conversation so far and the turn's user message); its result,
    with the error where the engine refused it."""
    from ..sampling_params import SamplingParams

    turn = job.turns[k]
    if turn.prompt is not None:
        ids = engine.tokenizer.encode(turn.prompt)
    else:
        messages = turn.messages if turn.messages is not None else history + [{"role": "user", "content": turn.user}]
        ids = engine.render_chat(messages, True)
    params = SamplingParams(max_tokens=turn.max_tokens, temperature=temperature, ignore_eos=True)
    res = RequestResult(ok=False, kind=job.kind, start=time.monotonic(), prompt_tokens=len(ids), usage_reported=True)
    try:
        engine.add_request(rid, ids, params)
    except ValueError as e:
        res.error, res.end = str(e), res.start
    return res
