"""Ray Serve's side of data-parallel replicas (justapi.ray_serve builds the application):

- ``EngineReplica`` (a Serve deployment): a whole engine, the loop of a worker process (engine.worker_loop) run in
  a thread of the replica; ``generate`` streams a request's EngineCoreOutputs (token ids) with the replica's load.
- ``PrefixAwareRequestRouter``: Serve's request-router extension point, choosing the replica with core.router's
  PrefixRouter (the policy of every mode) from the request's token ids and the replicas' queue lengths.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .config import EngineConfig
from .core.router import PrefixRouter
from .engine.worker_messages import AbortRequest, AddRequest, Load, Outputs, RequestFailed, Stop
from .sampling_params import SamplingParams

log = logging.getLogger("justapi.ray_serve")


class _Dispatch:
    """The replica's worker loop reports here (as a worker process would to its server): outputs to the request's
    stream, the load kept for routing and metrics."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None  # the replica's, known at its first request
        self.streams: dict[str, asyncio.Queue] = {}
        self.load: Load | None = None

    def put(self, msg) -> None:
        match msg:
            case Outputs(_, outs):
                for out in outs:
                    self._send(out.request_id, out)
            case RequestFailed(_, rid, why):
                self._send(rid, why)
            case Load():
                self.load = msg

    def _send(self, rid: str, item) -> None:
        q = self.streams.get(rid)
        if q is not None:
            self.loop.call_soon_threadsafe(q.put_nowait, item)


class EngineReplica:
    """One engine; its loop runs in a thread, requests come and go through ``generate``."""

    def __init__(self, config: EngineConfig) -> None:
        from .engine.engine_core import EngineCore
        from .engine.worker_loop import WorkerLoop

        self.engine = EngineCore(config)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.inbox: queue.Queue = queue.Queue()
        self.dispatch = _Dispatch()
        # the load rides on the request streams: each step's report, so that each chunk carries the latest
        worker = WorkerLoop(0, self.engine, self.inbox, self.dispatch, report_every=0.0)
        self.broken: str | None = None  # why the engine loop died: every stream fails, Serve replaces the replica
        self.thread = threading.Thread(target=self._run, args=(worker,), name="justapi-replica", daemon=True)
        self.thread.start()

    def _run(self, worker) -> None:
        try:
            worker.run()
        except BaseException as e:  # noqa: BLE001 - reported to every open stream and to Serve's health check
            self.broken = f"the replica's engine failed ({type(e).__name__}: {e})"
            log.error(self.broken)
            for rid in list(self.dispatch.streams):
                self.dispatch.put(RequestFailed(0, rid, self.broken))

    def check_health(self) -> None:
        """Serve's health check: a replica whose engine loop died is replaced."""
        if self.broken is not None:
            raise RuntimeError(self.broken)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                       deadline_in: float | None):
        """Stream (the request's new EngineCoreOutputs, this replica's id, its last load) until it finishes."""
        if self.broken is not None:
            raise RuntimeError(self.broken)
        # ValueError: a 400
        self.engine.request_limits.check(len(prompt_token_ids), params.max_tokens, params.pooling is not None)
        q: asyncio.Queue = asyncio.Queue()
        self.dispatch.loop = asyncio.get_running_loop()
        self.dispatch.streams[request_id] = q
        self.inbox.put(AddRequest(request_id, prompt_token_ids, params, seed, deadline_in))
        finished = False
        try:
            while not finished:
                batch = [await q.get()]
                while not q.empty():
                    batch.append(q.get_nowait())
                failure = next((b for b in batch if isinstance(b, str)), None)
                if failure is not None:
                    finished = True
                    raise RuntimeError(failure)
                finished = any(o.finish_reason is not None for o in batch)
                yield batch, self.replica_id, self.dispatch.load
        finally:
            self.dispatch.streams.pop(request_id, None)
            if not finished:  # cancelled by the caller (client gone, aborted)
                self.inbox.put(AbortRequest(request_id))

    def record_routing_stats(self) -> dict:
        load = self.dispatch.load
        stats = {"num_blocks": self.engine.scheduler.pool.num_blocks}
        return stats if load is None else stats | {"running": load.running, "waiting": load.waiting}

    def __del__(self) -> None:
        self.inbox.put(Stop())


class PrefixAwareRequestRouter(RequestRouter):
    """Serve's replica choice by core.router.PrefixRouter: the request's token ids (``generate``'s second argument)
    against a shadow of what each replica was sent, loads from Serve's queue-length cache (else its probes'
    routing stats)."""

    def initialize_state(self, policy: str = "prefix", slack: int = 2, block_size: int = 16, **kwargs) -> None:
        self.router = PrefixRouter(policy, slack, block_size)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if pending_request is None or len(pending_request.args) < 2:
            return [candidate_replicas]
        for rid, r in by_id.items():  # each replica's shadow as large as its KV pool, once it has said
            blocks = (r.routing_stats or {}).get("num_blocks")
            if blocks:
                self.router.add(rid, blocks)
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        best = self.router.best(list(pending_request.args[1]), loads)
        return [[by_id[best]], [r for rid, r in by_id.items() if rid != best]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id, result) -> None:
        """Where the request went in the end (Serve may fall back to another rank): that replica holds it now."""
        if len(pending_request.args) >= 2:
            self.router.remember(replica_id.unique_id, list(pending_request.args[1]))

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        current = {r.replica_id.unique_id for r in replicas}
        for gone in [e for e in self.router.engines() if e not in current]:  # scaled down or replaced
            self.router.remove(gone)

    def _load(self, replica: RunningReplica) -> int:
        cached = self.replica_queue_len_cache.get(replica.replica_id)
        if cached is not None:
            return cached
        stats = replica.routing_stats or {}
        return stats.get("running", 0) + stats.get("waiting", 0)

    def on_replica_actor_died(self, replica_id) -> None:
        super().on_replica_actor_died(replica_id)
        self.router.remove(replica_id.unique_id)
