"""RoPE as a GGUF file states it: the rotary frequencies (the base, stretched linearly, by YaRN, or by per-frequency
factors: the ``rope_freqs`` tensor of Llama 3.x files, LongRoPE's short and long factors of Phi-3.5 and Phi-4-mini)
and the attention factor that scales cos and sin (YaRN's, LongRoPE's). Every route (the torch path, the C++
``rope_write_kv``, draft trees) reads the same cos/sin tables, built once per model here."""

from __future__ import annotations

import math

import torch

from ..model_config import RopeScaling

def inv_freq(head_dim: int, theta: float, scaling: RopeScaling, context: int) -> torch.Tensor:
    """The rotary frequencies, [head_dim / 2] fp32, as transformers computes them for the same scaling, for a model
    serving ``context`` tokens (LongRoPE's choice of factors: RopeScaling.divisors)."""
    base = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    divisors = scaling.divisors(context)
    if divisors is not None:
        factors = torch.tensor(divisors, dtype=torch.float32)
        if factors.numel() != base.numel():
            raise ValueError(f"the file's RoPE frequency factors hold {factors.numel()} values for "
                             f"{base.numel()} frequencies")
        base = base / factors
    if scaling.kind == "linear":
        return base / scaling.factor
    if scaling.kind == "yarn":
        return _yarn(base, head_dim, theta, scaling)
    return base


def attention_factor(scaling: RopeScaling) -> float:
    """What cos and sin are multiplied by: YaRN's 0.1 ln(factor) + 1 (times the file's attn_factor), LongRoPE's
    attn_factor (the file's), else 1."""
    if scaling.kind == "longrope":
        return scaling.attn_factor
    if scaling.kind != "yarn":
        return 1.0
    return scaling.attn_factor * (0.1 * math.log(scaling.factor) + 1.0 if scaling.factor > 1 else 1.0)


def _yarn(base: torch.Tensor, head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times within the original context are interpolated
    (divided by the factor), those turning more than ``beta_fast`` times kept, with a linear ramp between."""

    def dim_of(rotations: float) -> float:  # the frequency index that turns ``rotations`` times in the context
        return head_dim * math.log(s.original_context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = max(math.floor(dim_of(s.beta_fast)), 0)
    high = min(math.ceil(dim_of(s.beta_slow)), head_dim - 1)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / max(high - low, 0.001)).clamp(0, 1)
    kept = 1 - ramp  # 1 where the frequency is extrapolated (kept as it is)
    return base / s.factor * (1 - kept) + base * kept


def cos_sin(head_dim: int, theta: float, scaling: RopeScaling, max_positions: int, device: str):
    """The cos and sin tables, [max_positions, head_dim / 2] fp32, attention factor applied; ``max_positions`` is
    the context the model serves."""
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.int64).float(),
                        inv_freq(head_dim, theta, scaling, max_positions))
    scale = attention_factor(scaling)
    return (freqs.cos() * scale).to(device), (freqs.sin() * scale).to(device)
