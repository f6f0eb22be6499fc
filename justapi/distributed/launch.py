"""Where the engine's other processes run (``--distributed-executor``): WorkerPoolEngine's workers (disaggregated pools,
data-parallel replicas) with their tensor-parallel ranks, and the ranks of a plain ``--tp`` engine.

- ``LocalProcesses`` (``mp``, the default): spawned on this host, linked to the server by pipes.
- ``RayActors`` (``ray``): each process a Ray actor in its own bundle of one placement group (``--placement-strategy``,
  Ray's PACK / SPREAD / STRICT_PACK / STRICT_SPREAD), so Ray places them over the cluster's nodes; linked to the
  server by TCP connections it dials back (``distributed.channel``); the torch.distributed rendezvous is a free port
  on the node of the group's first process, found through Ray. Ray reports an actor's death (``ray.wait`` on its
  running task returns), which the engines read as the process ending, as with a local one.

Both hand back process-like handles (``is_alive``, ``pid``, ``exitcode``, ``join``, ``kill``, ``terminate``): the
engines watch and stop their processes one way.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import socket

from ..config import PLACEMENT_STRATEGIES
from . import group
from .channel import Channel, WorkerListener

log = logging.getLogger("justapi.launch")

START_TIMEOUT_S = 300.0  # for a Ray actor to start (scheduling, importing torch)


class LocalProcesses:
    """Processes on this host."""

    def __init__(self) -> None:
        self._ctx = multiprocessing.get_context("spawn")
        self._ends: dict[int, Channel] = {}
        self._worker_ends: list = []

    def rendezvous(self, index: int | None = 0) -> str | None:
        return group.rendezvous()

    def link(self, rank: int):
        """What worker ``rank`` is given to reach the server (its end of a pipe)."""
        server_end, worker_end = self._ctx.Pipe(duplex=True)
        self._ends[rank] = Channel(server_end, f"worker-{rank}")
        self._worker_ends.append(worker_end)
        return worker_end

    def start(self, target, args: tuple, name: str, index: int):
        proc = self._ctx.Process(target=target, args=args, name=name, daemon=True)
        proc.start()
        return proc

    def channels(self, handles: dict, deadline: float) -> dict[int, Channel]:
        """Each linked worker's channel (pipes are connected from the start)."""
        for end in self._worker_ends:  # the workers hold them now: a worker's death reads as end of file here
            end.close()
        self._worker_ends = []
        return self._ends

    def close(self) -> None:
        pass


class RayProcess:
    """A Ray actor running one process entry point, seen as a process."""

    def __init__(self, actor, name: str) -> None:
        import ray

        self.actor, self.name = actor, name
        # an actor that cannot start (a node without justapi, no room) fails here instead of hanging the server
        self.pid, self.node_ip, self.node_id = ray.get(actor.describe.remote(), timeout=START_TIMEOUT_S)
        self._ref = None
        self.exitcode: int | None = None

    def run(self, target, args: tuple) -> None:
        self._ref = self.actor.run.remote(target, args)

    def is_alive(self) -> bool:
        import ray

        if self.exitcode is not None:
            return False
        ready, _ = ray.wait([self._ref], timeout=0)
        if not ready:
            return True
        try:
            ray.get(self._ref)
            self.exitcode = 0
        except Exception as e:  # noqa: BLE001 - the actor died (RayActorError) or its entry point raised
            log.info("%s ended: %s", self.name, str(e).splitlines()[0] if str(e) else type(e).__name__)
            self.exitcode = 1
        return False

    def join(self, timeout: float | None = None) -> None:
        import ray

        if self._ref is not None and self.exitcode is None:
            ray.wait([self._ref], timeout=timeout)
            self.is_alive()

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)

    terminate = kill


class RayActors:
    """Processes as Ray actors, one per bundle of a placement group over the cluster."""

    def __init__(self, num_bundles: int, cpus_per_bundle: float, strategy: str, driver_bundle: bool = False) -> None:
        """``driver_bundle``: bundle 0 is for this process (the server's own rank 0): it must be on this node."""
        import ray
        from ray.util.placement_group import placement_group

        if strategy not in PLACEMENT_STRATEGIES:
            raise ValueError(f"--placement-strategy must be one of {', '.join(PLACEMENT_STRATEGIES)}, not {strategy!r}")
        if not ray.is_initialized():
            # RAY_ADDRESS when set (a running cluster), else a Ray instance of this host started for this server
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True, include_dashboard=False)
        selector = None
        if driver_bundle:  # bundle 0 on this node: a label selector on Ray's own node-id label
            here = ray.get_runtime_context().get_node_id()
            selector = [{"ray.io/node-id": here}] + [{}] * (num_bundles - 1)
        self.pg = placement_group([{"CPU": cpus_per_bundle}] * num_bundles, strategy=strategy,
                                  bundle_label_selector=selector)
        if not self.pg.wait(timeout_seconds=120):
            ray.util.remove_placement_group(self.pg)
            raise RuntimeError(f"Ray could not place {num_bundles} bundles of {cpus_per_bundle:g} CPU "
                               f"({strategy}{', the first on this node' if driver_bundle else ''}) on this "
                               f"cluster: {ray.cluster_resources()} in all")
        self._bundles = list(range(num_bundles))
        self._authkey = secrets.token_bytes(16)
        self._listener = None
        self._expected: set[int] = set()
        log.info("Ray placement group of %d bundles (%s) on nodes %s", num_bundles, strategy,
                 ray.util.placement_group_table(self.pg)["bundles_to_node_id"])

    def _options(self, bundle: int) -> dict:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return {"num_cpus": self.pg.bundle_specs[bundle]["CPU"], "scheduling_strategy":
                PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle)}

    def rendezvous(self, index: int | None = 0) -> str:
        """A free port on the node of the ``index``-th process (None: this node), as a torch.distributed init
        method."""
        import ray

        if index is None:
            return f"tcp://{_free_address(ray.util.get_node_ip_address())}"
        task = ray.remote(_node_free_address).options(**self._options(self._bundles[index]) | {"num_cpus": 0})
        return f"tcp://{ray.get(task.remote())}"

    def link(self, rank: int):
        """What worker ``rank`` is given to reach the server: the server's listening address and a key."""
        import ray

        if self._listener is None:
            self._listener = WorkerListener(ray.util.get_node_ip_address(), self._authkey)
        self._listener.expect(rank)
        self._expected.add(rank)
        return (self._listener.address, self._authkey, rank)

    def start(self, target, args: tuple, name: str, index: int) -> RayProcess:
        """Run ``target(*args)`` as the ``index``-th process (rank order) in its bundle."""
        actor = _actor_class().options(max_restarts=0, **self._options(self._bundles[index])).remote(name)
        proc = RayProcess(actor, name)
        proc.run(target, args)
        return proc

    def channels(self, handles: dict, deadline: float) -> dict[int, Channel]:
        """Accept each linked worker's connection (a worker dials back as it starts)."""
        conns = self._listener.take(set(self._expected), lambda r: handles[r].is_alive(), deadline)
        return {rank: Channel(conn, f"worker-{rank}") for rank, conn in conns.items()}

    def close(self) -> None:
        import ray

        if self._listener is not None:
            self._listener.close()
        ray.util.remove_placement_group(self.pg)


class _ActorProcess:
    """The body of a Ray actor that runs one process entry point (made a Ray actor class in RayActors.start)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def describe(self) -> tuple[int, str, str]:
        import ray

        return os.getpid(), ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def run(self, target, args: tuple) -> None:
        target(*args)


_ACTOR_CLASS = None


def _actor_class():
    global _ACTOR_CLASS
    if _ACTOR_CLASS is None:
        import ray

        _ACTOR_CLASS = ray.remote(_ActorProcess)
    return _ACTOR_CLASS


def _free_address(ip: str) -> str:
    with socket.socket() as s:
        s.bind((ip, 0))
        return f"{ip}:{s.getsockname()[1]}"


def _node_free_address() -> str:
    import ray

    return _free_address(ray.util.get_node_ip_address())


def make_launcher(config, num_processes: int, cpus_per_process: float, driver_bundle: bool = False):
    """The launcher ``--distributed-executor`` names, for ``num_processes`` processes."""
    if config.distributed_executor == "ray":
        return RayActors(num_processes, cpus_per_process, config.placement_strategy, driver_bundle)
    return LocalProcesses()
