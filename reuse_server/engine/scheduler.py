"""Continuous batching with prefill slices under a token budget per step, and the loop's other half:
`schedule()` picks the step's work, `update(step_output)` takes in what the step produced.

Each step: running sequences in decode take one token each (preempting the most recently admitted
sequences when blocks run out), prefilling ones take a slice of their prompt (blended prefills alike),
and waiting ones are admitted while the budget, the sequence cap and the pool allow. Waiting requests go
longest-cached-prefix first (their prefill is cheapest and their cached blocks are the likeliest to be
evicted if they wait), except that anyone passed over too often goes first, so nothing starves.

A waiting request whose first uncached block is the block another request is computing right now (the same
tokens before it: a burst of requests with one system prompt, an agent's parallel branches) waits instead
of computing it too: once the other request hands its blocks to the tree, the waiting one hits them
(`dedup_prefill`; SGLang calls this in-batch prefix caching). The one it waits for is running, so it
always progresses; if it is preempted or aborted, the wait ends with it.

After the forward, `update` (vLLM's update_from_output, nano-vllm's postprocess) advances each slice's KV,
closes a blended prefill's job once its prompt is computed (registering its chunks), appends each sampled
token, checks the stop conditions, and finishes and releases what ended: a request leaves the scheduler
only through `update` or `abort`, and its blocks are given back there.

Prompt-cache pins live by the clock passed to `schedule(now)`: expired pins are released before anything is
scheduled, an admission renews the pins its match reads, and a prompt computed pins its breakpoints (in
`update`, at the same step's time). A pool that cannot admit a request while nothing runs (so no block will
come back) makes the least recently used pin give way instead of leaving the request waiting for ever.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from reuse_server.kv.block_manager import BlockManager
from reuse_server.kv.pins import breakpoint_writes
from reuse_server.engine.sequence import SeqStatus, Sequence

CACHE_AWARE_QUEUE_LIMIT = 128  # beyond this, matching every waiting prompt each step costs too much: FCFS
MAX_SKIPS = 8


@dataclass
class StepSlice:
    """One sequence's part of a step: the tokens it computes, from seq.num_computed on."""

    seq: Sequence
    num_tokens: int
    # the slice computes up to the sequence's last token (the prompt's end, or a decode token): its logits
    # are computed, and sampled if the sequence generates (fixed when scheduled, before the KV advances)
    reaches_end: bool = field(init=False)

    def __post_init__(self) -> None:
        self.reaches_end = self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class StepOutput:
    """What one step produced: the slices it computed, and the token sampled for each sequence that took one."""

    slices: list[StepSlice]
    tokens: dict[Sequence, int] = field(default_factory=dict)


@dataclass
class SeqUpdate:
    """One sequence's news from a step, for the engine to report (the sequence says whether it finished)."""

    seq: Sequence
    new_token_ids: list[int]
    new_text: str = ""
    prompt_done: bool = False  # its prompt's KV was complete for the first time: count its usage
    first_token: bool = False  # the first token of its output


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 blender=None, blend_default: bool = False, dedup_prefill: bool = True,
                 eos_ids: set[int] = frozenset(), max_sequence_tokens: int | None = None) -> None:
        """eos_ids: the tokens that end an output (unless a request ignores them); max_sequence_tokens: the
        longest sequence the engine holds (None: no limit beyond max_tokens)."""
        self.blocks = blocks
        self.eos_ids = set(eos_ids)
        self.max_sequence_tokens = max_sequence_tokens
        self.dedup_prefill = dedup_prefill
        self.blender = blender
        self.blend_default = blend_default
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.admitted: list[Sequence] = []  # admitted for the first time since the engine last took them
        self.num_preemptions = 0
        self.now = time.monotonic()  # the step's time (schedule's `now`): pins are renewed and made at it

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq: Sequence) -> None:
        """End seq now (the client left, a timeout, the engine stopping): out of the queues, blocks given back."""
        seq.finish_reason = "abort"
        self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.queue.status = SeqStatus.FINISHED

    def _release(self, seq: Sequence) -> None:
        self._close_blend(seq)
        self.blocks.release(seq)

    def _close_blend(self, seq: Sequence):
        """The one place a blended prefill's job closes: its prompt is computed, or it leaves early."""
        return self.blender.finish(seq) if self.blender is not None else None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.queue.status = SeqStatus.WAITING
        seq.queue.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self, now: float | None = None) -> list[StepSlice]:
        """The step's work. now: the engine's clock (default: time.monotonic), by which pins expire."""
        self.now = time.monotonic() if now is None else now
        self.blocks.expire_pins(self.now)
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
            approximate = self.blender.approximate_namespace(seq) if blends else None
            admission = self.blocks.admit(seq, budget, approximate)
            while admission is None and not self.running and self.blocks.give_way():
                admission = self.blocks.admit(seq, budget, approximate)  # pins held the blocks no one else would free
            if admission is None:
                break  # the pool is full: wait for blocks to come back
            if blends and not self.blender.open_job(seq):
                self.blocks.release(seq)
                break
            self.blocks.renew_pins(seq, self.now)
            self.waiting.remove(seq)
            seq.queue.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.usage.cached_tokens is None:  # the first admission is what the client is told
                seq.usage.cached_tokens = admission.cached_tokens
                seq.usage.tier_tokens = dict(admission.by_tier)
                self.admitted.append(seq)
            n = min(self.blocks.computable(seq), budget)
            batch.append(StepSlice(seq, n))
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
        wanted = self.blend_default if seq.options.blend is None else seq.options.blend
        return self.blender is not None and wanted and self.blender.fits(seq)

    def take_admitted(self) -> list[Sequence]:
        """The sequences admitted for the first time since the last call (the engine reports them before the
        step's forward computes their prompts)."""
        admitted, self.admitted = self.admitted, []
        return admitted

    def breakpoint_writes(self, seq: Sequence, cached_tokens: int) -> dict[int, int]:
        """Anthropic's cache writes of seq, had it reused `cached_tokens` (kv/pins.breakpoint_writes): none
        where it uses no prefix cache, as nothing it computes is kept for a later request."""
        if seq.options.breakpoints and self.blocks.enable_prefix_cache and seq.uses_prefix_cache:
            return breakpoint_writes(seq.options.breakpoints, len(seq.prompt_ids), cached_tokens)
        return {}

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

    # ---- after the step ----------------------------------------------------------------------
    def update(self, step: StepOutput) -> list[SeqUpdate]:
        """Take in what the step produced: advance each slice's KV (publishing full blocks); where a prompt is
        now computed, close its blend job and count its usage, register its chunks, and end a precompute;
        append each sampled token, check the stop conditions, and finish and release what ended. Returns the
        sequences with news, in the step's order (precomputes as their slices come, then the sampled)."""
        updates, prompts_done = [], set()
        for c in step.slices:
            seq = c.seq
            self.blocks.advance(seq, c.num_tokens)
            if not c.reaches_end:
                continue
            if self._prompt_done(seq):
                prompts_done.add(seq)
            if not seq.generates:
                seq.finish_reason = "stop"
                self._finish(seq)
                updates.append(SeqUpdate(seq, [], prompt_done=seq in prompts_done))
        for seq, token in step.tokens.items():
            update = self._append(seq, token)
            update.prompt_done = seq in prompts_done
            updates.append(update)
        return updates

    def _prompt_done(self, seq: Sequence) -> bool:
        """seq's KV is complete up to its last token (the slice just computed reached its end): its blend job,
        if any, closes. True the first time (its prompt is done): usage counted, chunks registered."""
        job = self._close_blend(seq)
        usage = seq.usage
        if usage.counted:  # a preempted request recomputed it: counted already
            return False
        usage.counted = True
        if job is not None:
            usage.blended_tokens, usage.recomputed_tokens = job.blended, job.recomputed
            usage.recomputed_positions = tuple(job.recomputed_positions)
            usage.cached_tokens = (usage.cached_tokens or 0) + job.blended
        if self.blender is not None and (not seq.generates or self.blends(seq)):
            reused = job.reused if job is not None else None  # blended KV is approximate: not filed as chunks
            usage.chunk_tokens_stored, usage.chunk_tokens_present = self.blender.register(seq, reused)
        cached = usage.cached_tokens or 0
        usage.cache_write_tokens = self.blocks.stored_prompt_tokens(seq, cached)
        usage.breakpoint_write_tokens = self.breakpoint_writes(seq, cached)
        self.blocks.pin_breakpoints(seq, self.now)
        return True

    def _append(self, seq: Sequence, token: int) -> SeqUpdate:
        """Add the token sampled for seq, detokenize it and check the stop conditions; finish seq if one holds."""
        first = seq.usage.first_token_time is None
        if first:
            seq.usage.first_token_time = time.monotonic()
        seq.output_ids.append(token)
        p = seq.params
        detok = seq.detokenizer
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            new_text = detok.flush()
            seq.finish_reason = "stop"
        else:
            new_text = detok.add(seq.output_ids)
            if detok.stopped:
                seq.finish_reason = "stop"
                new_text += detok.flush()
            elif len(seq.output_ids) >= p.max_tokens or (self.max_sequence_tokens is not None
                                                         and seq.num_tokens >= self.max_sequence_tokens):
                seq.finish_reason = "length"
                new_text += detok.flush()
        if seq.finish_reason is not None:
            self._finish(seq)
        return SeqUpdate(seq, [token], new_text, first_token=first)
