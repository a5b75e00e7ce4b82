"""`reuse-server cluster` as a user runs it: one command starts Redis, the replicas and the gateway, prints
the URLs, serves through the gateway, and on SIGTERM stops everything in order; flags the cluster owns are
refused."""
from __future__ import annotations

import re
import signal
import subprocess
import sys

import httpx
import pytest
from openai import OpenAI

from reuse_server.server.launcher import free_port
from server_process import REPO, read_until

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)


def refuses(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=2)
    except httpx.TransportError:
        return True
    return False


def test_one_command_runs_redis_replicas_and_the_gateway_and_stops_them_all(tiny_llama_path, tmp_path):
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "reuse_server.server.cli", "cluster", "--replicas", "2", "--policy", "power_of_two",
         "--port", str(port), "--log-dir", str(tmp_path), "--", "--model", str(tiny_llama_path),
         "--served-model-name", "tiny", "--block-size", "4", "--num-gpu-blocks", "256", "--no-blend-key-shift"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text = read_until(proc, "ready")
        gateway = f"http://127.0.0.1:{port}"
        assert f"gateway:  {gateway}" in text
        replicas = re.findall(r"replica \d: (http://\S+)", text)
        redis_port = int(re.search(r"redis:\s+redis://127.0.0.1:(\d+)/0", text).group(1))
        assert len(replicas) == 2
        client = OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
        prompt = "The quick brown fox jumps over the lazy dog. " * 4
        first = client.completions.create(model="tiny", prompt=prompt, max_tokens=4)
        again = [client.completions.create(model="tiny", prompt=prompt, max_tokens=4) for _ in range(3)]
        # whichever replica each landed on, the prompt came from a device pool or from the shared Redis
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        full_blocks = (first.usage.prompt_tokens - 1) // 4 * 4  # the last prompt token is always computed
        assert all(a.usage.prompt_tokens_details.cached_tokens >= full_blocks for a in again), again
        # the gateway polls each replica's /get_load for power_of_two (-1 would mean it could not read it)
        loads = httpx.get(gateway + "/get_loads").json()
        assert all(w["load"] >= 0 for w in loads["workers"]), loads
        assert (tmp_path / "gateway.log").exists() and (tmp_path / "replica-1.log").exists()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and "stopped" in out
        assert refuses(gateway) and all(refuses(url) for url in replicas)
        with pytest.raises(OSError):  # Redis is gone too
            import socket
            socket.create_connection(("127.0.0.1", redis_port), timeout=2).close()
        for i in range(2):
            log = (tmp_path / f"replica-{i}.log").read_text()
            assert "drained" in log and "Traceback" not in log  # each replica drained on SIGTERM
    finally:
        if proc.poll() is None:
            proc.terminate()  # stops its children in order; a killed cluster would leave that to PDEATHSIG
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.parametrize("args, message", [
    (["--", "--port", "9"], "--port is set by the cluster"),
    (["--", "--redis-url=redis://x:1/0"], "--redis-url is set by the cluster"),
    (["--", "--host", "0.0.0.0"], "--host is set by the cluster"),
    (["--replicas", "1", "--policy", "power_of_two"], "needs at least 2 replicas"),
    (["--replicas", "0"], "must be at least 1"),
    (["--policy", "fastest"], "invalid choice"),
    (["--policy", "kv_aware"], "is not one of smg's"),  # the SGLang gateway reads no KV events
    (["--router", "vllm-router", "--", "--kv-events", "tcp://127.0.0.1:9"], "--kv-events is set by the cluster"),
    # only vllm-router's kv_aware reads the session ids the agents send (tests/server/test_session_routing.py)
    (["--session-affinity-ttl", "60"], "is for --router vllm-router with its kv_aware policy"),
    (["--router", "vllm-router", "--policy", "random", "--session-affinity-ttl", "0"], "is for --router vllm-router"),
    (["--router", "vllm-router", "--session-affinity-ttl", "-1"], "must not be negative"),
    (["--router", "vllm-router", "--session-affinity-ttl", "31536001"], "at most 31536000"),
])
def test_the_cluster_refuses_bad_flags_before_starting_anything(args, message):
    done = subprocess.run([sys.executable, "-m", "reuse_server.server.cli", "cluster", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr, done.stderr
