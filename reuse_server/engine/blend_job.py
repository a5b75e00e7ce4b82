"""A blended prefill in progress (BlendJob): what the Blender (engine/blender.py) keeps on a sequence between
its admission and its end. Apart from the Blender so that the sequence that carries it need not import it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
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
