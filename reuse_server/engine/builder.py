"""Building an engine: validate the config once, load the model, and make and wire the parts. The engine
receives the finished parts (engine.EngineParts) and only runs them.

Order matters in three places: the fingerprint digests the weights as loaded, before they are packed for the
CPU kernels (packing drops the dense copies); the pool is sized from the model's shapes; the key shift is
calibrated (once per model, then read from disk) through the model's own forward."""
from __future__ import annotations

import ctypes
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from blend.chunk_index import ChunkIndex
from blend.chunking import whitespace_tokens
from blend.content_cuts import ContentDefinedCuts, ParagraphCuts, WholeSpans
from blend.fidelity import FidelityCheck
from radix import Listeners, RadixCache

from reuse_server.kv.block_manager import BlockManager
from reuse_server.engine.blender import Blender, BlendSettings, layer_inv_freq
from reuse_server.engine.cache_sizing import size_kv_cache
from reuse_server.engine.config import EngineConfig, resolve_attention_backend, resolve_dtype
from reuse_server.engine.engine import EngineParts, LLMEngine
from reuse_server.kv.fingerprint import ModelFingerprint, fingerprint
from reuse_server.kv import quant as kv_quant
from reuse_server.engine.fidelity_calibration import load_or_calibrate_threshold
from reuse_server.engine.key_shift_calibration import load_or_calibrate
from reuse_server.engine.model_names import ModelNames, model_names
from reuse_server.kv.layered_pool import LayeredKVPool
from reuse_server.kv.pool import KVPool
from reuse_server.kv.sizing import KVSizing
from reuse_server.model.config import ModelConfig
from reuse_server.model.loader import load_model, load_tokenizer, model_source, resolve_model
from reuse_server.model.weight_dtype import choose as choose_weight_dtype
from reuse_server.engine.decode_graphs import static_decode_problem
from reuse_server.engine.decode_inputs import StaticDecodeInputs
from reuse_server.engine.runner import ModelRunner
from reuse_server.engine.sampler import Sampler
from reuse_server.engine.scheduler import Scheduler

if TYPE_CHECKING:  # imported where configured: redis (tiers) and zmq (events) stay out of a plain server
    from reuse_server.kv.events import KVEvents
    from reuse_server.kv.tiers import KVTiers

log = logging.getLogger(__name__)


def fidelity_threshold(config: EngineConfig, model, tokenizer, path: Path | None, dtype, key_shift) -> float:
    """--blend-max-deviation: the number given, or (auto) the one calibrated for this model and first check
    layer. A model built in the process has no folder to keep a calibration in: its check is off."""
    if config.blend_max_deviation is not None:
        return config.blend_max_deviation
    if path is None:
        log.info("no model folder to keep a fidelity calibration in: the blending fidelity check is off")
        return math.inf
    return load_or_calibrate_threshold(model, tokenizer, path, dtype, config.device, config.blend_check_layers[0],
                                       key_shift)


def build_engine(config: EngineConfig, loaded: "LoadedModel | None" = None) -> LLMEngine:
    """A ready LLMEngine for `config` (ValueError for bad settings, ModelLoadError for a bad model), around
    `loaded` if given."""
    return LLMEngine(build_parts(config, loaded))


@dataclass
class LoadedModel:
    """A model ready to be served and where it came from: what build_parts loads for config.model, or one built
    in the process (benchmarks/gpu_check.py: random weights in a checkpoint's shape, which no file holds)."""
    model: torch.nn.Module
    model_config: ModelConfig
    tokenizer: object
    weight_dtype: str
    path: Path | None  # the folder it was loaded from (the key shift's calibration is kept per folder)


def load(config: EngineConfig, dtype: torch.dtype) -> LoadedModel:
    weight_dtype, why = choose_weight_dtype(config.weight_dtype, model_source(config.model), config.device, dtype)
    log.info("weights in %s (%s)%s", weight_dtype, why, "; their products on int8 activations (--activation-dtype "
             "int8: logits not fp32 activations')" if config.activation_dtype == "int8" else "")
    path = resolve_model(config.model, weight_dtype)
    model, mc = load_model(path, dtype=dtype, device=config.device, weight_dtype=weight_dtype)
    return LoadedModel(model, mc, load_tokenizer(path), weight_dtype, path)


def build_parts(config: EngineConfig, loaded: LoadedModel | None = None) -> EngineParts:
    """The parts for `config`, around `loaded` if given (else the model config.model names, loaded here)."""
    config.validate()
    dtype = resolve_dtype(config.dtype, config.device)
    if loaded is None:
        loaded = load(config, dtype)
    model, mc, tokenizer, path, weight_dtype = (loaded.model, loaded.model_config, loaded.tokenizer, loaded.path,
                                                loaded.weight_dtype)
    bs = config.block_size
    kv_dtype = kv_quant.pool_dtype(config.kv_dtype, dtype)
    identity = fingerprint(model, mc, tokenizer, dtype, kv_dtype, bs, config.hash_algo, config.activation_dtype)
    model.pack_for_cpu(config.cpu_matmul, config.activation_dtype)
    attention_backend = _use_attention_backend(model, config, dtype)
    attention_kernel = attention_backend == "native"

    sizing = size_kv_cache(config, mc, dtype)  # after the weights: what they hold is no longer available
    pool = build_pool(config, mc, kv_dtype, dtype, sizing.pool_bytes)
    if attention_backend == "triton":
        pool.use_triton_kernels()  # the store (and an 8-bit pool's re-RoPE) in Triton beside its attention
    static_decode = _static_decode(config, attention_backend, pool)
    # static decode buffers pad a batch with rows that write a scratch block: the last, which the cache never
    # hands out
    num_blocks = pool.num_blocks - 1 if static_decode else pool.num_blocks
    sizing.pool_blocks, sizing.pool_tokens = num_blocks, num_blocks * bs
    if config.num_gpu_blocks:
        sizing.pool_bytes = pool.nbytes
    log.info("%s", sizing.log_line())
    tiers = build_tiers(config, pool, identity, sizing.host_tier_bytes)
    events = None
    if config.kv_events:
        from reuse_server.kv.events import KVEvents

        events = KVEvents(config.kv_events, bs, config.kv_events_replay)
    listeners = Listeners(tiers, events)
    cache = RadixCache(num_blocks, bs, hash_algo=config.hash_algo, identity=identity.identity,
                       policy=config.eviction_policy, listener=listeners)
    if events is not None:
        events.root = cache.hasher.root
        if tiers is not None:
            tiers.events = events
    blocks = BlockManager(cache, bs, config.enable_prefix_cache, pool.copy_blocks, pool.clear_blocks, tiers,
                          pool.window_policy(), config.max_pinned_share)
    listeners.listeners.append(blocks)  # last: the tiers copy an evicted block out before its window part goes
    chunk_index = ChunkIndex(blocks, bs, pad_token=mc.vocab_size, min_tokens=config.blend_min_tokens)
    if config.blend_key_shift and path is None:
        raise ValueError("the key shift is calibrated per model folder: a model built in the process needs "
                         "blend_key_shift=False")
    key_shift = load_or_calibrate(model, tokenizer, path, dtype, config.device) if config.blend_key_shift else None
    settings = BlendSettings(
        recompute_ratio=config.blend_recompute_ratio, check_layers=tuple(config.blend_check_layers),
        gradual_factors=tuple(config.blend_gradual_factors), score=config.blend_score,
        selection=config.blend_strategy(), min_chunk_tokens=config.blend_min_tokens,
        fidelity=FidelityCheck(fidelity_threshold(config, model, tokenizer, path, dtype, key_shift)))
    cuts = (ParagraphCuts(ContentDefinedCuts.around(config.blend_chunk_tokens, config.blend_min_tokens),
                          whitespace_tokens(tokenizer))
            if config.blend_chunk_tokens else WholeSpans())
    blender = Blender(pool, blocks, chunk_index, settings, mc.num_layers, layer_inv_freq(model), mc.attention_scale,
                      key_shift, cuts)
    max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    eos_ids = set(mc.eos_token_ids) | ({tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set())
    # the longest sequence the engine holds: the context, or the whole pool if smaller
    longest = min(max_model_len, num_blocks * bs)
    scheduler = Scheduler(blocks, config.max_num_seqs, config.max_num_batched_tokens, blender, config.enable_blend,
                          config.dedup_prefill, eos_ids, longest)
    decode_inputs = None
    if static_decode:
        decode_inputs = StaticDecodeInputs(config.max_num_seqs, -(-longest // bs), bs, pool.num_blocks - 1,
                                           config.device, (mc.num_heads, mc.num_kv_heads, mc.head_dim))
    runner = ModelRunner(model, pool, config.device, decode_inputs)
    if config.cuda_graphs:
        runner.capture_graphs()
    parts = EngineParts(
        config=config, model=model, model_config=mc, tokenizer=tokenizer,
        names=model_names(config.model, config.served_model_name), weight_dtype=weight_dtype,
        fingerprint=identity,
        attention_kernel=attention_kernel, attention_backend=attention_backend,
        max_model_len=max_model_len,
        pool=pool, sizing=sizing, cache=cache, blocks=blocks, chunk_index=chunk_index, blender=blender, scheduler=scheduler,
        runner=runner, sampler=Sampler(), tiers=tiers,
        events=events)
    log.info("model fingerprint %s; KV pool %d blocks of %d tokens in %s, %.0f bytes a token (%.0f MiB)",
             identity.short, num_blocks, bs, kv_quant.spec(pool.dtype).name, pool.bytes_per_token, pool.nbytes / 2**20)
    if pool.layered:
        log.info("the %d sliding-window layers' KV (window %d) in a pool of its own: %d blocks, %.0f bytes a token",
                 len(pool.window_layers), pool.window, pool.parts.num_window_blocks - 1, pool.window_bytes_per_token)
    _return_freed_memory()
    return parts


def _use_attention_backend(model, config: EngineConfig, dtype: torch.dtype) -> str:
    """Point the model's attention at --attention-backend's kernel; returns the backend that serves it."""
    backend = resolve_attention_backend(config.attention_backend, config.device)
    device = torch.device(config.device)
    if backend == "triton":
        try:
            from reuse_server.model.attention_triton import runs_on
        except ImportError as exc:
            raise ValueError(f"--attention-backend triton needs triton installed: {exc}") from exc
        if not runs_on(device):
            raise ValueError(f"--attention-backend triton runs on CUDA, or on the CPU in Triton's interpreter "
                             f"(TRITON_INTERPRET=1 in the environment), not on {device}")
        model.use_triton_attention()
        return backend
    # Only fp32 on the CPU runs through the native kernel; elsewhere it would be built for nothing.
    on_cpu_fp32 = device.type == "cpu" and dtype == torch.float32
    if backend == "native" and on_cpu_fp32 and model.use_cpu_attention_kernel():
        return backend
    return "torch"


def _static_decode(config: EngineConfig, attention_backend: str, pool) -> bool:
    """Whether decode steps run on static input buffers (decode_inputs.py): with the Triton attention on a pool
    of one layer group (and so wherever --cuda-graphs replays them, which needs them)."""
    problem = static_decode_problem(pool)
    if config.cuda_graphs and problem:
        raise ValueError(f"--cuda-graphs: {problem}")
    return attention_backend == "triton" and problem is None


def build_pool(config: EngineConfig, mc: ModelConfig, kv_dtype, dtype, memory: int) -> "KVPool | LayeredKVPool":
    """The KV pool in `memory` bytes (or config.num_gpu_blocks): one for every layer, or for a hybrid model
    (full-attention and sliding-window layers) the layered pool, whose window layers keep only what a window
    needs (config.window_kv_share)."""
    bs, heads, hd = config.block_size, mc.num_kv_heads, mc.head_dim
    windows = tuple(mc.layer_window(layer) for layer in range(mc.num_layers))
    kinds = {w is None for w in windows}
    if config.window_kv_share is not None and kinds == {True, False} and len({w for w in windows if w}) == 1:
        if config.num_gpu_blocks:
            num_blocks = config.num_gpu_blocks
            num_window = config.num_window_blocks or max(2, int(num_blocks * config.window_kv_share))
        else:
            num_blocks, num_window = LayeredKVPool.split_memory(memory, windows, bs, heads, hd,
                                                                kv_dtype, config.window_kv_share)
            if config.num_window_blocks:
                num_window = config.num_window_blocks
        # every running sequence pins its window and its next slice: fewer parts than that could stall them all
        window = next(w for w in windows if w)
        least = config.max_num_seqs * (-(-window // bs) + 1) + -(-config.max_num_batched_tokens // bs) + 1
        if num_window < least and not config.num_window_blocks:
            num_window = least
        one = -(-window // bs) + 1 + -(-config.max_num_batched_tokens // bs) + 1  # one sequence's window and slice
        if num_window - 1 < one:
            raise ValueError(f"{num_window} window blocks cannot hold one sequence's window ({window} tokens) and "
                             f"a slice of {config.max_num_batched_tokens} tokens: give at least {one + 1}")
        if num_blocks < 2:
            raise ValueError(f"the KV cache holds only {num_blocks} blocks; give it more memory")
        return LayeredKVPool(windows, num_blocks, num_window, bs, heads, hd, kv_dtype, config.device,
                             read_dtype=dtype)
    if config.num_gpu_blocks:
        num_blocks = config.num_gpu_blocks
    else:
        num_blocks = memory // KVPool.bytes_per_block(mc.num_layers, bs, heads, hd, kv_dtype)
    if num_blocks < 2:
        raise ValueError(f"the KV cache holds only {num_blocks} blocks; give it more memory")
    return KVPool(mc.num_layers, num_blocks, bs, heads, hd, kv_dtype, config.device, read_dtype=dtype)


MIN_WRITE_QUEUE_BYTES = 256 << 20  # a disk or Redis writer's queue, whatever the step


def build_tiers(config: EngineConfig, pool: KVPool, identity: ModelFingerprint, host_bytes: int) -> KVTiers | None:
    """The tiers the config asks for below the pool, the host tier in host_bytes (None: none)."""
    if not (host_bytes or config.disk_cache_dir or config.redis_url):
        return None
    from reuse_server.kv.tiers import BlobContext, DiskTier, HostTier, KVTiers, RedisTier
    from reuse_server.kv.tiers.host_memory import host_memory_for

    tier_dtype = None if config.tier_kv_dtype == "auto" else kv_quant.storage_dtype(config.tier_kv_dtype)
    layout = pool.layout_for(tier_dtype)
    # A copy in another dtype than the pool's is another block: its files and keys live apart
    name = identity.identity.hex() + ("" if tier_dtype is None else "-" + kv_quant.spec(tier_dtype).name)
    ctx = BlobContext(fingerprint=name, block_size=pool.block_size, hash_algo=identity.hash_algo,
                      layout=layout.describe(), kv_bytes=layout.nbytes)
    # A writer's queue takes the blocks of two full steps: a prompt as long as a step is written through
    # whole even while the step before it is still being written (past the bound, blocks are dropped)
    queue = max(MIN_WRITE_QUEUE_BYTES, 2 * config.max_num_batched_tokens // pool.block_size * layout.nbytes)
    host = HostTier(host_bytes, memory=host_memory_for(pool.device)) if host_bytes else None
    from reuse_server.kv.tiers.reads import read_buffer  # pinned for a CUDA pool: its loads copy asynchronously

    disk = (DiskTier(Path(config.disk_cache_dir), config.disk_cache_size, ctx, max_queue_bytes=queue,
                     reads=read_buffer(layout.nbytes, pool.device)) if config.disk_cache_dir else None)
    remote = (RedisTier(config.redis_url, ctx, timeout=config.redis_timeout, max_queue_bytes=queue,
                        reads=read_buffer(layout.nbytes, pool.device)) if config.redis_url else None)
    log.info("KV tiers: %s", ", ".join(t.name for t in (host, disk, remote) if t is not None))
    return KVTiers(pool, host, disk, remote, config.disk_write_policy, tier_dtype, fetch=config.tier_fetch,
                   host_write_policy=config.host_write_policy)


def _return_freed_memory() -> None:
    """Give the heap memory that loading freed (dense weights copied into packed layouts, conversion and
    calibration temporaries) back to the system: glibc keeps freed allocations below its mmap threshold mapped,
    where they would count as resident memory after start."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass
