"""Non-prefix reuse inside the engine: fill a prompt's KV from the chunk index, then recompute only the
tokens whose reused KV deviates most (CacheBlend), through the same model layers as every other forward.

A blended prefill runs in three parts:
1. plan: after the exact prefix match, look every reusable chunk of the rest of the prompt up in the
   chunk index and lock what is found (so allocating the prompt's blocks cannot evict it);
2. copy in: copy those tokens' KV into the sequence's blocks and re-RoPE the keys from positions
   0..n-1 to where the chunk now sits; then drop the locks;
   Chunks cached alone that other text now precedes also get the model's key shift (blend/key_shift.py):
   the systematic difference between a chunk's keys alone and after other text;
3. forward, layer by layer: every token not reused is always computed; reused tokens are computed up
   to the first check layer, where the deviation between their stale and fresh KV picks the ones to
   keep computing (gradually fewer at later check layers); the rest keep their reused KV from there on.
After a request's prompt is computed, its reusable chunks that the index lacks are registered: their KV
is copied to fresh blocks at positions 0..n-1 and filed in the chunk namespace of the radix cache.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from blend import GradualSchedule, first_tokens_mask, kv_deviation, rerope_layers_
from blend.chunk_index import ChunkHit, ChunkIndex
from blend.key_shift import KeyShift
from blend.selection import combine_scores, count_for_ratio, query_attention, select_top_k
from radix import OutOfBlocks

from reuse_server.block_manager import approximate_namespace
from reuse_server.kv_pool import KVPool
from reuse_server.model.attention import AttentionMetadata
from reuse_server.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class BlendSettings:
    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    # Gradual filtering: the fraction kept at each check layer is ratio * factor, the factors falling to 1
    # at the last check layer (e.g. check layers (1, 2, 3) with factors (3, 2, 1)).
    gradual_factors: tuple[float, ...] = (1.0,)
    score: str = "kv"  # deviation score: "k", "v" or "kv"
    first_tokens: int = 0  # always recompute each reused chunk's first k tokens (EPIC); 0: off
    # Query-aware selection: a probe pass runs the prompt's tail after the last reused chunk (the question)
    # over the reused KV; the attention it pays each reused token, summed over layers, joins the deviation
    # score with this weight. 0: deviation alone (CacheBlend).
    query_weight: float = 0.0
    min_chunk_tokens: int = 32

    def schedule(self, ratio: float) -> GradualSchedule:
        ratios = [min(1.0, ratio * f) for f in self.gradual_factors]
        return GradualSchedule(list(self.check_layers), ratios)


@dataclass
class Reuse:
    start: int  # prompt position the chunk starts at
    hit: ChunkHit
    skip: int = 0  # leading chunk tokens already served by the exact prefix match


@dataclass
class BlendPlan:
    reuses: list[Reuse]
    ratio: float
    locked: bool = True  # the chunk nodes are locked until their KV is copied in

    @property
    def spans(self) -> list[tuple[int, int]]:
        """(prompt position, tokens) of each reused piece."""
        return [(r.start + r.skip, r.hit.num_tokens - r.skip) for r in self.reuses]

    @property
    def chunk_starts(self) -> set[int]:
        return {r.start for r in self.reuses}


class Blender:
    def __init__(self, model, kv: KVPool, index: ChunkIndex, settings: BlendSettings, block_size: int,
                 key_shift: KeyShift | None = None) -> None:
        self.model = model
        self.key_shift = key_shift
        self.kv = kv
        self.index = index
        self.settings = settings
        self.block_size = block_size
        settings.schedule(settings.recompute_ratio).validate_for(len(model.layers))
        self.registered_chunks = 0

    def _spans_ending_after(self, seq: Sequence, pos: int) -> list[tuple[int, int]]:
        return [(s, n) for s, n in seq.cache.chunk_spans if s + n > pos and n >= self.index.min_tokens]

    # 1. plan ------------------------------------------------------------------------------
    def plan(self, seq: Sequence) -> BlendPlan | None:
        """Chunks of seq after its prefix hit that the index holds, their nodes locked; None if none."""
        if seq.output_ids:  # a preempted request recomputes exactly
            return None
        salt = seq.extra_key
        reuses = []
        for start, n in self._spans_ending_after(seq, seq.num_computed):
            hit = self.index.lookup(seq.prompt_ids[start:start + n], salt)
            skip = max(0, seq.num_computed - start)  # a chunk may begin inside the exact prefix hit
            if hit is not None and hit.num_tokens > skip:
                self.index.cache.lock(hit.match.node)
                reuses.append(Reuse(start, hit, skip))
        if not reuses:
            return None
        return BlendPlan(reuses, self.ratio_for(seq))

    def ratio_for(self, seq: Sequence) -> float:
        ratio = seq.cache.recompute_ratio
        return self.settings.recompute_ratio if ratio is None else ratio

    def approximate_key(self, seq: Sequence) -> bytes:
        """The namespace seq's blended KV is filed under: everything that decides what KV blending produces."""
        s = self.settings
        return approximate_namespace(f"r={self.ratio_for(seq):.6g};score={s.score};check={s.check_layers};"
                                     f"factors={s.gradual_factors};first={s.first_tokens};query={s.query_weight:g};"
                                    f"shift={self.key_shift is not None}")

    def release(self, plan: BlendPlan) -> None:
        if plan.locked:
            for r in plan.reuses:
                self.index.cache.unlock(r.hit.match.node)
            plan.locked = False

    # 2. copy in ---------------------------------------------------------------------------
    def _slots(self, block_table: list[int], positions: range) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([block_table[p // bs] * bs + p % bs for p in positions], dtype=torch.long,
                            device=self.kv.k[0].device)

    def _copy(self, src: torch.Tensor, dst: torch.Tensor, old_pos: torch.Tensor, new_pos: torch.Tensor) -> None:
        for layer in range(self.kv.num_layers):
            k, v = self.kv.read_slots(layer, src)
            self.kv.write(layer, dst, k, v)
        rerope_layers_(self.kv.k, dst, old_pos, new_pos, self.model.rotary.inv_freq)

    @staticmethod
    def _is_first_chunk(seq: Sequence, start: int) -> bool:
        """Only the prompt's framing comes before the chunk at `start`: its KV there is its alone form."""
        return bool(seq.cache.chunk_spans) and seq.cache.chunk_spans[0][0] == start

    def copy_in(self, seq: Sequence, plan: BlendPlan) -> None:
        for r in plan.reuses:
            n = r.hit.num_tokens
            src = self._slots(r.hit.block_ids, range(r.skip, n))
            dst = self._slots(seq.block_table, range(r.start + r.skip, r.start + n))
            pos = torch.arange(r.skip, n, device=dst.device)
            self._copy(src, dst, pos, pos + r.start)
            # a chunk cached alone needs the shift only where other text now precedes it
            if self.key_shift is not None and r.hit.alone and not self._is_first_chunk(seq, r.start):
                self.key_shift.apply_(self.kv.k, dst, pos + r.start, self.model.rotary.inv_freq)

    # 3. forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, seq: Sequence, plan: BlendPlan) -> torch.Tensor:
        """Compute seq's prompt from seq.num_computed on, reusing plan's chunks. Returns the last token's logits."""
        self.copy_in(seq, plan)
        self.release(plan)
        start, end = seq.num_computed, seq.num_tokens
        device = self.kv.k[0].device
        n = end - start
        reused = torch.zeros(n, dtype=torch.bool)
        for s, cnt in plan.spans:
            reused[s - start:s - start + cnt] = True
        reused[-1] = False  # the last token gives the logits
        always = None
        if self.settings.first_tokens:
            always = first_tokens_mask([s - start for s, _ in plan.spans], [c for _, c in plan.spans],
                                       self.settings.first_tokens, total=n)
        n_reused = int(reused.sum())
        schedule = self.settings.schedule(plan.ratio)

        ids = torch.tensor(seq.token_ids[start:end], dtype=torch.long, device=device)
        positions = torch.arange(start, end, dtype=torch.long, device=device)
        slots = self._slots(seq.block_table, range(start, end))
        table = torch.tensor(seq.block_table, dtype=torch.long, device=device)
        active = torch.arange(n)  # indices (into start..end) of the tokens this layer computes
        if schedule.ratios[0] == 0.0 and always is None:
            # nothing will be selected: skip the reused tokens from layer 0 on (plain KV reuse)
            active = (~reused).nonzero(as_tuple=True)[0]
        hidden = self.model.embed(ids[active.to(device)])

        def batch_of(active: torch.Tensor):
            # built once per active set, so masks and RoPE tables are shared by the layers that use it
            act = active.to(device)
            return act, positions[act], AttentionMetadata([0, len(active)], [table], [end], slots[act])

        probe = None
        if self.settings.query_weight and n_reused and schedule.ratios[0] > 0:  # ratio 0 keeps nothing: no ranking
            probe = self._question_probe(ids, positions, slots, table, end, reused)
        act, pos, meta = batch_of(active)
        for i, layer in enumerate(self.model.layers):
            if schedule.is_check_layer(i) and bool(reused[active].any()):
                # Select before the layer runs: its fresh K/V come from the projections alone, so the
                # attention and MLP of this layer are spent only on the tokens kept.
                fresh_k, fresh_v = layer.project_kv(hidden, pos, meta)
                cand = reused[active].nonzero(as_tuple=True)[0]  # rows of `hidden` that are reused tokens
                cand_dev = cand.to(device)
                old_k, old_v = self.kv.read_slots(i, slots[act[cand_dev]])
                self.kv.write(i, slots[act], fresh_k, fresh_v)  # every token gets this layer's fresh K/V
                dev = kv_deviation(old_k, fresh_k[cand_dev], old_v, fresh_v[cand_dev], score=self.settings.score)
                if probe is not None:
                    dev = combine_scores(dev, probe[active[cand]], self.settings.query_weight)
                keep = count_for_ratio(schedule.ratios[schedule.check_layers.index(i)], n_reused)
                cand_always = always[active[cand]] if always is not None else None
                chosen = cand[select_top_k(dev.cpu(), keep, cand_always).cpu()]
                rows = torch.cat([(~reused[active]).nonzero(as_tuple=True)[0], chosen]).sort().values
                active = active[rows]
                hidden = hidden[rows.to(device)]
                act, pos, meta = batch_of(active)
            hidden = layer(hidden, pos, meta, self.kv, i)
        recomputed = int(reused[active].sum())
        seq.recomputed_tokens = recomputed
        seq.blended_tokens = n_reused - recomputed
        seq.cached_tokens = (seq.cached_tokens or 0) + seq.blended_tokens
        last = self.model.final_norm(hidden[-1:])
        return self.model.compute_logits(last)

    def _question_probe(self, ids, positions, slots, table, end: int, reused: torch.Tensor) -> torch.Tensor:
        """Run the prompt's tail after the last reused token (the question) through every layer over the
        reused KV as it stands, and return the attention mass [n] it pays each token of the blended range,
        summed over layers. The tail's KV written here is rewritten by the blended pass."""
        n = reused.shape[0]
        device = ids.device
        tail = torch.arange(int(reused.nonzero()[-1]) + 1, n, device=device)
        hidden, pos = self.model.embed(ids[tail]), positions[tail]
        meta = AttentionMetadata([0, len(tail)], [table], [end], slots[tail])
        all_pos = torch.arange(end, device=device)
        mass = torch.zeros(n, dtype=torch.float32, device=device)
        for i, layer in enumerate(self.model.layers):
            q = layer.project_q(hidden, pos)
            hidden = layer(hidden, pos, meta, self.kv, i)  # writes the tail's K/V first
            k, _ = self.kv.gather(i, table, end, meta.consecutive_start(self.kv, 0))
            mass += query_attention(q, k, pos, all_pos, layer.self_attn.scale)[end - n:]
        return mass.cpu()

    # registration -------------------------------------------------------------------------
    def register(self, seq: Sequence, skip: set[int] = frozenset()) -> tuple[int, int]:
        """File seq's reusable chunks whose KV is exact and not yet indexed (called once its prompt is
        computed). Returns (tokens newly stored, tokens of chunks that were already indexed)."""
        salt = seq.extra_key
        stored = present = 0
        for start, n in self._spans_ending_after(seq, 0):
            alone = self._is_first_chunk(seq, start)
            if start in skip or start + n > seq.num_computed:
                continue
            tokens = seq.prompt_ids[start:start + n]
            # an alone copy serves every lookup (it is preferred); an in-context one only where none exists
            if self.index.contains(tokens, salt, True if alone else None):
                present += n
                continue
            try:
                blocks = self.index.cache.allocate(self.index.blocks_needed(tokens))
            except OutOfBlocks:
                log.debug("no room to register a %d-token chunk", n)
                break
            dst = self._slots(blocks, range(n))
            src = self._slots(seq.block_table, range(start, start + n))
            pos = torch.arange(n, device=dst.device)
            self._copy(src, dst, pos + start, pos)
            spare = self.index.register(tokens, blocks, salt, alone)
            if spare:
                self.index.cache.free(spare)
            self.registered_chunks += 1
            stored += n
        return stored, present
