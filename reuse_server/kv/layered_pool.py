"""The KV pool of a hybrid model: full-attention layers and sliding-window layers in two pools.

Gemma 3 270M has 3 full-attention layers and 15 that attend over the last 512 tokens. One block table for all
layers would hold every layer's KV for every token; at 8,192 tokens that is about five times what the model
can ever read. Here the full-attention layers live in one `KVPool` whose block ids are the ids the rest of the
server knows (the radix tree, the tiers, the events, a sequence's block table), and the window layers in a
second, smaller `KVPool` whose blocks are the *window parts* of those ids (`WindowParts.table` maps an id to its
part; the block manager decides which ids have one). This is SGLang's split into a full and an SWA pool
(`swa_full_tokens_ratio`), chosen over vLLM's one pool of equal pages because our pool keeps each layer's K
and V as one array that the kernels read in place: two pools keep that, and both stay `KVPool`s.

Callers keep speaking block ids and slots (id * block_size + offset) for every layer: this class routes a
layer to its pool and translates ids and slots for the window layers. The model asks `route` once per layer
for the pool, the index inside it and the step's metadata in that pool's ids."""
from __future__ import annotations

import torch

from reuse_server.kv.block_codec import BlockLayout
from reuse_server.kv.pool import KVPool, PoolMemory, import_in_runs
from reuse_server.kv.window_parts import WindowParts
from reuse_server.kv.window_policy import SlidingWindow


class GroupedLayout:
    """A hybrid block's bytes: the full-attention layers' block, then the window layers' block (each a
    `BlockLayout`). Only blocks that have their window part are exported (`LayeredKVPool.exportable`)."""

    def __init__(self, full: BlockLayout, window: BlockLayout, full_layers: list[int], window_layers: list[int]):
        self.full, self.window = full, window
        self.full_layers, self.window_layers = full_layers, window_layers

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.window.nbytes

    @property
    def dtype(self) -> torch.dtype:
        return self.full.dtype

    def with_dtype(self, dtype) -> "GroupedLayout":
        return GroupedLayout(self.full.with_dtype(dtype), self.window.with_dtype(dtype), self.full_layers,
                             self.window_layers)

    def decode(self, data: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Block buffers -> K/V values [n, layers, 2, block_size, kv_heads, head_dim] in model layer order."""
        split = self.full.nbytes
        full, window = self.full.decode(data[:, :split], dtype), self.window.decode(data[:, split:], dtype)
        out = full.new_empty(data.shape[0], len(self.full_layers) + len(self.window_layers), *full.shape[2:])
        out[:, self.full_layers], out[:, self.window_layers] = full, window
        return out

    def describe(self) -> dict:
        return {"groups": [dict(self.full.describe(), layers=self.full_layers),
                           dict(self.window.describe(), layers=self.window_layers)]}

    def __eq__(self, other) -> bool:
        return (isinstance(other, GroupedLayout) and (self.full, self.window, self.full_layers, self.window_layers)
                == (other.full, other.window, other.full_layers, other.window_layers))

    def __repr__(self) -> str:
        return f"GroupedLayout(full={self.full}, window={self.window})"


class LayeredKVPool:
    layered = True

    def __init__(self, layer_windows: tuple, num_blocks: int, num_window_blocks: int, block_size: int,
                 num_kv_heads: int, head_dim: int, dtype="fp32", device="cpu", read_dtype=torch.float32):
        """layer_windows: each layer's window (None: full attention); both kinds must be present, with one
        window size."""
        windows = {w for w in layer_windows if w is not None}
        self.full_layers = [i for i, w in enumerate(layer_windows) if w is None]
        self.window_layers = [i for i, w in enumerate(layer_windows) if w is not None]
        if len(windows) != 1 or not self.full_layers:
            raise ValueError(f"a layered pool needs full-attention layers and window layers of one size, got "
                             f"{layer_windows}")
        self.full = KVPool(len(self.full_layers), num_blocks, block_size, num_kv_heads, head_dim, dtype, device,
                           read_dtype)
        self.windowed = KVPool(len(self.window_layers), num_window_blocks, block_size, num_kv_heads, head_dim,
                               dtype, device, read_dtype)
        self.parts = WindowParts(num_blocks, num_window_blocks, windows.pop(), block_size)
        self._where = {layer: (self.full, i) for i, layer in enumerate(self.full_layers)}
        self._where.update({layer: (self.windowed, i) for i, layer in enumerate(self.window_layers)})
        self.num_layers = len(layer_windows)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device, self.read_dtype = self.full.dtype, self.full.device, self.full.read_dtype
        self.quantized, self.scale_per = self.full.quantized, self.full.scale_per
        self.layout = GroupedLayout(self.full.layout, self.windowed.layout, self.full_layers, self.window_layers)

    def use_triton_kernels(self, enable: bool = True) -> bool:
        """KVPool.use_triton_kernels for both pools."""
        return self.full.use_triton_kernels(enable) & self.windowed.use_triton_kernels(enable)

    @property
    def kernel_launches(self):
        """Both pools' KVPool.kernel_launches, added up."""
        return self.full.kernel_launches + self.windowed.kernel_launches

    @staticmethod
    def split_memory(memory_bytes: int, layer_windows: tuple, block_size: int, num_kv_heads: int, head_dim: int,
                     dtype, window_share: float) -> tuple[int, int]:
        """(block ids, window parts) for a pool of memory_bytes: window parts for `window_share` of the ids."""
        full = sum(w is None for w in layer_windows)
        per_layer = KVPool.bytes_per_block(1, block_size, num_kv_heads, head_dim, dtype)
        per_block = per_layer * (full + window_share * (len(layer_windows) - full))
        num_blocks = int(memory_bytes // per_block)
        return num_blocks, max(2, int(num_blocks * window_share))

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def window(self) -> int:
        return self.parts.window

    @property
    def nbytes(self) -> int:
        return self.full.nbytes + self.windowed.nbytes

    @property
    def bytes_per_token(self) -> float:
        """What a token held costs in the full-attention layers (every held token), without its window part."""
        return self.full.bytes_per_token

    @property
    def window_bytes_per_token(self) -> float:
        return self.windowed.bytes_per_token

    def layout_for(self, dtype) -> GroupedLayout:
        return self.layout if dtype is None else self.layout.with_dtype(dtype)

    # ---- ids and slots in the window pool ------------------------------------------------------------
    def _parts(self, blocks) -> list[int]:
        table = self.parts.table
        return [int(table[b]) for b in blocks]

    def _window_slots(self, slots: torch.Tensor) -> torch.Tensor:
        table = self.parts.table.to(slots.device)
        bs = self.block_size
        return table[torch.div(slots, bs, rounding_mode="floor")] * bs + slots % bs

    def place(self, layer: int) -> tuple[KVPool, int]:
        """(the pool that holds `layer`, its index there)."""
        return self._where[layer]

    def route(self, layer: int, meta):
        """(pool, its index for `layer`, `meta` with that pool's block ids and slots)."""
        pool, index = self._where[layer]
        if pool is self.full:
            return pool, index, meta
        return pool, index, meta.remapped(self.parts.table, self.block_size)

    def exportable(self, block: int) -> bool:
        """Whether the block's KV is whole here (its window part too), so that a tier can take it."""
        return self.parts.has(block)

    def window_policy(self) -> SlidingWindow:
        """What the block manager does for the window layers here: hold their parts while a window needs them."""
        return SlidingWindow(self.parts)

    def memory(self, used_blocks: int) -> PoolMemory:
        """Every used block's full-attention layers, and the window parts held (pinned or cached); the window
        parts' counts (running requests pin, cached, free) beside."""
        window = self.parts.stats()
        held = window["window_blocks_pinned"] + window["window_blocks_cached"]
        return PoolMemory(str(self.dtype).removeprefix("torch."), self.layout.nbytes, self.nbytes,
                          used_blocks * self.full.layout.nbytes + held * self.windowed.layout.nbytes, window)

    # ---- per layer ---------------------------------------------------------------------------------
    def read(self, layer: int, slots: torch.Tensor):
        pool, index = self._where[layer]
        return pool.read(index, slots if pool is self.full else self._window_slots(slots))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        pool, index = self._where[layer]
        pool.write(index, slots if pool is self.full else self._window_slots(slots), k, v)

    def read_keys(self, slots: torch.Tensor) -> list[torch.Tensor]:
        full, window = self.full.read_keys(slots), self.windowed.read_keys(self._window_slots(slots))
        return [full[i] if pool is self.full else window[i] for pool, i in (self._where[l] for l in range(self.num_layers))]

    def update_keys(self, slots: torch.Tensor, change) -> None:
        """KVPool.update_keys over every layer in model order (a re-RoPE's per-layer bases line up): the
        two pools' keys at slots as fp32 copies, changed together, written back."""
        if slots.numel() == 0:
            return
        move = getattr(change, "in_place", None)
        if move is not None and self.full.rotates_in_place and self.windowed.rotates_in_place:
            # each pool edits its own layers in place, with their rows of the inverse-frequency table and shift
            self.full.update_keys(slots, move.of_layers(self.full_layers, self.num_layers))
            self.windowed.update_keys(self._window_slots(slots), move.of_layers(self.window_layers, self.num_layers))
            return
        keys = [k.float().unsqueeze(1) for k in self.read_keys(slots)]
        change(keys, torch.arange(slots.shape[0], device=slots.device))
        for pool, layers, at in ((self.full, self.full_layers, slots),
                                 (self.windowed, self.window_layers, self._window_slots(slots))):
            values = [keys[layer].squeeze(1) for layer in layers]
            pool.update_keys(at, _overwrite(values))

    # ---- whole blocks and slots, every layer --------------------------------------------------------
    def clear_blocks(self, blocks: list[int]) -> None:
        self.full.clear_blocks(blocks)
        self.windowed.clear_blocks([p for p in self._parts(blocks) if p])

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """src[i] -> dst[i]: the full-attention layers, and the window layers where both have a part."""
        self.full.copy_blocks(src, dst)
        pairs = [(s, d) for s, d in zip(self._parts(src), self._parts(dst)) if s and d]
        self.windowed.copy_blocks([s for s, _ in pairs], [d for _, d in pairs])

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.full.copy_slots(src, dst)
        self.windowed.copy_slots(self._window_slots(src), self._window_slots(dst))

    def export_blocks(self, blocks: list[int], as_dtype=None) -> torch.Tensor:
        buffers, copied = self.export_blocks_async(blocks, as_dtype)
        if copied is not None:
            copied.synchronize()
        return buffers

    def export_blocks_async(self, blocks: list[int], as_dtype=None, into=None):
        """Blocks with their window parts (exportable) as [full-layer bytes | window-layer bytes] rows, in
        `into`'s memory (kv.tiers.host_memory) where given."""
        full, copied = self.full.export_blocks_async(blocks, as_dtype)
        if copied is not None:
            copied.synchronize()
        window = self.windowed.export_blocks(self._parts(blocks), as_dtype)
        if into is None:
            return torch.cat([full, window], 1), None
        out = into.empty((full.shape[0], full.shape[1] + window.shape[1]), full.dtype)
        return torch.cat([full, window], 1, out=out), None

    def import_blocks(self, blocks: list[int], data: torch.Tensor, layout: GroupedLayout | None = None) -> None:
        """Rows of export_blocks into blocks that have window parts."""
        layout = self.layout if layout is None else layout
        if data.dtype != torch.uint8 or tuple(data.shape) != (len(blocks), layout.nbytes):
            raise ValueError(f"expected uint8 [{len(blocks)}, {layout.nbytes}] block buffers, got "
                             f"{data.dtype} {tuple(data.shape)}")
        split = layout.full.nbytes
        self.full.import_blocks(blocks, data[:, :split].contiguous(), layout.full)
        self.windowed.import_blocks(self._parts(blocks), data[:, split:].contiguous(), layout.window)

    def import_rows(self, blocks: list[int], rows: list[torch.Tensor], layout: GroupedLayout | None = None) -> None:
        """import_blocks for buffers given one by one (KVPool.import_rows)."""
        import_in_runs(self, blocks, rows, layout)

    def read_targets(self, blocks: list[int], layout: GroupedLayout | None = None) -> None:
        """A block's buffer lies in two pools here: reads go through buffers and import_rows (KVPool.read_targets)."""
        return None


def _overwrite(values: list[torch.Tensor]):
    """An update_keys change that writes `values` (per layer [n, heads, dim]) at the given slots."""
    def change(caches, idx):
        for cache, value in zip(caches, values):
            cache.view(-1, *cache.shape[2:])[idx] = value.to(cache.dtype)
    return change
