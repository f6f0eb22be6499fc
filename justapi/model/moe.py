"""Mixture-of-experts MLPs (qwen2moe, qwen3moe): a router picks each token's top-k experts; tokens are grouped by
expert (one sort per layer) and each expert with tokens runs one batched gate/up and down product, so the Python
loop is over experts, never over tokens. Qwen2-MoE adds a shared expert, every token's, scaled by a sigmoid gate.

Under tensor parallelism each rank holds a contiguous range of experts (``first_expert``): it computes its experts'
share of every token, rank 0 adds the shared expert, and the MLP's all-reduce sums the ranks' shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoeWeights:
    router: torch.Tensor  # [experts, hidden] fp32: every expert's, on every rank
    gate_up: torch.Tensor  # [local experts, 2 * expert ff, hidden]: gate rows, then up rows
    down: torch.Tensor  # [local experts, hidden, expert ff]
    first_expert: int  # the global id of gate_up[0]
    top_k: int
    norm_top_k: bool  # renormalize the top-k weights to sum to 1 (Qwen3-MoE) or not (Qwen2-MoE)
    shared_gate_up: torch.Tensor | None = None  # [2 * shared ff, hidden]
    shared_down: torch.Tensor | None = None  # [hidden, shared ff]
    shared_gate: torch.Tensor | None = None  # [hidden] fp32: the shared expert's sigmoid gate


def moe_mlp(h: torch.Tensor, w: MoeWeights, act) -> torch.Tensor:
    """The MLP output [tokens, hidden] (fp32) of rows ``h`` [tokens, hidden]; ``act`` is the gate's activation."""
    probs = torch.softmax(h.float() @ w.router.t(), dim=-1)  # [tokens, experts]
    weights, experts = probs.topk(w.top_k, dim=-1)
    if w.norm_top_k:
        weights = weights / weights.sum(-1, keepdim=True)
    out = torch.zeros(h.shape[0], h.shape[1], dtype=torch.float32, device=h.device)
    flat = experts.flatten()
    order = flat.argsort(stable=True)  # (token, slot) pairs grouped by expert
    counts = torch.bincount(flat, minlength=w.router.shape[0]).tolist()
    token_of = order // w.top_k
    pair_weight = weights.flatten()[order]
    start = 0
    for expert, count in enumerate(counts):
        local = expert - w.first_expert
        if count and 0 <= local < w.gate_up.shape[0]:
            rows = token_of[start : start + count]
            gate, up = (h[rows] @ w.gate_up[local].t()).chunk(2, dim=-1)
            y = (act(gate) * up) @ w.down[local].t()
            out.index_add_(0, rows, y.float() * pair_weight[start : start + count, None])
        start += count
    if w.shared_gate_up is not None:
        gate, up = (h @ w.shared_gate_up.t()).chunk(2, dim=-1)
        y = (act(gate) * up) @ w.shared_down.t()
        out += y.float() * torch.sigmoid(h.float() @ w.shared_gate)[:, None]
    return out

