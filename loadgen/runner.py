"""Drives one phase (one workload, cached or baseline): sessions in order, `concurrency` at a time.

Turns of a session go one after another; a session with `after` waits for that session to finish.
Nothing new is sent once `duration_s` has passed; requests already in flight finish, so the
server's counters and the responses' usage cover exactly the same requests.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from loadgen.client import LoadClient
from loadgen.results import RequestResult
from loadgen.workloads.spec import Session


@dataclass
class PhaseResult:
    results: list[RequestResult]
    wall_s: float
    unsent: int  # requests skipped because the time bound was reached


async def run_phase(sessions: list[Session], client: LoadClient, concurrency: int, duration_s: float,
                    progress=None) -> PhaseResult:
    start = time.perf_counter()
    deadline = start + duration_s
    done = {s.id: asyncio.Event() for s in sessions}
    queue = iter(sessions)
    results: list[RequestResult] = []
    unsent = 0

    async def run_session(session: Session) -> None:
        nonlocal unsent
        try:
            if session.after is not None and session.after in done:
                await done[session.after].wait()
            if session.driver is not None:
                driven, skipped = await client.drive(session, start, deadline)
                results.extend(driven)
                unsent += skipped
                if progress is not None:
                    progress.update(len(driven))
                return
            for i, spec in enumerate(session.requests):
                if spec.arrival_s is not None:
                    delay = start + spec.arrival_s - time.perf_counter()
                    if delay > 0:
                        await asyncio.sleep(min(delay, max(0.0, deadline - time.perf_counter())))
                if time.perf_counter() >= deadline:
                    unsent += len(session.requests) - i
                    return
                results.append(await client.send(spec, start))
                if progress is not None:
                    progress.update(1)
        finally:
            done[session.id].set()

    async def worker() -> None:
        for session in queue:  # a shared iterator: each session goes to exactly one worker
            await run_session(session)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    results.sort(key=lambda r: r.start_s)
    return PhaseResult(results=results, wall_s=time.perf_counter() - start, unsent=unsent)
