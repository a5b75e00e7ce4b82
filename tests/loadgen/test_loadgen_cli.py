"""`reuse-loadgen run`: bad flags and an unreachable server end with one clear line and exit 2."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from loadgen import cli
from reuse_server.server.launcher import free_port

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

REPO = Path(__file__).resolve().parents[2]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loadgen.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=120)


def test_unreachable_server_is_one_clear_line(tmp_path):
    port = free_port()
    out = tmp_path / "out"
    proc = run_cli("run", "--server", f"http://127.0.0.1:{port}", "--workload", "agent-loop", "--out", str(out),
                   "--requests", "2", "--no-progress")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert f"cannot reach the server at http://127.0.0.1:{port}" in proc.stderr
    assert not out.exists(), "nothing is written when nothing ran"


def test_bad_flag_value_is_an_argparse_error_not_a_traceback():
    proc = run_cli("run", "--server", "http://127.0.0.1:1", "--workload", "agent-loop", "--out", "x", "--requests", "0")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "argument --requests: expected a positive integer, got '0'" in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--workload", "agent-loop,nope"], "unknown workload nope"),
    (["--workload", "agent-loop", "--server", "127.0.0.1:8000"], "must start with http:// or https://"),
    (["--workload", "rag-shuffle", "--rag-k", "9", "--rag-pool", "4"], "--rag-k 9 is larger than --rag-pool 4"),
    (["--workload", "shared-doc", "--docs-file", "/nonexistent/docs.txt"], "no such file"),
    (["--workload", "trace", "--trace-file", "/nonexistent/trace.jsonl"], "no such file"),
    (["--workload", "agent-loop", "--max-prompt-tokens", "50"], "lower --system-tokens or raise --max-prompt-tokens"),
    (["--workload", "agent-loop", "--recompute-ratio", "0.2"], "--recompute-ratio needs --kv-blend on"),
])
def test_usage_errors(tmp_path, capsys, flags, message):
    argv = ["run", "--server", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path / "o"), "--no-progress"]
    if "--server" in flags:
        argv[1:3] = []
    assert cli.main(argv + flags) == 2
    err = capsys.readouterr().err
    assert err.startswith("reuse-loadgen run: error: ") and message in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("flags", [["--concurrency", "-1"], ["--duration", "0"], ["--return-fraction", "1.5"],
                                   ["--kv-blend", "maybe"], ["--time-scale", "fast"]])
def test_bad_values_exit_2(tmp_path, capsys, flags):
    with pytest.raises(SystemExit) as exc:
        cli.main(["run", "--server", "http://127.0.0.1:1", "--workload", "agent-loop", "--out", str(tmp_path)] + flags)
    assert exc.value.code == 2
    assert f"argument {flags[0]}" in capsys.readouterr().err
