"""The model runner: executes a SchedulerOutput on the model and samples. It keeps tensors, never decides.

It mirrors each scheduled request's token ids and block table (sent once, then as diffs), builds the flat batch
(input ids, positions, slot mapping, per-sequence spans), runs one forward pass and samples the rows of
sequences whose tokens are all computed after this step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..core.outputs import RunnerOutput, SchedulerOutput
from ..spec.tree import ROOT, DraftTree, spec_decode_tree
from ..sampling_params import SamplingParams
from . import hugepages
from .batch import FlatBatch
from .encoder import EncoderModel
from .kernel_policy import kv_row_width
from .llama import LlamaModel
from .sampler import SampleRow, sample
from .state_cache import StateCache, layer_caches
from .thinking import after_thinking, steer, steer_tree

log = logging.getLogger("justapi.runner")

@dataclass
class _RequestState:
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    params: SamplingParams
    seed: int
    matcher: object = None  # structured.grammars.Matcher of a request with structured output
    thinking: bool = False  # a reasoning request (SamplingParams.think_tokens) whose thinking has not closed yet
    pooled: torch.Tensor | None = None  # an embedding request's pooled hidden states so far (mean: their sum)


def kv_bytes_per_block(model: LlamaModel | EncoderModel, block_size: int) -> int:
    """Bytes of K and V that one block takes across all layers (in the model's KV dtype); 0 for an encoder,
    which keeps none (its blocks only count tokens)."""
    return 2 * model.kv_layers * block_size * model.config.num_kv_heads * kv_row(model) * model.kv_dtype.itemsize


def kv_row(model: LlamaModel | EncoderModel) -> int:
    """Elements of one token's K (or V) row of one head in this model's cache (an int8 row: with its scale)."""
    return kv_row_width(model.config.head_dim, model.kv_dtype == torch.int8)


def new_kv_caches(model: LlamaModel | EncoderModel, num_blocks: int, block_size: int, device: str):
    """Per layer (K, V), each [num_kv_heads, num_blocks, block_size, row] (row: head_dim, or an int8 row's
    values and scales, kv_row); on huge pages where the model's
    weights are (decode attention reads scattered blocks: fewer TLB misses)."""
    cfg = model.config
    if not model.kv_layers:
        return []
    shape = (cfg.num_kv_heads, num_blocks, block_size, kv_row(model))
    # zero-filled: padded decode rows read unused slots, and 0 * garbage could be NaN
    if device == "cpu":  # untouched anonymous memory: zero without writing it (hugepages.untouched_zeros)
        flat = hugepages.zeros([shape] * (2 * model.kv_layers), model.kv_dtype, huge=model.huge_pages)
        hugepages.prefault(flat)  # the pool's memory in now, in the background: first writes while serving are slow
        return list(zip(flat[0::2], flat[1::2]))
    return [
        (torch.zeros(shape, dtype=model.kv_dtype, device=device),
         torch.zeros(shape, dtype=model.kv_dtype, device=device))
        for _ in range(model.kv_layers)
    ]


def move_kv(kv_caches, block_ids: list[int], block_size: int, moves: list[tuple[int, int]]) -> None:
    """Copy each (from, to) token position's K/V within a sequence's blocks, in every layer."""
    if not moves:
        return
    slot = lambda p: block_ids[p // block_size] * block_size + p % block_size  # noqa: E731
    device = kv_caches[0][0].device
    src = torch.tensor([slot(a) for a, _ in moves], dtype=torch.long, device=device)
    dst = torch.tensor([slot(b) for _, b in moves], dtype=torch.long, device=device)
    for k_cache, v_cache in kv_caches:
        for cache in (k_cache, v_cache):
            flat = cache.view(cache.shape[0], -1, cache.shape[-1])
            flat[:, dst] = flat[:, src]  # the gather copies first: sources are never overwritten early


class ModelRunner:
    """Owns the KV cache tensors and the per-request mirror state; ``execute`` runs one step.

    ``proposer``: a draft model (spec.draft.DraftProposer) that builds draft trees for the requests the scheduler
    gave speculative slots (``SchedulerOutput.drafts`` without tokens); prompt-lookup drafts arrive with theirs.
    ``grammars``: called once a request with structured output arrives, the process's structured.grammars.Grammars.
    """

    def __init__(self, model: LlamaModel | EncoderModel, num_blocks: int, block_size: int, device: str, proposer=None,
                 grammars=None, state_slots: int = 0, state_snapshots: int = 0) -> None:
        """``state_slots``: a hybrid model's state cache slots (model.state_cache), one per sequence it may run;
        ``state_snapshots``: those of its prefix cache."""
        self.model = model
        self.block_size = block_size
        self.device = device
        self.kv_caches = new_kv_caches(model, num_blocks, block_size, device)  # the attention layers'
        self.state_cache = StateCache(model, state_slots, device, state_snapshots) if state_slots else None
        self.layer_caches = layer_caches(model, self.kv_caches, self.state_cache)  # what each layer reads
        self.states: dict[str, _RequestState] = {}
        self.proposer = proposer
        self._grammars = grammars
        self._failed: dict[str, str] = {}  # this step's requests that failed alone (RunnerOutput.failed)

    def _sync_states(self, sched: SchedulerOutput) -> dict[str, int]:
        for rid in sched.finished_request_ids:
            self.states.pop(rid, None)
            if self.state_cache is not None:
                self.state_cache.release(rid)
            if self.proposer is not None:
                self.proposer.drop(rid)
        starts = {}
        for new in sched.new_requests:
            st = _RequestState(list(new.token_ids), new.num_prompt_tokens, list(new.block_ids), new.sampling_params,
                               new.seed)
            st.thinking, seen = after_thinking(st.params, st.token_ids[st.num_prompt_tokens :])
            if st.params.structured is not None:  # resumed or handed over: replay the output so far
                try:
                    st.matcher = self._grammars().matcher(st.params.structured, seen)
                except Exception as e:  # this request's grammar, not the step: it fails alone
                    self._failed[new.request_id] = _failure("its grammar", e)
            self.states[new.request_id] = st
            starts[new.request_id] = new.num_computed_tokens
            if new.kv_import is not None:  # disaggregation: the prompt's KV, and a hybrid's states, computed elsewhere
                kv, state = new.kv_import if isinstance(new.kv_import, tuple) else (new.kv_import, None)
                self.import_kv(new.block_ids, kv)
                if state is not None and self.state_cache is not None:
                    self.state_cache.import_(new.request_id, state)
            if self.proposer is not None:
                self.proposer.drop(new.request_id)  # a resumed request: its draft KV is recomputed
        for cached in sched.cached_requests:
            self.states[cached.request_id].block_ids.extend(cached.new_block_ids)
            starts[cached.request_id] = cached.num_computed_tokens
        if sched.kv_loads:
            self.load_blocks(sched.kv_loads)
        return starts

    def export_kv(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of ``block_ids`` in every layer, one tensor
        [layers, 2, kv_heads, len(block_ids), block_size, dim]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([torch.stack([k.index_select(1, idx), v.index_select(1, idx)]) for k, v in self.kv_caches])

    def import_kv(self, block_ids: list[int], kv: torch.Tensor) -> None:
        """Write ``kv`` (as ``EngineCore.export_kv`` makes it, possibly fewer blocks than ``block_ids``) into the
        first blocks."""
        n = kv.shape[3]
        idx = torch.tensor(block_ids[:n], dtype=torch.long, device=self.device)
        kv = kv.to(self.device, self.model.kv_dtype)
        tp = self.model.tp
        if tp is not None:  # ``kv`` has every KV head of the model; this rank keeps its own (engine.export_kv)
            kv = kv.index_select(2, torch.tensor(tp.kv_heads, dtype=torch.long, device=self.device))
        for layer, (k, v) in enumerate(self.kv_caches):
            k.index_copy_(1, idx, kv[layer, 0])
            v.index_copy_(1, idx, kv[layer, 1])

    def block_shape(self) -> tuple[int, ...]:
        """One block's K/V of every layer and every KV head of the model, as the disk tier keeps it."""
        model = self.model  # its config has this rank's heads under --tp; export_kv gathers all of them
        heads = model.comm.num_kv_heads if model.tp is not None else model.config.num_kv_heads
        return (model.kv_layers, 2, heads, self.block_size, kv_row(model))

    def load_blocks(self, runs: list[tuple[list[int], memoryview | bytearray]]) -> None:
        """Fill blocks from the disk tier's runs (block ids, their ``block_shape()`` payloads one after another)."""
        for block_ids, data in runs:
            kv = torch.frombuffer(data, dtype=self.model.kv_dtype).view(len(block_ids), *self.block_shape())
            self.import_kv(block_ids, kv.permute(1, 2, 3, 0, 4, 5))  # as export_kv gives it: no copy

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """Compute the scheduled tokens of every request and sample where a request caught up. A request whose own
        sampling, grammar or draft verification raises fails alone (``RunnerOutput.failed``); the others go on."""
        self._failed = {}
        starts = self._sync_states(sched)
        if sched.empty:
            return RunnerOutput(failed=self._failed)
        slot = (lambda rid: -1) if self.state_cache is None else self.state_cache.slot  # noqa: E731
        for rid, snapshot in sched.state_loads.items():  # a hybrid starting from a cached prefix
            self.state_cache.load(rid, snapshot)
        trees: dict[str, DraftTree] = {rid: DraftTree.chain(list(d.tokens)) for rid, d in sched.drafts.items()
                                       if d.tokens}
        proposed = [(rid, self.states[rid].token_ids, self.states[rid].block_ids, starts[rid], d.depth)
                    for rid, d in sched.drafts.items() if not d.tokens]
        if proposed and self.proposer is not None:
            trees.update(self.proposer.propose(proposed))
        batch = FlatBatch(self.block_size, self.device)
        sample_ids: list[str] = []
        pooled: list[tuple[str, int, bool]] = []  # embedding requests: hidden rows in the batch, prompt done
        for rid, n in sched.num_scheduled_tokens.items():
            st = self.states[rid]
            start = starts[rid]
            tree = trees.get(rid)
            if st.params.pooling is not None:  # prefill only: hidden states instead of logits
                end = start + n
                done = end == st.num_prompt_tokens
                rows = self._pooled_rows(st.params.pooling.kind, start, done)
                batch.add(st.token_ids[start:end], list(range(start, end)), start, st.block_ids, hidden=rows,
                          state_slot=slot(rid))
                pooled.append((rid, n if rows == "all" else int(rows is not None), done))
            elif tree:  # the last real token, then the draft nodes, each at its own slot
                mask = None if tree.is_chain else tree.attention_mask(self.device)
                batch.add([st.token_ids[start]] + tree.tokens, [start] + [start + d for d in tree.depths], start,
                          st.block_ids, mask, logits="all", state_slot=slot(rid),
                          parents=[-1] + [1 + p for p in tree.parents])
                sample_ids.append(rid)
            elif rid in sched.drafts:  # slots reserved for drafts the proposer did not make: one token
                batch.add(st.token_ids[start : start + 1], [start], start, st.block_ids, logits="last",
                          state_slot=slot(rid))
                sample_ids.append(rid)
            else:
                end = start + n
                done = end == len(st.token_ids)
                batch.add(st.token_ids[start:end], list(range(start, end)), start, st.block_ids,
                          logits="last" if done else None, state_slot=slot(rid))
                if done:
                    sample_ids.append(rid)
        logits, hidden = batch.forward(self.model, self.layer_caches)
        for rid, snapshot in sched.state_saves.items():  # a hybrid's prefix cache: the state after this chunk
            self.state_cache.save(rid, snapshot)
        out = self._sample(logits, sample_ids, trees, starts)
        if self.state_cache is not None:
            self.state_cache.drop_checkpoints()  # rejected drafts' states, and those of requests that failed
        self._pool(hidden, pooled, out)
        out.failed = self._failed
        return out

    def _pooled_rows(self, kind: str, start: int, done: bool) -> str | None:
        """Which of a pooling request's rows this chunk contributes: every one (mean), the prompt's first (cls; a
        BERT cross-encoder's rank) or its last (last; a decoder reranker's rank), or none."""
        if kind == "mean":
            return "all"
        first = kind == "cls" or (kind == "rank" and self.model.config.is_encoder)
        if first:
            return "first" if start == 0 else None
        return "last" if done else None

    def _pool(self, hidden: torch.Tensor | None, pooled: list[tuple[str, int, bool]], out: RunnerOutput) -> None:
        """Fold each embedding request's hidden rows into its pooled state; a request whose prompt is done gets its
        vector (Pooling: the mean or the last row, cut to ``dimensions``, L2-normalized; a reranker's score)."""
        offset = 0
        for rid, rows, done in pooled:
            st = self.states[rid]
            part = hidden[offset : offset + rows].sum(0, dtype=torch.float64) if rows else None
            offset += rows
            if part is not None:
                st.pooled = part if st.pooled is None else st.pooled + part
            if done:
                out.embeddings[rid] = self._pooled_vector(st)

    def _pooled_vector(self, st: _RequestState) -> list[float]:
        pooling = st.params.pooling
        if pooling.kind == "rank":  # a reranker's relevance score
            return [self.model.classifier.score(st.pooled.float())]
        vec = st.pooled / st.num_prompt_tokens if pooling.kind == "mean" else st.pooled
        vec = vec[: pooling.dimensions] if pooling.dimensions else vec
        if pooling.normalize:
            vec = vec / vec.norm().clamp_min(1e-12)
        return vec.float().tolist()

    def _sample(self, logits: torch.Tensor, sample_ids: list[str], trees: dict[str, DraftTree],
                starts: dict[str, int]) -> RunnerOutput:
        out = RunnerOutput()
        plain_rows, plain_ids, plain_logits = [], [], []
        offset = 0
        for rid in sample_ids:
            st = self.states[rid]
            row = SampleRow(st.params, st.seed, st.token_ids[st.num_prompt_tokens :],
                            st.token_ids[: st.num_prompt_tokens] if st.params.repetition_penalty != 1.0 else None)
            tree = trees.get(rid)
            if tree and rid not in self._failed:
                try:
                    out.sampled_token_ids[rid] = self._verify(logits[offset : offset + len(tree) + 1], rid, st, row,
                                                              tree, starts[rid])
                except Exception as e:
                    self._failed[rid] = _failure("verifying its drafts", e)
            if tree:
                offset += len(tree) + 1
            else:
                plain_rows.append(row)
                plain_ids.append(rid)
                plain_logits.append(offset)
                offset += 1
        if plain_rows:
            rows_logits = logits if len(plain_logits) == logits.shape[0] else logits[plain_logits]
            self._mask_by_grammar(rows_logits, plain_ids)
            for i, (tok, lp) in self._sample_rows(rows_logits, plain_rows, plain_ids).items():
                rid = plain_ids[i]
                st = self.states[rid]
                try:
                    if st.thinking:  # the grammar starts after the thinking's close token
                        st.thinking = tok != st.params.think_tokens[1]
                    elif st.matcher is not None:
                        st.matcher.advance([tok])
                except Exception as e:
                    self._failed[rid] = _failure("its grammar", e)
                    continue
                st.token_ids.append(tok)
                out.sampled_token_ids[rid] = [tok]
                if lp is not None:
                    out.logprobs[rid] = [lp]
        return out

    def _verify(self, rows_logits: torch.Tensor, rid: str, st: _RequestState, row: SampleRow, tree: DraftTree,
                start: int) -> list[int]:
        """One request's draft tree checked against its logits: the tokens it emits, its accepted path's KV moved."""
        tops = (ROOT,)  # where the grammar starts in the tree
        if st.thinking:
            tops = steer_tree(rows_logits, st.params, len(st.token_ids) - st.num_prompt_tokens, tree)
        if st.matcher is not None and tops:
            with torch.inference_mode():  # the forward pass's inference tensors, masked in place
                self._grammars().mask_tree(rows_logits, st.matcher, tree.parents, tree.tokens, self.model.kernels,
                                           tops)
        emitted, path = spec_decode_tree(rows_logits, tree, row)
        moves = [(start + a, start + b) for a, b in tree.path_moves(path)]
        move_kv(self.kv_caches, st.block_ids, self.block_size, moves)
        if self.state_cache is not None:  # a hybrid keeps the state after its last accepted row
            self.state_cache.keep(rid, 1 + path[-1] if path else 0)
        if self.proposer is not None and rid in self.proposer.positions:
            self.proposer.accepted(rid, st.block_ids, start, tree, path)
        answered = emitted
        if st.thinking:
            st.thinking, answered = after_thinking(st.params, emitted)
        if st.matcher is not None:
            st.matcher.advance(answered)
        st.token_ids.extend(emitted)
        return emitted

    def _sample_rows(self, logits: torch.Tensor, rows: list[SampleRow], ids: list[str]) -> dict[int, tuple]:
        """Row index -> (token, logprob) for every row that could be sampled. The batch is sampled at once; only if
        that raises is each row sampled alone (the same tokens: a row's randomness is its own), so one row's failure
        fails its request only. Rows already failed (their grammar) are left out."""
        live = [i for i, rid in enumerate(ids) if rid not in self._failed]
        if len(live) == len(rows):
            try:
                return dict(enumerate(zip(*sample(logits, rows, self.model.kernels))))
            except Exception:
                pass
        picked = {}
        for i in live:
            try:
                tokens, logprobs = sample(logits[i : i + 1], [rows[i]], self.model.kernels)
                picked[i] = (tokens[0], logprobs[0])
            except Exception as e:
                self._failed[ids[i]] = _failure("sampling", e)
        return picked

    def _mask_by_grammar(self, logits: torch.Tensor, ids: list[str]) -> None:
        """Rows of requests with structured output: only the tokens their grammar allows next keep a logit (a
        thinking request's: its forced token where model.thinking steers it). If the batch's masking raises, each
        row is masked alone and only the ones that raise fail."""
        rows = []
        for i, rid in enumerate(ids):
            st = self.states[rid]
            if st.thinking:
                steer(logits, i, st.params, len(st.token_ids) - st.num_prompt_tokens)
            elif st.matcher is not None and rid not in self._failed:
                rows.append(i)
        if not rows:
            return
        grammars = self._grammars()
        with torch.inference_mode():  # the logits are the forward pass's inference tensors
            try:
                grammars.mask(logits, rows, [self.states[ids[i]].matcher for i in rows], self.model.kernels)
                return
            except Exception:
                pass
            for i in rows:
                try:
                    grammars.mask(logits, [i], [self.states[ids[i]].matcher], self.model.kernels)
                except Exception as e:
                    self._failed[ids[i]] = _failure("its grammar", e)


def _failure(where: str, error: BaseException) -> str:
    """The message a request that failed alone ends with (the traceback goes to the log)."""
    log.exception("a request failed in %s", where, exc_info=error)
    return f"the request failed in {where}: {type(error).__name__}: {error}"
