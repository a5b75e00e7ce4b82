"""Claude Code 2.1.197 does not give up on a cold prompt's stream. Its byte watchdog (no byte for
CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS, at least 10 s) aborts the stream and sends the request again; it watches
only Anthropic's own URL, so it is pointed at this server with _CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL, set
to its 10 s floor, and given a system prompt of its own so that its ~18k-token prompt is computed cold (longer
than 10 s on a CPU). The server's pings (every --sse-keepalive seconds of silence, 5 s by default) keep it
from firing: one request is sent, its stream opens with message_start and pings come before the first token.
(Its other watchdog, on SSE events other than ping, cannot be set below 300 s: docs/usage.md.)"""
import json
import random

from coding_agents import AGENT_TIMEOUT, ClaudeCode, ClaudeResult, claude_main_requests
from loadgen.recording_proxy import recording_proxy
from reuse_server.api.settings import DEFAULT_SSE_KEEPALIVE

BYTE_WATCHDOG_MS = 10_000  # its floor


class WatchedClaudeCode(ClaudeCode):
    """Claude Code with its byte watchdog on, as it runs against Anthropic's API."""

    def env(self) -> dict[str, str]:
        return {**super().env(), "_CLAUDE_CODE_ASSUME_FIRST_PARTY_BASE_URL": "1",
                "CLAUDE_BYTE_STREAM_IDLE_TIMEOUT_MS": str(BYTE_WATCHDOG_MS)}


def event_names(body: bytes) -> list[str]:
    return [line[len("event: "):] for line in body.decode().splitlines() if line.startswith("event: ")]


def describe(exchanges) -> str:
    lines = []
    for e in exchanges:
        body = e.request_json or {}
        names = event_names(e.response_body) if e.streamed else []
        lines.append(f"stream={body.get('stream')} messages={len(body.get('messages') or [])} "
                     f"status={e.status} e2e={e.e2e_s} events={names[:6]}...{names[-3:]} "
                     f"last user={str((body.get('messages') or [{}])[-1])[:200]}")
    return "\n".join(lines)


def test_claude_code_sends_a_cold_prompt_once_as_pings_keep_its_byte_watchdog_quiet(gemma_server, tmp_path):
    url, model, _ = gemma_server
    seed = random.randrange(2**32)
    print(f"system prompt seed {seed}")
    with recording_proxy(url) as (proxy_url, proxy):
        claude = WatchedClaudeCode(tmp_path / "home", tmp_path / "work", proxy_url, model, max_output_tokens=16)
        run = claude.run(proxy, "-p", "Reply with the word hello.", "--output-format", "json",
                         "--system-prompt", f"You are session {seed}'s terse assistant.", timeout=AGENT_TIMEOUT)
    result = ClaudeResult.of(run)
    assert result.api_error is None, run.describe()
    main = claude_main_requests(run)
    # each request once: a watchdog's retry sends the same messages again (an answer cut at the output cap is
    # continued with a new user message, a request of its own)
    sent = [json.dumps(e.request_json["messages"]) for e in main]
    assert len(set(sent)) == len(sent), describe(main)
    assert main[0].request_json.get("stream") is True and main[0].status == 200
    names = event_names(main[0].response_body)
    first_block = names.index("content_block_start")
    pings = names[1:first_block].count("ping")
    print(f"{pings} pings before the first token (one after message_start, then one per "
          f"{DEFAULT_SSE_KEEPALIVE} s of silence)")
    assert names[0] == "message_start" and set(names[1:first_block]) == {"ping"}
    # the prefill was silent for longer than the watchdog: without the pings it would have fired
    assert pings - 1 >= BYTE_WATCHDOG_MS / 1000 / DEFAULT_SSE_KEEPALIVE, names
