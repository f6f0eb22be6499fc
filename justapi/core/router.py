"""Which engine takes a new request when several could: the one most likely to hold the prompt's prefix in its
radix cache, unless it is much busier than the least loaded one. One policy wherever JustAPI picks among engines:
the prefill pool of disaggregated serving, data-parallel replicas on one host (``--data-parallel``) and Ray Serve
replicas (``justapi.ray_replica``). Pure Python.

The router cannot see the engines' caches, so it keeps a shadow of each: the block-chain hashes of the prompts it
sent there, as many blocks as that engine's pool holds, the least recently sent forgotten first, a prompt's deepest
blocks before its first (the engines' radix caches evict least recently used leaves). A prompt's prefix hit on an
engine is the number of its leading full blocks in that shadow. Choice:

- ``prefix`` (default): among the engines with at most ``slack`` more requests in flight than the least loaded, the
  one with the longest prefix hit; ties (and no hit anywhere) go to the least loaded, then the first added.
- ``round-robin``: each engine in turn, whatever the prompt (the baseline a prefix-aware router is measured against).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import TypeVar

from ..config import DEFAULT_PREFIX_SLACK, ROUTER_POLICIES

E = TypeVar("E", bound=Hashable)  # an engine's key: the pick is one of the keys of ``loads``


class PrefixRouter:
    def __init__(self, policy: str = "prefix", slack: int = DEFAULT_PREFIX_SLACK, block_size: int = 16) -> None:
        if policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {', '.join(ROUTER_POLICIES)}, not {policy!r}")
        self.policy, self.slack, self.block_size = policy, slack, block_size
        self._shadows: dict[Hashable, OrderedDict[int, None]] = {}  # engine → block-chain hashes, least recent first
        self._capacity: dict[Hashable, int] = {}
        self._turn = 0

    def add(self, engine: Hashable, capacity_blocks: int) -> None:
        """An engine to route to, whose prefix cache holds up to ``capacity_blocks`` blocks."""
        self._shadows.setdefault(engine, OrderedDict())
        self._capacity[engine] = max(1, capacity_blocks)

    def remove(self, engine: Hashable) -> None:
        self._shadows.pop(engine, None)
        self._capacity.pop(engine, None)

    def engines(self) -> list[Hashable]:
        return list(self._shadows)

    def choose(self, prompt: Sequence[int], loads: Mapping[E, int]) -> E:
        """The engine for ``prompt`` among ``loads`` (engine → requests in flight there, not empty); it is
        remembered as holding the prompt from now on."""
        best = self.best(prompt, loads)
        self.remember(best, prompt)
        return best

    def best(self, prompt: Sequence[int], loads: Mapping[E, int]) -> E:
        """The engine ``choose`` would pick, remembering nothing (the caller calls ``remember`` where it went)."""
        order = {e: i for i, e in enumerate(self._shadows)}
        candidates = sorted(loads, key=lambda e: order.get(e, len(order)))
        if self.policy == "round-robin":
            best = candidates[self._turn % len(candidates)]
            self._turn += 1
        else:
            least = min(loads.values())
            best = max(candidates, key=lambda e: (self.prefix_blocks(e, prompt) if loads[e] <= least + self.slack
                                                  else -1, -loads[e], -order.get(e, len(order))))
        return best

    def prefix_blocks(self, engine: Hashable, prompt: Sequence[int]) -> int:
        """Leading full blocks of ``prompt`` the engine was last sent (as far as the shadow remembers)."""
        shadow: Mapping[int, None] = self._shadows.get(engine, {})
        hit = 0
        for h in block_chain(prompt, self.block_size):
            if h not in shadow:
                break
            hit += 1
        return hit

    def remember(self, engine: Hashable, prompt: Sequence[int]) -> None:
        if engine not in self._shadows:
            self.add(engine, self._capacity.get(engine, 1 << 16))
        shadow = self._shadows[engine]
        # the first block most recent: the deepest go first, as the radix cache evicts leaves before what they extend
        for h in reversed(list(block_chain(prompt, self.block_size))):
            shadow[h] = None
            shadow.move_to_end(h)
        while len(shadow) > self._capacity[engine]:
            shadow.popitem(last=False)


def block_chain(prompt: Sequence[int], block_size: int) -> Iterator[int]:
    """One hash per full block, each covering every block before it (as the radix cache keys blocks): two prompts
    share a block's hash exactly when they share everything up to its end (also the planner's, plan.cost_model)."""
    h = 0
    for i in range(len(prompt) // block_size):
        h = hash((h, tuple(prompt[i * block_size : (i + 1) * block_size])))
        yield h
