"""`reuse-loadgen aiperf`: the trace input it builds for aiperf, the offline tokenizer cache, and one real aiperf
run (from `make aiperf`'s `.venv-aiperf`) against a real server, checked against the server's own counters."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from loadgen import cli
from loadgen.aiperf import DEFAULT_AIPERF, lay_hub_cache, shared_block_share, trace_records
from loadgen.errors import UsageError
from server_process import running_server
from tiny_checkpoint import write_tiny_checkpoint


def write_trace(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trace_records_keep_the_traces_shared_prefixes_at_our_block_size(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 500, "input_length": 1200, "output_length": 300, "hash_ids": [7, 8, 9]},
        {"timestamp": 700, "input_length": 2048, "output_length": 2, "hash_ids": [7, 8, 10, 11]},
        {"timestamp": 900, "input_length": 10, "output_length": 5, "hash_ids": []},  # nothing to send
        {"timestamp": 950, "input_length": 100, "output_length": 5, "hash_ids": [12]},
    ])
    records = trace_records(trace, requests=10, max_blocks=3, block_tokens=128, trace_block_tokens=512,
                            output_tokens=16)
    assert [r["hash_ids"] for r in records] == [[7, 8, 9], [7, 8, 10], [12]]
    assert [r["timestamp"] for r in records] == [0, 200, 450]  # relative to the first
    # 1,200 of 3 x 512 tokens -> a quarter at 128-token blocks; the second is cut to 3 full blocks
    assert [r["input_length"] for r in records] == [300, 384, 25]
    assert [r["output_length"] for r in records] == [16, 2, 5]
    assert len(trace_records(trace, requests=1, max_blocks=3, block_tokens=128, trace_block_tokens=512,
                             output_tokens=16)) == 1


def test_a_trace_without_usable_records_is_a_usage_error(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [{"timestamp": 0, "input_length": 5, "hash_ids": []}])
    with pytest.raises(UsageError, match="no usable record"):
        trace_records(trace, 4, 4, 128, 512, 16)


def test_the_best_possible_share_counts_blocks_whose_whole_prefix_came_before():
    records = [{"hash_ids": [1, 2]}, {"hash_ids": [1, 3]}, {"hash_ids": [1, 2, 4]}, {"hash_ids": [5, 2]}]
    # (1) (1,2) new; (1) seen (1,3) new; (1) (1,2) seen (1,2,4) new; (5) (5,2) new: 3 of 9
    assert shared_block_share(records) == pytest.approx(3 / 9)


def test_the_tokenizer_cache_loads_offline_by_hub_name(tmp_path):
    model = write_tiny_checkpoint(tmp_path / "model", arch="llama")
    name = lay_hub_cache(model, tmp_path / "hf-home", "local/tiny")
    # what aiperf does offline: resolve the snapshot from the cache alone, then load the tokenizer from it
    script = ("from huggingface_hub import snapshot_download; from transformers import AutoTokenizer; "
              f"p = snapshot_download({name!r}, local_files_only=True); "
              "print(len(AutoTokenizer.from_pretrained(p)('hello there')['input_ids']))")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 0
    with pytest.raises(UsageError, match="holds no tokenizer"):
        lay_hub_cache(tmp_path, tmp_path / "elsewhere")


@pytest.mark.server
@pytest.mark.skipif(not DEFAULT_AIPERF.is_file(), reason="aiperf is installed by `make aiperf` (make test runs it)")
def test_aiperf_replays_a_trace_and_the_server_counts_its_shared_prefixes(tmp_path, capsys):
    model = write_tiny_checkpoint(tmp_path / "model", arch="llama")
    trace = write_trace(tmp_path / "trace.jsonl", [
        {"timestamp": i, "input_length": 4 * 512, "output_length": 4, "hash_ids": [0, 1, 100 + i, 200 + i]}
        for i in range(4)])
    with running_server(model, tmp_path / "server.log", "--block-size", "16", "--max-model-len", "1024") as url:
        code = cli.main(["aiperf", "--url", url, "--tokenizer-dir", str(model), "--runs", "trace",
                         "--trace", str(trace), "--requests", "4", "--concurrency", "1", "--block-tokens", "32",
                         "--output-tokens", "4", "--out-dir", str(tmp_path / "out"), "--timeout", "900"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(rows) == 1
    row = rows[0]
    # every request was answered; aiperf counts as its own error an answer whose few random tokens decode to
    # no text yet (a partial UTF-8 sequence of the tiny byte-level tokenizer), so the two are summed
    assert row["run"] == "trace" and row["requests"] >= 1 and row["requests"] + row["errors"] == 4
    assert row["best_share"] == pytest.approx(6 / 16)  # blocks (0) and (0,1) of the last three requests
    # every later request reuses the first two blocks' text: the server counted hits, and aiperf saw cached
    # tokens in the usage of the answers it kept
    assert row["server_prompt_tokens"] > 0 and row["server_cached_tokens"] > 0
    assert 0 < row["cached_tokens_reported"] <= row["server_cached_tokens"] or row["requests"] == 1
