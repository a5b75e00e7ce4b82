"""The coding agents' runners live in loadgen (the agent-replay workload records sessions with them too);
tests import them from here as before, with the limits every agent test runs them under."""
from loadgen.coding_agents import (AGENT_BIN, DUMMY_KEY, REPO, AgentError, AgentRun, ClaudeCode, ClaudeResult,  # noqa: F401
                                   CodexCLI, CodingAgent, agent_binary, codex_events)
from loadgen.recording_proxy import Exchange

# What a base model may write before it stops is unbounded, and Codex sends no output limit: the server's
# --max-tokens keeps a turn to about its prefill's time.
ANSWER_CAP = 64
AGENT_TIMEOUT = 900  # seconds for one CLI invocation: a 20k-token prefill takes ~23 s on 2 idle cores

CODEX_TASKS = ("Reply with the word hello.", "Now reply with the word goodbye.")
CLAUDE_TASKS = ("Reply with the word hello.", "Now reply with the word goodbye.")


def claude_main_requests(run: AgentRun) -> list[Exchange]:
    """Claude Code's agent-loop requests: the ones offering its tools (side queries, such as a title, do not)."""
    return [e for e in run.generations() if "/messages/count_tokens" not in e.path and (e.request_json or {}).get("tools")]
