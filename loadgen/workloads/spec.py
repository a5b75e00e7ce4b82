"""What a workload produces: sessions of requests, fully decided before anything is sent.

Prompts never depend on what the model answers (assistant turns in a history are written by the
workload), so a seed fixes every prompt and two runs send exactly the same traffic.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

# A program that sends a session's requests itself (an agent framework): called with an openai AsyncOpenAI
# client, the model id and the extra body fields that select the phase's cache settings.
SessionDriver = Callable[[Any, str, dict], Awaitable[None]]


@dataclass(frozen=True)
class RequestSpec:
    session: str
    turn: int
    max_tokens: int
    messages: tuple[dict, ...] | None = None  # chat request
    prompt_token_ids: tuple[int, ...] | None = None  # completions request with a token-id prompt
    arrival_s: float | None = None  # send no earlier than this, relative to the phase start (trace replay)

    def __post_init__(self) -> None:
        if (self.messages is None) == (self.prompt_token_ids is None):
            raise ValueError("a request has either chat messages or prompt token ids")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


@dataclass
class Session:
    """Requests sent one after another (each turn waits for the previous answer). A session with a `driver`
    has no requests written in advance: the driver decides them as it goes (their prompts depend on the
    model's answers), up to `planned` of them."""

    id: str
    requests: list[RequestSpec]
    after: str | None = None  # id of a session that must finish before this one starts
    driver: SessionDriver | None = None
    planned: int = 0
    # what the driver is handed: "openai" (AsyncOpenAI), "anthropic" (AsyncAnthropic), or "http" (an httpx
    # AsyncClient whose base URL is the server, for a driver sending requests as recorded: agent-replay)
    client: str = "openai"


@dataclass(frozen=True)
class WorkloadConfig:
    """Sizes and inputs shared by all workloads; each workload reads the fields it needs."""

    seed: int = 0
    requests: int = 48  # per workload, exact (sessions are cut to fit)
    output_tokens: int = 32
    max_prompt_tokens: int = 4096  # estimated; every prompt stays under it
    chars_per_token: float = 4.0  # how the estimate turns characters into tokens
    # agent-loop
    agents: int = 4
    turns: int = 12  # agent-loop and multi-turn: turns per session at most
    system_tokens: int = 800  # system prompt with tool definitions
    tool_output_tokens: int = 120
    # rag-shuffle and shared-doc
    docs_file: Path | None = None
    doc_tokens: int = 1024  # shared-doc: the document; rag-shuffle: each retrieved document at most
    rag_k: int = 4
    rag_pool: int = 16
    # long-doc-qa: distinct documents of doc_tokens each
    documents: int = 12
    # multi-turn
    return_fraction: float = 0.5
    # trace
    trace_file: Path | None = None
    trace_block_tokens: int = 512
    vocab_size: int = 49152
    time_scale: float = 0.0  # 0: no pacing; 1: real time; 0.01: 100x faster than the trace
    # agent-replay
    sessions: int = 4  # replayed sessions (users of the agent)
    replay_turns: int = 5  # user turns of the recorded session
    keep_recording: Path | None = None  # where to write the recording (outside the checkout), for debugging

    def tokens_to_chars(self, tokens: float) -> int:
        return max(1, int(tokens * self.chars_per_token))


@dataclass
class Workload:
    name: str
    sessions: list[Session] = field(default_factory=list)

    @property
    def requests(self) -> list[RequestSpec]:
        return [r for s in self.sessions for r in s.requests]

    def prepare(self, server: str, model: str, max_model_len: int | None) -> None:
        """Called once before any phase, with the target server, the model id and its context length when the
        server says it. Workloads written in advance have nothing to do; one made of what a real client sends
        (agent-replay) records it here."""

    @property
    def planned_requests(self) -> int:
        return sum(s.planned if s.driver is not None else len(s.requests) for s in self.sessions)
