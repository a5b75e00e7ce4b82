"""`report.md`: the report as tables a person reads, rendered from report.json alone."""
from __future__ import annotations

PREFIX_HELPS_BELOW = 0.5  # prefix hit rate under which a workload is listed as blending's job
PER_STEP_WORKLOADS = ("agent-sdk", "agent-sdk-responses", "anthropic-tools", "agent-replay-codex",
                      "agent-replay-claude-code")  # reported step by step as well

WHY_PREFIX_FAILS = {
    "agent-loop-timestamp": "a clock line near the top of the system prompt changes every step, so the prefix ends there "
                            "while everything after it recurs (blending's job)",
    "agent-loop-shuffled-tools": "parallel tool results come back in another order each step, so the prefix ends at the "
                                 "first reordered result while the results themselves recur (blending's job)",
    "agent-loop-compaction": "compaction rewrites the context after the task, so only the part before the summary is a "
                             "prefix; the kept steps recur at new positions (blending's job)",
    "rag-shuffle": "the same documents recur at other positions; only the instruction before the first document is a "
                   "prefix (blending's job)",
    "multi-turn": "returning users find their history evicted when the cache is small (a capacity problem, not an "
                  "ordering one)",
    "agent-sdk": "the agent's calls are written back into the history as the client rebuilds them, which the "
                 "tokenizer may split differently from the tokens the model generated",
    "agent-sdk-responses": "the agent's calls are written back into the input as the SDK rebuilds them, which the "
                           "tokenizer may split differently from the tokens the model generated",
    "anthropic-tools": "the tool_use blocks are written back into the conversation as the client rebuilds them, which "
                       "the tokenizer may split differently from the tokens the model generated",
    "trace": "most requests share few blocks with earlier ones (the trace's ceiling with full-block prefix sharing and "
             "unlimited capacity is about 37%)",
}


def pct(x) -> str:
    return "n/a" if x is None else f"{100 * x:.1f}%"


def ms(x) -> str:
    return "n/a" if x is None else (f"{x:.0f}" if x >= 100 else f"{x:.1f}")


def times(x) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def num(x) -> str:
    return "n/a" if x is None else f"{x:,.0f}"


def flops(x) -> str:
    if x is None:
        return "n/a"
    for unit, scale in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if abs(x) >= scale:
            return f"{x / scale:.2f} {unit}"
    return f"{x:.0f} FLOP"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def _latency_rows(workloads: dict) -> list[list[str]]:
    rows = []
    for name, w in workloads.items():
        b = w.get("baseline")
        s = w.get("speedup") or {}
        rows.append([
            name, num(w["requests"]), num(w["errors"]), num(w["prompt_tokens"]), pct(w["prefix_hit_rate"]), pct(w["reuse_rate"]),
            " / ".join(ms(w["ttft_ms"][k]) for k in ("p50", "p90", "p99")),
            " / ".join(ms(b["ttft_ms"][k]) for k in ("p50", "p90", "p99")) if b else "-",
            times(s.get("ttft_p50")) if b else "-",
            " / ".join(ms(w["e2e_ms"][k]) for k in ("p50", "p99")),
            " / ".join(ms(b["e2e_ms"][k]) for k in ("p50", "p99")) if b else "-",
            f"{w['output_tokens_per_s']:.1f}" if w["output_tokens_per_s"] is not None else "n/a",
            (f"{b['output_tokens_per_s']:.1f}" if b["output_tokens_per_s"] is not None else "n/a") if b else "-",
        ])
    return rows


def _bill_rows(workloads: dict) -> list[list[str]]:
    rows = []
    for name, w in workloads.items():
        p = w["prefill"]
        b = w.get("baseline")
        rows.append([name, num(w["prompt_tokens"]), num(p["tokens_computed"]), num(p["tokens_avoided"]), pct(p["avoided_fraction"]),
                     flops(p["flops_computed"]), flops(p["flops_avoided"]), num(w["recomputed_tokens"]),
                     flops(b["prefill"]["flops_computed"]) if b else "-"])
    return rows


def _server_rows(workloads: dict) -> list[list[str]]:
    rows = []
    for name, w in workloads.items():
        m = w.get("server_metrics") or {}
        seen = (m.get("prompt_tokens"), m.get("prefix_cache_hits"))
        agree = "n/a" if None in seen else ("yes" if seen == (w["prompt_tokens"], w["prefix_hit_tokens"]) else "no")
        rows.append([name, f"{num(w['prompt_tokens'])} / {num(m.get('prompt_tokens'))}",
                     f"{num(w['prefix_hit_tokens'])} / {num(m.get('prefix_cache_hits'))}",
                     f"{num(w['blended_tokens'])} / {num(m.get('blended_tokens'))}",
                     num(m.get("evicted_blocks")), agree])
    return rows


def _step_rows(w: dict) -> list[list[str]]:
    base = {t["turn"]: t for t in (w.get("baseline") or {}).get("by_turn", [])}
    rows = []
    for t in w.get("by_turn", []):
        b = base.get(t["turn"])
        speed = b["ttft_ms_p50"] / t["ttft_ms_p50"] if b and b["ttft_ms_p50"] and t["ttft_ms_p50"] else None
        rows.append([str(t["turn"]), num(t["requests"]), num(t["prompt_tokens"] / t["requests"]), pct(t["reuse_rate"]),
                     ms(t["ttft_ms_p50"]), ms(b["ttft_ms_p50"]) if b else "-", times(speed) if b else "-"])
    return rows


def _replica_lines(workloads: dict) -> list[str]:
    """Per replica behind the gateway (run --replica-metrics): what each served and how evenly."""
    rows, notes = [], []
    for name, w in workloads.items():
        rep = w.get("replicas")
        if not rep:
            continue
        total = sum(e["requests"] or 0 for e in rep["per_replica"])
        for e in rep["per_replica"]:
            share = pct(e["requests"] / total) if e["requests"] is not None and total else "n/a"
            rows.append([name, e["url"], f"{num(e['requests'])} ({share})", num(e["prompt_tokens"]),
                         pct(e["prefix_hit_rate"]), ms(e["ttft_mean_ms"]), num(e["redis_hit_blocks"])])
        s = rep["spread"]
        if s["requests"] is not None:
            cv = "n/a" if s["requests_cv"] is None else f"{s['requests_cv']:.2f}"
            hit = s["prefix_hit_rate_range"]
            notes.append(f"- **{name}**: busiest replica {pct(s['max_request_share'])} of the requests, coefficient of "
                         f"variation {cv}" + (f", prefix hit rate {pct(hit[0])}..{pct(hit[1])}" if hit else ""))
    if not rows:
        return []
    lines = ["", "## Replicas", "",
             "Each replica's own `/metrics` over the cached phase: requests it finished, prefix hit rate (tokens), mean "
             "TTFT (its histogram: arrival to first token), blocks it loaded from Redis.", ""]
    lines += _table(["workload", "replica", "requests (share)", "prompt tokens", "prefix hit rate", "TTFT mean ms",
                     "Redis hit blocks"], rows)
    return lines + [""] + notes


def render_markdown(report: dict, plot_files: list[str]) -> str:
    meta = report.get("meta", {})
    workloads = report["workloads"]
    lines = ["# KV reuse load report", ""]
    if meta:
        lines.append(f"Server `{meta.get('server')}`, model `{meta.get('model')}`, seed {meta.get('seed')}, "
                     f"concurrency {meta.get('concurrency')}, {meta.get('started_at', '')}.")
        if meta.get("baseline"):
            lines.append(f"Baseline: {meta['baseline']}.")
        lines.append("")
    lines += ["## Hit rate and latency", "",
              "Prefix hit rate: prompt tokens served as an exact cached prefix. Reuse rate: all prompt tokens "
              "served from cache (prefix hits and blended chunks). Latencies in ms (p50 / p90 / p99); "
              "speedup is baseline TTFT p50 over cached TTFT p50.", ""]
    lines += _table(["workload", "requests", "errors", "prompt tokens", "prefix hit rate", "reuse rate", "TTFT ms",
                     "baseline TTFT ms", "TTFT speedup", "e2e ms p50 / p99", "baseline e2e ms", "output tok/s",
                     "baseline tok/s"], _latency_rows(workloads))
    cut = [(n, w["unsent"]) for n, w in workloads.items() if w.get("unsent")]
    if cut:
        lines += ["", "Not sent because the --duration bound was reached: "
                  + ", ".join(f"{n} {k} requests" for n, k in cut) + "."]
    params = meta.get("model_params")
    params_text = f"{params:,.0f}" if isinstance(params, (int, float)) else "n_params"
    lines += ["", "## Prefill bill", "",
              f"Prefill FLOPs = 2 x {params_text} parameters x tokens run through the model (matmuls only; "
              "attention over the context comes on top). Reuse changes how often the KV cache is rebuilt, not how "
              "big it is: every avoided token is prefill compute not spent.", ""]
    lines += _table(["workload", "prompt tokens", "prefilled", "avoided", "avoided share", "FLOPs prefilled",
                     "FLOPs avoided", "recomputed (blend)", "baseline FLOPs prefilled"], _bill_rows(workloads))
    lines += ["", "## What the server counted over the same window", "",
              "Report totals (from per-response usage) / the server's `/metrics` deltas over the cached phase.", ""]
    lines += _table(["workload", "prompt tokens", "prefix hit tokens", "blended tokens", "evicted blocks", "agree"],
                    _server_rows(workloads))
    for name in (n for n in PER_STEP_WORKLOADS if n in workloads and workloads[n].get("by_turn")):
        lines += ["", f"## {name}: reuse per step", "",
                  "Step k of every task (agent-replay: request k of every session): mean prompt tokens, share served from cache, TTFT p50 in ms (cached, "
                  "baseline) and the speedup.", ""]
        lines += _table(["step", "requests", "prompt tokens", "reuse rate", "TTFT ms", "baseline TTFT ms",
                         "TTFT speedup"], _step_rows(workloads[name]))
    lines += _replica_lines(workloads)
    weak = [(n, w) for n, w in workloads.items() if w["prefix_hit_rate"] is not None and w["prefix_hit_rate"] < PREFIX_HELPS_BELOW]
    lines += ["", "## Where prefix reuse cannot help", ""]
    if weak:
        lines.append(f"Prefix reuse served under {pct(PREFIX_HELPS_BELOW)} of the prompt tokens of these workloads:")
        lines.append("")
        for name, w in weak:
            why = WHY_PREFIX_FAILS.get(name, "the shared text is not a common prefix")
            lines.append(f"- **{name}**: prefix hit rate {pct(w['prefix_hit_rate'])}, reuse rate {pct(w['reuse_rate'])}: {why}.")
    else:
        lines.append(f"Every workload reached a prefix hit rate of at least {pct(PREFIX_HELPS_BELOW)}.")
    failing = [(n, w) for n, w in workloads.items() if w["errors"] or (w.get("baseline") or {}).get("errors")]
    if failing:
        lines += ["", "## Errors", ""]
        for name, w in failing:
            samples = list(w.get("error_samples") or []) + list((w.get("baseline") or {}).get("error_samples") or [])
            lines.append(f"- **{name}**: {w['errors']} cached, {(w.get('baseline') or {}).get('errors', 0)} baseline; "
                         + "; ".join(f"`{s}`" for s in samples[:3]))
    if plot_files:
        lines += ["", "## Plots", ""]
        lines += [f"![{f.rsplit('.', 1)[0]}]({f})" for f in plot_files]
    return "\n".join(lines) + "\n"
