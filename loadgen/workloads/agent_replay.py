"""agent-replay-codex, agent-replay-claude-code: what a real coding agent sends, replayed as N concurrent users.

Before its phases the workload records one session of the real agent (loadgen/coding_agents.py: Codex CLI,
Claude Code, isolated in a temporary HOME and working folder) against the target server, through the
recording proxy: turn 1 is `codex exec TASK` / `claude -p TASK`, turns 2..N continue it (`codex exec resume
--last NEXT` / `claude -p --continue NEXT`) with short tasks of ours. Every generation request the agent sent,
in order, becomes one step of a replayed session: the same body (streamed, as recorded) with the recording's
model replaced by the phase's and the phase's cache fields added, sent on the same path with the same headers.

N replayed sessions are N users of one agent: what names the recorded user (the agent's session and
installation ids, and the temporary folder its prompts mention as home and working directory) is replaced in
each session by strings of its own, so the sessions share the agent's instructions and tools, as real users
do, and nothing after the first user-specific text. The recording lives in memory (the agents' prompts are
their owners' text, not ours to store); --keep-recording writes it to a file outside the checkout.
"""
from __future__ import annotations

import json
import random
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from loadgen.coding_agents import REPO, AgentError, ClaudeCode, CodexCLI, CodingAgent, agent_binary
from loadgen.errors import UsageError
from loadgen.recording_proxy import Exchange, recording_proxy
from loadgen.workloads.spec import Session, Workload, WorkloadConfig

# What each user turn asks: harmless in an empty folder, short to answer; more turns go on with `Continue.`
TASKS = (
    "Say hello and tell me in one sentence what you can do.",
    "List the files in the current directory.",
    "Show a one-line Python function that adds two numbers; do not create any file.",
    "In one sentence, what does that function return for 2 and 3?",
    "Thank you, that is all. Say goodbye.",
)
TURN_TIMEOUT_S = 900.0  # one CLI invocation, all its requests: a 60k-token prefill on two CPU cores is slow
DEFAULT_CONTEXT = 32768  # Codex's window when the server does not say its max_model_len

# the replay's requests are read as they arrive (TTFT, usage): ask for them uncompressed
_NOT_REPLAYED_HEADERS = {"accept-encoding"}

AGENTS: dict[str, type[CodingAgent]] = {"agent-replay-codex": CodexCLI, "agent-replay-claude-code": ClaudeCode}


def task(turn: int) -> str:
    return TASKS[turn] if turn < len(TASKS) else f"Continue (turn {turn + 1})."


@dataclass(frozen=True)
class RecordedRequest:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Recording:
    """An agent's session as it was sent: its generation requests in order, and the strings in them that
    name the recorded user (ids, folders)."""
    agent: str
    requests: tuple[RecordedRequest, ...]
    private: tuple[str, ...]

    def to_jsonl(self) -> str:
        return "".join(json.dumps({"agent": self.agent, "path": r.path, "headers": r.headers,
                                   "body": json.loads(r.body)}) + "\n" for r in self.requests)


def record_session(kind: type[CodingAgent], name: str, server: str, model: str, context_window: int, turns: int,
                   output_tokens: int) -> Recording:
    """Runs the agent for `turns` turns against `server` through the recording proxy; a request the server
    refused, or a turn that sent none, fails the recording (there would be nothing faithful to replay)."""
    with tempfile.TemporaryDirectory(prefix="agent-replay-") as tmp, recording_proxy(server) as (url, proxy):
        root = Path(tmp)
        agent = kind.for_server(root / "home", root / "work", url, model, context_window, output_tokens)
        for turn in range(turns):
            run = agent.turn(proxy, task(turn), first=turn == 0, timeout=TURN_TIMEOUT_S)
            refused = [e for e in run.exchanges if e.path.startswith("/v1/") and e.status != 200]
            if refused or not run.generations():
                raise AgentError(f"{name}: turn {turn + 1} of the recorded session "
                                 f"{'was refused' if refused else 'sent no request'}\n{run.describe()}")
        generations = [e for e in proxy.snapshot() if e.is_generation]
        private = {root.name} | {i for e in generations for i in agent.identities(e)}
    return Recording(name, tuple(_recorded(e) for e in generations), tuple(sorted(private, key=len, reverse=True)))


def _recorded(exchange: Exchange) -> RecordedRequest:
    headers = {k: v for k, v in exchange.request_headers.items() if k.lower() not in _NOT_REPLAYED_HEADERS}
    return RecordedRequest(exchange.path, headers, exchange.request_body)


def like(text: str, rng: random.Random) -> str:
    """A string shaped like `text` (its punctuation kept, every letter or digit a random hex digit): a fresh
    id where `text` is an id, a fresh folder name where it is one."""
    return "".join(rng.choice("0123456789abcdef") if c.isalnum() else c for c in text)


def personalized(recording: Recording, session: int, seed: int) -> list[RecordedRequest]:
    """The recording's requests as replayed session `session` sends them: each private string replaced,
    everywhere in bodies and headers, by one of this session's own (the same one in every request)."""
    mapping = {p: like(p, random.Random(f"agent-replay:{seed}:{session}:{p}")) for p in recording.private}

    def swap(text: str) -> str:
        for old, new in mapping.items():  # longest first: no id is replaced inside a longer one
            text = text.replace(old, new)
        return text

    return [RecordedRequest(r.path, {k: swap(v) for k, v in r.headers.items()}, swap(r.body.decode()).encode())
            for r in recording.requests]


def _driver(requests: list[RecordedRequest]):
    async def drive(http, model: str, cache_body: dict) -> None:
        for request in requests:
            body = {**json.loads(request.body), "model": model, **cache_body}
            # the measuring transport records the status, TTFT and usage; a refused step does not stop the
            # session: its later steps were recorded, and are sent as they were
            async with http.stream("POST", request.path, headers=request.headers, json=body) as response:
                await response.aread()

    return drive


@dataclass
class AgentReplayWorkload(Workload):
    """Empty until `prepare` records the agent against the target server."""
    config: WorkloadConfig = field(default_factory=WorkloadConfig)
    recording: Recording | None = None

    def prepare(self, server: str, model: str, max_model_len: int | None) -> None:
        cfg = self.config
        window = max_model_len or DEFAULT_CONTEXT
        try:
            self.recording = record_session(AGENTS[self.name], self.name, server, model, window, cfg.replay_turns,
                                            cfg.output_tokens)
        except AgentError as exc:
            raise UsageError(str(exc)) from None
        if cfg.keep_recording is not None:
            cfg.keep_recording.write_text(self.recording.to_jsonl(), encoding="utf-8")
        self.sessions = []
        for i in range(cfg.sessions):
            requests = personalized(self.recording, i, cfg.seed)
            self.sessions.append(Session(id=f"{self.name.removeprefix('agent-replay-')}{i}", requests=[],
                                         planned=len(requests), client="http", driver=_driver(requests)))


def build(name: str, cfg: WorkloadConfig) -> Workload:
    try:
        agent_binary(AGENTS[name].binary_name)  # before any traffic
    except AgentError as exc:
        raise UsageError(str(exc)) from None
    path = cfg.keep_recording
    if path is not None:
        resolved = path.resolve()
        if resolved.is_relative_to(REPO):
            raise UsageError(f"--keep-recording {path}: inside the checkout; a recording holds the agent's own "
                             "prompts, which are not ours to commit: write it elsewhere")
        if not resolved.parent.is_dir():
            raise UsageError(f"--keep-recording {path}: no folder {resolved.parent}")
    return AgentReplayWorkload(name=name, config=cfg)
