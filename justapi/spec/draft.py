"""Draft-model proposer (``--draft-model``): a small model with the target's vocabulary drafts chains or trees.

The draft keeps its own paged KV cache: the same block ids and slots as the target's (the scheduler reserves
them), in tensors shaped for the draft's layers and heads. It runs only for requests that speculate this step,
catching up lazily: its KV is valid for a request's first ``positions[rid]`` tokens, and a new, resumed or
prefix-cache-hit request starts at 0, so the draft never trusts KV it did not compute itself. One step::

    pass 0   the tokens it has not seen, up to the request's last token      → top-B children of the root
    pass d   the B^d nodes of level d, each seeing its ancestors (tree mask)  → top-B children of each
    (gamma passes; level gamma's nodes are never fed to the draft)

Drafts are the draft's top tokens, chosen deterministically, so verification treats each as a point mass
(spec.tree.spec_decode_tree): whatever the draft proposes, the output keeps the target's distribution. A poor draft
only costs speed.
"""

from __future__ import annotations

import torch

from ..model.gguf_loader import ModelLoadError, field_value
from ..model.llama import LlamaModel
from ..model.batch import FlatBatch
from ..model.runner import move_kv, new_kv_caches
from .tree import ROOT, DraftTree


class DraftProposer:
    """Builds a DraftTree per speculating request with a draft model over its own paged KV cache."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, device: str, branch: int) -> None:
        self.model = model
        self.block_size = block_size
        self.device = device
        self.branch = branch
        self.kv_caches = new_kv_caches(model, num_blocks, block_size, device)
        self.positions: dict[str, int] = {}  # request → tokens whose draft KV is valid

    def drop(self, request_id: str) -> None:
        self.positions.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: list[tuple[str, list[int], list[int], int, int]]) -> dict[str, DraftTree]:
        """Trees for (request id, token ids, block ids, start, depth): the last token is ``token_ids[start]``."""
        batch = FlatBatch(self.block_size, self.device)
        trees = {}
        for rid, tokens, blocks, start, _ in requests:
            first = min(self.positions.get(rid, 0), start)
            batch.add(tokens[first : start + 1], list(range(first, start + 1)), first, blocks, logits="last")
            self.positions[rid] = start + 1
            trees[rid] = DraftTree()
        logits, _ = batch.forward(self.model, self.kv_caches)
        frontier = {rid: [ROOT] for rid, *_ in requests}  # nodes whose children come from the latest logits
        self._expand(trees, frontier, logits, [rid for rid, *_ in requests])
        max_depth = max(depth for *_, depth in requests)
        for level in range(1, max_depth):
            batch = FlatBatch(self.block_size, self.device)
            order = []
            for rid, _, blocks, start, depth in requests:
                if level >= depth:
                    continue
                tree = trees[rid]
                nodes = frontier[rid]
                lo, hi = nodes[0], nodes[-1] + 1  # breadth first: a level is one contiguous run
                full = tree.attention_mask()[1 + lo : 1 + hi, 1 : 1 + hi]
                mask = None if bool(full.all()) else full.to(self.device)  # a chain sees everything: plain decode
                batch.add([tree.tokens[i] for i in nodes], [start + level] * len(nodes), start + 1 + lo, blocks,
                          mask, logits="all")
                order.append(rid)
            logits, _ = batch.forward(self.model, self.kv_caches)
            self._expand(trees, frontier, logits, order)
        return trees

    def _expand(self, trees, frontier, logits: torch.Tensor, order: list[str]) -> None:
        """Give each frontier node its top-``branch`` children from its logits row; they become the frontier."""
        top = torch.topk(logits, self.branch, dim=-1).indices.tolist()
        row = 0
        for rid in order:
            children = []
            for node in frontier[rid]:
                children.extend(trees[rid].add(tok, node) for tok in top[row])
                row += 1
            frontier[rid] = children

    def accepted(self, request_id: str, block_ids: list[int], start: int, tree: DraftTree, path: list[int]) -> None:
        """Keep the draft KV of accepted nodes the draft computed (all but the deepest level) at their positions."""
        fed = [i for i in path if tree.depths[i] < tree.depth]
        move_kv(self.kv_caches, block_ids, self.block_size,
                [(start + a, start + b) for a, b in tree.path_moves(fed)])
        self.positions[request_id] = start + 1 + len(fed)


def check_same_vocabulary(target_reader, target_path: str, draft_reader, draft_path: str) -> None:
    """Raise ModelLoadError naming both tokenizers unless the draft's vocabulary is exactly the target's."""

    def describe(reader, path):
        tokens = field_value(reader, "tokenizer.ggml.tokens") or []
        model = field_value(reader, "tokenizer.ggml.model")
        return model, tokens, f"{path} ({model} tokenizer, {len(tokens)} tokens)"

    t_model, t_tokens, t_desc = describe(target_reader, target_path)
    d_model, d_tokens, d_desc = describe(draft_reader, draft_path)
    if t_model == d_model and t_tokens == d_tokens:
        return
    first = next((i for i, (a, b) in enumerate(zip(t_tokens, d_tokens)) if a != b), min(len(t_tokens), len(d_tokens)))
    raise ModelLoadError(
        f"--draft-model {d_desc} does not share the target's vocabulary, {t_desc}; they first differ at token id "
        f"{first}. A draft model must use the same tokenizer as the target"
    )
