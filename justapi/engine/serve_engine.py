"""ServeEngine: the OpenAI server's engine (engine.protocol) over Ray Serve replicas (justapi.ray_replica), in the
ingress: it tokenizes, sends each request to the replicas through a deployment handle, detokenizes what streams
back, and, when the replica serving a request dies (Ray reports the actor's death), sends it to another if nothing
was streamed yet, else fails it."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from typing import TYPE_CHECKING

from ray import serve

from ..config import EngineConfig
from ..core.limits import RequestLimits
from ..core.outputs import EngineCoreOutput
from ..core.pd_scheduler import PdStats
from ..core.stats import PdSnapshot, WorkerSnapshot
from ..sampling_params import SamplingParams
from .model_front import ModelFront
from .output_processor import OutputProcessor, RequestOutput
from .worker_messages import Load, seconds_left
from .protocol import EngineDeadError

if TYPE_CHECKING:
    from ray.serve.handle import DeploymentResponseGenerator


@dataclasses.dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    seed: int
    replica: str | None = None
    task: concurrent.futures.Future[None] | None = None  # the consuming coroutine's, set once it is queued
    gen: DeploymentResponseGenerator | None = None  # the current response stream, to cancel on the replica


class ServeEngine(ModelFront):
    """The Engine interface (engine.protocol) over the replicas' deployment handle; AsyncLLM drives it."""

    def __init__(self, config: EngineConfig, handle, deployment: str) -> None:
        """``handle``: the replicas' deployment handle; ``deployment``: its name (for Serve's status of it)."""
        super().__init__(config)
        self.handle, self.deployment = handle.options(stream=True), deployment
        self.outputs = OutputProcessor(self.tokenizer)
        blocks = -(-self.max_model_len // config.block_size)  # a pool as long as the model: only lengths are checked
        self._limits = RequestLimits(self.max_model_len, blocks, config.block_size)
        self.last_step = None
        self.requests: dict[str, _Pending] = {}
        self.stats_counters = PdStats()
        self.replicas: dict[str, tuple[bool, Load | None]] = {}  # id → (alive, last load)
        self.routed: dict[str, int] = {}  # id → requests it served (first chunk from it)
        self._events: queue.Queue = queue.Queue()  # from the handle's loop to step()
        self._failures: list[tuple[str, BaseException]] = []
        self._status: tuple[str, dict] = ("", {})  # the deployment's status and replica states, as Serve last said
        self._closed = False
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="justapi-serve-handle", daemon=True).start()
        threading.Thread(target=self._watch_status, name="justapi-serve-status", daemon=True).start()

    # requests
    @property
    def request_limits(self) -> RequestLimits:
        return self._limits  # the length checks of a scheduler; a replica checks its own KV pool on arrival

    def queue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Send an admitted request (ModelFront.admit) to the replicas' deployment."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        assert params.seed is not None, "queue() takes admitted params: ModelFront.admit sets the seed"
        seed = params.seed
        req = self.requests[request_id] = _Pending(list(prompt_token_ids), params, seed)
        self.outputs.add_request(request_id, prompt_token_ids, params)
        req.task = asyncio.run_coroutine_threadsafe(self._stream(request_id, req), self._loop)

    async def _stream(self, rid: str, req: _Pending) -> None:
        """Consume the request's stream; once more on another replica if the first died before any token."""
        from ray.exceptions import ActorDiedError, RayActorError

        streamed, replica = False, None  # seen here, not by the engine thread: its view lags the queue
        for attempt in (0, 1):
            try:
                req.gen = self.handle.generate.remote(rid if attempt == 0 else f"{rid}#retry", req.prompt,
                                                      req.params, req.seed, seconds_left(req.params))
                async for outs, replica, load in req.gen:
                    if attempt:  # the retry ran under an id of its own on the replica
                        outs = [dataclasses.replace(o, request_id=rid) for o in outs]
                    streamed = streamed or any(o.new_token_ids for o in outs)
                    self._events.put(("out", rid, outs, replica, load))
                return
            except asyncio.CancelledError:
                assert req.gen is not None  # set before the stream's first await, where a cancel lands
                req.gen.cancel()  # the replica aborts the request and frees its blocks
                raise
            except (ActorDiedError, RayActorError) as e:  # Ray reports the replica's death
                if not streamed and attempt == 0:
                    self._events.put(("retry", rid, replica))
                    continue
                self._events.put(("fail", rid, f"the replica {replica or ''} serving it died ({type(e).__name__})",
                                  replica, None, True))
                return
            except Exception as e:  # noqa: BLE001 - the request failed on the replica: its reason, not Ray's header
                cause = getattr(e, "cause", None) or e
                why = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(cause).__name__
                # a request the replica refused (it can never fit its pool) is the client's error, a 400
                self._events.put(("fail", rid, why, None, ValueError if isinstance(cause, ValueError) else None, False))
                return

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self._cancel(req)
        report, _ = self.outputs.process(EngineCoreOutput(request_id, [], None, "abort", len(req.prompt), 0))
        return report

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return sum(load.waiting for alive, load in self.replicas.values() if alive and load is not None)

    # the loop
    def step(self) -> list[RequestOutput]:
        reports: list[RequestOutput] = []
        try:
            event = self._events.get(timeout=0.02)
            while True:
                self._handle(event, reports)
                event = self._events.get_nowait()
        except queue.Empty:
            pass
        return reports

    def _handle(self, event, reports: list[RequestOutput]) -> None:
        kind, rid = event[0], event[1]
        req = self.requests.get(rid)
        if kind == "out":
            _, _, outs, replica, load = event
            self.replicas[replica] = (True, load)
            if req is None:
                return  # aborted meanwhile
            if req.replica != replica:
                self.routed[replica] = self.routed.get(replica, 0) + 1
            req.replica = replica
            for out in outs:
                report, stopped = self.outputs.process_safely(out)
                reports.append(report)
                if report.finished:
                    if stopped:  # a stop string: the replica does not know yet
                        self._cancel(req)
                    self.requests.pop(rid, None)
                    return
        elif kind == "retry":
            self._mark_dead(event[2])
            self.stats_counters.retried += 1
        elif kind == "fail" and req is not None:
            _, _, why, replica, error, died = event
            if died:
                self._mark_dead(replica)
                self.stats_counters.failed += 1  # (the metric counts requests lost with a replica)
            self.requests.pop(rid, None)
            self.outputs.drop(rid)
            error = error or EngineDeadError
            self._failures.append((rid, error(why if error is ValueError else f"the request failed: {why}")))

    def _cancel(self, req: _Pending) -> None:
        """Stop consuming the request's stream; cancelling the stream's task cancels it on the replica too."""
        assert req.task is not None  # add_request sets it as it registers the request, before any cancel
        req.task.cancel()

    def _mark_dead(self, replica: str | None) -> None:
        if replica is not None:
            self.replicas[replica] = (False, self.replicas.get(replica, (False, None))[1])

    def idle(self) -> None:
        self.step()

    def take_failures(self) -> list[tuple[str, BaseException]]:
        out, self._failures = self._failures, []
        return out

    def _watch_status(self) -> None:
        """Serve's view of the replica deployment, every 2 s, on a thread of its own (the call blocks)."""
        app = serve.get_replica_context().app_name
        while not self._closed:
            try:
                d = serve.status().applications[app].deployments[self.deployment]
                self._status = (_name(d.status), {_name(k): v for k, v in d.replica_states.items()})
            except Exception as e:  # noqa: BLE001 - the controller is unreachable: /health says so
                self._status = (f"unknown ({type(e).__name__})", {})
            time.sleep(2.0)

    def health(self) -> tuple[bool, dict]:
        """Serving while Serve runs a replica; degraded while the deployment is not healthy (a replica died and is
        being replaced, or scaling)."""
        status, states = self._status
        running = states.get("RUNNING", 0)
        replicas = dict(self.replicas)
        detail = {"replica_workers_alive": running, "replica_deployment": status, "replica_states": states,
                  "executor": "ray serve", "replicas_lost": [r for r, (ok, _) in replicas.items() if not ok],
                  "workers": [{"rank": r, "role": "replica", "alive": ok} for r, (ok, _) in replicas.items()]}
        if status not in ("HEALTHY", ""):
            detail["dead_workers"] = [f"the replica deployment is {status}: {states}"]
        return running > 0, detail

    def stats(self) -> PdSnapshot:
        workers = tuple(self._snapshot(r, ok, load) for r, (ok, load) in dict(self.replicas).items())
        return PdSnapshot(workers, dataclasses.replace(self.stats_counters), "replica")

    def _snapshot(self, replica: str, alive: bool, load: Load | None) -> WorkerSnapshot:
        if load is None:
            return WorkerSnapshot(replica, "replica", alive, 0, 0, 0.0, 0, 0, 0, 0, routed=self.routed.get(replica, 0))
        return WorkerSnapshot(replica, "replica", alive, load.running, load.waiting, load.busy_fraction,
                              load.cache_hits, load.cache_misses, load.cached_blocks, 0, load.costs,
                              load.prefill_backlog, load.num_decoding, self.routed.get(replica, 0),
                              disk_hits=load.disk_hits, disk=load.disk)

    def shared_prefixes(self, limit: int) -> list[tuple[tuple[int, ...], int]]:
        return []  # each worker's prefix cache is its own (the dashboard lists none)

    def stats_line(self) -> str:
        return "replicas: " + ", ".join(
            f"[{r[:8]}] " + ("dead" if not ok else "?" if load is None else f"{load.running} running {load.waiting} "
                             f"waiting {load.busy_fraction:.0%} busy") for r, (ok, load) in self.replicas.items())

    def close(self) -> None:
        self._closed = True
        for req in list(self.requests.values()):
            self._cancel(req)
        self._loop.call_soon_threadsafe(self._loop.stop)


def _name(value) -> str:
    """An enum member's value, or the string Serve already gave."""
    return str(getattr(value, "value", value))
