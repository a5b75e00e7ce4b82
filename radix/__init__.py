"""The cache index: which KV blocks already hold a prompt's state (pure Python: numpy + xxhash).

A prompt is cut into blocks of `block_size` tokens (a power of two, 1..512). Every full block gets
a hash chained from its parent, h_i = H(h_{i-1} || tokens_i), whose root is H(identity || namespace):
the identity names what computed the KV (a model fingerprint), the namespace keeps apart otherwise equal
tokens (a tenant, a cache salt, a blending setting). So a block's hash is its name in every process and on
every server (radix.hashing). H is xxh3_128 by default; "sha256" can be chosen where crafted collisions
are feared. A partial last block is never
hashed or matched as a chain link, but a finished request may file it as a *tail* of its last full
block (`insert_tail`). Where a prompt leaves the cached chain inside a block, `match_partial` finds the
tail or child block that shares the most of its leading tokens; the engine copies that block and computes
only from the divergence on: reuse to the token, not only to the block.

`RadixCache` keeps the blocks in a radix tree: a node holds a run of consecutive blocks (their
tokens, KV block ids and chain hashes) and is filed under its first block's hash. `match` walks the
tree and compares the stored tokens of every block it returns, so even a hash collision (forced in
the tests by truncating hashes to a few bits) can never serve KV computed for other tokens or under
another `namespace`. What that costs:
- memory: the tree keeps 4 bytes per cached token (int32), 4 MB per million tokens, next to the KV
  itself (tens of kB per token for real models);
- time: one `bytes.startswith` (a memcmp) per node run on the matched path, about as fast as
  copying the prompt's bytes once; and since the tokens are checked anyway, only the first block
  after each node boundary is hashed during a match (it is the child's key); the worst case is a
  path cut into one-block nodes: one hash and one compare per node (BENCHMARKS.md, cache index).

The cache is also the one owner of block state: every block id is free, caller-owned ("in use",
from `allocate`), or in the tree, where it is evictable while no running request locks its node
and in use while one does (`lock`/`unlock` count up to the root like SGLang's `lock_ref`).
`allocate(n)` takes free blocks first and evicts leaves by policy (LRU or LFU) when it must; a
parent becomes evictable when its last child goes. A `listener` hears every block stored in and
removed from the tree, with its hash, parent hash, tokens and namespace (radix.events), so an evicted block
can be demoted to a slower tier instead of dropped.
`stats()` counts queries and hits in tokens (as vLLM's prefix_cache_queries/hits), evictions in
blocks, and the current free/evictable/in-use blocks. The engine must lock a matched node before it
allocates, or the allocation may evict the very blocks it just matched. Not thread-safe: one owner
(the scheduler) calls it.

`publish` (radix.filing) files a request's computed blocks and moves its lock to the chain's new end:
the engine's block manager and `reuse-loadgen simulate` (loadgen/simulate.py, which replays a Mooncake trace through this
cache to answer "how much cache would my traffic need?") both call it.
"""
from radix.cache import InsertResult, MatchResult, PartialMatch, RadixCache
from radix.errors import OutOfBlocks, RadixError
from radix.events import BlockRecord, CacheListener, Listeners
from radix.filing import file_blocks, publish
from radix.hashing import HASH_ALGOS, BlockHasher, check_block_size
from radix.node import TreeNode
from radix.policy import POLICIES, EvictionPolicy, LFUPolicy, LRUPolicy
from radix.stats import CacheStats
from radix.tokens import TOKEN_DTYPE, as_token_array

__all__ = [
    "BlockHasher",
    "BlockRecord",
    "CacheListener",
    "Listeners",
    "CacheStats",
    "EvictionPolicy",
    "HASH_ALGOS",
    "InsertResult",
    "LFUPolicy",
    "LRUPolicy",
    "MatchResult",
    "OutOfBlocks",
    "POLICIES",
    "RadixCache",
    "PartialMatch",
    "RadixError",
    "TOKEN_DTYPE",
    "TreeNode",
    "as_token_array",
    "check_block_size",
    "file_blocks",
    "publish",
]
