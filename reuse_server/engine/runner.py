"""Run one scheduled step through the model: flatten its slices (prefill slices, decode tokens, blended
prefill slices alike) into one forward, write their KV, return the logits of the rows that are sampled."""
from __future__ import annotations

from collections import Counter

import torch

from reuse_server.engine.decode_graphs import DecodeGraphs
from reuse_server.engine.decode_inputs import StaticDecodeInputs, is_plain_decode
from reuse_server.kv.pool import KVPool
from reuse_server.model.attention import AttentionMetadata
from reuse_server.model.llama import RowSelection
from reuse_server.engine.scheduler import StepSlice


class StepRows(RowSelection):
    """The rows of a step's forward: every token of every slice, except that a blended slice's selection
    drops reused rows at its check layers, and the last layer goes on only for the rows whose logits are
    sampled. `active` maps the current rows back to the step's input rows."""

    def __init__(self, bounds: list[tuple[int, int]], selections: dict[int, object], output_rows: torch.Tensor,
                 num_layers: int):
        self.bounds = bounds  # per slice: its input rows lo..hi
        self.selections = selections  # slice index -> blending.SliceSelection
        self.output_rows = output_rows  # input rows whose logits are wanted
        self.last_layer = num_layers - 1
        self.active = torch.arange(bounds[-1][1] if bounds else 0)

    def keeps_all_rows(self, num_rows):
        """Without a blended slice only the last layer selects, the output rows: all rows in a decode step."""
        return not self.selections and self.output_rows.tolist() == list(range(num_rows))

    def rows(self, layer, q, k, v, meta):
        keep = None
        checking = [(i, sel) for i, sel in self.selections.items() if sel.checks(layer)]
        if checking:
            pieces, changed = [], False
            for i, (lo, hi) in enumerate(self.bounds):
                first, end = torch.searchsorted(self.active, torch.tensor([lo, hi])).tolist()
                rows = torch.arange(first, end)
                sel = self.selections.get(i)
                if sel is not None and sel.checks(layer) and end > first:
                    local = self.active[first:end] - lo
                    chosen = sel.choose(layer, local, k[first:end], v[first:end], meta.slot_mapping[first:end])
                    if chosen is not None:
                        rows, changed = rows[chosen], True
                pieces.append(rows)
            if changed:
                keep = torch.cat(pieces)
        if layer == self.last_layer:
            current = self.active if keep is None else self.active[keep]
            wanted = torch.isin(current, self.output_rows).nonzero(as_tuple=True)[0]
            if keep is not None or len(wanted) < len(current):  # a decode step keeps every row: no subset
                keep = wanted if keep is None else keep[wanted]
        if keep is not None:
            self.active = self.active[keep]
        return keep  # on the host, as RowSelection.rows returns them


class ModelRunner:
    """decode_inputs: the static buffers plain decode steps run on (decode_inputs.py; None: every step builds
    its inputs afresh); graphs: the CUDA graphs captured on them (decode_graphs.py), replayed for the buckets
    they hold. `steps` counts the steps each way ran: dynamic, static (eager on the buffers), graph."""

    def __init__(self, model, pool: KVPool, device: str = "cpu",
                 decode_inputs: StaticDecodeInputs | None = None) -> None:
        self.model = model
        self.pool = pool
        self.block_size = pool.block_size
        self.device = torch.device(device)
        self.num_layers = len(model.layers)
        self.decode_inputs = decode_inputs
        self.graphs: DecodeGraphs | None = None
        self.steps: Counter[str] = Counter()

    def capture_graphs(self) -> DecodeGraphs:
        """Capture a CUDA graph of the decode step per bucket of the static buffers (after the pool is
        allocated: the graphs' activations come out of what is left); plain decode steps replay them."""
        if self.decode_inputs is None:
            raise ValueError("CUDA graphs replay decode steps on static input buffers; this runner has none")
        self.graphs = DecodeGraphs.capture(self.model, self.pool, self.decode_inputs)
        return self.graphs

    def _inputs(self, spans: list[tuple[list[int], list[int], list[int], int]]):
        """spans: per sequence (its token ids, their positions, its block table, its context length). Everything
        the forward needs to know of the step is built here on the host, from these lists, and goes to the
        device in one copy (AttentionMetadata keeps the host side too: planning reads nothing back)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        table_ids: list[int] = []
        context_lens: list[int] = []
        for token_ids, token_positions, table, context in spans:
            ids.extend(token_ids)
            positions.extend(token_positions)
            slots.extend(table[p // bs] * bs + p % bs for p in token_positions)
            query_start.append(len(ids))
            table_ids.extend(table)
            context_lens.append(context)
        t = len(ids)
        host = torch.tensor(ids + positions + slots + table_ids, dtype=torch.long)
        dev = host if self.device.type == "cpu" else host.to(self.device, non_blocking=True)

        def tables(flat: torch.Tensor) -> list[torch.Tensor]:
            out, at = [], 3 * t
            for span in spans:
                out.append(flat[at:at + len(span[2])])
                at += len(span[2])
            return out

        meta = AttentionMetadata(query_start=query_start, block_tables=tables(dev), context_lens=context_lens,
                                 slot_mapping=dev[2 * t:3 * t], host_positions=host[t:2 * t],
                                 host_block_tables=tables(host))
        return dev[:t], dev[t:2 * t], meta

    @torch.inference_mode()
    def run(self, slices: list[StepSlice], want_logits: list[bool],
            selections: dict[int, object] | None = None) -> torch.Tensor | None:
        """Compute the slices' KV; return logits [k, vocab] for the slices flagged in want_logits (in order).
        selections: slice index -> the blending.SliceSelection of a blended slice."""
        selections = selections or {}
        if self.decode_inputs is not None and is_plain_decode(slices, want_logits, selections):
            bucket = self.decode_inputs.fits([piece.seq.block_table for piece in slices])
            if bucket is not None:
                return self._run_static(slices, bucket)
        self.steps["dynamic"] += 1
        spans, bounds, output_rows = [], [], []
        for i, (piece, want) in enumerate(zip(slices, want_logits)):
            seq = piece.seq
            start, end = seq.num_computed, seq.num_computed + piece.num_tokens
            picked = range(start, end)
            sel = selections.get(i)
            if sel is not None and sel.input_rows is not None:
                picked = [start + int(r) for r in sel.input_rows]
            token_ids = seq.token_ids
            spans.append(([token_ids[p] for p in picked], list(picked), seq.block_table, end))
            lo = bounds[-1][1] if bounds else 0
            bounds.append((lo, lo + len(picked)))
            if want:
                output_rows.append(lo + len(picked) - 1)
        input_ids, positions, meta = self._inputs(spans)
        select = StepRows(bounds, selections, torch.tensor(output_rows, dtype=torch.long), self.num_layers)
        hidden = self.model(input_ids, positions, meta, self.pool, select)
        return self.model.compute_logits(hidden) if output_rows else None

    def _run_static(self, slices: list[StepSlice], bucket: int) -> torch.Tensor:
        """A plain decode step on the static buffers, padded to `bucket`: the bucket's graph replayed where
        one was captured, else the forward eagerly on the buffers' views. Returns the real rows' logits."""
        spans = []
        for piece in slices:
            seq = piece.seq
            at = seq.num_computed
            spans.append((seq.token_ids[at], at, seq.block_table, at + 1))
        step = self.decode_inputs.load(spans, bucket, self.model.backend.attention)
        if self.graphs is not None and self.graphs.holds(bucket):
            self.steps["graph"] += 1
            return self.graphs.replay(bucket)[:step.rows]
        self.steps["static"] += 1
        hidden = self.model(step.input_ids, step.positions, step.meta, self.pool, None)
        return self.model.compute_logits(hidden)[:step.rows]

    @torch.inference_mode()
    def observe(self, seq, positions: list[int], observer: RowSelection) -> None:
        """Run seq's tokens at `positions` through every layer with an observing selection (blending's question
        probe); their K/V is written and later rewritten."""
        token_ids = seq.token_ids
        input_ids, pos, meta = self._inputs([([token_ids[p] for p in positions], positions, seq.block_table,
                                              seq.num_tokens)])
        self.model(input_ids, pos, meta, self.pool, observer)
