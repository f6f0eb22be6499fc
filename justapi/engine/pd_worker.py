"""A prefill or decode worker process of the disaggregated engine (``justapi serve --disaggregate``).

Each worker is a whole engine (model replica, KV pool, continuous-batching scheduler) in its own process. The
server (engine.pd_engine) talks to it over one connection (distributed.channel: a pipe, or a TCP socket when the
worker is a Ray actor on another host): commands in (add, abort, send KV, receive KV, stop) and reports out (new
token ids per request, hand-offs, transfer figures, load), each a dataclass of engine.pd_messages. KV itself goes worker
to worker over torch.distributed (distributed.kv_transfer), never through the server.

A prefill worker's scheduler hands a request off after its first token, keeping the prompt's blocks until the
send completed (then they go to its prefix cache); a decode worker admits a received request straight into
decoding with the prompt's KV copied into its own blocks.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
import traceback
from dataclasses import dataclass

from ..config import EngineConfig
from ..core.admission import StepCostModel
from ..distributed.channel import WorkerLink, connect
from .pd_messages import (AbortRequest, AddRequest, CheckIntegrity, Checked, Failed, Load, Outputs, Prefilled, Ready,
                          Received, RecvKv, RequestFailed, SendKv, Sent, Stop, local_params)

log = logging.getLogger("justapi.worker")

REPORT_INTERVAL_S = 0.25


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

        engine = EngineCore(spec.config, tp_group=_join(spec))
        engine.scheduler.hand_off_after_prefill = spec.role == "prefill"
        outbox.put(Ready(spec.rank, engine.scheduler.pool.num_blocks, engine.config.block_size, os.getpid()))
    except BaseException as e:  # noqa: BLE001 - reported to the server, which names the worker
        outbox.put(Failed(spec.rank, f"{type(e).__name__}: {e}"))
        return
    try:
        _Worker(spec, engine, inbox, outbox).run()
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


class _Worker:
    def __init__(self, spec: WorkerSpec, engine, inbox, outbox) -> None:
        self.spec = spec
        self.engine = engine
        self.sched = engine.scheduler
        self.inbox = inbox
        self.outbox = outbox
        self.sends = {}  # request id → Transfer (prefill side)
        self.recvs = {}  # request id → (Transfer, request fields) (decode side)
        self.aborted_recvs: set[str] = set()
        self.announced: set[str] = set()  # hand-offs already reported
        self.busy_s = 0.0
        self.last_report = time.monotonic()
        self.step_costs = StepCostModel()  # reported to the server for --ttft-slo's prediction
        self.report_every = REPORT_INTERVAL_S  # seconds between load reports (0: after every step, Ray Serve's)

    def run(self) -> None:
        while True:
            # nothing to step: wait for a command (briefly while transfers are pending, to poll them)
            timeout = None if self.engine.has_unfinished else 0.005 if self.sends or self.recvs else 0.05
            for msg in self._drain(timeout):
                if isinstance(msg, Stop):
                    return
                try:
                    self._handle(msg)
                except Exception as e:  # noqa: BLE001 - one bad request must not take the worker down
                    rid = getattr(msg, "request_id", None)
                    kind = type(msg).__name__
                    log.error("%s failed for request %s: %s", kind, rid, e)
                    self._failed(rid, f"a {kind} command failed on the worker ({type(e).__name__}: {e})")
            self._poll_transfers()
            if self.engine.has_unfinished:
                t0 = time.perf_counter()
                outs = self.engine.step_core()
                seconds = time.perf_counter() - t0
                self.busy_s += seconds
                if outs:
                    self.outbox.put(Outputs(self.spec.rank, outs))
                handed_off = self.sched.handoffs.keys() - self.announced
                for rid in handed_off:
                    self.announced.add(rid)
                    self.outbox.put(Prefilled(self.spec.rank, rid))
                stats = self.sched.stats  # a request leaving the batch (finished or handed off) frees a slot
                self.step_costs.observe(seconds, stats.last_step_prefill_tokens, stats.last_step_decodes,
                                        sum(o.finish_reason is not None for o in outs) + len(handed_off))
            self._report()

    def _prefill_backlog(self) -> int:
        return sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in (*self.sched.waiting,
                                                                                    *self.sched.running))

    def _drain(self, timeout: float | None) -> list:
        msgs = []
        try:
            msgs.append(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def _failed(self, rid: str | None, why: str) -> None:
        self.outbox.put(RequestFailed(self.spec.rank, rid, why))

    def _handle(self, msg) -> None:
        match msg:
            case AddRequest(rid, prompt, params, seed, deadline_in):
                params = local_params(params, deadline_in)
                self.sched.add_request(rid, prompt, params, self.engine.tokenizer.eos_token_ids, seed)
            case AbortRequest(rid):
                self.sched.abort_request(rid)
                self.announced.discard(rid)
                if rid in self.recvs:
                    self.aborted_recvs.add(rid)
            case SendKv(rid, dst, tag):
                from ..distributed.kv_transfer import send_kv

                req = self.sched.handoffs.get(rid)
                if req is None:  # aborted meanwhile, or not ours
                    self._failed(rid, "its KV is not on the prefill worker")
                    return
                blocks = req.block_ids[: -(-req.num_prompt_tokens // self.sched.block_size)]
                self.sends[rid] = send_kv(rid, self.engine.export_kv(blocks), dst, tag)
            case RecvKv(rid, src, tag, shape, request):
                from ..distributed.kv_transfer import recv_kv

                transfer = recv_kv(rid, shape, self.engine.model.kv_dtype, src, tag, self.engine.config.device)
                self.recvs[rid] = (transfer, dataclasses.replace(
                    request, params=local_params(request.params, request.deadline_in), deadline_in=None))
            case CheckIntegrity():
                self.outbox.put(self._check())
            case _:
                raise TypeError(f"unknown command {msg!r}")

    def _check(self) -> Checked:
        try:
            self.sched.check_integrity()
            problem = None
        except AssertionError as e:
            problem = f"integrity check failed: {e}"
        held = sum(len(r.block_ids) for r in self.sched.running) + sum(
            len(r.block_ids) for r in self.sched.handoffs.values())
        return Checked(self.spec.rank, problem, dict(
            running=len(self.sched.running), waiting=len(self.sched.waiting), handoffs=len(self.sched.handoffs),
            transfers=len(self.sends) + len(self.recvs), blocks_held_by_requests=held,
            free_blocks=self.sched.pool.num_free, cached_blocks=self.sched.num_cached_blocks,
            num_blocks=self.sched.pool.num_blocks))

    def _poll_transfers(self) -> None:
        for rid, t in list(self.sends.items()):
            try:
                if not t.done():
                    continue
                self.outbox.put(Sent(self.spec.rank, rid, t.nbytes, t.tensor.shape[3], t.seconds))
            except RuntimeError as e:
                self._failed(rid, f"its KV transfer failed ({str(e).splitlines()[0]})")
            del self.sends[rid]
            self.sched.release_handoff(rid)
            self.announced.discard(rid)
        for rid, (t, r) in list(self.recvs.items()):
            try:
                if not t.done():
                    continue
            except RuntimeError as e:
                del self.recvs[rid]
                self.aborted_recvs.discard(rid)
                self._failed(rid, f"its KV transfer failed ({str(e).splitlines()[0]})")
                continue
            del self.recvs[rid]
            if rid in self.aborted_recvs:
                self.aborted_recvs.discard(rid)
                continue
            try:
                self.sched.add_prefilled_request(rid, r.prompt_token_ids, r.first_token, r.params,
                                                 self.engine.tokenizer.eos_token_ids, r.seed, t.tensor,
                                                 r.num_cached_tokens)
            except ValueError as e:
                self._failed(rid, str(e))
                continue
            self.outbox.put(Received(self.spec.rank, rid))

    def _report(self) -> None:
        now = time.monotonic()
        if now - self.last_report < self.report_every:
            return
        cache = self.sched.cache
        self.outbox.put(Load(
            self.spec.rank,
            free_blocks=self.sched.pool.num_free + self.sched.num_cached_blocks,  # cached blocks can be evicted
            running=len(self.sched.running), waiting=len(self.sched.waiting) + len(self.recvs),
            busy_fraction=min(1.0, self.busy_s / (now - self.last_report)),
            cache_hits=cache.hits if cache is not None else 0, cache_misses=cache.misses if cache is not None else 0,
            cached_blocks=self.sched.num_cached_blocks,
            costs=self.step_costs.costs, prefill_backlog=self._prefill_backlog(),
            num_decoding=sum(r.num_computed_tokens >= r.num_prompt_tokens for r in self.sched.running),
        ))
        self.busy_s = 0.0
        self.last_report = now
