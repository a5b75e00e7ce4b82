"""Non-prefix reuse inside the engine (CacheBlend): fill a prompt's KV from the chunk index, then recompute
only the tokens whose reused KV deviates most. The Blender owns a blended prefill from admission to its end:
- open_job: after the exact prefix match, look the rest of the prompt's spans up in the chunk index, at every
  offset where a filed chunk begins (not only where the client marked one: `_lookup`); if any is cached, take blocks for the whole prompt, copy those tokens' KV in through the pool
  (re-RoPE from positions 0..n-1 to where the chunk now sits, each layer with its own RoPE: Gemma 3's sliding
  layers with base 10k, its global ones with 1M; chunks cached alone that other text now precedes also get the
  model's key shift, blend/key_shift.py) and open a BlendJob. A sliding layer's moved keys are rotated like
  any other's; the layer then attends only to those within its window of each query, as a full prefill does;
- run: the prompt is prefilled in slices like any other, batched with other work in the runner's one
  forward; for each slice the Blender gives a SliceSelection, which only chooses rows: every token not
  reused is always computed; reused tokens are computed up to the first check layer, where the deviation
  between their stale and fresh KV picks the ones to keep computing (gradually fewer at later check layers);
  the rest keep their reused KV from there on. That is CacheBlend; the selection strategy (blend/strategies.py)
  may instead choose before the forward (EPIC: each chunk's first tokens; A³: what the question attends to),
  and then only the chosen reused tokens are computed, at every layer. A strategy that reads the question
  runs a probe pass of it over the reused KV first (QuestionProbe). Whatever the strategy, the fidelity check
  (blend/fidelity.py, --blend-max-deviation) measures each reused chunk's deviation at the first check layer
  (every reused token is computed up to it while the check is on) and recomputes a chunk past the threshold
  whole, on top of the strategy's budget;
- finish: the job's counts go to the request's usage, and the prompt's chunks (its spans cut by their content,
  blend/content_cuts.py) that the index lacks and that hold no blended KV are registered: their KV is copied to fresh blocks at positions 0..n-1 and filed in the chunk
  namespace of the radix cache.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from blend.chunk_index import ChunkHit, ChunkIndex
from blend.content_cuts import SpanCuts, WholeSpans
from blend.fidelity import ChunkDeviation, FidelityCheck
from blend.key_shift import KeyShift, moved_keys
from blend.selection import (GradualSchedule, combine_scores, count_for_ratio, kv_deviation, query_attention,
                             select_top_k)
from blend.strategies import ChunkStarts, Deviation, QuestionAttention, Selection

from reuse_server.engine.blend_job import BlendJob
from reuse_server.kv.block_manager import BlockManager, approximate_namespace
from reuse_server.kv.pool import KVPool
from reuse_server.model.attention import AttentionMetadata
from reuse_server.model.llama import RowSelection
from reuse_server.engine.sequence import Sequence

log = logging.getLogger(__name__)


def layer_inv_freq(model) -> torch.Tensor:
    """[layers, head_dim/2]: row i is the inverse frequencies layer i's keys are stored with (its
    `LlamaModel.layer_rotary`), which is what re-RoPE and the key shift must rotate that layer's keys by."""
    return torch.stack([model.layer_rotary(i).inv_freq for i in range(model.config.num_layers)])


@dataclass
class BlendSettings:
    recompute_ratio: float = 0.15
    check_layers: tuple[int, ...] = (1,)
    # Gradual filtering: the fraction kept at each check layer is ratio * factor, the factors falling to 1
    # at the last check layer (e.g. check layers (1, 2, 3) with factors (3, 2, 1)).
    gradual_factors: tuple[float, ...] = (1.0,)
    score: str = "kv"  # deviation score: "k", "v" or "kv"
    # which reused tokens are recomputed (blend/strategies.py); check_layers, gradual_factors and score
    # tune Deviation only
    selection: Selection = field(default_factory=Deviation)
    min_chunk_tokens: int = 32
    # which reused chunks are rejected (recomputed whole) at the first check layer, whatever the selection
    fidelity: FidelityCheck = field(default_factory=FidelityCheck)

    def schedule(self, ratio: float) -> GradualSchedule:
        ratios = [min(1.0, ratio * f) for f in self.gradual_factors]
        return GradualSchedule(list(self.check_layers), ratios)


@dataclass
class Reuse:
    start: int  # prompt position the chunk starts at
    hit: ChunkHit
    skip: int = 0  # leading chunk tokens already served by the exact prefix match


class Blender:
    def __init__(self, pool: KVPool, blocks: BlockManager, index: ChunkIndex, settings: BlendSettings,
                 num_layers: int, inv_freq: torch.Tensor, attention_scale: float,
                 key_shift: KeyShift | None = None, cuts: SpanCuts | None = None) -> None:
        """inv_freq: [layers, head_dim/2] (`layer_inv_freq(model)`), or [head_dim/2] when every layer shares one.
        cuts: how client spans are cut into the chunks registered (default: not at all)."""
        self.pool = pool
        self.blocks = blocks
        self.index = index
        self.settings = settings
        self.num_layers = num_layers
        self.inv_freq = inv_freq
        self.attention_scale = attention_scale
        self.key_shift = key_shift
        self.cuts = cuts if cuts is not None else WholeSpans()
        self.block_size = pool.block_size
        settings.schedule(settings.recompute_ratio).validate_for(num_layers)
        self.registered_chunks = 0
        self.rejected_chunks = 0  # chunks the fidelity check rejected, and their tokens it recomputed
        self.rejected_tokens = 0

    def _client_spans(self, seq: Sequence) -> list[tuple[int, int]]:
        """The spans the client marked (messages, text parts, ...) long enough to be chunks."""
        return [(s, n) for s, n in seq.options.chunk_spans if n >= self.index.min_tokens]

    def _chunks(self, seq: Sequence) -> list[tuple[int, int]]:
        """The chunks seq registers: each client span whole, then its pieces cut by their content
        (blend/content_cuts.py), so text glued into one message is filed in pieces that the same text elsewhere
        cuts into again. The whole span comes first: a part sent again as a part is then reused as one chunk,
        the key shift of its alone form reaching every token of it (a piece after the first is filed in the
        context of the span's earlier text, which the shift does not correct); its first piece is the whole
        span's beginning, already in the tree, and costs nothing."""
        spans = self._client_spans(seq)
        whole = set(spans)
        pieces = [(s, n) for s, n in self.cuts.cut(seq.prompt_ids, spans)
                  if n >= self.index.min_tokens and (s, n) not in whole]
        return spans + pieces

    def ratio_for(self, seq: Sequence) -> float:
        ratio = seq.options.recompute_ratio
        return self.settings.recompute_ratio if ratio is None else ratio

    def selection_for(self, seq: Sequence) -> Selection:
        chosen = seq.options.blend_selection
        return self.settings.selection if chosen is None else chosen

    def approximate_namespace(self, seq: Sequence) -> bytes:
        """The namespace seq's blended KV is filed under: everything that decides what KV blending produces."""
        s = self.settings
        return approximate_namespace(seq.namespace, f"r={self.ratio_for(seq):.6g};score={s.score};"
                                     f"check={s.check_layers};factors={s.gradual_factors};"
                                     f"select={self.selection_for(seq).key()};shift={self.key_shift is not None};"
                                     f"fidelity={s.fidelity.max_deviation:g}")

    def fits(self, seq: Sequence) -> bool:
        """Whether seq's prompt can ever be blended here. Blending copies reused KV into blocks for the whole
        prompt at once, and on a hybrid pool each of those blocks needs a window part until the prefill passes
        it: a prompt with more blocks than the window layers' pool is computed exactly instead of waiting for
        parts that can never be free together."""
        return self.blocks.window.holds_at_once(-(-seq.num_tokens // self.block_size))

    # ---- open a job ------------------------------------------------------------------------
    def open_job(self, seq: Sequence) -> bool:
        """Called right after the block manager admitted seq (its exact prefix matched): look its chunks up
        in the chunk index and, if any is cached, take blocks for the whole prompt, copy the cached KV in and
        open a job. False when those blocks are not available (no job; the caller releases seq)."""
        if seq.output_ids:  # a preempted request recomputes exactly
            return True
        reuses = self._lookup(seq)
        if not reuses:
            return True
        try:
            if not self.blocks.ensure_capacity(seq, seq.num_tokens):
                return False
            self._copy_in(seq, reuses)
        finally:
            for r in reuses:
                self.index.release(r.hit)
        n = seq.num_tokens
        reused = torch.zeros(n, dtype=torch.bool)
        for r in reuses:
            reused[r.start + r.skip:r.start + r.hit.num_tokens] = True
        reused[:seq.num_computed] = False  # served by the exact prefix: not computed at all
        chunk_of = torch.full((n,), -1, dtype=torch.long)
        for i, r in enumerate(reuses):
            chunk_of[r.start + r.skip:r.start + r.hit.num_tokens] = i
        chunk_of[~reused] = -1
        ratio, selection = self.ratio_for(seq), self.selection_for(seq)
        job = BlendJob(reused, ratio, selection, chunk_of=chunk_of,
                       chunks=[(r.start + r.skip, r.hit.num_tokens - r.skip) for r in reuses],
                       deviation=ChunkDeviation(len(reuses)), rejected=torch.zeros(len(reuses), dtype=torch.bool))
        if isinstance(selection, ChunkStarts):
            job.chosen = selection.mask([r.start + r.skip for r in reuses], [r.hit.num_tokens - r.skip for r in reuses],
                                        count_for_ratio(ratio, int(reused.sum())), total=n) & reused
        seq.blend = job
        return True

    def _lookup(self, seq: Sequence) -> list[Reuse]:
        """Cached chunks in seq's spans after its prefix hit, held until released. A chunk is looked for
        wherever one may begin: at each span's start, at each of its content-defined cuts, and at every
        offset where a chunk filed in the tree begins with the block of tokens there (ChunkIndex.starts), so
        a passage filed alone, as a text part or as a piece of another prompt is found wherever it now
        stands, with no separator. Where one is found, the longest cached chunk there is taken if it covers
        at least --blend-min-tokens, and the search goes on after it. At a cut, the piece that begins there
        is looked up as well as the rest of the span: a chunk's last block is filed padded, so only a lookup
        that ends where the chunk ends can match it, and without that each piece found would lose up to a
        block of tokens."""
        prompt, computed, min_tokens = seq.prompt_ids, seq.num_computed, self.index.min_tokens
        spans = [(s, n) for s, n in self._client_spans(seq) if s + n > computed]
        if not spans:
            return []
        in_tree = self.index.starts(prompt, seq.namespace)
        piece_at = dict(self.cuts.cut(prompt, spans))
        reuses = []
        for start, n in spans:
            end = start + n
            candidates = sorted({p for p in in_tree if start <= p < end} | {p for p in piece_at if start <= p < end})
            covered = start
            for pos in candidates:
                if pos < covered or end - pos < min_tokens:
                    continue
                hit = self.index.lookup(prompt[pos:end], seq.namespace)
                piece = piece_at.get(pos, 0)
                if min_tokens <= piece < end - pos:
                    whole = self.index.lookup(prompt[pos:pos + piece], seq.namespace)
                    if whole is not None and (hit is None or whole.num_tokens > hit.num_tokens):
                        hit = whole
                skip = max(0, computed - pos)  # a chunk may begin inside the exact prefix hit
                if (hit is not None and hit.num_tokens >= min_tokens and hit.num_tokens > skip
                        and self._whole(hit.block_ids)):
                    self.index.hold(hit)
                    reuses.append(Reuse(pos, hit, skip))
                    covered = pos + hit.num_tokens
        return reuses

    def _whole(self, block_ids: list[int]) -> bool:
        """Whether these blocks hold every layer's KV: on a hybrid pool, a block whose window part is gone
        (out of its sequence's window, or evicted) has none of its window layers' KV to reuse or register."""
        return self.blocks.window.whole(block_ids)

    def _slots(self, block_table: list[int], positions: range) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([block_table[p // bs] * bs + p % bs for p in positions], dtype=torch.long)

    @staticmethod
    def _is_first_chunk(seq: Sequence, start: int) -> bool:
        """Only the prompt's framing comes before the chunk at `start`: its KV there is its alone form."""
        return bool(seq.options.chunk_spans) and seq.options.chunk_spans[0][0] == start

    def _move(self, src: torch.Tensor, dst: torch.Tensor, old_pos: torch.Tensor, new_pos: torch.Tensor,
              shift: KeyShift | None = None) -> None:
        # re-RoPE and shift in one pass: an 8-bit pool then rounds the moved keys once
        self.pool.copy_slots(src, dst)
        self.pool.update_keys(dst, moved_keys(old_pos, new_pos, self.inv_freq, shift))

    def _copy_in(self, seq: Sequence, reuses: list[Reuse]) -> None:
        for r in reuses:
            n = r.hit.num_tokens
            src = self._slots(r.hit.block_ids, range(r.skip, n))
            dst = self._slots(seq.block_table, range(r.start + r.skip, r.start + n))
            pos = torch.arange(r.skip, n)
            # a chunk cached alone needs the shift only where other text now precedes it
            shifted = self.key_shift is not None and r.hit.alone and not self._is_first_chunk(seq, r.start)
            self._move(src, dst, pos, pos + r.start, self.key_shift if shifted else None)

    # ---- run -------------------------------------------------------------------------------
    def blending(self, seq: Sequence) -> bool:
        return seq.blend is not None

    def needs_probe(self, seq: Sequence) -> bool:
        job = seq.blend
        return (job is not None and not job.probed and job.selection.reads_question
                and bool(job.reused.any()) and self.settings.schedule(job.ratio).ratios[0] > 0)

    def probe(self, seq: Sequence) -> tuple[list[int], "QuestionProbe"]:
        """The question probe of seq's job: (positions of the prompt's tail after its last reused token, the
        observer to run them through the model with). Its result lands in the job when the pass is done."""
        job = seq.blend
        job.probed = True
        tail = list(range(int(job.reused.nonzero()[-1]) + 1, seq.num_tokens))
        job.probe = torch.zeros(seq.num_tokens, dtype=torch.float32)
        # the KV the probe may read: the exact prefix hit, the reused chunks and the tail it computes; the gaps
        # between chunks are not computed yet, and their slots hold whatever the blocks held before
        ready = job.reused.clone()
        ready[:seq.num_computed] = True
        ready[tail] = True
        return tail, QuestionProbe(self.pool, torch.tensor(seq.block_table), seq.num_tokens,
                                   ready.nonzero().squeeze(1), len(tail), self.attention_scale, self.num_layers,
                                   job.probe)

    def selection(self, seq: Sequence, start: int, num_tokens: int) -> "SliceSelection":
        """The rows the layers compute for seq's prompt tokens start .. start + num_tokens - 1 this step."""
        job = seq.blend
        if job.chosen is None and isinstance(job.selection, QuestionAttention):
            # the probe has run (or nothing is to be recomputed): choose once, for every slice
            budget = count_for_ratio(job.ratio, int(job.reused.sum()))
            attention = job.probe if job.probe is not None else torch.zeros(len(job.reused))
            job.chosen = QuestionAttention.mask(attention, job.reused, budget)
        end = start + num_tokens
        return SliceSelection(self.pool, self.settings, job, start, end, final=end == seq.num_tokens)

    def slice_done(self, seq: Sequence, selection: "SliceSelection") -> None:
        """After the step's forward: count what selection did. Anything not recomputed makes seq's KV
        approximate, so from now on it is filed under its approximate namespace."""
        job = seq.blend
        job.recomputed += selection.recomputed
        job.rejected_tokens += selection.rejected_tokens
        job.blended += selection.num_reused - selection.recomputed
        job.recomputed_positions += selection.recomputed_positions()
        if job.blended:
            self.blocks.make_approximate(seq)

    # ---- finish ----------------------------------------------------------------------------
    def finish(self, seq: Sequence) -> BlendJob | None:
        """seq's prompt is computed, or seq leaves (finish, abort, preemption): close its job (the scheduler
        calls this, from one place: Scheduler._close_blend)."""
        job, seq.blend = seq.blend, None
        if job is not None:
            self.rejected_chunks += job.rejected_chunks
            self.rejected_tokens += job.rejected_tokens
        return job

    def register(self, seq: Sequence, reused: torch.Tensor | None = None) -> tuple[int, int]:
        """File seq's chunks whose KV is exact and not yet indexed (called once its prompt is computed); a
        chunk with any token in `reused` (KV copied in by its blend job) is not. Returns (prompt tokens newly
        filed, prompt tokens whose chunks were already indexed), each prompt token counted once although a
        span and its pieces are filed apart."""
        filed = torch.zeros(seq.num_tokens, dtype=torch.bool)  # prompt positions filed now
        indexed = torch.zeros(seq.num_tokens, dtype=torch.bool)  # and found filed already
        for start, n in self._chunks(seq):
            alone = self._is_first_chunk(seq, start)
            if start + n > seq.num_computed or (reused is not None and bool(reused[start:start + n].any())):
                continue
            tokens = seq.prompt_ids[start:start + n]
            # an alone copy serves every lookup (it is preferred); an in-context one only where none exists
            if self.index.contains(tokens, seq.namespace, True if alone else None):
                indexed[start:start + n] = True
                continue
            if not self._whole(seq.block_table[start // self.block_size:-(-(start + n) // self.block_size)]):
                continue
            src = self._slots(seq.block_table, range(start, start + n))
            pos = torch.arange(n)

            def fill(blocks: list[int]) -> None:
                self.pool.clear_blocks(blocks)  # fresh blocks: the padding after the chunk must hold nothing
                self._move(src, self._slots(blocks, range(n)), pos + start, pos)

            if not self.index.store(tokens, fill, seq.namespace, alone):
                log.debug("no room to register a %d-token chunk", n)
                break
            self.registered_chunks += 1
            filed[start:start + n] = True
        return int(filed.sum()), int((indexed & ~filed).sum())


class SliceSelection:
    """Which of one blended slice's tokens each layer computes (the slice's tokens are prompt positions
    start .. end - 1). Tokens not reused always go on. Under a static selection the chosen reused tokens go
    on too and the others are not computed at all; otherwise reused ones go on until a check layer, where
    the deviation of their stale from their fresh K/V keeps the top share of them.

    With the fidelity check on (blend/fidelity.py), every reused token goes on to the first check layer
    whatever the selection: there each reused chunk's deviation is measured, and the tokens of a rejected
    chunk go on through every later layer, on top of what the selection keeps (a static selection's choice
    is then applied at that layer instead of before the forward)."""

    def __init__(self, pool: KVPool, settings: BlendSettings, job: BlendJob, start: int, end: int, final: bool):
        self.pool = pool
        self.settings = settings
        self.job = job
        self.start = start
        self.reused = job.reused[start:end].clone()
        if final:
            self.reused[-1] = False  # the last token gives the logits
        self.num_reused = int(self.reused.sum())
        self.schedule = settings.schedule(job.ratio)
        self.query_weight = job.selection.query_weight if isinstance(job.selection, Deviation) else 0.0
        self.probe = None if job.probe is None else job.probe[start:end]
        self.chunk_of = job.chunk_of[start:end]
        self.fidelity = settings.fidelity.active and self.num_reused > 0
        self.rejected_rows = torch.zeros_like(self.reused)  # slice positions of rejected chunks' tokens
        self.rejected_tokens = 0
        self.chosen_rows: torch.Tensor | None = None  # slice positions of the reused tokens recomputed
        # the reused tokens chosen before the forward (a static selection; none when there is nothing to
        # choose), or None: chosen at the check layers by their deviation
        if job.chosen is not None:
            self.preset = job.chosen[start:end] & self.reused
        elif self.num_reused and self.schedule.ratios[0] == 0.0:
            self.preset = torch.zeros_like(self.reused)
        else:
            self.preset = None
        # without the check, preset tokens are all a static slice computes: the other reused ones skip every layer
        self.static = self.preset is not None and not self.fidelity
        computed = ~self.reused | self.preset if self.static else None
        self.input_rows = None if computed is None else computed.nonzero(as_tuple=True)[0]
        if self.static:
            self.chosen_rows = self.preset.nonzero(as_tuple=True)[0]
        self.recomputed = len(self.chosen_rows) if self.static else self.num_reused

    def checks(self, layer: int) -> bool:
        if self.static or not self.num_reused:
            return False
        if self.preset is not None:  # chosen already: only the fidelity check's layer drops rows
            return layer == self.schedule.check_layers[0]
        return self.schedule.is_check_layer(layer)

    def recomputed_positions(self) -> list[int]:
        """Prompt positions of the reused tokens this slice computed through the last layer."""
        rows = self.chosen_rows
        if rows is None:  # no check layer ran: every reused token went through every layer
            rows = self.reused.nonzero(as_tuple=True)[0]
        return (rows + self.start).tolist()

    def choose(self, layer: int, local: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor | None:
        """At a check layer: `local` are the indices into this slice's input rows of the rows still computed
        (ascending), k/v their fresh K/V and slots where the stale one lies. Returns which of those rows go
        on (indices into `local`), or None for all."""
        local = local if self.input_rows is None else self.input_rows[local]  # -> positions in the slice
        cand = self.reused[local].nonzero(as_tuple=True)[0]
        if not cand.numel():
            return None
        cand_dev = cand.to(k.device)
        old_k, old_v = self.pool.read(layer, slots[cand_dev])
        if self.fidelity and layer == self.schedule.check_layers[0]:
            self._check_chunks(local[cand], old_k, k[cand_dev], old_v, v[cand_dev])
        always = self.rejected_rows[local[cand]]
        if self.preset is not None:
            chosen = cand[self.preset[local[cand]] | always]
        else:
            dev = kv_deviation(old_k, k[cand_dev], old_v, v[cand_dev], score=self.settings.score)
            if self.probe is not None and self.query_weight:
                # the question's attention mass is summed on the host (QuestionProbe); the deviation is the pool's
                dev = combine_scores(dev, self.probe[local[cand]].to(dev.device), self.query_weight)
            keep = self.schedule.selection_count(layer, self.num_reused)
            # a rejected chunk's tokens come on top of the budget (select_top_k's `always`), not out of it
            chosen = cand[select_top_k(dev.cpu(), keep, always).cpu()]
        self.chosen_rows = local[chosen]
        rows = torch.cat([(~self.reused[local]).nonzero(as_tuple=True)[0], chosen]).sort().values
        self.recomputed = int(self.reused[local[rows]].sum())
        return rows

    def _check_chunks(self, positions: torch.Tensor, old_k, new_k, old_v, new_v) -> None:
        """Add these reused tokens' (slice positions) deviation to their chunks' sums, reject the chunks now
        past the threshold, and mark every token of a rejected chunk in this slice."""
        job = self.job
        job.deviation.add(self.chunk_of[positions], old_k, new_k, old_v, new_v)
        job.rejected |= job.deviation.deviation() > self.settings.fidelity.max_deviation
        in_slice = self.chunk_of >= 0
        self.rejected_rows = in_slice & job.rejected[self.chunk_of.clamp_min(0)] & self.reused
        self.rejected_tokens = int(self.rejected_rows.sum())


class QuestionProbe(RowSelection):
    """A forward of the prompt's tail (the question) over the reused KV as it stands, which adds the
    attention mass it pays each prompt position, summed over layers, to `mass`. It attends only over `ready`
    (the positions whose KV is there: the prefix hit, the reused chunks, the tail itself, which ends it); the
    tail's K/V it writes is rewritten by the blended pass."""

    def __init__(self, pool: KVPool, block_table: torch.Tensor, context: int, ready: torch.Tensor, tail: int,
                 scale: float, num_layers: int, mass: torch.Tensor):
        self.pool = pool
        self.table = block_table
        self.context = context
        self.ready = ready
        self.tail = tail
        self.scale = scale
        self.last_layer = num_layers - 1
        self.mass = mass

    def rows(self, layer, q, k, v, meta):
        if self.tail:
            keys = self.pool.gather(layer, self.table, self.context)[0][self.ready.to(self.pool.device)]
            keys[-self.tail:] = k.to(keys.dtype)  # the tail sees its own fresh keys
            self.mass[self.ready] += query_attention(q, keys, self.ready[-self.tail:], self.ready, self.scale).cpu()
        # nothing reads the last layer's output
        return torch.empty(0, dtype=torch.long) if layer == self.last_layer else None
