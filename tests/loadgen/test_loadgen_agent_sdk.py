"""The agent workloads: the OpenAI Agents SDK (over chat completions, and in its default Responses mode) and the
anthropic SDK's tool loop run scripted tasks with local tools against a real server (tiny random checkpoint:
its calls are valid because the server constrains them) for a fixed number of steps, cached and with the
cache off, and the report counts every step as the server did."""
from __future__ import annotations

import dataclasses
import json

import pytest

from loadgen import cli
from loadgen.errors import UsageError
from loadgen.workloads import WORKLOAD_NAMES, WorkloadConfig, build_workload, parse_workload_names
from loadgen.workloads.agent_sdk import NAME, RESPONSES_NAME, ToolBox, steps_that_fit
from loadgen.workloads.anthropic_tools import NAME as ANTHROPIC_NAME
from server_process import metric, running_server, scrape

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

STEPS = 3
REQUESTS = 5  # two tasks: 3 steps, then 2
AGENTS = (NAME, RESPONSES_NAME, ANTHROPIC_NAME)
CLIENTS = {NAME: "openai", RESPONSES_NAME: "openai", ANTHROPIC_NAME: "anthropic"}


@pytest.mark.parametrize("name", AGENTS)
def test_named_only_and_sized_by_the_config(name):
    assert name not in WORKLOAD_NAMES and name not in parse_workload_names("all")
    assert parse_workload_names(f"agent-loop,{name}") == ["agent-loop", name]
    cfg = WorkloadConfig(requests=REQUESTS, turns=STEPS)
    workload = build_workload(name, cfg)
    assert [s.planned for s in workload.sessions] == [3, 2] and workload.planned_requests == REQUESTS
    assert all(s.driver is not None and s.requests == [] and s.client == CLIENTS[name] for s in workload.sessions)
    assert [s.id for s in workload.sessions] == ["travel0", "research1"]
    # steps stay within the prompt budget
    small = dataclasses.replace(cfg, turns=50, max_prompt_tokens=2000, system_tokens=200, tool_output_tokens=100)
    assert steps_that_fit(small) < 50
    with pytest.raises(UsageError, match="not even one step"):
        steps_that_fit(dataclasses.replace(small, max_prompt_tokens=500))


def test_tool_outputs_are_fixed_by_the_call():
    box = ToolBox(seed=1, output_chars=200)
    assert box.answer("read_note", note_id=3) == box.answer("read_note", note_id=3)
    assert box.answer("read_note", note_id=3) != box.answer("read_note", note_id=4)
    assert box.answer("read_note", note_id=3) != ToolBox(seed=2, output_chars=200).answer("read_note", note_id=3)
    assert 150 < len(box.answer("get_weather", city="Oslo")) < 260


@pytest.fixture(scope="module", params=AGENTS)
def run(request, tiny_llama_path, tmp_path_factory):
    name = request.param
    log = tmp_path_factory.mktemp(f"{name}-server") / "server.log"
    out = tmp_path_factory.mktemp(f"{name}-report")
    with running_server(tiny_llama_path, log, "--block-size", "16", "--max-model-len", "4096") as url:
        before = scrape(url)
        code = cli.main(["run", "--server", url, "--workload", name, "--out", str(out), "--compare", "--no-progress",
                         "--requests", str(REQUESTS), "--turns", str(STEPS), "--concurrency", "2", "--warmup", "0",
                         "--system-tokens", "60", "--tool-output-tokens", "40", "--chars-per-token", "1.2",
                         "--max-prompt-tokens", "3500", "--model-params", "1e6"])
        after = scrape(url)
    report = json.loads((out / "report.json").read_text())
    records = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    return name, code, report["workloads"][name], records, before, after, out


def test_every_step_is_a_request_the_report_counts_as_the_server_did(run):
    name, code, w, records, before, after, out = run
    assert code == 0
    for phase in (w, w["baseline"]):
        assert (phase["requests"], phase["errors"], phase["unsent"]) == (REQUESTS, 0, 0)
        assert phase["ttft_ms"]["p50"] > 0
    assert len(records) == 2 * REQUESTS
    assert w["prompt_tokens"] == w["baseline"]["prompt_tokens"], "temperature 0: both phases take the same steps"
    assert w["baseline"]["cached_tokens"] == 0
    for counter, field in (("kvreuse_prompt_tokens_total", "prompt_tokens"),
                           ("kvreuse_generation_tokens_total", "completion_tokens")):
        assert metric(after, counter) - metric(before, counter) == w[field] + w["baseline"][field]
    assert f"## {name}: reuse per step" in (out / "report.md").read_text()


def test_each_step_extends_the_last_and_hits_its_prompt(run):
    _, _, w, records, *_ = run
    sessions: dict[str, list[dict]] = {}
    for r in records:
        if r["phase"] == "cached":
            sessions.setdefault(r["session"], []).append(r)
    assert sorted(len(s) for s in sessions.values()) == [2, 3]
    for steps in sessions.values():
        steps.sort(key=lambda r: r["turn"])
        assert [r["turn"] for r in steps] == list(range(len(steps)))
        for prev, cur in zip(steps, steps[1:]):
            # the previous prompt, the call the model made and the tool's output
            assert cur["prompt_tokens"] > prev["prompt_tokens"] + prev["completion_tokens"]
            assert cur["cached_tokens"] >= prev["prompt_tokens"]
    by_turn = {t["turn"]: t for t in w["by_turn"]}
    assert by_turn[0]["requests"] == 2 and by_turn[2]["requests"] == 1
    assert by_turn[1]["reuse_rate"] > 0.5 and by_turn[2]["reuse_rate"] > 0.5
