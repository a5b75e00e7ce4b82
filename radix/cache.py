"""`RadixCache`: the prefix index over KV blocks and the one owner of every block's state.

Every block id in `range(num_blocks)` is in exactly one state:
- free: on the free list;
- caller-owned ("in use"): handed out by `allocate`, not (yet) in the tree;
- in the tree: evictable when its node's `lock_ref` is 0, in use while a running request locks it.
A *pin* (`pin`/`unpin`) is a lock held for the prompt cache rather than a running request: the pinned
prefix is in use (never evicted) until the pin is released; its blocks are also counted as pinned.
"""
from __future__ import annotations

import itertools
from typing import NamedTuple, Sequence

import numpy as np

from radix.errors import OutOfBlocks, RadixError
from radix.events import BlockRecord, CacheListener
from radix.hashing import BlockHasher
from radix.node import TreeNode
from radix.policy import EvictionPolicy, EvictionQueue, make_policy
from radix.stats import CacheStats
from radix.tokens import TOKEN_DTYPE, TokenInput, as_token_array

FREE, CALLER, TREE = 0, 1, 2
# Children bucket of a node's tail blocks (see insert_tail). No chain hash is empty, so no full block is
# ever looked up under this key.
TAIL_KEY = b""
_STATE_NAMES = {FREE: "free", CALLER: "caller-owned", TREE: "in the tree"}


class MatchResult(NamedTuple):
    """The cached prefix of a prompt: its KV block ids, its length in tokens, and its last node."""

    block_ids: list[int]
    num_tokens: int
    node: TreeNode


class PartialMatch(NamedTuple):
    """A cached block whose first `num_tokens` tokens continue a matched chain as the prompt does."""

    node: TreeNode
    block_id: int
    num_tokens: int


class InsertResult(NamedTuple):
    """`node` ends the inserted chain; `duplicate_block_ids` stay caller-owned (free them)."""

    node: TreeNode
    duplicate_block_ids: list[int]
    inserted_block_ids: list[int]


def _as_namespace(namespace: bytes) -> bytes:
    if isinstance(namespace, bytes):
        return namespace
    if isinstance(namespace, (bytearray, memoryview)):
        return bytes(namespace)
    raise TypeError(f"namespace must be bytes, got {type(namespace).__name__}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


class RadixCache:
    """Radix tree of chained block hashes over a pool of `num_blocks` KV blocks.

    `identity` seeds every chain (the engine passes its model fingerprint, see radix.hashing).
    `listener` hears every block stored in and removed from the tree (radix.events): `insert`,
    `insert_tail` and `_release_evicted` send the events.
    `hash_bits` truncates every block hash to that many bits: TEST-ONLY, to force collisions.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        hash_algo: str = "xxh3_128",
        identity: bytes = b"",
        policy: "str | EvictionPolicy" = "lru",
        listener: CacheListener | None = None,
        hash_bits: int | None = None,
    ):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, (int, np.integer)) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative integer, got {num_blocks!r}")
        self.hasher = BlockHasher(block_size, hash_algo, identity, truncate_bits=hash_bits)
        self.block_size = self.hasher.block_size
        self.num_blocks = int(num_blocks)
        self.listener = listener
        self._block_bytes = self.hasher.block_bytes
        self._root = TreeNode(None, b"", [], [], b"")
        self._state = bytearray(self.num_blocks)  # FREE / CALLER / TREE per block id
        # Free blocks: ids returned to the pool (a stack), plus the never-used ids from `_fresh` up,
        # kept as a counter so that a huge pool (an unlimited trace replay) costs no list of ids.
        self._free: list[int] = []
        self._fresh = 0
        self._num_caller = 0
        self._num_evictable = 0  # tree blocks whose node has lock_ref 0
        self._num_locked = 0  # tree blocks whose node has lock_ref > 0
        self._num_pinned = 0  # of those, blocks whose node has pin_ref > 0
        self._num_tails = 0
        self._tail_tokens = 0  # tokens held by tails (their blocks are partly filled)
        self._queue = EvictionQueue(make_policy(policy))
        self._clock = 0
        self._query_tokens = 0
        self._hit_tokens = 0
        self._evicted_blocks = 0

    # ------------------------------------------------------------------ index

    @property
    def root(self) -> TreeNode:
        return self._root

    @property
    def policy(self) -> EvictionPolicy:
        return self._queue.policy

    def match(self, tokens: TokenInput, namespace: bytes = b"", record_stats: bool = True) -> MatchResult:
        """Longest cached prefix of `tokens` (full blocks only) under `namespace`.

        Every matched block's stored tokens are compared with the prompt's, so a hash collision can
        never return wrong KV. A node matched only in part is split so that `node` ends exactly at the
        match. Lock `node` before anything else can evict (before `allocate`). `record_stats=False`
        re-matches without counting the query, hits or LFU frequency again.
        """
        arr = as_token_array(tokens)
        namespace = _as_namespace(namespace)
        n_blocks = len(arr) // self.block_size
        data = arr[: n_blocks * self.block_size].tobytes()
        node, matched, block_ids, _ = self._walk(data, n_blocks, namespace, count_hit=record_stats)
        if node in self._queue:
            self._queue.add(node)  # its priority changed
        if record_stats:
            self._query_tokens += len(arr)
            self._hit_tokens += matched * self.block_size
        return MatchResult(block_ids, matched * self.block_size, node)

    def chain_starts(self, tokens: TokenInput, namespaces: Sequence[bytes]) -> list[int]:
        """Offsets of `tokens` where a chain filed under one of `namespaces` begins (its first block equals the
        block of tokens there), in order. One hash and one dict lookup per offset and namespace, with no
        token compare: a candidate to `match` at, not a match (the chunk index's search of a prompt)."""
        bs, hasher = self.block_size, self.hasher
        data, width = as_token_array(tokens).tobytes(), TOKEN_DTYPE.itemsize
        children = self._root.children
        roots = [(hasher.root(ns), _as_namespace(ns)) for ns in namespaces]
        found = []
        for pos in range(len(data) // width - bs + 1):
            block = data[pos * width:(pos + bs) * width]
            for parent, ns in roots:
                bucket = children.get(hasher.digest(parent + block))
                if bucket and any(child.namespace == ns for child in bucket):
                    found.append(pos)
                    break
        return found

    def insert(self, tokens: TokenInput, block_ids: Sequence[int], namespace: bytes = b"") -> InsertResult:
        """Add the full blocks of `tokens`, whose KV lies in `block_ids` (block i holds tokens[i*bs:(i+1)*bs]).

        Blocks whose chain position is already cached are left as they are: if the given id is the
        tree's own block there, nothing happens; otherwise the given block is a duplicate and stays
        caller-owned. The remaining (new) blocks must be caller-owned; they become the tree's
        (evictable until locked). Ids beyond the full blocks are ignored and stay caller-owned.
        """
        arr = as_token_array(tokens)
        namespace = _as_namespace(namespace)
        n_blocks = len(arr) // self.block_size
        if len(block_ids) < n_blocks:
            raise ValueError(f"insert got {len(block_ids)} block ids for {n_blocks} full blocks")
        given = [int(b) for b in block_ids[:n_blocks]]
        for block in (min(given), max(given)) if given else ():
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block id {block} out of range [0, {self.num_blocks})")
        if len(set(given)) != n_blocks:
            raise ValueError("insert got the same block id twice")
        data = arr[: n_blocks * self.block_size].tobytes()
        node, matched, tree_ids, parent_hash = self._walk(data, n_blocks, namespace, count_hit=False)
        if node in self._queue:
            self._queue.add(node)  # its priority changed

        state = self._state
        duplicates = []
        for position in range(matched):
            block = given[position]
            if block != tree_ids[position]:
                self._require_caller_owned(block, position)
                duplicates.append(block)
        new_ids = given[matched:]
        for position, block in enumerate(new_ids, matched):
            self._require_caller_owned(block, position)

        if not new_ids:
            return InsertResult(node, duplicates, [])
        hashes = self.hasher.chain_bytes(parent_hash, data, matched, n_blocks)
        child = TreeNode(node, data[matched * self._block_bytes:], list(new_ids), hashes, namespace)
        if self.listener is not None:
            self.listener.stored(self._records(child, parent_hash, 0))
        child.last_access = self._clock
        self._queue.discard(node)  # no longer a leaf
        node.add_child(child)
        for block in new_ids:
            state[block] = TREE
        self._num_caller -= len(new_ids)
        self._num_evictable += len(new_ids)
        self._queue.add(child)
        return InsertResult(child, duplicates, list(new_ids))

    def insert_tail(self, node: TreeNode, tokens: TokenInput, block_id: int) -> TreeNode | None:
        """File caller-owned `block_id`, whose first slots hold the KV of `tokens` (1 to block_size - 1
        tokens continuing `node`'s chain), as a tail of `node`.

        Only full blocks are hashed and shared as chain links; a tail lets a later prompt that continues
        the chain with some of these tokens copy their KV instead of recomputing them (`match_partial`: a
        follow-up turn whose shared text ends inside the previous turn's last block). Tails are leaves:
        evictable while unlocked, in policy order.
        Returns the tail's node, or None when a cached tail or child block already starts with these tokens
        (the block then stays caller-owned). Unlocked tails that the new one extends are evicted.
        """
        self._path(node)  # must be in this tree
        if node is self._root:
            raise ValueError("a tail continues a chain of at least one full block")
        data = as_token_array(tokens).tobytes()
        if not 0 < len(data) < self._block_bytes:
            raise ValueError(f"a tail holds 1 to {self.block_size - 1} tokens, got {len(data) // TOKEN_DTYPE.itemsize}")
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} out of range [0, {self.num_blocks})")
        self._require_caller_owned(block_id, 0)
        same_start = node.by_first_token.get(data[:TOKEN_DTYPE.itemsize], [])
        if any(child.tokens.startswith(data) for child in same_start):
            return None  # a tail or a full child block already holds these tokens' KV
        for tail in [t for t in same_start if t.key == TAIL_KEY and data.startswith(t.tokens) and t.lock_ref == 0]:
            self._drop_leaf(tail)
        self._clock += 1
        child = TreeNode(node, data, [block_id], [TAIL_KEY], node.namespace)
        child.last_access = self._clock
        self._queue.discard(node)  # no longer a leaf
        node.add_child(child)
        self._state[block_id] = TREE
        self._num_caller -= 1
        self._num_evictable += 1
        self._num_tails += 1
        self._tail_tokens += len(data) // TOKEN_DTYPE.itemsize
        self._queue.add(child)
        if self.listener is not None:
            self.listener.stored(self._records(child, node.hashes[-1], 0))
        return child

    def match_partial(self, node: TreeNode, tokens: TokenInput, namespace: bytes = b"") -> PartialMatch | None:
        """The block right after `node`'s chain that shares the most leading tokens with `tokens` (what
        follows the chain in the prompt, where `match` stopped): a tail of `node` or the first block of one
        of its children. None when none shares even the first token.

        Those shared tokens' KV is exactly the prompt's (same chain, same tokens, causal attention), so a
        prompt that diverges inside a block needs to compute only from the divergence on. The caller writes
        after the shared tokens, so it copies the block: lock the returned node until the copy is done.
        """
        arr = as_token_array(tokens)[: self.block_size - 1]
        if not len(arr):
            return None
        data, item = arr.tobytes(), TOKEN_DTYPE.itemsize
        namespace = _as_namespace(namespace)
        best, best_n = None, 0
        for child in node.by_first_token.get(data[:item], ()):
            if node is self._root and child.namespace != namespace:
                continue
            stored = child.tokens[: self._block_bytes]
            if stored.startswith(data):
                shared = len(arr)
            else:
                n = min(len(stored), len(data)) // item
                a = np.frombuffer(stored, TOKEN_DTYPE, count=n)
                differ = np.flatnonzero(a != arr[:n])
                shared = int(differ[0]) if differ.size else n
            if shared > best_n:
                best, best_n = child, shared
        if best is None:
            return None
        self._clock += 1
        best.last_access = self._clock
        if best in self._queue:
            self._queue.add(best)  # its priority changed
        return PartialMatch(best, best.block_ids[0], best_n)

    def lock(self, node: TreeNode) -> None:
        """Mark the path from `node` up to the root as used by one more running request."""
        path = self._path(node)
        for n in path:
            if n.lock_ref == 0:
                self._num_evictable -= n.num_blocks
                self._num_locked += n.num_blocks
                self._queue.discard(n)
            n.lock_ref += 1

    def unlock(self, node: TreeNode) -> None:
        """Undo one `lock(node)`; blocks whose lock count drops to 0 become evictable."""
        path = self._path(node)
        for n in path:
            if n.lock_ref <= 0:
                raise RadixError("unlock of a node that is not locked (more unlocks than locks)")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_evictable += n.num_blocks
                self._num_locked -= n.num_blocks
                if not n.children:
                    self._queue.add(n)

    def pin(self, node: TreeNode) -> None:
        """Keep the prefix ending at `node` in the tree until `unpin(node)`: a lock that no running request
        holds (the prompt cache's breakpoints, kv/pins.py), its blocks counted as pinned."""
        self.lock(node)
        for n in self._path(node):
            if n.pin_ref == 0:
                self._num_pinned += n.num_blocks
            n.pin_ref += 1

    def unpin(self, node: TreeNode) -> None:
        """Undo one `pin(node)`: its blocks are ordinary cache again once nothing else locks them."""
        path = self._path(node)
        if any(n.pin_ref <= 0 for n in path):
            raise RadixError("unpin of a node that is not pinned (more unpins than pins)")
        for n in path:
            n.pin_ref -= 1
            if n.pin_ref == 0:
                self._num_pinned -= n.num_blocks
        self.unlock(node)

    # ------------------------------------------------------------- accounting

    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks for the caller: free ones first, then evicted ones. All or nothing."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n == 0:
            return []
        num_free = self._num_free()
        if n > num_free:
            available = num_free + self._num_evictable
            if n > available:
                raise OutOfBlocks(n, available, self.num_blocks)
            self.evict(n - num_free)
        free = self._free
        recycled = min(n, len(free))
        taken = free[len(free) - recycled:]
        del free[len(free) - recycled:]
        taken.reverse()
        if recycled < n:
            taken += range(self._fresh, self._fresh + n - recycled)
            self._fresh += n - recycled
        state = self._state
        for block in taken:
            state[block] = CALLER
        self._num_caller += n
        return taken

    def free(self, block_ids: Sequence[int]) -> None:
        """Return caller-owned blocks (never the tree's) to the free list."""
        ids = [int(b) for b in block_ids]
        if len(set(ids)) != len(ids):
            raise ValueError("free got the same block id twice")
        for block in ids:
            if not 0 <= block < self.num_blocks:
                raise ValueError(f"block id {block} out of range [0, {self.num_blocks})")
            if self._state[block] != CALLER:
                raise ValueError(f"cannot free block {block}: it is {_STATE_NAMES[self._state[block]]}, not caller-owned")
        for block in ids:
            self._state[block] = FREE
        self._free.extend(ids)
        self._num_caller -= len(ids)

    def num_allocatable(self) -> int:
        return self._num_free() + self._num_evictable

    def _num_free(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    def evict(self, num_blocks: int) -> list[int]:
        """Evict up to `num_blocks` blocks from evictable leaves in policy order; return their ids.

        A leaf bigger than what is still needed loses only its last blocks, so exactly
        min(num_blocks, evictable) blocks are freed. The listener hears of every named block removed.
        """
        freed: list[int] = []
        records: list[BlockRecord] = []
        queue = self._queue
        while len(freed) < num_blocks:
            leaf = queue.pop()
            if leaf is None:
                break
            wanted = num_blocks - len(freed)
            keep = leaf.num_blocks - wanted if wanted < leaf.num_blocks else 0
            if self.listener is not None:
                records += self._records(leaf, self._parent_hash(leaf), keep)
            if keep:
                freed.extend(leaf.truncate(wanted, self._block_bytes))
                queue.add(leaf)
                break
            freed.extend(leaf.block_ids)
            self._detach_leaf(leaf)
        self._release_evicted(freed, records)
        return freed

    def _parent_hash(self, node: TreeNode) -> bytes:
        """The hash the first block of `node` is chained from."""
        return self.hasher.root(node.namespace) if node.parent is self._root else node.parent.hashes[-1]

    def _records(self, node: TreeNode, parent_hash: bytes, start: int) -> list[BlockRecord]:
        """Event records of `node`'s blocks from its `start`-th on (a tail's hash is empty: not a name)."""
        bb, hashes = self._block_bytes, node.hashes
        return [BlockRecord(hashes[i], hashes[i - 1] if i else parent_hash, node.tokens[i * bb:(i + 1) * bb],
                            node.namespace, node.block_ids[i]) for i in range(start, node.num_blocks)]

    def _detach_leaf(self, leaf: TreeNode) -> None:
        """Take an evicted leaf out of the tree; its parent may become an evictable leaf."""
        if leaf.key == TAIL_KEY:
            self._num_tails -= 1
            self._tail_tokens -= len(leaf.tokens) // TOKEN_DTYPE.itemsize
        parent = leaf.parent
        parent.remove_child(leaf)
        leaf.parent = None
        if parent is not self._root and not parent.children and parent.lock_ref == 0:
            self._queue.add(parent)

    def _release_evicted(self, freed: list[int], records: list[BlockRecord]) -> None:
        """Evicted tree blocks become free (counted); the listener hears of the named ones while their KV
        is still intact (nobody has been handed the ids yet)."""
        if not freed:
            return
        for block in freed:
            self._state[block] = FREE
        self._free.extend(freed)
        self._num_evictable -= len(freed)
        self._evicted_blocks += len(freed)
        if records:
            self.listener.removed(records)

    def _drop_leaf(self, leaf: TreeNode) -> None:
        """Evict one unlocked leaf now, whatever the policy order (a tail superseded by a longer one)."""
        assert leaf.lock_ref == 0 and not leaf.children
        records = self._records(leaf, self._parent_hash(leaf), 0) if self.listener is not None else []
        self._queue.discard(leaf)
        self._detach_leaf(leaf)
        self._release_evicted(list(leaf.block_ids), records)

    def reset_prefix_cache(self) -> bool:
        """Evict every evictable block; True when the tree is now empty (no request held a lock)."""
        self.evict(self._num_evictable)
        return not self._root.children

    # ------------------------------------------------------------------ stats

    def stats(self) -> CacheStats:
        return CacheStats(
            total_blocks=self.num_blocks,
            free_blocks=self._num_free(),
            evictable_blocks=self._num_evictable,
            in_use_blocks=self._num_caller + self._num_locked,
            cached_blocks=self._num_evictable + self._num_locked,
            cached_tokens=(self._num_evictable + self._num_locked - self._num_tails) * self.block_size
            + self._tail_tokens,
            query_tokens=self._query_tokens,
            hit_tokens=self._hit_tokens,
            evicted_blocks=self._evicted_blocks,
            pinned_blocks=self._num_pinned,
        )

    def check_invariants(self, check_hashes: bool = True) -> None:
        """Raise AssertionError if the tree or the block accounting is inconsistent."""
        total, bb = self.num_blocks, self._block_bytes
        owner: dict[int, str] = {}

        def claim(block: int, where: str) -> None:
            _require(0 <= block < total, f"block id {block} out of range")
            _require(block not in owner, f"block {block} is both {owner.get(block)} and {where}")
            owner[block] = where

        for block in itertools.chain(self._free, range(self._fresh, total)):
            claim(block, "free")
            _require(self._state[block] == FREE, f"free block {block} has state {self._state[block]}")
        evictable = locked = pinned = tails = tail_tokens = 0
        leaves: set[TreeNode] = set()
        stack = [self._root]
        while stack:
            node = stack.pop()
            child_locks = 0
            first_blocks: set[tuple[bytes, bytes]] = set()
            for key, bucket in node.children.items():
                _require(bool(bucket), "empty child bucket")
                for child in bucket:
                    n = child.num_blocks
                    _require(child.parent is node, "child's parent pointer is wrong")
                    _require(n > 0, "node without blocks")
                    _require(child.key == key, "child filed under a key that is not its first hash")
                    _require(node is self._root or child.namespace == node.namespace, "namespace differs from parent's")
                    if key == TAIL_KEY:
                        tails += 1
                        tail_tokens += len(child.tokens) // TOKEN_DTYPE.itemsize
                        _require(node is not self._root and n == 1 and not child.children, "a tail is one leaf block")
                        _require(0 < len(child.tokens) < bb and len(child.tokens) % TOKEN_DTYPE.itemsize == 0,
                                 "a tail holds 1 to block_size - 1 tokens")
                        _require(not any(o is not child and o.tokens == child.tokens for o in bucket),
                                 "two tails of one node hold the same tokens")
                    else:
                        _require(len(child.tokens) == n * bb and len(child.hashes) == n, "node run lengths disagree")
                        first = (child.tokens[:bb], child.namespace)
                        _require(first not in first_blocks, "two siblings start with the same block")
                        first_blocks.add(first)
                    if check_hashes and key != TAIL_KEY:
                        parent_hash = self.hasher.root(child.namespace) if node is self._root else node.hashes[-1]
                        expected = self.hasher.chain_bytes(parent_hash, child.tokens, 0, n)
                        _require(expected == child.hashes, "stored hashes are not the chain of the stored tokens")
                    _require(child.lock_ref >= 0, "negative lock_ref")
                    _require(0 <= child.pin_ref <= child.lock_ref, "pin_ref negative or above lock_ref (a pin is a lock)")
                    if child.pin_ref:
                        pinned += n
                    for block in child.block_ids:
                        claim(block, "in the tree")
                        _require(self._state[block] == TREE, f"tree block {block} has state {self._state[block]}")
                    if child.lock_ref == 0:
                        evictable += n
                        if not child.children:
                            leaves.add(child)
                    else:
                        locked += n
                    child_locks += child.lock_ref
                    stack.append(child)
            by_first = sorted((id(c), k) for k, b in node.by_first_token.items() for c in b)
            _require(by_first == sorted((id(c), c.first_token) for b in node.children.values() for c in b),
                     "by_first_token does not file exactly the children under their first token")
            if node is not self._root:
                _require(node.lock_ref >= child_locks, "a node's lock_ref is below its children's sum")
        caller = [b for b in range(total) if self._state[b] == CALLER]
        for block in caller:
            claim(block, "caller-owned")
        _require(len(owner) == total, f"{total - len(owner)} blocks are in no state")
        _require(len(caller) == self._num_caller, f"caller count {self._num_caller} != {len(caller)}")
        _require(evictable == self._num_evictable, f"evictable count {self._num_evictable} != {evictable}")
        _require(locked == self._num_locked, f"locked count {self._num_locked} != {locked}")
        _require(pinned == self._num_pinned, f"pinned count {self._num_pinned} != {pinned}")
        _require(leaves == self._queue.leaves, "eviction queue disagrees with the tree's evictable leaves")
        _require((tails, tail_tokens) == (self._num_tails, self._tail_tokens), "tail counters disagree with the tree")
        s = self.stats()
        _require(s.free_blocks + s.evictable_blocks + s.in_use_blocks == total, "free + evictable + in use != total")

    # ------------------------------------------------------------- internals

    def _walk(self, data: bytes, n_blocks: int, namespace: bytes, count_hit: bool):
        """Follow `data` (int32 bytes of `n_blocks` full blocks) down the tree, comparing tokens.

        Returns (last node, matched blocks, their ids, chain hash of the last matched block). Only
        the first block after each node boundary is hashed: it is the child's key; the rest of a run
        is checked with one comparison of its bytes.
        """
        self._clock += 1
        clock, bb, digest, root = self._clock, self._block_bytes, self.hasher.digest, self._root
        node, parent_hash, pos = root, self.hasher.root(namespace), 0
        block_ids: list[int] = []
        while pos < n_blocks:
            start = pos * bb
            bucket = node.children.get(digest(parent_hash + data[start:start + bb]))
            if bucket is None:
                break
            for child in bucket:
                if node is root and child.namespace != namespace:
                    continue
                size = len(child.block_ids)
                run = size if size <= n_blocks - pos else n_blocks - pos
                segment = data[start:start + run * bb]
                matched = run if child.tokens.startswith(segment) else self._equal_blocks(child.tokens, segment)
                if matched:
                    break
            else:
                break  # the key collided, but no child holds this block
            if matched < size:
                child = self._split(child, matched)
            child.last_access = clock
            if count_hit:
                child.hit_count += 1
            block_ids += child.block_ids
            pos += matched
            node, parent_hash = child, child.hashes[-1]
            if matched < run:
                break
        return node, pos, block_ids, parent_hash

    def _equal_blocks(self, stored: bytes, segment: bytes) -> int:
        """Number of leading blocks in which `stored` and `segment` agree (segment is the shorter)."""
        a = np.frombuffer(stored, TOKEN_DTYPE, count=len(segment) // TOKEN_DTYPE.itemsize)
        b = np.frombuffer(segment, TOKEN_DTYPE)
        differ = np.flatnonzero(a != b)
        return int(differ[0]) // self.block_size if differ.size else len(b) // self.block_size

    def _split(self, node: TreeNode, num_blocks: int) -> TreeNode:
        # Accounting is unchanged: both parts keep the lock count, the lower part stays a leaf or not.
        return node.split(num_blocks, self._block_bytes)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from `node` up to (not including) the root; error if `node` is not in this tree."""
        path = []
        while node is not self._root:
            if not isinstance(node, TreeNode) or node.parent is None:
                raise RadixError("node is not in this cache (evicted, or from another cache)")
            path.append(node)
            node = node.parent
        return path

    def _require_caller_owned(self, block: int, position: int) -> None:
        if self._state[block] != CALLER:
            raise ValueError(
                f"block {block} given for position {position} is {_STATE_NAMES[self._state[block]]}, not caller-owned"
            )
