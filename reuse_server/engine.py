"""The synchronous engine: requests in, one scheduler step at a time, outputs out."""
from __future__ import annotations

import ctypes
import logging
import threading
import time
from pathlib import Path

import torch
from radix import RadixCache

from blend.chunk_index import ChunkIndex

from reuse_server.block_manager import BlockManager
from reuse_server.blending import Blender, BlendSettings
from reuse_server.config import EngineConfig
from reuse_server.detokenizer import IncrementalDetokenizer
from reuse_server.key_shift_calibration import load_or_calibrate
from reuse_server.kv_pool import KVPool
from reuse_server.model.loader import load_model, load_tokenizer, model_source, resolve_model
from reuse_server.model.weight_dtype import choose as choose_weight_dtype
from reuse_server.outputs import RequestOutput, TokenLogprob
from reuse_server.runner import ModelRunner
from reuse_server.sampler import Sampler, top_logprobs
from reuse_server.sampling_params import CacheOptions, InvalidRequest, SamplingParams
from reuse_server.scheduler import Scheduler
from reuse_server.sequence import SeqStatus, Sequence

log = logging.getLogger(__name__)


def _return_freed_memory() -> None:
    """Give the heap memory that loading freed (dense weights copied into packed layouts, conversion and
    calibration temporaries) back to the system: glibc keeps freed chunks below its mmap threshold mapped,
    and they showed as ~90 MiB of resident memory after start (BENCHMARKS.md, Memory)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(table)}")
    return table[name]


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.built_on = threading.get_ident()  # the thread whose OpenMP pool did the loading (AsyncEngine)
        dtype = resolve_dtype(config.dtype, config.device)
        self.weight_dtype, why = choose_weight_dtype(config.weight_dtype, model_source(config.model), config.device, dtype)
        log.info("weights in %s (%s)", self.weight_dtype, why)
        path = resolve_model(config.model, self.weight_dtype)
        self.model, self.model_config = load_model(path, dtype=dtype, device=config.device, weight_dtype=self.weight_dtype)
        if config.cpu_matmul not in ("native", "onednn", "torch"):
            raise ValueError(f"unknown cpu_matmul {config.cpu_matmul!r}; choose native, onednn or torch")
        self.model.pack_for_cpu(config.cpu_matmul)
        if config.cpu_attention not in ("native", "torch"):
            raise ValueError(f"unknown cpu_attention {config.cpu_attention!r}; choose native or torch")
        # Only fp32 on the CPU runs through the kernel; elsewhere it would be built for nothing.
        on_cpu_fp32 = torch.device(config.device).type == "cpu" and dtype == torch.float32
        self.attention_kernel = config.cpu_attention == "native" and on_cpu_fp32 and self.model.use_cpu_attention_kernel()
        self.tokenizer = load_tokenizer(path)
        self.model_id = config.served_model_name or _default_model_id(config.model)
        mc = self.model_config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)

        bs = config.block_size
        if config.num_gpu_blocks:
            num_blocks = config.num_gpu_blocks
        else:
            per_block = KVPool.bytes_per_block(mc.num_layers, bs, mc.num_kv_heads, mc.head_dim, dtype)
            num_blocks = config.kv_cache_memory // per_block
        if num_blocks < 2:
            raise ValueError(f"the KV cache holds only {num_blocks} blocks; give it more memory")
        self.kv = KVPool(mc.num_layers, num_blocks, bs, mc.num_kv_heads, mc.head_dim, dtype, config.device)
        self.cache = RadixCache(num_blocks, bs, hash_algo=config.hash_algo, seed=config.seed, policy=config.eviction_policy)
        self.blocks = BlockManager(self.cache, bs, config.enable_prefix_cache, self._copy_blocks)
        self.chunk_index = ChunkIndex(self.cache, bs, self.model_id, pad_token=mc.vocab_size,
                                      min_tokens=config.blend_min_tokens)
        self.blender = Blender(self.model, self.kv, self.chunk_index, BlendSettings(
            recompute_ratio=config.blend_recompute_ratio, check_layers=tuple(config.blend_check_layers),
            gradual_factors=tuple(config.blend_gradual_factors), score=config.blend_score,
            first_tokens=config.blend_first_tokens, min_chunk_tokens=config.blend_min_tokens,
            query_weight=config.blend_query_weight), bs,
            key_shift=load_or_calibrate(self.model, self.tokenizer, path, dtype, config.device)
            if config.blend_key_shift else None)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.blender, config.enable_blend, config.dedup_prefill)
        self.runner = ModelRunner(self.model, self.kv, bs, config.device)
        self.sampler = Sampler()
        self.eos_ids = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        self.vocab_size = mc.vocab_size
        self.seqs: dict[str, Sequence] = {}
        self.detoks: dict[str, IncrementalDetokenizer] = {}
        self.metrics = None  # ServerMetrics, attached by the server
        self.counters = dict(prompt_tokens=0, generation_tokens=0, prefix_query_tokens=0, prefix_hit_tokens=0,
                             blended_tokens=0, recomputed_tokens=0)
        _return_freed_memory()

    # ---- requests -------------------------------------------------------------------------
    @property
    def max_sequence_tokens(self) -> int:
        """The longest sequence the engine can hold: the context, or the whole KV pool if smaller."""
        return min(self.max_model_len, self.kv.num_blocks * self.config.block_size)

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
        seq = self.seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = "abort"
        return self._finish(seq, [], "")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        chunks = self.scheduler.schedule()
        if not chunks:
            return []
        plain = [c for c in chunks if c.seq.blend_plan is None]
        want = [c.seq.num_computed + c.num_tokens == c.seq.num_tokens for c in plain]
        rows: dict[int, torch.Tensor] = {}  # id(seq) -> next-token logits
        if plain:
            logits = self.runner.run(plain, want)
            sampled_plain = [c.seq for c, w in zip(plain, want) if w]
            rows.update((id(seq), logits[i]) for i, seq in enumerate(sampled_plain))
        for c in chunks:
            if c.seq.blend_plan is not None:
                c.seq.reused_starts = c.seq.blend_plan.chunk_starts
                rows[id(c.seq)] = self.blender.prefill(c.seq, c.seq.blend_plan)[0]
                c.seq.blend_plan = None
                if c.seq.blended_tokens:  # anything not recomputed makes the KV approximate
                    self.blocks.make_approximate(c.seq)
        outputs = []
        for c in chunks:
            seq = c.seq
            seq.num_computed += c.num_tokens
            self.blocks.publish(seq)
            if id(seq) not in rows:
                continue
            if not seq.counted:
                self._prompt_done(seq)
            if seq.cache.precompute_only:
                seq.finish_reason = "stop"
                outputs.append(self._finish(seq, [], ""))
        pending = [c.seq for c in chunks if id(c.seq) in rows and not c.seq.cache.precompute_only]
        if not pending:
            return outputs
        tokens = self.sampler.sample(torch.stack([rows[id(s)] for s in pending]),
                                     [s.request_id for s in pending], [s.params for s in pending],
                                     [(s.prompt_ids, s.output_ids) for s in pending])
        for seq, token in zip(pending, tokens):
            outputs.append(self._append_token(seq, token, rows[id(seq)]))
        return outputs

    def _prompt_done(self, seq: Sequence) -> None:
        """The prompt's KV is complete for the first time: count its usage, register its chunks."""
        self._count_usage(seq)
        if seq.cache.precompute_only or self.scheduler.blends(seq):
            seq.chunk_tokens_stored, seq.chunk_tokens_present = self.blender.register(seq, skip=seq.reused_starts)

    def _count_usage(self, seq: Sequence) -> None:
        seq.counted = True
        n = len(seq.prompt_ids)
        self.counters["prompt_tokens"] += n
        if self.blocks.enable_prefix_cache and seq.uses_prefix_cache:
            self.counters["prefix_query_tokens"] += n
            self.counters["prefix_hit_tokens"] += seq.cached_tokens - seq.blended_tokens
        self.counters["blended_tokens"] += seq.blended_tokens
        self.counters["recomputed_tokens"] += seq.recomputed_tokens

    def _append_token(self, seq: Sequence, token: int, logits_row: torch.Tensor) -> RequestOutput:
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
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
        seq.status = SeqStatus.FINISHED
        self.seqs.pop(seq.request_id, None)
        self.detoks.pop(seq.request_id, None)
        self.sampler.forget(seq.request_id)
        if self.metrics is not None:
            self.metrics.observe_request(time.monotonic() - seq.arrival, seq.finish_reason)
        return self._output(seq, new_ids, new_text, True, lp)

    @staticmethod
    def _output(seq: Sequence, new_ids: list[int], new_text: str, finished: bool, lp) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id, new_token_ids=new_ids, new_text=new_text, finished=finished,
            finish_reason=seq.finish_reason if finished else None, num_prompt_tokens=len(seq.prompt_ids),
            num_output_tokens=len(seq.output_ids), cached_tokens=seq.cached_tokens or 0,
            blended_tokens=seq.blended_tokens, recomputed_tokens=seq.recomputed_tokens, logprobs=lp,
            chunk_tokens_stored=seq.chunk_tokens_stored, chunk_tokens_present=seq.chunk_tokens_present)

    def _copy_blocks(self, src: list[int], dst: list[int]) -> None:
        device = self.kv.k[0].device
        self.kv.copy_blocks(torch.tensor(src, device=device), torch.tensor(dst, device=device))

    # ---- observability --------------------------------------------------------------------
    def snapshot(self) -> dict:
        stats = self.cache.stats()
        return dict(
            running=len(self.scheduler.running), waiting=len(self.scheduler.waiting),
            free_blocks=stats.free_blocks, evictable_blocks=stats.evictable_blocks,
            in_use_blocks=stats.in_use_blocks, total_blocks=stats.total_blocks,
            evicted_blocks=stats.evicted_blocks, preemptions=self.scheduler.num_preemptions,
            **self.counters,
        )


def _default_model_id(model: str | None) -> str:
    if model is None or model.lower() in BUNDLED_NAMES:
        return "SmolLM2-135M-Instruct"
    name = Path(model.rstrip("/")).name
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


BUNDLED_NAMES = {"smollm2", "smollm2-135m-instruct", "bundled"}
