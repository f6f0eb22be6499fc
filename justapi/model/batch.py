"""One forward pass's flat batch: every scheduled sequence's tokens, positions and KV slots side by side, its
attention spans (decode rows gathered for the paged kernel), and which rows give logits or hidden states. Built by
the runner and the draft proposer alike."""

from __future__ import annotations

import torch

from .attention import AttentionMetadata, SeqSpan
from .llama import LlamaModel


class FlatBatch:
    """One forward pass's inputs, sequence by sequence: tokens, positions, KV slots, attention spans, logits rows."""

    def __init__(self, block_size: int, device: str) -> None:
        self.block_size = block_size
        self.device = device
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.spans: list[SeqSpan] = []
        self.tables: list[list[int]] = []  # each span's block ids (made tensors in forward, where needed)
        self.logits_rows: list[int] = []
        self.hidden_rows: list[int] = []  # rows whose final hidden states embeddings pool

    def add(self, token_ids: list[int], positions: list[int], first_slot: int, block_ids: list[int],
            mask: torch.Tensor | None = None, logits: str | None = None, hidden: str | None = None,
            state_slot: int = -1, parents: list[int] | None = None) -> None:
        """A sequence's new tokens, stored at slot positions ``first_slot ..``, seeing everything before them.

        ``logits``: "last" (the row after the last token), "all", "first", or None (no row: a prefill chunk
        mid-prompt);
        ``hidden`` the same for final hidden states (an embedding request's); ``state_slot``: the sequence's slot in a
        hybrid model's state cache; ``parents``: a draft verification's row parents (SeqSpan.parents).
        """
        bs = self.block_size
        n = len(token_ids)
        row = len(self.input_ids)
        end = first_slot + n
        self.input_ids.extend(token_ids)
        self.positions.extend(positions)
        self.slots.extend(block_ids[p // bs] * bs + p % bs for p in range(first_slot, end))
        self.tables.append(block_ids[: -(-end // bs)])
        self.spans.append(SeqSpan(row, n, end, None, mask, positions, state_slot=state_slot, parents=parents))
        for kind, rows in ((logits, self.logits_rows), (hidden, self.hidden_rows)):
            if kind == "last":
                rows.append(row + n - 1)
            elif kind == "first":
                rows.append(row)
            elif kind == "all":
                rows.extend(range(row, row + n))

    def forward(self, model: LlamaModel, caches: list) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the model; logits [len(logits_rows), vocab] and hidden states [len(hidden_rows), hidden] (fp32;
        None without hidden rows)."""
        dev = self.device
        meta = AttentionMetadata(slot_mapping=torch.tensor(self.slots, dtype=torch.long, device=dev), seqs=self.spans)
        decode = [i for i, s in enumerate(self.spans) if s.num_query_tokens == 1 and s.mask is None
                  and s.parents is None]
        if decode:
            _add_decode_batch(meta, [self.spans[i] for i in decode], [self.tables[i] for i in decode], dev)
        runs = [(s.query_start, s.num_query_tokens, s.state_slot, int(s.starts_sequence))
                for s in self.spans if s.state_slot >= 0 and s.parents is None]
        if runs:
            meta.state_runs = torch.tensor(runs, dtype=torch.long, device=dev)
        for span, table in zip(self.spans, self.tables):
            if not (span.num_query_tokens == 1 and span.mask is None):  # the decode batch reads its own tables
                span.block_table = torch.tensor(table, dtype=torch.long, device=dev)
        out = model.forward(
            torch.tensor(self.input_ids, dtype=torch.long, device=dev),
            torch.tensor(self.positions, dtype=torch.long, device=dev),
            meta,
            caches,
            torch.tensor(self.logits_rows, dtype=torch.long, device=dev),
            torch.tensor(self.hidden_rows, dtype=torch.long, device=dev) if self.hidden_rows else None,
        )
        return out if self.hidden_rows else (out, None)


def _add_decode_batch(meta: AttentionMetadata, spans: list[SeqSpan], tables: list[list[int]], device: str) -> None:
    """Sequences with one new token and no mask go as one padded batch (see attention._decode_attention); its
    tables are built as lists and made one tensor (not one per sequence)."""
    width = max(len(t) for t in tables)
    meta.decode_rows = torch.tensor([s.query_start for s in spans], dtype=torch.long, device=device)
    meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                                            device=device)
    meta.decode_context_lens = torch.tensor([s.context_len for s in spans], dtype=torch.long, device=device)
    meta.decode_max_context = max(s.context_len for s in spans)
    if spans[0].state_slot >= 0:
        meta.decode_state_slots = torch.tensor([s.state_slot for s in spans], dtype=torch.long, device=device)
