"""RadixPrefixCache: a radix tree of token blocks mapping shared prompt prefixes to KV blocks in the pool.

Each edge holds a run of whole blocks (a multiple of ``block_size`` tokens) and the KV block ids that hold
them. The cache owns one reference on every block in the tree; requests that use a cached prefix add their
own. A node is *locked* while any running request uses the path through it; only unlocked leaves can be
evicted, least recently used first, and they are kept in a set so eviction never scans the whole tree::

    root ─ [The cat sat on | the mat.  ] ─ [ It purred.   ]     one block = block_size tokens
                           └ [a hat.     ]
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter

from .block_pool import BlockPool


class _Node:
    __slots__ = ("parent", "children", "token_ids", "block_ids", "lock_ref", "last_access", "uid", "hits")
    _uids = itertools.count()

    def __init__(self, parent: "_Node | None", token_ids: tuple[int, ...], block_ids: list[int]) -> None:
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}  # keyed by the child's first block of tokens
        self.token_ids = token_ids
        self.block_ids = block_ids
        self.lock_ref = 0
        self.last_access = 0
        self.uid = next(self._uids)
        self.hits = 0  # lookups that matched this node's blocks (the dashboard's shared prefixes)

    def __lt__(self, other: "_Node") -> bool:  # heap tie-break
        return self.uid < other.uid


class RadixPrefixCache:
    """Longest-prefix match, insert, lock/unlock and LRU eviction over block-aligned token prefixes."""

    def __init__(self, pool: BlockPool, block_size: int, on_evict=None) -> None:
        """``on_evict(block_ids)``: told of the blocks each eviction takes out of the tree."""
        self.pool = pool
        self.on_evict = on_evict
        self.block_size = block_size
        self.root = _Node(None, (), [])
        self.root.lock_ref = 1  # the root is never evicted
        self._evictable: set[_Node] = set()
        self._clock = itertools.count(1)
        self.num_blocks = 0  # blocks currently held by the tree
        self.num_locked_blocks = 0  # of those, on paths a request holds (the rest can be evicted)
        self.hits = 0  # prompt blocks found in the cache
        self.misses = 0  # prompt blocks looked up and not found

    # --- lookup -------------------------------------------------------------------------------------------
    def match(self, token_ids: list[int]) -> tuple[_Node, list[int]]:
        """The deepest node whose path is a prefix of ``token_ids`` (whole blocks only) and its block ids.

        Splits a node when the match ends inside it, so the returned node's path is exactly the match.
        Touches the matched path for LRU. Does not lock: call ``lock`` on the node to keep the blocks.
        """
        bs = self.block_size
        node, block_ids, pos = self.root, [], 0
        now = next(self._clock)
        while len(token_ids) - pos >= bs:
            child = node.children.get(tuple(token_ids[pos : pos + bs]))
            if child is None:
                break
            n = self._common_blocks(child.token_ids, token_ids, pos)
            if n < len(child.block_ids):
                child = self._split(child, n)
            child.last_access = now
            block_ids.extend(child.block_ids)
            pos += len(child.token_ids)
            node = child
        return node, block_ids

    def record_lookup(self, num_blocks_looked_up: int, num_blocks_hit: int) -> None:
        """Count one prompt lookup: hits and misses are per block."""
        self.hits += num_blocks_hit
        self.misses += num_blocks_looked_up - num_blocks_hit

    def count_hit(self, node: _Node) -> None:
        """A request starts from the prefix ending at ``node``: count it on every node of the path."""
        cur: _Node | None = node
        while cur is not None and cur is not self.root:
            cur.hits += 1
            cur = cur.parent

    @property
    def hit_ratio(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    # --- update -------------------------------------------------------------------------------------------
    def insert(self, token_ids: list[int], block_ids: list[int]) -> _Node:
        """Add the whole blocks of ``token_ids`` (KV in ``block_ids``) and return the node that ends them.

        Blocks already in the tree for the same tokens stay as they are (the caller keeps its own copies);
        new blocks gain a reference owned by the cache.
        """
        bs = self.block_size
        num_blocks = min(len(token_ids) // bs, len(block_ids))
        node, pos, now = self.root, 0, next(self._clock)
        while pos < num_blocks * bs:
            key = tuple(token_ids[pos : pos + bs])
            child = node.children.get(key)
            if child is None:
                new_tokens = tuple(token_ids[pos : num_blocks * bs])
                new_blocks = list(block_ids[pos // bs : num_blocks])
                child = _Node(node, new_tokens, new_blocks)
                self._evictable.discard(node)
                node.children[key] = child
                self.pool.incref(new_blocks)
                self.num_blocks += len(new_blocks)
                child.last_access = now
                self._update_evictable(child)
                return child
            n = self._common_blocks(child.token_ids, token_ids[: num_blocks * bs], pos)
            if n < len(child.block_ids):
                child = self._split(child, n)
            child.last_access = now
            pos += len(child.token_ids)
            node = child
        return node

    def lock(self, node: _Node) -> None:
        """Protect the path from ``node`` to the root from eviction (one more running request uses it)."""
        cur: _Node | None = node
        while cur is not None:
            cur.lock_ref += 1
            if cur.lock_ref == 1:
                self.num_locked_blocks += len(cur.block_ids)
            self._evictable.discard(cur)
            cur = cur.parent

    def unlock(self, node: _Node) -> None:
        """Undo one ``lock``; leaves nobody uses become evictable."""
        cur: _Node | None = node
        while cur is not None:
            assert cur.lock_ref > 0
            cur.lock_ref -= 1
            if cur.lock_ref == 0:
                self.num_locked_blocks -= len(cur.block_ids)
            self._update_evictable(cur)
            cur = cur.parent

    def evict(self, num_blocks: int) -> int:
        """Free at least ``num_blocks`` blocks if possible, least recently used unlocked leaves first."""
        heap = [(n.last_access, n) for n in self._evictable]
        heapq.heapify(heap)
        freed = 0
        while freed < num_blocks and heap:
            _, node = heapq.heappop(heap)
            if node not in self._evictable:
                continue
            parent = node.parent
            assert parent is not None  # the root is never evictable, every other node has a parent
            del parent.children[node.token_ids[: self.block_size]]
            self._evictable.discard(node)
            if self.on_evict is not None:
                self.on_evict(node.block_ids)
            self.pool.decref(node.block_ids)
            self.num_blocks -= len(node.block_ids)
            freed += sum(1 for b in node.block_ids if self.pool.ref_counts[b] == 0)
            self._update_evictable(parent)
            if parent in self._evictable:
                heapq.heappush(heap, (parent.last_access, parent))
        return freed

    # --- internals ----------------------------------------------------------------------------------------
    def _common_blocks(self, node_tokens: tuple[int, ...], token_ids: list[int], pos: int) -> int:
        bs = self.block_size
        n = 0
        while (n + 1) * bs <= len(node_tokens) and pos + (n + 1) * bs <= len(token_ids):
            if tuple(token_ids[pos + n * bs : pos + (n + 1) * bs]) != node_tokens[n * bs : (n + 1) * bs]:
                break
            n += 1
        return n

    def _split(self, node: _Node, num_blocks: int) -> _Node:
        """Cut ``node`` after ``num_blocks`` blocks; return the new upper part (same parent, same locks)."""
        assert 0 < num_blocks < len(node.block_ids)
        cut = num_blocks * self.block_size
        parent = node.parent
        assert parent is not None  # only a child (never the root) is split
        upper = _Node(parent, node.token_ids[:cut], node.block_ids[:num_blocks])
        upper.lock_ref = node.lock_ref
        upper.last_access = node.last_access
        upper.hits = node.hits
        parent.children[upper.token_ids[: self.block_size]] = upper
        node.token_ids = node.token_ids[cut:]
        node.block_ids = node.block_ids[num_blocks:]
        node.parent = upper
        upper.children[node.token_ids[: self.block_size]] = node
        return upper

    def _update_evictable(self, node: _Node) -> None:
        if node is not self.root and node.lock_ref == 0 and not node.children:
            self._evictable.add(node)
        else:
            self._evictable.discard(node)

    def shared_prefixes(self, limit: int) -> list[tuple[tuple[int, ...], int]]:
        """The ``limit`` prefixes that saved the most prompt tokens (length times requests): (token ids, requests
        that started from all of them). A prefix ends where fewer requests went on (its node's hits exceed each
        child's). Walks the tree: for the dashboard, about once a second."""
        found: list[tuple[tuple[int, ...], int]] = []
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self.root, ())]
        while stack:
            node, path = stack.pop()
            hit_children = [c for c in node.children.values() if c.hits]
            if node.hits > max((c.hits for c in hit_children), default=0):
                found.append((path, node.hits))
            stack.extend((c, path + c.token_ids) for c in hit_children)
        found.sort(key=lambda f: len(f[0]) * f[1], reverse=True)
        return found[:limit]

    def block_owners(self) -> Counter[int]:
        """One reference per block held by the tree (for the pool's integrity check)."""
        owners: Counter[int] = Counter()
        stack = [self.root]
        while stack:
            node = stack.pop()
            owners.update(node.block_ids)
            stack.extend(node.children.values())
        return owners

    def check_integrity(self, locks: Counter[_Node] | None = None) -> None:
        """Assert the tree's shape: block-aligned edges, keys, block counts, lock counts, the evictable set."""
        bs = self.block_size
        count = locked = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            count += len(node.block_ids)
            locked += len(node.block_ids) if node.lock_ref else 0
            if node is not self.root:
                assert len(node.token_ids) == len(node.block_ids) * bs > 0
                assert node.parent is not None and node.parent.children[node.token_ids[:bs]] is node
                child_locks = sum(c.lock_ref for c in node.children.values())
                own = locks.get(node, 0) if locks is not None else None
                if own is not None:
                    assert node.lock_ref == own + child_locks, "lock count disagrees with running requests"
                else:
                    assert node.lock_ref >= child_locks
                assert (node in self._evictable) == (node.lock_ref == 0 and not node.children)
            stack.extend(node.children.values())
        assert count == self.num_blocks, f"tree holds {count} blocks, counter says {self.num_blocks}"
        assert locked == self.num_locked_blocks, f"{locked} blocks locked, counter says {self.num_locked_blocks}"
