"""The KV blocks of the requests a scheduler serves: the pool, the prefix cache, and what each request holds.

The scheduler decides who runs; this decides nothing, it only keeps the books (vLLM V1's KVCacheManager): a request
grows block by block, starts from the longest cached prefix, and gives back what it holds, whole blocks going into
the prefix cache so that a preempted or later request finds them again. Pure Python.
"""

from __future__ import annotations

import mmap
from collections import Counter
from collections.abc import Iterable

from ..request import Request
from .block_pool import BlockPool
from .kv_store import KvStore, chain_keys
from .outputs import SchedulerOutput
from .radix_cache import RadixPrefixCache, _Node
from .state_snapshots import StateSnapshots


class KvBlocks:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool, state_snapshots: int = 0,
                 store: KvStore | None = None) -> None:
        """``state_snapshots``: a hybrid model's snapshot slots (core.state_snapshots); its prefix cache then starts
        requests only where a snapshot is. ``store``: the prefix cache's disk tier (core.kv_store), attention KV
        only (never with snapshots)."""
        assert store is None or (prefix_cache and not state_snapshots)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.snapshots = StateSnapshots(state_snapshots) if prefix_cache and state_snapshots else None
        on_evict = self.snapshots.drop if self.snapshots is not None else None
        self.cache = RadixPrefixCache(self.pool, block_size, on_evict) if prefix_cache else None
        self.store = store
        self.disk_hits = 0  # of the cache's hits, blocks a first lookup found on disk (the rest: in memory)
        self._loads: dict[str, tuple[list[int], memoryview]] = {}  # a matched request's blocks to fill from disk
        self._spills: list[tuple[int, str, list[int]]] = []  # cached blocks to write to disk: (block, key, tokens)

    @property
    def num_cached_blocks(self) -> int:
        return self.cache.num_blocks if self.cache is not None else 0

    def occupancy(self) -> tuple[int, int, int]:
        """Blocks (held by requests, cached and evictable, free): they add up to the pool."""
        pool, cache = self.pool, self.cache
        evictable = cache.num_blocks - cache.num_locked_blocks if cache is not None else 0
        return pool.num_used - evictable, evictable, pool.num_free

    def grow(self, req: Request, num_tokens: int) -> list[int] | None:
        """Give ``req`` enough blocks for ``num_tokens`` tokens; the new block ids, or None if the pool is full
        even after evicting unlocked cached blocks."""
        need = -(-num_tokens // self.block_size) - len(req.block_ids)
        if need <= 0:
            return []
        if self.pool.num_free < need and self.cache is not None:
            self.cache.evict(need - self.pool.num_free)
        if self.pool.num_free < need:
            return None
        new = self.pool.allocate(need)
        req.block_ids.extend(new)
        return new

    def match_prefix(self, req: Request, chunk: int = 0) -> None:
        """Start ``req`` from the longest cached prefix of its tokens (always leaving one token to compute).
        ``chunk``: the prompt tokens its first step may take (the disk tier leaves their blocks free; 0: the step
        starts no prompt, and the disk is not read for one that would wait)."""
        assert req.num_computed_tokens == 0 and not req.block_ids
        if self.cache is None:
            return
        tokens = req.all_token_ids[: req.num_tokens - 1]
        node, block_ids = self.cache.match(tokens)
        if self.snapshots is not None:  # a hybrid starts where a snapshot is; it takes one at the whole match's end
            keep = self.snapshots.usable_blocks(block_ids)
            if keep < len(block_ids):
                req.snapshot_at = len(block_ids) * self.block_size
                node, block_ids = self.cache.match(tokens[: keep * self.block_size])
            req.state_load = self.snapshots.load(block_ids[-1]) if block_ids else None
        self.cache.lock(node)
        req.cache_node = node
        self.pool.incref(block_ids)
        req.block_ids = list(block_ids)
        req.num_computed_tokens = len(block_ids) * self.block_size
        if self.store is not None:
            self._match_disk(req, tokens, chunk)

    # --- the disk tier (core.kv_store) ------------------------------------------------------------------------
    def _match_disk(self, req: Request, tokens: list[int], chunk: int) -> None:
        """Continue ``req``'s match with the blocks the disk holds after the memory's, where reading beats
        computing them and the pool has room for them and the request's first chunk after them: their payloads go to
        the runner with the request's first step."""
        assert self.store is not None and self.cache is not None
        bs, first = self.block_size, len(req.block_ids)
        room = self.pool.num_free + self.cache.num_blocks - self.cache.num_locked_blocks
        last = len(tokens) // bs
        if last <= first or chunk <= 0 or not self.store.worth_reading(bs):
            return
        keys = chain_keys(self.store.fingerprint, tokens, bs, last)
        found = next((i for i in range(first, last) if not self.store.has(keys[i])), last) - first
        rest = req.num_tokens - (first + found) * bs  # to compute after them: their first chunk needs its blocks
        if found + -(-min(rest, chunk) // bs) > room:
            found = room - -(-chunk // bs)  # cut short: a whole chunk follows them
        if found <= 0:
            return
        size = self.store.block_bytes
        # one buffer for the run, its pages touched only by the reads (a bytearray would zero it first)
        run = memoryview(mmap.mmap(-1, found * size))
        loads = 0
        while loads < found and self.store.read(keys[first + loads], tokens[(first + loads) * bs :
                                                                             (first + loads + 1) * bs],
                                                run[loads * size : (loads + 1) * size]):
            loads += 1
        if loads and self.grow(req, (first + loads) * bs) is not None:
            self._loads[req.request_id] = (req.block_ids[first:], run[: loads * size])
            req.num_computed_tokens = len(req.block_ids) * bs

    def _record_spills(self, req: Request) -> None:
        """The blocks of ``req`` just inserted in the cache that the disk does not hold yet."""
        if self.store is None:
            return
        bs = self.block_size
        n = min(len(req.block_ids), req.num_computed_tokens // bs)
        keys = chain_keys(self.store.fingerprint, req.all_token_ids, bs, n)
        for i, key in enumerate(keys):
            if not self.store.has(key):
                self._spills.append((req.block_ids[i], key, req.all_token_ids[i * bs : (i + 1) * bs]))

    def take_spills(self) -> list[tuple[int, str, list[int]]]:
        """The blocks to write to disk since the last call, which hold their KV until the next step executes."""
        spills, self._spills = self._spills, []
        return spills

    # --- a hybrid's snapshots (core.state_snapshots) ----------------------------------------------------------
    def _snapshot_points(self, req: Request) -> tuple[int, ...]:
        """Where ``req``'s state is snapshotted: a matched prefix's end without one, its last whole block's end."""
        return req.snapshot_at, (req.num_tokens - 1) // self.block_size * self.block_size

    def chunk(self, req: Request, n: int) -> int:
        """``n`` prompt tokens of ``req`` this step, cut short at its next snapshot point (a hybrid's)."""
        if self.snapshots is None:
            return n
        start = req.num_computed_tokens
        return min([n] + [p - start for p in self._snapshot_points(req) if start < p < start + n])

    def step_copies(self, req: Request, n: int, out: SchedulerOutput) -> None:
        """What a step of ``n`` tokens of ``req`` copies besides computing: the blocks read from disk for it and the
        snapshot slots it reads before the step and writes after it."""
        if req.request_id in self._loads:
            ids, run = self._loads.pop(req.request_id)
            out.kv_loads.append((ids, run))
            assert self.store is not None  # only the disk tier's KvBlocks has loads
            self.store.loaded(len(ids), self.block_size)
        if self.snapshots is None:
            return
        if req.state_load is not None:
            out.state_loads[req.request_id] = req.state_load
            req.state_load = None
        end = req.num_computed_tokens + n
        if end > 0 and end in self._snapshot_points(req):
            slot = self.snapshots.save(req.request_id)
            if slot is not None:
                out.state_saves[req.request_id] = slot

    def state_saved(self, req: Request) -> None:
        """After the step: ``req``'s blocks up to its snapshot go to the cache, the snapshot keyed by the last."""
        if self.snapshots is not None and self.snapshots.pending(req.request_id):
            self.cache_computed(req)
            assert req.cache_node is not None and req.cache_node.block_ids  # a snapshot point ends a whole block
            self.snapshots.saved(req.request_id, req.cache_node.block_ids[-1])

    def record_lookup(self, req: Request) -> None:
        """Count a request's first admission in the cache's hit ratio (blocks found of blocks looked up)."""
        if self.cache is not None:
            lookup_blocks = (req.num_tokens - 1) // self.block_size
            self.cache.record_lookup(lookup_blocks, req.num_computed_tokens // self.block_size)
            if req.request_id in self._loads:
                self.disk_hits += len(self._loads[req.request_id][0])
            if req.cache_node is not None:
                self.cache.count_hit(req.cache_node)

    def unmatch(self, req: Request) -> None:
        """Undo ``match_prefix`` (or an imported prompt's blocks) for a request that stays in the queue: waiting
        requests hold nothing."""
        if req.cache_node is not None:
            assert self.cache is not None  # a request holds a radix node only when there is a prefix cache
            self.cache.unlock(req.cache_node)
            req.cache_node = None
        self.pool.decref(req.block_ids)
        req.block_ids = []
        req.num_computed_tokens = 0
        req.state_load, req.snapshot_at = None, 0
        self._loads.pop(req.request_id, None)

    def cache_computed(self, req: Request) -> None:
        """Insert the request's computed whole blocks into the prefix cache and hold the new path locked."""
        if self.cache is None:
            return
        node = self.cache.insert(req.all_token_ids[: req.num_computed_tokens], req.block_ids)
        self._record_spills(req)
        self.cache.lock(node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        req.cache_node = node

    def release(self, req: Request) -> None:
        """Give back everything ``req`` holds: its blocks (whole ones go to the prefix cache) and its lock."""
        pending = self._loads.pop(req.request_id, None)
        if pending is not None:  # admitted, never scheduled (static batching): its disk blocks were never filled
            req.num_computed_tokens = (len(req.block_ids) - len(pending[0])) * self.block_size
        if self.cache is not None:
            if req.num_computed_tokens >= self.block_size:
                self.cache_computed(req)
            if req.cache_node is not None:
                self.cache.unlock(req.cache_node)
        req.cache_node = None
        self.pool.decref(req.block_ids)
        req.block_ids = []
        if self.snapshots is not None:
            self.snapshots.forget(req.request_id)
        req.state_load, req.snapshot_at = None, 0

    def check_integrity(self, holders: Iterable[Request], waiting: Iterable[Request]) -> None:
        """Assert every block is free, cached or held by one of ``holders``, with matching reference counts and
        locks, and that no waiting request holds anything."""
        owners: Counter[int] = Counter()
        locks: Counter[_Node] = Counter()
        for req in holders:
            owners.update(req.block_ids)
            assert len(req.block_ids) * self.block_size >= req.num_computed_tokens
            if req.cache_node is not None:
                locks[req.cache_node] += 1
        for req in waiting:
            assert not req.block_ids and req.cache_node is None, "a waiting request holds blocks"
        if self.cache is not None:
            owners.update(self.cache.block_owners())
            self.cache.check_integrity(locks)
            if self.snapshots is not None:  # every snapshot keyed by a cached block
                self.snapshots.check_integrity(set(self.cache.block_owners()))
        self.pool.check_integrity(owners)
