"""Data-parallel replicas on a Ray cluster through Ray Serve (``justapi serve --data-parallel N --distributed-executor
ray``, or ``serve run justapi.ray_serve:app_builder model=PATH data-parallel=N``). Needs the Ray extra.

- ``EngineReplica`` (justapi.ray_replica; a Serve deployment, N replicas or autoscaled between ``--data-parallel`` and
  ``--max-replicas`` on ongoing requests by Serve's own autoscaler): a whole engine, the loop of a worker process
  (engine.worker_loop) run in a thread of the replica; ``generate`` streams a request's EngineCoreOutputs (token
  ids) with the replica's load.
- ``PrefixAwareRequestRouter`` (justapi.ray_replica): Serve's request-router extension point, choosing the replica with
  core.router's PrefixRouter (the policy of every mode) from the request's token ids and the replicas' queue lengths.
- ``Ingress``: the OpenAI server (server.api.build_app, the same routes, metrics and admission) over ``ServeEngine``
  (engine.serve_engine),
  which tokenizes, sends each request to the replicas through a deployment handle, detokenizes what streams back,
  and, when the replica serving a request dies (Ray reports the actor's death), sends it to another if nothing was
  streamed yet, else fails it. Serve's HTTP proxy listens on ``--host``/``--port``.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time

from ray import serve

from .engine.serve_engine import ServeEngine
from .ray_replica import EngineReplica

log = logging.getLogger("justapi.ray_serve")

REPLICAS = "EngineReplica"  # the replicas' deployment name


def app_builder(args: dict):
    """A Serve application from ``justapi serve``'s flags given as a dict (``serve run justapi.ray_serve:app_builder
    model=PATH data-parallel=2``; keys with - or _)."""
    from .startup import build_parser

    argv = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        argv += [flag] if value is True or value == "true" else [flag, str(value)]
    return build_application(build_parser().parse_args(argv))


def build_application(parsed):
    """The Serve application of parsed ``justapi serve`` arguments: the ingress over the replica deployment."""
    from ray.serve.config import AutoscalingConfig, RequestRouterConfig

    from .startup import engine_config
    from .server_config import ServerConfig
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
        request_router_class="justapi.ray_replica:PrefixAwareRequestRouter",
        request_router_kwargs={"policy": cfg.router, "slack": cfg.router_prefix_slack, "block_size": cfg.block_size},
        request_routing_stats_period_s=1.0)
    replicas = serve.deployment(EngineReplica, name=REPLICAS).options(
        ray_actor_options={"num_cpus": threads}, max_ongoing_requests=cfg.max_seqs * 4,
        request_router_config=router, **scaling).bind(replica_cfg)
    return _ingress(parsed, server_cfg).options(name="Ingress", ray_actor_options={"num_cpus": 0}).bind(replicas)


def _ingress(parsed, server_cfg):
    from .startup import serve_app

    def make_engine(cfg):
        return ServeEngine(cfg, serve.get_deployment_handle(REPLICAS, serve.get_replica_context().app_name), REPLICAS)

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

    from .server_config import ServerConfig
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
