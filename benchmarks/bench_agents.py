"""A real agent framework against the server: the loadgen's agent-sdk workload (the OpenAI Agents SDK working
through scripted tasks with local tools, every step a tool call) on the bundled SmolLM2, once with the
cache and once with it off (prefix_cache false), through `reuse-loadgen run --compare`.

Reported: per step k (over the tasks) the mean prompt tokens, the share of them served from cache, and the
median time to the first streamed chunk that carries text or a tool call, cached and with the cache off;
then the totals. TTFT here includes the tokens of the call's head (`<tool_call>` and the function's name),
which the server streams once the name is complete, so it is larger than the prefill alone; the totals also
give the server's own mean time to the first sampled token (its /metrics histogram over each phase).

    .venv/bin/python -m benchmarks.bench_agents [--tasks 3] [--steps 8] [--concurrency 1]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.bench_ttft import server_process
from loadgen import cli


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=3, help="tasks (sessions), one after another per worker")
    ap.add_argument("--steps", type=int, default=8, help="steps (model calls) per task")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--system-tokens", type=int, default=600, help="the agent's instructions")
    ap.add_argument("--tool-output-tokens", type=int, default=150)
    args = ap.parse_args(argv)

    out = Path(tempfile.mkdtemp(prefix="bench-agents-"))
    with server_process("--block-size", "16", "--max-model-len", "8192") as (url, _):
        code = cli.main(["run", "--server", url, "--workload", "agent-sdk", "--compare", "--out", str(out),
                         "--requests", str(args.tasks * args.steps), "--turns", str(args.steps),
                         "--concurrency", str(args.concurrency), "--system-tokens", str(args.system_tokens),
                         "--tool-output-tokens", str(args.tool_output_tokens), "--max-prompt-tokens", "7000",
                         "--no-plots", "--no-progress", "--warmup", "2", "--duration", "3000"])
    w = json.loads((out / "report.json").read_text())["workloads"]["agent-sdk"]
    base = {t["turn"]: t for t in w["baseline"]["by_turn"]}
    for t in w["by_turn"]:
        b = base.get(t["turn"], {})
        emit(kind="step", step=t["turn"], requests=t["requests"],
             prompt_tokens_mean=round(t["prompt_tokens"] / t["requests"]), reuse_rate=round(t["reuse_rate"], 4),
             ttft_ms_p50=round(t["ttft_ms_p50"], 1), ttft_ms_p50_cache_off=round(b["ttft_ms_p50"], 1) if b else None,
             ttft_speedup=round(b["ttft_ms_p50"] / t["ttft_ms_p50"], 2) if b else None)
    def server_ttft_ms(phase: dict) -> float | None:
        m = phase.get("server_metrics") or {}
        return round(1e3 * m["ttft_seconds_sum"] / m["first_tokens"], 1) if m.get("first_tokens") else None

    emit(kind="total", exit_code=code, requests=w["requests"], errors=w["errors"] + w["baseline"]["errors"],
         prompt_tokens=w["prompt_tokens"], reuse_rate=round(w["reuse_rate"], 4),
         completion_tokens=w["completion_tokens"], ttft_ms_p50=round(w["ttft_ms"]["p50"], 1),
         ttft_ms_p50_cache_off=round(w["baseline"]["ttft_ms"]["p50"], 1),
         ttft_speedup=round(w["speedup"]["ttft_p50"], 2), e2e_ms_p50=round(w["e2e_ms"]["p50"], 1),
         e2e_ms_p50_cache_off=round(w["baseline"]["e2e_ms"]["p50"], 1),
         server_ttft_ms_mean=server_ttft_ms(w), server_ttft_ms_mean_cache_off=server_ttft_ms(w["baseline"]),
         report=str(out / "report.md"))


if __name__ == "__main__":
    main()
