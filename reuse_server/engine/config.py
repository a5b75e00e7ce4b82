"""Engine settings, one place; the CLI fills it from flags and `validate` checks them once, before anything
is loaded. Torch-free, so that the CLI's tools that need no model (kv-calc) start fast."""
from __future__ import annotations

from dataclasses import dataclass

from reuse_server.kv import layout as kv_layout  # torch-free
from reuse_server.kv.sizing import AUTO, CPU_SHARE, GPU_MEMORY_UTILIZATION, Auto  # torch-free

DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}
CPU_MATMULS = ("native", "onednn", "torch")
# --attention-backend: native, the C++ paged kernel (model/cpu_attention.cpp: fp32 on the CPU, torch's SDPA for
# the rest); torch, SDPA over gathered K/V; triton, the paged Triton kernel (model/attention_triton.py: CUDA, or
# the CPU in Triton's interpreter); auto, native on the CPU, triton on CUDA, torch elsewhere.
ATTENTION_BACKENDS = ("auto", "native", "torch", "triton")


def resolve_attention_backend(name: str, device: str) -> str:
    """The backend --attention-backend names on `device` ('auto' resolved)."""
    if name == "auto":
        # any other device (a test's fake one, mps) gets the torch path, which runs wherever torch does
        return {"cpu": "native", "cuda": "triton"}.get(device.split(":")[0], "torch")
    return name
def cuda_graphs_problem(device: str, attention_backend: str) -> str | None:
    """Why --cuda-graphs cannot run with these settings, or None. Graphs capture CUDA work; the step they
    capture must read nothing back to the host, which only the Triton attention's plan on static buffers
    ensures (the torch path plans its masks and gathers from host lists every step)."""
    if device.split(":")[0] != "cuda":
        return f"--cuda-graphs captures CUDA graphs of the decode step: it needs a CUDA device, not {device}"
    if resolve_attention_backend(attention_backend, device) != "triton":
        return (f"--cuda-graphs replays the paged Triton attention; --attention-backend {attention_backend} "
                f"cannot be captured (use triton or auto)")
    return None


ACTIVATION_DTYPES = ("fp32", "int8")  # --activation-dtype (model/quant_linear.py)


def resolve_dtype(name: str, device: str):
    """The torch dtype for a --dtype name; 'auto' is fp32 on the CPU and bf16 on CUDA."""
    import torch

    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return getattr(torch, DTYPES[name])


@dataclass
class EngineConfig:
    model: str | None = None  # bundled name, a .gguf file, or an HF checkpoint folder; None: the bundled SmolLM2
    # the names requests may use (as vLLM's: one or several; the first is the id answers report); default: one
    # derived from the model (engine/model_names.py)
    served_model_name: str | list[str] | None = None
    device: str = "cpu"
    dtype: str = "auto"  # auto: fp32 on CPU, bf16 on CUDA
    # the matrices' storage, independent of the compute dtype: fp32 (as --dtype), bf16, int8, int4 (group-wise
    # scales; the output head in at least int8), or auto: the narrowest within measured quality bounds
    # (model/weight_dtype.py)
    weight_dtype: str = "auto"
    # int8: int8/int4 weights' products quantize their activations to int8 per group of 32 and run as integer
    # dot products (llama.cpp's way; model/cpu_quant_a8.cpp): faster decode, logits no longer fp32
    # activations'. fp32: exact.
    activation_dtype: str = "fp32"
    # the KV pool's storage (kv_layout.KV_DTYPES: fp32, fp16, bf16, fp8_e4m3, int8); auto: the weights' dtype
    kv_dtype: str = "auto"
    # linear layers on weights packed once (model/cpu_linear.py): native kernel (fp32; else oneDNN), onednn, or
    # torch (F.linear)
    cpu_matmul: str = "native"
    attention_backend: str = "auto"  # ATTENTION_BACKENDS
    # capture a CUDA graph of the decode step per batch-size bucket at start and replay it (decode_graphs.py);
    # CUDA with the Triton attention only. Off until measured.
    cuda_graphs: bool = False
    block_size: int = 16
    num_gpu_blocks: int | None = None  # exact pool size in blocks; overrides kv_cache_memory
    # bytes for the KV pool; AUTO: sized at start from the machine (kv/sizing.py: a share of the RAM available
    # on the CPU, --gpu-memory-utilization of the card on CUDA)
    kv_cache_memory: int | Auto = AUTO
    kv_cache_share: float = CPU_SHARE  # AUTO on the CPU: the share of the memory available at start (less a reserve)
    gpu_memory_utilization: float = GPU_MEMORY_UTILIZATION  # AUTO on CUDA: vLLM's meaning, this server's share of the card
    # A hybrid model (sliding-window layers beside full-attention ones): the window layers' KV in a pool of its
    # own, for this share of the block ids (kv/layered_pool.py); None: one pool holds every layer of every block.
    window_kv_share: float | None = 0.25
    num_window_blocks: int | None = None  # exact size of that pool in blocks; overrides the share's sizing
    max_num_seqs: int = 16  # running sequences at once
    max_num_batched_tokens: int = 2048  # token budget per scheduler step (prompts go in prefill slices)
    max_model_len: int | None = None  # default: the model's max positions
    # the most tokens any answer may have (llama.cpp's --n-predict), whatever a request asks; a request's smaller
    # limit wins. None: only the request's limit and the room the context leaves.
    max_tokens: int | None = None
    enable_prefix_cache: bool = True
    dedup_prefill: bool = True  # a request waits for blocks another request is computing instead of computing them too
    hash_algo: str = "xxh3_128"
    eviction_policy: str = "lru"
    # prompt-cache pins (cache_control breakpoints): the share of the pool's blocks one tenant's pins may hold.
    # A quarter: a tenant's pinned system prompt, tools and conversation stay put while three quarters of the
    # pool remain for running requests and everyone else's ordinary cache (kv/pins.py, docs/usage.md).
    max_pinned_share: float = 0.25
    # KV tiers below the device pool (disk and Redis off by default)
    # bytes of host RAM for blocks evicted from the pool; AUTO: off on the CPU (the same RAM: the pool takes it
    # all), the CPU rule's share of host RAM on CUDA (kv/sizing.py)
    cpu_cache_size: int | Auto = AUTO
    disk_cache_dir: str | None = None  # folder for blocks kept on disk across restarts
    disk_cache_size: int = 10 * 1000**3  # bytes of disk for them
    disk_write_policy: str = "through"  # through: every new full block; back: what host RAM evicts
    host_write_policy: str = "through"  # through: every new full block, so an eviction copies nothing; back: evicted ones
    tier_fetch: str = "auto"  # auto: fetch a block where measured cheaper than recomputing it; always: fetch
    redis_url: str | None = None  # Redis/Valkey shared by servers on the same model
    redis_timeout: float = 0.25  # seconds a Redis call may take before it counts as a miss
    # KV events in vLLM's format for a KV-aware router (kv/events.py): where to publish, where to answer replays
    kv_events: str | None = None  # e.g. tcp://127.0.0.1:5557 (default: off)
    kv_events_replay: str | None = None
    tier_kv_dtype: str = "auto"  # what host/disk/Redis copies are stored in (kv_layout.KV_DTYPES); auto: the pool's
    # non-prefix reuse (blending)
    enable_blend: bool = False  # default for requests that don't say; the chunk index exists either way
    blend_recompute_ratio: float = 0.15
    blend_check_layers: tuple[int, ...] = (1,)
    blend_gradual_factors: tuple[float, ...] = (1.0,)
    blend_score: str = "kv"  # K+V deviation: best of k, v, kv on the needle benchmark (BENCHMARKS.md)
    blend_selection: str = "cacheblend"  # which reused tokens are recomputed: cacheblend, epic, a3 (blend/strategies.py)
    blend_first_tokens: int = 0  # epic: each chunk's first N tokens (0: the recompute ratio's budget, spread)
    blend_query_weight: float = 0.0  # cacheblend: weight of the question's attention in the deviation score
    blend_key_shift: bool = True  # add the model's calibrated key shift to chunks reused from their alone form
    blend_min_tokens: int = 32
    # the fidelity check (blend/fidelity.py): a reused chunk whose K or V deviates from this prompt's by more
    # than this (relative L2 at the first check layer) is recomputed whole; inf: off, 0: reject every chunk;
    # None: calibrated once per model (engine/fidelity_calibration.py)
    blend_max_deviation: float | None = None
    # Client spans are cut into chunks of about this many tokens where their content says (a rolling hash;
    # blend/content_cuts.py), so text glued into one message is reused in pieces; 0: only the client's spans.
    blend_chunk_tokens: int = 64
    blend_separator: str | None = None  # /v1/completions: split the prompt into chunks at this string

    def blend_strategy(self):
        """The blend.strategies.Selection these settings name."""
        from blend.strategies import make_selection
        return make_selection(self.blend_selection, self.blend_first_tokens, self.blend_query_weight)

    def validate(self) -> None:
        """Raise ValueError naming every setting that cannot work (the model-dependent checks, such as the
        check layers against the model's depth, happen once the model's config is read)."""
        from radix import HASH_ALGOS, POLICIES, check_block_size  # the cache index owns its rules

        problems = []
        if self.dtype != "auto" and self.dtype not in DTYPES:
            problems.append(f"unknown dtype {self.dtype!r}; choose one of auto, {', '.join(DTYPES)}")
        try:
            kv_layout.kv_dtype(self.kv_dtype)
        except ValueError as exc:
            problems.append(str(exc))
        if self.activation_dtype not in ACTIVATION_DTYPES:
            problems.append(f"unknown activation_dtype {self.activation_dtype!r}; choose {', '.join(ACTIVATION_DTYPES)}")
        if self.cpu_matmul not in CPU_MATMULS:
            problems.append(f"unknown cpu_matmul {self.cpu_matmul!r}; choose {', '.join(CPU_MATMULS)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            problems.append(f"unknown attention_backend {self.attention_backend!r}; choose "
                            f"{', '.join(ATTENTION_BACKENDS)}")
        if self.cuda_graphs:
            graphs_problem = cuda_graphs_problem(self.device, self.attention_backend)
            if graphs_problem:
                problems.append(graphs_problem)
        try:
            check_block_size(self.block_size)
        except ValueError as exc:
            problems.append(str(exc))
        if self.hash_algo not in HASH_ALGOS:
            problems.append(f"unknown hash {self.hash_algo!r}; choose {', '.join(HASH_ALGOS)}")
        if self.eviction_policy not in POLICIES:
            problems.append(f"unknown eviction policy {self.eviction_policy!r}; choose {', '.join(POLICIES)}")
        if self.max_tokens is not None and self.max_tokens < 1:
            problems.append(f"max_tokens must be at least 1, got {self.max_tokens}")
        names = [self.served_model_name] if isinstance(self.served_model_name, str) else self.served_model_name
        if names is not None and (not names or any(not name.strip() for name in names)):
            problems.append("served_model_name must be one or more non-empty names")
        for name in ("max_num_seqs", "max_num_batched_tokens", "kv_cache_memory", "blend_min_tokens"):
            value = getattr(self, name)
            if not isinstance(value, Auto) and value < 1:
                problems.append(f"{name} must be at least 1, got {value}")
        for name in ("kv_cache_share", "gpu_memory_utilization"):
            if not 0.0 < getattr(self, name) <= 1.0:
                problems.append(f"{name} must be in (0, 1], got {getattr(self, name)}")
        if self.blend_chunk_tokens < 0:
            problems.append(f"blend_chunk_tokens must be 0 (off) or more, got {self.blend_chunk_tokens}")
        if not 0.0 <= self.max_pinned_share <= 1.0:
            problems.append(f"max_pinned_share must be in [0, 1], got {self.max_pinned_share}")
        if self.window_kv_share is not None and not 0 < self.window_kv_share <= 1:
            problems.append(f"window_kv_share must be in (0, 1], got {self.window_kv_share}")
        if self.num_window_blocks is not None and self.num_window_blocks < 2:
            problems.append(f"num_window_blocks must be at least 2, got {self.num_window_blocks}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks < 2:
            problems.append(f"num_gpu_blocks must be at least 2, got {self.num_gpu_blocks}")
        try:
            self.blend_strategy()
        except ValueError as exc:
            problems.append(str(exc))
        from blend.fidelity import FidelityCheck  # torch-free, like blend.strategies

        try:
            if self.blend_max_deviation is not None:
                FidelityCheck(self.blend_max_deviation)
        except ValueError as exc:
            problems.append(f"blend_{exc}")
        if not 0.0 <= self.blend_recompute_ratio <= 1.0:
            problems.append(f"blend_recompute_ratio must be in [0, 1], got {self.blend_recompute_ratio}")
        if len(self.blend_gradual_factors) != len(self.blend_check_layers):
            problems.append(f"blend_gradual_factors has {len(self.blend_gradual_factors)} values but "
                            f"blend_check_layers has {len(self.blend_check_layers)} layers")
        if self.tier_fetch not in ("auto", "always"):
            problems.append(f"unknown tier fetch setting {self.tier_fetch!r}; choose auto or always")
        if self.disk_write_policy not in ("through", "back"):
            problems.append(f"unknown disk write policy {self.disk_write_policy!r}; choose through or back")
        negative_host = not isinstance(self.cpu_cache_size, Auto) and self.cpu_cache_size < 0
        if negative_host or self.disk_cache_size < 1 or self.redis_timeout <= 0:
            problems.append("tier sizes and the Redis timeout must be positive")
        if self.kv_events_replay and not self.kv_events:
            problems.append("kv_events_replay needs kv_events (the endpoint the events are published on)")
        for name in ("kv_events", "kv_events_replay"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://")):
                problems.append(f"{name} must be tcp://HOST:PORT or ipc://PATH, got {value!r}")
        if self.blend_score not in ("k", "v", "kv"):
            problems.append(f"unknown blend_score {self.blend_score!r}; choose k, v or kv")
        if problems:
            raise ValueError("; ".join(problems))
