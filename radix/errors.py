"""Errors raised by the cache index."""
from __future__ import annotations


class RadixError(Exception):
    """Base class for errors of the `radix` package."""


class OutOfBlocks(RadixError):
    """`allocate(n)` could not find `n` blocks even after evicting every evictable one."""

    def __init__(self, needed: int, available: int, total: int):
        self.needed = needed
        self.available = available
        self.total = total
        super().__init__(
            f"out of KV blocks: needed {needed}, available {available} "
            f"(free + evictable) of {total} total"
        )
