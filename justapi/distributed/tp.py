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

from ..model_config import ModelConfig


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
    experts: tuple[int, int] = (0, 0)  # a mixture of experts' experts this rank holds [start, end)
    # a hybrid's recurrent layers (model.recurrent): the key heads (Gated DeltaNet, each with its value heads) or
    # the channels (short convolutions) this rank holds [start, end)
    recurrent: tuple[int, int] = (0, 0)

    @classmethod
    def make(cls, cfg: ModelConfig, rank: int, size: int) -> TpPlan:
        """The plan, or ValueError naming the dimension that cannot be split ``size`` ways."""
        dims = [("attention heads", cfg.num_heads), ("intermediate (MLP) rows", cfg.intermediate_size),
                ("vocabulary entries", cfg.vocab_size)] + ([("experts", cfg.num_experts)] if cfg.num_experts else []) \
            + ([("recurrent layers' " + _recurrent_unit(cfg)[0], _recurrent_unit(cfg)[1])] if cfg.recurrent else [])
        for dim, value in dims:
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
                   even_range(cfg.vocab_size, size, rank), even_range(cfg.num_experts, size, rank),
                   even_range(_recurrent_unit(cfg)[1], size, rank) if cfg.recurrent else (0, 0))


def _recurrent_unit(cfg: ModelConfig) -> tuple[str, int]:
    """What a hybrid's recurrent layers split by: Gated DeltaNet's key heads, a short convolution's channels."""
    shape = cfg.recurrent
    assert shape is not None
    return ("key heads", shape.key_heads) if shape.kind == "gated_delta" else ("channels", cfg.hidden_size)


def head_rows(heads: tuple[int, ...], head_dim: int) -> torch.Tensor:
    """Row indices of ``heads`` in a [heads * head_dim, ...] projection."""
    return torch.cat([torch.arange(i * head_dim, (i + 1) * head_dim) for i in heads])


class TpComm:
    """The collectives a sharded model needs, with the time they take (for the benchmark).

    ``group``: the ranks of this engine, None for the default group (``--tp`` alone); a disaggregated engine's
    worker pools each form a sub-group of one world (engine.worker_pool). Ranks are the group's own, 0 leading.
    """

    def __init__(self, plan: TpPlan, cfg: ModelConfig, group=None) -> None:
        self.plan = plan
        self.vocab_size = vocab_size = cfg.vocab_size
        self.group = group
        # every rank's KV heads, to reassemble a request's KV (gather_kv)
        self.kv_heads_of = [TpPlan.make(cfg, r, plan.size).kv_heads for r in range(plan.size)]
        self.num_kv_heads = cfg.num_kv_heads
        self.slice_len = max(even_range(vocab_size, plan.size, r)[1] - even_range(vocab_size, plan.size, r)[0]
                             for r in range(plan.size))
        self.seconds = 0.0  # spent in collectives (all-reduce, all-gather), this rank's view
        self.calls = 0
        self.bytes = 0  # payload of this rank's collectives

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        y = x.float()
        dist.all_reduce(y, group=self.group)
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
        dist.all_gather(parts, padded, group=self.group)
        out = torch.cat([p[:, : b - a] for p, (a, b) in
                         zip(parts, (even_range(self.vocab_size, self.plan.size, r) for r in range(self.plan.size)))],
                        dim=1)
        self.seconds += time.perf_counter() - t0
        self.calls += 1
        self.bytes += padded.numel() * 4 * self.plan.size
        return out

    def gather_kv(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's KV of the same blocks, [layers, 2, its kv heads, blocks, block_size, dim], → on rank 0 the
        KV with every head of the model in order (a replicated head is taken from its first holder); None elsewhere.
        """
        most = max(len(h) for h in self.kv_heads_of)
        if local.shape[2] < most:  # uneven splits: pad so that every rank sends the same shape
            pad = local.new_zeros(*local.shape[:2], most - local.shape[2], *local.shape[3:])
            local = torch.cat([local, pad], dim=2)
        parts = [torch.empty_like(local) for _ in self.kv_heads_of] if self.plan.rank == 0 else None
        dist.gather(local.contiguous(), parts, group=self.group, group_dst=0)
        if parts is None:
            return None
        full = local.new_empty(*local.shape[:2], self.num_kv_heads, *local.shape[3:])
        seen = set()
        for part, heads in zip(parts, self.kv_heads_of):
            for j, h in enumerate(heads):
                if h not in seen:
                    seen.add(h)
                    full[:, :, h] = part[:, :, j]
        assert len(seen) == self.num_kv_heads, "the ranks' KV heads do not cover the model's"
        return full


def broadcast(obj, group=None):
    """Rank 0's ``obj`` on every rank of ``group`` (pickled: a step's SchedulerOutput, a command, None to stop)."""
    box = [obj]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]
