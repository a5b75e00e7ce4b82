"""Agent clients against the server, on the bundled SmolLM2, each once with the cache and once with it off
(prefix_cache false), through `reuse-loadgen run --compare`:
- `agent-sdk`: the OpenAI Agents SDK with its Chat Completions model (`/v1/chat/completions`);
- `agent-sdk-responses`: the Agents SDK with its default model, the Responses API (`/v1/responses`), sending
  the whole input every step as Codex does;
- `anthropic-tools`: a tool loop through the `anthropic` SDK (`/v1/messages`), as Claude Code's traffic.
Every step is a tool call whose output goes back into the next step's history.

Reported: per step k (over the tasks) the mean prompt tokens, the share of them served from cache, and the
median time to the first streamed event that carries text or a tool call, cached and with the cache off;
then the totals. TTFT here includes the tokens of the call's head (`<tool_call>` and the function's name),
which the server streams once the name is complete, so it is larger than the prefill alone; the totals also
give the server's own mean time to the first sampled token (its /metrics histogram over each phase).

Then the stored chain (`--chain-turns`): one conversation through `/v1/responses`, continued with
`previous_response_id` (the server keeps the exact token ids), against the same conversation resent whole each
turn (`store: false`, the client rebuilding the history), and resent with the cache off.

    .venv/bin/python -m benchmarks.bench_agents [--tasks 3] [--steps 8] [--concurrency 1] [--chain-turns 6]
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import time

import openai

from benchmarks.bench_ttft import DOCS, FILLER, server_process
from loadgen import cli

WORKLOADS = ("agent-sdk", "agent-sdk-responses", "anthropic-tools")


def emit(**row) -> None:
    print(json.dumps(row), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tasks", type=int, default=3, help="tasks (sessions), one after another per worker")
    ap.add_argument("--steps", type=int, default=8, help="steps (model calls) per task")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--system-tokens", type=int, default=600, help="the agent's instructions")
    ap.add_argument("--tool-output-tokens", type=int, default=150)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--chain-turns", type=int, default=6, help="turns of the stored-chain comparison (0: skip)")
    ap.add_argument("--chain-first-tokens", type=int, default=1500, help="the chain's first message, about")
    args = ap.parse_args(argv)

    with server_process("--block-size", "16", "--max-model-len", "8192") as (url, _):
        for workload in [w for w in args.workloads.split(",") if w]:
            run_workload(url, workload, args)
        if args.chain_turns:
            for mode in ("stored", "resent", "resent-cache-off"):
                for row in chain(url, mode, args.chain_turns, args.chain_first_tokens):
                    emit(kind="chain", **row)


def run_workload(url: str, workload: str, args) -> None:
    out = Path(tempfile.mkdtemp(prefix=f"bench-agents-{workload}-"))
    code = cli.main(["run", "--server", url, "--workload", workload, "--compare", "--out", str(out),
                     "--requests", str(args.tasks * args.steps), "--turns", str(args.steps),
                     "--concurrency", str(args.concurrency), "--system-tokens", str(args.system_tokens),
                     "--tool-output-tokens", str(args.tool_output_tokens), "--max-prompt-tokens", "7000",
                     "--no-plots", "--no-progress", "--warmup", "2", "--duration", "3000"])
    w = json.loads((out / "report.json").read_text())["workloads"][workload]
    base = {t["turn"]: t for t in w["baseline"]["by_turn"]}
    for t in w["by_turn"]:
        b = base.get(t["turn"], {})
        emit(kind="step", workload=workload, step=t["turn"], requests=t["requests"],
             prompt_tokens_mean=round(t["prompt_tokens"] / t["requests"]), reuse_rate=round(t["reuse_rate"], 4),
             ttft_ms_p50=round(t["ttft_ms_p50"], 1), ttft_ms_p50_cache_off=round(b["ttft_ms_p50"], 1) if b else None,
             ttft_speedup=round(b["ttft_ms_p50"] / t["ttft_ms_p50"], 2) if b else None)
    def server_ttft_ms(phase: dict) -> float | None:
        m = phase.get("server_metrics") or {}
        return round(1e3 * m["ttft_seconds_sum"] / m["first_tokens"], 1) if m.get("first_tokens") else None

    emit(kind="total", workload=workload, exit_code=code, requests=w["requests"], errors=w["errors"] + w["baseline"]["errors"],
         prompt_tokens=w["prompt_tokens"], reuse_rate=round(w["reuse_rate"], 4),
         completion_tokens=w["completion_tokens"], ttft_ms_p50=round(w["ttft_ms"]["p50"], 1),
         ttft_ms_p50_cache_off=round(w["baseline"]["ttft_ms"]["p50"], 1),
         ttft_speedup=round(w["speedup"]["ttft_p50"], 2), e2e_ms_p50=round(w["e2e_ms"]["p50"], 1),
         e2e_ms_p50_cache_off=round(w["baseline"]["e2e_ms"]["p50"], 1),
         server_ttft_ms_mean=server_ttft_ms(w), server_ttft_ms_mean_cache_off=server_ttft_ms(w["baseline"]),
         report=str(out / "report.md"))


def chain(url: str, mode: str, turns: int, first_tokens: int) -> list[dict]:
    """One conversation of `turns` user messages (a long document first, short questions after), streamed
    through /v1/responses. `stored`: each turn sends only its new message with previous_response_id;
    `resent`: each turn sends the whole history as input items with store false; `resent-cache-off`: the
    same with prefix_cache false. Per turn: input tokens, cached tokens and the time to the first text."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="bench", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    words = (DOCS.read_text(errors="ignore") if DOCS.is_file() else FILLER * 200).split()
    document = " ".join(words[: int(first_tokens * 0.75)])
    # a salt of the mode's own keeps each mode's conversation out of the others' cache
    extra = {"cache_salt": f"chain-{mode}", **({"prefix_cache": False} if mode == "resent-cache-off" else {})}
    messages = [f"Read this report and answer my questions about it.\n\n{document}"]
    messages += [f"Question {k}: what does the report say about item {k} of its list?" for k in range(1, turns)]
    history: list[dict] = []
    previous = None
    rows = []
    for k, text in enumerate(messages):
        if mode == "stored":
            kwargs = {"input": text, "previous_response_id": previous, "store": True}
        else:
            history.append({"role": "user", "content": text})
            kwargs = {"input": list(history), "store": False}
        sent = time.perf_counter()
        first = None
        final = None
        with client.responses.create(model=model, max_output_tokens=32, temperature=0.0, stream=True,
                                     extra_body=extra, **kwargs) as stream:
            for event in stream:
                if event.type == "response.output_text.delta" and first is None:
                    first = time.perf_counter() - sent
                if event.type in ("response.completed", "response.incomplete"):  # incomplete: cut at 32 tokens
                    final = event.response
        previous = final.id
        if mode != "stored":
            history.append({"role": "assistant", "content": final.output_text})
        usage = final.usage
        rows.append({"mode": mode, "turn": k + 1, "input_tokens": usage.input_tokens,
                     "cached_tokens": usage.input_tokens_details.cached_tokens,
                     "ttft_ms": round(1e3 * (first if first is not None else time.perf_counter() - sent), 1)})
    return rows


if __name__ == "__main__":
    main()
