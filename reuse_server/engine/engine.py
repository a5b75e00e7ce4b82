"""The synchronous engine: requests in, one scheduler step at a time, outputs out. Built by
builder.build_engine; driven by one thread (the AsyncEngine's), which step() asserts.

A step: the scheduler picks the work (Scheduler.schedule), the runner computes it in one forward, the
sampler picks a token for each sequence that generates, and the scheduler takes the result in
(Scheduler.update: advance, stop, finish, release). The engine turns the news into outputs and counts."""
from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
from blend.chunk_index import ChunkIndex
from radix import RadixCache

from reuse_server.engine.blender import Blender
from reuse_server.engine.config import EngineConfig
from reuse_server.engine.detokenizer import IncrementalDetokenizer
from reuse_server.engine.model_names import ModelNames
from reuse_server.engine.outputs import Admission, RequestOutput, TokenLogprob
from reuse_server.engine.runner import ModelRunner
from reuse_server.engine.sampler import Sampler
from reuse_server.engine.sampling_params import CacheOptions, InvalidRequest, PromptTooLong, SamplingParams
from reuse_server.engine.scheduler import Scheduler, StepOutput
from reuse_server.engine.sequence import Sequence
from reuse_server.kv.block_manager import BlockManager
from reuse_server.kv.fingerprint import ModelFingerprint
from reuse_server.kv.pool import KVPool
from reuse_server.kv.sizing import KVSizing
from reuse_server.model.config import ModelConfig

if TYPE_CHECKING:  # imported where configured: redis (tiers) and zmq (events) stay out of a plain server
    from reuse_server.kv.events import KVEvents
    from reuse_server.kv.tiers import KVTiers

log = logging.getLogger(__name__)

# A precompute or prefetch samples nothing; its params only fill the sequence's field.
NO_SAMPLING = SamplingParams(max_tokens=1, temperature=0.0)


@dataclass
class EngineParts:
    """What builder.build_parts made and wired, for LLMEngine to run."""

    config: EngineConfig
    model: torch.nn.Module
    model_config: ModelConfig
    tokenizer: object
    names: ModelNames  # what requests may call the model; names.id is the one answers report
    weight_dtype: str  # what the weights are held in (--weight-dtype, auto resolved)
    fingerprint: ModelFingerprint
    attention_kernel: bool  # the CPU attention kernel serves this model
    attention_backend: str  # --attention-backend, auto resolved (native where its kernel could not serve: torch)
    max_model_len: int
    pool: KVPool
    sizing: KVSizing  # how the pool and the host tier were sized at start, and from what
    cache: RadixCache
    blocks: BlockManager
    chunk_index: ChunkIndex
    blender: Blender
    scheduler: Scheduler
    runner: ModelRunner
    sampler: Sampler
    tiers: KVTiers | None
    events: KVEvents | None


class LLMEngine:
    def __init__(self, parts: EngineParts) -> None:
        self.config = parts.config
        self.model = parts.model
        self.model_config = parts.model_config
        self.tokenizer = parts.tokenizer
        self.names = parts.names
        self.model_id = parts.names.id
        self.weight_dtype = parts.weight_dtype
        self.fingerprint = parts.fingerprint
        self.attention_kernel = parts.attention_kernel
        self.attention_backend = parts.attention_backend
        self.max_model_len = parts.max_model_len
        self.pool = parts.pool
        self.sizing = parts.sizing
        self.cache = parts.cache
        self.blocks = parts.blocks
        self.chunk_index = parts.chunk_index
        self.blender = parts.blender
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.sampler = parts.sampler
        self.tiers = parts.tiers
        self.events = parts.events
        self.eos_ids = self.scheduler.eos_ids  # the scheduler stops on them (builder: the model's and tokenizer's)
        self.vocab_size = self.model_config.vocab_size
        self.seqs: dict[str, Sequence] = {}  # every request in the engine, by id (the engine alone writes it)
        self.prefetches: list[Sequence] = []  # prefetches the pool could not take yet (see prefetch)
        self.metrics = None  # the server's metrics, attached by it (server/metrics.py: wire_metrics)
        # told of each generating request's first admission before the step computes its prompt (AsyncEngine
        # hands it to the request's stream: a long prefill's stream can start before its first token)
        self.on_admitted: Callable[[Admission], None] | None = None
        self.clock = time.monotonic  # what prompt-cache pins expire by (tests pass their own)
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
        return self.scheduler.max_sequence_tokens

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Every check of a request's prompt and sampling parameters, in one place: an entry point calls it
        once, before anything is queued (the API's routes through AsyncEngine.validate_prompt, direct
        callers through add_request). Returns the parameters to run it with: its output limit fitted to the
        room the context leaves and to the server's --max-tokens (output_limit), the one place every route's
        limit (max_tokens, max_completion_tokens, max_output_tokens) is capped."""
        if not prompt_ids:
            raise InvalidRequest("The prompt is empty.", "prompt")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"Token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1}).", "prompt")
        limit = self.max_sequence_tokens
        if len(prompt_ids) >= limit:
            raise PromptTooLong(limit, len(prompt_ids))
        params.validate()
        outside = [t for t in params.logit_bias if not 0 <= t < self.vocab_size]
        if outside:
            raise InvalidRequest(f"logit_bias names token {outside[0]}, outside the vocabulary "
                                 f"(0..{self.vocab_size - 1}).", "logit_bias")
        fitted = self.output_limit(len(prompt_ids), params.max_tokens)
        return params if fitted == params.max_tokens else dataclasses.replace(params, max_tokens=fitted)

    def output_limit(self, prompt_tokens: int, requested: int | None) -> int:
        """The most tokens an answer may have: the request's limit (None: no limit of its own), the room the
        context leaves after the prompt, and --max-tokens, whichever is smallest, as vLLM's get_max_tokens.
        A limit beyond the room left is not an error: clients send their own model's limits (Claude Code
        asks for 32,000 or 64,000 tokens) and expect the answer to end with the length stop reason."""
        limits = (requested, self.max_sequence_tokens - prompt_tokens, self.config.max_tokens)
        return min(limit for limit in limits if limit is not None)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    options: CacheOptions | None = None, arrival: float | None = None) -> Sequence:
        """Validate a request and queue it (for callers that drive the engine directly)."""
        return self.add(request_id, prompt_ids, self.validate(prompt_ids, params), options, arrival)

    def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
            options: CacheOptions | None = None, arrival: float | None = None, generates: bool = True) -> Sequence:
        """Queue a request whose input was validated already (LLMEngine.validate)."""
        self._check_thread()
        if request_id in self.seqs:
            raise InvalidRequest(f"Duplicate request id {request_id!r}.")
        seq = Sequence(request_id, list(prompt_ids), params, options or CacheOptions(), generates=generates)
        if arrival is not None:
            seq.arrival = arrival
        seq.sampling.request_id = request_id
        if generates:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.include_stop_str_in_output)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def precompute(self, request_id: str, prompt_ids: list[int], options: CacheOptions,
                   arrival: float | None = None) -> Sequence:
        """Queue a chunk precompute (POST /v1/cache/chunks): the prompt is computed like any prefill, its
        chunks (options.chunk_spans) are registered in the chunk index, and it ends without sampling; its
        last output says what it stored. The caller validated the prompt."""
        return self.add(request_id, prompt_ids, NO_SAMPLING, options, arrival, generates=False)

    def prefetch(self, request_id: str, prompt_ids: list[int], options: CacheOptions) -> RequestOutput | None:
        """Pull the prompt's cached blocks from the tiers up into the pool and the radix tree now, computing
        nothing (POST /v1/cache/prefetch): an admission by the block manager that is released at once. Its
        output says how many prompt tokens are resident and where they came from. None when the pool cannot
        take even that now (every block held by running requests): it is tried again before each step, and
        its output then comes from step(). The caller validated the prompt."""
        self._check_thread()
        if request_id in self.seqs:
            raise InvalidRequest(f"Duplicate request id {request_id!r}.")
        seq = Sequence(request_id, list(prompt_ids), NO_SAMPLING, options, generates=False)
        out = self._prefetch(seq)
        if out is None:
            self.seqs[request_id] = seq
            self.prefetches.append(seq)
        return out

    def _prefetch(self, seq: Sequence) -> RequestOutput | None:
        # as a request with these options would be admitted: a blending one may match blended KV too
        approximate = self.blender.approximate_namespace(seq) if self.scheduler.blends(seq) else None
        admission = self.blocks.admit(seq, 0, approximate, fill_holes=False)
        if admission is None:
            return None
        self.blocks.release(seq)
        seq.finish_reason = "stop"
        self._observe_end(seq)
        return RequestOutput(request_id=seq.request_id, new_token_ids=[], new_text="", finished=True,
                             finish_reason="stop", num_prompt_tokens=len(seq.prompt_ids), num_output_tokens=0,
                             cached_tokens=admission.cached_tokens, tier_tokens=dict(admission.by_tier))

    def abort(self, request_id: str) -> RequestOutput | None:
        self._check_thread()
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq in self.prefetches:
            self.prefetches.remove(seq)
            seq.finish_reason = "abort"
        else:
            self.scheduler.abort(seq)
        self._observe_end(seq)
        return self._output(seq, [], "", True, None)

    def block_hashes(self, prompt_ids: list[int], options: CacheOptions | None = None) -> list[bytes]:
        """The identities of the prompt's full blocks as this engine files them: the same in every process and
        on every server with the same model fingerprint (see radix.hashing)."""
        return self.cache.hasher.hash_blocks(prompt_ids, (options or CacheOptions()).namespace)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self.prefetches)

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule, run the forward, sample, and let the scheduler take in the result (Scheduler.update
        advances, stops, finishes and releases); the outputs of the requests with news."""
        self._check_thread()
        outputs = []
        for seq in list(self.prefetches):  # parked prefetches first: their blocks are up before anyone is admitted
            if (out := self._prefetch(seq)) is not None:
                self.prefetches.remove(seq)
                del self.seqs[seq.request_id]
                outputs.append(out)
        slices = self.scheduler.schedule(self.clock())
        self._report_admissions()
        slices = [c for c in slices if c.num_tokens]
        if not slices:
            return outputs
        want = [c.reaches_end for c in slices]
        start = time.perf_counter()
        logits = self._forward(slices, want)  # a row per slice that wants one, in order
        if self.tiers is not None:  # the prefill rate, against which tier fetches are weighed
            prefill = sum(c.num_tokens for c in slices if c.num_tokens > 1)
            if prefill:
                self.tiers.observe_prefill(prefill, time.perf_counter() - start)
        ends = [c.seq for c in slices if c.reaches_end]  # a row of logits each, in order
        rows = [row for row, seq in enumerate(ends) if seq.generates]
        seqs = [ends[row] for row in rows]
        tokens, logprobs = [], {}
        if seqs:
            picked = logits if len(rows) == logits.shape[0] else logits[rows]  # a decode step keeps them all
            # the step's one copy from the device: the tokens, and the logprobs asked for (sampler._to_host)
            sampled = self.sampler.pick(picked, [s.sampling for s in seqs], [s.params for s in seqs],
                                        [(s.prompt_ids, s.output_ids) for s in seqs])
            tokens = sampled.tokens
            for seq, token, lp in zip(seqs, tokens, sampled.logprobs):
                if lp is not None:
                    logprobs[seq] = self._logprobs(token, *lp)
        for update in self.scheduler.update(StepOutput(slices, dict(zip(seqs, tokens)))):
            seq = update.seq
            if update.prompt_done:
                self._count_usage(seq)
            if update.first_token and self.metrics is not None:
                self.metrics.observe_ttft(seq.usage.first_token_time - seq.arrival)
            self.counters["generation_tokens"] += len(update.new_token_ids)
            finished = seq.finish_reason is not None
            if finished:
                del self.seqs[seq.request_id]
                self._observe_end(seq)
            outputs.append(self._output(seq, update.new_token_ids, update.new_text, finished, logprobs.get(seq)))
        return outputs

    def _report_admissions(self) -> None:
        for seq in self.scheduler.take_admitted():
            if seq.generates and self.on_admitted is not None:
                usage = seq.usage
                self.on_admitted(Admission(seq.request_id, len(seq.prompt_ids), usage.cached_tokens,
                                           dict(usage.tier_tokens),
                                           self.scheduler.breakpoint_writes(seq, usage.cached_tokens)))

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

    def _count_usage(self, seq: Sequence) -> None:
        usage = seq.usage
        n = len(seq.prompt_ids)
        self.counters["prompt_tokens"] += n
        if self.blocks.enable_prefix_cache and seq.uses_prefix_cache:
            self.counters["prefix_query_tokens"] += n
            self.counters["prefix_hit_tokens"] += (usage.cached_tokens or 0) - usage.blended_tokens
        self.counters["blended_tokens"] += usage.blended_tokens
        self.counters["recomputed_tokens"] += usage.recomputed_tokens

    def _logprobs(self, token: int, chosen: float, top: list[tuple[int, float]]) -> list[TokenLogprob]:
        return [TokenLogprob(token, self._piece(token), chosen, [(t, self._piece(t), v) for t, v in top])]

    def _piece(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def _observe_end(self, seq: Sequence) -> None:
        if self.metrics is not None:
            self.metrics.observe_request(time.monotonic() - seq.arrival, seq.finish_reason)

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], new_text: str, finished: bool, lp) -> RequestOutput:
        usage = seq.usage
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=new_text, finished=finished,
            finish_reason=seq.finish_reason if finished else None, num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids), cached_tokens=usage.cached_tokens or 0,
            blended_tokens=usage.blended_tokens, recomputed_tokens=usage.recomputed_tokens,
            recomputed_positions=usage.recomputed_positions, logprobs=lp,
            chunk_tokens_stored=usage.chunk_tokens_stored, chunk_tokens_present=usage.chunk_tokens_present,
            tier_tokens=dict(usage.tier_tokens), cache_write_tokens=usage.cache_write_tokens,
            breakpoint_write_tokens=dict(usage.breakpoint_write_tokens))

    # ---- observability --------------------------------------------------------------------
    def snapshot(self) -> dict:
        stats = self.cache.stats()
        return dict(
            pins=dict(pinned_blocks=stats.pinned_blocks, pinned_tokens=stats.pinned_blocks * self.pool.block_size,
                      pins=len(self.blocks.pins), given_way=self.blocks.pins_given_way,
                      budget_blocks_per_tenant=self.blocks.pin_budget,
                      tenants=self.blocks.pins.stats(self.clock(), self.pool.block_size,
                                                    self.blocks.given_way_by_tenant)),
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            free_blocks=stats.free_blocks, evictable_blocks=stats.evictable_blocks,
            in_use_blocks=stats.in_use_blocks, total_blocks=stats.total_blocks,
            evicted_blocks=stats.evicted_blocks, preemptions=self.scheduler.num_preemptions,
            tiers=self.tiers.snapshot() if self.tiers is not None else {},
            memory=self.memory(stats),
            **self.counters,
            **self.blend_counters(),
        )

    def blend_counters(self) -> dict:
        """What blending's chunk index and fidelity check did since the start (the blend section of
        /v1/cache/stats; the Prometheus counters of the same names)."""
        blender = self.blender
        return dict(blend_registered_chunks=blender.registered_chunks if blender else 0,
                    blend_rejected_chunks=blender.rejected_chunks if blender else 0,
                    blend_rejected_tokens=blender.rejected_tokens if blender else 0,
                    # the check's threshold as calibrated (--blend-max-deviation auto) or given; inf: off
                    blend_max_deviation=blender.settings.fidelity.max_deviation if blender else math.inf)

    def memory(self, stats) -> dict:
        """What the pool's memory holds now: cached blocks and their tokens, the blocks running requests
        own and the tokens in them, and the slots that hold nothing (partly filled last blocks, blocks taken
        for a slice not yet computed)."""
        bs = self.pool.block_size
        owned_blocks = owned_tokens = 0
        for seq in self.seqs.values():
            kv = seq.kv
            owned_blocks += len(kv.owned)
            owned_tokens += max(0, kv.num_computed - kv.num_published * bs) + len(kv.filled) * bs
        held = stats.cached_tokens + owned_tokens
        pool = self.pool.memory(stats.total_blocks - stats.free_blocks)
        return dict(
            kv_dtype=pool.kv_dtype, block_size=bs, bytes_per_block=pool.bytes_per_block,
            pool_bytes=pool.pool_bytes, total_blocks=stats.total_blocks, free_blocks=stats.free_blocks,
            cached_blocks=stats.cached_blocks, cached_tokens=stats.cached_tokens,
            sequence_blocks=owned_blocks, sequence_tokens=owned_tokens, held_tokens=held,
            empty_slots=(stats.cached_blocks + owned_blocks) * bs - held,
            held_bytes=pool.held_bytes,  # the KV bytes the used blocks take
            # a hybrid model's window layers, in a pool of their own: parts running requests pin, cached, free
            **pool.window,
        )

    def close(self, timeout: float = 10.0) -> bool:
        """The server is stopping and every request has ended (AsyncEngine calls this last, on the engine
        thread): flush what the tiers still have to write (up to `timeout` seconds) and stop their writers."""
        done = self.tiers.close(timeout) if self.tiers is not None else True
        if self.events is not None:
            self.events.close()
        return done

