"""Draft trees (``spec_decode_tree``): many candidate continuations verified by the target in one pass.

A tree hangs off the request's last token (the root). ``--branch B`` and ``--gamma G`` give a full B-ary tree of
depth G: the draft's top-B tokens after the root, the top-B after each of those, and so on. A chain (``--branch 1``,
or prompt-lookup drafts) is the tree with one child per node. Nodes are flattened breadth first::

    root ─┬─ n0 ─┬─ n2            flat:  root n0 n1 n2 n3 n4 n5      depth:  0 1 1 2 2 2 2
          │      └─ n3            parents: n0, n1 → root; n2, n3 → n0; n4, n5 → n1
          └─ n1 ─┬─ n4
                 └─ n5

The target computes root + nodes in one pass: node i sits at position ``start + depth(i)`` (RoPE) but in KV slot
``start + 1 + i``, and sees the cached context, the root, its ancestors and itself (``attention_mask``). Then
``spec_decode_tree`` walks from the root, accepting at most one child per level, and the KV of the accepted path is
moved to its positional slots (``path_moves``).
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass, field

import torch

from ..model.sampler import SampleRow, adjust_logits, processed_probs, row_generator

ROOT = -1
_ACCEPT_STREAM = 0x5BD1E995  # a second random stream per (seed, position) for accept/reject draws


@dataclass
class DraftTree:
    """Draft tokens in breadth-first order with their parents (ROOT or an earlier node index) and depths (1-based)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    depths: list[int] = field(default_factory=list)

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), [ROOT] + list(range(len(tokens) - 1)), list(range(1, len(tokens) + 1)))

    def add(self, token: int, parent: int) -> int:
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
        return len(self.tokens) - 1

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def attention_mask(self, device="cpu") -> torch.Tensor:
        """[1 + n, 1 + n] bool over root + nodes: each row sees the root, its ancestors and itself."""
        n = len(self.tokens)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1, i + 1] = True
            if p != ROOT:
                mask[i + 1] |= mask[p + 1]
        return mask.to(device)

    def path_moves(self, path: list[int]) -> list[tuple[int, int]]:
        """(from, to) offsets after the root for the accepted ``path``: node i's KV at 1 + i goes to 1 + depth."""
        return [(1 + i, d) for d, i in enumerate(path, start=1) if 1 + i != d]


def spec_decode_tree(logits: torch.Tensor, tree: DraftTree, row: SampleRow) -> tuple[list[int], list[int]]:
    """Verify ``tree`` against the target's ``logits`` [1 + len(tree), vocab]: the tokens to emit and the accepted path.

    Row 0 holds the logits after the request's tokens; row 1 + i those after node i's path. The draft proposes
    each child deterministically (the draft's top tokens), so every candidate is a point mass, and the lossless
    rule for several distinct point-mass candidates c1, c2, ... at a node, with p the request's processed target
    distribution there, is::

        try c1: accept with probability p(c1)
        else remove c1 from p and renormalise, try c2 with its new probability, and so on
        all rejected: sample from what is left of p, emit it, stop      (greedy: emit argmax p; accept iff a child)
        a leaf reached with everything accepted: sample one more token from its row (the bonus token)

    Each emitted token is then distributed exactly as p: P(c1) = p(c1), P(c2) = (1 - p(c1)) · p(c2)/(1 - p(c1)), and
    the remainder keeps p's proportions. Penalties see the tokens emitted before; randomness is keyed by (seed,
    position) like ``sample``, so greedy output is exactly the non-speculative output.
    """
    emitted: list[int] = []
    path: list[int] = []
    base = list(row.output_token_ids)
    kids_of: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids_of.setdefault(p, []).append(i)
    node = ROOT
    while True:
        ctx = dataclasses.replace(row, output_token_ids=base + emitted)
        row_logits = adjust_logits(logits[node + 1], ctx)
        kids = kids_of.get(node, [])
        if row.params.greedy:
            target = int(row_logits.argmax())
            accepted = next((k for k in kids if tree.tokens[k] == target), None)
        else:
            target, accepted = _sampled_step(row_logits, row, kids, tree.tokens, len(ctx.output_token_ids),
                                             str(logits.device))
        if accepted is None:
            emitted.append(target)
            break
        emitted.append(tree.tokens[accepted])
        path.append(accepted)
        node = accepted
    return emitted, path


def _sampled_step(row_logits: torch.Tensor, row: SampleRow, kids: list[int], tokens: list[int], position: int,
                  device: str) -> tuple[int, int | None]:
    """One node of a sampled verification: (-1, the accepted child) where a child is accepted, else (the token
    sampled from what is left of the distribution, None)."""
    probs = processed_probs(row_logits, row.params)
    if kids:
        u = torch.rand(len(kids), generator=row_generator(row.seed ^ _ACCEPT_STREAM, position, device))
        for j, k in enumerate(kids):
            x = tokens[k]
            mass = float(probs.sum())
            if mass > 0 and float(u[j]) < float(probs[x]) / mass:
                return -1, k
            probs = probs.clone()
            probs[x] = 0.0
    if float(probs.sum()) <= 0:  # every candidate rejected yet no mass left: only floating-point rounding
        probs = processed_probs(row_logits, row.params)
    g = row_generator(row.seed, position, device)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=g)), None
