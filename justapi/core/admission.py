"""Admission by SLO: the time to first token a new request would see, predicted from the prompt tokens queued ahead
of it and the step costs the engine has measured (``--ttft-slo``). Pure Python.

A new request first waits for a slot (``--max-seqs``) if every one is taken: with K requests queued ahead of it and
F slots free it waits for K + 1 - F requests to finish, at the rate requests have been finishing. Then its prompt
is computed behind the prompt tokens ahead of it. A step costs about ``base + per_prefill_token * prefill tokens
+ per_decode * decoding rows`` seconds (the products grow with the rows, attention with the context, both roughly
linear at these sizes); the three are fitted to the engine's own steps by exponentially weighted least squares.
With B prompt tokens ahead, P of its own, chunks of C and D rows decoding, the prompt takes ceil((B + P) / C)
steps costing steps * (base + per_decode * D) + per_prefill_token * (B + P). What this leaves out (prefix-cache
hits, output lengths unlike the recent ones) shows up in the prediction's error, which the server measures per
request (``justapi_ttft_prediction_error_seconds``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

HALF_LIFE_STEPS = 200  # steps after which an observation weighs half: the fit follows load changes within seconds
RIDGE = 1e-3  # keeps the fit solvable before both kinds of rows have been seen (seconds² per token², negligible)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one step: ``base`` plus per prompt token computed plus per decoding row."""

    base: float
    per_prefill_token: float
    per_decode: float
    finish_rate: float = 0.0  # requests finished per second of engine time, recently

    def ttft(self, tokens_ahead: int, own_tokens: int, num_decoding: int, chunk_size: int,
             slots_awaited: int = 0) -> float:
        """Seconds to a new request's first token; ``slots_awaited``: requests that must finish before it has a
        slot."""
        tokens = tokens_ahead + own_tokens
        steps = max(1, math.ceil(tokens / chunk_size))
        prefill = steps * (self.base + self.per_decode * num_decoding) + self.per_prefill_token * tokens
        if slots_awaited <= 0:
            return prefill
        return prefill + (slots_awaited / self.finish_rate if self.finish_rate > 0 else math.inf)


class StepCostModel:
    """Fits StepCosts to observed steps; ``costs`` is replaced whole after each one (other threads read it)."""

    def __init__(self, half_life_steps: int = HALF_LIFE_STEPS) -> None:
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self._xx = [[0.0] * 3 for _ in range(3)]
        self._xy = [0.0] * 3
        self._finished = self._seconds = 0.0  # decayed sums: requests finished, step seconds
        self.costs: StepCosts | None = None  # None until a step has been seen

    def observe(self, seconds: float, prefill_tokens: int, num_decoding: int, num_finished: int = 0) -> None:
        x = (1.0, float(prefill_tokens), float(num_decoding))
        d = self.decay
        for i in range(3):
            self._xy[i] = d * self._xy[i] + x[i] * seconds
            for j in range(3):
                self._xx[i][j] = d * self._xx[i][j] + x[i] * x[j]
        self._finished = d * self._finished + num_finished
        self._seconds = d * self._seconds + seconds
        self.costs = self._solve()

    def _solve(self) -> StepCosts:
        a = [row[:] + [y] for row, y in zip(self._xx, self._xy)]
        a[1][1] += RIDGE
        a[2][2] += RIDGE
        for col in range(3):  # Gaussian elimination with partial pivoting on the 3x3 normal equations
            pivot = max(range(col, 3), key=lambda r: abs(a[r][col]))
            a[col], a[pivot] = a[pivot], a[col]
            if abs(a[col][col]) < 1e-12:
                continue
            for r in range(3):
                if r != col:
                    f = a[r][col] / a[col][col]
                    a[r] = [v - f * w for v, w in zip(a[r], a[col])]
        coef = [a[i][3] / a[i][i] if abs(a[i][i]) >= 1e-12 else 0.0 for i in range(3)]
        rate = self._finished / self._seconds if self._seconds > 0 else 0.0
        base, per_prefill_token, per_decode = (max(0.0, c) for c in coef)  # a negative cost is noise, not a saving
        return StepCosts(base, per_prefill_token, per_decode, rate)
