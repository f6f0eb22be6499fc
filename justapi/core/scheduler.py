"""The token-level scheduler: each step, which tokens of which requests to compute. Pure Python, no torch.

One invariant drives everything: a request has ``num_computed_tokens`` and catches up towards ``num_tokens``.
A step gives every running request that has caught up one decode token, then spends the prefill budget
(``chunk_size`` tokens) on requests still prefilling, in the policy's order, admitting waiting requests into free
slots (who starts next, who is preempted first, and whose prompt goes before a running one's: core.policy). A
prefix-cache hit simply starts a request with ``num_computed_tokens > 0``; a preempted request restarts at 0 and
recomputes (cheaply, since its blocks went into the prefix cache).

The blocks themselves are kept by ``KvBlocks``; static batching, the baseline, is a ``Batching`` of its own
(core.batching).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import replace

from ..config import SchedulerConfig
from ..request import Request, RequestStatus, pools_from_the_start, with_min_tokens_stop_ids
from ..sampling_params import SamplingParams
from .drafts import add_draft_slots, draft_slots, propose_drafts
from .batching import Batching
from .handoff import HandOffs
from .kv_blocks import KvBlocks
from .kv_store import KvStore
from .limits import RequestLimits
from .outputs import CachedRequestData, EngineCoreOutput, NewRequestData, RunnerOutput, SchedulerOutput
from .policy import make_policy
from .stats import SchedulerStats
from .step_budget import StepBudget
from .step_record import StepRecord


class Scheduler(HandOffs):
    """Continuous batching with chunked prefill, a paged KV pool, preemption by recompute and a prefix cache."""

    def __init__(self, config: SchedulerConfig, batching: Batching | None = None, store: KvStore | None = None) -> None:
        """``batching``: when waiting requests join (core.batching: at any step, or in whole batches); ``store``: the
        prefix cache's disk tier (core.kv_store)."""
        self.config = config
        self.batching = batching or Batching()
        self.block_size = config.block_size
        self.kv = KvBlocks(config.num_blocks, config.block_size, config.prefix_cache, config.state_snapshots, store)
        self.pool = self.kv.pool  # read by the engine, stats and tests
        self.cache = self.kv.cache
        self.limits = RequestLimits(config.max_model_len, config.num_blocks, config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in the policy's order (fcfs: admission): the last is preempted first
        self.policy = make_policy(config.policy, config.priority_aging_s, dict(config.user_weights), config.chunk_size)
        self.clock = time.monotonic  # arrivals, priority aging and deadlines (tests set their own)
        self._num_arrivals = 0
        self._num_with_deadline = 0  # requests that have one: expire() scans nothing while there are none
        self._short_of_blocks = False  # the last step found no blocks for the next waiting request
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        self._finished_ids: set[str] = set()  # runner state to drop at the next step
        self._new_ids: set[str] = set()  # admitted (or resumed) since the last step
        self._out_data: dict[str, NewRequestData | CachedRequestData] = {}  # this step's entries by request id
        self.record = StepRecord()  # the latest step as the step log keeps it (cells, preemptions, aborts)
        self.handoffs: dict[str, Request] = {}  # a prefill worker's (core.handoff)

    # --- requests in and out ------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids, seed: int
    ) -> Request:
        """Queue a request, or raise AdmissionError if it could never fit."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        max_tokens = self.limits.check(len(prompt_token_ids), params.max_tokens, params.pooling is not None)
        if params.max_tokens is None:
            params = replace(params, max_tokens=max_tokens)
        params = with_min_tokens_stop_ids(params, eos_token_ids)
        req = Request(request_id, list(prompt_token_ids), params, frozenset(eos_token_ids), seed)
        self._queue(req)
        return req

    def _queue(self, req: Request) -> None:
        req.arrival_time, req.arrival_seq = self.clock(), self._num_arrivals
        self._num_arrivals += 1
        self._num_with_deadline += req.sampling_params.deadline is not None
        self.policy.on_arrival(req, self.waiting)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> EngineCoreOutput | None:
        """Stop a request at once and free its blocks; None if it is unknown or already finished."""
        if request_id in self.handoffs:
            self.release_handoff(request_id)
            return None
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        self.record.abort(request_id)
        return self._output(req, [], None, "abort")

    def expire(self) -> list[EngineCoreOutput]:
        """End every request whose deadline has passed with what it has (freeing its blocks): their outputs."""
        if not self._num_with_deadline:
            return []
        now = self.clock()
        late = [r for r in (*self.waiting, *self.running)
                if r.sampling_params.deadline is not None and r.sampling_params.deadline <= now]
        for req in late:
            self._finish(req, RequestStatus.FINISHED_TIMEOUT)
        self.stats.num_timeouts += len(late)
        return [self._output(req, [], None, RequestStatus.FINISHED_TIMEOUT.value) for req in late]

    def fail_request(self, request_id: str, error: str) -> EngineCoreOutput:
        """End a request that failed alone (its sampling, grammar or text raised), freeing its blocks."""
        req = self.requests[request_id]
        self._finish(req, RequestStatus.FINISHED_ERROR)
        out = self._output(req, [], None, RequestStatus.FINISHED_ERROR.value)
        out.error = error
        return out

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """End a request for a reason found outside the scheduler (a stop string)."""
        req = self.requests.get(request_id)
        if req is not None:
            self._finish(req, status)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide this step's work: running decodes first, then prefill chunks, then admissions."""
        out = SchedulerOutput()
        self._out_data = {}
        self.record.begin()
        budget = StepBudget(self.config)
        now = self.clock()
        self.policy.order_running(self.running, now)
        self._displace(now)
        self.batching.admit_batch(self)
        propose_drafts(self.running, self.config)
        preempted, deferred = self._schedule_running(out, budget, now)
        if not preempted and self.batching.admits_each_step:
            self._schedule_waiting(out, budget, now)
        self._schedule_deferred(out, budget, deferred)
        self.policy.charge_step(self.requests, out.num_scheduled_tokens)
        out.finished_request_ids = self._finished_ids
        self._finished_ids = set()
        self.stats.num_steps += 1
        self.stats.last_step_tokens = out.total_num_scheduled_tokens
        self.stats.last_step_prefill_tokens = self.config.chunk_size - budget.tokens
        self.stats.last_step_decodes = budget.decodes
        self.stats.num_scheduled_tokens_total += out.total_num_scheduled_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget,
                          now: float) -> tuple[bool, list[Request]]:
        """Decodes and prefill chunks of running requests; returns whether any was preempted, and the prefilling
        requests the policy puts after the next waiting one (their chunks wait for the admissions)."""
        preempted = False
        drafting: list[Request] = []  # decodes with drafts, given their draft slots once everyone has a token
        deferred: list[Request] = []
        i = 0
        while i < len(self.running):
            req = self.running[i]
            remaining = req.num_tokens - req.num_computed_tokens
            if remaining == 1:
                if not budget.may_decode():
                    i += 1
                    continue
                n = 1
            else:
                if not budget.may_prefill():
                    i += 1
                    continue
                if self.waiting and self.policy.prefill_after(req, self.waiting, now):
                    # stays running: victims below come from after the request growing, so never from here
                    deferred.append(req)
                    i += 1
                    continue
                n = self.kv.chunk(req, min(remaining, budget.tokens))
            new_blocks, lost = self._grow_or_preempt(req, n)
            preempted |= lost
            if new_blocks is None:
                break  # req itself was preempted; it was the last one
            budget.spend(n, decode=remaining == 1)
            if remaining == 1 and draft_slots(req, self.config.branch):
                drafting.append(req)
            self._add_to_output(out, req, n, new_blocks)
            i += 1
        for req in drafting:
            if req.status is RequestStatus.RUNNING:  # not preempted for a later request's blocks
                add_draft_slots(out, self._out_data[req.request_id], req, self.kv, self.config.branch)
        return preempted, deferred

    def _grow_or_preempt(self, req: Request, n: int) -> tuple[list[int] | None, bool]:
        """Blocks for ``n`` more of ``req``'s tokens, preempting from the end of the running list (the policy's
        last) while there are none; None if ``req`` itself was preempted. Also whether anyone was."""
        new_blocks = self.kv.grow(req, req.num_computed_tokens + n)
        preempted = False
        while new_blocks is None:  # out of blocks: preempt the policy's last running request
            victim = self.running[-1]
            self._preempt(victim)
            preempted = True
            if victim is req:
                break
            new_blocks = self.kv.grow(req, req.num_computed_tokens + n)
        return new_blocks, preempted

    def _schedule_deferred(self, out: SchedulerOutput, budget: StepBudget, deferred: list[Request]) -> None:
        """What the admissions left of the prefill budget, to the running prompts deferred for them. Everyone else
        is scheduled by now, so one short of blocks is itself preempted (the policy put it after the admissions)."""
        for req in deferred:
            if not budget.may_prefill():
                return
            n = self.kv.chunk(req, min(req.num_tokens - req.num_computed_tokens, budget.tokens))
            new_blocks = self.kv.grow(req, req.num_computed_tokens + n)
            if new_blocks is None:
                self._preempt(req)
                continue
            budget.spend(n, decode=False)
            self._add_to_output(out, req, n, new_blocks)

    def _displace(self, now: float) -> None:
        """Preempt the last running request (the policy's least urgent) for the next waiting one when the policy
        ranks that one strictly higher and it cannot start: every slot is taken, or the last step found no blocks
        for it. One a step: the freed room is tried before more is taken."""
        if not self.waiting or not self.running:
            return
        if self._num_holding < self.config.max_seqs and not self._short_of_blocks:
            return
        head = self.policy.next_waiting(self.waiting, now)
        if self.policy.displaces(head, self.running[-1], now):
            self._preempt(self.running[-1])

    def _schedule_waiting(self, out: SchedulerOutput, budget: StepBudget, now: float) -> None:
        self._short_of_blocks = False
        while self.waiting and self._num_holding < self.config.max_seqs:
            req = self.policy.next_waiting(self.waiting, now)
            if req.imported_kv is not None:
                req.num_computed_tokens = req.num_prompt_tokens  # its prompt's KV arrives with it
            elif not pools_from_the_start(req):  # a mean- or cls-pooled embedding needs its rows from the first
                self.kv.match_prefix(req, budget.tokens if budget.may_prefill() else 0)
            remaining = req.num_tokens - req.num_computed_tokens
            is_decode = remaining == 1
            if is_decode and not budget.may_decode():
                new_blocks = None
            elif not is_decode and not budget.may_prefill():
                new_blocks = None
            elif not is_decode and self.config.whole_prompts and remaining > budget.tokens and budget.prefills:
                new_blocks = None  # a whole prompt over what this step has left waits for a step of its own
            else:
                # a whole prompt takes a step's budget or more: the first prefill of its step, bounded by the context
                n = 1 if is_decode else remaining if self.config.whole_prompts else self.kv.chunk(
                    req, min(remaining, budget.tokens))
                new_blocks = self.kv.grow(req, req.num_computed_tokens + n)
                self._short_of_blocks = new_blocks is None
            if new_blocks is None:
                self.kv.unmatch(req)
                break  # nobody overtakes the request the policy picked
            if req is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(req)
            self.policy.on_admit(req, self.waiting)
            self.admit(req)
            budget.spend(n, decode=is_decode)
            self._add_to_output(out, req, n, new_blocks)

    def admit(self, req: Request) -> None:
        """Into the running batch (a waiting request the batching chose, or a preempted one resuming)."""
        if req.status is RequestStatus.PREEMPTED:
            self.stats.num_resumed_cached_tokens += req.num_computed_tokens
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        self._new_ids.add(req.request_id)
        if req.num_cached_tokens < 0:  # first admission: count the prompt lookup
            req.num_cached_tokens = req.num_computed_tokens
            self.kv.record_lookup(req)

    def _add_to_output(self, out: SchedulerOutput, req: Request, num_tokens: int, new_blocks: list[int]) -> None:
        rid = req.request_id
        data: NewRequestData | CachedRequestData
        if rid in self._new_ids:
            self._new_ids.discard(rid)
            data = NewRequestData(
                rid, list(req.all_token_ids), req.num_prompt_tokens, list(req.block_ids),
                req.num_computed_tokens, req.sampling_params, req.seed, req.imported_kv,
            )
            out.new_requests.append(data)
            req.imported_kv = None  # the runner has it now; after a preemption the request recomputes
        else:
            data = CachedRequestData(rid, list(new_blocks), req.num_computed_tokens)
            out.cached_requests.append(data)
        self._out_data[rid] = data
        out.num_scheduled_tokens[rid] = num_tokens
        self.kv.step_copies(req, num_tokens, out)

    # --- after the runner ---------------------------------------------------------------------------------
    def update(self, sched: SchedulerOutput, result: RunnerOutput) -> list[EngineCoreOutput]:
        """Advance ``num_computed_tokens``, append sampled tokens, retire finished requests; each request's cell
        goes to the step record."""
        outputs = []
        self.record.begin_update()
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if rid in result.failed:
                outputs.append(self.fail_request(rid, result.failed[rid]))
                continue
            start = req.num_computed_tokens
            was_prefilling = start < req.num_prompt_tokens
            new_ids = result.sampled_token_ids.get(rid, [])
            drafts = sched.drafts.get(rid)
            if drafts is not None:
                # the last token and the accepted drafts now have KV at their positions (the runner moved a
                # tree's accepted path there); rejected drafts' slots are simply overwritten later
                req.num_computed_tokens += len(new_ids)
                self.stats.count_spec(n - 1, drafts.depth, len(new_ids) - 1)
                self.record.cell(rid, "spec", start, n, len(new_ids) - 1)
            else:
                req.num_computed_tokens += n
                self.kv.state_saved(req)
                self.record.cell(rid, "prefill" if was_prefilling else "decode", start, n, 0)
            status = None
            for k, tok in enumerate(new_ids):
                req.append_output(tok)
                status = req.check_stop()
                if status is not None:
                    new_ids = new_ids[: k + 1]
                    break
            if self.cache is not None and was_prefilling and req.num_computed_tokens >= req.num_prompt_tokens:
                self.kv.cache_computed(req)  # share the prompt with requests arriving while this one decodes
            embedding = result.embeddings.get(rid)
            if embedding is not None:  # an embedding request: done once its prompt is
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self._finish(req, status)
            elif self.config.hand_off_after_prefill and was_prefilling and new_ids:
                self._hand_off(req)
            if new_ids or status is not None:
                logprobs = result.logprobs.get(rid)
                logprobs = logprobs[: len(new_ids)] if logprobs is not None else None
                outputs.append(self._output(req, new_ids, logprobs, status and status.value, embedding))
        return outputs

    def _output(self, req: Request, new_ids, logprobs, reason, embedding=None) -> EngineCoreOutput:
        return EngineCoreOutput(
            req.request_id, list(new_ids), logprobs, reason, req.num_prompt_tokens, max(req.num_cached_tokens, 0),
            embedding,
        )

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.batching.preempted(req)
        self.record.preempt(req.request_id)
        req.drafts = None
        self.stats.num_preempted_tokens += req.num_computed_tokens
        self.kv.release(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        self._finished_ids.add(req.request_id)
        self._new_ids.discard(req.request_id)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.release(req)
        req.status = status
        self._forget(req)
        self._finished_ids.add(req.request_id)
        self._new_ids.discard(req.request_id)
        self.batching.finished(self, req)

    def _forget(self, req: Request) -> None:
        """The request leaves the scheduler's books (finished, or its handed-off KV shipped)."""
        del self.requests[req.request_id]
        self._num_with_deadline -= req.sampling_params.deadline is not None

    # --- checks and figures ----------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Assert every block is free, cached or held by a running or handed-off request."""
        self.kv.check_integrity([*self.running, *self.handoffs.values()], self.waiting)

    @property
    def _num_holding(self) -> int:
        """Requests holding a sequence slot: the running ones, and a hybrid's hand-offs (their state slots)."""
        return len(self.running) + (len(self.handoffs) if self.config.holds_states else 0)

    @property
    def num_cached_blocks(self) -> int:
        return self.kv.num_cached_blocks
