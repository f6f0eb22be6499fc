"""Statistical checks shared by the speculative-decoding tests: two samples against each other, and one sample against
the exact distributions it was drawn from (the model run by transformers, independently of the engine)."""

from __future__ import annotations

import functools


def assert_same_token_distribution(a, b, positions=(1, 2, 3), min_count=20, min_keys=5) -> None:
    """Two-sample chi-square, per output position, over the tokens of two lists of generation results.

    Tokens seen at least ``min_count`` times in both samples together are compared, against the 99.9% quantile.
    """
    from scipy.stats import chi2

    for pos in positions:
        ca, cb = {}, {}
        for r in a:
            ca[r.token_ids[pos]] = ca.get(r.token_ids[pos], 0) + 1
        for r in b:
            cb[r.token_ids[pos]] = cb.get(r.token_ids[pos], 0) + 1
        keys = [k for k in set(ca) | set(cb) if ca.get(k, 0) + cb.get(k, 0) >= min_count]
        stat = sum((ca.get(k, 0) - cb.get(k, 0)) ** 2 / (ca.get(k, 0) + cb.get(k, 0)) for k in keys)
        assert len(keys) >= min_keys and stat < chi2.ppf(0.999, len(keys) - 1), (pos, stat, len(keys))


@functools.lru_cache(maxsize=2)
def _reference_model(path: str):
    from hf_reference import hf_model

    return hf_model(path)


def model_next_token_logits(path: str, prompt: list[int], results, positions) -> dict:
    """The logits each sampled output position was drawn from, computed independently of the engine: transformers
    (fp32) runs the GGUF model in ``path`` on the prompt followed by each result's own earlier tokens. Returns
    {position: [len(results), vocab] float64}."""
    import torch

    model = _reference_model(path)
    last = max(positions)
    seqs = torch.tensor([list(prompt) + list(r.token_ids[:last]) for r in results])
    rows = torch.tensor([len(prompt) - 1 + k for k in positions])  # the logits row that predicts output position k
    out = []
    with torch.no_grad():
        for chunk in seqs.split(200):
            out.append(model(chunk).logits[:, rows].double())
    logits = torch.cat(out)
    return {k: logits[:, j] for j, k in enumerate(positions)}


def tempered(logits_by_pos: dict, temperature: float) -> dict:
    """{position: softmax(logits / temperature)}: what a request at that temperature, with no filter, draws from."""
    import torch

    return {k: torch.softmax(v / temperature, dim=-1) for k, v in logits_by_pos.items()}


def chi_square_against_model(results, pos: int, probs, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson statistic and degrees of freedom of the tokens at output position ``pos`` against their own
    distributions (``probs[i]`` is what result ``i`` drew from).

    A token's expected count is the sum of its probabilities over the draws; tokens expected fewer than
    ``min_expected`` times are pooled into one bin. With a different distribution per draw the statistic's mean is at
    most the degrees of freedom, so the chi-square quantile stays a valid (slightly conservative) threshold.
    """
    import torch

    observed = torch.zeros(probs.shape[1], dtype=torch.float64)
    for r in results:
        observed[r.token_ids[pos]] += 1
    expected = probs.sum(dim=0)
    big = expected >= min_expected
    obs_bins = torch.cat([observed[big], observed[~big].sum().reshape(1)])
    exp_bins = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    if exp_bins[-1] < min_expected:  # the pooled bin is too small to stand alone: fold it into the one before
        obs_bins[-2] += obs_bins[-1]
        exp_bins[-2] += exp_bins[-1]
        obs_bins, exp_bins = obs_bins[:-1], exp_bins[:-1]
    stat = float(((obs_bins - exp_bins) ** 2 / exp_bins).sum())
    return stat, len(exp_bins) - 1


def assert_follows_model(results, probs_by_pos: dict, min_bins: int = 5) -> None:
    """One-sample chi-square, per output position, against the distributions each draw came from ({position:
    [len(results), vocab]}, e.g. tempered(model_next_token_logits(...))), at the 99.9% quantile."""
    from scipy.stats import chi2

    for pos, probs in probs_by_pos.items():
        stat, df = chi_square_against_model(results, pos, probs)
        assert df + 1 >= min_bins and stat < chi2.ppf(0.999, df), (pos, stat, df)


def assert_rejects_model(results, probs_by_pos: dict) -> None:
    """The negative control of assert_follows_model: the draws score above the 99.9% quantile against ``probs``."""
    from scipy.stats import chi2

    for pos, probs in probs_by_pos.items():
        stat, df = chi_square_against_model(results, pos, probs)
        assert stat > chi2.ppf(0.999, df), (pos, stat, df)
