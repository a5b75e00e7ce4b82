"""What the block manager does for a model's sliding-window layers, as one of two types chosen when the pool is
made (`KVPool.window_policy`, `LayeredKVPool.window_policy`), so that `BlockManager` tells one story for both.

- `NoWindow`: the pool holds every layer's KV of every block it names (a model without window layers, or one
  whose window layers share the one pool). Every step is a no-op: every block is whole, every match usable.
- `SlidingWindow`: a hybrid pool keeps its window layers' KV in parts of their own (`kv/window_parts.py`). Every
  block a sequence takes gets a part, pinned; the parts of blocks that leave the sequence's window are unpinned as
  it advances (freed where the sequence owns the block, cached where the tree holds it); a match is usable only up
  to where the window before the reuse point still has its parts; the tree's eviction of a block frees its part.

vLLM splits KV management the same way (`SingleTypeKVCacheManager`: `FullAttentionManager` beside
`SlidingWindowManager`, which trims cache hits to a whole window and frees blocks that fall out of it); SGLang
keeps a cache class of its own for it (`SWARadixCache`).

A sequence's `kv` (engine.sequence.KVState) carries `window_from`: its blocks from that index on have window
parts it pins. Only `SlidingWindow` reads or moves it."""
from __future__ import annotations

from typing import Callable, Protocol

from reuse_server.kv.window_parts import WindowParts


class WindowPolicy(Protocol):
    def has_kv(self, block: int) -> bool:
        """Whether the block holds every layer's KV (a hybrid block whose window part is gone does not)."""

    def whole(self, blocks: list[int]) -> bool:
        """has_kv for every one of blocks."""

    def holds_at_once(self, num_blocks: int) -> bool:
        """Whether one sequence may hold this many blocks with their KV at the same time."""

    def usable(self, block_ids: list[int]) -> int:
        """How many leading blocks of a matched chain a query can continue from."""

    def start(self, kv, matched_tokens: int) -> None:
        """A sequence's block table starts with a matched chain of matched_tokens tokens: hold the window the
        query after it reads."""

    def attach(self, blocks: list[int]) -> bool:
        """Blocks newly taken from the cache become whole (held once); False (nothing changed) if they cannot."""

    def pin(self, blocks: list[int]) -> None: ...

    def unpin(self, blocks: list[int]) -> None: ...

    def free(self, blocks: list[int], pinned: bool) -> None:
        """Caller-owned blocks go back to the cache (attached and held once, or no longer held)."""

    def drop(self, blocks: list[int]) -> None:
        """The tree evicted these blocks."""

    def hand_over(self, mine: list[int], duplicates: list[int], tree_ids: Callable[[], list[int]]) -> None:
        """Filing `mine` found the tree holding `duplicates` of them already (tree_ids(): the tree's chain, in
        the order of mine): the tree's copies take what the duplicates held, before they are freed."""

    def slide(self, kv, num_computed: int) -> None:
        """The sequence computed up to num_computed: let go of what no later query of it reads."""

    def attach_copies(self, kv, copies: list[int]) -> list[int] | None:
        """Private copies replace the first len(copies) blocks of kv's table: make them whole where the
        originals are held. Returns the originals to unpin once copied, or None (nothing changed) if it cannot."""

    def pin_before(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """A prompt-cache pin at num_tokens over block_ids: hold what a hit there needs; returns what was pinned."""

    def release(self, kv) -> None:
        """The sequence gives back its blocks: let go of everything it holds."""


class NoWindow:
    """Every block holds every layer's KV: nothing to hold, trim or slide."""

    def has_kv(self, block: int) -> bool:
        return True

    def whole(self, blocks: list[int]) -> bool:
        return True

    def holds_at_once(self, num_blocks: int) -> bool:
        return True

    def usable(self, block_ids: list[int]) -> int:
        return len(block_ids)

    def start(self, kv, matched_tokens: int) -> None:
        pass

    def attach(self, blocks: list[int]) -> bool:
        return True

    def pin(self, blocks: list[int]) -> None:
        pass

    def unpin(self, blocks: list[int]) -> None:
        pass

    def free(self, blocks: list[int], pinned: bool) -> None:
        pass

    def drop(self, blocks: list[int]) -> None:
        pass

    def hand_over(self, mine: list[int], duplicates: list[int], tree_ids: Callable[[], list[int]]) -> None:
        pass

    def slide(self, kv, num_computed: int) -> None:
        pass

    def attach_copies(self, kv, copies: list[int]) -> list[int] | None:
        return []

    def pin_before(self, block_ids: list[int], num_tokens: int) -> list[int]:
        return []

    def release(self, kv) -> None:
        pass


class SlidingWindow:
    """A hybrid pool's window parts, held for the blocks whose window-layer KV some query still reads."""

    def __init__(self, parts: WindowParts) -> None:
        self.parts = parts

    def has_kv(self, block: int) -> bool:
        return self.parts.has(block)

    def whole(self, blocks: list[int]) -> bool:
        return all(self.parts.has(b) for b in blocks)

    def holds_at_once(self, num_blocks: int) -> bool:
        # blending takes blocks for the whole prompt at once, each with a part until the prefill passes it
        return num_blocks < self.parts.num_window_blocks

    def usable(self, block_ids: list[int]) -> int:
        """The most leading blocks of a chain after which a query finds every window part it sees."""
        missing = [0]  # missing[i]: blocks without a part among the first i
        for block in block_ids:
            missing.append(missing[-1] + (not self.parts.has(block)))
        for end in range(len(block_ids), 0, -1):
            if missing[end] == missing[self.parts.first_needed(end * self.parts.block_size)]:
                return end
        return 0

    def start(self, kv, matched_tokens: int) -> None:
        kv.window_from = self.parts.first_needed(matched_tokens) if kv.block_table else 0
        self.parts.pin(kv.block_table[kv.window_from:])

    def attach(self, blocks: list[int]) -> bool:
        return self.parts.attach(blocks)

    def pin(self, blocks: list[int]) -> None:
        self.parts.pin(blocks)

    def unpin(self, blocks: list[int]) -> None:
        self.parts.unpin(blocks)

    def free(self, blocks: list[int], pinned: bool) -> None:
        if pinned:
            self.parts.unpin(blocks)
        self.parts.drop(blocks)

    def drop(self, blocks: list[int]) -> None:
        self.parts.drop(blocks)

    def hand_over(self, mine: list[int], duplicates: list[int], tree_ids: Callable[[], list[int]]) -> None:
        # the tree's copies take the duplicates' pins (and parts they lack)
        duplicated = set(duplicates)
        for block, theirs in zip(mine, tree_ids()):
            if block in duplicated:
                self.parts.hand_over(block, theirs)

    def slide(self, kv, num_computed: int) -> None:
        """Unpin the window parts of the blocks that no query of the sequence can see any more: freed where it
        owns the block (nothing else can use its part), cached where the tree has it."""
        end = min(self.parts.first_needed(num_computed), len(kv.block_table))
        if end <= kv.window_from:
            return
        passed = kv.block_table[kv.window_from:end]
        self.parts.unpin(passed)
        self.parts.drop([b for b in passed if b in kv.owned])
        kv.window_from = end

    def attach_copies(self, kv, copies: list[int]) -> list[int] | None:
        pinned = kv.block_table[kv.window_from:len(copies)]
        if pinned and not self.parts.attach(copies[kv.window_from:]):
            return None
        return pinned  # a copy without a part takes no window KV

    def pin_before(self, block_ids: list[int], num_tokens: int) -> list[int]:
        # the window before the reuse point, which a hit needs whole
        window = [b for b in block_ids[self.parts.first_needed(num_tokens):] if self.parts.has(b)]
        self.parts.pin(window)
        return window

    def release(self, kv) -> None:
        self.parts.unpin(kv.block_table[kv.window_from:])
