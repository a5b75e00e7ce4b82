"""How a request's computed blocks go into the tree, one code for the engine's block manager (kv/block_manager.py)
and the offline replay (`reuse-loadgen simulate`, loadgen/simulate.py), so that the replay's hit rates are the
engine's.

A request holds (locks) the end of its chain in the tree while it runs, so that nothing it reads is evicted.
`file_blocks` hands blocks to the tree: the tree takes those it lacked; blocks it already held under the same
identity (another request filed them meanwhile) stay the caller's and are freed. `publish` does that for a
request's computed chain and moves its hold from the chain's old end to the new one."""
from __future__ import annotations

from typing import Callable, Sequence

from radix.cache import InsertResult, RadixCache
from radix.node import TreeNode
from radix.tokens import TokenInput


def file_blocks(cache: RadixCache, tokens: TokenInput, block_ids: Sequence[int], namespace: bytes = b"",
                before_freeing: Callable[[InsertResult], None] | None = None) -> InsertResult:
    """File the full blocks of `tokens` (block i in block_ids[i]); the duplicates of blocks the tree held already
    are freed, after before_freeing(result) if given (the block manager's window hands their parts over)."""
    result = cache.insert(tokens, block_ids, namespace)
    if result.duplicate_block_ids:
        if before_freeing is not None:
            before_freeing(result)
        cache.free(result.duplicate_block_ids)
    return result


def publish(cache: RadixCache, tokens: TokenInput, block_ids: Sequence[int], namespace: bytes,
            held: TreeNode | None, before_freeing: Callable[[InsertResult], None] | None = None) -> InsertResult:
    """A request computed the chain of `tokens`: file it (file_blocks) and move the request's hold from `held` (the
    node it locked: its matched prefix or its last publish; None: none) to the end of the filed chain."""
    result = file_blocks(cache, tokens, block_ids, namespace, before_freeing)
    cache.lock(result.node)
    if held is not None:
        cache.unlock(held)
    return result
