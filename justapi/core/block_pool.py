"""A pool of fixed-size KV blocks with reference counts; allocate and free are O(1)."""

from __future__ import annotations

from collections import Counter


class BlockPool:
    """Hands out block ids ``0 .. num_blocks-1``.

    Contract: a block is free exactly when its reference count is 0. ``allocate`` returns blocks with count 1
    (owned by the caller); ``incref`` adds an owner (a request sharing a cached block, or the prefix cache
    keeping one); ``decref`` drops one, and a block whose count reaches 0 goes back to the free stack.
    """

    def __init__(self, num_blocks: int) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 is handed out first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks (reference count 1 each); the caller checks ``num_free`` first."""
        assert num_blocks <= len(self._free), f"asked for {num_blocks} blocks, {len(self._free)} free"
        ids = [self._free.pop() for _ in range(num_blocks)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        """Add an owner to blocks that are already in use."""
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def decref(self, block_ids: list[int]) -> None:
        """Drop an owner; blocks nobody owns any more become free."""
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"decref of free block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self, owners: Counter) -> None:
        """Assert free + used = total, no block is free twice, and each count equals its owners in ``owners``."""
        assert len(set(self._free)) == len(self._free), "a block is on the free stack twice"
        free = set(self._free)
        for b in range(self.num_blocks):
            assert self.ref_counts[b] == owners.get(b, 0), (
                f"block {b}: ref count {self.ref_counts[b]} but {owners.get(b, 0)} owners"
            )
            assert (self.ref_counts[b] == 0) == (b in free), f"block {b}: free stack disagrees with its count"
        assert len(free) + sum(1 for c in self.ref_counts if c > 0) == self.num_blocks
