"""Prefill/decode disaggregation as the scheduler sees it (core.pd_scheduler routes between workers): a prefill
worker's request leaves the batch after its first token with its blocks kept until its KV is shipped
(SchedulerConfig.hand_off_after_prefill, set by the engine's role); a decode worker admits requests whose prompt KV
was computed elsewhere straight into decoding. Part of the Scheduler; its state lives there (``handoffs``)."""

from __future__ import annotations

from ..config import SchedulerConfig
from ..request import Request, with_min_tokens_stop_ids
from ..sampling_params import SamplingParams
from .kv_blocks import KvBlocks
from .limits import RequestLimits


class HandOffs:
    """The hand-off steps of core.scheduler.Scheduler, over the parts of it they use (declared here)."""

    config: SchedulerConfig
    requests: dict[str, Request]
    handoffs: dict[str, Request]  # handed off, their KV not yet shipped
    running: list[Request]
    limits: RequestLimits
    kv: KvBlocks
    _finished_ids: set[str]
    _new_ids: set[str]

    def _queue(self, req: Request) -> None:
        raise NotImplementedError  # the Scheduler's

    def _forget(self, req: Request) -> None:
        raise NotImplementedError  # the Scheduler's

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                              params: SamplingParams, eos_token_ids, seed: int, kv, num_cached_tokens: int) -> Request:
        """Queue a request whose prompt KV was computed elsewhere (``kv``, opaque here) and whose first output token
        is known: it is admitted straight into decoding, the runner copies ``kv`` into its blocks."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.limits.check(len(prompt_token_ids), params.max_tokens, params.pooling is not None)
        params = with_min_tokens_stop_ids(params, eos_token_ids)
        req = Request(request_id, list(prompt_token_ids), params, frozenset(eos_token_ids), seed)
        req.append_output(first_token)
        req.imported_kv = kv
        req.num_cached_tokens = num_cached_tokens  # counted by the prefill worker's cache
        self._queue(req)
        return req

    def release_handoff(self, request_id: str) -> None:
        """A handed-off request's KV has been shipped (or the transfer was given up): free its blocks."""
        req = self.handoffs.pop(request_id, None)
        if req is not None:
            self.kv.release(req)
            self._forget(req)
            if self.config.holds_states:
                self._finished_ids.add(request_id)  # the runner frees its state slot now

    def _hand_off(self, req: Request) -> None:
        """Out of the batch with its blocks kept: its KV is about to be shipped to a decode worker."""
        self.running.remove(req)
        self.handoffs[req.request_id] = req
        if not self.config.holds_states:  # a hybrid's state slot is kept, its states leave with the KV
            self._finished_ids.add(req.request_id)  # the runner drops its state
        self._new_ids.discard(req.request_id)
