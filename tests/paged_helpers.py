"""Test helpers: run a model over a prompt through the paged path in chunks, with shuffled block tables."""

from __future__ import annotations

import torch

from justapi.model.attention import AttentionMetadata, SeqSpan
from justapi.model.state_cache import StateCache, layer_caches


def paged_prefill_logits(model, token_ids: list[int], block_size: int = 4, chunk: int = 5,
                         seed: int = 0) -> torch.Tensor:
    """Logits for every position of ``token_ids``, computed chunk by chunk through a shuffled block table."""
    cfg = model.config
    num_blocks = -(-len(token_ids) // block_size) + 3
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(num_blocks, generator=g)
    shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    dtype = model.kv_dtype  # as the engine's runner allocates it
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(model.kv_layers)]
    caches = layer_caches(model, kv, StateCache(model, 1, "cpu"))  # a hybrid's states in slot 0
    out = []
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        pos = torch.arange(start, end)
        slots = table[pos // block_size] * block_size + pos % block_size
        span = SeqSpan(0, end - start, end, table[: -(-end // block_size)], state_slot=0)
        meta = AttentionMetadata(slot_mapping=slots, seqs=[span], state_runs=torch.tensor([[0, end - start, 0,
                                                                                          int(start == 0)]]))
        out.append(model.forward(torch.tensor(token_ids[start:end]), pos, meta, caches, torch.arange(end - start)))
    return torch.cat(out)
