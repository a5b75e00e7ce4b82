"""What the cache tells the world about its named blocks: a full block stored in the tree, or removed from it.

Both events carry everything a consumer needs to keep the block elsewhere (a host-RAM tier, a disk file, a
shared store) without asking the cache again: the block's chained hash, its parent's hash, its tokens and
its namespace, and the pool block id whose KV it names. `removed` is sent while that KV is still intact (the
id is already free in the accounting, but nobody has been handed it yet), so a consumer can copy it out
instead of losing it. A tail (a finished request's partial last block) is not named: its record's hash is
empty (`named` is False); only its id, tokens and parent mean something, and tiers skip it."""
from __future__ import annotations

from typing import NamedTuple, Protocol


class BlockRecord(NamedTuple):
    hash: bytes
    parent_hash: bytes  # the root's hash for the first block of a prompt (BlockHasher.root(namespace))
    tokens: bytes  # the block's token ids, little-endian int32 (fewer than block_size for a tail)
    namespace: bytes
    block_id: int

    @property
    def named(self) -> bool:
        return bool(self.hash)


class CacheListener(Protocol):
    """Called by RadixCache on its own thread; must not call back into the cache."""

    def stored(self, blocks: list[BlockRecord]) -> None: ...

    def removed(self, blocks: list[BlockRecord]) -> None: ...


class Listeners:
    """Several listeners heard as one, in order (the tiers first: they copy KV out while it is intact)."""

    def __init__(self, *listeners: CacheListener | None):
        self.listeners = [listener for listener in listeners if listener is not None]

    def stored(self, blocks: list[BlockRecord]) -> None:
        for listener in self.listeners:
            listener.stored(blocks)

    def removed(self, blocks: list[BlockRecord]) -> None:
        for listener in self.listeners:
            listener.removed(blocks)
