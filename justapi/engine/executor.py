"""Executors: how the engine runs its model, one way to call every rank. ``Executor`` holds the one ``Rank`` of
this process; ``TpExecutor`` leads a tensor-parallel group, whose other ranks run ``follow`` in their own processes
(started here for --tp, on this host or as Ray actors: distributed.launch; or by WorkerPoolEngine for its workers'
sub-groups).

Rank 0 runs the scheduler and sends each step's SchedulerOutput (new requests once, then small diffs) to the other
ranks as a typed message; every rank runs the same step on its shard, the model's all-reduces combine the partial
results, and every rank samples the same tokens from the gathered logits (randomness is keyed by seed and position),
so the ranks' mirrors of the requests stay in step without being told the sampled tokens. A rank that dies breaks
the next collective on rank 0 with an error (gloo closes the pair), which fails the engine instead of hanging.
"""

from __future__ import annotations

import dataclasses

import logging
from dataclasses import dataclass

import torch

from ..config import EngineConfig, usable_cores
from ..model_config import ModelConfig
from ..core.outputs import RunnerOutput, SchedulerOutput
from ..distributed import group as pg
from ..distributed.launch import make_launcher
from .rank import Rank

log = logging.getLogger("justapi.engine")


# --- messages from rank 0 to the other ranks of a group -------------------------------------------------------
@dataclass(frozen=True)
class ExecuteStep:
    """Run this step on your shard."""

    sched: SchedulerOutput


@dataclass(frozen=True)
class ExportKv:
    """Send your KV heads of these blocks to rank 0 (a disaggregated prefill worker shipping a request's KV)."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class Shutdown:
    """Leave the loop."""


def set_threads(config: EngineConfig) -> None:
    """torch's threads for one rank: --threads, or the cores split between the ranks of --tp (measured: 2 threads
    per rank on 2 cores made steps 2.5-4x slower)."""
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    elif config.tp > 1:
        torch.set_num_threads(max(1, usable_cores() // config.tp))


class Executor:
    """The whole model in this process."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig) -> None:
        self.rank = Rank(config, model_config)

    def size_pool(self, num_blocks: int, branch: int) -> int:
        """Allocate every rank's KV pool with rank 0's ``num_blocks``; returns it."""
        self.rank.allocate(num_blocks, branch)
        return num_blocks

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        return self.rank.execute(sched)

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of ``block_ids`` with every KV head, [layers, 2, kv_heads, blocks, block_size, dim]."""
        return self.rank.export_kv(block_ids)

    def close(self) -> None:
        """Nothing to stop in one process."""


class TpExecutor(Executor):
    """Rank 0 of a tensor-parallel group: its own shard here, the step sent to the other ranks first."""

    def __init__(self, config: EngineConfig, model_config: ModelConfig, group=None) -> None:
        """``group``: the sub-group a disaggregated worker's ranks already form; None: start ranks 1..tp-1 here
        and form the default group with them."""
        from ..distributed.tp import TpComm, TpPlan

        plan = TpPlan.make(model_config, 0, config.tp)  # a bad --tp fails here, before any process starts
        self.group, self.procs, self.launcher = group, [], None
        if group is None:
            threads = config.num_threads or max(1, usable_cores() // config.tp)
            self.launcher = make_launcher(config, config.tp, threads, driver_bundle=True)  # rank 0 is this process
            init = self.launcher.rendezvous(None)
            try:
                for rank in range(1, config.tp):
                    self.procs.append(self.launcher.start(tp_rank_main, (config, model_config, rank, init),
                                                          f"justapi-tp-{rank}", rank))
            except Exception:
                for proc in self.procs:  # the ranks that did start, and their placement
                    proc.kill()
                self.launcher.close()
                raise
            log.info("started %d tensor-parallel ranks (%s), rendezvous %s", len(self.procs),
                     config.distributed_executor, pg.describe(init))
            if config.gpu:
                torch.cuda.set_device(0)
            pg.init_process_group(0, config.tp, init, config.gpu)
        self.comm = TpComm(plan, model_config, group)
        self.rank = Rank(config, model_config, plan, self.comm)
        self._open = True

    def _send(self, msg) -> None:
        from ..distributed.tp import broadcast

        broadcast(msg, self.group)

    def size_pool(self, num_blocks: int, branch: int) -> int:
        self._send((num_blocks, branch))  # rank 0's size for all: it holds the most KV heads
        return super().size_pool(num_blocks, branch)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        # the disk tier's buffers are views of a mapping here: the other ranks get copies
        loads: list[tuple[list[int], memoryview | bytearray]] = [(ids, bytearray(d)) for ids, d in sched.kv_loads]
        self._send(ExecuteStep(dataclasses.replace(sched, kv_loads=loads) if loads else sched))
        return self.rank.execute(sched)

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        self._send(ExportKv(tuple(block_ids)))
        kv = self.comm.gather_kv(self.rank.export_kv(block_ids))
        assert kv is not None  # None only on the other ranks: this executor is rank 0 (TpPlan.make(..., 0, ...))
        return kv

    def close(self) -> None:
        """Tell the other ranks to leave; stop the processes started here."""
        if not self._open:
            return
        self._open = False
        try:
            self._send(Shutdown())
        except RuntimeError:
            pass  # a rank is already gone
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        if self.launcher is not None:
            self.launcher.close()
        if self.group is None:
            import torch.distributed as dist

            dist.destroy_process_group()  # the group is per process: another engine here may form its own


def follow(config: EngineConfig, model_config: ModelConfig, rank: int, group=None) -> None:
    """A rank above 0: load its shard, then run what rank 0 sends until it sends Shutdown."""
    from ..distributed.tp import TpComm, TpPlan, broadcast

    comm = TpComm(TpPlan.make(model_config, rank, config.tp), model_config, group)
    local = Rank(config, model_config, comm.plan, comm)
    local.allocate(*broadcast(None, group))
    while True:
        msg = broadcast(None, group)
        if isinstance(msg, ExecuteStep):
            failed = local.execute(msg.sched).failed
            if failed:  # rank 0 never hears of it, and the ranks' batches would part ways: stop loudly instead
                raise RuntimeError(f"rank {rank}: requests failed on this rank alone: {failed}")
        elif isinstance(msg, ExportKv):
            comm.gather_kv(local.export_kv(list(msg.block_ids)))
        elif isinstance(msg, Shutdown):
            return
        else:
            raise TypeError(f"rank {rank}: unexpected message {type(msg).__name__}")


def tp_rank_main(config: EngineConfig, model_config: ModelConfig, rank: int, init: str | None) -> None:
    """Process entry of --tp's rank ``rank`` > 0: join the default group, then follow rank 0."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s tp-rank-{rank}: %(message)s")
    set_threads(config)
    if config.gpu:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    pg.init_process_group(rank, config.tp, init, config.gpu)
    try:
        follow(config, model_config, rank)
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def make_executor(config: EngineConfig, model_config: ModelConfig, group=None) -> Executor:
    """The executor for ``config``: tensor-parallel with --tp above 1, else one process."""
    return TpExecutor(config, model_config, group) if config.tp > 1 else Executor(config, model_config)
