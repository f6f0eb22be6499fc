"""Data-parallel replicas on a Ray cluster through Ray Serve (``justapi serve --data-parallel N --distributed-executor
ray``, or ``serve run justapi.ray_serve:app_builder model=PATH data-parallel=N``). Needs the Ray extra.

- ``EngineReplica`` (a Serve deployment, N replicas or autoscaled between ``--data-parallel`` and ``--max-replicas`` on
  ongoing requests by Serve's own autoscaler): a whole engine, the loop of a worker process (engine.pd_worker) run
  in a thread of the replica; ``generate`` streams a request's EngineCoreOutputs (token ids) with the replica's load.
- ``PrefixAwareRequestRouter``: Serve's request-router extension point, choosing the replica with core.router's
  PrefixRouter (the policy of every mode) from the request's token ids and the replicas' queue lengths.
- ``Ingress``: the OpenAI server (server.api.build_app, the same routes, metrics and admission) over ``ServeEngine``,
  which tokenizes, sends each request to the replicas through a deployment handle, detokenizes what streams back,
  and, when the replica serving a request dies (Ray reports the actor's death), sends it to another if nothing was
  streamed yet, else fails it. Serve's HTTP proxy listens on ``--host``/``--port``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import signal
import threading
import time

from ray import serve
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from .config import EngineConfig
from .core.outputs import EngineCoreOutput
from .core.pd_scheduler import PdStats
from .core.router import PrefixRouter
from .core.stats import PdSnapshot, WorkerSnapshot
from .engine.async_llm import EngineDeadError
from .engine.model_front import ModelFront
from .engine.output_processor import OutputProcessor, RequestOutput
from .engine.pd_messages import AbortRequest, AddRequest, Load, Outputs, RequestFailed, Stop, seconds_left
from .sampling_params import SamplingParams

log = logging.getLogger("justapi.ray_serve")

REPLICAS = "EngineReplica"


# --- the replicas ---------------------------------------------------------------------------------------------
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
        from .engine.pd_worker import WorkerSpec, _Worker

        self.engine = EngineCore(config)
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.inbox: queue.Queue = queue.Queue()
        self.dispatch = _Dispatch()
        spec = WorkerSpec(0, 1, "replica", config, None, config.num_threads or 1, ((0,),))
        worker = _Worker(spec, self.engine, self.inbox, self.dispatch)
        worker.report_every = 0.0  # the load rides on the request streams: let each chunk carry the latest
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
        self.engine.scheduler.check_admissible(len(prompt_token_ids), params.max_tokens)  # ValueError: a 400
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


# --- the router -----------------------------------------------------------------------------------------------
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


# --- the ingress's engine ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Pending:
    prompt: list[int]
    params: SamplingParams
    seed: int
    streamed: bool = False
    replica: str | None = None
    task: object = None  # the consuming coroutine's future (concurrent.futures)
    gen: object = None  # the current response stream (DeploymentResponseGenerator), to cancel on the replica


class ServeEngine(ModelFront):
    """The Engine interface (engine.protocol) over the replicas' deployment handle; AsyncLLM drives it."""

    def __init__(self, config: EngineConfig, handle) -> None:
        super().__init__(config)
        self.handle = handle.options(stream=True)
        self.outputs = OutputProcessor(self.tokenizer)
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
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        self.check_token_ids(prompt_token_ids)
        if len(prompt_token_ids) + (params.max_tokens or 1) > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} tokens and max_tokens {params.max_tokens} exceed "
                             f"the model's length {self.max_model_len}")
        return params.max_tokens or self.max_model_len - len(prompt_token_ids)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.check_request(prompt_token_ids, params)
        self.prepare(params)
        params = dataclasses.replace(params, max_tokens=max_tokens)
        seed = params.seed if params.seed is not None else self.new_seed()
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
                req.streamed = req.streamed or bool(out.new_token_ids)
                report, stopped = self.outputs.process(out)
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
                d = serve.status().applications[app].deployments[REPLICAS]
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
                              load.prefill_backlog, load.num_decoding, self.routed.get(replica, 0))

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


# --- the application --------------------------------------------------------------------------------------------
def app_builder(args: dict):
    """A Serve application from ``justapi serve``'s flags given as a dict (``serve run justapi.ray_serve:app_builder
    model=PATH data-parallel=2``; keys with - or _)."""
    from .cli import build_parser

    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True or value == "true" else [flag, str(value)]
    return build_application(build_parser().parse_args(argv))


def build_application(parsed):
    """The Serve application of parsed ``justapi serve`` arguments: the ingress over the replica deployment."""
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from .cli import engine_config
    from .config import ServerConfig
    from .flags import config_from_args

    cfg = engine_config(parsed)
    server_cfg = config_from_args(ServerConfig, parsed)
    threads = cfg.num_threads or 1  # each replica's torch threads, and the CPUs Ray reserves for it
    replica_cfg = dataclasses.replace(cfg, data_parallel=None, max_replicas=None, distributed_executor="mp",
                                      num_threads=threads, show_progress=False)
    n = cfg.data_parallel or 1
    scaling = {"num_replicas": n} if cfg.max_replicas is None else {"autoscaling_config": AutoscalingConfig(
        min_replicas=n, max_replicas=cfg.max_replicas, target_ongoing_requests=cfg.target_ongoing_requests,
        upscale_delay_s=cfg.upscale_delay)}
    router = RequestRouterConfig(
        request_router_class="justapi.ray_serve:PrefixAwareRequestRouter",
        request_router_kwargs={"policy": cfg.router, "slack": cfg.router_prefix_slack, "block_size": cfg.block_size},
        request_routing_stats_period_s=1.0)
    replicas = serve.deployment(EngineReplica, name=REPLICAS).options(
        ray_actor_options={"num_cpus": threads}, max_ongoing_requests=cfg.max_seqs * 4,
        request_router_config=router, **scaling).bind(replica_cfg)
    return _ingress(parsed, server_cfg).options(name="Ingress", ray_actor_options={"num_cpus": 0}).bind(replicas)


def _ingress(parsed, server_cfg):
    from .cli import serve_app

    def make_engine(cfg):
        return ServeEngine(cfg, serve.get_deployment_handle(REPLICAS, serve.get_replica_context().app_name))

    app, _ = serve_app(parsed, make_engine=make_engine)

    @serve.ingress(app)
    class Ingress:
        def __init__(self, replicas) -> None:
            self.replicas = replicas  # (the engine finds them by name; bound so Serve deploys them with the app)

    return serve.deployment(Ingress)


def run(parsed) -> int:
    """``justapi serve --data-parallel N --distributed-executor ray``: the application on the Ray cluster (RAY_ADDRESS,
    else a local Ray), Serve's HTTP proxy on --host/--port, until interrupted."""
    import os

    import ray

    from .config import ServerConfig
    from .flags import config_from_args

    server_cfg = config_from_args(ServerConfig, parsed)
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False)
    serve.start(http_options={"host": server_cfg.host, "port": server_cfg.port})
    serve.run(build_application(parsed), name="justapi", route_prefix="/")
    log.info("serving on http://%s:%d through Ray Serve", server_cfg.host, server_cfg.port)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)  # (Ray's own handler exits mid-shutdown with a traceback)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        serve.shutdown()
        ray.shutdown()
    return 0
