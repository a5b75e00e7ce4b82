"""`reuse-server cluster`: the whole multi-replica topology on one machine, with one command.

A local Redis (unless --redis-url names one), N replicas of `reuse-server serve` sharing KV through it (each
on a free loopback port, same flags), and the SGLang model gateway (`sglang-router`, a Rust load balancer)
in front of them. Each piece is a subprocess in its own session, so the terminal's Ctrl+C reaches only this
process, which then stops them in order: the gateway first (no new requests reach the replicas), then the
replicas (SIGTERM: each drains what it still runs), then Redis. The same three pieces are what one deploys
on several machines (docs/operations.md, "Several replicas behind a gateway").

The gateway flags set here (each can be overridden with --gateway-arg):
- --worker-startup-check-interval 1: in sglang-router 0.3.x this interval is also the period of the load
  monitor that polls each worker's GET /get_load for the power-of-two policy (30 s by default: the loads
  it compares would be half a minute old);
- --retry-max-retries 5 --retry-initial-backoff-ms 50 --retry-max-backoff-ms 1000: a request that fails
  with 408/429/5xx or a refused connection (a dead, draining or stalled replica) is sent again, to a worker
  chosen again, up to 5 times within about 2 s (the gateway's own backoff grows towards 30 s);
- --health-check-interval-secs 2 --health-check-timeout-secs 2 --health-failure-threshold 2 and
  --cb-failure-threshold 3: a dead replica, or one whose /health answers 503 (draining, a stalled engine),
  leaves the rotation within seconds (two failed probes, or three failed requests), and one that answers ok
  again (a stall that ended) comes back after two good probes (--health-success-threshold, its default);
- --prometheus-host 127.0.0.1 --prometheus-port (a free port): the gateway's own metrics listener, which
  otherwise takes 0.0.0.0:29000 and so fails the second gateway on a machine.

`--router vllm-router` runs vllm-router 0.1.17 instead (the same health and retry flags), by default with its
`kv_aware` policy, which routes by the replicas' own KV events: each replica publishes them (`--kv-events`,
`--kv-events-replay` on a free loopback port each) and the router is told, from each replica's /server_info,
`--kv-event-source URL=ENDPOINT`, `--kv-event-replay-source URL=ENDPOINT`, `--kv-event-block-size` (ours:
the router hashes the token ids itself) and `--kv-event-model`. It tokenizes each request through the
replicas' render endpoints (api/render.py).

Under vllm-router's `kv_aware` the cluster also turns on the router's session affinity
(`--kv-aware-session-affinity-ttl-secs`, --session-affinity-ttl here): a request that names its session is
sent where that session's earlier turns went, until the session has been idle that long. vllm-router 0.1.17
reads the session from the `session-id` header (Codex CLI sends it, equal to its `prompt_cache_key`),
`x-claude-code-session-id` (Claude Code), `x-session-id`, or a top-level `session_id` body field; it does not
read `prompt_cache_key` itself. A session's first request, and every request that names none, is routed by
the KV events as before (the least loaded replica where no replica holds the prompt, or where the router
cannot tokenize it: /v1/responses and /v1/messages). smg's own session routing (`--policy manual`) reads
only an `x-smg-routing-key` header, which neither agent sends, and smg 0.3.2 has no /v1/messages route."""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from reuse_server.server.args import non_negative_int, positive_int
from reuse_server.server.launcher import ServerStartError, free_port, own_session, redis_process, served
from reuse_server.server.replica_sizing import divided

ROUTERS = ("smg", "vllm-router")
POLICIES = {"smg": ("round_robin", "power_of_two", "cache_aware", "random"),
            "vllm-router": ("kv_aware", "round_robin", "power_of_two", "cache_aware", "random")}
DEFAULT_POLICY = {"smg": "power_of_two", "vllm-router": "kv_aware"}
ROUTER_MODULES = {"smg": "sglang_router.launch_router", "vllm-router": "vllm_router.launch_router"}
_HEALTH_FLAGS = ["--worker-startup-check-interval", "1", "--health-check-interval-secs", "2",
                 "--cb-failure-threshold", "3"]
# the gateway retries a request a dead replica dropped and takes the replica out after two failed checks
# (tests/server/test_replicas.py and test_kv_routing.py kill one mid-run); both routers take the same flags
_FAILOVER = ["--retry-max-retries", "5", "--retry-initial-backoff-ms", "50", "--retry-max-backoff-ms", "1000",
             "--health-check-timeout-secs", "2", "--health-failure-threshold", "2"]
GATEWAY_DEFAULTS = {"smg": [*_HEALTH_FLAGS, *_FAILOVER, "--log-level", "warn"],
                    "vllm-router": [*_HEALTH_FLAGS, *_FAILOVER, "--log-level", "warning"]}
# flags the cluster sets on every replica itself
OWNED_SERVE_FLAGS = ("--port", "--host", "--redis-url", "--kv-events", "--kv-events-replay")
STOP_SECONDS = 60.0
# how long vllm-router keeps a session on its replica after the session's last request: an hour, the longest
# prompt-cache lifetime the agents' own providers offer (Anthropic's 1 h cache TTL), so a user who pauses
# comes back to the replica that has the conversation (if it still holds it; Redis has it otherwise)
SESSION_AFFINITY_TTL = 3600
MAX_SESSION_AFFINITY_TTL = 31_536_000


@dataclass(frozen=True)
class Replica:
    url: str
    process: subprocess.Popen


@dataclass(frozen=True)
class ClusterUrls:
    gateway: str
    replicas: list[str]
    redis: str
    gateway_process: subprocess.Popen


def owned_flag(serve_args: list[str]) -> str | None:
    """The first serve flag the cluster sets itself, if the user passed one."""
    for arg in serve_args:
        name = arg.split("=", 1)[0]
        if name in OWNED_SERVE_FLAGS:
            return name
    return None


@contextmanager
def replica_set(count: int, serve_args: list[str], log_dir: Path, redis_url: str | None = None,
                startup_timeout: float = 300.0, kv_events: bool = False) -> Iterator[list[Replica]]:
    """`count` servers with the same flags (and --redis-url), each on a free loopback port; yields them once
    each answers /health. kv_events: each publishes its KV events too (on free loopback ports). On the way
    out each gets SIGTERM and drains. Flags that size no pool get an equal part of the machine each
    (replica_sizing.py), printed."""
    serve_args, part = divided(serve_args, count)
    if part:
        print(f"KV cache: {part}", flush=True)
    extra = ["--redis-url", redis_url] if redis_url else []
    with ExitStack() as stack:
        replicas = []
        for i in range(count):
            events = []
            if kv_events:
                events = ["--kv-events", f"tcp://127.0.0.1:{free_port()}",
                          "--kv-events-replay", f"tcp://127.0.0.1:{free_port()}"]
            url, proc = stack.enter_context(served([*serve_args, *extra, *events], Path(log_dir) / f"replica-{i}.log",
                                                   startup_timeout=startup_timeout, new_session=True))
            replicas.append(Replica(url, proc))
        yield replicas


@contextmanager
def gateway(worker_urls: list[str], policy: str, log_dir: Path, host: str = "127.0.0.1", port: int | None = None,
            extra_args: list[str] = (), startup_timeout: float = 60.0, router: str = "smg",
            session_ttl: int = SESSION_AFFINITY_TTL) -> Iterator[tuple[str, subprocess.Popen]]:
    """The router (`smg`: the SGLang model gateway; `vllm-router`) in front of `worker_urls`; yields (its URL,
    process) once it lists every worker as healthy. Stopped with SIGTERM on the way out. session_ttl: under
    vllm-router's kv_aware, seconds a session stays on its replica after its last request (0: no affinity)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", ROUTER_MODULES[router], "--worker-urls", *worker_urls, "--policy", policy,
           "--host", host, "--port", str(port), *GATEWAY_DEFAULTS[router],
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if pins_sessions(router, policy):
        cmd += kv_event_flags(worker_urls)
        if session_ttl:
            cmd += ["--kv-aware-session-affinity-ttl-secs", str(session_ttl)]
    cmd += extra_args
    log_path = Path(log_dir) / "gateway.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=own_session)
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{port}"
    try:
        wait_for_workers(url, proc, len(worker_urls), startup_timeout, log_path)
        yield url, proc
    finally:
        stop(proc)


def pins_sessions(router: str, policy: str) -> bool:
    """Whether this router and policy can keep a session on one replica by the session id the agents send
    (vllm-router's kv_aware, which also routes by the replicas' KV events)."""
    return router == "vllm-router" and policy == "kv_aware"


def kv_event_flags(worker_urls: list[str]) -> list[str]:
    """vllm-router's flags for routing by the workers' KV events, from what each says at /server_info."""
    # imported here, not at the top: `reuse-server serve` imports this module for its flags, and httpx
    # brings rich, click and pygments (its command line) with it
    import httpx

    flags, block_sizes, models = [], set(), set()
    for url in worker_urls:
        info = httpx.get(url + "/server_info", timeout=10).json()
        events = info.get("kv_events")
        if not events:
            raise ServerStartError(f"{url} publishes no KV events (start it with --kv-events tcp://HOST:PORT)")
        flags += ["--kv-event-source", f"{url}={events['endpoint']}"]
        if events.get("replay_endpoint"):
            flags += ["--kv-event-replay-source", f"{url}={events['replay_endpoint']}"]
        block_sizes.add(events["block_size"])
        models.add(info["served_model_name"])
    if len(block_sizes) != 1 or len(models) != 1:
        raise ServerStartError(f"the replicas differ in block size {sorted(block_sizes)} or model {sorted(models)}")
    return [*flags, "--kv-event-block-size", str(block_sizes.pop()), "--kv-event-model", models.pop()]


def wait_for_workers(url: str, proc: subprocess.Popen, count: int, timeout: float, log_path: Path) -> None:
    import httpx  # here, not at the top: see kv_event_flags

    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise ServerStartError(f"the gateway exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            workers = httpx.get(url + "/workers", timeout=2).json().get("workers", [])
            if sum(1 for w in workers if w.get("is_healthy")) >= count:
                return
        except (httpx.TransportError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise ServerStartError(f"the gateway did not list {count} healthy workers in {timeout:g} s:\n"
                                   f"{log_path.read_text()[-3000:]}")
        time.sleep(0.2)


def stop(proc: subprocess.Popen, timeout: float = STOP_SECONDS) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def cluster(replicas: int, policy: str, serve_args: list[str], log_dir: Path, redis_url: str | None = None,
            host: str = "127.0.0.1", port: int | None = None, gateway_args: list[str] = (),
            redis_maxmemory: str = "1gb", router: str = "smg",
            session_ttl: int = SESSION_AFFINITY_TTL) -> Iterator[ClusterUrls]:
    """Redis (a local one unless redis_url), the replicas, the gateway; stopped in the reverse order."""
    with ExitStack() as stack:
        if redis_url is None:
            redis_url, _ = stack.enter_context(redis_process(maxmemory=redis_maxmemory, new_session=True))
        events = pins_sessions(router, policy)  # kv_aware reads the replicas' KV events
        urls = [r.url for r in stack.enter_context(replica_set(replicas, serve_args, log_dir, redis_url,
                                                                kv_events=events))]
        gateway_url, proc = stack.enter_context(gateway(urls, policy, log_dir, host, port, list(gateway_args),
                                                        router=router, session_ttl=session_ttl))
        yield ClusterUrls(gateway=gateway_url, replicas=urls, redis=redis_url, gateway_process=proc)


def add_parser(commands, formatter_class) -> None:
    p = commands.add_parser(
        "cluster", help="run N replicas sharing KV through Redis behind the SGLang model gateway, on this machine",
        formatter_class=formatter_class,
        description="Start a local Redis (unless --redis-url), N `reuse-server serve` replicas sharing KV through "
                    "it, and the SGLang model gateway in front; print the gateway's URL; on Ctrl+C or SIGTERM stop "
                    "the gateway, then the replicas (they drain), then Redis. Flags after `--` go to every replica, "
                    "e.g. `reuse-server cluster --replicas 2 -- --kv-cache-memory 512MiB`.")
    p.add_argument("--replicas", type=positive_int, default=2, help="servers behind the gateway")
    p.add_argument("--router", choices=ROUTERS, default="smg",
                   help="smg: the SGLang model gateway; vllm-router: vLLM's router, whose kv_aware policy routes by "
                        "the replicas' KV events")
    p.add_argument("--policy", choices=sorted(set(POLICIES["smg"]) | set(POLICIES["vllm-router"])), default=None,
                   help="the router's load balancing: power_of_two (the less loaded of two, by the tokens each "
                        "replica reports at /get_load; smg's default), round_robin, cache_aware (prompt-prefix "
                        "affinity), random, kv_aware (vllm-router only, its default: where the replicas' KV "
                        "events say the prompt is cached)")
    p.add_argument("--session-affinity-ttl", type=non_negative_int, default=None, metavar="SECONDS",
                   help="vllm-router's kv_aware only: a request naming its session (the session-id header of "
                        "Codex CLI, x-claude-code-session-id of Claude Code, x-session-id, or a session_id body "
                        "field) goes to the replica of the session's earlier turns until the session has been "
                        f"idle this long (default {SESSION_AFFINITY_TTL}; 0: route every request by KV events)")
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument("--port", type=positive_int, default=8000, help="port the gateway listens on")
    p.add_argument("--redis-url", default=None, metavar="URL",
                   help="an existing Redis or Valkey for the shared KV tier (default: start a local redis-server)")
    p.add_argument("--redis-maxmemory", default="1gb", metavar="SIZE",
                   help="memory bound of the local Redis (LRU beyond it)")
    p.add_argument("--log-dir", type=Path, default=None, metavar="DIR",
                   help="where each process's log goes (default: a new temporary folder, printed)")
    p.add_argument("--gateway-arg", dest="gateway_args", action="append", default=[], metavar="ARG",
                   help="one more argument for the gateway (repeatable), e.g. --gateway-arg=--api-key=KEY")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, metavar="-- SERVE_ARGS",
                   help="flags for every replica (reuse-server serve --help)")
    p.set_defaults(command_parser=p)


class _Stop(Exception):
    pass


def _raise_stop(signum, frame) -> None:
    # once: a second signal while everything stops must not cut the stopping short (each stop is bounded)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise _Stop()


def run(args: argparse.Namespace) -> int:
    serve_args = list(args.serve_args)
    if serve_args[:1] == ["--"]:
        serve_args = serve_args[1:]
    flag = owned_flag(serve_args)
    if flag:
        args.command_parser.error(f"{flag} is set by the cluster for each replica; use the cluster's own flags")
    args.policy = args.policy or DEFAULT_POLICY[args.router]
    if args.policy not in POLICIES[args.router]:
        args.command_parser.error(f"--policy {args.policy} is not one of {args.router}'s: "
                                  f"{', '.join(POLICIES[args.router])}")
    if args.session_affinity_ttl is not None and not pins_sessions(args.router, args.policy):
        args.command_parser.error("--session-affinity-ttl is for --router vllm-router with its kv_aware policy (the "
                                  "only router and policy here that read the session id the agents send)")
    if (args.session_affinity_ttl or 0) > MAX_SESSION_AFFINITY_TTL:
        args.command_parser.error(f"--session-affinity-ttl is at most {MAX_SESSION_AFFINITY_TTL} (a year: "
                                  "vllm-router's bound)")
    if args.policy == "power_of_two" and args.replicas < 2:
        args.command_parser.error("--policy power_of_two needs at least 2 replicas (the gateway refuses fewer); "
                                  "use --policy round_robin for one")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="reuse-cluster-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _raise_stop)
    print(f"reuse-server cluster: logs in {log_dir}", flush=True)
    ttl = SESSION_AFFINITY_TTL if args.session_affinity_ttl is None else args.session_affinity_ttl
    try:
        with cluster(args.replicas, args.policy, serve_args, log_dir, args.redis_url, args.host, args.port,
                     args.gateway_args, args.redis_maxmemory, args.router, ttl) as urls:
            print(f"redis:    {urls.redis}", flush=True)
            for i, url in enumerate(urls.replicas):
                print(f"replica {i}: {url}", flush=True)
            print(f"gateway:  {urls.gateway} ({args.router}, policy {args.policy}); OpenAI base URL "
                  f"{urls.gateway}/v1", flush=True)
            if pins_sessions(args.router, args.policy) and ttl:
                print(f"sessions: each stays on its replica until idle {ttl} s (session-id, x-claude-code-session-id "
                      "or x-session-id header)", flush=True)
            print("ready; Ctrl+C stops everything", flush=True)
            signal.signal(signal.SIGINT, _raise_stop)
            while urls.gateway_process.poll() is None:
                time.sleep(1)
            print(f"reuse-server cluster: the gateway exited with {urls.gateway_process.returncode} (see "
                  f"{log_dir / 'gateway.log'}); stopping", file=sys.stderr, flush=True)
            return 1
    except (_Stop, KeyboardInterrupt):
        print("reuse-server cluster: stopped", flush=True)
        return 0
    except ServerStartError as exc:
        print(f"reuse-server cluster: error: {exc}", file=sys.stderr)
        return 1
