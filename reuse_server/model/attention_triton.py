"""Paged attention over the KV pool in Triton: one kernel for decode, prefill, prefill slices and blending's
scattered rows, reading K/V in place through the block tables (no gather, no padding to the longest context).

The facts it is built on come from vLLM's unified Triton attention and SGLang's decode/extend kernels (their
code is not copied):
- one launch serves a mixed batch: the step's query rows are cut into tiles of at most BLOCK_Q tokens of one
  sequence, and a program attends one tile for one KV head (vLLM's "query blocks");
- GQA without repeating K/V: the query heads sharing a KV head are rows of the same tile, BLOCK_M = BLOCK_Q *
  group rows, at least 16 so that `tl.dot` compiles on a GPU (vLLM's BLOCK_M / num_queries_per_kv);
- split-KV for steps with few tiles (decode): a third grid axis cuts each tile's key range into NUM_SPLITS
  parts, each writes its normalized partial output and its log-sum-exp, and a second kernel merges them
  (SGLang's stage 1 / stage 2, vLLM's segments);
- an online softmax in base 2 (exp2 with log2(e) folded into the scale).

What is ours: every query row carries its own position (read from the positions tensor, as the torch path
does), so one rule masks a causal prefill, a slice deep in a cached prefix, a decode row and blending's
scattered recomputed rows alike: a row sees the keys at positions <= its own, and with a sliding window only
those after its position - window; each tile reads only the key range its rows can see. The pool's 8-bit
formats are read as stored, their scales (per block and KV head for fp8, per slot and KV head for int8)
applied to the scores and the probabilities inside the kernel, so an 8-bit pool costs a quarter of the bytes.

Tile sizes respect what a GPU compiles: powers of two, `tl.dot` dimensions of at least 16, and K/V tiles that
fit shared memory for head dims 64 to 256 (BLOCK_N shrinks as the head dim grows).

On the CPU, Triton runs kernels only in its interpreter, and only when TRITON_INTERPRET=1 was in the
environment before triton was imported (triton.language's own helpers are kernels, decorated at import): the
kernels then take CPU tensors, which is how the tests check them against the torch path without a GPU.
`runs_on(device)` says whether they can run there in this process."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# A step whose tiles x KV heads give fewer programs than this splits each tile's keys (a decode batch would
# otherwise leave most of a GPU's multiprocessors idle); at most MAX_SPLITS parts, each of at least
# MIN_SPLIT_KEYS keys (below that the merge costs more than the split saves).
SPLIT_BELOW_PROGRAMS = 256
MAX_SPLITS = 16
MIN_SPLIT_KEYS = 256
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8)
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


def _paged_attention(
    q_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    k_ptr, v_ptr, k_scale_ptr, v_scale_ptr,
    tiles_ptr, tables_ptr, pos_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh,
    stride_sb, stride_ss, stride_sh,
    num_rows, num_heads,
    qk_scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SCALED: tl.constexpr, IEEE: tl.constexpr, WIDEN: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row_lo = tl.load(tiles_ptr + tile * 4)
    row_hi = tl.load(tiles_ptr + tile * 4 + 1)
    ctx = tl.load(tiles_ptr + tile * 4 + 2)
    table = tl.load(tiles_ptr + tile * 4 + 3)

    m = tl.arange(0, BLOCK_M)
    tok = row_lo + m // GROUP
    head = kv_head * GROUP + m % GROUP
    row_ok = (m < BLOCK_Q * GROUP) & (tok < row_hi)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    pos = tl.load(pos_ptr + tok, mask=row_ok, other=0).to(tl.int32)
    q = tl.load(q_ptr + tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if WIDEN:  # the interpreter's tl.dot multiplies 16-bit floats' bit patterns: take them in fp32 there
        q = q.to(tl.float32)

    # The keys any row of this tile sees: up to its last row's position, from its first row's window start.
    key_hi = tl.minimum(tl.max(tl.where(row_ok, pos, -1), axis=0) + 1, ctx)
    key_lo = 0
    if window > 0:
        key_lo = tl.maximum(tl.min(tl.where(row_ok, pos, 2147483647), axis=0) - window + 1, 0)
    # (ceiling divisions by hand: tl.cdiv is a kernel of its own, which the interpreter pays for at every call)
    num_key_tiles = (tl.maximum(key_hi - key_lo, 0) + BLOCK_N - 1) // BLOCK_N
    per_split = (num_key_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    first_tile = split * per_split
    end_tile = tl.minimum(first_tile + per_split, num_key_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for t in range(first_tile, end_tile):
        key = key_lo + t * BLOCK_N + n
        key_ok = key < key_hi
        block = tl.load(tables_ptr + table + key // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = key % BLOCK_SIZE
        where = block * stride_kb + slot * stride_ks + kv_head * stride_kh
        kv_mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + where[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(v_ptr + where[:, None] + d[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        if SCALED:
            scale_at = block * stride_sb + slot * stride_ss + kv_head * stride_sh
            s = s * tl.load(k_scale_ptr + scale_at, mask=key_ok, other=0.0)[None, :]
        s = s * qk_scale
        seen = key_ok[None, :] & (key[None, :] <= pos[:, None])
        if window > 0:
            seen = seen & (key[None, :] > pos[:, None] - window)
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if SCALED:
            p = p * tl.load(v_scale_ptr + scale_at, mask=key_ok, other=0.0)[None, :]
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + tok.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # [splits, rows, heads, BLOCK_D] and [splits, rows, heads], fp32; lse in base 2, -inf for no key
        at = (split * num_rows + tok.to(tl.int64)) * num_heads + head
        tl.store(part_out_ptr + at[:, None] * BLOCK_D + d[None, :], out, mask=out_mask)
        tl.store(part_lse_ptr + at, m_i + tl.log2(l_i), mask=row_ok)


def _merge_splits(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh, num_rows, num_heads,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
):
    """One (row, head): the splits' partial outputs weighted by their share of the exp-sum."""
    row = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    at = (s.to(tl.int64) * num_rows + row) * num_heads + head
    lse = tl.load(part_lse_ptr + at, mask=s_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    weight = tl.where(s_ok & (lse > float("-inf")), tl.exp2(lse - top), 0.0)
    parts = tl.load(part_out_ptr + at[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    out = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(out_ptr + row.to(tl.int64) * stride_ot + head * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


_attend = triton.jit(_paged_attention)
_merge = triton.jit(_merge_splits)


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter in this process (TRITON_INTERPRET=1 at import)."""
    return bool(triton.knobs.runtime.interpret)


def runs_on(device: "torch.device | str") -> bool:
    """Whether the kernels run on `device` here: CUDA compiles them; the CPU runs them in the interpreter."""
    device = torch.device(device)
    return interpreting() if device.type == "cpu" else device.type == "cuda"


def tile_shape(group: int, head_dim: int, most_rows: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_Q, BLOCK_N): rows of a tile (its tokens x the query heads of one KV head), its tokens,
    and keys read at a time. A decode tile (one token) takes the fewest rows `tl.dot` accepts, a prefill tile
    64 or more; the key tile shrinks with the head dim so that K and V tiles of two pipeline stages fit a GPU's
    shared memory (bf16, head dim 256: 2 x 2 x 32 x 256 x 2 bytes = 64 KiB). The interpreter has no shared
    memory and pays per operation, so it takes wider key tiles."""
    smallest = max(16, triton.next_power_of_2(group))
    block_m = smallest if most_rows * group <= smallest else max(64, smallest)
    block_d = triton.next_power_of_2(head_dim)
    block_n = 128 if device.type == "cpu" else (64 if block_d <= 64 else 32)
    return block_m, block_m // group, block_n


def num_splits(programs: int, longest: int) -> int:
    """How many parts each tile's keys are cut into (see SPLIT_BELOW_PROGRAMS)."""
    if programs >= SPLIT_BELOW_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, SPLIT_BELOW_PROGRAMS // programs, longest // MIN_SPLIT_KEYS))


class TritonPlan:
    """A step's tiles in the kernel's terms, built once from the host lists the runner already has and sent to
    the device in one copy (the block tables are already there: concatenated on the device): per tile (first
    query row, end row, the sequence's context length, offset of its block table)."""

    def __init__(self, query_start: list[int], block_tables: list[torch.Tensor], context_lens: list[int],
                 positions: torch.Tensor, block_size: int, group: int, head_dim: int,
                 splits: int | None = None, block_n: int | None = None):
        n = len(query_start) - 1
        if len(block_tables) != n or len(context_lens) != n:
            raise ValueError("query_start, block_tables and context_lens disagree on the number of sequences")
        if query_start[0] != 0 or query_start[-1] != positions.shape[0]:
            raise ValueError(f"query_start {query_start} does not cover the {positions.shape[0]} query tokens")
        device = positions.device
        most_rows = max((query_start[s + 1] - query_start[s] for s in range(n)), default=1)
        self.block_m, self.block_q, self.block_n = tile_shape(group, head_dim, most_rows, device)
        self.block_n = block_n or self.block_n
        tiles, offset = [], 0
        for s in range(n):
            lo, hi, ctx = query_start[s], query_start[s + 1], context_lens[s]
            if hi < lo or len(block_tables[s]) * block_size < ctx:
                raise ValueError(f"sequence {s}: {len(block_tables[s])} blocks cannot hold {ctx} positions")
            tiles += [(first, min(first + self.block_q, hi), ctx, offset) for first in range(lo, hi, self.block_q)]
            offset += len(block_tables[s])
        self.num_tiles = len(tiles)
        self.tiles = torch.tensor(tiles or [(0, 0, 0, 0)], dtype=torch.int32).to(device, non_blocking=True)
        self.tables = (torch.cat([t.to(device=device, dtype=torch.int32) for t in block_tables if len(t)])
                       if offset else torch.zeros(1, dtype=torch.int32, device=device))
        self.positions = positions
        self.longest = max(context_lens, default=0)
        self.splits = splits

    def splits_for(self, kv_heads: int) -> int:
        return self.splits if self.splits is not None else num_splits(self.num_tiles * kv_heads, self.longest)


class TritonAttentionKernel:
    """The paged Triton kernel as the model's attention (model.backend.attention): `takes` says which calls
    it serves, `plan` builds a step's plan once (shared by every layer of one pool), the call attends.
    splits, block_n: force the split-KV parts and the keys read at a time (tests: short contexts through
    several key tiles and parts); None: num_splits and tile_shape decide."""

    def __init__(self, splits: int | None = None, block_n: int | None = None):
        self.splits = splits
        self.block_n = block_n

    @staticmethod
    def takes(q: torch.Tensor, pool) -> bool:
        return (q.dtype in QUERY_DTYPES and pool.dtype in POOL_DTYPES and q.device == pool.device
                and runs_on(q.device)
                and pool.head_dim <= MAX_HEAD_DIM and q.shape[1] % pool.num_kv_heads == 0)

    def plan(self, meta, positions: torch.Tensor, pool, num_heads: int) -> TritonPlan:
        return TritonPlan(meta.query_start, meta.block_tables, meta.context_lens, positions, pool.block_size,
                          num_heads // pool.num_kv_heads, pool.head_dim, self.splits, self.block_n)

    def __call__(self, q: torch.Tensor, plan: TritonPlan, pool, layer: int, scale: float,
                 window: int | None) -> torch.Tensor:
        """q: [T, heads, head_dim] (post-RoPE; a view with a wider token stride is fine). Returns [T, heads,
        head_dim]; every token's own K/V must already be in the pool."""
        k, v = pool.layer_blocks(layer)
        k_scale, v_scale = pool.layer_scales(layer)
        return paged_attention(q, plan, k, v, k_scale, v_scale, scale, window)


def paged_attention(q: torch.Tensor, plan: TritonPlan, k: torch.Tensor, v: torch.Tensor,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, scale: float,
                    window: int | None) -> torch.Tensor:
    """Attention of q [T, heads, head_dim] over one layer's pool K/V [blocks, block_size, kv_heads, head_dim]
    (any of POOL_DTYPES; the 8-bit ones with their scales, [blocks, kv_heads] for fp8, [blocks, block_size,
    kv_heads] for int8) through plan's tiles. Returns [T, heads, head_dim] in q's dtype."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    rows, heads, hd = q.shape
    _, block_size, kv_heads, _ = k.shape
    out = torch.empty((rows, heads, hd), dtype=q.dtype, device=q.device)
    if rows == 0 or plan.num_tiles == 0:
        return out
    if k.stride() != v.stride() or k.stride(-1) != 1:
        raise ValueError("K and V must share one layout with the head dim innermost")
    scaled = k_scale is not None
    if scaled:
        # fp8: one scale per block and KV head (no slot stride); int8: one per slot and KV head
        stride_sb, stride_ss, stride_sh = ((k_scale.stride(0), 0, k_scale.stride(1)) if k_scale.dim() == 2
                                           else k_scale.stride())
    else:
        k_scale = v_scale = k
        stride_sb = stride_ss = stride_sh = 0
    splits = plan.splits_for(kv_heads)
    block_d = triton.next_power_of_2(hd)
    part_out = part_lse = out
    if splits > 1:
        part_out = torch.empty((splits, rows, heads, block_d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((splits, rows, heads), dtype=torch.float32, device=q.device)
    _attend[(plan.num_tiles, kv_heads, splits)](
        q, out, part_out, part_lse, k, v, k_scale, v_scale, plan.tiles, plan.tables, plan.positions,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k.stride(0), k.stride(1), k.stride(2), stride_sb, stride_ss, stride_sh,
        rows, heads, scale * math.log2(math.e), window or 0,
        GROUP=heads // kv_heads, HEAD_DIM=hd, BLOCK_D=block_d, BLOCK_M=plan.block_m, BLOCK_Q=plan.block_q,
        BLOCK_N=plan.block_n, BLOCK_SIZE=block_size, NUM_SPLITS=splits, SCALED=scaled,
        IEEE=q.dtype == torch.float32 or interpreting(), WIDEN=interpreting())
    if splits > 1:
        _merge[(rows, heads)](
            part_out, part_lse, out, out.stride(0), out.stride(1), rows, heads,
            HEAD_DIM=hd, BLOCK_D=block_d, NUM_SPLITS=splits, BLOCK_S=triton.next_power_of_2(splits))
    return out
