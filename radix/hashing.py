"""Block identities: chained hashes h_0 = H(root), h_i = H(h_{i-1} || tokens_i), root = H(identity || namespace).

`tokens_i` are the little-endian int32 bytes of block i. The *identity* names what computed the KV (the
engine passes a model fingerprint: weights, tokenizer, block size, KV dtype, hash algorithm), the *namespace*
what must keep otherwise equal tokens apart (a tenant, a cache salt, a blending setting). Both enter only the
root, and every later hash is chained from it, so a block's hash names its whole prefix, its model and its
namespace: the same prompt gets the same hashes in every process, after a restart and on every server, and
the hashes can name the block in a store outside the process. Nothing here depends on a seed or on Python's
`hash()`. One hash call per block, never a Python loop per token.
"""
from __future__ import annotations

import hashlib
from typing import Callable

import numpy as np
import xxhash

from radix.tokens import TOKEN_DTYPE, TokenInput, as_token_array

HASH_ALGOS = ("xxh3_128", "sha256")
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 1, 512


def check_block_size(block_size: int) -> int:
    """Return `block_size` if it is a power of two in [1, 512], else raise ValueError."""
    if (
        isinstance(block_size, bool)
        or not isinstance(block_size, (int, np.integer))
        or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(
            f"block size must be a power of two between {MIN_BLOCK_SIZE} and {MAX_BLOCK_SIZE}, got {block_size!r}"
        )
    return int(block_size)


def _make_digest(algo: str) -> Callable[[bytes], bytes]:
    if algo == "xxh3_128":
        return xxhash.xxh3_128_digest
    if algo == "sha256":
        sha256 = hashlib.sha256
        return lambda data: sha256(data).digest()
    raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {', '.join(HASH_ALGOS)}")


class BlockHasher:
    """Hashes token blocks into a chain; the hash of block i depends on every token before it, the identity
    and the namespace.

    `algo` is "xxh3_128" (fast, the default) or "sha256" (for deployments that fear crafted
    collisions). `truncate_bits` keeps only the low bits of every hash: TEST-ONLY, to force collisions.
    """

    def __init__(self, block_size: int = 16, algo: str = "xxh3_128", identity: bytes = b"",
                 truncate_bits: int | None = None):
        self.block_size = check_block_size(block_size)
        self.block_bytes = self.block_size * TOKEN_DTYPE.itemsize
        if not isinstance(identity, bytes):
            raise TypeError(f"identity must be bytes, got {type(identity).__name__}")
        self.algo = algo
        self.identity = identity
        digest = _make_digest(algo)
        self.digest_size = len(digest(b""))
        if truncate_bits is not None:
            if not 1 <= truncate_bits <= 8 * self.digest_size:
                raise ValueError(f"truncate_bits must lie in [1, {8 * self.digest_size}], got {truncate_bits}")
            mask, size = (1 << truncate_bits) - 1, self.digest_size
            full_digest = digest
            digest = lambda data: (int.from_bytes(full_digest(data), "little") & mask).to_bytes(size, "little")
        self.truncate_bits = truncate_bits
        self.digest = digest  # bytes -> hash bytes; chain() feeds it parent || block
        # The identity is length-prefixed and the namespace comes last, so no two pairs give the same bytes.
        self._root_prefix = b"kv-root" + len(identity).to_bytes(4, "little") + identity

    def root(self, namespace: bytes = b"") -> bytes:
        """The "parent" of a prompt's first block in `namespace`."""
        return self.digest(self._root_prefix + namespace)

    def chain(self, parent: bytes, block: bytes) -> bytes:
        """Hash of one block (its int32 bytes) given its parent's hash."""
        return self.digest(parent + block)

    def chain_bytes(self, parent: bytes, data: bytes, start: int, stop: int) -> list[bytes]:
        """Hashes of blocks `start..stop-1` of `data` (int32 token bytes), chained from `parent`."""
        digest, bb = self.digest, self.block_bytes
        out: list[bytes] = []
        append = out.append
        h = parent
        for offset in range(start * bb, stop * bb, bb):
            h = digest(h + data[offset:offset + bb])
            append(h)
        return out

    def hash_blocks(self, tokens: TokenInput, namespace: bytes = b"", parent: bytes | None = None) -> list[bytes]:
        """Chained hashes of every full block of `tokens` in `namespace`, or continuing the chain of `parent`
        (a partial last block gets none)."""
        arr = as_token_array(tokens)
        n_full = len(arr) // self.block_size
        data = arr[: n_full * self.block_size].tobytes()
        return self.chain_bytes(self.root(bytes(namespace)) if parent is None else parent, data, 0, n_full)
