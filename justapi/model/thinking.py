"""A reasoning request that waits on its thinking (SamplingParams.think_tokens: a constraint after it, a thinking
budget): where its thinking ends in its output, and the next token forced while it thinks: its think-open token
first where the model opens its own thinking (Qwen3 opens every thought with it), its close token once the budget is
spent."""

from __future__ import annotations

import torch

from ..sampling_params import SamplingParams
from ..spec.tree import DraftTree


def after_thinking(params: SamplingParams, output: list[int]) -> tuple[bool, list[int]]:
    """(whether the request is still thinking, the tokens of ``output`` after its thinking): all of them where it
    does not wait on its thinking, those after the close token (none while it thinks). ``output``: its whole output,
    or the tokens a step emitted while it was still thinking."""
    if params.think_tokens is None:
        return False, output
    close = params.think_tokens[1]
    return (False, output[output.index(close) + 1:]) if close in output else (True, [])


def steer_tree(logits: torch.Tensor, params: SamplingParams, written: int, tree: DraftTree) -> tuple[int, ...]:
    """Steer, in place, the verification rows of a draft tree (row 0 the request's, row 1 + i after node i's path)
    of a request still thinking, each row by where its own path leaves the thinking; answer the nodes that close
    it, whose subtrees the request's grammar then masks."""
    close = params.think_tokens[1]
    thinking = []  # node i's path still thinking after it
    closes = []
    steer(logits, 0, params, written)
    for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
        before = parent < 0 or thinking[parent]
        thinking.append(before and token != close)
        if thinking[i]:
            steer(logits, i + 1, params, written + tree.depths[i])
        elif before:
            closes.append(i)
    return tuple(closes)


def steer(logits: torch.Tensor, row: int, params: SamplingParams, written: int) -> None:
    """Force row ``row``'s next token where a thinking request (``written`` output tokens so far) must open or close
    its thinking."""
    open_id, close_id = params.think_tokens
    budget = params.thinking_budget
    if written == 0 and open_id >= 0:
        _force(logits, row, open_id)
    elif budget is not None and written - (open_id >= 0) >= budget:
        _force(logits, row, close_id)


def _force(logits: torch.Tensor, row: int, token: int) -> None:
    """Row ``row`` of ``logits`` allows ``token`` only (its own logit kept, for its logprob)."""
    with torch.inference_mode():
        keep = logits[row, token].clone()
        logits[row].fill_(float("-inf"))
        logits[row, token] = keep
