"""Engine settings, one place; the CLI fills it from flags."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    model: str | None = None  # bundled name, a .gguf file, or an HF checkpoint folder; None: the bundled SmolLM2
    served_model_name: str | None = None  # id shown in /v1/models; default: derived from the model
    device: str = "cpu"
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    # the matrices' storage, independent of the compute dtype: fp32 (as --dtype), bf16, int8, int4 (group-wise
    # scales; the output head in at least int8), or auto: the narrowest within measured quality bounds
    # (model/weight_dtype.py)
    weight_dtype: str = "auto"
    # linear layers on weights packed once (model/cpu_linear.py): native kernel (fp32; else oneDNN), onednn, or
    # torch (F.linear)
    cpu_matmul: str = "native"
    cpu_attention: str = "native"  # native: the paged attention kernel (model/cpu_attention.cpp); torch: SDPA
    block_size: int = 16
    num_gpu_blocks: int | None = None  # exact pool size in blocks; overrides kv_cache_memory
    kv_cache_memory: int = 1 << 30  # bytes for the KV pool
    max_num_seqs: int = 16  # running sequences at once
    max_num_batched_tokens: int = 2048  # token budget per scheduler step (chunked prefill)
    max_model_len: int | None = None  # default: the model's max positions
    enable_prefix_cache: bool = True
    dedup_prefill: bool = True  # a request waits for blocks another request is computing instead of computing them too
    hash_algo: str = "xxh3_128"
    eviction_policy: str = "lru"
    seed: int = 0
    # non-prefix reuse (blending)
    enable_blend: bool = False  # default for requests that don't say; the chunk index exists either way
    blend_recompute_ratio: float = 0.15
    blend_check_layers: tuple[int, ...] = (1,)
    blend_gradual_factors: tuple[float, ...] = (1.0,)
    blend_score: str = "kv"  # K+V deviation: best of k, v, kv on the needle benchmark (BENCHMARKS.md)
    blend_first_tokens: int = 0
    blend_query_weight: float = 0.0
    blend_key_shift: bool = True  # add the model's calibrated key shift to chunks reused from their alone form
    blend_min_tokens: int = 32
    blend_separator: str | None = None  # /v1/completions: split the prompt into chunks at this string
