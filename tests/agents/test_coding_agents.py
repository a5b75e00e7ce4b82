"""The real coding agents against a Gemma 3 270M server (issue #43): Codex CLI over the Responses API, Claude
Code over Anthropic's Messages API, each for a turn and the turn that continues it. Each must finish without
an API error and find the first turn's prompt in the cache on the second; every request they sent must be
accepted again when replayed, and no random corruption of one may get a 5xx.
"""
from __future__ import annotations

import os
import random

import httpx
import pytest

from coding_agents import AgentRun, ClaudeResult, claude_main_requests, codex_events
from json_mutations import mutate
from loadgen.http_recorder import sse_payloads
from loadgen.recording_proxy import Exchange

pytestmark = [pytest.mark.agents, pytest.mark.server, pytest.mark.timeout(3600)]

REUSED_SHARE = 0.9  # of the first turn's prompt, found in the cache by the next turn's first request
FUZZ_VARIANTS = 1  # mutated copies sent of each recorded request (a mutation early in Claude Code's 20k-token
# prompt recomputes everything after it: ~25 s on Gemma)


def _prompt_tokens(exchange: Exchange, run: AgentRun) -> int:
    usage = exchange.usage_in_chat_terms()
    assert usage is not None, f"{exchange.path} answered no usage\n{run.describe()}"
    return usage.prompt_tokens


def _cached_tokens(exchange: Exchange, run: AgentRun) -> int:
    usage = exchange.usage_in_chat_terms()
    assert usage is not None, f"{exchange.path} answered no usage\n{run.describe()}"
    return usage.prompt_tokens_details.cached_tokens or 0


def test_codex_exec_then_resume_reuses_the_first_turn(codex_session):
    for run in (codex_session.first, codex_session.second):
        failed = [e for e in codex_events(run) if e.get("type") in ("error", "turn.failed")]
        assert run.returncode == 0 and not failed, run.describe()
        assert run.generations(), f"codex sent no request to the server\n{run.describe()}"
        assert all(e.status == 200 for e in run.generations()), run.describe()
    first = codex_session.first.generations()[0]
    resumed = codex_session.second.generations()[0]
    prompt = _prompt_tokens(first, codex_session.first)
    cached = _cached_tokens(resumed, codex_session.second)
    # Codex sends the whole conversation again (store: false), so the prefix cache is what serves it
    assert cached >= REUSED_SHARE * prompt, (
        f"the resumed turn's first request reused {cached} of the first turn's {prompt} prompt tokens")


def test_claude_code_print_then_continue_reuses_the_first_turn(claude_session):
    for run in (claude_session.first, claude_session.second):
        result = ClaudeResult.of(run)
        assert result.api_error is None, f"API error: {result.api_error}\n{run.describe()}"
        # exit 1 only where the answer reached CLAUDE_CODE_MAX_OUTPUT_TOKENS, which Claude Code reports as an error
        assert run.returncode == 0 or result.hit_output_cap, run.describe()
        assert claude_main_requests(run), f"claude sent no agent request\n{run.describe()}"
        assert all(e.status == 200 for e in run.generations()), run.describe()
    first = claude_main_requests(claude_session.first)[0]
    continued = claude_main_requests(claude_session.second)[0]
    prompt = _prompt_tokens(first, claude_session.first)
    cached = _cached_tokens(continued, claude_session.second)
    assert cached >= REUSED_SHARE * prompt, (
        f"the continued turn's main request read {cached} cached tokens of the first turn's {prompt}")
    # Claude Code marks its system blocks and the user's last block with cache_control (no ttl: 5 minutes):
    # everything up to that block, its instructions and tools, is written to the cache at breakpoints; only
    # what follows (the agent-types system message after the user's question, the turn's framing) is input
    usage = first.usage()
    assert usage["cache_creation_input_tokens"] >= 0.75 * prompt > usage["input_tokens"] > 0, usage
    assert usage["cache_creation"] == {"ephemeral_5m_input_tokens": usage["cache_creation_input_tokens"],
                                       "ephemeral_1h_input_tokens": 0}, usage


def _recorded_api_requests(session) -> list[Exchange]:
    """What the agent sent to the API (its /v1 routes; a connectivity probe of / is not an API request)."""
    return [e for e in session.exchanges if e.path.startswith("/v1/")]


def _send(client: httpx.Client, url: str, exchange: Exchange, body: bytes) -> tuple[int, bytes, str]:
    """(status, whole body, content type) of the request sent again directly to the server."""
    with client.stream(exchange.method, url + exchange.path, headers=exchange.request_headers,
                       content=body if exchange.method not in ("GET", "HEAD") else None) as response:
        return response.status_code, response.read(), response.headers.get("content-type", "")


def _stream_errors(body: bytes, content_type: str) -> list[dict]:
    """The error events of an SSE body (a failure after the 200 was sent)."""
    if not content_type.startswith("text/event-stream"):
        return []
    return [p for p in sse_payloads(body) if p.get("type") in ("error", "response.failed") or "error" in p]


def _server_error_events(body: bytes, content_type: str) -> list[dict]:
    """The in-stream errors that are the server's fault: all but a refusal of the request itself."""
    def client_fault(event: dict) -> bool:
        error = event.get("error") if isinstance(event.get("error"), dict) else event
        return "invalid_request_error" in (error.get("type"), error.get("code"))
    return [e for e in _stream_errors(body, content_type) if not client_fault(e)]


@pytest.mark.parametrize("agent", ["codex", "claude"])
def test_every_recorded_request_is_accepted_again(agent, request, gemma_server):
    session = request.getfixturevalue(f"{agent}_session")
    url = gemma_server[0]
    recorded = _recorded_api_requests(session)
    assert recorded, f"{agent} sent nothing to record\n{session.first.describe()}"
    with httpx.Client(timeout=None) as client:
        for exchange in recorded:
            status, body, content_type = _send(client, url, exchange, exchange.request_body)
            assert status < 400, f"{exchange.method} {exchange.path} -> {status}: {body[:500]!r}"
            assert not _stream_errors(body, content_type), f"{exchange.path}: {_stream_errors(body, content_type)}"


@pytest.mark.parametrize("agent", ["codex", "claude"])
def test_no_corruption_of_a_recorded_request_gets_a_server_error(agent, request, gemma_server):
    session = request.getfixturevalue(f"{agent}_session")
    url = gemma_server[0]
    seed = int(os.environ.get("AGENTS_FUZZ_SEED") or random.randrange(2**32))
    print(f"fuzz seed {seed} (AGENTS_FUZZ_SEED={seed} repeats it)")
    rng = random.Random(seed)
    recorded = [e for e in _recorded_api_requests(session) if e.method == "POST" and e.request_json is not None]
    assert recorded, f"{agent} sent no JSON request to fuzz\n{session.first.describe()}"
    failures = []
    with httpx.Client(timeout=None) as client:
        for exchange in recorded:
            for _ in range(FUZZ_VARIANTS):
                what, body = mutate(exchange.request_json, rng)
                status, answer, content_type = _send(client, url, exchange, body)
                if status >= 500 or _server_error_events(answer, content_type):
                    failures.append(f"{exchange.path} {what} -> {status}: {answer[-300:]!r}")
    assert not failures, f"seed {seed}:\n" + "\n".join(failures)
