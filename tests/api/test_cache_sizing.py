"""The KV cache's start-up sizing as a real server reports it (GET /v1/cache/stats `sizing`, and its start-up
log line): the default rule on this machine, and explicit sizes winning. The default server here is started
with --kv-cache-share 0.01 so that CI's servers stay small; the rule is the default one."""
from __future__ import annotations

import httpx
import pytest

from reuse_server.kv.sizing import CPU_RESERVE, cpu_budget, read_machine_memory
from server_process import running_server

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BS = 4
MiB = 1 << 20


def stats(url: str) -> dict:
    return httpx.get(url + "/v1/cache/stats").json()


def test_a_default_server_sizes_its_pool_from_the_machine_and_says_so(tiny_llama_path, tmp_path):
    log = tmp_path / "server.log"
    # --kv-cache-memory auto is the default; named here only so the test helper adds no small pool of its own
    with running_server(tiny_llama_path, log, "--block-size", str(BS), "--kv-cache-memory", "auto",
                        "--kv-cache-share", "0.01", "--log-level", "info") as url:
        body = stats(url)
    sizing, device = body["sizing"], body["device"]
    assert (sizing["pool"], sizing["host_tier"], sizing["host_tier_bytes"], sizing["device"]) == (
        "auto", "off", 0, "cpu")
    machine = sizing["machine"]
    assert machine["source"] == "/proc/meminfo" and machine["total"] == read_machine_memory().total
    assert 0 < machine["usable"] <= machine["available"] <= machine["total"]
    # the figures it reports are the ones its rule was applied to
    assert (sizing["rule"]["share"], sizing["rule"]["reserve_bytes"]) == (0.01, CPU_RESERVE)
    assert sizing["pool_bytes"] == cpu_budget(machine["usable"], share=0.01)
    # and the pool that exists is that budget in whole blocks
    assert sizing["pool_blocks"] == device["total_blocks"] and sizing["pool_tokens"] == device["total_blocks"] * BS
    assert 0 <= sizing["pool_bytes"] - device["pool_bytes"] < device["bytes_per_block"]
    assert body["tiers"] == {}
    assert "available at start" in sizing["why"]
    assert "KV cache sizing (auto pool, off host tier)" in log.read_text()


def test_explicit_sizes_win_over_the_machine(tiny_llama_path, tmp_path):
    with running_server(tiny_llama_path, tmp_path / "server.log", "--block-size", str(BS), "--kv-cache-memory",
                        "48MiB", "--cpu-cache-size", "16MiB", "--no-blend-key-shift") as url:
        body = stats(url)
    sizing = body["sizing"]
    assert (sizing["pool"], sizing["pool_bytes"], sizing["host_tier"], sizing["host_tier_bytes"]) == (
        "explicit", 48 * MiB, "explicit", 16 * MiB)
    assert sizing["pool_blocks"] == body["device"]["total_blocks"] == 48 * MiB // body["device"]["bytes_per_block"]
    assert "host" in body["tiers"]
    assert sizing["why"].startswith("--kv-cache-memory as given")
