"""Codex CLI's session through `reuse-server cluster --router vllm-router --replicas 2` (issue #43): `codex exec`
and then `codex exec resume --last` land every request of both turns on one replica, the one that holds the
conversation, which the resumed turn then finds in its cache.

The replicas run the tiny random checkpoint, made to end every answer at its first token (Codex takes it and
exits 0), with a context long enough for Codex's prompt on the tiny byte-level tokenizer. The replicas share
the cluster's Redis, so the resumed turn would find its prompt cached on either replica: that it ran where the
session began is read from where it was served, and that it found the conversation in that replica's own KV
pool from the replica's tier counters (nothing loaded from Redis). Which replica served a request
is read from the replicas' access logs (uvicorn's "POST /v1/responses" lines), not from their request
counters, because a decoy (below) sends other requests to the same replicas.

Why a decoy: vllm-router cannot tokenize /v1/responses, so a request it places by itself goes to the replica
with fewer requests in flight, and on an idle cluster that is the same replica every time: both turns would
land together even without the session key. So during the resumed turn a decoy keeps the first turn's replica
busy with a stream of /v1/completions requests, routed there by their prefix (the router tokenizes those and
knows from the KV events that only that replica holds it): placed by load, the resumed turn would go to the
other replica; only the session key (Codex's `session-id` header, the same across `exec resume`) keeps it."""
from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from coding_agents import CodexCLI, codex_events
from loadgen.recording_proxy import Exchange, recording_proxy
from reuse_server.server.cluster import stop
from reuse_server.server.launcher import SMALL_POOL, free_port
from server_process import REPO, metric, read_until, scrape
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = [pytest.mark.agents, pytest.mark.server, pytest.mark.timeout(1200)]

# Codex's first prompt (its instructions and tool schemas) is ~31k tokens on the tiny byte-level tokenizer;
# the resumed turn sends it again with one more exchange
CONTEXT = 65536
AGENT_TIMEOUT = 600
DECOY_TOKENS = 256  # a few hundred milliseconds of decoding a request
REUSED_SHARE = 0.9  # of the first turn's prompt, found in the cache by the resumed turn's first request
TASKS = ("Reply with the word hello.", "Now reply with the word goodbye.")
WORDS = ("river salt wool grain trader spring market bridge tower harbor winter lantern copper meadow orchard "
         "archive signal engine quarry garden mirror").split()


@pytest.fixture(scope="module")
def long_context_checkpoint(tmp_path_factory) -> Path:
    """The suite's tiny random Llama, with room for Codex's prompt, whose every token ends its answer (its
    generation_config names them all end-of-sequence): an answer of random tokens cut at a length limit is
    "incomplete" to the Responses API, which Codex fails as a turn; one token long, it is complete."""
    path = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama-64k"), max_position_embeddings=CONTEXT)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": list(range(vocab))}))
    return path


@contextmanager
def cluster_command(checkpoint: Path, log_dir: Path) -> Iterator[tuple[str, list[str]]]:
    """`reuse-server cluster --router vllm-router --replicas 2` as a user runs it (its defaults: kv_aware, session
    affinity on); yields (the router's URL, the replicas' URLs) once it is ready. The replicas log at info so
    that each request they serve leaves an access-log line."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "reuse_server.server.cli", "cluster", "--router", "vllm-router", "--replicas", "2",
         "--port", str(port), "--log-dir", str(log_dir), "--", "--model", str(checkpoint),
         "--served-model-name", "tiny", "--max-model-len", str(CONTEXT),
         "--no-blend-key-shift", "--log-level", "info", "--kv-cache-memory", SMALL_POOL],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = read_until(proc, "ready")
        replicas = re.findall(r"replica \d: (http://\S+)", text)
        assert len(replicas) == 2, text
        yield f"http://127.0.0.1:{port}", replicas
    finally:
        stop(proc, timeout=120)  # SIGTERM: the cluster stops the router, the replicas, then Redis
    for i in range(2):
        log = (log_dir / f"replica-{i}.log").read_text()
        assert "Traceback" not in log, log[-3000:]


def served(log_dir: Path, path: str = "/v1/responses") -> list[int]:
    """How many POSTs to `path` each replica has answered so far (its access log)."""
    return [(log_dir / f"replica-{i}.log").read_text().count(f'"POST {path} HTTP/1.1"') for i in range(2)]


@contextmanager
def decoy(router: str, replica: str, seed: int) -> Iterator[list[int]]:
    """Keeps `replica` busy through the router: a prompt computed on that replica alone (so the router's KV
    index places it there), then sent through the router again and again, one request at a time, each decoding
    DECOY_TOKENS past its end-of-sequence tokens (vLLM's ignore_eos) so that the request is in flight, and
    counted as the replica's load, nearly all the time. Yields once the replica runs the first; then the list of
    the decoy's answered statuses."""
    rng = random.Random(seed)
    prompt = " ".join(rng.choice(WORDS) for _ in range(200))
    body = {"model": "tiny", "prompt": prompt, "max_tokens": DECOY_TOKENS, "ignore_eos": True}
    assert httpx.post(replica + "/v1/completions", json={**body, "max_tokens": 1}, timeout=120).status_code == 200
    statuses: list[int] = []
    done = threading.Event()

    def loop():
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                statuses.append(client.post(router + "/v1/completions", json=body).status_code)

    thread = threading.Thread(target=loop, name="decoy")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not metric(scrape(replica), "kvreuse_requests_running"):
            assert time.monotonic() < deadline and thread.is_alive(), "the decoy never ran on its replica"
            time.sleep(0.02)
        yield statuses
    finally:
        done.set()
        thread.join()


def tier_hits(replica: str) -> float:
    """Blocks the replica has loaded from a tier below its KV pool (Redis here), all tiers together."""
    return sum(value for (name, _), value in scrape(replica).items() if name.startswith("kvreuse_tier_hits"))


def usage(exchange: Exchange):
    found = exchange.usage_in_chat_terms()
    assert found is not None, f"{exchange.path} -> {exchange.status}: answered no usage"
    return found


def test_codex_exec_then_resume_through_the_cluster_stays_on_one_replica(long_context_checkpoint, tmp_path):
    seed = random.randrange(2**32)
    print("decoy seed", seed)
    logs = tmp_path / "cluster"
    logs.mkdir()
    with cluster_command(long_context_checkpoint, logs) as (router, replicas), \
            recording_proxy(router) as (proxy_url, proxy):
        codex = CodexCLI(tmp_path / "home", tmp_path / "work", proxy_url, "tiny", CONTEXT)
        flags = ("--json", "--skip-git-repo-check", "--strict-config")
        first = codex.run(proxy, "exec", TASKS[0], *flags, timeout=AGENT_TIMEOUT)
        after_first = served(logs)
        began = [i for i, n in enumerate(after_first) if n]
        assert len(began) == 1, (after_first, first.describe())
        home = began[0]  # the replica the session began on
        with decoy(router, replicas[home], seed) as decoy_statuses:
            loaded_before = tier_hits(replicas[home])
            second = codex.run(proxy, "exec", "resume", "--last", TASKS[1], *flags, timeout=AGENT_TIMEOUT)
            loaded = tier_hits(replicas[home]) - loaded_before
        after_second = served(logs)
        decoys = served(logs, "/v1/completions")

    for run in (first, second):
        failed = [e for e in codex_events(run) if e.get("type") in ("error", "turn.failed")]
        assert run.returncode == 0 and not failed, run.describe()
        assert run.generations() and all(e.status == 200 for e in run.generations()), run.describe()
    assert decoy_statuses and set(decoy_statuses) == {200}, decoy_statuses
    # what makes the test able to fail: the decoy kept the session's replica busy, so load alone would move it
    assert decoys[1 - home] == 0, f"the decoy ran on the other replica too: {decoys}"
    # every /v1/responses request of the first turn ran on one replica, and every one of the resumed turn on it too
    assert after_first[home] == len(first.generations()), (after_first, first.describe())
    resumed = [after - before for after, before in zip(after_second, after_first)]
    print("responses per replica: first turn", after_first, "resumed turn", resumed,
          "; decoy requests per replica", decoys)
    assert resumed[home] == len(second.generations()) and resumed[1 - home] == 0, (
        f"the session began on replica {home}; its resumed turn's requests ran {resumed[0]} on replica 0, "
        f"{resumed[1]} on replica 1")
    # Codex sends the whole conversation again (store: false): the replica that ran it has it in its own pool
    assert loaded == 0, f"the session's replica loaded {loaded} blocks from a tier instead of holding them"
    prompt = usage(first.generations()[0]).prompt_tokens
    cached = usage(second.generations()[0]).prompt_tokens_details.cached_tokens or 0
    print("first turn's prompt", prompt, "tokens; cached on resume", cached)
    assert cached >= REUSED_SHARE * prompt, (cached, prompt)
