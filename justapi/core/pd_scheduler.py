"""PdScheduler: prefill and decode on separate worker pools. Pure Python: it routes, the workers compute.

Each request goes through three phases::

    prefill   on a prefill worker: its prompt in chunks, continuous batching, then the first token is sampled
    transfer  its prompt's KV blocks go from that worker to a decode worker (torch.distributed isend / irecv)
    decode    on the decode worker: continuous batching until it finishes; tokens stream back through the server

Routing: a prefill worker is chosen by core.router.PrefixRouter (the likeliest prefix-cache hit among the workers
not much busier than the least loaded); a decode worker is the least loaded one with room for the request's blocks
(as last reported). A worker that dies takes its requests with it: those still in prefill are sent to another
prefill worker, the others fail with an error.

Data-parallel replicas (``--data-parallel N``) are workers of the role ``replica``: each computes its requests
whole (they never leave the prefill phase), routed the same way; one that dies is handled the same way too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .admission import StepCosts
from .kv_store import KvStoreStats
from .router import PrefixRouter


@dataclass
class WorkerInfo:
    rank: int
    role: str  # "prefill" | "decode" | "replica"
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
    costs: StepCosts | None = None  # what the worker fitted to its steps, None before its first
    prefill_backlog: int = 0  # prompt tokens still to compute, reported plus routed here since the report
    num_decoding: int = 0
    routed: int = 0  # requests sent here (retries included)
    disk_hits: int = 0  # of cache_hits, found in the prefix cache's disk tier
    disk: KvStoreStats | None = None  # its disk tier's counters, as last reported

    @property
    def load(self) -> int:
        return len(self.requests)

    def report(self, load) -> None:
        """Take the worker's periodic report (engine.worker_messages.Load)."""
        self.free_blocks, self.running, self.waiting = load.free_blocks, load.running, load.waiting
        self.busy_fraction = load.busy_fraction
        self.cache_hits, self.cache_misses, self.cached_blocks = load.cache_hits, load.cache_misses, load.cached_blocks
        self.costs, self.prefill_backlog, self.num_decoding = load.costs, load.prefill_backlog, load.num_decoding
        self.disk_hits, self.disk = load.disk_hits, load.disk


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

    def __init__(self, workers: list[WorkerInfo], router: PrefixRouter | None = None) -> None:
        self.workers = {w.rank: w for w in workers}
        self.requests: dict[str, PdRequest] = {}
        self.stats = PdStats()
        # where a request starts: the prefill pool, or the replicas when data-parallel
        self.entry_role = "prefill" if any(w.role == "prefill" for w in workers) else "replica"
        self.router = router or PrefixRouter(block_size=workers[0].block_size)
        for w in self.pool(self.entry_role):
            self.router.add(w.rank, w.num_blocks)

    def pool(self, role: str, alive_only: bool = True) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.role == role and (w.alive or not alive_only)]

    # --- routing ----------------------------------------------------------------------------------------------
    def route(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """Assign a new (or retried) request to a prefill worker or replica; its rank. Raises RuntimeError when
        none is alive."""
        pool = self.pool(self.entry_role)
        if not pool:
            raise RuntimeError(f"no {self.entry_role} worker is alive")
        best = self.workers[self.router.choose(prompt_token_ids, {w.rank: w.load for w in pool})]
        req = self.requests.get(request_id) or PdRequest(request_id, list(prompt_token_ids))
        req.phase, req.prefill_rank = "prefill", best.rank
        self.requests[request_id] = req
        best.requests.add(request_id)
        best.routed += 1
        best.waiting += 1  # until its next report counts it
        best.prefill_backlog += len(prompt_token_ids)
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
            if req.phase == "prefill" and self.pool(self.entry_role):
                retry.append(rid)
            else:
                fail.append(rid)
        w.requests.clear()
        self.router.remove(rank)
        self.stats.retried += len(retry)
        self.stats.failed += len(fail)
        return retry, fail
