"""Eviction policies (which evictable leaf goes first) and the lazy priority queue that applies them."""
from __future__ import annotations

import heapq
import itertools
from typing import Any, Iterator

from radix.node import TreeNode


class EvictionPolicy:
    """Orders evictable leaves: the leaf with the smallest `priority` is evicted first."""

    name = "base"

    def priority(self, node: TreeNode) -> Any:
        raise NotImplementedError


class LRUPolicy(EvictionPolicy):
    """Least recently used first (`last_access` is a logical clock bumped by every match and insert)."""

    name = "lru"

    def priority(self, node: TreeNode) -> Any:
        return node.last_access


class LFUPolicy(EvictionPolicy):
    """Least frequently matched first; ties go to the least recently used."""

    name = "lfu"

    def priority(self, node: TreeNode) -> Any:
        return (node.hit_count, node.last_access)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(policy: "str | EvictionPolicy") -> EvictionPolicy:
    if isinstance(policy, EvictionPolicy):
        return policy
    try:
        return POLICIES[policy]()
    except (KeyError, TypeError):
        raise ValueError(f"unknown eviction policy {policy!r}; choose one of {', '.join(POLICIES)}") from None


class EvictionQueue:
    """The set of evictable leaves plus a heap over them with lazy deletion.

    Eviction must not scan every leaf on every call (a trace replay evicts thousands of times), so a
    leaf is pushed whenever it becomes evictable or its priority changes; stale entries (older
    `heap_version`, or a node no longer an evictable leaf) are skipped when popped, and the heap is
    rebuilt when stale entries outnumber live ones.
    """

    def __init__(self, policy: EvictionPolicy):
        self.policy = policy
        self.leaves: set[TreeNode] = set()
        self._heap: list[tuple[Any, int, int, TreeNode]] = []
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self.leaves)

    def __contains__(self, node: TreeNode) -> bool:
        return node in self.leaves

    def __iter__(self) -> Iterator[TreeNode]:
        return iter(self.leaves)

    def add(self, node: TreeNode) -> None:
        """Mark `node` an evictable leaf (or re-queue it after its priority changed)."""
        self.leaves.add(node)
        node.heap_version += 1
        heapq.heappush(self._heap, (self.policy.priority(node), next(self._seq), node.heap_version, node))
        if len(self._heap) > 2 * len(self.leaves) + 64:
            self._rebuild()

    def discard(self, node: TreeNode) -> None:
        self.leaves.discard(node)

    def pop(self) -> TreeNode | None:
        """Remove and return the evictable leaf that goes first, or None when there is none."""
        heap = self._heap
        while heap:
            _, _, version, node = heapq.heappop(heap)
            if version == node.heap_version and node in self.leaves:
                self.leaves.remove(node)
                return node
        return None

    def _rebuild(self) -> None:
        self._heap = []
        for node in self.leaves:
            node.heap_version += 1
            self._heap.append((self.policy.priority(node), next(self._seq), node.heap_version, node))
        heapq.heapify(self._heap)
