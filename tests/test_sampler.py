"""The sampler's filters on settings where they matter: top-k 5, top-p 0.9, min-p 0.1, and three at once.

Each setting draws 6,000 tokens from one fixed row of logits, every draw with its own (seed, position) key, and
compares the counts with the filtered distribution worked out here from the logits in float64, independently of
the sampler: tokens the filter removes must never appear, and the kept ones must follow the renormalised
probabilities (chi-square, 99.9% quantile). The logits are chosen so that every filter removes 8-16% of the mass
and no cut falls within 1% of a threshold, and the same draws against the temperature-1 distribution must fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from justapi import SamplingParams
from justapi.model.sampler import SampleRow, sample

# tempered at 0.8: 0.339 0.205 0.141 0.091 0.067 0.046 0.031 0.025 0.017 ..., in a shuffled order of token ids
SORTED_LOGITS = [3.1, 2.7, 2.4, 2.05, 1.8, 1.5, 1.2, 1.0, 0.7, 0.45, 0.2, -0.1, -0.4, -0.7, -1.0, -1.3]
ORDER = [11, 3, 14, 0, 7, 9, 1, 12, 5, 15, 2, 8, 13, 6, 10, 4]  # token id of the k-th most likely token
LOGITS = [0.0] * len(ORDER)
for rank, tok in enumerate(ORDER):
    LOGITS[tok] = SORTED_LOGITS[rank]
N = 6000


def filtered(temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> dict[int, float]:
    """The distribution the OpenAI/vLLM filters leave, in float64: temperature, then top-k, then top-p (the smallest
    set of most likely tokens whose mass reaches top_p), then min-p (tokens at least min_p times the most likely),
    renormalised."""
    z = [float(torch.tensor(x, dtype=torch.float32)) / temperature for x in LOGITS]
    keep = sorted(range(len(z)), key=lambda t: -z[t])
    if top_k:
        keep = keep[:top_k]
    m = max(z[t] for t in keep)
    total = sum(math.exp(z[t] - m) for t in keep)
    probs = {t: math.exp(z[t] - m) / total for t in keep}
    mass, nucleus = 0.0, {}
    for t in keep:  # most likely first
        if mass < top_p:
            nucleus[t] = probs[t]
        mass += probs[t]
    top = max(probs.values())
    kept = {t: p for t, p in nucleus.items() if p >= min_p * top}
    total = sum(kept.values())
    return {t: p / total for t, p in kept.items()}


def chi_square(counts: dict[int, int], expected: dict[int, float], n: int) -> float:
    if any(t not in expected for t in counts):
        return math.inf  # a token the distribution cannot draw
    return sum((counts.get(t, 0) - n * p) ** 2 / (n * p) for t, p in expected.items())


SETTINGS = {
    "top-k 5": dict(top_k=5),
    "top-p 0.9": dict(top_p=0.9),
    "min-p 0.1": dict(min_p=0.1),
    "top-k 8, top-p 0.95, min-p 0.1": dict(top_k=8, top_p=0.95, min_p=0.1),
}


@pytest.mark.parametrize("route", ["torch", "C++"])
@pytest.mark.parametrize("filters", SETTINGS.values(), ids=SETTINGS.keys())
def test_filters_sample_the_exact_renormalised_distribution(filters, route, cpp_kernels):
    from scipy.stats import chi2

    want = filtered(0.8, **filters)
    full = filtered(0.8)
    removed = 1 - sum(full[t] for t in want)
    assert len(want) >= 5 and removed > 0.07, (len(want), removed)  # the filter matters here
    if len(filters) == 3:  # each of the three removes something the others keep
        assert len(filtered(0.8, top_k=8)) > len(filtered(0.8, top_k=8, top_p=0.95)) > len(want)
    if route == "C++" and cpp_kernels is None:
        pytest.skip("no C++ kernels here")
    kernels = cpp_kernels if route == "C++" else None
    params = SamplingParams(temperature=0.8, **filters)
    logits = torch.tensor([LOGITS], dtype=torch.float32).expand(500, -1)
    counts: dict[int, int] = {}
    for start in range(0, N, 500):  # 500 rows a call, as a batch of 500 requests; positions 0-6
        rows = [SampleRow(params, 7919 * i + 13, [ORDER[0]] * (i % 7)) for i in range(start, start + 500)]
        for tok in sample(logits, rows, kernels)[0]:
            counts[tok] = counts.get(tok, 0) + 1
    outside = {t: c for t, c in counts.items() if t not in want}
    assert not outside, f"tokens the filter removes were drawn: {outside}"
    threshold = chi2.ppf(0.999, len(want) - 1)
    assert chi_square(counts, want, N) < threshold, (counts, want)
    # the draws tell temperature 0.8 from 1.0: a sampler that dropped the temperature would fail above
    assert chi_square(counts, filtered(1.0, **filters), N) > threshold


def test_the_kernel_draws_the_token_the_torch_steps_draw(cpp_kernels):
    """The C++ sample_rows against sampler.draw on the same rows and uniforms: the same token every time, over
    vocabularies of every tail length, logits with ties and -inf (a grammar's mask), each filter alone and together,
    a batch of rows at once; a row with nothing to draw is -1 (sample() then raises for that row)."""
    from justapi.model.sampler import draw

    if cpp_kernels is None or not hasattr(cpp_kernels, "sample_rows"):
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(0)
    settings = [dict(), dict(top_k=7), dict(top_p=0.9), dict(min_p=0.05), dict(top_k=40, top_p=0.95, min_p=0.02),
                dict(top_p=0.5), dict(top_k=1000), dict(top_p=0.999)]
    mismatches, draws = [], 0
    for vocab in (1, 5, 16, 17, 100, 4099, 50000):
        for temperature in (0.3, 0.8, 1.0, 1.7):
            logits = (torch.randn(len(settings), vocab, generator=g) * 3).round(decimals=1)  # ties
            logits[1, 1::3] = float("-inf")
            rows = [SamplingParams(temperature=temperature, **f) for f in settings]
            us = torch.rand(len(settings), generator=g, dtype=torch.float64).tolist()
            batch = torch.tensor([[p.temperature, p.top_k, p.top_p, p.min_p, u] for p, u in zip(rows, us)],
                                 dtype=torch.float64)
            got = cpp_kernels.sample_rows(logits, batch).tolist()
            for r, (p, u) in enumerate(zip(rows, us)):
                draws += 1
                want = draw(logits[r], p, u)
                if got[r] != want:
                    mismatches.append((vocab, temperature, settings[r], got[r], want))
    assert draws == 7 * 4 * len(settings) and not mismatches, mismatches
    dead = torch.full((2, 50), float("-inf"))
    dead[1, 3] = float("nan")
    one = torch.tensor([[1.0, 0, 1.0, 0, 0.5]] * 2, dtype=torch.float64)
    assert cpp_kernels.sample_rows(dead, one).tolist() == [-1, -1]
    with pytest.raises(ValueError, match="no token can be sampled"):
        draw(dead[0], SamplingParams(temperature=1.0), 0.5)


def test_a_draw_takes_the_token_whose_cumulative_weight_passes_u(cpp_kernels):
    """draw's inverse distribution, by hand: weights 1 : 3 : 4 at temperature 1 (logits log 1, log 3, log 4); u
    below 1/8 draws token 0, up to 1/2 token 1, the rest token 2; top-p 0.5 keeps token 2 alone (the mass before
    the next one, 4/8, is not under 0.5), top-k 2 tokens 1 and 2 (u scaled over 7)."""
    from justapi.model.sampler import draw

    logits = torch.tensor([0.0, math.log(3), math.log(4)])
    plain = SamplingParams(temperature=1.0)
    assert [draw(logits, plain, u) for u in (0.0, 0.12, 0.13, 0.49, 0.51, 0.999)] == [0, 0, 1, 1, 2, 2]
    assert {draw(logits, SamplingParams(temperature=1.0, top_p=0.5), u) for u in (0.0, 0.5, 0.99)} == {2}
    assert [draw(logits, SamplingParams(temperature=1.0, top_k=2), u) for u in (0.42, 0.44)] == [1, 2]
    if cpp_kernels is not None and hasattr(cpp_kernels, "sample_rows"):
        batch = torch.tensor([[1.0, 0, 1.0, 0, u] for u in (0.0, 0.12, 0.13, 0.49, 0.51, 0.999)], dtype=torch.float64)
        assert cpp_kernels.sample_rows(logits.expand(6, -1).contiguous(), batch).tolist() == [0, 0, 1, 1, 2, 2]


def test_the_kernel_rounds_its_weights_as_torch_does(cpp_kernels):
    """Weights at their rounding's edge: a min-p set exactly at torch's own weight of the second token keeps it, and
    a uniform near 1 then draws it; a weight rounded any other way (another exp) would drop it and draw token 0. A
    temperature past fp32's range over a -inf logit (NaN in fp32) leaves that token out on both paths."""
    from justapi.model.sampler import draw

    if cpp_kernels is None or not hasattr(cpp_kernels, "sample_rows"):
        pytest.skip("no C++ kernels here")
    g = torch.Generator().manual_seed(7)
    logits = torch.stack([torch.zeros(400), -5 * torch.rand(400, generator=g)], 1)
    weights = torch.exp((logits[:, 1] - 0.0) / 1.0)  # the second token's weight, as draw computes it
    settings = torch.tensor([[1.0, 0, 1.0, float(w), 0.999999999] for w in weights], dtype=torch.float64)
    want = [draw(row, SamplingParams(temperature=1.0, min_p=float(w)), 0.999999999) for row, w in zip(logits, weights)]
    assert want == [1] * 400
    assert cpp_kernels.sample_rows(logits.contiguous(), settings).tolist() == want
    masked = torch.tensor([[0.5, float("-inf"), 0.2, float("-inf")]])
    hot = SamplingParams(temperature=1e300)
    drawn = [draw(masked[0], hot, u) for u in (0.0, 0.49, 0.51, 0.99)]
    assert drawn == [0, 0, 2, 2]
    batch = torch.tensor([[1e300, 0, 1.0, 0.0, u] for u in (0.0, 0.49, 0.51, 0.99)], dtype=torch.float64)
    assert cpp_kernels.sample_rows(masked.expand(4, -1).contiguous(), batch).tolist() == drawn
