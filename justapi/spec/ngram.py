"""Prompt-lookup proposer (``--spec-method ngram``): no draft model, the request's own tokens are the draft.

The latest ``n`` tokens are searched for earlier in the request (prompt and output), longest ``n`` first; the
tokens that followed the most recent earlier match are proposed::

    tokens:  ... the quick brown fox jumps over ... the quick brown | ?
             match of "the quick brown" ───────────┘ proposes "fox jumps over" (gamma = 3)

Text that copies from its context (rewrites, code edits, quotes, extraction) gets long accepted runs; other text
gets no proposal at all, so it costs nothing.
"""

from __future__ import annotations


def propose_ngram(tokens: list[int], gamma: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to ``gamma`` tokens continuing the latest earlier occurrence of the longest suffix n-gram, or []."""
    total = len(tokens)
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        suffix = tokens[total - n :]
        # scan backwards for the most recent earlier occurrence (not the suffix itself)
        for start in range(total - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                follow = tokens[start + n : start + n + gamma]
                if follow:
                    return follow
                break
    return []
