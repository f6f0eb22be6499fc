"""Tensor parallelism (``--tp N``): which slice of every weight a rank holds, and the collectives between ranks.

The split, per layer (Megatron-style, as vLLM does)::

    attention   query heads split across ranks; KV heads split with them, or replicated where there are fewer KV
                heads than ranks; Q/K/V rows of the rank's heads, output-projection columns of the same heads
                → partial sums, one all-reduce
    MLP         gate/up rows (column-parallel), down columns (row-parallel) → partial sums, one all-reduce
    embedding   rows of a vocabulary range: a token outside it looks up zeros; one all-reduce
    LM head     rows of the same vocabulary range: every rank's logits slice, then one all-gather

When the heads do not divide evenly (SmolLM2: 9 query heads, 3 KV heads, on 2 ranks) each rank takes a contiguous
range of query heads, as even as possible, and a copy of the KV head of each of them (one KV head per query head on
that rank: the shared KV heads are replicated). Every rank holds only its slices and the KV cache of its KV heads.
Norm weights are replicated. Sums run in fp32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import ModelConfig


def even_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` contiguous ranges covering 0..n, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


@dataclass(frozen=True)
class TpPlan:
    """What rank ``rank`` of ``size`` holds."""

    rank: int
    size: int
    q_heads: tuple[int, ...]  # global query heads, in local order
    kv_heads: tuple[int, ...]  # global KV heads, in local order (repeats where replicated)
    ffn: tuple[int, int]  # intermediate rows [start, end)
    vocab: tuple[int, int]  # vocabulary rows [start, end)

    @classmethod
    def make(cls, cfg: ModelConfig, rank: int, size: int) -> TpPlan:
        """The plan, or ValueError naming the dimension that cannot be split ``size`` ways."""
        for dim, value in (("attention heads", cfg.num_heads), ("intermediate (MLP) rows", cfg.intermediate_size),
                           ("vocabulary entries", cfg.vocab_size)):
            if size > value:
                raise ValueError(f"--tp {size} exceeds the model's {value} {dim}: every rank needs at least one")
        h, k = cfg.num_heads, cfg.num_kv_heads
        group = h // k
        if h % size == 0 and (k % size == 0 or size % k == 0):
            per = h // size
            q = tuple(range(rank * per, (rank + 1) * per))
            if k % size == 0:
                kv = tuple(range(rank * (k // size), (rank + 1) * (k // size)))
            else:  # more ranks than KV heads: this rank's query heads share one KV head, replicated
                kv = (q[0] // group,)
        else:
            a, b = even_range(h, size, rank)
            q = tuple(range(a, b))
            kv = tuple(i // group for i in q)
        return cls(rank, size, q, kv, even_range(cfg.intermediate_size, size, rank),
                   even_range(cfg.vocab_size, size, rank))


def head_rows(heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """Row indices of ``heads`` in a [heads * head_dim, ...] projection."""
    return torch.cat([torch.arange(i * head_dim, (i + 1) * head_dim) for i in heads])


class TpComm:
    """The collectives a sharded model needs, with the time they take (for the benchmark)."""

    def __init__(self, plan: TpPlan, vocab_size: int) -> None:
        self.plan = plan
        self.vocab_size = vocab_size
        self.slice_len = max(even_range(vocab_size, plan.size, r)[1] - even_range(vocab_size, plan.size, r)[0]
                             for r in range(plan.size))
        self.seconds = 0.0  # spent in collectives (all-reduce, all-gather), this rank's view
        self.calls = 0
        self.bytes = 0  # payload of this rank's collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = x.float()
        dist.all_reduce(y)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += y.numel() * 4
        return y.to(x.dtype)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, local vocab] on every rank → [rows, vocab] on every rank."""
        t0 = time.perf_counter()
        rows, n = logits.shape
        padded = logits.new_zeros(rows, self.slice_len)
        padded[:, :n] = logits
        parts = [torch.empty_like(padded) for _ in range(self.plan.size)]
        dist.all_gather(parts, padded)
        out = torch.cat([p[:, : b - a] for p, (a, b) in
                         zip(parts, (even_range(self.vocab_size, self.plan.size, r) for r in range(self.plan.size)))],
                        dim=1)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += padded.numel() * 4 * self.plan.size
        return out
