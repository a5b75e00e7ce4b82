"""Replicas behind a router on the bundled SmolLM2: what each router keeps of one server's reuse, and what
sharing KV through Redis buys.

Part 1 (matrix): `reuse-loadgen run` through the router for each replica count, each router and policy, with
and/or without the Redis tier, on the multi-turn and agent-loop workloads; loadgen scrapes every replica's
/metrics (--replica-metrics) and reports per-replica requests, hit rate and TTFT and their spread. Every cell
starts cold (a new Redis, new replicas, a new router). The routers (--policies; a bare policy is the SGLang
model gateway's):
- `round_robin`, `power_of_two`, `cache_aware`, `random`: the SGLang model gateway (sglang-router, started by
  reuse_server.server.cluster), which routes by the prompt's text (cache_aware) or ignores it;
- `vllm-router:kv_aware` (or another vllm-router policy): vllm-router, routing by the replicas' own KV events;
- `dynamo:kv`: `reuse-server dynamo-worker` replicas behind NVIDIA Dynamo's frontend and KV router
  (reuse_server.server.dynamo_cluster); their hits and requests are read from each worker's Dynamo /metrics,
  which carries the engine's kvreuse_* counters.
One replica (the ceiling: everything cached that can be) runs once per Redis setting, behind the SGLang
gateway with round_robin. loadgen runs with --cache-salt none: the SGLang gateway drops cache_salt anyway, and
the others would pass it on (a salt changes the replicas' block hashes), so every router sees the same requests.

Part 2 (handoff): a conversation whose every turn goes to the other of two replicas right after the previous
answer, the answer fed back as the assistant message. The previous turn's last blocks (its answer) are
written to Redis by a background writer; if the next turn arrives first, it misses them. Each conversation
runs twice, each time in its own cache_salt: "immediate" (the next turn is sent as soon as the answer is
read) and "settled" (sent only once the previous replica's Redis write queue is empty). A turn whose cached
tokens are fewer when immediate lost the race.

    .venv/bin/python -m benchmarks.bench_replicas [--replicas 1,2,3] [--policies round_robin,power_of_two,
        cache_aware,vllm-router:kv_aware,dynamo:kv] [--redis no,yes] [--workloads multi-turn,agent-loop]
        [--requests 48] [--skip-matrix] [--skip-handoff]

One JSON line per run; the tables at the end (Markdown) for BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import openai

from reuse_server.server.cluster import POLICIES, gateway, replica_set
from reuse_server.server.dynamo_cluster import dynamo_cluster
from reuse_server.server.launcher import redis_process

REPO = Path(__file__).resolve().parents[1]
WORDS = ("river stone cloud paper seven orange window garden yellow silver market letter engine harbour "
         "morning winter bridge candle forest music").split()


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def write_queue_bytes(url: str) -> float:
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith('kvreuse_tier_write_queue_bytes{tier="redis"}'):
            return float(line.split()[-1])
    return 0.0


def wait_written(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while write_queue_bytes(url) > 0 and time.monotonic() < deadline:
        time.sleep(0.01)


def user_line(conv: int, turn: int) -> str:
    import random

    rng = random.Random(f"handoff:{conv}:{turn}")
    return " ".join(rng.choice(WORDS) for _ in range(40)) + " What comes next?"


async def conversation(conv: int, turns: int, replicas: list[str], mode: str, output_tokens: int) -> list[dict]:
    clients = [openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=300) for url in replicas]
    messages = [{"role": "system", "content": "You are a helpful assistant."}]
    rows = []
    try:
        for turn in range(turns):
            which = turn % len(replicas)
            if mode == "settled" and turn:
                await asyncio.to_thread(wait_written, replicas[(turn - 1) % len(replicas)])
            messages.append({"role": "user", "content": user_line(conv, turn)})
            r = await clients[which].chat.completions.create(
                model="SmolLM2-135M-Instruct", messages=messages, max_tokens=output_tokens, temperature=0.0,
                extra_body={"ignore_eos": True, "cache_salt": f"handoff-{mode}-{conv}"})
            answer = r.choices[0].message.content
            messages.append({"role": "assistant", "content": answer})
            details = r.usage.prompt_tokens_details
            rows.append(dict(conv=conv, turn=turn, mode=mode, prompt_tokens=r.usage.prompt_tokens,
                             cached_tokens=details.cached_tokens, answer=answer))
    finally:
        for c in clients:
            await c.close()
    return rows


async def handoff_runs(replicas: list[str], conversations: int, turns: int, concurrency: int,
                       output_tokens: int) -> list[dict]:
    gate = asyncio.Semaphore(concurrency)

    async def one(conv: int) -> list[dict]:
        async with gate:
            return (await conversation(conv, turns, replicas, "immediate", output_tokens)
                    + await conversation(conv, turns, replicas, "settled", output_tokens))

    return [row for rows in await asyncio.gather(*(one(c) for c in range(conversations))) for row in rows]


def handoff(args, serve_args: list[str], log_dir: Path) -> dict:
    with ExitStack() as stack:
        redis_url, _ = stack.enter_context(redis_process(maxmemory="2gb"))
        urls = [r.url for r in stack.enter_context(replica_set(2, serve_args, log_dir, redis_url))]
        rows = asyncio.run(handoff_runs(urls, args.handoff_conversations, args.handoff_turns, args.concurrency,
                                        args.output_tokens))
    by_key = {(r["conv"], r["turn"], r["mode"]): r for r in rows}
    compared = lost_turns = lost_tokens = diverged = 0
    for conv in range(args.handoff_conversations):
        for turn in range(1, args.handoff_turns):
            now, settled = by_key[(conv, turn, "immediate")], by_key[(conv, turn, "settled")]
            if by_key[(conv, turn - 1, "immediate")]["answer"] != by_key[(conv, turn - 1, "settled")]["answer"]:
                diverged += 1  # the two runs' prompts differ from here on: not comparable
                break
            compared += 1
            if now["cached_tokens"] < settled["cached_tokens"]:
                lost_turns += 1
                lost_tokens += settled["cached_tokens"] - now["cached_tokens"]
    summary = dict(bench="replicas_handoff", conversations=args.handoff_conversations, turns=args.handoff_turns,
                   concurrency=args.concurrency, turns_compared=compared, turns_that_lost_the_race=lost_turns,
                   tokens_lost=lost_tokens, conversations_diverged=diverged,
                   cached_immediate=sum(r["cached_tokens"] for r in rows if r["mode"] == "immediate" and r["turn"]),
                   cached_settled=sum(r["cached_tokens"] for r in rows if r["mode"] == "settled" and r["turn"]))
    emit(**summary)
    return summary


def loadgen(gateway_url: str, replicas: list[str], workload: str, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "loadgen.cli", "run", "--server", gateway_url, "--workload", workload,
           "--out", str(out), "--requests", str(args.requests), "--concurrency", str(args.concurrency),
           "--output-tokens", str(args.output_tokens), "--max-prompt-tokens", str(args.max_prompt_tokens),
           "--turns", str(args.turns), "--cache-salt", "none", "--no-plots", "--no-progress",
           "--replica-metrics", *replicas]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode not in (0, 1):  # 1: some requests failed; the report says which
        raise RuntimeError(f"loadgen failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads((out / "report.json").read_text())["workloads"][workload]


ROUTERS = ("smg", "vllm-router", "dynamo")
DYNAMO_POLICIES = ("kv",)
MODEL_NAME = "SmolLM2-135M-Instruct"  # what the replicas serve the bundled model as


def parse_router(text: str) -> tuple[str, str]:
    """`policy` (the SGLang model gateway's) or `router:policy` -> (router, policy)."""
    router, _, policy = text.rpartition(":")
    router = router or "smg"
    allowed = DYNAMO_POLICIES if router == "dynamo" else POLICIES.get(router)
    if allowed is None:
        raise ValueError(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
    if policy not in allowed:
        raise ValueError(f"{router} has no policy {policy!r}; choose from {', '.join(allowed)}")
    return router, policy


def bundled_model_folder() -> Path:
    """The folder the engine converts the bundled GGUF into (in the weight dtype `serve` picks for it): Dynamo's
    frontend tokenizes from a model folder."""
    from reuse_server.model.bundled import bundled_gguf_path
    from reuse_server.model.loader import resolve_model
    from reuse_server.model.weight_dtype import choose

    dtype, _ = choose("auto", bundled_gguf_path())
    return resolve_model("smollm2", dtype)


@contextmanager
def routed(router: str, policy: str, count: int, serve_args: list[str], log_dir: Path,
           redis_url: str | None) -> Iterator[tuple[str, list[str]]]:
    """(the URL requests go to, the URLs whose /metrics are each replica's) for `count` replicas behind the
    router."""
    if router == "dynamo":
        redis = ["--redis-url", redis_url] if redis_url else []
        model = ["--model", str(bundled_model_folder()), "--served-model-name", MODEL_NAME]
        with dynamo_cluster(count, [*model, *serve_args, *redis], log_dir) as c:
            yield c.url, c.metrics_urls
        return
    with ExitStack() as stack:
        urls = [r.url for r in stack.enter_context(replica_set(count, serve_args, log_dir, redis_url,
                                                                kv_events=router == "vllm-router"))]
        gateway_url, _ = stack.enter_context(gateway(urls, policy, log_dir, router=router))
        yield gateway_url, urls


def matrix(args, serve_args: list[str], log_dir: Path, out_dir: Path) -> list[dict]:
    """A fresh Redis, replica set and router per cell: the SGLang gateway drops `cache_salt`, so runs through it
    cannot be kept apart by namespace, only by starting cold."""
    rows = []
    for count in args.replicas:
        for redis in args.redis:
            # one replica: the router is moot (the ceiling)
            for router, policy in (args.policies if count > 1 else [("smg", "round_robin")]):
                cell_logs = log_dir / f"r{count}-{router}-{policy}-{'redis' if redis else 'local'}"
                cell_logs.mkdir(parents=True, exist_ok=True)
                with ExitStack() as stack:
                    redis_url = stack.enter_context(redis_process(maxmemory="2gb"))[0] if redis else None
                    entry_url, metric_urls = stack.enter_context(
                        routed(router, policy, count, serve_args, cell_logs, redis_url))
                    for workload in args.workloads:
                        name = f"{workload}-r{count}-{router}-{policy}-{'redis' if redis else 'local'}"
                        w = loadgen(entry_url, metric_urls, workload, args, out_dir / name)
                        spread = w.get("replicas", {}).get("spread", {})
                        per_replica = w.get("replicas", {}).get("per_replica", [])
                        hits = [e.get("prefix_hit_rate") for e in per_replica]
                        # the replicas' own count (their /metrics): hit rates weighted by their prompt tokens
                        weighted = [(e["prefix_hit_rate"], e["prompt_tokens"]) for e in per_replica
                                    if e.get("prefix_hit_rate") is not None and e.get("prompt_tokens")]
                        total = sum(t for _, t in weighted)
                        row = dict(bench="replicas", workload=workload, replicas=count,
                                   router=router if count > 1 else "-", policy=policy if count > 1 else "-",
                                   redis=redis, requests=w["requests"], errors=w["errors"],
                                   prompt_tokens=w["prompt_tokens"], cached_share=w["reuse_rate"],
                                   replica_prompt_tokens=sum(e["prompt_tokens"] or 0 for e in per_replica) or None,
                                   replica_hit_rates=hits or None,
                                   replica_cached_share=sum(h * t for h, t in weighted) / total if total else None,
                                   ttft_p50_ms=w["ttft_ms"]["p50"], ttft_p90_ms=w["ttft_ms"]["p90"],
                                   ttft_p99_ms=w["ttft_ms"]["p99"], output_tok_s=w["output_tokens_per_s"],
                                   requests_per_replica=spread.get("requests"),
                                   request_share_max=spread.get("max_request_share"),
                                   requests_cv=spread.get("requests_cv"))
                        emit(**row)
                        rows.append(row)
    return rows


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def markdown(rows: list[dict]) -> str:
    lines = ["| workload | replicas | router | policy | Redis | prompt tokens cached | busiest replica's share | "
             "requests per replica | TTFT p50 / p99 ms | failed |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ttft = " / ".join("n/a" if v is None else f"{v:.0f}" for v in (r["ttft_p50_ms"], r["ttft_p99_ms"]))
        per = "n/a" if r["requests_per_replica"] is None else " / ".join(str(int(v)) for v in r["requests_per_replica"])
        lines.append(f"| {r['workload']} | {r['replicas']} | {r['router']} | {r['policy']} | "
                     f"{'yes' if r['redis'] else 'no'} | {pct(r['cached_share'])} | {pct(r['request_share_max'])} | "
                     f"{per} | {ttft} | {r['errors']} |")
    return "\n".join(lines)


def redis_settings(text: str) -> list[bool]:
    settings = {"no": False, "yes": True}
    if not text or any(x not in settings for x in text.split(",")):
        raise argparse.ArgumentTypeError(f"{text!r}: give no, yes or no,yes")
    return [settings[x] for x in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3])
    p.add_argument("--policies", type=lambda s: s.split(","), default=["round_robin", "power_of_two", "cache_aware"],
                   help="routers: a policy of the SGLang model gateway (round_robin, power_of_two, cache_aware, "
                        "random), or ROUTER:POLICY: vllm-router:kv_aware (or another vllm-router policy), dynamo:kv")
    p.add_argument("--redis", type=redis_settings, default=[False, True],
                   help="no,yes (default): each cell without and with the Redis tier; no or yes: only that")
    p.add_argument("--workloads", type=lambda s: s.split(","), default=["multi-turn", "agent-loop"])
    p.add_argument("--requests", type=int, default=48, help="requests per workload run")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--turns", type=int, default=6, help="multi-turn and agent-loop: turns per session at most")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per replica (each holds the model too)")
    p.add_argument("--handoff-conversations", type=int, default=8)
    p.add_argument("--handoff-turns", type=int, default=6)
    p.add_argument("--skip-matrix", action="store_true")
    p.add_argument("--skip-handoff", action="store_true")
    p.add_argument("--out", type=Path, default=None, help="loadgen reports (default: a temporary folder)")
    args = p.parse_args(argv)
    try:
        args.policies = [parse_router(x) for x in args.policies]
    except ValueError as exc:
        p.error(str(exc))
    serve_args = ["--kv-cache-memory", args.kv_cache_memory]
    out_dir = args.out or Path(tempfile.mkdtemp(prefix="bench-replicas-"))
    log_dir = out_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    if not args.skip_handoff:
        handoff(args, serve_args, log_dir)
    if not args.skip_matrix:
        rows = matrix(args, serve_args, log_dir, out_dir)
        print(markdown(rows))


if __name__ == "__main__":
    main()
