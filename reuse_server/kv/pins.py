"""Prompt-cache pins: prefixes a client marked as breakpoints (Anthropic's `cache_control`), kept in the device
pool for their time to live.

A pin holds the prefix up to a breakpoint through `RadixCache.pin` (a lock no running request holds), so the
least-recently-used eviction never takes it: the whole blocks before the breakpoint and, where the breakpoint
falls inside a block, that block too (the tree keeps whole blocks only; a hit reads the prefix to the token by
copying the block's leading tokens, BlockManager.match, as Anthropic counts a hit up to the breakpoint). When
the pin expires or gives way it is unpinned and the blocks are ordinary cache again (evicted in LRU order,
demoted to host RAM like any block). Pins are keyed by the node that ends at the last whole block before the
breakpoint, which a hit's match ends at or passes: a node keeps its end when the tree splits it (the split's
upper part is new, the pinned node keeps the lower part), so a breakpoint sent again finds its pin.

Time is the engine's clock, passed in (`now`): a pin expires when the scheduler asks (`expire`) at the start
of a step, never from a thread of its own. The table is written by the block manager alone, which alone
changes the tree; it reads the tree only to count blocks."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Iterable, Mapping, NamedTuple

from radix import TreeNode


class CacheBreakpoint(NamedTuple):
    """A prompt-cache breakpoint (Anthropic's `cache_control`): the prompt's first `offset` tokens are kept
    (whole blocks) for `ttl` seconds from each use (a Pin)."""

    offset: int
    ttl: float


@dataclass(eq=False)
class Pin:
    node: TreeNode  # the whole blocks before the breakpoint end with this node's last block: the pin's key
    held: TreeNode  # what the cache keeps pinned: `node`, or its one-block child the breakpoint falls in
    tenant: str  # whose budget it counts against ("" without API keys)
    num_tokens: int  # tokens of the blocks held
    ttl: float  # seconds; the longest any breakpoint here asked for
    expires_at: float
    used_at: float  # created or last renewed: the least recently used pin of a tenant gives way first
    order: int  # ties of used_at: the older pin first
    window_blocks: list[int] = field(default_factory=list)  # a hybrid pool's window parts pinned with it

    def renew(self, now: float, ttl: float | None = None) -> None:
        """A request read the prefix (or marked it again): its time to live starts over."""
        if ttl is not None:
            self.ttl = max(self.ttl, ttl)
        self.expires_at = max(self.expires_at, now + self.ttl)
        self.used_at = now


class PinTable:
    """The pins in force, by the node that ends each."""

    def __init__(self) -> None:
        self._pins: dict[TreeNode, Pin] = {}
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._pins)

    def __iter__(self):
        return iter(list(self._pins.values()))

    def get(self, node: TreeNode) -> Pin | None:
        return self._pins.get(node)

    def add(self, node: TreeNode, held: TreeNode, tenant: str, num_tokens: int, ttl: float, now: float,
            window_blocks: list[int]) -> Pin:
        pin = Pin(node, held, tenant, num_tokens, ttl, now + ttl, now, next(self._order), window_blocks)
        self._pins[node] = pin
        return pin

    def remove(self, pin: Pin) -> None:
        del self._pins[pin.node]

    def on_path(self, node: TreeNode | None) -> list[Pin]:
        """The pins whose prefix a match ending at `node` reads whole (they end at `node` or above it)."""
        found = []
        while node is not None and self._pins:
            pin = self._pins.get(node)
            if pin is not None:
                found.append(pin)
            node = node.parent
        return found

    def expired(self, now: float) -> list[Pin]:
        return [p for p in self._pins.values() if p.expires_at <= now]

    def oldest(self, tenant: str | None = None) -> Pin | None:
        """The least recently used pin (of `tenant`, if given)."""
        pins = [p for p in self._pins.values() if tenant is None or p.tenant == tenant]
        return min(pins, key=lambda p: (p.used_at, p.order), default=None)

    def blocks_of(self, tenant: str) -> int:
        """Blocks the tenant's pins hold (a block shared by two of its pins counted once)."""
        return _blocks_under(p.held for p in self._pins.values() if p.tenant == tenant)

    def stats(self, now: float, block_size: int, given_way: Mapping[str, int]) -> dict:
        """Per tenant (by tenant_label) with pins in force or pins that gave way (`given_way`, by tenant): pins,
        blocks and tokens pinned, pins given way, and the soonest and latest expiry (seconds from now; null
        with no pin in force)."""
        out: dict[str, dict] = {}
        for tenant in sorted({p.tenant for p in self._pins.values()} | {t for t, n in given_way.items() if n}):
            pins = [p for p in self._pins.values() if p.tenant == tenant]
            blocks = _blocks_under(p.held for p in pins)
            out[tenant_label(tenant)] = {
                "pins": len(pins), "pinned_blocks": blocks, "pinned_tokens": blocks * block_size,
                "given_way": given_way.get(tenant, 0),
                "next_expiry_s": round(min(p.expires_at for p in pins) - now, 3) if pins else None,
                "last_expiry_s": round(max(p.expires_at for p in pins) - now, 3) if pins else None}
        return out


def tenant_label(tenant: str | None) -> str:
    """How the pin statistics name a tenant: its digest, "default" without API keys (no digest is a word)."""
    return tenant or "default"


def _blocks_under(ends: Iterable[TreeNode]) -> int:
    """Blocks on the paths from each node up to the root, each node counted once."""
    seen: set[int] = set()
    total = 0
    for node in ends:
        while node is not None and node.parent is not None and id(node) not in seen:
            seen.add(id(node))
            total += node.num_blocks
            node = node.parent
    return total


def breakpoint_writes(breakpoints: Iterable[CacheBreakpoint], prompt_tokens: int, cached_tokens: int
                      ) -> dict[int, int]:
    """Anthropic's cache writes: the prompt tokens this request computed (past the `cached_tokens` it reused)
    up to its last breakpoint, each counted under the time to live of the first breakpoint at or after it
    (the 5-minute and 1-hour writes are priced apart). {ttl seconds: tokens}."""
    out: dict[int, int] = {}
    start = cached_tokens
    for bp in sorted(breakpoints, key=lambda b: b.offset):
        end = min(bp.offset, prompt_tokens)
        if end > start:
            out[int(bp.ttl)] = out.get(int(bp.ttl), 0) + end - start
            start = end
    return out
