"""Workload generators: deterministic for a seed, exactly the requested size, within the prompt
budget, and producing the sharing (or the breaks in it) each one claims."""
from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path

import pytest

from loadgen.errors import UsageError
from loadgen.workloads import WORKLOAD_NAMES, WorkloadConfig, build_workload, parse_workload_names
from loadgen.workloads import agent_loop, rag_shuffle, trace
from loadgen.workloads.text import content_text, estimate_chat_tokens
from loadgen_inputs import write_docs, write_trace

SHARED_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "traces" / "conversation_trace.jsonl"


@pytest.fixture()
def cfg(tmp_path) -> WorkloadConfig:
    return WorkloadConfig(seed=3, requests=20, output_tokens=16, max_prompt_tokens=1500, system_tokens=300,
                          tool_output_tokens=90, agents=3, turns=6, docs_file=write_docs(tmp_path / "docs.txt"),
                          doc_tokens=300, rag_k=3, rag_pool=8, trace_file=write_trace(tmp_path / "trace.jsonl"),
                          trace_block_tokens=16, vocab_size=320)


def by_session(workload):
    out: dict[str, list] = {}
    for r in workload.requests:
        out.setdefault(r.session, []).append(r)
    return out


def is_prefix(a, b) -> bool:
    return len(a) <= len(b) and tuple(b[: len(a)]) == tuple(a)


@pytest.mark.parametrize("name", WORKLOAD_NAMES)
def test_same_seed_same_prompts_other_seed_other_prompts(cfg, name):
    first = build_workload(name, cfg).requests
    again = build_workload(name, cfg).requests
    other = build_workload(name, dataclasses.replace(cfg, seed=4)).requests
    assert first == again
    assert [r.messages or r.prompt_token_ids for r in first] != [r.messages or r.prompt_token_ids for r in other]


@pytest.mark.parametrize("name", [n for n in WORKLOAD_NAMES if n != "trace"])
@pytest.mark.parametrize("requests", [1, 7, 20])
def test_exact_request_count_and_prompts_within_budget(cfg, name, requests):
    workload = build_workload(name, dataclasses.replace(cfg, requests=requests))
    assert len(workload.requests) == requests
    for r in workload.requests:
        assert r.max_tokens == cfg.output_tokens
        assert estimate_chat_tokens(r.messages, cfg.chars_per_token) <= cfg.max_prompt_tokens


def test_agent_loop_prompts_extend_the_previous_turn(cfg):
    workload = build_workload("agent-loop", cfg)
    sessions = by_session(workload)
    assert len(sessions) >= cfg.agents
    systems = {r.messages[0]["content"] for r in workload.requests}
    assert len(systems) == 1, "all agents share one system prompt with the tool definitions"
    assert estimate_chat_tokens([{"content": systems.pop()}], cfg.chars_per_token) >= cfg.system_tokens
    for turns in sessions.values():
        for prev, cur in zip(turns, turns[1:]):
            assert len(cur.messages) > len(prev.messages)
            assert is_prefix(prev.messages, cur.messages)
    assert max(len(t) for t in sessions.values()) >= 3


def test_agent_loop_timestamp_changes_near_the_top_only(cfg):
    workload = build_workload("agent-loop-timestamp", cfg)
    for turns in by_session(workload).values():
        for prev, cur in zip(turns, turns[1:]):
            a, b = prev.messages[0]["content"], cur.messages[0]["content"]
            assert a != b
            first_diff = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            assert first_diff < 80, "the changing clock sits near the top of the context"
            assert a.splitlines()[2:] == b.splitlines()[2:], "only the clock line changes"
            assert is_prefix(prev.messages[1:], cur.messages[1:])


def test_agent_loop_shuffled_tools_reorders_results_it_already_sent(cfg):
    workload = build_workload("agent-loop-shuffled-tools", cfg)
    reordered = 0
    for turns in by_session(workload).values():
        for prev, cur in zip(turns, turns[1:]):
            assert not Counter(map(str, prev.messages)) - Counter(map(str, cur.messages)), "nothing is dropped"
            if len(prev.messages) > 2 + 1 + agent_loop.PARALLEL_TOOLS:  # at least one step with its results
                assert not is_prefix(prev.messages, cur.messages)
                assert prev.messages[:3] == cur.messages[:3], "system, task and first thought still match"
                reordered += 1
    assert reordered >= 3


def test_agent_loop_compaction_summarizes_and_stays_in_budget(cfg):
    small = dataclasses.replace(cfg, max_prompt_tokens=900, turns=12, requests=24)
    compacted = build_workload("agent-loop-compaction", small)
    appended = build_workload("agent-loop", small)
    assert len(compacted.sessions) < len(appended.sessions), "compaction lets an episode outlive the budget"
    summaries = 0
    for turns in by_session(compacted).values():
        for prev, cur in zip(turns, turns[1:]):
            if not is_prefix(prev.messages, cur.messages):
                assert len(cur.messages) < len(prev.messages) + 1 + agent_loop.PARALLEL_TOOLS
                assert cur.messages[2]["content"].startswith("Summary of the earlier steps")
                assert cur.messages[:2] == prev.messages[:2]
                summaries += 1
    assert summaries >= 1
    assert all(estimate_chat_tokens(r.messages, small.chars_per_token) <= small.max_prompt_tokens for r in compacted.requests)


def _doc_ids(request) -> list[int]:
    body = content_text(request.messages[1]["content"])
    return [int(line[len("[doc "):-1]) for line in body.splitlines() if line.startswith("[doc ")]


def test_rag_shuffle_reuses_documents_in_new_orders(cfg):
    workload = build_workload("rag-shuffle", cfg)
    picks = [_doc_ids(r) for r in workload.requests]
    assert all(len(p) == cfg.rag_k == len(set(p)) for p in picks)
    assert all(0 <= d < cfg.rag_pool for p in picks for d in p)
    # documents recur at other positions, and the same pair of documents comes in both orders
    positions: dict[int, set[int]] = {}
    for p in picks:
        for pos, d in enumerate(p):
            positions.setdefault(d, set()).add(pos)
    assert sum(len(s) > 1 for s in positions.values()) >= cfg.rag_pool // 2
    ordered_pairs = {(a, b) for p in picks for i, a in enumerate(p) for b in p[i + 1:]}
    assert any((b, a) in ordered_pairs for a, b in ordered_pairs)
    # a document's text is identical wherever it appears, so non-prefix reuse can find it
    texts: dict[int, set[str]] = {}
    for r in workload.requests:
        body = content_text(r.messages[1]["content"])
        for block in body.split("[doc ")[1:]:
            doc_id, _, rest = block.partition("]\n")
            texts.setdefault(int(doc_id), set()).add(rest.split("\n\n")[0])
    assert all(len(v) == 1 for v in texts.values())
    first_docs = {p[0] for p in picks}
    assert len(first_docs) > 1, "the first document varies, so the prefix breaks early"


def test_shared_doc_everyone_asks_about_the_same_document(cfg):
    workload = build_workload("shared-doc", cfg)
    bodies = [r.messages[1]["content"] for r in workload.requests]
    doc = bodies[0].split("\n\nQuestion")[0]
    assert len(doc) >= 0.9 * cfg.doc_tokens * cfg.chars_per_token
    assert all(b.startswith(doc + "\n\nQuestion") for b in bodies)
    assert len({b[len(doc):] for b in bodies}) == len(bodies), "each user asks something else"
    assert len(workload.sessions) == cfg.requests


def test_multi_turn_grows_and_returning_users_come_back_last(cfg):
    workload = build_workload("multi-turn", dataclasses.replace(cfg, return_fraction=1.0, turns=4))
    ids = [s.id for s in workload.sessions]
    returns = [s for s in workload.sessions if s.after is not None]
    first_visits = [s for s in workload.sessions if s.after is None]
    assert returns and ids.index(returns[0].id) > max(ids.index(s.id) for s in first_visits)
    visits = {s.id: s for s in workload.sessions}
    for s in returns:
        before = visits[s.after]
        assert is_prefix(before.requests[-1].messages, s.requests[0].messages), "the returning user resends the history"
        assert s.requests[0].turn == before.requests[-1].turn + 1
    for s in workload.sessions:
        for prev, cur in zip(s.requests, s.requests[1:]):
            assert is_prefix(prev.messages, cur.messages) and len(cur.messages) == len(prev.messages) + 2
    none_return = build_workload("multi-turn", dataclasses.replace(cfg, return_fraction=0.0, turns=4))
    assert all(s.after is None for s in none_return.sessions)


def test_trace_blocks_follow_hash_ids(cfg):
    workload = build_workload("trace", cfg)
    rows = trace.read_trace(cfg.trace_file, 100)
    reqs = workload.requests
    assert len(reqs) == len(rows)
    B = cfg.trace_block_tokens
    for row, r in zip(rows, reqs):
        ids = r.prompt_token_ids
        assert len(ids) == min(-(-row["input_length"] * B // 512), len(row["hash_ids"]) * B)
        for j, h in enumerate(row["hash_ids"]):
            assert list(ids[j * B:(j + 1) * B]) == trace.block_tokens(cfg.seed, h, B, cfg.vocab_size)[: len(ids[j * B:(j + 1) * B])]
        assert all(trace.token_range(cfg.vocab_size)[0] <= t < cfg.vocab_size for t in ids)
        assert r.max_tokens == min(cfg.output_tokens, row["output_length"])
        assert r.arrival_s is None  # time_scale 0: no pacing
    # rows 0 and 2 share hash ids [0, 1, 2]; rows 0 and 1 share only [0]
    common = lambda a, b: next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))  # noqa: E731
    assert common(reqs[0].prompt_token_ids, reqs[2].prompt_token_ids) >= 3 * B - 1
    assert B <= common(reqs[0].prompt_token_ids, reqs[1].prompt_token_ids) < 2 * B
    assert common(reqs[0].prompt_token_ids, reqs[3].prompt_token_ids) < B


def test_trace_truncation_and_time_scale(cfg):
    small = dataclasses.replace(cfg, max_prompt_tokens=40, time_scale=0.5, requests=4)
    reqs = build_workload("trace", small).requests
    assert len(reqs) == 4
    assert max(len(r.prompt_token_ids) for r in reqs) == 40
    assert [r.arrival_s for r in reqs] == [0.0, 0.05, 0.125, 0.2]


@pytest.mark.skipif(not SHARED_TRACE.is_file(), reason=f"shared data absent: {SHARED_TRACE}")
def test_real_trace_shares_prefixes_exactly_where_hash_ids_do(cfg):
    real = dataclasses.replace(cfg, trace_file=SHARED_TRACE, requests=300, max_prompt_tokens=10**6, trace_block_tokens=8)
    reqs = build_workload("trace", real).requests
    rows = trace.read_trace(SHARED_TRACE, 300)
    first_block = {}
    for row, r in zip(rows, reqs):
        block = r.prompt_token_ids[:8]
        if len(block) == 8:
            assert first_block.setdefault(row["hash_ids"][0], block) == block
    assert len(set(first_block.values())) == len(first_block), "different ids, different blocks"


def test_workload_names_and_size_errors(cfg, tmp_path):
    assert parse_workload_names("all") == list(WORKLOAD_NAMES)
    assert parse_workload_names("trace, agent-loop,trace") == ["trace", "agent-loop"]
    with pytest.raises(UsageError, match="unknown workload nope"):
        parse_workload_names("agent-loop,nope")
    with pytest.raises(UsageError, match="--rag-k"):
        build_workload("rag-shuffle", dataclasses.replace(cfg, rag_k=9, rag_pool=8))
    with pytest.raises(UsageError, match="no such file"):
        build_workload("shared-doc", dataclasses.replace(cfg, docs_file=tmp_path / "missing.txt"))
    with pytest.raises(UsageError, match="--max-prompt-tokens"):
        build_workload("agent-loop", dataclasses.replace(cfg, max_prompt_tokens=100))
    with pytest.raises(UsageError, match="--doc-tokens"):
        build_workload("shared-doc", dataclasses.replace(cfg, doc_tokens=5000))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    with pytest.raises(UsageError, match="not a Mooncake trace record"):
        build_workload("trace", dataclasses.replace(cfg, trace_file=bad))
    assert rag_shuffle.document_block(3, "x") == "[doc 3]\nx\n\n"


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from([n for n in WORKLOAD_NAMES if n != "trace"]), requests=st.integers(1, 30),
       max_prompt=st.integers(200, 3000), cpt=st.sampled_from([1.2, 2.5, 4.0]), system=st.integers(20, 600),
       turns=st.integers(1, 10), agents=st.integers(1, 5), k=st.integers(1, 4), seed=st.integers(0, 2**31))
def test_any_sizes_give_exact_counts_within_budget_or_a_usage_error(cfg, name, requests, max_prompt, cpt, system, turns,
                                                                      agents, k, seed):
    sized = dataclasses.replace(cfg, requests=requests, max_prompt_tokens=max_prompt, chars_per_token=cpt,
                                system_tokens=system, turns=turns, agents=agents, rag_k=k, seed=seed)
    try:
        workload = build_workload(name, sized)
    except UsageError:
        return
    assert len(workload.requests) == requests
    assert all(estimate_chat_tokens(r.messages, cpt) <= max_prompt for r in workload.requests)
    ids = {s.id for s in workload.sessions}
    assert len(ids) == len(workload.sessions)
    seen: set[str] = set()
    for s in workload.sessions:  # a session only ever waits for one listed before it
        assert s.after is None or s.after in seen
        seen.add(s.id)
