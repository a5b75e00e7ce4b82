"""Attention of an arbitrary set of query tokens against the paged KV pool.

One code path serves prefill, prefill slices, decode and blending: a step is a flattened batch of query
tokens, each with its own position; every query token attends to the keys of its sequence at positions
<= its own (and < the sequence's context length). Query positions of a sequence need not be contiguous."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


KERNEL_PLAN = "kernel_plan"  # the cached() key of the attention kernel's plan


@dataclass
class AttentionMetadata:
    # A flattened batch: T query tokens from S sequences; sequence s owns tokens query_start[s]:query_start[s+1].
    query_start: list[int]  # len S+1
    block_tables: list[torch.Tensor]  # per sequence: its pool block ids (LongTensor, pool device), in position order
    context_lens: list[int]  # per sequence: KV positions 0..ctx-1 to attend over (after this step's writes)
    slot_mapping: torch.Tensor  # [T] where each query token's fresh K/V is written
    # The same step as the host knows it (CPU tensors; the very same tensors when the model runs on the CPU),
    # so that planning a step (masks, runs of consecutive blocks) reads nothing back from the device. None:
    # built from the device tensors when first needed (a caller that made only those).
    host_positions: torch.Tensor | None = None  # [T] each query token's position
    host_block_tables: list[torch.Tensor] | None = None
    _cache_positions: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _cache: dict = field(default_factory=dict, repr=False, compare=False)
    _decode_plan: tuple | None = field(default=None, repr=False, compare=False)
    _leading_runs: list | None = field(default=None, repr=False, compare=False)
    _remapped: "AttentionMetadata | None" = field(default=None, repr=False, compare=False)

    @property
    def num_sequences(self) -> int:
        return len(self.query_start) - 1

    def subset(self, rows: torch.Tensor, device_rows: torch.Tensor | None = None) -> "AttentionMetadata":
        """The same sequences with only the query tokens at `rows` (ascending indices into this step's
        tokens, a CPU tensor; device_rows: the same on the device, where the caller has them already); a
        sequence may keep none."""
        if device_rows is None:
            device_rows = rows.to(self.slot_mapping.device)
        picked = rows.tolist()
        starts, i = [0], 0
        for end in self.query_start[1:]:
            while i < len(picked) and picked[i] < end:
                i += 1
            starts.append(i)
        if i != len(picked):
            raise ValueError(f"rows {picked} are not ascending indices below {self.query_start[-1]}")
        host_positions = None if self.host_positions is None else self.host_positions[rows]
        return AttentionMetadata(starts, self.block_tables, self.context_lens, self.slot_mapping[device_rows],
                                 host_positions=host_positions, host_block_tables=self.host_block_tables)

    def remapped(self, table: torch.Tensor, block_size: int) -> "AttentionMetadata":
        """The same step in another pool's block ids (a hybrid pool's window layers: table[id] is the id's
        block there), built once and shared by every layer of that pool."""
        if self._remapped is None:
            host_tables = None
            if self.host_block_tables is not None and table.device.type == "cpu":
                host_tables = [table[t] for t in self.host_block_tables]
            on_device = table.to(self.slot_mapping.device)
            slots = self.slot_mapping
            self._remapped = AttentionMetadata(
                self.query_start, [on_device[t] for t in self.block_tables], self.context_lens,
                on_device[torch.div(slots, block_size, rounding_mode="floor")] * block_size + slots % block_size,
                host_positions=self.host_positions, host_block_tables=host_tables)
        return self._remapped

    def cached(self, positions: torch.Tensor, key, build):
        """build(), computed once per positions tensor and key and then shared by every layer of a forward
        pass (masks, RoPE cos/sin). Keyed on the tensor object: do not modify positions in place."""
        if self._cache_positions is not positions:
            self._cache_positions, self._cache = positions, {}
        if key not in self._cache:
            self._cache[key] = build()
        return self._cache[key]

    def kernel_plan(self, positions: torch.Tensor, build):
        """The attention kernel's plan of this step (model.backend.attention.plan), built once per positions
        tensor and shared by every layer."""
        return self.cached(positions, KERNEL_PLAN, build)

    def use_kernel_plan(self, positions: torch.Tensor, plan) -> None:
        """Give the step a plan built beforehand (engine/decode_inputs.py: one on static buffers, which a
        CUDA graph replays), which kernel_plan then returns instead of building one."""
        self.cached(positions, KERNEL_PLAN, lambda: plan)

    def leading_run(self, pool, s: int) -> tuple[int, int]:
        """(first block id, number of blocks) of the consecutive block ids that start sequence s's table,
        worked out once per step."""
        if self._leading_runs is None:
            tables = self.block_tables if self.host_block_tables is None else self.host_block_tables
            self._leading_runs = [pool.leading_run(t, n) for t, n in zip(tables, self.context_lens)]
        return self._leading_runs[s]

    def consecutive_start(self, pool, s: int) -> int | None:
        """The first block id when all of sequence s's context lies in consecutive blocks, else None."""
        first, blocks = self.leading_run(pool, s)
        return first if blocks and blocks * pool.block_size >= self.context_lens[s] else None

    def sequence_masks(
        self, positions: torch.Tensor, sliding_window: int | None, dtype: torch.dtype
    ) -> list["_SequenceMask"]:
        """Per sequence, how to mask its attention."""
        key = ("masks", sliding_window, dtype)
        return self.cached(positions, key, lambda: _build_masks(self, positions, sliding_window, dtype))


@dataclass
class _SequenceMask:
    is_causal: bool  # queries are exactly positions 0..ctx-1 in order: SDPA's own causal mask is right
    mask: torch.Tensor | None  # additive [n, ctx]: 0 = may attend, -inf = not; None when nothing is masked
    # With a mask, queries in ascending position order are attended in groups: (first row, end row, keys),
    # each group against only the keys its last query can see (scattered blended queries or a prefill slice deep
    # in a long context would otherwise score every key and mask half of them away).
    groups: list[tuple[int, int, int]] | None = None
    first_query: int = 0  # the lowest query position
    windowed: bool = False
    first_key: int = 0  # windowed: the lowest key position any query sees (the ones before it are masked)
    _folded: dict = field(default_factory=dict, repr=False, compare=False)

    def folded(self, lo: int, hi: int, keys: int, group: int, first_key: int = 0) -> torch.Tensor | None:
        """mask[lo:hi, first_key:keys] with its rows repeated for each of `group` query heads sharing a KV
        head, built once per step (see _attend_folded)."""
        if self.mask is None:
            return None
        key = (lo, hi, keys, group, first_key)
        if key not in self._folded:
            self._folded[key] = self.mask[lo:hi, first_key:keys].repeat(group, 1)
        return self._folded[key]


# Split masked queries into groups of at least this many rows (a smaller SDPA call costs more than it saves).
MIN_GROUP_ROWS = 32
MAX_GROUPS = 8
# Up to this many query rows, the query heads sharing a KV head are folded into one head's rows
# (_attend_folded): the fused CPU kernel then runs fewer, taller blocks (as many times fewer as heads share a
# KV head), which was faster from 2 rows to this many and slightly slower for one (BENCHMARKS.md, "CPU
# kernel choices").
FOLD_MAX_ROWS = 128
# A few queries after a long cached prefix whose blocks are consecutive ids except the last few (the usual
# shape of a warm request: the matched blocks came out of the pool in order, the new ones did not) attend the
# prefix in place and only the rest through a gather, merged by log-sum-exp (_attend_split): no multi-MiB copy
# of the prefix per layer. CPU only (the kernel that returns the log-sum-exp is the CPU flash kernel).
SPLIT_CACHED_PREFIX = True


def _query_groups(q_pos: torch.Tensor, ctx: int) -> list[tuple[int, int, int]]:
    n = q_pos.shape[0]
    count = min(MAX_GROUPS, n // MIN_GROUP_ROWS)
    if count < 2 or not bool((q_pos[1:] >= q_pos[:-1]).all()):
        return [(0, n, ctx)]
    bounds = [n * g // count for g in range(count + 1)]
    return [(lo, hi, int(q_pos[hi - 1]) + 1) for lo, hi in zip(bounds, bounds[1:])]


def _build_masks(
    meta: AttentionMetadata, positions: torch.Tensor, window: int | None, dtype: torch.dtype
) -> list[_SequenceMask]:
    if len(meta.block_tables) != meta.num_sequences or len(meta.context_lens) != meta.num_sequences:
        raise ValueError("query_start, block_tables and context_lens disagree on the number of sequences")
    if meta.query_start[0] != 0 or meta.query_start[-1] != positions.shape[0]:
        raise ValueError(f"query_start {meta.query_start} does not cover the {positions.shape[0]} query tokens")
    if meta.slot_mapping.shape[0] != positions.shape[0]:
        raise ValueError(f"slot_mapping has {meta.slot_mapping.shape[0]} slots for {positions.shape[0]} query tokens")
    host_positions = positions.cpu() if meta.host_positions is None else meta.host_positions
    out = []
    for s in range(meta.num_sequences):
        lo, hi = meta.query_start[s], meta.query_start[s + 1]
        ctx = meta.context_lens[s]
        q_pos = host_positions[lo:hi]
        if hi == lo:
            out.append(_SequenceMask(False, None))
            continue
        if int(q_pos.max()) >= ctx or int(q_pos.min()) < 0:
            raise ValueError(f"sequence {s}: query positions must lie in [0, {ctx}), got {q_pos.tolist()[:8]}...")
        windowed = window is not None and ctx > window
        if not windowed and hi - lo == ctx and torch.equal(q_pos, torch.arange(ctx)):
            out.append(_SequenceMask(True, None))
        elif not windowed and int(q_pos.min()) == ctx - 1:
            out.append(_SequenceMask(False, None, None, ctx - 1))  # every query sees the whole context
        else:
            q_dev = positions[lo:hi]
            k_pos = torch.arange(ctx, device=positions.device)
            mask = k_pos[None, :] <= q_dev[:, None]
            if windowed:
                mask &= k_pos[None, :] > q_dev[:, None] - window
            # Additive, built once: SDPA would otherwise turn a bool mask into this in every layer.
            additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            groups = [(0, hi - lo, ctx)] if windowed else _query_groups(q_pos, ctx)
            first_key = max(0, int(q_pos.min()) - window + 1) if windowed else 0
            out.append(_SequenceMask(False, additive, groups, int(q_pos.min()), windowed, first_key))
    return out


def paged_attention(
    q: torch.Tensor,
    meta: AttentionMetadata,
    masks: list[_SequenceMask],
    pool,
    layer_idx: int,
    scale: float,
) -> torch.Tensor:
    """q: [T, heads, head_dim] (post-RoPE). The query tokens' own K/V must already be in the pool.
    Returns [T, heads, head_dim]."""
    if len(masks) > 1 and all(m.mask is None and not m.is_causal for m in masks) and q.shape[0] == len(masks):
        return _decode_batch(q, meta, pool, layer_idx, scale)
    out = torch.empty_like(q)
    for s, seq_mask in enumerate(masks):
        lo, hi = meta.query_start[s], meta.query_start[s + 1]
        if hi == lo:
            continue
        run = _in_place_run(q, meta, pool, s, seq_mask, hi - lo)
        if run is not None:
            out[lo:hi] = _attend_split(q[lo:hi], meta, pool, layer_idx, s, seq_mask, run, scale)
            continue
        # A sliding window's queries see none of the blocks before its first key: they are not read (on a hybrid
        # pool they hold no KV at all) and the mask's columns start after them.
        skip = seq_mask.first_key // pool.block_size
        offset = skip * pool.block_size
        if skip:
            k, v = pool.gather(layer_idx, meta.block_tables[s][skip:], meta.context_lens[s] - offset)
        else:
            k, v = pool.gather(layer_idx, meta.block_tables[s], meta.context_lens[s], meta.consecutive_start(pool, s))
        k, v = k.to(q.dtype).transpose(0, 1).unsqueeze(0), v.to(q.dtype).transpose(0, 1).unsqueeze(0)
        for g_lo, g_hi, keys in seq_mask.groups or [(0, hi - lo, meta.context_lens[s])]:
            rows = q[lo + g_lo:lo + g_hi]
            seen = keys - offset
            if not seq_mask.is_causal and 2 <= g_hi - g_lo <= FOLD_MAX_ROWS and q.shape[1] > k.shape[1]:
                group = q.shape[1] // k.shape[1]
                out[lo + g_lo:lo + g_hi] = _attend_folded(
                    rows, k[:, :, :seen], v[:, :, :seen], seq_mask.folded(g_lo, g_hi, keys, group, offset), scale)
                continue
            mask = None if seq_mask.mask is None else seq_mask.mask[g_lo:g_hi, offset:keys]
            # [1, heads, n, hd]: the 4-D layout picks the fused CPU kernel; the 3-D one falls back to math.
            attn = F.scaled_dot_product_attention(
                rows.transpose(0, 1).unsqueeze(0),
                k[:, :, :seen],
                v[:, :, :seen],
                attn_mask=mask,
                is_causal=seq_mask.is_causal,
                scale=scale,
                enable_gqa=True,
            )
            out[lo + g_lo:lo + g_hi] = attn.squeeze(0).transpose(0, 1)
    return out


def _in_place_run(q, meta: AttentionMetadata, pool, s: int, seq_mask: _SequenceMask, rows: int):
    """(first block, blocks) of sequence s's prefix to attend in place (see SPLIT_CACHED_PREFIX), or None."""
    if (not SPLIT_CACHED_PREFIX or q.device.type != "cpu" or seq_mask.is_causal or seq_mask.windowed
            or not 2 <= rows <= FOLD_MAX_ROWS or q.shape[1] == pool.num_kv_heads or q.dtype != pool.dtype
            or meta.consecutive_start(pool, s) is not None):
        return None
    first, blocks = meta.leading_run(pool, s)
    prefix = blocks * pool.block_size
    # every query must see the whole prefix and at least one key after it (its own)
    if prefix * 2 < meta.context_lens[s] or seq_mask.first_query < prefix:
        return None
    return first, blocks


def _attend_split(q: torch.Tensor, meta: AttentionMetadata, pool, layer: int, s: int, seq_mask: _SequenceMask,
                  run: tuple[int, int], scale: float) -> torch.Tensor:
    """Attention of q ([n, heads, hd]) over sequence s: its leading run of consecutive blocks read in place
    (no mask: every query sees all of it), the remaining keys gathered and masked, the two partial results
    merged by their log-sum-exp."""
    first, blocks = run
    n, heads, hd = q.shape
    kv_heads, prefix, ctx = pool.num_kv_heads, blocks * pool.block_size, meta.context_lens[s]
    group = heads // kv_heads
    folded = _fold_heads(q, kv_heads)
    k_run, v_run = pool.run(layer, first, blocks)
    k_run, v_run = k_run.transpose(0, 1).unsqueeze(0), v_run.transpose(0, 1).unsqueeze(0)
    k_rest, v_rest = pool.gather(layer, meta.block_tables[s][blocks:], ctx - prefix)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    o_run, lse_run = flash(folded, k_run, v_run, scale=scale)[:2]
    o_rest, lse_rest = flash(folded, k_rest.transpose(0, 1).unsqueeze(0), v_rest.transpose(0, 1).unsqueeze(0),
                             attn_mask=seq_mask.folded(0, n, ctx, group, prefix), scale=scale)[:2]
    # softmax over both parts = each part's softmax weighted by its share of the total exp-sum
    # (the log-sum-exps are fp32 whatever the outputs' dtype: lerp takes a weight of the outputs' own)
    share_run = torch.sigmoid(lse_run - lse_rest).unsqueeze_(-1).to(o_run.dtype)
    return _unfold_heads(torch.lerp(o_rest, o_run, share_run), n)


def _fold_heads(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[n, heads, hd] -> [1, kv_heads, group * n, hd]: GQA without repeating K/V, query head h*group + g of
    token t becomes row g*n + t of KV head h (masks for it are repeated `group` times, head-in-group major)."""
    n, heads, hd = q.shape
    group = heads // kv_heads
    return q.reshape(n, kv_heads, group, hd).permute(1, 2, 0, 3).reshape(1, kv_heads, group * n, hd)


def _unfold_heads(out: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of _fold_heads: [1, kv_heads, group * n, hd] -> [n, heads, hd]."""
    _, kv_heads, rows, hd = out.shape
    return out.view(kv_heads, rows // n, n, hd).permute(2, 0, 1, 3).reshape(n, kv_heads * (rows // n), hd)


def _attend_folded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                   scale: float) -> torch.Tensor:
    """q: [n, heads, hd]; k, v: [1, kv_heads, keys, hd]; mask: [group * n, keys] (see _fold_heads)."""
    out = F.scaled_dot_product_attention(_fold_heads(q, k.shape[1]), k, v, attn_mask=mask, scale=scale)
    return _unfold_heads(out, q.shape[0])


def _decode_batch(q: torch.Tensor, meta: AttentionMetadata, pool, layer_idx: int, scale: float) -> torch.Tensor:
    """Several sequences with one query token each, every one seeing its whole context: one gather of the
    block tables padded to the longest context, one masked attention call, instead of a call per sequence."""
    s, heads, hd = q.shape
    kv_heads = pool.num_kv_heads
    if meta._decode_plan is None:
        bs = pool.block_size
        longest = max(meta.context_lens)
        width = -(-longest // bs)
        table = torch.zeros(len(meta.block_tables), width, dtype=torch.long, device=q.device)
        for i, t in enumerate(meta.block_tables):
            n = -(-meta.context_lens[i] // bs)
            table[i, :n] = t[:n]
        lens = torch.tensor(meta.context_lens, device=q.device)
        valid = torch.arange(longest, device=q.device)[None, :] < lens[:, None]
        mask = torch.zeros(valid.shape, dtype=q.dtype, device=q.device).masked_fill_(~valid, float("-inf"))
        meta._decode_plan = (table.flatten(), mask[:, None, None, :], longest)
    flat_table, mask, longest = meta._decode_plan
    # index_select over whole blocks: far cheaper than advanced indexing with a 2-D table
    k, v = pool.gather_blocks(layer_idx, flat_table)
    k, v = k.view(s, -1, kv_heads, hd)[:, :longest], v.view(s, -1, kv_heads, hd)[:, :longest]
    # The query heads sharing a KV head become that head's query rows (GQA without repeating K/V).
    out = F.scaled_dot_product_attention(
        q.view(s, kv_heads, heads // kv_heads, hd), k.to(q.dtype).transpose(1, 2), v.to(q.dtype).transpose(1, 2),
        attn_mask=mask, scale=scale)
    return out.reshape(s, heads, hd)
