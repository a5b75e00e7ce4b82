"""agent-replay-*: a real coding agent's session, recorded at run time against a real server (the tiny random
checkpoint, its context raised to fit the agent's prompt, every answer capped by --max-tokens), replayed as
concurrent sessions of distinct users. A recording proxy in front of the server sees both the agent's own
requests and the replay's, so the tests compare what was replayed with what the agent sent."""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import pytest

from loadgen import cli
from loadgen.coding_agents import REPO
from loadgen.recording_proxy import Exchange, recording_proxy
from loadgen.workloads import WORKLOAD_NAMES, parse_workload_names
from loadgen.workloads.agent_replay import RecordedRequest, Recording, personalized
from server_process import metric, running_server, wait_idle
from tiny_checkpoint import write_tiny_checkpoint

NAMES = ("agent-replay-codex", "agent-replay-claude-code")
# Each agent's first prompt on the tiny tokenizer (a few hundred merges: nearly a token a byte): Codex's is
# about 31k tokens, Claude Code's about 63k; the context leaves room for a few turns.
CONTEXT = {"agent-replay-codex": 40960, "agent-replay-claude-code": 81920}
BLOCK = 16
SESSIONS = 2
TURNS = 2


def live(test):
    """Runs the real agents (`make agents`) against a server it starts."""
    return pytest.mark.agents(pytest.mark.server(pytest.mark.timeout(1800)(test)))


def test_named_only():
    for name in NAMES:
        assert name not in WORKLOAD_NAMES and name not in parse_workload_names("all")
        assert parse_workload_names(f"shared-doc,{name}") == ["shared-doc", name]


def test_each_session_gets_its_own_ids_the_same_in_every_request():
    seed = random.randrange(2**32)
    print(f"seed {seed}")
    session_id, folder = "01a245a0-fb13-78d1-92e0-90447d11d866", "agent-replay-q1w2e3r4"
    body = json.dumps({"prompt_cache_key": session_id, "input": f"cwd /tmp/{folder}/work, shared text"}).encode()
    recording = Recording("agent-replay-codex", (RecordedRequest("/v1/responses", {"session-id": session_id}, body),) * 2,
                          (folder, session_id))
    replays = [personalized(recording, i, seed) for i in range(3)]
    keys = []
    for requests in replays:
        first, second = (json.loads(r.body) for r in requests)
        assert first == second and requests[0].headers == requests[1].headers, "one session: the same ids throughout"
        assert session_id not in requests[0].body.decode() + json.dumps(requests[0].headers)
        assert folder not in first["input"] and first["input"].endswith("/work, shared text")
        assert requests[0].headers["session-id"] == first["prompt_cache_key"]
        assert len(first["prompt_cache_key"]) == len(session_id) and first["prompt_cache_key"].count("-") == 4
        keys.append(first["prompt_cache_key"])
    assert len(set(keys)) == 3, "every session is a user of its own"
    assert personalized(recording, 1, seed) == replays[1], "the seed fixes the replay"


def test_a_recording_is_never_kept_in_the_checkout(tmp_path, capsys):
    inside = REPO / "out" / "recording.jsonl"
    code = cli.main(["run", "--server", "http://127.0.0.1:1", "--workload", "agent-replay-codex", "--out",
                     str(tmp_path / "out"), "--keep-recording", str(inside)])
    assert code == 2
    assert f"--keep-recording {inside}: inside the checkout" in capsys.readouterr().err
    assert not inside.exists() and not (tmp_path / "out").exists()


def test_an_agent_not_installed_is_one_clear_line_before_any_traffic(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("loadgen.coding_agents.AGENT_BIN", tmp_path / "bin")  # where nothing is installed
    code = cli.main(["run", "--server", "http://127.0.0.1:1", "--workload", "agent-replay-claude-code", "--out",
                     str(tmp_path / "out")])
    assert code == 2
    assert f"{tmp_path / 'bin' / 'claude'} is missing: `make agents` installs" in capsys.readouterr().err


@dataclass
class Replay:
    name: str
    code: int
    report: dict  # the workload's entry in report.json
    records: list[dict]  # requests.jsonl of the cached phase
    recorded: list[dict]  # what --keep-recording wrote
    exchanges: list[Exchange]  # every exchange the proxy in front of the server saw
    after: dict  # the server's metrics once idle


@pytest.fixture(scope="module", params=NAMES)
def replay(request, tmp_path_factory) -> Replay:
    """The workload run once against a tiny server seen through a recording proxy."""
    name = request.param
    root = tmp_path_factory.mktemp(name)
    checkpoint = write_tiny_checkpoint(root / "checkpoint", arch="llama", max_position_embeddings=CONTEXT[name])
    kept, out = root / "recording.jsonl", root / "out"
    with running_server(checkpoint, root / "server.log", "--block-size", str(BLOCK), "--max-model-len",
                        str(CONTEXT[name]), "--max-tokens", "16") as url:
        with recording_proxy(url) as (proxy_url, proxy):
            code = cli.main(["run", "--server", proxy_url, "--workload", name, "--out", str(out), "--compare",
                             "--turns", str(TURNS), "--sessions", str(SESSIONS), "--concurrency", str(SESSIONS),
                             "--warmup", "0", "--no-plots", "--no-progress", "--output-tokens", "16",
                             # the tests count every step: no phase may be cut by the time bound (300 s by
                             # default), which a busy 2-core machine reached in Claude Code's replay
                             "--duration", "800",
                             "--keep-recording", str(kept)])
        after = wait_idle(url)
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return Replay(name, code, json.loads((out / "report.json").read_text())["workloads"][name],
                  [r for r in records if r["phase"] == "cached"],
                  [json.loads(line) for line in kept.read_text().splitlines()], proxy.snapshot(), after)


@live
def test_every_replayed_step_is_answered_and_reported(replay):
    w, steps = replay.report, len(replay.recorded)
    assert replay.code == 0
    assert steps >= TURNS and all(r["agent"] == replay.name for r in replay.recorded)
    for phase in (w, w["baseline"]):
        assert (phase["requests"], phase["errors"], phase["unsent"]) == (SESSIONS * steps, 0, 0), phase["error_samples"]
        assert [t["turn"] for t in phase["by_turn"]] == list(range(steps)), "one row per step"
        assert all(t["requests"] == SESSIONS for t in phase["by_turn"])
    assert w["baseline"]["cached_tokens"] == 0, "the baseline asks for no cache, on the agent's own route"
    assert metric(replay.after, "kvreuse_kv_blocks", state="in_use") == 0


@live
def test_replayed_sessions_are_distinct_users_of_one_agent(replay):
    generations = [e.request_json for e in replay.exchanges if e.is_generation]
    # the replay adds the phase's cache fields (cached: a cache_salt; baseline: prefix_cache off); agents send none
    replayed = [b for b in generations if "cache_salt" in b or "prefix_cache" in b]
    agent_sent = [b for b in generations if b not in replayed]
    assert [r["body"] for r in replay.recorded] == agent_sent, "the kept recording is what the agent sent"
    assert len(replayed) == 2 * SESSIONS * len(agent_sent)  # the cached phase and the baseline
    codex = replay.name.endswith("codex")
    instructions = "input" if codex else "system"
    first = agent_sent[0]

    def user(body: dict) -> str:
        return body["prompt_cache_key"] if codex else json.loads(body["metadata"]["user_id"])["session_id"]

    users = {user(b) for b in replayed}
    assert len(users) == SESSIONS and user(first) not in users, "each session is a user of its own"
    for body in replayed:
        assert body["tools"] == first["tools"], "the agent's tools, as it sent them"
        # the agent's opening instructions, word for word (further on, its prompts name the user's folders)
        assert json.dumps(body[instructions])[:1000] == json.dumps(first[instructions])[:1000]
        assert body["stream"] is True


@live
def test_sessions_share_the_opening_and_hit_their_own_earlier_steps(replay):
    sessions: dict[str, list[dict]] = {}
    for r in sorted(replay.records, key=lambda r: r["turn"]):
        sessions.setdefault(r["session"], []).append(r)
    assert len(sessions) == SESSIONS
    firsts = sorted((s[0] for s in sessions.values()), key=lambda r: r["cached_tokens"])
    shared = firsts[-1]["cached_tokens"]
    # one session computes the agent's opening (none of the recording's KV is reused: the replay has a
    # cache_salt of its own), the other reads it
    assert firsts[0]["cached_tokens"] == 0
    assert shared > 0, "the second session's first request read nothing of the first's"
    if replay.name.endswith("codex"):  # Codex's instructions and tools come before anything naming its user
        assert shared > firsts[-1]["prompt_tokens"] / 2, f"the second session's first request read {shared} tokens"
    for steps in sessions.values():
        assert [r["turn"] for r in steps] == list(range(len(steps)))
        for r in steps[1:]:
            # a later step reads the session's own history, far past what the sessions share
            assert r["cached_tokens"] > shared and r["cached_tokens"] >= 0.9 * r["prompt_tokens"], r
