"""The real coding agents (Codex CLI, Claude Code; `make agents`) on Gemma 3 270M, the bundled model whose 32k
context holds their prompts: this server with its defaults, with the cache off, and llama.cpp's server.

1. Sessions. For each agent and each target, one session of --turns user turns in a tiny scratch repository of
   its own (a temporary folder: a README, a Python module, one git commit): `codex exec TASK` / `claude -p TASK`,
   then `codex exec resume --last NEXT` / `claude -p --continue NEXT` with the agent-replay workload's short
   follow-ups. The agents talk to the target through the recording proxy (loadgen/recording_proxy.py), which
   times each request where the agent sees it: from the request sent to the first streamed event carrying text
   or a tool call (TTFT), and reads its usage (prompt tokens, cached tokens; llama-server's `timings` too).
   Targets, one server at a time, each with --max-tokens (llama-server's -n) as the only cap on an answer
   (Codex sends none, and a base model may never stop):
   - `reuse`: `reuse-server serve --model gemma3-270m` with its defaults;
   - `reuse-cache-off`: the same with `--no-prefix-cache`, for --cache-off-turns turns (2: every turn
     recomputes its whole prompt, which grows ~1% a turn, so turn 2 stands for the later ones);
   - `llama-server`: llama.cpp's server on the same GGUF with its defaults (`cache_prompt` on, its slots);
     Codex through /v1/responses, Claude Code through /v1/messages. A request it refuses is recorded as such.
2. Replay. `reuse-loadgen run --workload agent-replay-codex|agent-replay-claude-code` against a fresh server
   with defaults, at each of --replay-sessions concurrent sessions, one level after another, with no cache_salt:
   each level's sessions are new users (ids and folders of their own, a seed per level) of an agent whose
   instructions and tools the server has seen (its recorded session), as a server used by a team finds them:
   hit rate and TTFT per step.

Rows (JSON, one a line): `request` (one per generation request of a session), `turn` (how each agent
invocation ended), `session` (per agent and target: the first request's TTFT, the later requests' least
cached share and median TTFT), `versus_cache_off` (the goals: every later request >= 95% cached, its TTFT >= 20x
sooner than with the cache off), `replay_step`, `replay_total`; each with the 1-minute load average when it was taken.

    .venv/bin/python -m benchmarks.bench_coding_agents [--turns 5] [--agents codex,claude-code]
        [--targets reuse,reuse-cache-off,llama-server] [--replay-sessions 1,4,8] [--llama-server PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import httpx

from benchmarks.bench_ttft import server_process
from loadgen import cli
from loadgen.coding_agents import REPO, AgentError, AgentRun, ClaudeCode, ClaudeResult, CodexCLI, CodingAgent, codex_events
from loadgen.http_recorder import sse_payloads
from loadgen.recording_proxy import Exchange, recording_proxy
from loadgen.workloads.agent_replay import TURN_TIMEOUT_S, task
from reuse_server.model.bundled import bundled_gguf_path
from benchmarks.llama_server import running_llama_server

AGENTS: dict[str, type[CodingAgent]] = {"codex": CodexCLI, "claude-code": ClaudeCode}
TARGETS = ("reuse", "reuse-cache-off", "llama-server")
MODEL = "gemma3-270m"
LLAMA_MODEL_NAME = "gemma-3-270m"  # llama-server serves one model under any name; the agents need one
CACHED_GOAL, SPEEDUP_GOAL = 0.95, 20.0

# The scratch repository each session works in: small enough to list, real enough to ask about
SCRATCH_FILES = {
    "README.md": "# calc\n\nA tiny calculator module.\n",
    "calc.py": 'def add(a, b):\n    """The sum of a and b."""\n    return a + b\n',
}


def emit(**row) -> None:
    print(json.dumps({**row, "load_1m": round(os.getloadavg()[0], 2)}), flush=True)


def scratch_repo(path: Path) -> None:
    path.mkdir(parents=True)
    for name, text in SCRATCH_FILES.items():
        (path / name).write_text(text)
    git = ["git", "-c", "user.name=bench", "-c", "user.email=bench@localhost"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "calc: add"]):
        subprocess.run(git + args, cwd=path, check=True, capture_output=True)


# ---- targets --------------------------------------------------------------------------------------------------

@contextmanager
def llama_server(binary: str, answer_cap: int) -> Iterator[str]:
    """llama.cpp's server on the bundled Gemma GGUF with its defaults (context from the model, its slots,
    cache_prompt on), answers capped at `answer_cap` (-n); yields its base URL."""
    with running_llama_server(binary, bundled_gguf_path(MODEL), ["-n", str(answer_cap)]) as (url, _):
        yield url


@contextmanager
def target(name: str, args) -> Iterator[tuple[str, str, int]]:
    """(base URL, model name for the agents, context window) of a running target."""
    if name == "llama-server":
        with llama_server(args.llama_server, args.answer_cap) as url:
            yield url, LLAMA_MODEL_NAME, 32768
        return
    flags = ["--model", MODEL, "--max-tokens", str(args.answer_cap)]
    with server_process(*flags, *(["--no-prefix-cache"] if name == "reuse-cache-off" else [])) as (url, _):
        (model,) = httpx.get(url + "/v1/models").json()["data"]
        yield url, model["id"], model["max_model_len"]


# ---- sessions -------------------------------------------------------------------------------------------------

def llama_timings(exchange: Exchange) -> dict:
    """llama-server's own count of the prompt it computed and took from its cache (the `timings` it adds)."""
    if exchange.status != 200 or not exchange.streamed:
        return {}
    timings = {}
    for data in sse_payloads(exchange.response_body):
        timings = data.get("timings") or timings
    return {"llama_cache_n": timings["cache_n"], "llama_prompt_n": timings["prompt_n"]} if timings else {}


def request_row(exchange: Exchange) -> dict:
    usage = exchange.usage_in_chat_terms()
    prompt = usage.prompt_tokens if usage else None
    cached = (getattr(usage.prompt_tokens_details, "cached_tokens", 0) or 0) if usage else None
    error = None if exchange.status == 200 else exchange.response_body[:300].decode("utf-8", "replace")
    return dict(path=exchange.path.split("?")[0], status=exchange.status, prompt_tokens=prompt, cached_tokens=cached,
                cached_share=round(cached / prompt, 4) if prompt else None,
                ttft_ms=round(exchange.ttft_s * 1e3, 1) if exchange.ttft_s is not None else None,
                e2e_ms=round(exchange.e2e_s * 1e3, 1) if exchange.e2e_s is not None else None,
                error=error, **llama_timings(exchange))


def outcome(agent: str, run: AgentRun) -> dict:
    """How the invocation ended, as its agent reports it."""
    if agent == "codex":
        failures = [e for e in codex_events(run) if e.get("type") in ("turn.failed", "error")]
        return dict(exit_code=run.returncode, agent_error=json.dumps(failures[0])[:300] if failures else None)
    try:
        result = ClaudeResult.of(run)
    except AgentError:
        return dict(exit_code=run.returncode, agent_error="no JSON result: " + run.stderr[-300:])
    # an answer cut at CLAUDE_CODE_MAX_OUTPUT_TOKENS is an error to Claude Code, not to the server
    return dict(exit_code=run.returncode, agent_error=result.api_error, hit_output_cap=result.hit_output_cap)


def session(agent: str, target_name: str, url: str, model: str, window: int, turns: int, args) -> list[dict]:
    """One `turns`-turn session of `agent` against the target at `url`; returns its request rows."""
    rows = []
    with tempfile.TemporaryDirectory(prefix=f"bench-{agent}-") as tmp, recording_proxy(url) as (proxy_url, proxy):
        root = Path(tmp)
        scratch_repo(root / "work")
        runner = AGENTS[agent].for_server(root / "home", root / "work", proxy_url, model, window, args.answer_cap)
        for turn in range(1, turns + 1):
            base = dict(agent=agent, target=target_name, turn=turn)
            try:
                run = runner.turn(proxy, task(turn - 1), first=turn == 1, timeout=TURN_TIMEOUT_S)
            except AgentError as exc:
                emit(kind="turn", **base, exit_code=None, agent_error=str(exc)[:300])
                continue
            emit(kind="turn", **base, requests=len(run.generations()), **outcome(agent, run))
            for i, exchange in enumerate(run.generations(), 1):
                if args.keep_requests is not None:  # to diff what changed between two requests
                    (args.keep_requests / f"{agent}-{target_name}-t{turn}-r{i}.json").write_bytes(exchange.request_body)
                row = dict(kind="request", **base, request=i, **request_row(exchange))
                emit(**row)
                rows.append(row)
    return rows


def summary(agent: str, target_name: str, rows: list[dict]) -> dict:
    """The session's first request (cold) against every later one: each resends the whole context, whether it
    opens a turn or continues one (Claude Code asks again when an answer reaches its output cap)."""
    ok = [r for r in rows if r["status"] == 200]
    first = ok[:1]
    later = [r for r in ok[1:] if r["ttft_ms"] is not None]
    return dict(agent=agent, target=target_name, requests=len(rows), refused=len(rows) - len(ok),
                first_ttft_ms=first[0]["ttft_ms"] if first else None,
                first_prompt_tokens=first[0]["prompt_tokens"] if first else None,
                later_requests=len(later),
                later_min_cached_share=min((r["cached_share"] for r in later), default=None),
                later_ttft_ms_median=round(statistics.median(r["ttft_ms"] for r in later), 1) if later else None)


def versus_cache_off(agent: str, ours: dict, off: dict) -> dict:
    speedup = (round(off["later_ttft_ms_median"] / ours["later_ttft_ms_median"], 1)
               if ours["later_ttft_ms_median"] and off["later_ttft_ms_median"] else None)
    cached = ours["later_min_cached_share"]
    return dict(agent=agent, later_min_cached_share=cached, later_ttft_speedup=speedup,
                cached_goal_met=cached is not None and cached >= CACHED_GOAL,
                speedup_goal_met=speedup is not None and speedup >= SPEEDUP_GOAL)


# ---- replay ---------------------------------------------------------------------------------------------------

def replay(agent: str, levels: list[int], args) -> None:
    """agent-replay-<agent> at each concurrency level against one fresh server with defaults."""
    workload = f"agent-replay-{agent}"
    with server_process("--model", MODEL, "--max-tokens", str(args.answer_cap)) as (url, _):
        for sessions in levels:
            out = Path(tempfile.mkdtemp(prefix=f"bench-{workload}-{sessions}-"))
            code = cli.main(["run", "--server", url, "--workload", workload, "--out", str(out),
                             "--concurrency", str(sessions), "--sessions", str(sessions), "--turns", str(args.turns),
                             "--seed", str(sessions), "--cache-salt", "none", "--output-tokens", str(args.answer_cap), "--warmup", "0",
                             "--duration", "7200", "--request-timeout", "3600", "--no-plots", "--no-progress"])
            report = out / "report.json"
            if not report.exists():
                emit(kind="replay_total", agent=agent, sessions=sessions, exit_code=code, error="no report")
                continue
            w = json.loads(report.read_text())["workloads"][workload]
            for step in w["by_turn"]:
                emit(kind="replay_step", agent=agent, sessions=sessions, step=step["turn"] + 1,
                     requests=step["requests"], prompt_tokens_mean=round(step["prompt_tokens"] / step["requests"]),
                     reuse_rate=round(step["reuse_rate"], 4), ttft_ms_p50=round(step["ttft_ms_p50"], 1))
            emit(kind="replay_total", agent=agent, sessions=sessions, exit_code=code, requests=w["requests"],
                 errors=w["errors"], error_samples=w["error_samples"], prompt_tokens=w["prompt_tokens"],
                 reuse_rate=round(w["reuse_rate"], 4), ttft_ms_p50=round(w["ttft_ms"]["p50"], 1),
                 ttft_ms_p90=round(w["ttft_ms"]["p90"], 1), duration_s=round(w["duration_s"], 1))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--turns", type=int, default=5, help="user turns per session (and per recorded replay session)")
    ap.add_argument("--cache-off-turns", type=int, default=2,
                    help="turns of the cache-off sessions: each recomputes its whole prompt, which grows by ~1%% a "
                         "turn, so turn 2 stands for every later one (a cold 20k-token prefill is minutes here)")
    ap.add_argument("--agents", default=",".join(AGENTS))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--replay-sessions", default="1,4,8", help="concurrent replayed sessions per level ('' skips)")
    ap.add_argument("--answer-cap", type=int, default=64,
                    help="tokens per answer at most (--max-tokens, llama-server's -n, CLAUDE_CODE_MAX_OUTPUT_TOKENS)")
    ap.add_argument("--llama-server", default=shutil.which("llama-server"), help="llama.cpp's server binary")
    ap.add_argument("--keep-requests", type=Path, metavar="DIR",
                    help="also write every request the agents sent to DIR (outside the checkout: the agents' "
                         "prompts are their owners' text), one JSON file each")
    args = ap.parse_args(argv)
    if args.keep_requests is not None:
        if args.keep_requests.resolve().is_relative_to(REPO):
            ap.error("--keep-requests: inside the checkout; the agents' prompts are not ours to commit")
        args.keep_requests.mkdir(parents=True, exist_ok=True)
    agents = [a for a in args.agents.split(",") if a]
    summaries: dict[tuple[str, str], dict] = {}
    for target_name in [t for t in args.targets.split(",") if t]:
        if target_name == "llama-server" and not (args.llama_server and Path(args.llama_server).exists()):
            emit(kind="skipped", target=target_name, reason="no llama-server binary (--llama-server PATH)")
            continue
        with target(target_name, args) as (url, model, window):
            turns = args.cache_off_turns if target_name == "reuse-cache-off" else args.turns
            for agent in agents:
                rows = session(agent, target_name, url, model, window, turns, args)
                summaries[agent, target_name] = summary(agent, target_name, rows)
                emit(kind="session", **summaries[agent, target_name])
    for agent in agents:
        if (agent, "reuse") in summaries and (agent, "reuse-cache-off") in summaries:
            emit(kind="versus_cache_off",
                 **versus_cache_off(agent, summaries[agent, "reuse"], summaries[agent, "reuse-cache-off"]))
    levels = [int(n) for n in args.replay_sessions.split(",") if n]
    for agent in agents if levels else ():
        replay(agent, levels, args)


if __name__ == "__main__":
    main()
