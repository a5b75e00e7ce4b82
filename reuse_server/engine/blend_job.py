"""A blended prefill in progress (BlendJob): what the Blender (engine/blender.py) keeps on a sequence between
its admission and its end. Apart from the Blender so that the sequence that carries it need not import it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from blend.fidelity import ChunkDeviation
from blend.strategies import Selection


@dataclass
class BlendJob:
    """One blended prefill: which prompt tokens came from the chunk index, and what selection made of them."""

    reused: torch.Tensor  # bool [prompt tokens]: KV copied in from the chunk index
    ratio: float
    selection: Selection
    # bool [prompt tokens]: the reused tokens a static selection recomputes at every layer (None: chosen at
    # check layers, or, for a selection that reads the question, not yet chosen)
    chosen: torch.Tensor | None = None
    probe: torch.Tensor | None = None  # attention mass [prompt tokens] the question pays
    probed: bool = False
    blended: int = 0  # reused tokens selection left alone
    recomputed: int = 0  # reused tokens selection recomputed
    recomputed_positions: list[int] = field(default_factory=list)  # ... and where they are in the prompt
    # the fidelity check (blend/fidelity.py): which reused chunk each prompt token came from (-1: none), the
    # chunks' (start, tokens reused) in the prompt, their deviation sums, and which were rejected
    chunk_of: torch.Tensor | None = None
    chunks: list[tuple[int, int]] = field(default_factory=list)
    deviation: ChunkDeviation | None = None
    rejected: torch.Tensor | None = None
    rejected_tokens: int = 0  # reused tokens recomputed because their chunk was rejected

    @property
    def rejected_chunks(self) -> int:
        return 0 if self.rejected is None else int(self.rejected.sum())
