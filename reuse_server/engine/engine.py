"""The synchronous engine: requests in, one scheduler step at a time, outputs out. Built by
engine_builder.build_engine; driven by one thread (the AsyncEngine's), which step() asserts."""
from __future__ import annotations

import logging
import threading
import time

import torch

from reuse_server.engine.builder import EngineParts
from reuse_server.engine.detokenizer import IncrementalDetokenizer
from reuse_server.engine.outputs import RequestOutput, TokenLogprob
from reuse_server.engine.sampler import top_logprobs
from reuse_server.engine.sampling_params import CacheOptions, InvalidRequest, SamplingParams
from reuse_server.engine.sequence import Sequence

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, parts: EngineParts) -> None:
        self.config = parts.config
        self.model = parts.model
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.model_id = parts.model_id
        self.weight_dtype = parts.weight_dtype
        self.fingerprint = parts.fingerprint
        self.attention_kernel = parts.attention_kernel
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.cache = parts.cache
        self.blocks = parts.blocks
        self.chunk_index = parts.chunk_index
        self.blender = parts.blender
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.sampler = parts.sampler
        self.tiers = parts.tiers
        self.events = parts.events
        mc = self.model_config
        self.eos_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.vocab_size = mc.vocab_size
        self.seqs: dict[str, Sequence] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.metrics = None  # ServerMetrics, attached by the server
        self.counters = dict(prompt_tokens=0, generation_tokens=0, prefix_query_tokens=0, prefix_hit_tokens=0,
                             blended_tokens=0, recomputed_tokens=0)
        self.built_on = threading.get_ident()  # the thread whose OpenMP pool did the loading (AsyncEngine)
        self._owner: int | None = None  # the one thread that drives the engine (the first to call in)

    def _check_thread(self) -> None:
        """Nothing in the engine is locked: one thread must drive it. The first to call in owns it."""
        me = threading.get_ident()
        if self._owner is None:
            self._owner = me
        elif self._owner != me:
            raise RuntimeError("the engine is driven by another thread (see AsyncEngine)")

    # ---- requests -------------------------------------------------------------------------
    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence the engine can hold: the context, or the whole KV pool if smaller."""
        return min(self.max_model_len, self.pool.num_blocks * self.config.block_size)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise InvalidRequest("The prompt is empty.", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"Token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1}).", "prompt")
        limit = self.max_sequence_tokens
        if len(prompt_ids) >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, your prompt has "
                f"{len(prompt_ids)} tokens, which leaves no room for a completion.",
                None, "context_length_exceeded")
        params.validate()
        outside = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if outside:
            raise InvalidRequest(f"logit_bias names token {outside[0]}, outside the vocabulary "
                                 f"(0..{self.vocab_size - 1}).", "logit_bias")
        if len(prompt_ids) + params.max_tokens > limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt_ids) + params.max_tokens} tokens ({len(prompt_ids)} in the prompt, "
                f"{params.max_tokens} for the completion). Reduce the prompt or max_tokens.",
                "max_tokens", "context_length_exceeded")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    cache: CacheOptions | None = None, arrival: float | None = None) -> Sequence:
        self._check_thread()
        self.validate(prompt_ids, params)
        if request_id in self.seqs:
            raise InvalidRequest(f"Duplicate request id {request_id!r}.")
        seq = Sequence(request_id, list(prompt_ids), params, cache or CacheOptions())
        if arrival is not None:
            seq.arrival = arrival
        self.seqs[request_id] = seq
        self.detoks[request_id] = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        self._check_thread()
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        return self._finish(seq, [], "")

    def block_hashes(self, prompt_ids: list[int], cache: CacheOptions | None = None) -> list[bytes]:
        """The identities of the prompt's full blocks as this engine files them: the same in every process and
        on every server with the same model fingerprint (see radix.hashing)."""
        return self.cache.hasher.hash_blocks(prompt_ids, (cache or CacheOptions()).namespace)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self._check_thread()
        slices = self.scheduler.schedule()
        if not slices:
            return []
        outputs = []
        for c in slices:
            usage = c.seq.usage
            if c.admission is not None and usage.cached_tokens is None:
                usage.cached_tokens = c.admission.cached_tokens
                usage.tier_tokens = dict(c.admission.by_tier)
            if c.seq.cache.prefetch_only:  # admitted: its blocks are up in the pool; nothing to compute
                c.seq.finish_reason = "stop"
                outputs.append(self._finish(c.seq, [], ""))
        slices = [c for c in slices if c.num_tokens]
        if not slices:
            return outputs
        want = [c.seq.num_computed + c.num_tokens == c.seq.num_tokens for c in slices]
        start = time.perf_counter()
        logits = self._forward(slices, want)  # a row per slice that wants one, in order
        if self.tiers is not None:  # the prefill rate, against which tier fetches are weighed
            prefill = sum(c.num_tokens for c in slices if c.num_tokens > 1)
            if prefill:
                self.tiers.observe_prefill(prefill, time.perf_counter() - start)
        pending, row = [], -1
        for c, w in zip(slices, want):
            seq = c.seq
            self.blocks.advance(seq, c.num_tokens)
            if not w:
                continue
            row += 1
            if not seq.usage.counted:
                self._prompt_done(seq)
            if seq.cache.precompute_only:
                seq.finish_reason = "stop"
                outputs.append(self._finish(seq, [], ""))
            else:
                pending.append((seq, row))
        if not pending:
            return outputs
        picked = logits[[row for _, row in pending]]
        seqs = [seq for seq, _ in pending]
        tokens = self.sampler.sample(picked, [s.request_id for s in seqs], [s.params for s in seqs],
                                     [(s.prompt_ids, s.output_ids) for s in seqs])
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            outputs.append(self._append_token(seq, token, picked[i]))
        return outputs

    def _forward(self, slices, want: list[bool]) -> torch.Tensor | None:
        """One forward for the step; a blended prefill's slice only chooses rows (blending.SliceSelection)."""
        blender = self.blender
        for c in slices:
            if blender.needs_probe(c.seq):
                positions, probe = blender.probe(c.seq)
                self.runner.observe(c.seq, positions, probe)
        selections = {i: blender.selection(c.seq, c.seq.num_computed, c.num_tokens)
                      for i, c in enumerate(slices) if blender.blending(c.seq)}
        logits = self.runner.run(slices, want, selections)
        for i, selection in selections.items():
            blender.slice_done(slices[i].seq, selection)
        return logits

    def _prompt_done(self, seq: Sequence) -> None:
        """The prompt's KV is complete for the first time: count its usage, register its chunks."""
        job = self.blender.finish(seq)
        usage = seq.usage
        if job is not None:
            usage.blended_tokens, usage.recomputed_tokens = job.blended, job.recomputed
            usage.cached_tokens = (usage.cached_tokens or 0) + job.blended
        self._count_usage(seq)
        if seq.cache.precompute_only or self.scheduler.blends(seq):
            skip = job.chunk_starts if job is not None else set()
            usage.chunk_tokens_stored, usage.chunk_tokens_present = self.blender.register(seq, skip=skip)

    def _count_usage(self, seq: Sequence) -> None:
        usage = seq.usage
        usage.counted = True
        n = len(seq.prompt_ids)
        self.counters["prompt_tokens"] += n
        if self.blocks.enable_prefix_cache and seq.uses_prefix_cache:
            self.counters["prefix_query_tokens"] += n
            self.counters["prefix_hit_tokens"] += (usage.cached_tokens or 0) - usage.blended_tokens
        self.counters["blended_tokens"] += usage.blended_tokens
        self.counters["recomputed_tokens"] += usage.recomputed_tokens

    def _append_token(self, seq: Sequence, token: int, logits_row: torch.Tensor) -> RequestOutput:
        now = time.monotonic()
        if seq.usage.first_token_time is None:
            seq.usage.first_token_time = now
            if self.metrics is not None:
                self.metrics.observe_ttft(now - seq.arrival)
        seq.output_ids.append(token)
        self.counters["generation_tokens"] += 1
        p = seq.params
        lp = None
        if p.logprobs is not None:
            chosen, top = top_logprobs(logits_row, token, p.logprobs)
            lp = [TokenLogprob(token, self._piece(token), chosen, [(t, self._piece(t), v) for t, v in top])]
        detok = self.detoks[seq.request_id]
        is_eos = token in self.eos_ids and not p.ignore_eos
        if is_eos or token in p.stop_token_ids:
            new_text = detok.flush()
            seq.finish_reason = "stop"
        else:
            new_text = detok.add(seq.output_ids)
            if detok.stopped:
                seq.finish_reason = "stop"
                new_text += detok.flush()
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_sequence_tokens:
                seq.finish_reason = "length"
                new_text += detok.flush()
        if seq.finish_reason is not None:
            return self._finish(seq, [token], new_text, lp)
        return self._output(seq, [token], new_text, False, lp)

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _finish(self, seq: Sequence, new_ids: list[int], new_text: str, lp=None) -> RequestOutput:
        self.scheduler.remove(seq)
        self.seqs.pop(seq.request_id, None)
        self.detoks.pop(seq.request_id, None)
        self.sampler.forget(seq.request_id)
        if self.metrics is not None:
            self.metrics.observe_request(time.monotonic() - seq.arrival, seq.finish_reason)
        return self._output(seq, new_ids, new_text, True, lp)

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], new_text: str, finished: bool, lp) -> RequestOutput:
        usage = seq.usage
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=new_text, finished=finished,
            finish_reason=seq.finish_reason if finished else None, num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids), cached_tokens=usage.cached_tokens or 0,
            blended_tokens=usage.blended_tokens, recomputed_tokens=usage.recomputed_tokens, logprobs=lp,
            chunk_tokens_stored=usage.chunk_tokens_stored, chunk_tokens_present=usage.chunk_tokens_present,
            tier_tokens=dict(usage.tier_tokens))

    # ---- observability --------------------------------------------------------------------
    def snapshot(self) -> dict:
        stats = self.cache.stats()
        return dict(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            free_blocks=stats.free_blocks, evictable_blocks=stats.evictable_blocks,
            in_use_blocks=stats.in_use_blocks, total_blocks=stats.total_blocks,
            evicted_blocks=stats.evicted_blocks, preemptions=self.scheduler.num_preemptions,
            tiers=self.tiers.snapshot() if self.tiers is not None else {},
            memory=self.memory(stats),
            **self.counters,
        )

    def memory(self, stats) -> dict:
        """What the pool's memory holds now: cached blocks and their tokens, the blocks running requests
        own and the tokens in them, and the slots that hold nothing (partly filled last blocks, blocks taken
        for a slice not yet computed)."""
        bs = self.pool.block_size
        owned_blocks = owned_tokens = 0
        for seq in self.seqs.values():
            pool = seq.kv
            owned_blocks += len(pool.owned)
            owned_tokens += max(0, pool.num_computed - pool.num_published * bs) + len(pool.filled) * bs
        per_block = self.pool.layout.nbytes
        held = stats.cached_tokens + owned_tokens
        return dict(
            kv_dtype=str(self.pool.dtype).removeprefix("torch."), block_size=bs, bytes_per_block=per_block,
            pool_bytes=self.pool.nbytes, total_blocks=stats.total_blocks, free_blocks=stats.free_blocks,
            cached_blocks=stats.cached_blocks, cached_tokens=stats.cached_tokens,
            sequence_blocks=owned_blocks, sequence_tokens=owned_tokens, held_tokens=held,
            empty_slots=(stats.cached_blocks + owned_blocks) * bs - held,
        )

    def close(self, timeout: float = 10.0) -> bool:
        """The server is stopping and every request has ended (AsyncEngine calls this last, on the engine
        thread): flush what the tiers still have to write (up to `timeout` seconds) and stop their writers."""
        done = self.tiers.close(timeout) if self.tiers is not None else True
        if self.events is not None:
            self.events.close()
        return done

