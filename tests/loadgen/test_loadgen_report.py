"""Report numbers from per-request results, usage parsing from real openai types, the /metrics
parser on text from a real prometheus_client registry, and the rendered files."""
from __future__ import annotations

import json

import numpy as np
import pytest
from openai.types.completion_usage import CompletionUsage
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from loadgen import cli
from loadgen.client import BASELINE, CacheMode, normalize_server_url
from loadgen.errors import UsageError
from loadgen.metrics_scrape import counter_deltas, parse_counters, requests_running
from loadgen.render import render_outputs
from loadgen.report import load_json, speedup, summarize, workload_entry, write_json
from loadgen.results import RequestResult, apply_usage

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def result(i, prompt, cached, blended=0, recomputed=0, ttft=0.01, e2e=0.05, completion=8, ok=True, error=None):
    return RequestResult(session=f"s{i}", turn=0, ok=ok, start_s=0.1 * i, e2e_s=e2e, ttft_s=ttft if ok else None,
                         prompt_tokens=prompt if ok else 0, completion_tokens=completion if ok else 0,
                         cached_tokens=cached if ok else 0, blended_tokens=blended if ok else 0,
                         recomputed_tokens=recomputed if ok else 0, error=error)


@pytest.fixture()
def cached_results():
    return [result(0, 100, 0, ttft=0.050), result(1, 200, 160, blended=32, recomputed=5, ttft=0.010),
            result(2, 300, 288, ttft=0.012), result(3, 50, 0, ok=False, error="HTTP 400: too long"),
            result(4, 400, 352, blended=64, ttft=0.020)]


def test_summary_counts_rates_percentiles_and_bill(cached_results):
    s = summarize(cached_results, wall_s=2.0, flops_per_token=2 * 1e6, unsent=3)
    assert (s["requests"], s["errors"], s["unsent"]) == (5, 1, 3)
    assert s["prompt_tokens"] == 1000 and s["cached_tokens"] == 800
    assert s["blended_tokens"] == 96 and s["prefix_hit_tokens"] == 704 and s["recomputed_tokens"] == 5
    assert s["prefix_hit_rate"] == pytest.approx(0.704) and s["reuse_rate"] == pytest.approx(0.8)
    ttfts = [50.0, 10.0, 12.0, 20.0]
    for p in (50, 90, 99):
        assert s["ttft_ms"][f"p{p}"] == pytest.approx(np.percentile(ttfts, p))
    assert s["output_tokens_per_s"] == pytest.approx(32 / 2.0)
    assert s["prefill"] == {"tokens_computed": 200, "tokens_avoided": 800, "flops_computed": 200 * 2e6,
                            "flops_avoided": 800 * 2e6, "avoided_fraction": pytest.approx(0.8)}
    assert s["error_samples"] == ["HTTP 400: too long"]
    assert sorted(s["samples"]["ttft_ms"]) == pytest.approx(sorted(ttfts))
    assert [row[1:] for row in s["samples"]["timeline"]] == [[100, 0, 0], [200, 128, 160], [300, 288, 288], [400, 288, 352]]


def test_empty_and_speedup(cached_results):
    empty = summarize([], wall_s=1.0, flops_per_token=1.0)
    assert empty["prefix_hit_rate"] is None and empty["ttft_ms"]["p50"] is None and empty["requests"] == 0
    cached = summarize(cached_results, 2.0, 1.0)
    baseline = summarize([result(i, 100, 0, ttft=0.1, e2e=0.2) for i in range(4)], 4.0, 1.0)
    sp = speedup(cached, baseline)
    assert sp["ttft_p50"] == pytest.approx(100 / cached["ttft_ms"]["p50"])
    assert sp["output_tokens_per_s"] == pytest.approx(cached["output_tokens_per_s"] / baseline["output_tokens_per_s"])
    assert speedup(cached, empty)["ttft_p50"] is None
    entry = workload_entry(cached, {"prompt_tokens": 1000.0}, baseline, None)
    assert entry["baseline"]["requests"] == 4 and entry["speedup"] == sp and entry["server_metrics"]["prompt_tokens"] == 1000


def test_usage_fields_from_openai_types():
    usage = CompletionUsage.model_validate({
        "prompt_tokens": 120, "completion_tokens": 9, "total_tokens": 129,
        "prompt_tokens_details": {"cached_tokens": 96, "blended_tokens": 32, "recomputed_tokens": 4}})
    r = RequestResult(session="s", turn=0, ok=True, start_s=0.0)
    apply_usage(r, usage)
    assert (r.prompt_tokens, r.completion_tokens, r.cached_tokens, r.blended_tokens, r.recomputed_tokens) == (120, 9, 96, 32, 4)
    assert r.prefix_hit_tokens == 64
    plain = CompletionUsage.model_validate({"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11,
                                            "prompt_tokens_details": {"cached_tokens": 8}})
    apply_usage(r, plain)
    assert (r.cached_tokens, r.blended_tokens, r.recomputed_tokens, r.prefix_hit_tokens) == (8, 0, 0, 8)
    apply_usage(r, CompletionUsage(prompt_tokens=5, completion_tokens=1, total_tokens=6))
    assert r.cached_tokens == 0


def test_request_bodies_for_cached_and_baseline():
    assert BASELINE.extra_body() == {"ignore_eos": True, "prefix_cache": False, "kv_blend": {"enabled": False}}
    assert CacheMode(cache_salt="run/agent-loop").extra_body() == {"ignore_eos": True, "cache_salt": "run/agent-loop"}
    assert CacheMode(kv_blend=True, recompute_ratio=0.15).extra_body()["kv_blend"] == {"enabled": True, "recompute_ratio": 0.15}
    assert normalize_server_url("http://127.0.0.1:8000/v1/") == "http://127.0.0.1:8000"
    with pytest.raises(UsageError, match="http://"):
        normalize_server_url("127.0.0.1:8000")


def test_metrics_parser_on_prometheus_client_output():
    registry = CollectorRegistry()
    prompt = Counter("kvreuse_prompt_tokens", "prompt tokens", ["model"], registry=registry)
    hits = Counter("kvreuse_prefix_cache_hits", "hit tokens", registry=registry)
    running = Gauge("kvreuse_requests_running", "running", registry=registry)
    prompt.labels("a").inc(100)
    prompt.labels("b").inc(20)
    hits.inc(64)
    running.set(2)
    before = parse_counters(generate_latest(registry).decode())
    assert before == {"prompt_tokens": 120.0, "prefix_cache_hits": 64.0}
    assert requests_running(generate_latest(registry).decode()) == 2
    prompt.labels("a").inc(30)
    after = parse_counters(generate_latest(registry).decode())
    deltas = counter_deltas(before, after)
    assert deltas["prompt_tokens"] == 30 and deltas["prefix_cache_hits"] == 0
    assert deltas["blended_tokens"] is None, "a counter the server does not export is unknown, not zero"
    assert all(v is None for v in counter_deltas(None, after).values())


def make_report(cached_results) -> dict:
    flops = 2 * 134.5e6
    entries = {}
    for name, scale in (("agent-loop", 1.0), ("rag-shuffle", 0.1), ("trace", 0.5)):
        rs = [result(i, 100 * (i + 1), int(scale * 96 * (i + 1)) // 16 * 16, ttft=0.01 + 0.001 * i) for i in range(20)]
        base = [result(i, 100 * (i + 1), 0, ttft=0.05 + 0.001 * i) for i in range(20)]
        cached = summarize(rs, 1.5, flops)
        metrics = {"prompt_tokens": float(cached["prompt_tokens"]), "prefix_cache_hits": float(cached["prefix_hit_tokens"]),
                   "blended_tokens": 0.0, "evicted_blocks": 0.0}
        entries[name] = workload_entry(cached, metrics, summarize(base, 2.5, flops), None)
    entries["multi-turn"] = workload_entry(summarize(cached_results, 1.0, flops), None)
    return {"meta": {"server": "http://127.0.0.1:1", "model": "m", "seed": 0, "concurrency": 2,
                     "model_params": 134.5e6}, "workloads": entries}


def test_report_files_and_rerender(tmp_path, cached_results, capsys):
    report = make_report(cached_results)
    write_json(report, tmp_path)
    written = render_outputs(report, tmp_path)
    assert {p.name for p in written} == {"report.md", "hit_rate.png", "ttft.png", "trace_hit_rate.png"}
    for p in written[1:]:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 5000
    md = (tmp_path / "report.md").read_text()
    for name in report["workloads"]:
        assert f"| {name} |" in md
    assert "**rag-shuffle**" in md.split("## Where prefix reuse cannot help")[1]
    assert "agent-loop" not in md.split("## Where prefix reuse cannot help")[1].split("##")[0]
    assert "HTTP 400: too long" in md
    assert load_json(tmp_path) == json.loads(json.dumps(report))

    original = md
    for p in written:
        p.unlink()
    assert cli.main(["report", str(tmp_path)]) == 0
    assert (tmp_path / "report.md").read_text() == original
    assert (tmp_path / "trace_hit_rate.png").read_bytes()[:8] == PNG_MAGIC
    assert "wrote" in capsys.readouterr().out


def test_report_command_errors(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path / "nowhere")]) == 2
    assert "no such file" in capsys.readouterr().err
    (tmp_path / "report.json").write_text("{not json")
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    (tmp_path / "report.json").write_text('{"rows": []}')
    assert cli.main(["report", str(tmp_path)]) == 2
    assert "not a loadgen report" in capsys.readouterr().err


def test_replica_counters_match_labels_and_spread_says_how_even_the_work_was():
    from prometheus_client import Histogram

    from loadgen.replica_metrics import REPLICA_COUNTERS, replica_report

    def replica(requests: int, hits: int, ttft: list[float], redis_hits: int):
        registry = CollectorRegistry()
        Counter("kvreuse_requests", "finished", ["finish_reason"], registry=registry).labels("length").inc(requests)
        Counter("kvreuse_prefix_cache_queries", "q", registry=registry).inc(100)
        Counter("kvreuse_prefix_cache_hits", "h", registry=registry).inc(hits)
        tier = Counter("kvreuse_tier_hits", "tier hits", ["tier"], registry=registry)
        tier.labels("host").inc(1000)  # another tier's hits are not Redis's
        tier.labels("redis").inc(redis_hits)
        histogram = Histogram("kvreuse_time_to_first_token_seconds", "ttft", registry=registry)
        for t in ttft:
            histogram.observe(t)
        return parse_counters(generate_latest(registry).decode(), REPLICA_COUNTERS)

    zero = {key: 0.0 for key in REPLICA_COUNTERS}
    after = [replica(6, 50, [0.1, 0.3], 4), replica(2, 90, [0.2], 0)]
    report = replica_report(["http://a", "http://b"], [zero, zero], after)
    a, b = report["per_replica"]
    assert a["requests"] == 6 and a["prefix_hit_rate"] == 0.5 and a["redis_hit_blocks"] == 4
    assert a["ttft_mean_ms"] == pytest.approx(200.0) and b["ttft_mean_ms"] == pytest.approx(200.0)
    spread = report["spread"]
    assert spread["requests"] == [6, 2] and spread["max_request_share"] == 0.75
    assert spread["requests_cv"] == pytest.approx(0.5) and spread["prefix_hit_rate_range"] == [0.5, 0.9]
    # a replica whose /metrics could not be read leaves its figures, and the spread, unknown
    unknown = replica_report(["http://a", "http://b"], [zero, None], after)
    assert unknown["per_replica"][1]["requests"] is None and unknown["spread"]["requests"] is None
