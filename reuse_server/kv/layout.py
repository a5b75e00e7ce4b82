"""How many bytes the KV cache takes: one formula for the server's pool and for `reuse-server kv-calc`.

A model's KV cache is described per layer (`LayerKV`): how many KV heads it stores, the width of each K and V
head, and the sliding window, if the layer has one. Grouped-query layers store their KV heads, not their
attention heads; an MLA layer (DeepSeek-V2/V3) stores one latent vector per token (the compressed KV plus the
decoupled RoPE key), shared by every head, and no separate V. A KV dtype (`KVDType`) has a width per element
and, for the 8-bit formats, fp32 scales:
- fp8_e4m3: one scale per (layer, K or V, block, KV head), so a block's scales are spread over its tokens;
- int8: one scale per (layer, K or V, token, KV head), symmetric.

bytes per block = sum over layers of block_size x heads x (k_dim + v_dim) x element bytes + scales, and
bytes per token = bytes per block / block_size. Pure arithmetic on purpose (no torch): the calculator must
answer in well under a second, and the pool sizes itself from the same functions."""

from __future__ import annotations

from dataclasses import dataclass

SCALE_BYTES = 4  # the 8-bit formats keep fp32 scales


@dataclass(frozen=True)
class KVDType:
    name: str
    element_bytes: int
    scale_per: str | None = None  # None, "token" (int8) or "block" (fp8_e4m3): what one scale covers
    torch_name: str | None = None  # torch.<name> of the stored elements


KV_DTYPES = {
    "fp32": KVDType("fp32", 4, torch_name="float32"),
    "fp16": KVDType("fp16", 2, torch_name="float16"),
    "bf16": KVDType("bf16", 2, torch_name="bfloat16"),
    "fp8_e4m3": KVDType("fp8_e4m3", 1, "block", torch_name="float8_e4m3fn"),
    "int8": KVDType("int8", 1, "token", torch_name="int8"),
}
_ALIASES = {"float32": "fp32", "float": "fp32", "float16": "fp16", "half": "fp16", "bfloat16": "bf16",
            "fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "float8_e4m3": "fp8_e4m3"}
KV_DTYPE_CHOICES = ("auto", *KV_DTYPES)


def default_kv_dtype(device: str) -> str:
    """What `auto` means: the weights' default dtype on that device (as the engine picks it)."""
    return "bf16" if str(device).startswith("cuda") else "fp32"


def kv_dtype(name: str, device: str = "cpu") -> KVDType:
    """'auto', a name of KV_DTYPES, or a torch dtype's name ('float32', 'torch.bfloat16', ...)."""
    key = str(name).strip().lower().removeprefix("torch.")
    if key == "auto":
        key = default_kv_dtype(device)
    key = _ALIASES.get(key, key)
    if key not in KV_DTYPES:
        raise ValueError(f"unknown KV dtype {name!r}; choose one of {', '.join(KV_DTYPE_CHOICES)}")
    return KV_DTYPES[key]


@dataclass(frozen=True)
class LayerKV:
    """What one layer stores per token: kv_heads heads of k_dim key and v_dim value elements (v_dim 0: no
    separate V, as in MLA); window: the layer only ever attends the last `window` tokens (None: all)."""

    kv_heads: int
    k_dim: int
    v_dim: int
    window: int | None = None

    @property
    def elements_per_token(self) -> int:
        return self.kv_heads * (self.k_dim + self.v_dim)

    @property
    def scales_per_unit(self) -> int:
        """Scales per token (int8) or per block (fp8): one per stored tensor (K, V) and head."""
        return self.kv_heads * ((self.k_dim > 0) + (self.v_dim > 0))

    def bytes_per_block(self, dtype: KVDType, block_size: int) -> int:
        data = block_size * self.elements_per_token * dtype.element_bytes
        if dtype.scale_per == "token":
            return data + block_size * self.scales_per_unit * SCALE_BYTES
        if dtype.scale_per == "block":
            return data + self.scales_per_unit * SCALE_BYTES
        return data

    def tokens_held(self, context: int) -> int:
        """Tokens of a `context`-token sequence whose KV this layer still needs (ideal: no blocks)."""
        return context if self.window is None else min(context, self.window)

    def blocks_held(self, context: int, block_size: int, window_aware: bool = True) -> int:
        """Blocks a paged pool holds in this layer for a `context`-token sequence. Window-aware: a windowed
        layer frees the blocks that fell out of its window, keeping those its last `window` positions touch
        (an unaligned window spans one block more than it fills)."""
        blocks = -(-context // block_size)
        if self.window is None or not window_aware:
            return blocks
        return min(blocks, -(-(self.window + block_size - 1) // block_size))


@dataclass(frozen=True)
class KVGeometry:
    layers: tuple[LayerKV, ...]
    mla: bool = False  # the layers store DeepSeek's compressed latent (+ RoPE key) instead of K and V

    @classmethod
    def uniform(cls, num_layers: int, kv_heads: int, head_dim: int, window: int | None = None) -> "KVGeometry":
        """A Llama-family model: every layer stores K and V of kv_heads heads of head_dim."""
        return cls(tuple(LayerKV(kv_heads, head_dim, head_dim, window) for _ in range(num_layers)))

    @property
    def windowed(self) -> bool:
        return any(layer.window is not None for layer in self.layers)

    def groups(self) -> list[tuple[LayerKV, int]]:
        """Runs of identical layers as (layer, count), in order of first appearance (for showing formulas)."""
        counts: dict[LayerKV, int] = {}
        for layer in self.layers:
            counts[layer] = counts.get(layer, 0) + 1
        return list(counts.items())


def bytes_per_block(geometry: KVGeometry, dtype: KVDType, block_size: int) -> int:
    """One block of block_size tokens in every layer, scales included."""
    _check_block_size(block_size)
    return sum(layer.bytes_per_block(dtype, block_size) for layer in geometry.layers)


def bytes_per_token(geometry: KVGeometry, dtype: KVDType, block_size: int) -> float:
    """One token in every layer, scales included (fp8's per-block scales spread over the block's tokens)."""
    return bytes_per_block(geometry, dtype, block_size) / block_size


ALLOCATIONS = ("ideal", "paged", "paged_all_layers")


def sequence_bytes(geometry: KVGeometry, dtype: KVDType, block_size: int, context: int, allocation: str) -> float:
    """KV bytes one sequence of `context` tokens holds:
    ideal: each layer exactly the tokens it needs (min(context, window)), no block padding;
    paged: whole blocks per layer, windowed layers freeing blocks that left their window;
    paged_all_layers: whole blocks, every layer holding the whole context (one block table shared by all
    layers, so out-of-window blocks are never returned)."""
    _check_block_size(block_size)
    if allocation == "ideal":
        return sum(layer.tokens_held(context) * layer.bytes_per_block(dtype, block_size) / block_size
                   for layer in geometry.layers)
    if allocation not in ALLOCATIONS:
        raise ValueError(f"unknown allocation {allocation!r}; choose one of {', '.join(ALLOCATIONS)}")
    window_aware = allocation == "paged"
    return sum(layer.blocks_held(context, block_size, window_aware) * layer.bytes_per_block(dtype, block_size)
               for layer in geometry.layers)


def max_concurrency(per_sequence_bytes: float, memory_bytes: int) -> int:
    return int(memory_bytes // per_sequence_bytes) if per_sequence_bytes > 0 else 0


def max_context(geometry: KVGeometry, dtype: KVDType, block_size: int, concurrency: int, memory_bytes: int,
                allocation: str, limit: int) -> int | None:
    """The longest context of which `concurrency` sequences fit in memory_bytes, searched up to `limit`
    tokens; None when even `limit` fits (every layer windowed: the need stops growing)."""
    def fits(context: int) -> bool:
        return concurrency * sequence_bytes(geometry, dtype, block_size, context, allocation) <= memory_bytes

    if fits(limit):
        return None
    low, high = 0, limit  # fits(low) holds, fits(high) does not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def padding_tokens(context: int, block_size: int) -> int:
    """Slots left empty in a sequence's partly filled last block."""
    return -(-context // block_size) * block_size - context


def _check_block_size(block_size: int) -> None:
    if block_size < 1:
        raise ValueError(f"the block size must be at least 1, got {block_size}")
