"""`reuse-loadgen simulate`: replaying Mooncake traces through the radix cache, and its error messages."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from loadgen.cli import main
from loadgen.simulate import load_trace, replay

TRACE_BLOCK = 512
REAL_TRACE = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces" / "conversation_trace.jsonl"


def make_trace(seed=0, conversations=12, turns=4):
    """Chat-like requests: shared system prompts, conversations that grow, partial last blocks."""
    rng = np.random.default_rng(seed)
    next_id = iter(range(10**6))
    systems = [[next(next_id) for _ in range(rng.integers(1, 4))] for _ in range(3)]
    records = []
    for _ in range(conversations):
        history = list(systems[rng.integers(len(systems))])
        t = int(rng.integers(0, 1000))
        for _ in range(turns):
            history += [next(next_id) for _ in range(rng.integers(0, 3))]
            partial = int(rng.integers(0, TRACE_BLOCK))  # 0: the prompt ends on a block boundary
            ids = history + ([next(next_id)] if partial else [])
            records.append({"timestamp": t, "input_length": len(history) * TRACE_BLOCK + partial,
                            "output_length": int(rng.integers(1, 300)), "hash_ids": ids})
            t += int(rng.integers(0, 500))
    rng.shuffle(records)  # file order differs from time order
    return records


def write_trace(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reference_hit_tokens(records):
    """Unlimited prefix cache by hand: a full block hits when its whole chain of ids was seen in full before."""
    seen, hits = set(), 0
    for r in sorted(records, key=lambda r: r["timestamp"]):
        full = r["input_length"] // TRACE_BLOCK
        n = 0
        while n < full and tuple(r["hash_ids"][: n + 1]) in seen:
            n += 1
        hits += n * TRACE_BLOCK
        seen.update(tuple(r["hash_ids"][: k + 1]) for k in range(full))
    return hits


def run_cli(capsys, *args):
    code = main(["simulate", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def test_unlimited_replay_matches_a_hand_computed_prefix_cache(tmp_path, capsys):
    records = make_trace()
    trace = write_trace(tmp_path / "trace.jsonl", records)
    code, out, _ = run_cli(capsys, "--trace", trace)
    assert code == 0
    result = json.loads(out)
    prompt_tokens = sum(r["input_length"] for r in records)
    hits = reference_hit_tokens(records)
    assert hits > 0
    assert result["requests"] == len(records)
    assert result["prompt_tokens"] == prompt_tokens
    assert result["hit_tokens"] == hits
    assert result["token_hit_rate"] == pytest.approx(hits / prompt_tokens)
    assert result["block_hit_rate"] == pytest.approx(
        (hits // TRACE_BLOCK) / sum(len(r["hash_ids"]) for r in records))
    assert result["evicted_blocks"] == 0 and result["capacity_blocks"] is None


def test_enough_capacity_equals_unlimited_and_less_evicts(tmp_path):
    requests = load_trace(write_trace(tmp_path / "trace.jsonl", make_trace(seed=3)))
    unlimited = replay(requests)
    roomy = replay(requests, capacity_blocks=unlimited.cached_blocks)
    assert (roomy.hit_tokens, roomy.evicted_blocks) == (unlimited.hit_tokens, 0)
    tight = replay(requests, capacity_blocks=8)
    assert tight.evicted_blocks > 0 and tight.hit_tokens < unlimited.hit_tokens
    assert tight.cached_blocks <= 8


@pytest.mark.parametrize("seed", [5, 6])
def test_the_replay_hits_what_the_engines_block_manager_hits_on_the_same_prompts(tmp_path, seed):
    """The replay files blocks through the code the engine's block manager files them through (radix's
    publish): the same prompts, admitted, computed and released one at a time by a real BlockManager, hit the
    same tokens. Prompts end inside a cache block, where the engine (which always computes a prompt's last
    token) and the replay (which matches every full block) agree on what is matchable."""
    from reuse_server.engine.sampling_params import CacheOptions, SamplingParams
    from reuse_server.engine.sequence import Sequence
    from reuse_server.kv.block_manager import BlockManager
    from radix import RadixCache
    from loadgen.simulate import synthetic_prompt

    print(f"seed {seed}")
    bs = 16
    records = make_trace(seed=seed)
    for r in records:
        r["input_length"] -= r["input_length"] % bs == 0  # off a block boundary; as many trace blocks
    requests = load_trace(write_trace(tmp_path / "trace.jsonl", records))
    replayed = replay(requests, block_size=bs)
    blocks = BlockManager(RadixCache(sum(-(-r.input_length // bs) for r in requests), bs), bs)
    hits = 0
    for i, r in enumerate(requests):
        seq = Sequence(f"r{i}", synthetic_prompt(r.hash_ids, r.input_length).tolist(), SamplingParams(max_tokens=1),
                       CacheOptions())
        hits += blocks.admit(seq, seq.num_tokens).cached_tokens
        blocks.advance(seq, seq.num_tokens - seq.num_computed)
        blocks.release(seq)
    assert replayed.hit_tokens > 0 and hits == replayed.hit_tokens
    assert blocks.cache.stats().cached_blocks == replayed.cached_blocks


def test_lru_thrashes_on_a_cycle_one_block_larger_than_the_cache(tmp_path, capsys):
    # k one-block prompts (plus a partial block) requested round robin: LRU always evicts the next one.
    k, rounds = 6, 4
    records = [{"timestamp": i, "input_length": TRACE_BLOCK + 100, "output_length": 1,
                "hash_ids": [i % k, 1000 + i]} for i in range(k * rounds)]
    trace = write_trace(tmp_path / "cycle.jsonl", records)
    code, out, err = run_cli(capsys, "--trace", trace, "--capacity-blocks", f"{k - 1},{k},unlimited")
    assert code == 0
    curve = json.loads(out)["curve"]
    assert [p["capacity_blocks"] for p in curve] == [k - 1, k, None]
    assert curve[0]["hit_tokens"] == 0 and curve[0]["evicted_blocks"] == k * rounds - (k - 1)
    assert curve[1]["hit_tokens"] == curve[2]["hit_tokens"] == (rounds - 1) * k * TRACE_BLOCK
    assert "token hit rate" in err and "unlimited" in err  # the human-readable table


def test_smaller_cache_blocks_and_lfu_policy(tmp_path, capsys):
    trace = write_trace(tmp_path / "trace.jsonl", make_trace(seed=5))
    code, out, _ = run_cli(capsys, "--trace", trace, "--block-size", 128, "--capacity-blocks", 40, "--policy", "lfu")
    assert code == 0
    result = json.loads(out)
    assert (result["block_size"], result["policy"], result["capacity_blocks"]) == (128, "lfu", 40)
    assert result["cached_blocks"] <= 40 and result["hit_tokens"] % 128 == 0


@pytest.mark.parametrize(
    "lines, extra_args, message",
    [
        (None, ["--block-size", "3"], "power of two"),
        (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "", "{not json"], [], "line 3"),
        (['{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}', '{"timestamp": 1}'], [],
         "line 2: missing field 'input_length'"),
        (['{"timestamp": 0, "input_length": 1500, "output_length": 1, "hash_ids": [1, 2]}'], [],
         "line 1: input_length 1500 needs 3 hash_ids"),
        (['{"timestamp": 0, "input_length": 1024, "output_length": 1, "hash_ids": [1, -2]}'], [], "line 1"),
        (['{"timestamp": 0, "input_length": 2000, "output_length": 1, "hash_ids": [1, 2, 3, 4]}'],
         ["--capacity-blocks", "2"], "smaller than one request"),
        (None, ["--capacity-blocks", "100,lots"], "'lots' is not a whole number"),
        (None, ["--capacity-blocks", "0"], "at least 1 block"),
        ([""], [], "holds no requests"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_code_2(tmp_path, capsys, lines, extra_args, message):
    if lines is None:
        trace = write_trace(tmp_path / "trace.jsonl", make_trace(conversations=2))
    else:
        trace = tmp_path / "bad.jsonl"
        trace.write_text("\n".join(lines) + "\n")
    code, out, err = run_cli(capsys, "--trace", trace, *extra_args)
    assert code == 2 and out == ""
    assert message in err and "Traceback" not in err
    assert err.startswith("reuse-loadgen simulate: error:")


def test_missing_file_from_a_real_process_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "loadgen.cli", "simulate", "--trace", str(tmp_path / "nope.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cannot read trace" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(not REAL_TRACE.exists(), reason=f"shared Mooncake trace not found at {REAL_TRACE}")
def test_real_mooncake_trace_hit_rate_and_capacity_curve(capsys):
    code, out, err = run_cli(capsys, "--trace", REAL_TRACE, "--capacity-blocks", "5000,50000,unlimited")
    assert code == 0
    curve = json.loads(out)["curve"]
    assert curve[-1]["requests"] == 12031
    assert round(curve[-1]["token_hit_rate"], 4) == 0.3734
    assert curve[0]["token_hit_rate"] < curve[1]["token_hit_rate"] < curve[2]["token_hit_rate"]
