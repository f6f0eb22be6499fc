"""Statistical checks shared by the speculative-decoding tests."""

from __future__ import annotations


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
