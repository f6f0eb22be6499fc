"""Shared building blocks: RMSNorm, rotary embeddings, and a linear layer whose rows never see each other."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model_config import RopeScaling
from .quant import Int4Weight, Int8RowWeight, Int8Weight
from .rope import cos_sin

# Rows of a matmul are computed in tiles of this many rows, each tile one GEMM of the same shape, so a row's
# result never depends on how many other rows share the batch (BLAS picks different kernels and reduction
# orders for different M; measured: a 1536-wide reduction differs in the last bits between M=64 and M=128).
BATCH_INVARIANT_TILE = 16


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension: torch's fused kernel (one op instead of seven; on fp32 it is bit-identical
    to ``weight * x * rsqrt(mean(x²) + eps)``, tested; on bf16 it accumulates in fp32 and rounds once)."""
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


def linear(
    x: torch.Tensor, weight: torch.Tensor | Int4Weight | Int8Weight | Int8RowWeight, bias: torch.Tensor | None,
    batch_invariant: bool
) -> torch.Tensor:
    """``x @ weight.T + bias``; with ``batch_invariant``, row tiles of fixed height, padded at the end.

    ::

        x rows:  [ 0 .. 15 ][ 16 .. 31 ][ 32 33 pad .. ]   each tile one [16, K] x [K, N] GEMM
    """
    quantized = not isinstance(weight, torch.Tensor)  # packed (model.quant): x @ w.T by weight.matmul
    if not batch_invariant:
        if quantized:
            out = weight.matmul(x)
            out = out if out.dtype == x.dtype else out.to(x.dtype)
            return out + bias if bias is not None else out
        return F.linear(x, weight, bias)
    tile = BATCH_INVARIANT_TILE
    m = x.shape[0]
    num_tiles = -(-m // tile)
    if num_tiles * tile != m:
        x = torch.cat([x, x.new_zeros(num_tiles * tile - m, x.shape[1])])
    out = x.new_empty(num_tiles * tile, weight.shape[0])
    for t in range(num_tiles):
        rows = slice(t * tile, (t + 1) * tile)
        if quantized:
            out[rows] = weight.matmul(x[rows])
        else:
            torch.mm(x[rows], weight.t(), out=out[rows])
    out = out[:m]
    if bias is not None:
        out = out + bias
    return out


class RotaryEmbedding:
    """Precomputed cos/sin tables (model.rope: the file's scaling applied); ``style`` "norm" rotates adjacent pairs
    (llama.cpp's llama layout), "neox" halves."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, style: str, device: str,
                 scaling: RopeScaling = RopeScaling(), rot_dim: int | None = None) -> None:
        """``rot_dim``: the leading dimensions of each head rotated (partial rotary, Phi-4-mini's 3/4); the rest
        pass through. None: all of them."""
        self.rot_dim = rot_dim or head_dim
        self.whole = self.rot_dim == head_dim
        self.cos, self.sin = cos_sin(self.rot_dim, theta, scaling, max_positions, device)  # [positions, rot_dim/2]
        self.style = style

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of each token's position, [tokens, 1, head_dim/2] fp32: looked up once per forward pass."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x`` [tokens, heads, head_dim] rotated with ``tables``' cos and sin (in ``x``'s dtype)."""
        if not self.whole:
            return torch.cat([self._rotate_all(x[..., : self.rot_dim], cos, sin), x[..., self.rot_dim :]], dim=-1)
        return self._rotate_all(x, cos, sin)

    def _rotate_all(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        if self.style == "neox":
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
