"""End to end: the real `reuse-server` on a tiny random model, every workload briefly with --compare,
and the report's numbers checked against what the server's /metrics counted over the same window."""
from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from loadgen import cli
from loadgen.workloads import WORKLOAD_NAMES
from loadgen_inputs import write_docs, write_trace
from server_process import running_server
from tiny_checkpoint import write_tiny_checkpoint

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BLOCK = 16  # the server's --block-size in this test
REQUESTS = 6
CONCURRENCY = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-llama"), arch="llama")
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    with running_server(model, log, "--block-size", str(BLOCK), "--max-model-len", "1024") as url:
        yield url


def server_counters(url: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {s.name: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name.endswith("_total") and s.name.startswith("kvreuse_")}


@pytest.fixture(scope="module")
def run(server, tmp_path_factory):
    """One loadgen run of every workload with --compare; the server's counters before and after."""
    inputs = tmp_path_factory.mktemp("inputs")
    out = tmp_path_factory.mktemp("report")
    before = server_counters(server)
    code = cli.main([
        "run", "--server", server, "--workload", "all", "--out", str(out), "--compare", "--no-progress",
        "--requests", str(REQUESTS), "--concurrency", str(CONCURRENCY), "--duration", "120", "--warmup", "0",
        "--output-tokens", "4", "--max-prompt-tokens", "900", "--chars-per-token", "1.2",
        "--agents", "2", "--turns", "3", "--system-tokens", "150", "--tool-output-tokens", "60",
        "--docs-file", str(write_docs(inputs / "docs.txt", count=6, chars=300)), "--doc-tokens", "200",
        "--rag-k", "2", "--rag-pool", "4", "--trace-file", str(write_trace(inputs / "trace.jsonl")),
        "--trace-block-tokens", str(BLOCK), "--vocab-size", "320", "--model-params", "1e6",
    ])
    after = server_counters(server)
    report = json.loads((out / "report.json").read_text())
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return code, report, records, before, after, out


def delta(before, after, name):
    return after.get(name, 0.0) - before.get(name, 0.0)


def test_every_workload_ran_without_errors(run):
    code, report, records, *_ , out = run
    assert code == 0
    assert list(report["workloads"]) == list(WORKLOAD_NAMES)
    for name, w in report["workloads"].items():
        for phase in (w, w["baseline"]):
            assert phase["requests"] == REQUESTS and phase["errors"] == 0 and phase["unsent"] == 0, name
            assert phase["ttft_ms"]["p50"] > 0 and phase["e2e_ms"]["p99"] >= phase["ttft_ms"]["p50"]
            assert phase["completion_tokens"] == REQUESTS * 4, "ignore_eos: every request generates what it asks"
    assert len(records) == 2 * REQUESTS * len(WORKLOAD_NAMES)
    for f in ("report.md", "hit_rate.png", "ttft.png", "trace_hit_rate.png"):
        assert (out / f).stat().st_size > 0


def test_report_totals_match_server_metrics(run):
    _, report, _, before, after, _ = run
    phases = [p for w in report["workloads"].values() for p in (w, w["baseline"])]
    # the whole run: the loadgen was the server's only client
    assert sum(p["prompt_tokens"] for p in phases) == delta(before, after, "kvreuse_prompt_tokens_total")
    assert sum(p["prefix_hit_tokens"] for p in phases) == delta(before, after, "kvreuse_prefix_cache_hits_total")
    assert sum(p["blended_tokens"] for p in phases) == delta(before, after, "kvreuse_blended_tokens_total")
    assert sum(p["completion_tokens"] for p in phases) == delta(before, after, "kvreuse_generation_tokens_total")
    # and every phase's own window
    for name, w in report["workloads"].items():
        for phase in (w, w["baseline"]):
            m = phase["server_metrics"]
            assert m["prompt_tokens"] == phase["prompt_tokens"], name
            assert m["prefix_cache_hits"] == phase["prefix_hit_tokens"], name
            assert m["generation_tokens"] == phase["completion_tokens"], name


def test_rates_and_bill_are_consistent(run):
    _, report, _, *_ = run
    for name, w in report["workloads"].items():
        assert w["prefix_hit_rate"] == pytest.approx(w["prefix_hit_tokens"] / w["prompt_tokens"])
        assert w["reuse_rate"] == pytest.approx(w["cached_tokens"] / w["prompt_tokens"])
        assert w["prefill"]["tokens_computed"] + w["prefill"]["tokens_avoided"] == w["prompt_tokens"]
        assert w["prefill"]["flops_avoided"] == pytest.approx(2e6 * w["prefill"]["tokens_avoided"])
        b = w["baseline"]
        assert b["cached_tokens"] == 0 and b["prefix_hit_rate"] == 0, f"{name}: the baseline must not reuse"
        assert b["prompt_tokens"] == w["prompt_tokens"], f"{name}: the baseline sends the same prompts"
        assert w["speedup"]["ttft_p50"] == pytest.approx(b["ttft_ms"]["p50"] / w["ttft_ms"]["p50"])


def _by(records, workload, phase="cached"):
    return [r for r in records if r["workload"] == workload and r["phase"] == phase]


def test_agent_loop_hits_the_whole_previous_turn(run):
    _, report, records, *_ = run
    turns: dict[str, list[dict]] = {}
    for r in _by(records, "agent-loop"):
        turns.setdefault(r["session"], []).append(r)
    checked = 0
    for session in turns.values():
        session.sort(key=lambda r: r["turn"])
        for prev, cur in zip(session, session[1:]):
            assert cur["prompt_tokens"] > prev["prompt_tokens"]
            assert cur["cached_tokens"] - cur["blended_tokens"] >= prev["prompt_tokens"] // BLOCK * BLOCK
            checked += 1
    assert checked >= REQUESTS - 2
    loops = report["workloads"]
    assert loops["agent-loop"]["prefix_hit_rate"] > loops["agent-loop-timestamp"]["prefix_hit_rate"]
    assert loops["agent-loop"]["prefix_hit_rate"] > loops["rag-shuffle"]["prefix_hit_rate"]


def test_shared_doc_and_trace_share_what_they_claim(run):
    _, report, records, *_ = run
    shared = _by(records, "shared-doc")
    late = shared[CONCURRENCY:]  # sent after an earlier user's request had finished
    assert all(r["cached_tokens"] >= 0.5 * r["prompt_tokens"] for r in late)
    trace = sorted(_by(records, "trace"), key=lambda r: int(r["session"][len("trace"):]))
    # row 4 ([0, 1, 8, 9]) starts after one of rows 0-2 (all begin with block 0) has finished;
    # only blocks 0 and 1 are shared with anything earlier
    assert BLOCK <= trace[4]["cached_tokens"] <= 2 * BLOCK
    assert trace[3]["cached_tokens"] == 0 and trace[5]["cached_tokens"] == 0  # rows with ids no one else has


def test_duration_bound_and_trace_pacing(server, tmp_path):
    """Trace arrivals at 10x the trace's clock: only the first row arrives within a 0.5 s bound."""
    before = server_counters(server)
    code = cli.main([
        "run", "--server", server, "--workload", "trace", "--out", str(tmp_path), "--no-progress", "--no-plots",
        "--requests", "6", "--time-scale", "10", "--duration", "0.5", "--warmup", "0", "--output-tokens", "4",
        "--max-prompt-tokens", "900", "--trace-file", str(write_trace(tmp_path / "trace.jsonl")),
        "--trace-block-tokens", str(BLOCK), "--vocab-size", "320",
    ])
    after = server_counters(server)
    assert code == 0
    w = json.loads((tmp_path / "report.json").read_text())["workloads"]["trace"]
    assert (w["requests"], w["unsent"], w["errors"]) == (1, 5, 0)
    first_row_tokens = -(-1500 * BLOCK // 512)  # row 0: 1500 tokens in the trace's 512-token blocks, scaled
    assert w["prompt_tokens"] == delta(before, after, "kvreuse_prompt_tokens_total") == first_row_tokens
