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


def _extra(details, name: str) -> int:
    """A non-standard usage field: pydantic keeps unknown fields in model_extra."""
    if details is None:
        return 0
    value = getattr(details, name, None)
    if value is None:
        value = (getattr(details, "model_extra", None) or {}).get(name)
    return int(value or 0)


def apply_usage(result: RequestResult, usage) -> None:
    """The token counts of a response's `usage` (chat's fields: the openai SDK's objects, or http_recorder's
    reading of any dialect) into the result."""
    result.prompt_tokens = int(usage.prompt_tokens or 0)
    result.completion_tokens = int(usage.completion_tokens or 0)
    details = getattr(usage, "prompt_tokens_details", None)
    result.cached_tokens = _extra(details, "cached_tokens")
    result.blended_tokens = _extra(details, "blended_tokens")
    result.recomputed_tokens = _extra(details, "recomputed_tokens")
