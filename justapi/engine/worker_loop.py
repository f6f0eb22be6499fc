"""The one worker loop: an EngineCore (of any role: engine_core.ROLES) driven by the messages of
engine.worker_messages, in a worker process (engine.worker_process) or in a Ray Serve replica's thread (ray_replica).

Commands come in through ``inbox`` (add, abort, send KV, receive KV, check, stop); reports go out through
``outbox`` (each step's new token ids, hand-offs, transfers, load). The loop only talks to the engine: requests
arrive checked and defaulted by the front that sent them.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time

from ..core.admission import StepCostModel
from .engine_core import EngineCore
from .worker_messages import (AbortRequest, AddRequest, CheckIntegrity, Checked, Load, Outputs, Prefilled, Received,
                          RecvKv, RequestFailed, SendKv, Sent, Stop, local_params)

log = logging.getLogger("justapi.worker")

REPORT_INTERVAL_S = 0.25


class WorkerLoop:
    """Step the engine while it holds requests, serve commands between steps, report to the front."""

    def __init__(self, rank: int, engine: EngineCore, inbox, outbox, report_every: float = REPORT_INTERVAL_S) -> None:
        """``rank``: the worker's name in its reports. ``report_every``: seconds between load reports (0: after
        every step, as a Ray Serve replica's load rides on its streams)."""
        self.rank = rank
        self.engine = engine
        self.inbox = inbox
        self.outbox = outbox
        self.report_every = report_every
        self.sends: dict = {}  # request id -> Transfer (prefill side)
        self.recvs: dict = {}  # request id -> (Transfer, RecvKv's request fields) (decode side)
        self.aborted_recvs: set[str] = set()
        self.announced: set[str] = set()  # hand-offs already reported
        self.busy_s = 0.0
        self.last_report = time.monotonic()
        self.step_costs = StepCostModel()  # reported to the front for --ttft-slo's prediction

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
                self._step()
            self._report()

    def _step(self) -> None:
        t0 = time.perf_counter()
        outs = self.engine.step_core()
        seconds = time.perf_counter() - t0
        self.busy_s += seconds
        if outs:
            self.outbox.put(Outputs(self.rank, outs))
        # only a prefill worker hands off: the others skip the set a step
        handed_off = self.engine.handed_off - self.announced if self.engine.role == "prefill" else set()
        for rid in handed_off:
            self.announced.add(rid)
            self.outbox.put(Prefilled(self.rank, rid))
        # a request leaving the batch (finished or handed off) frees a slot
        self.step_costs.observe(seconds, *self.engine.last_step_shape(),
                                sum(o.finish_reason is not None for o in outs) + len(handed_off))

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
        self.outbox.put(RequestFailed(self.rank, rid, why))

    def _handle(self, msg) -> None:
        match msg:
            case AddRequest(rid, prompt, params, seed, deadline_in):
                self.engine.queue_request(rid, prompt, local_params(params, deadline_in), seed)
            case AbortRequest(rid):
                self.engine.drop_request(rid)
                self.announced.discard(rid)
                if rid in self.recvs:
                    self.aborted_recvs.add(rid)
            case SendKv(rid, dst, tag):
                from ..distributed.kv_transfer import send_kv

                kv = self.engine.handoff_kv(rid)
                if kv is None:  # aborted meanwhile, or not ours
                    self._failed(rid, "its KV is not on the prefill worker")
                    return
                state = self.engine.handoff_state(rid)  # a hybrid's recurrent states after the prompt
                self.sends[rid] = send_kv(rid, [kv] + ([state] if state is not None else []), dst, tag)
            case RecvKv(rid, src, tag, shape, request):
                from ..distributed.kv_transfer import recv_kv

                specs = [(shape, self.engine.model.kv_dtype)] + self.engine.state_specs()
                transfer = recv_kv(rid, specs, src, tag, self.engine.config.device)
                self.recvs[rid] = (transfer, dataclasses.replace(
                    request, params=local_params(request.params, request.deadline_in), deadline_in=None))
            case CheckIntegrity():
                problem, counts = self.engine.integrity()
                self.outbox.put(Checked(self.rank, problem, counts | {"transfers": len(self.sends) + len(self.recvs)}))
            case _:
                raise TypeError(f"unknown command {msg!r}")

    def _poll_transfers(self) -> None:
        for rid, t in list(self.sends.items()):
            try:
                if not t.done():
                    continue
                self.outbox.put(Sent(self.rank, rid, t.nbytes, t.tensor.shape[3], t.seconds))
            except RuntimeError as e:
                self._failed(rid, f"its KV transfer failed ({str(e).splitlines()[0]})")
            del self.sends[rid]
            self.engine.release_handoff(rid)
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
                self.engine.admit_prefilled(rid, r.prompt_token_ids, r.first_token, r.params, r.seed, t.tensor,
                                            r.num_cached_tokens, t.tensors[1] if len(t.tensors) > 1 else None)
            except ValueError as e:
                self._failed(rid, str(e))
                continue
            self.outbox.put(Received(self.rank, rid))

    def _report(self) -> None:
        now = time.monotonic()
        if now - self.last_report < self.report_every:
            return
        load = self.engine.load()
        load["waiting"] += len(self.recvs)  # received KV not yet admitted waits too
        self.outbox.put(Load(self.rank, busy_fraction=min(1.0, self.busy_s / (now - self.last_report)),
                             costs=self.step_costs.costs, **load))
        self.busy_s = 0.0
        self.last_report = now
