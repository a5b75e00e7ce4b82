"""One Gemma 3 270M server for the session, and each agent's two-turn session against it, recorded once and
read by every test (the agent tests, the replay and the fuzzing of what they sent)."""
from __future__ import annotations

from dataclasses import dataclass

import httpx
import pytest

from coding_agents import REPO, AgentRun, ClaudeCode, CodexCLI
from loadgen.recording_proxy import Exchange, recording_proxy
from reuse_server.server.launcher import ServerStartError, served, with_small_pool

# What a base model may write before it stops is unbounded, and Codex sends no output limit: the server's
# --max-tokens keeps a turn to about its prefill's time.
ANSWER_CAP = 64
AGENT_TIMEOUT = 900  # seconds for one CLI invocation: a 20k-token prefill takes ~23 s on 2 idle cores

CODEX_TASKS = ("Reply with the word hello.", "Now reply with the word goodbye.")
CLAUDE_TASKS = ("Reply with the word hello.", "Now reply with the word goodbye.")


@pytest.fixture(scope="session")
def gemma_server(tmp_path_factory) -> tuple[str, str, int]:
    """(base URL, served model id, its context length) of `reuse-server serve --model gemma3-270m` (32k context) in a subprocess."""
    log = tmp_path_factory.mktemp("gemma-server") / "server.log"
    try:
        with served(with_small_pool(["--model", "gemma3-270m", "--max-tokens", str(ANSWER_CAP)]), log,
                    cwd=REPO) as (url, _):
            (model,) = httpx.get(url + "/v1/models").json()["data"]
            yield url, model["id"], model["max_model_len"]
    except ServerStartError as exc:
        pytest.fail(str(exc))
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


@dataclass
class AgentSession:
    """An agent's first turn and the turn that continues it, with every exchange both made."""
    first: AgentRun
    second: AgentRun

    @property
    def exchanges(self) -> list[Exchange]:
        return self.first.exchanges + self.second.exchanges


@pytest.fixture(scope="session")
def codex_session(gemma_server, tmp_path_factory) -> AgentSession:
    """`codex exec TASK --json` then `codex exec resume --last NEXT --json`, as a user continues a session."""
    url, model, context_window = gemma_server
    root = tmp_path_factory.mktemp("codex")
    with recording_proxy(url) as (proxy_url, proxy):
        codex = CodexCLI(root / "home", root / "work", proxy_url, model, context_window)
        flags = ("--json", "--skip-git-repo-check", "--strict-config")
        first = codex.run(proxy, "exec", CODEX_TASKS[0], *flags, timeout=AGENT_TIMEOUT)
        second = codex.run(proxy, "exec", "resume", "--last", CODEX_TASKS[1], *flags, timeout=AGENT_TIMEOUT)
    return AgentSession(first, second)


@pytest.fixture(scope="session")
def claude_session(gemma_server, tmp_path_factory) -> AgentSession:
    """`claude -p TASK --output-format json` then the same with `--continue`."""
    url, model, _ = gemma_server
    root = tmp_path_factory.mktemp("claude")
    with recording_proxy(url) as (proxy_url, proxy):
        claude = ClaudeCode(root / "home", root / "work", proxy_url, model, max_output_tokens=ANSWER_CAP)
        first = claude.run(proxy, "-p", CLAUDE_TASKS[0], "--output-format", "json", timeout=AGENT_TIMEOUT)
        second = claude.run(proxy, "-p", CLAUDE_TASKS[1], "--output-format", "json", "--continue",
                            timeout=AGENT_TIMEOUT)
    return AgentSession(first, second)
