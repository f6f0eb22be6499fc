"""Scheduling policies: which waiting request starts next, which running request is preempted first, and whether a
waiting request may push a running one out. The scheduler asks; a policy never moves a request itself. Pure Python.

- ``fcfs``: arrival order; the most recently admitted request is preempted first (what the scheduler always did).
- ``priority``: the request's ``priority`` (lower is more urgent, vLLM's meaning), aged so that nobody waits forever:
  every ``aging_s`` seconds since arrival make a request one level more urgent. A request of priority p therefore
  outranks every later arrival of priority p_min after (p - p_min) * aging_s seconds, and ties go to the earlier
  arrival, so it starts once the requests ahead of it by then are served. The least urgent running request (ties:
  the latest admitted) is preempted first, also to make room for a strictly more urgent waiting one, and a strictly
  more urgent waiting request's prompt chunk goes before a less urgent running one's.
- ``fair``: virtual token counters (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024): each
  user's counter grows by the tokens computed for it, prompt tokens weighing 1 and output tokens 2 (the paper's
  w_p, w_q), divided by the user's weight; the waiting request of the user with the smallest counter starts next.
  A user who arrives with nothing queued has its counter lifted to the smallest counter in the queue (to the
  counter of the last user to leave it when the queue is empty), so idle time earns no credit. No preemption for
  fairness: the preemption victim (for lack of blocks) is the latest admitted request of the user with the largest
  counter.
- ``shortest``: shortest remaining prompt first (SRPT on the prefill): the request with the fewest tokens left to
  compute before its next output (for a waiting request, its whole prompt: the prefix cache is looked up at
  admission) starts next and gets the step's prefill budget first, so a short prompt is not queued behind a long
  one's chunks. Aged: every ``aging_s`` seconds of waiting count as one step's prefill budget
  (``chunk_size`` tokens) fewer, so a prompt of L tokens outranks every later arrival after L / chunk_size * aging_s
  seconds. The most recently admitted of those with the most left to compute is preempted first. No preemption to
  start a shorter one.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..request import Request

PROMPT_TOKEN_WEIGHT = 1.0  # VTC's w_p
OUTPUT_TOKEN_WEIGHT = 2.0  # VTC's w_q: a decode step costs more per token than a prefill chunk
MAX_IDLE_COUNTERS = 4096  # counters kept of users with nothing queued (clients name users freely); up to twice that


class FcfsPolicy:
    name = "fcfs"

    def on_arrival(self, req: Request, waiting: Sequence[Request]) -> None:
        """A request is about to join the queue."""

    def on_admit(self, req: Request, waiting: Sequence[Request]) -> None:
        """A request left the queue for the running batch."""

    def next_waiting(self, waiting: Sequence[Request], now: float) -> Request:
        """The waiting request to start next (the queue is not empty)."""
        return waiting[0]

    def order_running(self, running: list[Request], now: float) -> None:
        """Sort ``running`` in place so that its last request is the first to preempt. FCFS: admission order."""

    def displaces(self, waiting: Request, running: Request, now: float) -> bool:
        """Whether ``waiting`` may preempt ``running`` to start (when slots or blocks are short)."""
        return False

    def prefill_after(self, running: Request, waiting: Sequence[Request], now: float) -> bool:
        """Whether the prompt chunk of ``running`` (still prefilling) waits this step until the next of ``waiting``
        (not empty) is admitted and given its chunk. Otherwise running requests' chunks come first."""
        return False

    def charge(self, req: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:
        """Tokens computed for ``req`` this step."""

    def charge_step(self, requests: Mapping[str, Request], scheduled: Mapping[str, int]) -> None:
        """What each scheduled request computes this step: its prompt tokens, or one output token."""
        for rid, n in scheduled.items():
            req = requests[rid]
            if req.num_tokens - req.num_computed_tokens == 1:
                self.charge(req, 0, 1)
            else:
                self.charge(req, n, 0)


class PriorityPolicy(FcfsPolicy):
    name = "priority"

    def __init__(self, aging_s: float) -> None:
        self.aging_s = aging_s

    def level(self, req: Request, now: float) -> int:
        """The request's priority, one level more urgent per ``aging_s`` seconds since it arrived."""
        return req.sampling_params.priority - math.floor(max(0.0, now - req.arrival_time) / self.aging_s)

    def next_waiting(self, waiting: Sequence[Request], now: float) -> Request:
        return min(waiting, key=lambda r: (self.level(r, now), r.arrival_seq))

    def order_running(self, running: list[Request], now: float) -> None:
        running.sort(key=lambda r: self.level(r, now))  # stable: admission order among equal levels

    def displaces(self, waiting: Request, running: Request, now: float) -> bool:
        return self.level(waiting, now) < self.level(running, now)

    def prefill_after(self, running: Request, waiting: Sequence[Request], now: float) -> bool:
        return self.displaces(self.next_waiting(waiting, now), running, now)


class FairPolicy(FcfsPolicy):
    name = "fair"

    def __init__(self, weights: dict[str, float]) -> None:
        self.weights = weights
        self.counters: dict[str, float] = {}
        self._last_left: str | None = None  # the last user whose queued requests all started

    @staticmethod
    def user(req: Request) -> str:
        return req.sampling_params.user or ""

    def on_arrival(self, req: Request, waiting: Sequence[Request]) -> None:
        user = self.user(req)
        queued = {self.user(r) for r in waiting}
        if user in queued:
            return
        if queued:
            floor = min(self.counters.get(u, 0.0) for u in queued)
        else:
            floor = self.counters.get(self._last_left, 0.0) if self._last_left is not None else 0.0
        self.counters[user] = max(self.counters.pop(user, 0.0), floor)  # the dict runs least to most recently active
        if len(self.counters) > 2 * MAX_IDLE_COUNTERS + len(queued):
            self._forget_idle({*queued, user, self._last_left})

    def _forget_idle(self, keep: set[str | None]) -> None:
        """Keep the counters of the MAX_IDLE_COUNTERS most recently active users outside ``keep``. A forgotten user
        who returns is lifted to the floor, losing what its counter had above it: only a user idle while thousands
        of others were served gains that (API keys as users bound who one client can be)."""
        idle = [u for u in self.counters if u not in keep]
        for u in idle[:len(idle) - MAX_IDLE_COUNTERS]:
            del self.counters[u]

    def on_admit(self, req: Request, waiting: Sequence[Request]) -> None:
        user = self.user(req)
        if all(self.user(r) != user for r in waiting):
            self._last_left = user

    def next_waiting(self, waiting: Sequence[Request], now: float) -> Request:
        return min(waiting, key=lambda r: (self.counters.get(self.user(r), 0.0), r.arrival_seq))

    def order_running(self, running: list[Request], now: float) -> None:
        running.sort(key=lambda r: self.counters.get(self.user(r), 0.0))  # stable: admission order per user

    def charge(self, req: Request, num_prompt_tokens: int, num_output_tokens: int) -> None:
        user = self.user(req)
        cost = PROMPT_TOKEN_WEIGHT * num_prompt_tokens + OUTPUT_TOKEN_WEIGHT * num_output_tokens
        self.counters[user] = self.counters.pop(user, 0.0) + cost / self.weights.get(user, 1.0)  # now most recent


class ShortestPolicy(FcfsPolicy):
    name = "shortest"

    def __init__(self, aging_s: float, chunk_size: int) -> None:
        self.credit_per_s = chunk_size / aging_s  # tokens of rank a second of waiting earns

    def rank(self, req: Request, now: float) -> float:
        """Tokens left to compute before the request's next output, less its credit for the time since it arrived."""
        return req.num_tokens - req.num_computed_tokens - self.credit_per_s * max(0.0, now - req.arrival_time)

    def next_waiting(self, waiting: Sequence[Request], now: float) -> Request:
        return min(waiting, key=lambda r: (self.rank(r, now), r.arrival_seq))

    def order_running(self, running: list[Request], now: float) -> None:
        running.sort(key=lambda r: self.rank(r, now))  # stable: admission order among equal ranks

    def prefill_after(self, running: Request, waiting: Sequence[Request], now: float) -> bool:
        return self.rank(self.next_waiting(waiting, now), now) < self.rank(running, now)


def make_policy(name: str, aging_s: float, weights: dict[str, float], chunk_size: int) -> FcfsPolicy:
    if name == "shortest":
        return ShortestPolicy(aging_s, chunk_size)
    if name == "priority":
        return PriorityPolicy(aging_s)
    if name == "fair":
        return FairPolicy(weights)
    if name == "fcfs":
        return FcfsPolicy()
    raise ValueError(f"unknown scheduling policy {name!r}")
