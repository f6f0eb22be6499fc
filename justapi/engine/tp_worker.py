"""Tensor-parallel workers (``--tp N``): ranks 1..N-1 as processes; rank 0 is the engine itself.

Rank 0 runs the scheduler once per step and broadcasts the step's SchedulerOutput (new requests once, then small
diffs) to the workers; every rank then runs the same ModelRunner step on its shard, the model's all-reduces combine
the partial results, and every rank samples the same tokens from the gathered logits (randomness is keyed by seed and
position), so the workers' mirrors of the requests stay in step without being told the sampled tokens.

The group meets at MASTER_ADDR / MASTER_PORT when both are set (env://, as on several hosts), otherwise at a free
loopback port. A worker that dies breaks the next collective on rank 0 with an error (gloo closes the pair), which
fails the engine and every open request instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket

import torch.distributed as dist

from ..config import EngineConfig

log = logging.getLogger("justapi.tp")

GROUP_TIMEOUT_S = 300.0


def start_workers(config: EngineConfig) -> tuple[str | None, list]:
    """Spawn ranks 1..tp-1; the rendezvous they were given (None: env://) and the processes."""
    if os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        init = None
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")
    procs = []
    for rank in range(1, config.tp):
        p = ctx.Process(target=tp_worker_main, args=(config, rank, init), name=f"justapi-tp-{rank}", daemon=True)
        p.start()
        procs.append(p)
    log.info("started %d tensor-parallel workers, rendezvous %s", len(procs), init or "env://")
    return init, procs


def join_group(config: EngineConfig, rank: int, init: str | None) -> None:
    from ..distributed.kv_transfer import init_process_group

    if config.gpu:
        import torch

        torch.cuda.set_device(rank % torch.cuda.device_count())
    init_process_group(rank, config.tp, init, GROUP_TIMEOUT_S, "nccl" if config.gpu else "gloo")


def stop_workers(procs: list) -> None:
    from ..distributed.tp import broadcast

    try:
        broadcast(None)
    except RuntimeError:
        pass  # a worker is already gone
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
    dist.destroy_process_group()  # the group is per process: another engine here may form its own


def tp_worker_main(config: EngineConfig, rank: int, init: str | None) -> None:
    """Load this rank's shard, then run every step rank 0 broadcasts until it broadcasts None."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-worker-{rank}: %(message)s")
    from .engine_core import EngineCore

    follow(EngineCore(config, tp_rank=rank, tp_init=init))


def follow(engine) -> None:
    """A worker rank's loop: run what rank 0 broadcasts to the engine's group until it broadcasts None.

    A SchedulerOutput: run the step on this shard. ("export_kv", block ids): send this rank's KV of those blocks to
    rank 0 (a disaggregated prefill worker shipping a request's KV, EngineCore.export_kv).
    """
    from ..distributed.tp import broadcast

    while True:
        msg = broadcast(None, engine.tp_group)
        if msg is None:
            return
        if isinstance(msg, tuple) and msg[0] == "export_kv":
            engine.model.comm.gather_kv(engine.runner.export_kv(msg[1]))
        else:
            engine.runner.execute(msg)
