"""Continuous batching with chunked prefill under a token budget per step.

Each step: running sequences in decode take one token each (preempting the most recently admitted
sequences when blocks run out), prefilling ones take a slice of their prompt (chunked prefill; blended
prefills alike), and waiting ones are admitted while the
budget, the sequence cap and the pool allow. Waiting requests go longest-cached-prefix first (their
prefill is cheapest and their cached blocks are the likeliest to be evicted if they wait), except that
anyone passed over too often goes first, so nothing starves.

A waiting request whose first uncached block is the block another request is computing right now (the same
tokens before it: a burst of requests with one system prompt, an agent's parallel branches) waits instead
of computing it too: once the other request hands its blocks to the tree, the waiting one hits them
(`dedup_prefill`; SGLang calls this in-batch prefix caching). The one it waits for is running, so it
always progresses; if it is preempted or aborted, the wait ends with it.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from reuse_server.kv.block_manager import Admission, BlockManager
from reuse_server.engine.sequence import SeqStatus, Sequence

CACHE_AWARE_QUEUE_LIMIT = 128  # beyond this, matching every waiting prompt each step costs too much: FCFS
MAX_SKIPS = 8


@dataclass
class StepSlice:
    """One sequence's part of a step: the tokens it computes, from seq.num_computed on."""

    seq: Sequence
    num_tokens: int
    admission: Admission | None = None  # admitted this step: what the caches served


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 blender=None, blend_default: bool = False, dedup_prefill: bool = True) -> None:
        self.blocks = blocks
        self.dedup_prefill = dedup_prefill
        self.blender = blender
        self.blend_default = blend_default
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take seq out of the queues and give back its blocks (finish or abort)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.queue.status = SeqStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        if self.blender is not None:
            self.blender.finish(seq)
        self.blocks.release(seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.queue.status = SeqStatus.WAITING
        seq.queue.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> list[StepSlice]:
        budget = self.max_num_batched_tokens
        batch: list[StepSlice] = []

        # Running sequences, oldest first; the newest are the ones preempted under pressure.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(self.blocks.computable(seq), budget)
            while not self.blocks.ensure_capacity(seq, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                batch.append(StepSlice(seq, n))
                budget -= n
                i += 1
                continue
            # seq itself was preempted; the loop index now points at the next one

        # Admit waiting sequences.
        in_flight = self._blocks_in_flight()
        order, cached = self._admission_order()
        for seq in order:
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            blends = self.blends(seq)
            if (in_flight and not blends
                    and self.blocks.next_uncached_block(seq, cached.get(id(seq))) in in_flight):
                continue  # another request is computing its next block: hit it next step instead
            prefetch = seq.cache.prefetch_only
            admission = self.blocks.admit(seq, 0 if prefetch else budget,
                                          self.blender.approximate_namespace(seq) if blends else None,
                                          fill_holes=not prefetch)
            if admission is None:
                break  # the pool is full: wait for blocks to come back
            if blends and not self.blender.admit(seq):
                self.blocks.release(seq)
                break
            self.waiting.remove(seq)
            seq.queue.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = 0 if prefetch else min(self.blocks.computable(seq), budget)
            batch.append(StepSlice(seq, n, admission))
            budget -= n
            if in_flight is not None and (key := self._block_in_flight(seq)) is not None:
                in_flight.add(key)
        return batch

    def _block_in_flight(self, seq: Sequence) -> bytes | None:
        """The identity of the block seq is computing into the exact tree, if any (a blended prefill's KV may
        come out approximate: nobody waits for it)."""
        if self.blender is not None and self.blender.blending(seq):
            return None
        return self.blocks.block_in_flight(seq)

    def _blocks_in_flight(self) -> set | None:
        """The identities of the blocks running requests are computing into the exact tree."""
        if not self.dedup_prefill or not self.waiting:
            return None
        return {key for seq in self.running if (key := self._block_in_flight(seq)) is not None}

    def blends(self, seq: Sequence) -> bool:
        return self.blender is not None and (self.blend_default if seq.cache.blend is None else seq.cache.blend)

    def _admission_order(self) -> tuple[list[Sequence], dict[int, int]]:
        """The waiting sequences in admission order, and {id(seq): cached tokens} where that was looked up."""
        queue = list(self.waiting)
        if len(queue) <= 1 or len(queue) > CACHE_AWARE_QUEUE_LIMIT:
            return queue, {}
        starved = [s for s in queue if s.queue.skipped >= MAX_SKIPS or s.queue.preemptions]
        rest = [s for s in queue if not (s.queue.skipped >= MAX_SKIPS or s.queue.preemptions)]
        cached = {id(s): self.blocks.peek_cached(s) for s in rest}
        rest.sort(key=lambda s: (-cached[id(s)], s.arrival))
        order = starved + rest
        # everyone behind someone who arrived later was passed over once
        latest_ahead = float("-inf")
        for seq in order:
            if latest_ahead > seq.arrival:
                seq.queue.skipped += 1
            latest_ahead = max(latest_ahead, seq.arrival)
        return order, cached
