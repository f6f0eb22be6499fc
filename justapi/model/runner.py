"""The model runner: executes a SchedulerOutput on the model and samples. It keeps tensors, never decides.

It mirrors each scheduled request's token ids and block table (sent once, then as diffs), builds the flat batch
(input ids, positions, slot mapping, per-sequence spans), runs one forward pass and samples the rows of
sequences whose tokens are all computed after this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.outputs import RunnerOutput, SchedulerOutput
from ..sampling_params import SamplingParams
from .attention import AttentionMetadata, SeqSpan
from .llama import LlamaModel
from .sampler import SampleRow, sample, verify_drafts


@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    seed: int


KV_DTYPE = torch.float32  # the cache keeps full precision whatever the weights' dtype


def kv_bytes_per_block(model: LlamaModel, block_size: int) -> int:
    """Bytes of K and V that one block takes across all layers."""
    cfg = model.config
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * KV_DTYPE.itemsize


class ModelRunner:
    """Owns the KV cache tensors and the per-request mirror state; ``execute`` runs one step."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: str) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        shape = (cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
        # zero-filled: padded decode rows read unused slots, and 0 * garbage could be NaN
        self.kv_caches = [
            (torch.zeros(shape, dtype=KV_DTYPE, device=device), torch.zeros(shape, dtype=KV_DTYPE, device=device))
            for _ in range(cfg.num_layers)
        ]
        self.states: dict[str, _RequestState] = {}

    def _sync_states(self, sched: SchedulerOutput) -> dict[str, int]:
        for rid in sched.finished_request_ids:
            self.states.pop(rid, None)
        starts = {}
        for new in sched.new_requests:
            self.states[new.request_id] = _RequestState(
                list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.sampling_params, new.seed
            )
            starts[new.request_id] = new.num_computed_tokens
        for cached in sched.cached_requests:
            self.states[cached.request_id].block_ids.extend(cached.new_block_ids)
            starts[cached.request_id] = cached.num_computed_tokens
        return starts

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled tokens of every request and sample where a request caught up."""
        starts = self._sync_states(sched)
        if sched.empty:
            return RunnerOutput()
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        spans: list[SeqSpan] = []
        logits_rows: list[int] = []
        sample_ids: list[str] = []
        decode_spans: list[SeqSpan] = []
        spec: dict[str, list[int]] = {}  # request → its draft tokens, verified from logits rows after its last token
        for rid, n in sched.num_scheduled_tokens.items():
            st = self.states[rid]
            start = starts[rid]
            end = start + n
            row = len(input_ids)
            drafts = sched.spec_token_ids.get(rid)
            if drafts:
                input_ids.extend(st.token_ids[start:] + drafts)  # the last real token, then the drafts
            else:
                input_ids.extend(st.token_ids[start:end])
            positions.extend(range(start, end))
            blocks = st.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            num_blocks = -(-end // bs)
            span = SeqSpan(row, n, end, torch.tensor(blocks[:num_blocks], dtype=torch.long))
            spans.append(span)
            if n == 1:
                decode_spans.append(span)
            if drafts:
                logits_rows.extend(range(row, row + n))
                sample_ids.append(rid)
                spec[rid] = drafts
            elif end == len(st.token_ids):
                logits_rows.append(row + n - 1)
                sample_ids.append(rid)
        meta = AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device), seqs=spans)
        if decode_spans:
            self._add_decode_batch(meta, decode_spans)
        for span in spans:
            span.block_table = span.block_table.to(self.device)
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            meta,
            self.kv_caches,
            torch.tensor(logits_rows, dtype=torch.long, device=self.device),
        )
        return self._sample(logits, sample_ids, spec)

    def _add_decode_batch(self, meta: AttentionMetadata, spans: list[SeqSpan]) -> None:
        max_blocks = max(len(s.block_table) for s in spans)
        tables = torch.zeros(len(spans), max_blocks, dtype=torch.long)
        for i, s in enumerate(spans):
            tables[i, : len(s.block_table)] = s.block_table
        meta.decode_rows = torch.tensor([s.query_start for s in spans], dtype=torch.long, device=self.device)
        meta.decode_block_tables = tables.to(self.device)
        meta.decode_context_lens = torch.tensor([s.context_len for s in spans], dtype=torch.long, device=self.device)
        meta.decode_max_context = max(s.context_len for s in spans)

    def _sample(self, logits: torch.Tensor, sample_ids: list[str], spec: dict[str, list[int]]) -> RunnerOutput:
        out = RunnerOutput()
        plain_rows, plain_ids, plain_logits = [], [], []
        offset = 0
        for rid in sample_ids:
            st = self.states[rid]
            row = SampleRow(st.params, st.seed, st.token_ids[st.num_prompt_tokens :])
            drafts = spec.get(rid)
            if drafts:
                emitted = verify_drafts(logits[offset : offset + len(drafts) + 1], drafts, row)
                st.token_ids.extend(emitted)
                out.sampled_token_ids[rid] = emitted
                offset += len(drafts) + 1
            else:
                plain_rows.append(row)
                plain_ids.append(rid)
                plain_logits.append(offset)
                offset += 1
        if plain_rows:
            rows_logits = logits if len(plain_logits) == logits.shape[0] else logits[plain_logits]
            tokens, logprobs = sample(rows_logits, plain_rows)
            for rid, tok, lp in zip(plain_ids, tokens, logprobs):
                self.states[rid].token_ids.append(tok)
                out.sampled_token_ids[rid] = [tok]
                if lp is not None:
                    out.logprobs[rid] = [lp]
        return out
