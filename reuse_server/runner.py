"""Run one scheduled batch through the model: flatten the chunks, write their KV, return last-token logits."""
from __future__ import annotations

import torch

from reuse_server.kv_pool import KVPool
from reuse_server.model.attention import AttentionMetadata
from reuse_server.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model, kv: KVPool, block_size: int, device: str = "cpu") -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.device = torch.device(device)

    def build(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        tables: list[torch.Tensor] = []
        context_lens: list[int] = []
        for chunk in chunks:
            seq = chunk.seq
            start, end = seq.num_computed, seq.num_computed + chunk.num_tokens
            ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start.append(len(ids))
            tables.append(torch.tensor(table, dtype=torch.long, device=self.device))
            context_lens.append(end)
        dev = self.device
        meta = AttentionMetadata(
            query_start=query_start,
            block_tables=tables,
            context_lens=context_lens,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
        )
        return (
            torch.tensor(ids, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev),
            meta,
        )

    @torch.inference_mode()
    def run(self, chunks: list[ScheduledChunk], want_logits: list[bool]) -> torch.Tensor | None:
        """Compute the chunks' KV; return logits [k, vocab] for the chunks flagged in want_logits (in order)."""
        input_ids, positions, meta = self.build(chunks)
        last = [meta.query_start[i + 1] - 1 for i, w in enumerate(want_logits) if w]
        # the last layer goes on only for the tokens whose logits are wanted (~3% of a prefill)
        hidden = self.model(input_ids, positions, meta, self.kv, torch.tensor(last, dtype=torch.long,
                                                                               device=input_ids.device))
        return self.model.compute_logits(hidden) if last else None
