"""The real coding agents (npm's @openai/codex and @anthropic-ai/claude-code, pinned in coding-agents/ and
installed by `make agents`), each run as its user would run it against our server, isolated from the
machine's own set-up: a throw-away HOME and configuration folder, the server's URL and a dummy key, nothing
else of the caller's environment but PATH. A run's HTTP exchanges go through a recording proxy
(loadgen/recording_proxy.py), so the caller reads what the agent sent and what it was answered.

Each agent is a type: how it is configured, how a session's first turn and a turn that continues it are
asked for on its command line, and what in its requests names the session (so a replay can send the same
requests as another session of the same agent: agent_replay).
"""
from __future__ import annotations

import json
import os
import subprocess
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.recording_proxy import Exchange, RecordingProxy

REPO = Path(__file__).resolve().parents[1]
AGENT_BIN = REPO / "coding-agents" / "node_modules" / ".bin"
DUMMY_KEY = "sk-reuse-server-test"
STREAM_IDLE_TIMEOUT_MS = 900_000  # Claude Code's wait for a stream's next event: one CLI turn's bound, 15 min


class AgentError(Exception):
    """An agent could not be run, or did not finish."""


def agent_binary(name: str) -> Path:
    """The installed CLI; a clear error when it is absent (never silently skipped: `make agents` installs it)."""
    path = AGENT_BIN / name
    if not path.exists():
        raise AgentError(f"{path} is missing: `make agents` installs the coding agents (npm ci in coding-agents/)")
    return path


@dataclass
class AgentRun:
    """One invocation of an agent's CLI: how it ended and the exchanges it made (in the order they finished)."""
    args: list[str]
    returncode: int
    stdout: str
    stderr: str
    exchanges: list[Exchange] = field(default_factory=list)

    def generations(self) -> list[Exchange]:
        return [e for e in self.exchanges if e.is_generation]

    def describe(self) -> str:
        """What a failure shows: how the CLI ended and each exchange's status and error."""
        lines = [f"{' '.join(self.args[:3])}... exited {self.returncode}", "stdout: " + self.stdout[-2000:],
                 "stderr: " + self.stderr[-2000:]]
        for e in self.exchanges:
            answer = "" if e.status == 200 else e.response_body[:400].decode("utf-8", "replace")
            lines.append(f"  {e.method} {e.path} -> {e.status} {answer}")
        return "\n".join(lines)


class CodingAgent(ABC):
    """A CLI run in `workdir` with HOME at `home`, talking to `base_url` (the recording proxy's), as `model`."""
    binary_name: str

    def __init__(self, home: Path, workdir: Path, base_url: str, model: str):
        self.home, self.workdir, self.base_url, self.model = home, workdir, base_url, model
        home.mkdir(parents=True, exist_ok=True)
        workdir.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        return {"PATH": os.environ["PATH"], "HOME": str(self.home), "TERM": "dumb", "NO_COLOR": "1"}

    def run(self, proxy: RecordingProxy, *args: str, timeout: float) -> AgentRun:
        """Runs the CLI to its end (no stdin: both read a prompt from it when it is open) and returns the run
        with the exchanges it added to the proxy's recording."""
        before = len(proxy.snapshot())
        cmd = [str(agent_binary(self.binary_name)), *args]
        try:
            done = subprocess.run(cmd, env=self.env(), cwd=self.workdir, stdin=subprocess.DEVNULL,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            run = AgentRun(cmd, -1, _text(exc.stdout), _text(exc.stderr), proxy.snapshot()[before:])
            raise AgentError(f"{self.binary_name} did not finish in {timeout:g} s\n{run.describe()}") from None
        return AgentRun(cmd, done.returncode, done.stdout, done.stderr, proxy.snapshot()[before:])

    @classmethod
    @abstractmethod
    def for_server(cls, home: Path, workdir: Path, base_url: str, model: str, context_window: int,
                   max_output_tokens: int) -> "CodingAgent":
        """Set up as a user of a server with this context window would set it up; answers capped at
        `max_output_tokens` where the agent has a cap of its own."""

    @abstractmethod
    def turn(self, proxy: RecordingProxy, task: str, first: bool, timeout: float) -> AgentRun:
        """One turn of a session as its user types it: the session's first, or one continuing the last."""

    @abstractmethod
    def identities(self, exchange: Exchange) -> set[str]:
        """The ids in a request the agent sent that name its user: the session's, the installation's."""


class CodexCLI(CodingAgent):
    """Codex CLI with a CODEX_HOME of its own whose config.toml names the server as a model provider speaking
    the Responses API (Codex's only wire API), its key read from the variable `env_key` names. Codex has no
    output cap of its own (0.171.0 sends no max_output_tokens): the server's --max-tokens is the bound."""
    binary_name = "codex"
    KEY_VARIABLE = "REUSE_SERVER_API_KEY"
    FLAGS = ("--json", "--skip-git-repo-check", "--strict-config")

    def __init__(self, home: Path, workdir: Path, base_url: str, model: str, context_window: int):
        super().__init__(home, workdir, base_url, model)
        self.codex_home = home / ".codex"
        self.codex_home.mkdir(exist_ok=True)
        (self.codex_home / "config.toml").write_text(
            f'model = "{model}"\n'
            'model_provider = "reuse-server"\n'
            # Codex knows the windows of OpenAI's models only; it compacts the conversation against this one
            f"model_context_window = {context_window}\n"
            "check_for_update_on_startup = false\n"
            "\n"
            "[model_providers.reuse-server]\n"
            'name = "reuse-server"\n'
            f'base_url = "{base_url}/v1"\n'
            'wire_api = "responses"\n'
            f'env_key = "{self.KEY_VARIABLE}"\n'
            # a refused request is the caller's finding: retrying it only takes longer to fail
            "request_max_retries = 0\n"
            "stream_max_retries = 0\n")

    @classmethod
    def for_server(cls, home, workdir, base_url, model, context_window, max_output_tokens) -> "CodexCLI":
        return cls(home, workdir, base_url, model, context_window)

    def env(self) -> dict[str, str]:
        return {**super().env(), "CODEX_HOME": str(self.codex_home), self.KEY_VARIABLE: DUMMY_KEY}

    def turn(self, proxy: RecordingProxy, task: str, first: bool, timeout: float) -> AgentRun:
        args = ("exec", task) if first else ("exec", "resume", "--last", task)
        return self.run(proxy, *args, *self.FLAGS, timeout=timeout)

    def identities(self, exchange: Exchange) -> set[str]:
        # the thread's id is the body's prompt_cache_key (and its session-id and thread-id headers); the
        # installation's is in client_metadata
        body = exchange.request_json or {}
        metadata = body.get("client_metadata") or {}
        ids = {body.get("prompt_cache_key"), metadata.get("session_id"), metadata.get("x-codex-installation-id")}
        return {str(i) for i in ids if i}


class ClaudeCode(CodingAgent):
    """Claude Code with its own CLAUDE_CONFIG_DIR, pointed at the server by ANTHROPIC_BASE_URL, its answers
    capped by CLAUDE_CODE_MAX_OUTPUT_TOKENS (the request's max_tokens), and no traffic but the model's."""
    binary_name = "claude"

    def __init__(self, home: Path, workdir: Path, base_url: str, model: str, max_output_tokens: int):
        super().__init__(home, workdir, base_url, model)
        self.max_output_tokens = max_output_tokens

    @classmethod
    def for_server(cls, home, workdir, base_url, model, context_window, max_output_tokens) -> "ClaudeCode":
        return cls(home, workdir, base_url, model, max_output_tokens)

    def env(self) -> dict[str, str]:
        return {**super().env(), "CLAUDE_CONFIG_DIR": str(self.home / ".claude"), "ANTHROPIC_BASE_URL": self.base_url,
                "ANTHROPIC_API_KEY": DUMMY_KEY, "ANTHROPIC_MODEL": self.model,
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
                "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(self.max_output_tokens),
                # Claude Code drops a stream that sends no SSE event but pings for 300 s (its floor) and sends
                # the request again unstreamed: a cold 20k-token prefill on a loaded 2-core CPU takes longer
                # after message_start, and would be computed twice
                "CLAUDE_STREAM_IDLE_TIMEOUT_MS": str(STREAM_IDLE_TIMEOUT_MS)}

    def turn(self, proxy: RecordingProxy, task: str, first: bool, timeout: float) -> AgentRun:
        args = ("-p", task, "--output-format", "json") + (() if first else ("--continue",))
        return self.run(proxy, *args, timeout=timeout)

    def identities(self, exchange: Exchange) -> set[str]:
        # metadata.user_id is JSON with the device's and the session's ids (the same session id is the
        # x-claude-code-session-id header)
        user_id = str(((exchange.request_json or {}).get("metadata") or {}).get("user_id") or "")
        try:
            ids = json.loads(user_id)
        except ValueError:
            return set()
        if not isinstance(ids, dict):
            return set()
        return {str(ids[k]) for k in ("session_id", "device_id") if ids.get(k)}


def codex_events(run: AgentRun) -> list[dict]:
    """The JSON events `codex exec --json` printed, one a line (its turn.failed and error events among them)."""
    return [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]


@dataclass
class ClaudeResult:
    """The JSON object `claude -p --output-format json` prints. An answer cut at CLAUDE_CODE_MAX_OUTPUT_TOKENS
    is an error to Claude Code too (is_error, exit 1, result "API Error: Claude's response exceeded the N
    output token maximum..."), though the server answered as asked; any other error is the API's."""
    data: dict

    @classmethod
    def of(cls, run: AgentRun) -> "ClaudeResult":
        try:
            return cls(json.loads(run.stdout.strip().splitlines()[-1]))
        except (ValueError, IndexError):
            raise AgentError(f"claude printed no JSON result\n{run.describe()}") from None

    @property
    def hit_output_cap(self) -> bool:
        return bool(self.data.get("is_error")) and "output token maximum" in str(self.data.get("result"))

    @property
    def api_error(self) -> str | None:
        if self.data.get("api_error_status") is not None:
            return f"HTTP {self.data['api_error_status']}: {self.data.get('result')}"
        if self.data.get("is_error") and not self.hit_output_cap:
            return str(self.data.get("result"))
        return None


def _text(data) -> str:
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else (data or "")
