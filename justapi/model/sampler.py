"""Turn a batch of logits into tokens, each row with its own sampling settings.

Randomness is drawn from a generator seeded by (request seed, output position), so a request's sampled text
depends only on its seed: not on what else is in the batch, nor on whether it was preempted and recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.outputs import Logprob
from ..sampling_params import SamplingParams

_MIX = 0x9E3779B97F4A7C15
MIN_LOGPROB = -9999.0  # reported for impossible tokens (-inf)


@dataclass
class SampleRow:
    """One row to sample: its settings, its seed, the tokens it has generated so far and, where its repetition
    penalty reads them, its prompt's."""

    params: SamplingParams
    seed: int
    output_token_ids: list[int]
    prompt_token_ids: list[int] | None = None


def row_generator(seed: int, position: int, device: str) -> torch.Generator:
    """The generator for output position ``position`` of a request seeded with ``seed``."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * _MIX + position * 0x632BE59BD9B4E019 + 1) % (1 << 63))
    return g


def adjust_logits(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    """A row's logits [vocab] before its distribution (never in place: logprobs report the model's own): EOS and
    stop token ids held back until min_tokens (unless nothing else is left: a grammar's end), the repetition
    penalty over prompt and output (vLLM's and transformers' rule), OpenAI's presence and frequency penalties over
    the output, and the logit bias."""
    p = row.params
    if not p.adjusts_logits:
        return logits
    dev = logits.device
    if len(row.output_token_ids) < p.min_tokens and p.min_tokens_stop_ids:
        held = logits.index_fill(0, torch.tensor(p.min_tokens_stop_ids, device=dev), float("-inf"))
        logits = held if bool(torch.isfinite(held).any()) else logits
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_token_ids or ()) | set(row.output_token_ids)), dtype=torch.long,
                            device=dev)
        if len(seen):
            vals = logits[seen]
            logits = logits.index_copy(0, seen, torch.where(vals > 0, vals / p.repetition_penalty,
                                                              vals * p.repetition_penalty))
    if (p.presence_penalty != 0 or p.frequency_penalty != 0) and row.output_token_ids:
        ids = torch.tensor(row.output_token_ids, device=dev)
        counts = torch.bincount(ids, minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits = logits - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(logits.dtype)
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=dev)
        logits = logits.index_add(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=dev))
    return logits


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: temperature, then top-k, top-p and min-p filters."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = cum - sorted_probs >= params.top_p  # keep the smallest prefix reaching top_p ...
        drop_sorted[0] = False  # ... the likeliest token at least (a top_p below fp32's least value rounds to 0)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def draw(logits: torch.Tensor, params: SamplingParams, u: float) -> int:
    """A token from ``logits`` [vocab] (fp32) under the temperature, top-k, top-p and min-p of ``params``: the
    first whose running sum of weights (in vocabulary order) passes ``u`` (uniform in [0, 1)) times their total.
    The weights are exp((logit - max) / temperature), zero where a filter drops the token; top-k keeps ties with the
    k-th logit, top-p the likeliest tokens (ties in vocabulary order) while the mass before them is under top_p,
    min-p those at least min_p times the likeliest's weight (which is 1). The C++ ``sample_rows`` takes the same
    steps in the same order and rounding (its weights by these same torch ops), token for token (tested), in a few
    passes over the row."""
    top = logits.max()
    if not bool(torch.isfinite(top)):
        raise ValueError("no token can be sampled: every logit is -inf, or one is NaN")
    # NaN only where a temperature past fp32's range meets a -inf logit (-inf / inf): that token stays out
    w = torch.exp((logits - top) / params.temperature).nan_to_num(0.0)
    if 0 < params.top_k < logits.shape[-1]:
        w = w.masked_fill(logits < torch.topk(logits, params.top_k).values[-1], 0.0)
    if params.top_p < 1.0:
        z = torch.cumsum(w.double(), 0)[-1]
        order = torch.sort(w, descending=True, stable=True).indices
        sorted_w = w[order].double()
        before = torch.cat([sorted_w.new_zeros(1), torch.cumsum(sorted_w, 0)[:-1]])  # the mass before each
        drop = before >= params.top_p * z
        drop[0] = False  # the likeliest token at least
        w = w.index_fill(0, order[drop], 0.0)
    if params.min_p > 0.0:
        w = w.masked_fill(w < params.min_p, 0.0)
    running = torch.cumsum(w.double(), 0)
    token = int(torch.searchsorted(running, u * running[-1], right=True))
    return token if token < len(w) else int(torch.nonzero(w)[-1])  # u * total rounded past the sum


def draw_rows(drawn: list[tuple[int, torch.Tensor, SamplingParams, float]], kernels) -> list[int]:
    """``draw`` for each (row, logits, params, u): all in one call of the C++ ``sample_rows`` on CPU, where the
    kernels are built with it."""
    if not drawn:
        return []
    if kernels is None or not hasattr(kernels, "sample_rows") or drawn[0][1].device.type != "cpu":
        return [draw(row_logits.float(), params, u) for _, row_logits, params, u in drawn]
    logits = drawn[0][1].unsqueeze(0) if len(drawn) == 1 else torch.stack([d[1] for d in drawn])
    vocab = logits.shape[-1]  # a top-k of the vocabulary or more (or none, <= 0) filters nothing
    settings = torch.tensor([[p.temperature, max(min(p.top_k, vocab), 0), p.top_p, p.min_p, u]
                             for _, _, p, u in drawn], dtype=torch.float64)
    tokens = kernels.sample_rows(logits.float(), settings).tolist()
    if -1 in tokens:
        raise ValueError("no token can be sampled: every logit is -inf, or one is NaN")
    return tokens


def sample(logits: torch.Tensor, rows: list[SampleRow], kernels=None) -> tuple[list[int], list[Logprob | None]]:
    """One token per row of ``logits`` [num_rows, vocab] (fp32), and logprobs where a row asked for them.
    ``kernels``: the engine's C++ kernels (justapi.kernels), whose ``argmax_rows`` makes the greedy pick on CPU."""
    tokens: list[int] = [0] * len(rows)
    greedy_rows = [i for i, r in enumerate(rows) if r.params.greedy and not r.params.adjusts_logits]
    if greedy_rows:
        every = len(greedy_rows) == len(rows)  # the common case: no copy of the [rows, vocab] logits
        greedy = logits if every else logits[greedy_rows]
        if kernels is not None and greedy.device.type == "cpu" and greedy.dtype == torch.float32:
            picked = kernels.argmax_rows(greedy).tolist()  # the same indices on all threads: 0.13x the time at 28 rows
        else:  # max(...).indices: the first maximum, as argmax, in 0.6x its time on CPU (measured at 8 and 32 rows)
            picked = greedy.max(dim=-1).indices.tolist()
        for i, t in zip(greedy_rows, picked):
            tokens[i] = t
    greedy_set = set(greedy_rows)
    drawn: list[tuple[int, torch.Tensor, SamplingParams, float]] = []
    for i, row in enumerate(rows):
        if i in greedy_set:
            continue
        row_logits = adjust_logits(logits[i], row)
        if row.params.greedy:
            tokens[i] = int(row_logits.argmax())
            continue
        g = row_generator(row.seed, len(row.output_token_ids), str(logits.device))
        drawn.append((i, row_logits, row.params, float(torch.rand((), generator=g, dtype=torch.float64,
                                                                    device=logits.device))))
    for (i, *_), token in zip(drawn, draw_rows(drawn, kernels)):
        tokens[i] = token
    logprobs: list[Logprob | None] = [None] * len(rows)
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want:
        # a token a grammar masked has logprob -inf, which JSON cannot carry: the floor vLLM reports instead
        lp = torch.log_softmax(logits[want], dim=-1).nan_to_num(nan=MIN_LOGPROB).clamp_min(MIN_LOGPROB)
        for j, i in enumerate(want):
            k = rows[i].params.logprobs
            top = []
            if k:
                vals, ids = torch.topk(lp[j], k)
                top = list(zip(ids.tolist(), vals.tolist()))
            logprobs[i] = Logprob(tokens[i], float(lp[j, tokens[i]]), top)
    return tokens, logprobs

