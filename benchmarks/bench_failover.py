"""Failover and Redis loss on the bundled SmolLM2: what a client sees when a replica dies behind the gateway, and
the Redis tier's hit rate, slice by slice, when Redis loses what it held.

Part 1 (failover): Redis, N replicas sharing it (`replica_set`) and the SGLang model gateway in front
(`gateway`, round_robin, with the retries, health checks and circuit breaker `reuse-server cluster` sets:
reuse_server/server/cluster.py). Six conversations of six turns run side by side, in step (every conversation
ends a turn before any starts the next), each request streamed. One replica is SIGKILLed:
- `between`: after the third turn, while nothing is in flight;
- `mid-stream`: during the fourth turn, once it has streamed a first token (its streams are in flight).
A request that fails is counted as lost and sent again by the client (once more at most), so the conversation
goes on. Reported: requests lost; the share of prompt tokens served from cache before the kill and after it (on
the survivors; every later turn's earlier conversation was computed on some replica and written to Redis); the
turns after the kill that found the whole previous prompt cached; and, read from the gateway while it runs
(its /workers and its Prometheus listener, every 50 ms): the last time after the kill that it sent a request to
the dead replica (a failed attempt it then retried elsewhere, smg_worker_cb_outcomes_total), when its circuit
breaker opened for it (three failed requests), and when its health checks marked it unhealthy.

Part 2 (redis-loss): one server with the Redis tier and a device pool too small for the working set (twelve
shared prefixes of ~450 tokens, drawn at random; the pool holds about three), so hits come mostly from Redis.
A steady stream of requests (each prefix plus a question of its own); after --loss-before seconds Redis loses
its blocks, one way per run:
- `flushall`: FLUSHALL;
- `restart`: redis-server SIGKILLed and, a second later, started again empty on the same port;
- `lru`: maxmemory set to half of what Redis holds, allkeys-lru evicting (it stays at that bound).
Reported per --slice seconds (by request start, relative to the loss): requests, errors, the share of prompt
tokens served from Redis and from the device pool; and the server's own Redis error counter.

    .venv/bin/python -m benchmarks.bench_failover [--replicas 2,3] [--kills between,mid-stream]
        [--faults flushall,restart,lru] [--loss-before 20] [--loss-after 40] [--skip-failover] [--skip-redis-loss]

One JSON line per run (and per time slice); Markdown tables at the end, on stderr.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import openai
import redis

from loadgen.metrics_scrape import parse_counters
from reuse_server.server.cluster import gateway, replica_set
from reuse_server.server.launcher import free_port, redis_process, served

MODEL = "SmolLM2-135M-Instruct"  # what the bundled model is served as
BS = 16  # the server's default block size
WORDS = ("river stone cloud paper seven orange window garden yellow silver market letter engine harbour "
         "morning winter bridge candle forest music table travel summer number planet shadow street bottle "
         "village kitchen doctor animal").split()
TIER_COUNTERS = {"redis_errors": ("kvreuse_tier_errors_total", {"tier": "redis"}),
                 "redis_hits": ("kvreuse_tier_hits_total", {"tier": "redis"}),
                 "redis_written": ("kvreuse_tier_written_blocks_total", {"tier": "redis"}),
                 "running": "kvreuse_requests_running",
                 "first_tokens": "kvreuse_time_to_first_token_seconds_count"}


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def counters(url: str, spec: dict = TIER_COUNTERS) -> dict[str, float]:
    try:
        return parse_counters(httpx.get(url + "/metrics", timeout=5).text, spec)
    except httpx.HTTPError:
        return {}


def text(seed: str, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def ask(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> dict:
    """One streamed chat; its answer, usage and timings (or the error it ended with)."""
    start = time.monotonic()
    row = dict(start=start, error=None, ttft_s=None, answer="", prompt_tokens=0, cached_tokens=0, redis_tokens=0)
    try:
        stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens,
                                                temperature=0.0, stream=True, stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                if row["ttft_s"] is None:
                    row["ttft_s"] = time.monotonic() - start
                parts.append(chunk.choices[0].delta.content)
            if chunk.usage is not None:
                usage = chunk.usage
        if usage is None or usage.completion_tokens != max_tokens:
            raise RuntimeError(f"the stream ended early (usage {usage})")
        details = usage.prompt_tokens_details
        tiers = getattr(details, "tier_tokens", None) or {}
        row.update(answer="".join(parts), prompt_tokens=usage.prompt_tokens, cached_tokens=details.cached_tokens,
                   redis_tokens=int(tiers.get("redis", 0)))
    except Exception as exc:  # what a client sees of a failure: counted, never raised
        row["error"] = f"{type(exc).__name__}: {str(exc)[:120]}"
    row["end"] = time.monotonic()
    return row


# -- part 1: failover --------------------------------------------------------------------------------------

class GatewayWatch(threading.Thread):
    """Polls the gateway every `period` s from the kill on: the dead worker's failed requests (each one a
    request the gateway sent it and then retried), its circuit breaker's consecutive failures, its health."""

    def __init__(self, url: str, metrics_url: str, dead: str, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.url, self.metrics_url, self.dead, self.period = url, metrics_url, dead, period
        self.stop = threading.Event()
        self.killed_at: float | None = None
        self.failures_at: list[tuple[float, float]] = []  # (seconds after the kill, failed requests so far)
        self.retries = 0.0
        self.circuit_open_s: float | None = None
        self.unhealthy_s: float | None = None
        self.spec = {"failures": ("smg_worker_cb_outcomes_total", {"worker": dead, "outcome": "failure"}),
                     "consecutive": ("smg_worker_cb_consecutive_failures", {"worker": dead}),
                     "retries": "smg_worker_retries_total"}
        self.base = self.read()

    def read(self) -> dict[str, float]:
        try:
            return parse_counters(httpx.get(self.metrics_url, timeout=2).text, self.spec)
        except httpx.HTTPError:
            return {}

    def run(self) -> None:
        last = self.base.get("failures", 0.0)
        while not self.stop.is_set():
            now = time.monotonic() - self.killed_at
            m = self.read()
            if m.get("failures", 0.0) != last:
                last = m.get("failures", 0.0)
                self.failures_at.append((round(now, 3), last - self.base.get("failures", 0.0)))
            if self.circuit_open_s is None and m.get("consecutive", 0.0) >= 3:  # --cb-failure-threshold 3
                self.circuit_open_s = now
            self.retries = m.get("retries", 0.0) - self.base.get("retries", 0.0)
            if self.unhealthy_s is None:
                try:
                    workers = httpx.get(self.url + "/workers", timeout=2).json()["workers"]
                    if not any(w["url"] == self.dead and w["is_healthy"] for w in workers):
                        self.unhealthy_s = now
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
            time.sleep(self.period)


def failover(count: int, kill: str, args, log_dir: Path) -> dict:
    serve_args = ["--kv-cache-memory", args.kv_cache_memory]
    with ExitStack() as stack:
        redis_url, _ = stack.enter_context(redis_process(maxmemory="2gb"))
        replicas = stack.enter_context(replica_set(count, serve_args, log_dir, redis_url))
        url, proc = stack.enter_context(gateway([r.url for r in replicas], "round_robin", log_dir))
        metrics_port = proc.args[proc.args.index("--prometheus-port") + 1]
        victim = replicas[1]
        watch = GatewayWatch(url, f"http://127.0.0.1:{metrics_port}/metrics", victim.url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        n, turns, kill_turn = args.conversations, args.turns, args.kill_turn
        rows: list[dict] = []
        lock = threading.Lock()

        def do_kill() -> None:
            victim.process.kill()
            watch.killed_at = time.monotonic()
            watch.start()
            victim.process.wait()

        def kill_mid_stream(first_tokens: float) -> None:
            """Once the victim has sent a first token in this turn, while its streams are still going."""
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                m = counters(victim.url)
                if m.get("first_tokens", 0) > first_tokens and m.get("running", 0) > 0:
                    break
                time.sleep(0.02)
            do_kill()

        def before_turn() -> None:  # the barrier's action: run by one thread once every conversation is there
            turn = before_turn.turn
            if turn == kill_turn:
                if kill == "between":
                    do_kill()
                else:
                    threading.Thread(target=kill_mid_stream, args=(counters(victim.url).get("first_tokens", 0),),
                                     daemon=True).start()
            before_turn.turn += 1
        before_turn.turn = 0
        barrier = threading.Barrier(n, action=before_turn)

        def conversation(c: int) -> None:
            messages = [{"role": "system", "content": f"You are assistant number {c}. " + text(f"sys{c}", 60)}]
            previous = None
            for turn in range(turns):
                barrier.wait()
                messages.append({"role": "user", "content": f"Conversation {c}, question {turn}: "
                                                            + text(f"q{c}.{turn}", 40) + " What comes next?"})
                for attempt in range(3):  # a lost request is sent again by the client
                    r = ask(client, messages, args.output_tokens)
                    r.update(conv=c, turn=turn, attempt=attempt, previous_prompt=previous)
                    with lock:
                        rows.append(r)
                    if r["error"] is None:
                        break
                previous = r["prompt_tokens"] or previous
                messages.append({"role": "assistant", "content": r["answer"] or "I do not know."})

        threads = [threading.Thread(target=conversation, args=(c,)) for c in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        time.sleep(max(0.0, 8 - (time.monotonic() - watch.killed_at)))  # let the health checks finish
        watch.stop.set()
        watch.join()
        survivors_requests = [counters(r.url, {"n": "kvreuse_requests_total"}).get("n", 0)
                              for r in replicas if r is not victim]

    kill_t = watch.killed_at
    ok = [r for r in rows if r["error"] is None]
    lost = [r for r in rows if r["error"] is not None]
    before = [r for r in ok if 0 < r["turn"] < kill_turn]
    after = [r for r in ok if r["turn"] >= kill_turn]

    def share(rs, key="cached_tokens"):
        prompt = sum(r["prompt_tokens"] for r in rs)
        return round(sum(r[key] for r in rs) / prompt, 4) if prompt else None

    whole = [r for r in after if r["cached_tokens"] >= (r["previous_prompt"] or 0) // BS * BS]
    summary = dict(
        bench="failover", replicas=count, kill=kill, conversations=n, turns=turns, kill_turn=kill_turn,
        requests=len(rows), lost=len(lost), lost_errors=sorted({r["error"] for r in lost}),
        lost_after_kill_s=[round(r["end"] - kill_t, 3) for r in lost],
        cached_share_before=share(before), cached_share_after=share(after),
        redis_share_before=share(before, "redis_tokens"), redis_share_after=share(after, "redis_tokens"),
        turns_after=len(after), turns_after_whole_history_cached=len(whole),
        dead_replica_requests_after_kill=watch.failures_at[-1][1] if watch.failures_at else 0,
        last_request_to_dead_s=watch.failures_at[-1][0] if watch.failures_at else None,
        circuit_open_s=None if watch.circuit_open_s is None else round(watch.circuit_open_s, 3),
        unhealthy_s=None if watch.unhealthy_s is None else round(watch.unhealthy_s, 3),
        gateway_retries=watch.retries, survivors_requests=survivors_requests,
        ttft_p50_before_s=median([r["ttft_s"] for r in before]), ttft_p50_after_s=median([r["ttft_s"] for r in after]),
        ttft_max_after_s=max((r["ttft_s"] for r in after if r["ttft_s"] is not None), default=None))
    emit(**summary)
    return summary


def median(xs):
    xs = sorted(x for x in xs if x is not None)
    return round(xs[len(xs) // 2], 3) if xs else None


# -- part 2: Redis losing its blocks -----------------------------------------------------------------------

class RedisHandle:
    """A redis-server on a fixed port that can be killed and started again empty on it."""

    def __init__(self, port: int, maxmemory: str) -> None:
        self.port, self.maxmemory = port, maxmemory
        self.stack = ExitStack()
        self.url, _ = self.stack.enter_context(redis_process(port=port, maxmemory=maxmemory))

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def restart(self, down_s: float) -> None:
        self.stack.close()  # SIGKILL
        time.sleep(down_s)
        self.stack = ExitStack()
        self.stack.enter_context(redis_process(port=self.port, maxmemory=self.maxmemory))

    def close(self) -> None:
        self.stack.close()


def redis_loss(fault: str, args, log_dir: Path) -> dict:
    handle = RedisHandle(free_port(), "2gb")
    prefixes = [f"You are assistant {p}. Background: " + text(f"prefix{p}", args.prefix_words)
                for p in range(args.prefixes)]
    try:
        serve = ["--kv-cache-memory", args.loss_pool, "--redis-url", handle.url]
        with served(serve, log_dir / f"redis-loss-{fault}.log", new_session=True) as (url, _):
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)

            def request(p: int, i: int) -> dict:
                return ask(client, [{"role": "system", "content": prefixes[p]},
                                    {"role": "user", "content": f"Question {i}: " + text(f"u{i}", 12)}],
                           args.loss_output_tokens)

            for p in range(args.prefixes):  # every prefix computed once and written to Redis
                request(p, -1 - p)
            wait_written(url)
            base = counters(url)
            rows: list[dict] = []
            lock = threading.Lock()
            stop = threading.Event()
            counter = iter(range(10 ** 9))
            rng = random.Random(args.seed)

            def worker() -> None:
                while not stop.is_set():
                    with lock:
                        i, p = next(counter), rng.randrange(args.prefixes)
                    r = request(p, i)
                    r["prefix"] = p
                    with lock:
                        rows.append(r)

            threads = [threading.Thread(target=worker) for _ in range(args.loss_concurrency)]
            start = time.monotonic()
            for t in threads:
                t.start()
            time.sleep(args.loss_before)
            fault_t = time.monotonic()
            info = {}
            if fault == "flushall":
                handle.client().flushall()
            elif fault == "restart":
                handle.restart(args.restart_down)
            else:
                c = handle.client()
                used = c.info("memory")["used_memory"]
                c.config_set("maxmemory-policy", "allkeys-lru")
                c.config_set("maxmemory", used // 2)
                info = dict(used_memory_before_mb=round(used / 2 ** 20, 1), maxmemory_mb=round(used / 2 ** 21, 1))
            time.sleep(max(0.0, fault_t + args.loss_after - time.monotonic()))
            stop.set()
            for t in threads:
                t.join()
            end = counters(url)
            if fault == "lru":
                info["evicted_keys"] = handle.client().info("stats")["evicted_keys"]
    finally:
        handle.close()

    slices = []
    for k in range(-int(args.loss_before // args.slice), int(args.loss_after // args.slice)):
        rs = [r for r in rows if k * args.slice <= r["start"] - fault_t < (k + 1) * args.slice]
        if not rs:
            continue
        ok = [r for r in rs if r["error"] is None]
        prompt = sum(r["prompt_tokens"] for r in ok)
        redis_t = sum(r["redis_tokens"] for r in ok)
        cached = sum(r["cached_tokens"] for r in ok)
        row = dict(bench="redis_loss_slice", fault=fault, t_from_s=k * args.slice, t_to_s=(k + 1) * args.slice,
                   requests=len(rs), errors=len(rs) - len(ok), prompt_tokens=prompt,
                   redis_share=round(redis_t / prompt, 4) if prompt else None,
                   device_share=round((cached - redis_t) / prompt, 4) if prompt else None)
        emit(**row)
        slices.append(row)
    summary = dict(bench="redis_loss", fault=fault, requests=len(rows),
                   errors=sum(r["error"] is not None for r in rows),
                   error_kinds=sorted({r["error"] for r in rows if r["error"]}),
                   seconds=round(time.monotonic() - start, 1),
                   server_redis_errors=end.get("redis_errors", 0) - base.get("redis_errors", 0),
                   prefixes=args.prefixes, prefix_words=args.prefix_words, pool=args.loss_pool,
                   concurrency=args.loss_concurrency, prompt_tokens_mean=round(
                       sum(r["prompt_tokens"] for r in rows) / max(1, sum(r["error"] is None for r in rows)), 1),
                   **info, slices=slices)
    emit(**{k: v for k, v in summary.items() if k != "slices"})
    return summary


def wait_written(url: str, timeout: float = 60.0) -> None:
    spec = {"queue": ("kvreuse_tier_write_queue_bytes", {"tier": "redis"})}
    deadline = time.monotonic() + timeout
    while counters(url, spec).get("queue", 0) > 0 and time.monotonic() < deadline:
        time.sleep(0.05)


# -- tables ------------------------------------------------------------------------------------------------

def pct(x) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def secs(x) -> str:
    return "-" if x is None else f"{x:.2f} s"


def failover_table(rows: list[dict]) -> str:
    lines = ["| replicas | kill | requests | lost | cached before / after the kill | from Redis after | "
             "later turns with the whole history cached | requests sent to the dead replica (retried) | "
             "last one after | circuit open | marked unhealthy |",
             "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['replicas']} | {r['kill']} | {r['requests']} | {r['lost']} | "
                     f"{pct(r['cached_share_before'])} / {pct(r['cached_share_after'])} | "
                     f"{pct(r['redis_share_after'])} | {r['turns_after_whole_history_cached']} of {r['turns_after']} | "
                     f"{r['dead_replica_requests_after_kill']:.0f} | {secs(r['last_request_to_dead_s'])} | "
                     f"{secs(r['circuit_open_s'])} | {secs(r['unhealthy_s'])} |")
    return "\n".join(lines)


def loss_table(rows: list[dict]) -> str:
    faults = [r["fault"] for r in rows]
    by = {r["fault"]: {(s["t_from_s"], s["t_to_s"]): s for s in r["slices"]} for r in rows}
    keys = sorted({k for r in rows for k in by[r["fault"]]})
    lines = ["| seconds after the loss | " + " | ".join(f"{f}: from Redis (device) / requests" for f in faults) + " |",
             "| ---: | " + " | ".join("---:" for _ in faults) + " |"]
    for k in keys:
        cells = []
        for f in faults:
            s = by[f].get(k)
            cells.append("-" if s is None else f"{pct(s['redis_share'])} ({pct(s['device_share'])}) / "
                                               f"{s['requests']}" + (f", {s['errors']} errors" if s["errors"] else ""))
        lines.append(f"| {k[0]:+g} to {k[1]:+g} | " + " | ".join(cells) + " |")
    lines.append("| errors (HTTP) / server's Redis errors | " + " | ".join(
        f"{r['errors']} / {r['server_redis_errors']:.0f}" for r in rows) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--replicas", type=lambda s: [int(x) for x in s.split(",")], default=[2, 3])
    p.add_argument("--kills", type=lambda s: s.split(","), default=["between", "mid-stream"])
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--kill-turn", type=int, default=3, help="the first turn after (between) or during the kill")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--kv-cache-memory", default="256MiB", help="per replica")
    p.add_argument("--faults", type=lambda s: s.split(","), default=["flushall", "restart", "lru"])
    p.add_argument("--loss-before", type=float, default=20.0, help="seconds of requests before the loss")
    p.add_argument("--loss-after", type=float, default=40.0, help="seconds of requests after it")
    p.add_argument("--slice", type=float, default=5.0)
    p.add_argument("--restart-down", type=float, default=1.0, help="seconds Redis is down in `restart`")
    p.add_argument("--prefixes", type=int, default=12)
    p.add_argument("--prefix-words", type=int, default=400)
    p.add_argument("--loss-pool", default="48MiB", help="the server's device pool in part 2 (a few prefixes)")
    p.add_argument("--loss-concurrency", type=int, default=2)
    p.add_argument("--loss-output-tokens", type=int, default=4)
    p.add_argument("--seed", type=int, default=20261202)
    p.add_argument("--skip-failover", action="store_true")
    p.add_argument("--skip-redis-loss", action="store_true")
    p.add_argument("--log-dir", type=Path, default=None)
    args = p.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-failover-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"logs in {log_dir}", file=sys.stderr)
    fo, rl = [], []
    if not args.skip_failover:
        for count in args.replicas:
            for kill in args.kills:
                cell = log_dir / f"r{count}-{kill}"
                cell.mkdir(exist_ok=True)
                fo.append(failover(count, kill, args, cell))
    if not args.skip_redis_loss:
        for fault in args.faults:
            rl.append(redis_loss(fault, args, log_dir))
    if fo:
        print(failover_table(fo), file=sys.stderr)
    if rl:
        print(loss_table(rl), file=sys.stderr)


if __name__ == "__main__":
    main()
