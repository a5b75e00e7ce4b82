"""Overload and shutdown over HTTP (default: the bundled SmolLM2; --model for another checkpoint).

1. Concurrency held: for each level C, C clients loop over short streaming chats for --seconds; reported per
   level: requests, errors (anything but a complete 200 stream), median and max TTFT. The server runs with
   the default --max-waiting.
2. Where 429s start: a server with --max-num-seqs S and --max-waiting M; long streaming requests are opened
   one at a time and held; the first 429 (with Retry-After) should come when S run and M wait. Reported: the
   request number of the first 429 and the waiting gauge then.
   Then a burst of --burst requests at once into the same idle server: how many got 200 and 429.
3. Shutdown: SIGTERM with nothing in flight, and with --shutdown-clients streams in flight (which finish
   within --shutdown-timeout): seconds from the signal to exit, the exit status, how the streams ended.

    .venv/bin/python -m benchmarks.bench_overload [--levels 8,32,128,256] [--seconds 20] [--model PATH]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import signal
import statistics
import time

import httpx

from benchmarks.bench_ttft import server_process, served_model
from benchmarks.soak import pool_state, settled_pool


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def chat_body(model: str, i: int, max_tokens: int, stream: bool = True) -> dict:
    return {"model": model, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "messages": [{"role": "system", "content": "You answer in one short sentence."},
                         {"role": "user", "content": f"Question {i}: what is a key-value cache for?"}]}


async def stream_once(http: httpx.AsyncClient, url: str, body: dict) -> tuple[int, float | None, bool]:
    """(status, TTFT, complete) of one streaming request."""
    sent = time.perf_counter()
    ttft = None
    async with http.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, None, False
        last = ""
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                if ttft is None and '"content":"' in line and '"content":""' not in line:
                    ttft = time.perf_counter() - sent
                last = line
                if '"error"' in line:
                    return 200, ttft, False
        return 200, ttft, last == "data: [DONE]"


def concurrency_level(url: str, model: str, clients: int, seconds: float, max_tokens: int) -> dict:
    statuses: dict[int, int] = {}
    ttfts: list[float] = []
    errors = 0

    async def client(c: int, until: float) -> None:
        nonlocal errors
        i = 0
        async with httpx.AsyncClient(timeout=600) as http:
            while time.monotonic() < until:
                i += 1
                try:
                    status, ttft, complete = await stream_once(http, url, chat_body(model, c * 100000 + i, max_tokens))
                except httpx.HTTPError:
                    errors += 1
                    continue
                statuses[status] = statuses.get(status, 0) + 1
                if status != 200 or not complete:
                    errors += 1
                if ttft is not None:
                    ttfts.append(ttft)

    async def run() -> None:
        until = time.monotonic() + seconds
        await asyncio.gather(*(client(c, until) for c in range(clients)))

    asyncio.run(run())
    return dict(clients=clients, requests=sum(statuses.values()), errors=errors, statuses=statuses,
                ttft_median_s=round(statistics.median(ttfts), 3) if ttfts else None,
                ttft_max_s=round(max(ttfts), 3) if ttfts else None)


def where_429_starts(url: str, model: str, max_num_seqs: int, max_waiting: int) -> dict:
    held = []
    http = httpx.Client(timeout=600)
    first_429 = retry_after = waiting = None
    try:
        for i in range(1, max_num_seqs + max_waiting + 5):
            request = http.build_request("POST", url + "/v1/chat/completions", json=chat_body(model, i, 2000))
            r = http.send(request, stream=True)
            if r.status_code == 429:
                first_429, retry_after = i, r.headers.get("retry-after")
                r.read()
                time.sleep(0.5)  # the gauge is the engine's view after its last step; nothing finishes meanwhile
                waiting = pool_state(url)["requests_waiting"]
                break
            held.append(r)
            while i <= max_num_seqs and pool_state(url)["requests_running"] < i:
                time.sleep(0.02)  # until it runs, so that it no longer counts as waiting
    finally:
        for r in held:
            r.close()
        http.close()
    return dict(max_num_seqs=max_num_seqs, max_waiting=max_waiting, first_429_at_request=first_429,
                waiting_when_refused=waiting, retry_after=retry_after)


def burst(url: str, model: str, requests: int) -> dict:
    async def run() -> list[tuple[int, float | None, bool]]:
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=requests)) as http:
            return await asyncio.gather(*(stream_once(http, url, chat_body(model, i, 8)) for i in range(requests)))

    results = asyncio.run(run())
    counts: dict[int, int] = {}
    for status, _, _ in results:
        counts[status] = counts.get(status, 0) + 1
    return dict(burst=requests, statuses=counts)


def shutdown_time(serve_args: list[str], clients: int, shutdown_timeout: float, max_tokens: int) -> dict:
    with server_process(*serve_args, "--shutdown-timeout", str(shutdown_timeout)) as (url, proc):
        model = served_model(url)
        outcomes: list[tuple[int, float | None, bool]] = []

        async def streams(started: asyncio.Event) -> None:
            async with httpx.AsyncClient(timeout=600) as http:
                async def one(i: int) -> None:
                    outcomes.append(await stream_once(http, url, chat_body(model, i, max_tokens)))
                tasks = [asyncio.ensure_future(one(i)) for i in range(clients)]
                while pool_state(url)["requests_running"] < min(clients, 1):
                    await asyncio.sleep(0.05)
                started.set()
                await asyncio.gather(*tasks)

        async def run() -> float:
            started = asyncio.Event()
            task = asyncio.ensure_future(streams(started))
            if clients:
                await started.wait()
            proc.send_signal(signal.SIGTERM)
            signalled = time.perf_counter()
            while proc.poll() is None:
                await asyncio.sleep(0.02)
            took = time.perf_counter() - signalled
            await task
            return took

        took = asyncio.run(run())
    return dict(in_flight=clients, shutdown_timeout_s=shutdown_timeout, exit_s=round(took, 2),
                exit_status=proc.returncode, streams_complete=sum(1 for _, _, ok in outcomes if ok))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--levels", default="8,32,128,256", help="client counts for the concurrency sweep")
    ap.add_argument("--seconds", type=float, default=20.0, help="seconds per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens per answer in the sweep")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="running requests in the 429 experiment")
    ap.add_argument("--max-waiting", type=int, default=16, help="--max-waiting in the 429 experiment")
    ap.add_argument("--burst", type=int, default=64, help="requests sent at once in the 429 experiment")
    ap.add_argument("--shutdown-clients", type=int, default=8)
    ap.add_argument("--shutdown-timeout", type=float, default=30.0)
    ap.add_argument("--skip", default="", help="comma-separated parts to skip: sweep, queue, shutdown")
    args = ap.parse_args(argv)
    skip = set(filter(None, args.skip.split(",")))
    base = ["--model", args.model]
    if "sweep" not in skip:
        with server_process(*base) as (url, _):
            model = served_model(url)
            for clients in (int(c) for c in args.levels.split(",")):
                emit(part="concurrency", **concurrency_level(url, model, clients, args.seconds, args.max_tokens))
            settled = settled_pool(url)
            emit(part="concurrency_settled", in_use_blocks=settled["in_use"])
    if "queue" not in skip:
        with server_process(*base, "--max-num-seqs", str(args.max_num_seqs),
                            "--max-waiting", str(args.max_waiting)) as (url, _):
            model = served_model(url)
            emit(part="queue", **where_429_starts(url, model, args.max_num_seqs, args.max_waiting))
            settled_pool(url)
            emit(part="queue_burst", max_num_seqs=args.max_num_seqs, max_waiting=args.max_waiting,
                 **burst(url, model, args.burst))
    if "shutdown" not in skip:
        for clients in (0, args.shutdown_clients):
            emit(part="shutdown", **shutdown_time(base, clients, args.shutdown_timeout, 64))


if __name__ == "__main__":
    main()
