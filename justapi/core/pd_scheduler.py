"""PdScheduler: prefill and decode on separate worker pools. Pure Python: it routes, the workers compute.

Each request goes through three phases::

    prefill   on a prefill worker: its prompt in chunks, continuous batching, then the first token is sampled
    transfer  its prompt's KV blocks go from that worker to a decode worker (torch.distributed isend / irecv)
    decode    on the decode worker: continuous batching until it finishes; tokens stream back through the server

Routing: a prefill worker is the least loaded one, unless another holds more of the prompt's prefix in its prefix
cache (tracked here from the prompts sent to it, block by block) without being much busier; a decode worker is
the least loaded one with room for the request's blocks (as last reported). A worker that dies takes its requests
with it: those still in prefill are sent to another prefill worker, the others fail with an error.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

PREFIX_SLACK = 2  # a prefix-cache hit may route to a worker with at most this many more requests than the least loaded


@dataclass
class WorkerInfo:
    rank: int
    role: str  # "prefill" | "decode"
    num_blocks: int = 0
    block_size: int = 16
    alive: bool = True
    requests: set[str] = field(default_factory=set)
    # last reported by the worker
    free_blocks: int = 0
    running: int = 0
    waiting: int = 0
    busy_fraction: float = 0.0  # share of wall time spent in engine steps since the previous report
    cache_hits: int = 0
    cache_misses: int = 0
    cached_blocks: int = 0
    costs: object = None  # core.admission.StepCosts the worker fitted to its steps, None before its first
    prefill_backlog: int = 0  # prompt tokens still to compute, reported plus routed here since the report
    num_decoding: int = 0
    # prompt prefixes recently prefilled here: block-chain hash → None, oldest first
    shadow: OrderedDict = field(default_factory=OrderedDict)

    @property
    def load(self) -> int:
        return len(self.requests)

    def report(self, load) -> None:
        """Take the worker's periodic report (engine.pd_messages.Load)."""
        self.free_blocks, self.running, self.waiting = load.free_blocks, load.running, load.waiting
        self.busy_fraction = load.busy_fraction
        self.cache_hits, self.cache_misses, self.cached_blocks = load.cache_hits, load.cache_misses, load.cached_blocks
        self.costs, self.prefill_backlog, self.num_decoding = load.costs, load.prefill_backlog, load.num_decoding


@dataclass
class PdRequest:
    request_id: str
    prompt_token_ids: list[int]
    phase: str = "prefill"  # prefill | transfer | decode
    prefill_rank: int = -1
    decode_rank: int = -1
    num_cached_tokens: int = 0


@dataclass
class PdStats:
    kv_transfers: int = 0
    kv_bytes: int = 0
    kv_blocks: int = 0
    kv_seconds: float = 0.0
    retried: int = 0
    failed: int = 0


class PdScheduler:
    """Which worker computes what; the workers' own schedulers batch, page and preempt inside each worker."""

    def __init__(self, workers: list[WorkerInfo]) -> None:
        self.workers = {w.rank: w for w in workers}
        self.requests: dict[str, PdRequest] = {}
        self.stats = PdStats()

    def pool(self, role: str, alive_only: bool = True) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role and (w.alive or not alive_only)]

    # --- routing ----------------------------------------------------------------------------------------------
    def route_prefill(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """Assign a new request to a prefill worker; its rank. Raises RuntimeError when none is alive."""
        pool = self.pool("prefill")
        if not pool:
            raise RuntimeError("no prefill worker is alive")
        least = min(w.load for w in pool)
        best = max(pool, key=lambda w: (self._prefix_hit(w, prompt_token_ids) if w.load <= least + PREFIX_SLACK
                                        else -1, -w.load, -w.rank))
        req = self.requests.get(request_id) or PdRequest(request_id, list(prompt_token_ids))
        req.phase, req.prefill_rank = "prefill", best.rank
        self.requests[request_id] = req
        best.requests.add(request_id)
        best.waiting += 1  # until its next report counts it
        best.prefill_backlog += len(prompt_token_ids)
        self._remember(best, prompt_token_ids)
        return best.rank

    def route_decode(self, request_id: str, num_tokens: int) -> int:
        """Pick the decode worker for a prefilled request; the request enters the transfer phase."""
        req = self.requests[request_id]
        pool = self.pool("decode")
        if not pool:
            raise RuntimeError("no decode worker is alive")
        need = -(-(num_tokens + 1) // pool[0].block_size)
        roomy = [w for w in pool if w.free_blocks >= need] or pool
        best = min(roomy, key=lambda w: (w.load, w.rank))
        self.workers[req.prefill_rank].requests.discard(request_id)
        req.phase, req.decode_rank = "transfer", best.rank
        best.requests.add(request_id)
        best.free_blocks -= need  # until its next report
        return best.rank

    def transferred(self, request_id: str, nbytes: int, nblocks: int, seconds: float) -> None:
        self.stats.kv_transfers += 1
        self.stats.kv_bytes += nbytes
        self.stats.kv_blocks += nblocks
        self.stats.kv_seconds += seconds
        req = self.requests.get(request_id)
        if req is not None and req.phase == "transfer":
            req.phase = "decode"  # (or earlier: when the decode worker reports it received the KV)

    def finished(self, request_id: str) -> PdRequest | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            for w in self.workers.values():
                w.requests.discard(request_id)
        return req

    def holder(self, request_id: str) -> list[int]:
        """Ranks that hold state for the request (to abort it there)."""
        req = self.requests.get(request_id)
        if req is None:
            return []
        if req.phase == "prefill":
            return [req.prefill_rank]
        if req.phase == "transfer":
            return [req.prefill_rank, req.decode_rank]
        return [req.decode_rank]

    def worker_died(self, rank: int) -> tuple[list[str], list[str]]:
        """Mark ``rank`` dead; (requests to send to prefill again, requests that fail)."""
        w = self.workers[rank]
        w.alive = False
        retry, fail = [], []
        for rid, req in list(self.requests.items()):
            involved = req.prefill_rank == rank if req.phase == "prefill" else rank in self.holder(rid)
            if not involved:
                continue
            if req.phase == "prefill" and self.pool("prefill"):
                retry.append(rid)
            else:
                fail.append(rid)
        w.requests.clear()
        self.stats.retried += len(retry)
        self.stats.failed += len(fail)
        return retry, fail

    # --- prefix-cache affinity ---------------------------------------------------------------------------------
    @staticmethod
    def _chain(prompt: list[int], block_size: int):
        h = 0
        for i in range(len(prompt) // block_size):
            h = hash((h, tuple(prompt[i * block_size : (i + 1) * block_size])))
            yield h

    def _prefix_hit(self, w: WorkerInfo, prompt: list[int]) -> int:
        hit = 0
        for h in self._chain(prompt, w.block_size):
            if h not in w.shadow:
                break
            hit += 1
        return hit

    def _remember(self, w: WorkerInfo, prompt: list[int]) -> None:
        for h in self._chain(prompt, w.block_size):
            w.shadow[h] = None
            w.shadow.move_to_end(h)
        while len(w.shadow) > max(w.num_blocks, 1):
            w.shadow.popitem(last=False)
