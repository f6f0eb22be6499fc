"""WorkerPoolEngine: the server side of engines in worker processes: prefill/decode disaggregation (``justapi serve
--disaggregate``) and data-parallel replicas (``--data-parallel N``).

It starts P prefill and D decode workers (engine.worker_process; workers 0..P-1 prefill, P..P+D-1 decode), or N replicas
that each compute their requests whole, in one torch.distributed group, and offers AsyncLLM the same interface as
EngineCore: add, abort, step, has_unfinished.
Each pool has its own tensor-parallel size (``--prefill-tp``, ``--decode-tp``): a worker of size N is N processes
forming a sub-group of the world; the server talks to its leader, which ships or receives the KV with every head
(gathered from its ranks, or handed to them with the step that admits the request).
``step`` collects what the workers sent (token ids, hand-offs, transfer figures, load reports), routes with
core.pd_scheduler.PdScheduler, detokenizes, and watches the worker processes: a dead worker is logged, shown on
/health, and its requests are sent to another prefill worker (still in prefill) or failed with an error.

The group rendezvous uses MASTER_ADDR / MASTER_PORT when both are set (env://, as on several hosts); otherwise a
free loopback port.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection as mp_connection
import time
import typing

from ..config import EngineConfig, usable_cores
from ..core.limits import RequestLimits
from ..core.outputs import EngineCoreOutput
from ..core.pd_scheduler import PdScheduler, WorkerInfo
from ..core.router import PrefixRouter
from ..core.stats import PdSnapshot
from ..distributed.group import describe
from ..distributed.launch import make_launcher
from ..model.gguf_loader import ModelLoadError
from ..model.kernel_policy import kv_row_width
from ..sampling_params import SamplingParams
from .model_front import ModelFront
from .output_processor import OutputProcessor, RequestOutput
from .worker_messages import (AbortRequest, AddRequest, CheckIntegrity, Checked, Failed, Load, Outputs, Prefilled,
                          PrefilledRequest, Ready, Received, RecvKv, RequestFailed, SendKv, Sent, Stop,
                          seconds_left)
from .worker_process import launch_workers, worker_pools
from .protocol import EngineDeadError

log = logging.getLogger("justapi.pd")

START_TIMEOUT_S = 900.0  # loading a model (and compiling the C++ kernels where the installed ones do not fit)


class WorkerPoolEngine(ModelFront):
    """EngineCore's interface over worker processes: prefill on some, decode on others, KV shipped between."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.outputs = OutputProcessor(self.tokenizer)
        self.last_step = None  # the steps run in the workers; this engine's step only gathers their reports
        self._failures: list[tuple[str, BaseException]] = []
        self._first: dict[str, tuple[list[int], int, SamplingParams, int]] = {}  # rid → prompt, first token, ...
        self._tag = 0
        self._closed = False
        self._start_workers()

    # --- workers ------------------------------------------------------------------------------------------------
    def _start_workers(self) -> None:
        cfg = self.config
        roles, sizes = worker_pools(cfg)
        mode = "--data-parallel" if cfg.data_parallel is not None else "--disaggregate"
        layout, start = [], 0
        for n in sizes:  # global ranks: worker after worker, each leader first
            layout.append(tuple(range(start, start + n)))
            start += n
        self._dist_rank = [ranks[0] for ranks in layout]  # where a worker's KV is sent from / to
        world = start
        threads = cfg.num_threads or max(1, usable_cores() // world)
        # under Ray, each process a bundle of this many CPUs (--threads sets it; the default splits this host's cores)
        self.launcher = make_launcher(cfg, world, threads)
        init_method = self.launcher.rendezvous(0)  # on the node of global rank 0, worker 0's leader
        self.procs: list = []  # the workers' leaders (processes or Ray actors), by worker index
        self.followers: list[list] = []  # the workers' tensor-parallel ranks > 0
        try:
            launch_workers(self.launcher, cfg, roles, sizes, layout, threads, init_method, self.procs,
                           self.followers)
        except Exception as e:  # noqa: BLE001 - e.g. a Ray actor that cannot start: stop what did, say why
            self.close()
            raise ModelLoadError(f"{mode}: the workers could not be started: {e}") from None
        try:
            channels = self.launcher.channels(dict(enumerate(self.procs)), time.monotonic() + START_TIMEOUT_S)
        except RuntimeError as e:
            self.close()
            raise ModelLoadError(f"{mode}: {e}") from None
        self.inboxes = [channels[r] for r in range(len(roles))]  # commands in
        self._pipes = {ch.conn: r for r, ch in channels.items()}  # reports out, while the worker lives
        pools = ", ".join(f"{roles.count(r)} {r} (tp {sizes[roles.index(r)]})" for r in dict.fromkeys(roles))
        log.info("started workers: %s; %d processes of %d threads, rendezvous %s", pools, world, threads,
                 describe(init_method))
        ready = self._await_ready(roles, mode)
        router = PrefixRouter(cfg.router, cfg.router_prefix_slack, cfg.block_size)
        self.pd = PdScheduler([WorkerInfo(r, roles[r], num_blocks=ready[r][0], block_size=ready[r][1],
                                          free_blocks=ready[r][0]) for r in range(len(roles))], router)
        smallest = min(n for n, _ in ready.values())
        self._limits = RequestLimits(self.max_model_len, smallest, cfg.block_size)
        c = self.model_config
        kv_layers = c.num_layers - sum(c.recurrent_layers)  # a hybrid's recurrent layers keep states, not KV
        row = kv_row_width(c.head_dim, cfg.kv_cache_dtype == "int8")
        self._kv_shape = (kv_layers, 2, c.num_kv_heads, None, cfg.block_size, row)

    def _await_ready(self, roles: list[str], mode: str) -> dict[int, tuple[int, int]]:
        """Each worker's (KV blocks, block size) once it has loaded the model; ModelLoadError (every worker stopped)
        where one failed, died or did not start in time."""
        ready: dict[int, tuple[int, int]] = {}
        self._pids: dict[int, int] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        pending: list = []
        while len(ready) < len(roles):
            if not pending:
                pending = self._receive(1.0)
            if not pending:
                dead = [r for r, pr in enumerate(self.procs) if r not in ready and not (
                    pr.is_alive() and all(f.is_alive() for f in self.followers[r]))]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = f"worker {dead[0]} exited" if dead else "workers did not start in time"
                    raise ModelLoadError(f"{mode}: {why} while loading the model")
                continue
            msg = pending.pop(0)
            if isinstance(msg, Failed):
                self.close()
                raise ModelLoadError(f"{mode}: {roles[msg.rank]} worker {msg.rank} failed to start: "
                                     f"{msg.error}")
            if isinstance(msg, Ready):
                ready[msg.rank] = (msg.num_blocks, msg.block_size)
                self._pids[msg.rank] = msg.pid
        return ready

    def close(self) -> None:
        """Stop every worker (they get a moment to leave the group cleanly, then are terminated)."""
        if self._closed:
            return
        self._closed = True
        inboxes = getattr(self, "inboxes", [])  # none when the workers never connected
        for inbox, proc in zip(inboxes, self.procs):
            if proc.is_alive():
                inbox.put(Stop())
        deadline = time.monotonic() + 5
        for proc in self.procs + [f for fs in self.followers for f in fs]:  # leaders release their followers
            proc.join(timeout=max(0.1, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
        for inbox in inboxes:
            inbox.close()
        self.launcher.close()

    def health(self) -> tuple[bool, dict]:
        """(serving, details): serving while each pool has a live worker; details name any dead worker."""
        dead = [f"{w.role} worker {w.rank}" for w in self.pd.workers.values() if not w.alive]
        roles = dict.fromkeys(w.role for w in self.pd.workers.values())
        serving = all(self.pd.pool(role) for role in roles)
        detail: dict[str, object] = {f"{role}_workers_alive": len(self.pd.pool(role)) for role in roles} | {
                  "workers": [{"rank": w.rank, "role": w.role, "alive": w.alive, "pid": self._pids.get(w.rank),
                               "tp": len(self.followers[w.rank]) + 1,
                               "requests": w.load} for w in self.pd.workers.values()]}
        if dead:
            detail["dead_workers"] = dead
        return serving, detail

    def stats(self) -> PdSnapshot:
        """A frozen copy of the workers' last reports and the transfer counters, taken on the engine thread."""
        return PdSnapshot.of(self.pd)

    def check_integrity(self, timeout_s: float = 30.0) -> dict[int, tuple[str | None, dict]]:
        """Ask every live worker to check its KV pool; rank → (problem or None, what it holds)."""
        alive = [r for r, w in self.pd.workers.items() if w.alive]
        for r in alive:
            self.inboxes[r].put(CheckIntegrity())
        answers: dict[int, tuple[str | None, dict]] = {}
        deadline = time.monotonic() + timeout_s
        while len(answers) < len(alive) and time.monotonic() < deadline:
            for msg in self._receive(0.1):
                if isinstance(msg, Checked):
                    answers[msg.rank] = (msg.problem, msg.held)
                else:
                    self._handle(msg, [])
        return answers

    # --- requests -----------------------------------------------------------------------------------------------
    @property
    def request_limits(self) -> RequestLimits:
        return self._limits  # the smallest worker pool's

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> int:
        """ModelFront's check, against the smallest worker pool; embeddings need a whole engine."""
        if params.pooling is not None and self.pd.entry_role == "prefill":
            raise ValueError("embeddings are not served with --disaggregate (a prompt's prefill is all they are: "
                             "serve them from a plain server)")
        return super().check_request(prompt_token_ids, params)

    def queue(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Route an admitted request (ModelFront.admit) to a worker."""
        if request_id in self.pd.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        assert params.seed is not None, "queue() takes admitted params: ModelFront.admit sets the seed"
        try:
            rank = self.pd.route(request_id, prompt_token_ids)
        except RuntimeError as e:
            raise EngineDeadError(str(e)) from None
        self._first[request_id] = (list(prompt_token_ids), -1, params, params.seed)
        self.outputs.add_request(request_id, prompt_token_ids, params)
        self.inboxes[rank].put(AddRequest(request_id, list(prompt_token_ids), params, params.seed,
                                          seconds_left(params)))

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if request_id not in self.pd.requests:
            return None
        self._drop(request_id)
        prompt = self._first.pop(request_id, ([], 0))[0]
        report, _ = self.outputs.process(EngineCoreOutput(request_id, [], None, "abort", len(prompt), 0))
        return report

    def _drop(self, request_id: str) -> None:
        """Tell every worker holding the request to let it go, and forget it."""
        for rank in self.pd.holder(request_id):
            if self.pd.workers[rank].alive:
                self.inboxes[rank].put(AbortRequest(request_id))
        self.pd.finished(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.pd.requests)

    @property
    def num_waiting(self) -> int:
        return sum(w.waiting for w in self.pd.workers.values() if w.alive)

    def shared_prefixes(self, limit: int) -> list[tuple[tuple[int, ...], int]]:
        return []  # each worker's prefix cache is its own (the dashboard lists none)

    def stats_line(self) -> str:
        parts = []
        for role in dict.fromkeys(w.role for w in self.pd.workers.values()):
            pool = self.pd.pool(role, alive_only=False)
            parts.append(f"{role}: " + ", ".join(
                f"[{w.rank}] "
                f"{'dead' if not w.alive else f'{w.running} running {w.waiting} waiting {w.busy_fraction:.0%} busy'}"
                for w in pool))
        st = self.pd.stats
        if self.pd.entry_role == "prefill":
            parts.append(f"KV moved: {st.kv_transfers} requests, {st.kv_bytes / 2**20:.1f} MiB in "
                         f"{st.kv_seconds:.2f} s")
        return "; ".join(parts)

    def idle(self) -> None:
        """Between requests: keep reading the workers' load reports (and notice a worker dying)."""
        self.step()

    def take_failures(self) -> list[tuple[str, BaseException]]:
        out, self._failures = self._failures, []
        return out

    # --- the loop -----------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Everything the workers reported since the last call (waiting up to 20 ms for the first message)."""
        reports: list[RequestOutput] = []
        for msg in self._receive(0.02):
            self._handle(msg, reports)
        self._check_workers()
        return reports

    def _receive(self, timeout: float) -> list:
        """Every message the workers sent, waiting up to ``timeout`` for the first. A pipe that ends (its worker
        died, maybe mid-message) is dropped; _check_workers handles the worker."""
        msgs = []
        for ready in mp_connection.wait(list(self._pipes), timeout):
            conn = typing.cast(mp_connection.Connection, ready)  # wait() gives back the pipes it was given
            try:
                while conn.poll():
                    msgs.append(conn.recv())
            except (EOFError, OSError):
                log.info("worker %d closed its pipe", self._pipes.pop(conn))  # (closed with its channel)
        return msgs

    def _handle(self, msg, reports: list[RequestOutput]) -> None:
        match msg:
            case Outputs(rank, outs):
                for out in outs:
                    self._output(rank, out, reports)
            case Prefilled(rank, rid):
                req = self.pd.requests.get(rid)
                if req is not None and rank == req.prefill_rank:  # not a late word from a worker it moved from
                    self._ship(rid)
            case Received(rank, rid):
                req = self.pd.requests.get(rid)
                if req is not None and req.phase == "transfer" and rank == req.decode_rank:
                    req.phase = "decode"  # from now on only the decode worker holds it
            case Sent(_, rid, nbytes, num_blocks, seconds):
                self.pd.transferred(rid, nbytes, num_blocks, seconds)
            case RequestFailed(rank, rid, error):
                if rid in self.pd.requests and rank in self.pd.holder(rid):
                    self._fail(rid, error)
            case Load():
                self.pd.workers[msg.rank].report(msg)
            case Failed(rank, error):
                log.error("%s worker %d failed: %s", self.pd.workers[rank].role, rank, error)

    def _output(self, rank: int, out: EngineCoreOutput, reports: list[RequestOutput]) -> None:
        rid = out.request_id
        req = self.pd.requests.get(rid)
        if req is None or rank not in self.pd.holder(rid):
            return  # aborted or failed meanwhile; a late message
        if req.phase == "transfer" and rank == req.decode_rank:
            req.phase = "decode"  # decoding already, whether or not the sender's Sent came in
        if req.phase == "prefill" and out.new_token_ids:  # (none when its deadline passed in the queue)
            req.num_cached_tokens = out.num_cached_tokens
            prompt, _, params, seed = self._first[rid]
            self._first[rid] = (prompt, out.new_token_ids[0], params, seed)
        report, stopped = self.outputs.process_safely(dataclasses.replace(out, num_cached_tokens=req.num_cached_tokens))
        reports.append(report)
        if report.finished:
            if stopped:
                self._drop(rid)  # a stop string: the worker does not know yet
            else:
                self.pd.finished(rid)
            self._first.pop(rid, None)

    def _ship(self, rid: str) -> None:
        """A prefill worker finished a request's prompt: pick a decode worker and start the KV transfer."""
        req = self.pd.requests.get(rid)
        if req is None or req.phase != "prefill":
            return
        src = req.prefill_rank
        prompt, first, params, seed = self._first[rid]
        try:
            dst = self.pd.route_decode(rid, len(prompt))
        except RuntimeError as e:
            self.inboxes[src].put(AbortRequest(rid))
            self._fail(rid, str(e))
            return
        self._tag += 1
        nblocks = -(-len(prompt) // self.config.block_size)
        shape = tuple(nblocks if x is None else x for x in self._kv_shape)
        self.inboxes[src].put(SendKv(rid, self._dist_rank[dst], self._tag))
        self.inboxes[dst].put(RecvKv(rid, self._dist_rank[src], self._tag, shape,
                                     PrefilledRequest(prompt, first, params, seed, req.num_cached_tokens,
                                                      seconds_left(params))))

    def _fail(self, rid: str, why: str) -> None:
        self._drop(rid)
        self._first.pop(rid, None)
        self.outputs.drop(rid)
        self._failures.append((rid, EngineDeadError(f"the request failed: {why}")))

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self.procs):
            w = self.pd.workers[rank]
            if not w.alive:
                continue
            lost = [f for f in self.followers[rank] if not f.is_alive()]
            if lost and proc.is_alive():  # a worker without all its shards cannot step: stop it as a whole
                log.error("%s worker %d: its tensor-parallel rank (pid %s) died with exit code %s", w.role, rank,
                          lost[0].pid, lost[0].exitcode)
                proc.kill()
                proc.join(5)
            if proc.is_alive():
                continue
            log.error("%s worker %d (pid %s) died with exit code %s; serving with the remaining workers",
                      w.role, rank, proc.pid, proc.exitcode)
            held = {rid: self.pd.requests[rid].phase for rid in w.requests if rid in self.pd.requests}
            retry, fail = self.pd.worker_died(rank)
            streamed = [rid for rid in retry if self._first[rid][1] >= 0]  # its first token already went out
            retry = [rid for rid in retry if rid not in streamed]
            fail += streamed
            self.pd.stats.retried -= len(streamed)
            self.pd.stats.failed += len(streamed)
            for rid in fail:
                self._fail(rid, f"the {w.role} worker {rank} serving it died"
                                + (" during its KV transfer" if held.get(rid) == "transfer" else ""))
            for rid in retry:
                prompt, _, params, seed = self._first[rid]
                new_rank = self.pd.route(rid, prompt)
                self.inboxes[new_rank].put(AddRequest(rid, prompt, params, seed, seconds_left(params)))
                log.info("request %s: prefill moved to worker %d", rid, new_rank)
