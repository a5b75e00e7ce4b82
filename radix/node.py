"""A radix-tree node: a run of consecutive KV blocks along one prompt chain."""
from __future__ import annotations

from radix.tokens import TOKEN_DTYPE

TOKEN_BYTES = TOKEN_DTYPE.itemsize


class TreeNode:
    """One edge of the tree, holding a run of `num_blocks` full blocks.

    `tokens` are the run's int32 token bytes, `block_ids[i]` and `hashes[i]` the KV block id and chain
    hash of its i-th block. A node is filed in its parent's `children` under the hash of its first
    block (`key`); every key maps to a list, because truncated (test) or crafted hashes can collide
    and siblings are told apart by their tokens. `lock_ref` counts the running requests whose path
    passes through the node (a lock walks up to the root, like SGLang's `lock_ref`); `pin_ref` counts, of
    those locks, the ones held by prompt-cache pins (`RadixCache.pin`) rather than running requests.
    """

    __slots__ = (
        "parent", "children", "by_first_token", "tokens", "block_ids", "hashes", "namespace",
        "lock_ref", "pin_ref", "last_access", "hit_count", "heap_version",
    )

    def __init__(self, parent: "TreeNode | None", tokens: bytes, block_ids: list[int], hashes: list[bytes], namespace: bytes):
        self.parent = parent
        self.children: dict[bytes, list[TreeNode]] = {}
        self.by_first_token: dict[bytes, list[TreeNode]] = {}
        self.tokens = tokens
        self.block_ids = block_ids
        self.hashes = hashes
        self.namespace = namespace
        self.lock_ref = 0
        self.pin_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.heap_version = 0

    @property
    def key(self) -> bytes:
        return self.hashes[0]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def is_root(self) -> bool:
        return not self.block_ids and self.parent is None

    @property
    def attached(self) -> bool:
        """False once the node has been evicted (detached from the tree)."""
        return self.parent is not None

    @property
    def first_token(self) -> bytes:
        return self.tokens[:TOKEN_BYTES]

    def add_child(self, child: "TreeNode") -> None:
        self.children.setdefault(child.key, []).append(child)
        self.by_first_token.setdefault(child.first_token, []).append(child)

    def remove_child(self, child: "TreeNode") -> None:
        for index, key in ((self.children, child.key), (self.by_first_token, child.first_token)):
            bucket = index[key]
            bucket.remove(child)
            if not bucket:
                del index[key]

    def replace_child(self, old: "TreeNode", new: "TreeNode") -> None:
        """Put `new` where `old` was; both must start with the same block."""
        for bucket in (self.children[old.key], self.by_first_token[old.first_token]):
            bucket[bucket.index(old)] = new

    def split(self, num_blocks: int, block_bytes: int) -> "TreeNode":
        """Cut this node after its first `num_blocks` blocks; return the new upper node.

        `self` keeps the lower part, so a caller holding (and having locked) `self` still unlocks
        the whole path it locked. Both parts keep the lock count and access statistics.
        """
        assert 0 < num_blocks < self.num_blocks
        cut = num_blocks * block_bytes
        top = TreeNode(self.parent, self.tokens[:cut], self.block_ids[:num_blocks], self.hashes[:num_blocks], self.namespace)
        top.lock_ref, top.pin_ref = self.lock_ref, self.pin_ref
        top.last_access, top.hit_count = self.last_access, self.hit_count
        self.parent.replace_child(self, top)
        self.tokens = self.tokens[cut:]
        self.block_ids = self.block_ids[num_blocks:]
        self.hashes = self.hashes[num_blocks:]
        self.parent = top
        top.children[self.key] = [self]
        top.by_first_token[self.first_token] = [self]
        return top

    def truncate(self, num_blocks: int, block_bytes: int) -> list[int]:
        """Drop the last `num_blocks` blocks of a leaf (keeping at least one); return their ids."""
        assert not self.children and 0 < num_blocks < self.num_blocks
        keep = self.num_blocks - num_blocks
        dropped = self.block_ids[keep:]
        self.tokens = self.tokens[: keep * block_bytes]
        del self.block_ids[keep:]
        del self.hashes[keep:]
        return dropped

    def __repr__(self) -> str:
        return f"TreeNode(blocks={self.num_blocks}, lock_ref={self.lock_ref}, children={sum(map(len, self.children.values()))})"
