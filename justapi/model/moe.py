"""Mixture-of-experts MLPs (qwen2moe, qwen3moe): a router picks each token's top-k experts; tokens are grouped by
expert (one sort per layer) and each expert with tokens runs one batched gate/up and down product, so the Python
loop is over experts, never over tokens. Qwen2-MoE adds a shared expert, every token's, scaled by a sigmoid gate.
Experts stay packed where the file's type allows (--dtype auto), each its own 4- or 8-bit weight.

Under tensor parallelism each rank holds a contiguous range of experts (``first_expert``): it computes its experts'
share of every token, rank 0 adds the shared expert, and the MLP's all-reduce sums the ranks' shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def _mm(x: torch.Tensor, w) -> torch.Tensor:
    """``x @ w.T`` for a dense [out, in] tensor or a packed weight (model.quant: its kernel routes)."""
    return x @ w.t() if isinstance(w, torch.Tensor) else w.matmul(x).to(x.dtype)


@dataclass
class MoeWeights:
    router: torch.Tensor  # [experts, hidden] fp32: every expert's, on every rank
    # this rank's experts, each [2 * expert ff, hidden] (gate rows, then up rows) and [hidden, expert ff]: dense
    # tensors (a stack's slices) or packed weights (model.quant), as the file stores them
    gate_up: list
    down: list
    first_expert: int  # the global id of gate_up[0]
    top_k: int
    norm_top_k: bool  # renormalize the top-k weights to sum to 1 (Qwen3-MoE) or not (Qwen2-MoE)
    shared_gate_up: object = None  # [2 * shared ff, hidden], dense or packed
    shared_down: object = None  # [hidden, shared ff]
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
        if count and 0 <= local < len(w.gate_up):
            rows = token_of[start : start + count]
            gate, up = _mm(h[rows], w.gate_up[local]).chunk(2, dim=-1)
            y = _mm(act(gate) * up, w.down[local])
            out.index_add_(0, rows, y.float() * pair_weight[start : start + count, None])
        start += count
    if w.shared_gate_up is not None:
        gate, up = _mm(h, w.shared_gate_up).chunk(2, dim=-1)
        y = _mm(act(gate) * up, w.shared_down)
        out += y.float() * torch.sigmoid(h.float() @ w.shared_gate)[:, None]
    return out

