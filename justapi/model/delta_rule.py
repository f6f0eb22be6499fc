"""The recurrences of hybrid models' linear layers, as pure functions over one sequence or a batch of single steps:
a causal depthwise convolution continued from its tail, and the gated delta rule (Gated DeltaNet: Qwen3.5,
Qwen3-Next), per token and in its chunked form.

The gated delta rule keeps, per value head, a state S [key_dim, value_dim]. Token t decays it, corrects what it
predicts for the token's key toward the token's value, and reads it with the query::

    S  <- exp(g_t) * S
    u_t = beta_t * (v_t - S^T k_t)           the correction (the "delta")
    S  <- S + k_t u_t^T
    o_t = S^T q_t

The chunked form computes the same over C tokens at once with matmuls (the WY/UT form of DeltaNet): within a chunk,
with G_i the cumulative log-decay up to token i and S_0 the state before it,

    (I + A) U = beta*V - beta*exp(G)*K S_0,   A_ij = beta_i exp(G_i - G_j) k_i.k_j   (j < i)
    o_i = exp(G_i) S_0^T q_i + sum_{j<=i} exp(G_i - G_j) (q_i.k_j) u_j
    S_C = exp(G_C) S_0 + sum_j exp(G_C - G_j) k_j u_j^T

so a prompt costs a triangular solve and a few matmuls per chunk instead of one small update per token. Both forms
take fp32 and give fp32; ``per_token`` is the one whose result does not depend on how a prompt is split into
chunks (``--batch-invariant``).
"""

from __future__ import annotations

import torch

CHUNK = 64  # tokens per chunk of the chunked scan (the form's matmuls are C x C)


def conv_continue(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal depthwise convolution over new inputs ``x`` [n, channels] continued from ``tail`` [channels, K-1],
    the inputs before them (zeros at a sequence's start); ``weight`` [channels, K]. Returns the outputs [n, channels]
    and the new tail. Each output sums its K products in one fixed order, whatever n is, so a prompt computed in
    chunks gives the same outputs as one computed whole."""
    k = weight.shape[1]
    padded = torch.cat([tail.t().to(x.dtype), x])  # [K-1+n, channels]
    n = x.shape[0]
    out = padded[0:n] * weight[:, 0]
    for j in range(1, k):
        out = out + padded[j : j + n] * weight[:, j]
    return out, padded[n:].t()


def conv_step(x: torch.Tensor, tails: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One new input per sequence: ``x`` [B, channels], ``tails`` [B, channels, K-1]. The outputs [B, channels] (the
    same sums, in the same order, as ``conv_continue``) and the new tails."""
    window = torch.cat([tails.to(x.dtype), x.unsqueeze(2)], dim=2)  # [B, channels, K]
    out = window[:, :, 0] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + window[:, :, j] * weight[:, j]
    return out, window[:, :, 1:]


def delta_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
               state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for each of B rows: ``q``, ``k`` [B, H, dk], ``v`` [B, H, dv], ``g``,
    ``beta`` [B, H], ``state`` [B, H, dk, dv] (not modified). Returns the outputs [B, H, dv] and the new states."""
    state = state * g.exp()[..., None, None]
    predicted = (state * k.unsqueeze(-1)).sum(-2)  # S^T k
    u = (v - predicted) * beta.unsqueeze(-1)
    state = state + k.unsqueeze(-1) * u.unsqueeze(-2)
    return (state * q.unsqueeze(-1)).sum(-2), state


def per_token(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over one sequence's n tokens, one at a time: ``q``, ``k`` [n, H, dk], ``v`` [n, H, dv], ``g``, ``beta``
    [n, H], ``state`` [H, dk, dv]. The outputs [n, H, dv] and the final state; every token's step is
    ``delta_step``'s, so the result is the same however the tokens were split."""
    out = v.new_empty(v.shape)
    s = state.unsqueeze(0)
    for t in range(q.shape[0]):
        o, s = delta_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], s)
        out[t] = o[0]
    return out, s[0]


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule over one sequence's n tokens in chunks of CHUNK (module docstring); same arguments and results as
    ``per_token``, equal within fp32 rounding."""
    n = q.shape[0]
    pad = -n % CHUNK
    # heads first, chunks next: [H, chunks, C, d]
    q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, pad)).transpose(0, 1).reshape(t.shape[1], -1, CHUNK,
                                                                                       t.shape[2]) for t in (q, k, v))
    g, beta = (torch.nn.functional.pad(t, (0, 0, 0, pad)).t().reshape(t.shape[1], -1, CHUNK) for t in (g, beta))
    cum = g.cumsum(-1)  # G_i within each chunk
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()  # exp(G_i - G_j), j<=i
    kb = k * beta.unsqueeze(-1)
    system = (kb @ k.transpose(-1, -2)) * decay  # A (its diagonal is ignored: the system is unit lower triangular)
    solve = lambda rhs: torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # noqa: E731
    values = solve(v * beta.unsqueeze(-1))  # U = T beta V  ...
    keys = solve(kb * cum.exp().unsqueeze(-1))  # ... - T (beta exp(G) K) S_0
    scores = (q @ k.transpose(-1, -2)) * decay  # exp(G_i - G_j) q_i.k_j, j <= i
    q_read = q * cum.exp().unsqueeze(-1)  # exp(G_i) q_i reads S_0
    k_write = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)  # exp(G_C - G_j) k_j writes S_C
    chunk_decay = cum[..., -1].exp()
    out = torch.empty_like(values)
    s = state
    for c in range(q.shape[1]):
        u = values[:, c] - keys[:, c] @ s
        out[:, c] = q_read[:, c] @ s + scores[:, c] @ u
        s = s * chunk_decay[:, c, None, None] + k_write[:, c].transpose(-1, -2) @ u
    return out.reshape(out.shape[0], -1, out.shape[-1])[:, :n].transpose(0, 1), s
