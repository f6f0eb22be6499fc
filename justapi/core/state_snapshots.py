"""A hybrid model's prefix cache: the recurrent states at the end of cached blocks.

An attention model's cached prefix is its KV blocks. A hybrid's recurrent layers also need their state at the end of
the prefix, which no block holds, so the scheduler snapshots a request's state when one of its prefill chunks ends on
a block boundary it chose: the end of the prompt's last whole block, and the end of a cached prefix that was found
without a snapshot (where the next request sharing it will start). A snapshot takes one of a fixed number of slots
(model.state_cache keeps them beside the running sequences') and is keyed by the cached block that ends there: while
that block is cached its tokens, and so the state after them, are fixed. A later request starts from its deepest
matched block that has a snapshot, the state copied from the slot. Slots are reused least recently used first; a
block leaving the cache takes its snapshot with it::

    request A:  [system prompt ...............][A's question]      snapshot at the end of A's last whole block
    request B:  [system prompt ...............][B's question]      matched up to the shared blocks, no snapshot
                                             ^ B's chunk ends here and snapshots: C starts from it
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    """Which cached block's end each snapshot slot holds, and the snapshots this step takes."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._slots: OrderedDict[int, int] = OrderedDict()  # block id -> slot, least recently used first
        self._free = list(range(capacity))[::-1]
        self._pending: dict[str, int] = {}  # request id -> the slot its state goes to after this step

    def __len__(self) -> int:
        return len(self._slots)

    def usable_blocks(self, block_ids: list[int]) -> int:
        """How many leading blocks of a match a request may start from: up to the deepest with a snapshot."""
        for i in range(len(block_ids), 0, -1):
            if block_ids[i - 1] in self._slots:
                return i
        return 0

    def load(self, block_id: int) -> int:
        """The slot holding the state after ``block_id`` (a block ``usable_blocks`` allowed), now most recent."""
        self._slots.move_to_end(block_id)
        return self._slots[block_id]

    def save(self, request_id: str) -> int | None:
        """A slot for ``request_id``'s state after this step (the least recently used snapshot's, if none is free);
        None when every slot is waiting for a step's save."""
        if self._free:
            slot = self._free.pop()
        elif self._slots:
            _, slot = self._slots.popitem(last=False)
        else:
            return None
        self._pending[request_id] = slot
        return slot

    def saved(self, request_id: str, block_id: int) -> None:
        """The step ran: ``request_id``'s snapshot is the state after ``block_id``, the cached block ending there
        (kept once: a block another request snapshotted meanwhile keeps its slot)."""
        slot = self._pending.pop(request_id)
        if block_id in self._slots:
            self._free.append(slot)
        else:
            self._slots[block_id] = slot

    def forget(self, request_id: str) -> None:
        """The request left before its step's save was keyed: the slot is free again."""
        slot = self._pending.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    def drop(self, block_ids: list[int]) -> None:
        """Blocks leaving the cache: their snapshots are free again."""
        for b in block_ids:
            slot = self._slots.pop(b, None)
            if slot is not None:
                self._free.append(slot)

    def pending(self, request_id: str) -> bool:
        return request_id in self._pending

    def check_integrity(self, cached_blocks: set[int]) -> None:
        slots = [*self._slots.values(), *self._pending.values(), *self._free]
        assert sorted(slots) == list(range(self.capacity)), "a snapshot slot is lost or held twice"
        assert set(self._slots) <= cached_blocks, "a snapshot of a block the cache no longer holds"
