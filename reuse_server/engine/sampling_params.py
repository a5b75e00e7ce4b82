"""What a request asks of generation (SamplingParams) and of the caches (CacheOptions, a request's `options`).
The parameters' range checks live here; LLMEngine.validate runs them with the prompt's checks, once per
request."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from reuse_server.kv.pins import CacheBreakpoint


class InvalidRequest(ValueError):
    """Bad input a client can fix: the API turns it into a 400 with an OpenAI-style error."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code



class PromptTooLong(InvalidRequest):
    """The prompt alone fills the context: no room is left for one token of answer. Its numbers travel with it,
    so that each API words the refusal as its clients read it (Claude Code compacts its conversation on
    Anthropic's wording: api/errors.py). An answer limit beyond the room left is not an error: the engine fits
    it to the room (LLMEngine.output_limit)."""

    def __init__(self, limit: int, prompt_tokens: int):
        super().__init__(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                         f"{prompt_tokens} tokens, which leaves no room for a completion.", None,
                         "context_length_exceeded")
        self.limit = limit
        self.prompt_tokens = prompt_tokens


SAMPLING_EPS = 1e-5


@dataclass
class SamplingParams:
    # None: as many as the context leaves (OpenAI's default for chat); LLMEngine.validate fits it to the context
    # and the server's --max-tokens, so a validated request always has a number here
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token; None: no logprobs
    include_stop_str_in_output: bool = False
    # OpenAI's: subtracted from a token's logit once it was generated (presence), per time generated (frequency)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # transformers'/vLLM's: the logit of any token seen in the prompt or the output so far is divided by it
    # when positive, multiplied when negative
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    # a structured_output.Grammar the output must match: JSON, tool calls
    grammar: Any = field(default=None, compare=False, repr=False)

    def validate(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {self.max_tokens}.", "max_tokens")
        if not 0.0 <= self.temperature <= 2.0:
            raise InvalidRequest(f"temperature must be in [0, 2], got {self.temperature}.", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequest(f"top_p must be in (0, 1], got {self.top_p}.", "top_p")
        if self.top_k == 0 or self.top_k < -1:
            raise InvalidRequest(f"top_k must be -1 (disabled) or positive, got {self.top_k}.", "top_k")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InvalidRequest(f"logprobs must be in [0, 20], got {self.logprobs}.", "logprobs")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise InvalidRequest("seed must be a 64-bit integer.", "seed")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequest(f"{name} must be in [-2, 2], got {getattr(self, name)}.", name)
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise InvalidRequest(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.",
                                 "repetition_penalty")
        if len(self.logit_bias) > 300:
            raise InvalidRequest("logit_bias may hold at most 300 tokens.", "logit_bias")
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {bias} for token {token}.",
                                     "logit_bias")
        if len(self.stop) > 4:
            raise InvalidRequest("At most 4 stop sequences are allowed.", "stop")
        if any(s == "" for s in self.stop):
            raise InvalidRequest("Stop sequences must not be empty.", "stop")
        if self.grammar is not None and self.ignore_eos:
            # a complete grammar allows nothing but the end of the output
            raise InvalidRequest("ignore_eos cannot be combined with constrained output (response_format, "
                                 "tool_choice 'required' or a named tool).", "ignore_eos")

    @property
    def greedy(self) -> bool:
        # as vLLM: a temperature this small is greedy; dividing by it would take logits to inf and the
        # probabilities to NaN (a valid request, e.g. temperature 1e-300, that must not fail the step)
        return self.temperature < SAMPLING_EPS

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed (penalties, bias) before choosing a token."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


@dataclass
class CacheOptions:
    """Per-request cache controls (request body extensions)."""

    prefix_cache: bool = True  # False: neither read nor write the prefix cache (a baseline)
    cache_salt: str | None = None  # salted requests share blocks only with the same salt (and tenant)
    # the API key's tenant (api/auth.py: a fixed-length digest, never the key): its own cache namespace
    tenant: str | None = None
    blend: bool | None = None  # None: server default
    recompute_ratio: float | None = None  # None: server default
    # a blend.strategies.Selection for this request (None: the server's); set in-process only (benchmarks
    # compare strategies on one engine), no API field reaches it
    blend_selection: object | None = None
    # (prompt position, length) of each chunk a client marked as a unit (a message, a text part, a
    # separator-delimited piece): what the chunk index registers and looks up
    chunk_spans: list[tuple[int, int]] = field(default_factory=list)
    # prefixes to pin once computed (the API places each client-marked block's end in the prompt)
    breakpoints: list[CacheBreakpoint] = field(default_factory=list)

    @property
    def namespace(self) -> bytes:
        """The bytes that keep this request's cached KV apart from other requests' (the radix namespace its
        exact blocks are filed under, folded into their identities): requests share blocks only within one
        namespace. The tenant, then the salt: tenant ids all have one length, so (tenant, salt) pairs never
        collide; without API keys there is no tenant."""
        tenant = self.tenant.encode() if self.tenant else b""
        return tenant + (self.cache_salt.encode() if self.cache_salt else b"")
