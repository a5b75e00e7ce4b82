"""One request's outcome as the load generator measured it."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class RequestResult:
    session: str
    turn: int
    ok: bool
    start_s: float  # when it was sent, seconds after the phase started
    e2e_s: float | None = None
    ttft_s: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prefix hits + blended (OpenAI's field)
    blended_tokens: int = 0  # reused out of prefix order, not recomputed
    recomputed_tokens: int = 0  # had cached KV but recomputed (blending's selection)
    error: str | None = None

    @property
    def prefix_hit_tokens(self) -> int:
        return self.cached_tokens - self.blended_tokens

    @property
    def end_s(self) -> float:
        return self.start_s + (self.e2e_s or 0.0)

    def to_dict(self) -> dict:
        return asdict(self)
