"""The window group's block accounting: which blocks have their sliding-window layers' KV, and where.

A hybrid model (Gemma 3: five layers attending over the last 512 tokens for each one attending over the whole
context) needs a token's window-layer KV only while some query can still see it. The pool keeps the two
kinds of layers apart (`LayeredKVPool`): a block id names the full-attention layers' KV of its tokens, as
everywhere else (the radix tree, the tiers and the events name blocks by it), and may additionally *have a
window part*: a block of the window layers' own, smaller pool, found through `table`.

A window part is in one of three states (SGLang's SWA radix cache keeps the same split of "full" and "SWA"
slots, with tombstones for nodes whose SWA part is gone; vLLM's hybrid allocator gives each attention type its
own block table):
- pinned: a running sequence's window covers it (or the sequence owns the block); never taken away;
- cached: no sequence needs it now but the block is in the radix tree, where a later prompt that stops right
  after it needs the window before that point; evicted least recently released first when parts run out;
- free.
A block whose part was evicted keeps its full-attention KV in the tree: a prompt can still reuse it as long as
the window before its reuse point has parts (`BlockManager` trims a match to that).

Written by the block manager only (through `kv/window_policy.SlidingWindow`); the pool reads `table` to find a
block's window part."""
from __future__ import annotations

from collections import Counter, OrderedDict

import torch

# Window block 0 is never handed out: blocks without a part map there. Its KV stays finite (zeros, or what a
# write of a block without a part would leave; the block manager gives every written block a part), so a
# masked read of it cannot turn an attention row into NaN.
NO_PART = 0


class WindowParts:
    def __init__(self, num_blocks: int, num_window_blocks: int, window: int, block_size: int) -> None:
        """num_blocks: the pool's block ids; num_window_blocks: the window layers' pool (block 0 reserved);
        window: a window layer's query at position p sees keys p - window + 1 .. p."""
        if num_window_blocks < 2:
            raise ValueError(f"the window layers' pool needs at least 2 blocks, got {num_window_blocks}")
        self.window = window
        self.block_size = block_size
        self.num_window_blocks = num_window_blocks
        self.table = torch.full((num_blocks,), NO_PART, dtype=torch.long)
        self._part: dict[int, int] = {}
        self._free = list(range(num_window_blocks - 1, NO_PART, -1))
        self._pins: Counter[int] = Counter()
        self._cached: OrderedDict[int, None] = OrderedDict()  # unpinned parts, least recently released first
        self.evicted = 0  # parts taken from cached blocks to serve others

    # ---- reads -----------------------------------------------------------------------------
    def has(self, block: int) -> bool:
        return block in self._part

    def part(self, block: int) -> int:
        return self._part[block]

    def first_needed(self, position: int) -> int:
        """The first block whose window part a query at `position` (or later) needs."""
        return max(0, position - self.window + 1) // self.block_size

    def num_available(self) -> int:
        return len(self._free) + len(self._cached)

    def stats(self) -> dict:
        return {"window_blocks": self.num_window_blocks - 1, "window_blocks_pinned": len(self._pins),
                "window_blocks_cached": len(self._cached), "window_blocks_free": len(self._free),
                "window_parts_evicted": self.evicted}

    # ---- changes (the block manager's) ----------------------------------------------------------
    def attach(self, blocks: list[int]) -> bool:
        """Give each of `blocks` (none with a part) a part, pinned once; least recently released cached parts
        are evicted as needed. All or nothing: False (nothing changed) when too few parts are free or cached."""
        if len(blocks) > self.num_available():
            return False
        for block in blocks:
            assert block not in self._part, f"block {block} already has a window part"
            if self._free:
                part = self._free.pop()
            else:
                victim, _ = self._cached.popitem(last=False)
                part = self._part.pop(victim)
                self.table[victim] = NO_PART
                self.evicted += 1
            self._part[block] = part
            self.table[block] = part
            self._pins[block] = 1
        return True

    def pin(self, blocks) -> None:
        for block in blocks:
            assert block in self._part, f"block {block} has no window part to pin"
            self._cached.pop(block, None)
            self._pins[block] += 1

    def unpin(self, blocks) -> None:
        """Parts no sequence needs any more stay cached (evictable)."""
        for block in blocks:
            self._pins[block] -= 1
            if self._pins[block] == 0:
                del self._pins[block]
                self._cached[block] = None

    def drop(self, blocks) -> None:
        """The blocks are freed or evicted from the tree: their parts (unpinned) are free again."""
        for block in blocks:
            part = self._part.pop(block, None)
            if part is None:
                continue
            assert block not in self._pins, f"block {block}'s window part is still pinned"
            self._cached.pop(block, None)
            self.table[block] = NO_PART
            self._free.append(part)

    def move(self, src: int, dst: int) -> None:
        """Block dst (which has no part) takes over src's part and its pins: the two blocks hold the same KV
        (a duplicate the tree already had under another id)."""
        assert dst not in self._part
        part = self._part.pop(src)
        self._part[dst] = part
        self.table[src], self.table[dst] = NO_PART, part
        if src in self._pins:
            self._pins[dst] = self._pins.pop(src)
        else:  # every part is pinned or cached
            del self._cached[src]
            self._cached[dst] = None

    def hand_over(self, src: int, dst: int) -> None:
        """src (a duplicate of dst: the same KV, about to be freed) gives dst its pins, and its part too when
        dst has none; otherwise src's part is freed."""
        if src not in self._part:
            return
        if dst not in self._part:
            self.move(src, dst)
            return
        pins = self._pins.pop(src, 0)
        if pins:
            self._cached.pop(dst, None)
            self._pins[dst] += pins
        else:
            self._cached.pop(src, None)
        self._free.append(self._part.pop(src))
        self.table[src] = NO_PART

    def check_invariants(self) -> None:
        parts = list(self._part.values())
        assert len(set(parts)) == len(parts) and NO_PART not in parts
        assert set(parts).isdisjoint(self._free) and len(parts) + len(self._free) == self.num_window_blocks - 1
        assert set(self._pins) | set(self._cached) == set(self._part) and not set(self._pins) & set(self._cached)
        assert all(count > 0 for count in self._pins.values())
        for block, part in self._part.items():
            assert int(self.table[block]) == part
        assert int((self.table != NO_PART).sum()) == len(parts)
