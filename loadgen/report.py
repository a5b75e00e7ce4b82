"""Numbers per workload from per-response usage and timings, and the report files.

`report.json` is the source of truth: `reuse-loadgen report DIR` re-renders the Markdown and the
plots from it alone, so it keeps the per-request samples the plots need.

The bill view counts prefill work: a prompt token served from cache (prefix hit or blended) is
a token the model did not run; FLOPs are estimated as 2 x parameters per token, the matmul cost
of a forward pass (attention over the context comes on top, so long prompts cost more than this).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from loadgen.results import RequestResult

PERCENTILES = (50, 90, 99)
DEFAULT_MODEL_PARAMS = 134.5e6  # SmolLM2-135M


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES} | {"mean": None}
    arr = np.asarray(values, dtype=float)
    out = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["mean"] = float(arr.mean())
    return out


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def summarize(results: list[RequestResult], wall_s: float, flops_per_token: float, unsent: int = 0) -> dict:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    blended = sum(r.blended_tokens for r in ok)
    recomputed = sum(r.recomputed_tokens for r in ok)
    completion = sum(r.completion_tokens for r in ok)
    prefix_hits = cached - blended
    computed = prompt - cached
    ttft_ms = [r.ttft_s * 1000 for r in ok if r.ttft_s is not None]
    e2e_ms = [r.e2e_s * 1000 for r in ok if r.e2e_s is not None]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "unsent": unsent,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_tokens": cached,
        "prefix_hit_tokens": prefix_hits,
        "blended_tokens": blended,
        "recomputed_tokens": recomputed,
        "prefix_hit_rate": _ratio(prefix_hits, prompt),
        "reuse_rate": _ratio(cached, prompt),
        "ttft_ms": percentiles(ttft_ms),
        "e2e_ms": percentiles(e2e_ms),
        "output_tokens_per_s": _ratio(completion, wall_s),
        "duration_s": wall_s,
        "prefill": {
            "tokens_computed": computed,
            "tokens_avoided": cached,
            "flops_computed": computed * flops_per_token,
            "flops_avoided": cached * flops_per_token,
            "avoided_fraction": _ratio(cached, prompt),
        },
        "by_turn": by_turn(ok),
        "error_samples": sorted({r.error for r in results if r.error})[:5],
        "samples": {
            "ttft_ms": ttft_ms,
            "e2e_ms": e2e_ms,
            # [end time s, prompt tokens, prefix hit tokens, cached tokens] per successful request
            "timeline": [[round(r.end_s, 4), r.prompt_tokens, r.prefix_hit_tokens, r.cached_tokens]
                         for r in sorted(ok, key=lambda r: r.end_s)],
        },
    }


def by_turn(ok: list[RequestResult]) -> list[dict]:
    """Reuse and TTFT per turn (an agent's step, a conversation's turn) over the sessions."""
    turns: dict[int, list[RequestResult]] = {}
    for r in ok:
        turns.setdefault(r.turn, []).append(r)
    out = []
    for turn in sorted(turns):
        rs = turns[turn]
        prompt, cached = sum(r.prompt_tokens for r in rs), sum(r.cached_tokens for r in rs)
        out.append({"turn": turn, "requests": len(rs), "prompt_tokens": prompt, "cached_tokens": cached,
                    "reuse_rate": _ratio(cached, prompt),
                    "ttft_ms_p50": percentiles([r.ttft_s * 1000 for r in rs if r.ttft_s is not None])["p50"]})
    return out


def speedup(cached: dict, baseline: dict) -> dict[str, float | None]:
    """Baseline latency over cached latency (higher is better), throughput the other way round."""
    out: dict[str, float | None] = {}
    for metric in ("ttft_ms", "e2e_ms"):
        for p in PERCENTILES:
            key = f"p{p}"
            c, b = cached[metric][key], baseline[metric][key]
            out[f"{metric.split('_')[0]}_{key}"] = b / c if c and b is not None else None
    c, b = cached["output_tokens_per_s"], baseline["output_tokens_per_s"]
    out["output_tokens_per_s"] = c / b if c is not None and b else None
    return out


def workload_entry(cached: dict, server_metrics: dict | None, baseline: dict | None = None,
                   baseline_server_metrics: dict | None = None) -> dict:
    entry = dict(cached)
    entry["server_metrics"] = server_metrics
    if baseline is not None:
        entry["baseline"] = dict(baseline, server_metrics=baseline_server_metrics)
        entry["speedup"] = speedup(cached, baseline)
    return entry


def write_json(report: dict, out_dir: Path) -> Path:
    path = Path(out_dir) / "report.json"
    path.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return path


def load_json(out_dir: Path) -> dict:
    return json.loads((Path(out_dir) / "report.json").read_text(encoding="utf-8"))
