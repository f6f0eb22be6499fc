"""``justapi plan profile``: a short run of a real ``justapi serve`` (a child process on loopback, the flags given)
under workloads chosen to cover the step shapes serving meets, its step log read back (``/engine/steps``) and a
cost model fitted to it (plan.cost_model).

A step's cost is what the engine thread spent on it: the commands taken in before it (requests added), the step
itself and the delivery of its outputs; the idle wait for work is not a step's. Each phase is ``bench serve``'s
random workload at one concurrency: one request at a time (a single stream over contexts up to a long prompt's,
prompts in chunks of every size), then batches of 4, 16 and the server's ``--max-seqs`` (prefill mixed with
decodes, the kernel routes of every row count).
"""

from __future__ import annotations

import asyncio
import os
import re
import statistics
from dataclasses import dataclass

import httpx

from ..bench.cli import _step_log_position
from ..bench.client import RequestResult, read_step_log, run_workload
from ..bench.workloads import WorkloadSpec, arrival_times, build
from ..config import EngineConfig, usable_cores
from ..core.router import block_chain
from .cost_model import CostModel, StepShape, fit, this_machine

SERVER_START_S = 600.0  # a large model's load


@dataclass(frozen=True)
class Phase:
    """One profiling run: requests at a concurrency, prompt and output lengths in tokens; with ``prefix_len``, the
    prompts share prefixes (prompt chunks that start after a prefix-cache hit)."""

    requests: int
    concurrency: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    prefix_len: int = 0


def phases(max_seqs: int, max_model_len: int, scale: float = 1.0) -> list[Phase]:
    """The profile's runs for a server of ``max_seqs`` sequences (``scale`` makes each longer or shorter): a single
    stream over short and long contexts, batches of every size over short and long contexts, and prompts after a
    cached prefix (so that a chunk's rows, its attention pairs and the decodes' contexts vary apart)."""
    longest = max(64, min(2048, max_model_len // 2))
    half = min(16, max_seqs)
    out = [Phase(6, 1, (16, longest), (24, 48)), Phase(12, 4, (32, 512), (16, 96)),
           Phase(32, half, (32, 512), (16, 128)), Phase(2 * half, half, (longest // 2, longest), (32, 64)),
           Phase(24, 4, (16, 256), (8, 32), prefix_len=min(1024, longest // 2)),
           Phase(3 * half, half, (16, 64), (16, 64), prefix_len=min(512, longest // 2))]
    if max_seqs > 16:
        out.append(Phase(2 * max_seqs, max_seqs, (64, 512), (16, 192)))
    return [Phase(max(1, round(p.requests * scale)), p.concurrency, p.input_len, p.output_len, p.prefix_len)
            for p in out]


def step_samples(records: list[dict], blocks: dict | None = None,
                 block_size: int = 16) -> tuple[list[StepShape], list[float]]:
    """The shape and engine-thread seconds (commands + step + delivery) of each record that computed something;
    ``blocks``: the requests' prompt block hashes (``prompt_blocks``), for the context their rows share (each
    request's prefix-cache hit read from where its first cell starts)."""
    hits: dict[str, int] = {}
    for rec in records:
        for rid, _, start, *_ in (rec.get("work") or {}).get("cells") or ():
            hits.setdefault(rid, start)
    shapes, seconds = [], []
    for rec in records:
        work = rec.get("work")
        if not work or not work.get("cells"):
            continue
        shapes.append(StepShape.of_cells(work["cells"], blocks, block_size, hits if blocks is not None else None))
        seconds.append(rec["commands"] + rec["step"] + rec["deliver"])
    return shapes, seconds


def server_settings(url: str, config: EngineConfig) -> dict:
    """What the simulation of this server needs besides the flags: its pool's blocks and longest context."""
    metrics = httpx.get(url + "/metrics", timeout=30).text
    found = re.search(r"^justapi_kv_blocks_total\s+([0-9.e+]+)$", metrics, re.M)
    if found is None:
        raise RuntimeError("the server's /metrics has no justapi_kv_blocks_total")
    limits = httpx.post(url + "/tokenize", json={"prompt": "a"}, timeout=30).json()
    return dict(num_blocks=int(float(found.group(1))), max_model_len=int(limits["max_model_len"]),
                block_size=config.block_size, max_seqs=config.max_seqs, chunk_size=config.chunk_size,
                max_prefill=config.max_prefill, max_decode=config.max_decode, prefix_cache=config.prefix_cache)


async def _run_phases(url: str, config: EngineConfig, tokenizer, settings: dict, scale: float,
                      seed: int) -> list[list[RequestResult]]:
    """Each phase's requests' results (the first phase's: one request at a time)."""
    out = []
    for k, phase in enumerate(phases(config.max_seqs, settings["max_model_len"], scale)):
        if phase.prefix_len:
            spec = WorkloadSpec("shared-prefix", input_len=phase.input_len, output_len=phase.output_len,
                                num_prefixes=2, prefix_len=phase.prefix_len,
                                suffixes_per_prefix=max(1, phase.requests // 2), seed=seed + k)
        else:
            spec = WorkloadSpec("random", phase.requests, phase.input_len, phase.output_len, seed=seed + k)
        jobs = build(spec, tokenizer)
        results, _, _ = await run_workload(url, jobs, arrival_times(jobs, float("inf"), "poisson", seed),
                                           max_concurrency=phase.concurrency, request_timeout=600.0,
                                           time_limit=3600.0)
        failed = [r.error for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} profiling requests failed, e.g. {failed[0]}")
        out.append(results)
    return out


def front_and_tail(results: list[RequestResult], records: list[dict]) -> tuple[float, float]:
    """The HTTP front's seconds before a request reaches the engine, and after its first token leaves a step until
    the client has it: medians over requests sent one at a time (the engine idle when each arrives), each placed in
    the step log by its id (client and server read the same monotonic clock)."""
    first_step: dict[str, dict] = {}  # request id -> the step it was first scheduled in
    token_step: dict[tuple[str, int], dict] = {}  # (request id, tokens computed) -> the step that computed them
    for rec in records:
        for rid, _, start, n, *_ in (rec.get("work") or {}).get("cells") or ():
            first_step.setdefault(rid, rec)
            token_step.setdefault((rid, start + n), rec)
    fronts, tails = [], []
    for res in results:
        rid = f"{res.response_id}-0"
        first, last = first_step.get(rid), token_step.get((rid, res.prompt_tokens))
        if first is None or last is None or res.ttft is None:
            continue
        fronts.append(first["start"] - res.start)  # the engine loop woke for its command
        tails.append(res.start + res.ttft - (last["start"] + last["commands"] + last["step"] + last["deliver"]))
    if not fronts:
        return 0.0, 0.0
    return max(0.0, statistics.median(fronts)), max(0.0, statistics.median(tails))


async def settled(pid: int, still_s: float = 1.0, poll_s: float = 0.25, limit_s: float = 300.0) -> None:
    """Wait until the server's memory stops growing: the KV pool's prefault (model.hugepages) takes a core for
    seconds after a start, and steps measured meanwhile are the start's, not the engine's."""
    last, since, waited = -1, 0.0, 0.0
    while since < still_s and waited < limit_s:
        try:
            with open(f"/proc/{pid}/status") as f:
                rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (OSError, StopIteration):
            return  # not Linux, or the process is gone (the phases will say so)
        since = since + poll_s if abs(rss - last) < 1024 else 0.0
        last = rss
        await asyncio.sleep(poll_s)
        waited += poll_s


def prompt_blocks(results: list[RequestResult], tokenizer, block_size: int) -> dict[str, list]:
    """Each completion's prompt block hashes (core.router.block_chain), by the id its cells carry in the step log;
    the prompt encoded as the server encodes it."""
    return {f"{r.response_id}-0": list(block_chain(tokenizer.encode(r.prompt), block_size))
            for r in results if r.prompt}


async def measure(url: str, config: EngineConfig, tokenizer, scale: float = 1.0,
                  seed: int = 0) -> tuple[list[dict], dict, dict[str, list]]:
    """Run the phases against the server at ``url`` (serving ``config``, settled): its step records of them, its
    settings (``server_settings``) and the requests' prompt blocks. A first pass of the phases at a quarter of their
    size, unrecorded, pays the first-use costs (kernels made for each new row count)."""
    settings = await asyncio.to_thread(server_settings, url, config)
    await _run_phases(url, config, tokenizer, settings, scale / 4, seed + 100)
    first = await asyncio.to_thread(_step_log_position, url)
    results = await _run_phases(url, config, tokenizer, settings, scale, seed)
    records = await asyncio.to_thread(read_step_log, url, first)
    settings["front_s"], settings["tail_s"] = front_and_tail(results[0], records)
    blocks = prompt_blocks([r for phase in results for r in phase], tokenizer, config.block_size)
    return records, settings, blocks


def fit_records(records: list[dict], config: EngineConfig, settings: dict, blocks: dict | None = None) -> CostModel:
    """The cost model of a server's step records (this machine's, ``config``'s threads)."""
    shapes, seconds = step_samples(records, blocks, config.block_size)
    return fit(shapes, seconds, os.path.basename(config.model), this_machine(), config.num_threads or usable_cores(),
               settings)


async def profile(serve_argv: list[str], config: EngineConfig, tokenizer, scale: float = 1.0,
                  seed: int = 0) -> tuple[CostModel, list[dict]]:
    """Start ``justapi serve`` with ``serve_argv``, run the phases, fit; the model and the step records."""
    from ..engine.model_process import ModelProcess

    name = "plan-profile"
    server = ModelProcess(name, [*serve_argv, "--served-model-name", name])
    await server.start(SERVER_START_S)
    try:
        assert server.proc is not None
        await settled(server.proc.pid)
        records, settings, blocks = await measure(server.url, config, tokenizer, scale, seed)
    finally:
        await server.stop()
    return fit_records(records, config, settings, blocks), records
