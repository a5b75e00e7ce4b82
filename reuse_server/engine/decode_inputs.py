"""A decode step's inputs in buffers allocated once, sized for the largest batch-size bucket: the step copies its
host lists into them in one transfer and the forward runs on views of them, so every decode step of a bucket
reads the same addresses (what a CUDA graph replays; decode_graphs.py).

The batch is padded up to its bucket (nano-vllm's and vLLM's way: a graph per bucket, not per batch size).
A padding row is a sequence of one token at position 0 whose table is the scratch block, a pool block the
block manager never hands out (builder.py holds it back): its K/V goes there, it reads only that, and no real
row sees it (attention stays within a row's own table), so the real rows' KV and results are those of the
unpadded step.

Only the model's inputs are static: sampling runs eagerly on the first rows of the logits (Sampler.pick),
whose penalties, grammars and per-request generators are host-driven and vary in kind from row to row."""
from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from typing import Callable

import torch

from reuse_server.model.attention import AttentionMetadata

# vLLM's and nano-vllm's bucket spacing: every power of two up to 8 (small batches are the common case and
# padding them is the costliest share), then every 16 (each graph holds its own activations: fewer graphs).
SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 16


def decode_buckets(max_rows: int) -> list[int]:
    """The batch sizes a decode step is padded to, ascending, the last one max_rows."""
    if max_rows < 1:
        raise ValueError(f"a decode batch holds at least one row, got {max_rows}")
    small = [b for b in SMALL_BUCKETS if b < max_rows]
    return small + list(range(BUCKET_STEP, max_rows, BUCKET_STEP)) + [max_rows]


def bucket_for(rows: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds `rows`, or None when none does (the step runs unpadded)."""
    return next((b for b in buckets if b >= rows), None)


def is_plain_decode(slices, want_logits: list[bool], selections: dict | None) -> bool:
    """Whether a step is one token per sequence, every one sampled, none blended: the step static buffers and
    graphs serve. A prefill slice, a step that mixes prefill with decode, and blending's row choices run
    eagerly through the runner's dynamic inputs."""
    return (bool(slices) and not selections and all(want_logits) and len(want_logits) == len(slices)
            and all(piece.num_tokens == 1 for piece in slices))


def is_triton_kernel(kernel) -> bool:
    """Whether the model attends through the paged Triton kernel (without importing triton where it does not:
    a kernel of that module means the module was imported)."""
    module = sys.modules.get("reuse_server.model.attention_triton")
    return module is not None and isinstance(kernel, module.TritonAttentionKernel)


@dataclass
class StaticStep:
    """One step on the static buffers: `rows` real rows, padded to `bucket`. Its metadata is built only where
    the forward runs eagerly (a graph's replay needs none: it is the metadata's Python work a replay saves)."""
    rows: int
    bucket: int
    input_ids: torch.Tensor  # [bucket] views of the buffers
    positions: torch.Tensor
    _build_meta: Callable[[], AttentionMetadata]
    _meta: AttentionMetadata | None = None

    @property
    def meta(self) -> AttentionMetadata:
        if self._meta is None:
            self._meta = self._build_meta()
        return self._meta


class StaticTritonPlan:
    """The Triton kernel's plan (attention_triton.TritonPlan's fields) on the static buffers: one tile per row,
    (row, row + 1, its context length, its table's offset); the context lengths and tables are copied in per
    step, the rest is fixed. The key-range splits are fixed per bucket from the longest context a sequence may
    have, not the step's longest, so that every step of a bucket launches the same kernels (a graph's)."""

    def __init__(self, tiles: torch.Tensor, tables: torch.Tensor, positions: torch.Tensor, group: int,
                 head_dim: int, kv_heads: int, longest: int, kernel):
        """kernel: the TritonAttentionKernel, whose forced splits and key tile (tests) it honours."""
        from reuse_server.model.attention_triton import num_splits, tile_shape

        self.block_m, self.block_q, self.block_n = tile_shape(group, head_dim, 1, positions.device)
        self.block_n = kernel.block_n or self.block_n
        self.num_tiles = tiles.shape[0]
        self.tiles, self.tables, self.positions = tiles, tables, positions
        self.longest = longest
        self.splits = kernel.splits if kernel.splits is not None else num_splits(self.num_tiles * kv_heads, longest)

    def splits_for(self, kv_heads: int) -> int:
        return self.splits


class StaticDecodeInputs:
    """The buffers, for batches of up to max_rows sequences of up to max_blocks blocks each. One int64 buffer
    holds the step, [token ids | positions | slots | context lengths | block tables (max_rows x max_blocks)],
    on the host (pinned on CUDA) and on the device: a step fills the host side and sends the rows it uses in
    one copy."""

    def __init__(self, max_rows: int, max_blocks: int, block_size: int, scratch_block: int,
                 device: "torch.device | str" = "cpu", heads: tuple[int, int, int] | None = None):
        """heads: the model's (query heads, KV heads, head dim), which a Triton kernel's plan on the buffers
        needs (load's kernel); None where the model attends through torch alone."""
        self.device = torch.device(device)
        self.buckets = decode_buckets(max_rows)
        self.max_rows, self.max_blocks = max_rows, max_blocks
        self.block_size, self.scratch_block = block_size, scratch_block
        n = 4 * max_rows + max_rows * max_blocks
        on_cuda = self.device.type == "cuda"
        self._host = torch.zeros(n, dtype=torch.long, pin_memory=on_cuda)
        self._dev = torch.zeros(n, dtype=torch.long, device=self.device) if self.device.type != "cpu" else self._host
        self._sent: "torch.cuda.Event | None" = None  # the last copy out of the host buffer
        self.loads: Counter[int] = Counter()  # steps loaded, by bucket
        self._triton = None
        if heads is not None:
            num_heads, kv_heads, head_dim = heads
            rows = torch.arange(max_rows, dtype=torch.int32)
            tiles = torch.stack([rows, rows + 1, torch.ones_like(rows), rows * max_blocks], 1)
            self._tiles = tiles.to(self.device)  # column 2, the context length, is copied in per step
            self._tables32 = torch.zeros(max_rows * max_blocks, dtype=torch.int32, device=self.device)
            self._triton = (num_heads // kv_heads, head_dim, kv_heads)

    def _part(self, buffer: torch.Tensor, index: int) -> torch.Tensor:
        """The index-th [max_rows] field (ids, positions, slots, context lengths) of a buffer."""
        return buffer[index * self.max_rows:(index + 1) * self.max_rows]

    def _tables(self, buffer: torch.Tensor) -> torch.Tensor:
        return buffer[4 * self.max_rows:].view(self.max_rows, self.max_blocks)

    def fits(self, tables: list[list[int]]) -> int | None:
        """The bucket of a decode step whose sequences have these block tables, or None when it has more
        sequences than the largest bucket or a table wider than the buffers."""
        if any(len(table) > self.max_blocks for table in tables):
            return None
        return bucket_for(len(tables), self.buckets)

    def load(self, spans: list[tuple[int, int, list[int], int]], bucket: int, kernel=None) -> StaticStep:
        """spans: per sequence (its token id, its position, its block table, its context length), at most
        `bucket` of them (fits). Fills the rows after them with padding, sends the step to the device in one
        copy and returns the step on views of the buffers. kernel: the model's attention kernel
        (model.backend.attention): a Triton one gets its plan on the buffers; any other plans for itself."""
        triton = self._triton is not None and is_triton_kernel(kernel)
        n, bs, pad = len(spans), self.block_size, bucket - len(spans)
        if self._sent is not None:
            self._sent.synchronize()  # the previous step's copy has read the host buffer
            self._sent = None
        fields = self._host[:4 * self.max_rows].view(4, self.max_rows)  # ids, positions, slots, context lengths
        fields[:, :bucket] = torch.tensor([
            [s[0] for s in spans] + [0] * pad,
            [s[1] for s in spans] + [0] * pad,
            [s[2][s[1] // bs] * bs + s[1] % bs for s in spans] + [self.scratch_block * bs] * pad,
            [s[3] for s in spans] + [1] * pad], dtype=torch.long)
        tables = self._tables(self._host)
        for i, span in enumerate(spans):  # the columns after a table's end keep what they held: nothing reads them
            tables[i, :len(span[2])] = torch.tensor(span[2], dtype=torch.long)
        tables[n:bucket, 0] = self.scratch_block
        self._send(bucket, triton)
        self.loads[bucket] += 1
        widths = [len(s[2]) for s in spans] + [1] * pad
        positions = self._part(self._dev, 1)[:bucket]  # the very tensor the forward gets: plans are keyed on it
        return StaticStep(n, bucket, self._part(self._dev, 0)[:bucket], positions,
                          lambda: self._metadata(positions, widths, [s[3] for s in spans] + [1] * pad,
                                                 kernel if triton else None))

    def padding(self, bucket: int, kernel=None) -> StaticStep:
        """A step of padding rows alone (what a graph is captured on)."""
        return self.load([], bucket, kernel)

    def _send(self, bucket: int, triton: bool) -> None:
        """The rows of the step's bucket to the device, one copy (the whole head of the buffer: the fields of
        max_rows each, then the first `bucket` tables), and the Triton plan's int32 fields from them."""
        end = 4 * self.max_rows + bucket * self.max_blocks
        if self._dev is not self._host:
            self._dev[:end].copy_(self._host[:end], non_blocking=True)
            self._sent = torch.cuda.Event() if self.device.type == "cuda" else None
            if self._sent is not None:
                self._sent.record()
        if triton:
            self._tiles[:bucket, 2].copy_(self._part(self._dev, 3)[:bucket])
            self._tables32[:bucket * self.max_blocks].copy_(self._dev[4 * self.max_rows:end])

    def _metadata(self, positions: torch.Tensor, widths: list[int], context_lens: list[int],
                  kernel) -> AttentionMetadata:
        """The step's AttentionMetadata on views of the buffers, with the Triton plan where `kernel` is one
        (AttentionMetadata.cached keys it on `positions`, the step's own positions tensor)."""
        bucket = positions.shape[0]
        dev_tables, host_tables = self._tables(self._dev), self._tables(self._host)
        meta = AttentionMetadata(
            query_start=list(range(bucket + 1)),
            block_tables=[dev_tables[i, :w] for i, w in enumerate(widths)], context_lens=context_lens,
            slot_mapping=self._part(self._dev, 2)[:bucket], host_positions=self._part(self._host, 1)[:bucket],
            host_block_tables=[host_tables[i, :w] for i, w in enumerate(widths)])
        if kernel is not None:
            group, head_dim, kv_heads = self._triton
            plan = StaticTritonPlan(self._tiles[:bucket], self._tables32, positions, group, head_dim, kv_heads,
                                    self.max_blocks * self.block_size, kernel)
            meta.use_kernel_plan(positions, plan)
        return meta
