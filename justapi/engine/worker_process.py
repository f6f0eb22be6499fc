"""A worker process of the multi-process engine (engine.worker_pool): a data-parallel replica (``--data-parallel``),
or a prefill or decode worker (``--disaggregate``); each a whole engine (EngineCore with its role) in its own process.

The process joins the torch.distributed world, loads the model and runs engine.worker_loop's loop over one connection
to the server (distributed.channel: a pipe, or a TCP socket when the worker is a Ray actor on another host). KV goes
worker to worker over torch.distributed (distributed.kv_transfer), never through the server. A worker's
tensor-parallel ranks past its first follow their leader's steps (follower_main).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import traceback
from dataclasses import dataclass

from ..config import EngineConfig
from ..distributed.channel import WorkerLink, connect
from .worker_messages import Failed, Ready
from .worker_loop import WorkerLoop

log = logging.getLogger("justapi.worker")


@dataclass(frozen=True)
class WorkerSpec:
    rank: int  # the worker's index (prefill workers first); the server's name for it
    world_size: int  # processes in the group: every worker's tensor-parallel ranks
    role: str  # "prefill" | "decode"
    config: EngineConfig  # config.tp: this worker's tensor-parallel size
    init_method: str | None  # None: env:// (MASTER_ADDR / MASTER_PORT)
    threads: int
    layout: tuple[tuple[int, ...], ...]  # each worker's global ranks, its leader first
    tp_rank: int = 0  # this process's rank within its worker; 0 leads (talks to the server), others follow

    @property
    def dist_rank(self) -> int:
        return self.layout[self.rank][self.tp_rank]


def _join(spec: WorkerSpec):
    """Join the world and form every worker's tensor-parallel sub-group (each process must create every group, in
    the same order); this worker's sub-group, or None for a worker of one process."""
    import torch
    import torch.distributed as dist

    from ..distributed.group import init_process_group

    torch.set_num_threads(spec.threads)
    if spec.config.gpu:
        torch.cuda.set_device(spec.dist_rank % torch.cuda.device_count())
    init_process_group(spec.dist_rank, spec.world_size, spec.init_method, spec.config.gpu)
    group = None
    for i, ranks in enumerate(spec.layout):
        if len(ranks) > 1:
            g = dist.new_group(list(ranks))
            if i == spec.rank:
                group = g
    return group


def worker_main(spec: WorkerSpec, link) -> None:
    """Process entry point: join the group, load the model, then serve commands until told to stop. ``link``: the
    worker's end of a pipe to the server, or (address, key, rank) to dial it (distributed.launch)."""
    link = WorkerLink(link if not isinstance(link, tuple) else connect(*link))
    outbox = inbox = link
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s {spec.role}-worker-{spec.rank}: %(message)s")
    try:
        from .engine_core import EngineCore

        engine = EngineCore(spec.config, tp_group=_join(spec), role=spec.role)
        outbox.put(Ready(spec.rank, engine.scheduler.pool.num_blocks, engine.config.block_size, os.getpid()))
    except BaseException as e:  # noqa: BLE001 - reported to the server, which names the worker
        outbox.put(Failed(spec.rank, f"{type(e).__name__}: {e}"))
        return
    try:
        WorkerLoop(spec.rank, engine, inbox, outbox).run()
    except BaseException as e:  # noqa: BLE001
        log.error("worker failed: %s", traceback.format_exc())
        outbox.put(Failed(spec.rank, f"{type(e).__name__}: {e}"))
    finally:
        engine.close()  # its tensor-parallel ranks leave


def follower_main(spec: WorkerSpec) -> None:
    """Entry point of a worker's tensor-parallel rank > 0: its shard, then the steps its leader broadcasts."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s "
                               f"{spec.role}-worker-{spec.rank}-tp{spec.tp_rank}: %(message)s")
    from ..model.gguf_loader import open_gguf, read_model_config
    from .executor import follow

    group = _join(spec)
    follow(spec.config, read_model_config(open_gguf(spec.config.model), spec.config.model), spec.tp_rank, group)


def worker_pools(cfg: EngineConfig) -> tuple[list[str], list[int]]:
    """Each worker's role and tensor-parallel size: N replicas, or the prefill workers then the decode ones."""
    if cfg.data_parallel is not None:
        return ["replica"] * cfg.data_parallel, [cfg.tp] * cfg.data_parallel
    p, d = cfg.prefill_workers, cfg.decode_workers
    # EngineConfig sets them under --disaggregate (1 worker each, --tp ranks each, by default)
    assert p is not None and d is not None and cfg.prefill_tp is not None and cfg.decode_tp is not None
    return ["prefill"] * p + ["decode"] * d, [cfg.prefill_tp] * p + [cfg.decode_tp] * d


def launch_workers(launcher, cfg: EngineConfig, roles: list[str], sizes: list[int], layout, threads: int,
                   init_method: str | None, procs: list, followers: list[list]) -> None:
    """Start every worker's leader (into ``procs``, by worker) and its tensor-parallel ranks (into ``followers``)
    through the launcher; the lists hold what started even where a later start raises, for the caller to stop."""
    workers, world = len(roles), sum(sizes)
    for rank, (role, n) in enumerate(zip(roles, sizes)):
        worker_config = dataclasses.replace(
            cfg, disaggregate=False, prefill_workers=None, decode_workers=None, prefill_tp=None, decode_tp=None,
            data_parallel=None, distributed_executor="mp", tp=n, num_threads=threads, show_progress=False,
            kv_memory_fraction=cfg.kv_memory_fraction / workers,
            kv_memory=None if (kv := cfg.kv_memory_bytes()) is None else str(kv // workers),
        )
        spec = WorkerSpec(rank, world, role, worker_config, init_method, threads, tuple(layout))
        procs.append(launcher.start(worker_main, (spec, launcher.link(rank)), f"justapi-{role}-{rank}",
                                    layout[rank][0]))
        followers.append([launcher.start(follower_main, (dataclasses.replace(spec, tp_rank=t),),
                                         f"justapi-{role}-{rank}-tp{t}", layout[rank][t]) for t in range(1, n)])
