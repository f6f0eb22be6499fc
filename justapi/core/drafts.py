"""Speculative decoding as the scheduler sees it: which decoding requests draft this step and how many KV slots
their drafts take. Prompt lookup proposes its tokens here; with a draft model the runner builds the tree and the
scheduler only reserves its slots (``depth`` levels of ``branch`` children each). Either way a request's drafts are one
``Drafts`` value. Pure Python."""

from __future__ import annotations

from ..config import SchedulerConfig, tree_size
from ..request import Request
from ..spec.ngram import propose_ngram
from .kv_blocks import KvBlocks
from .outputs import CachedRequestData, Drafts, NewRequestData, SchedulerOutput


def draft_slots(req: Request, branch: int) -> int:
    """KV slots this step's drafts take after the request's last token: prompt-lookup tokens or a tree."""
    drafts = req.drafts
    if drafts is None:
        return 0
    return len(drafts.tokens) if drafts.tokens else tree_size(branch, drafts.depth)


def propose_drafts(running: list[Request], cfg: SchedulerConfig) -> None:
    """Drafts for every decoding request, unless the batch is too large for speculation to pay."""
    if cfg.spec_method is None:
        return  # no request ever holds drafts
    decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
    for req in running:
        req.drafts = None
    if len(decoding) > cfg.spec_max_batch:
        return
    for req in decoding:
        params = req.sampling_params
        if params.logprobs is not None or not params.speculative:
            continue  # logprobs are reported per sampled token: such requests decode one token a step
        # never draft past max_tokens (the target's own token comes on top) or the context length
        room = min(req.max_tokens - req.num_output_tokens - 1, cfg.max_model_len - req.num_tokens - 1)
        gamma = min(cfg.gamma, room)
        if gamma <= 0:
            continue
        if cfg.spec_method == "ngram":
            tokens = propose_ngram(req.all_token_ids, gamma)
            req.drafts = Drafts.chain(tokens) if tokens else None
        else:
            req.drafts = Drafts(gamma)


def add_draft_slots(out: SchedulerOutput, data: NewRequestData | CachedRequestData, req: Request, kv: KvBlocks,
                    branch: int) -> None:
    """Add a running decode's draft slots to the step (``data``: its entry in ``out``) if free or cached blocks
    allow: drafts never cost another request its blocks, nor a waiting request its admission order (they only ever
    use what is left); without the blocks the request decodes one token."""
    slots = draft_slots(req, branch)
    new_blocks = kv.grow(req, req.num_computed_tokens + 1 + slots)
    if new_blocks is None or req.drafts is None:
        req.drafts = None
        return
    rid = req.request_id
    out.num_scheduled_tokens[rid] += slots
    (data.block_ids if isinstance(data, NewRequestData) else data.new_block_ids).extend(new_blocks)
    out.drafts[rid] = req.drafts
