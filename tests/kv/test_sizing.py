"""The start-up sizing rules of the KV cache (kv/sizing.py) on given machine figures: what the docs promise
for a 24 GiB machine, the floor of a tiny one, the ceiling of a large one, a cgroup limit read from the files a
container has, replicas dividing a machine, the CUDA rule (vLLM's --gpu-memory-utilization), explicit sizes."""
import re
from pathlib import Path

import pytest

from reuse_server.kv.sizing import (AUTO, CPU_CEILING, CPU_FLOOR, CPU_RESERVE, CardMemory, GiB, MachineMemory, MiB,
                                    cpu_budget, gpu_pool_bytes, read_machine_memory, size_for_cpu, size_for_gpu)

# where the user reads how big the cache is by default (README links to it)
SIZING_DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def machine(available_gib: float, total_gib: float = 24, **cgroup) -> MachineMemory:
    return MachineMemory(total=int(total_gib * GiB), available=int(available_gib * GiB), **cgroup)


def test_a_24_gib_machine_gets_the_pool_the_docs_state():
    text = " ".join(SIZING_DOC.read_text().split())
    found = re.search(r"a machine with 24 GiB of RAM, (\d+) GiB of it available at start, gets a pool of "
                      r"([\d.]+) GiB and no host tier", text)
    assert found, "docs/operations.md no longer states the 24 GiB example"
    sizing = size_for_cpu(machine(float(found.group(1))), AUTO, AUTO)
    assert sizing.pool_bytes == pytest.approx(float(found.group(2)) * GiB, abs=0.01 * GiB)
    assert (sizing.pool, sizing.host_tier, sizing.host_tier_bytes) == ("auto", "off", 0)
    assert "available at start" in sizing.why and "host tier off" in sizing.why


def test_a_tiny_machine_gets_the_floor():
    for available in (0.2, 0.9, 1.2):
        sizing = size_for_cpu(machine(available, total_gib=2), AUTO, AUTO)
        assert sizing.pool_bytes == CPU_FLOOR, available
        assert "(the floor)" in sizing.why


def test_a_large_machine_stops_at_the_ceiling():
    sizing = size_for_cpu(machine(500, total_gib=512), AUTO, AUTO)
    assert sizing.pool_bytes == CPU_CEILING and "(the ceiling)" in sizing.why


def test_the_share_scales_what_is_taken_between_floor_and_ceiling():
    usable = 9 * GiB
    assert cpu_budget(usable, share=0.5) == 4 * GiB
    assert cpu_budget(usable, share=0.25) == 2 * GiB
    assert size_for_cpu(machine(9), AUTO, AUTO, share=0.25).rule["share"] == 0.25


def test_replicas_divide_the_machine_each_with_its_reserve():
    usable = 21 * GiB
    one, three = cpu_budget(usable), cpu_budget(usable, replicas=3)
    assert one == 10 * GiB
    assert three == int(0.5 * (usable - 3 * CPU_RESERVE) / 3)  # 3 GiB each
    assert 3 * three + 3 * CPU_RESERVE < usable
    with pytest.raises(ValueError):
        cpu_budget(usable, replicas=0)


def test_a_cgroup_limit_is_respected():
    roomy_host = machine(20, total_gib=24, cgroup_limit=4 * GiB, cgroup_usage=1 * GiB)
    assert roomy_host.usable == 3 * GiB
    sizing = size_for_cpu(roomy_host, AUTO, AUTO)
    assert sizing.pool_bytes == 1 * GiB  # 0.5 x (3 - 1)
    assert "cgroup limit" in sizing.why
    assert machine(2, cgroup_limit=8 * GiB, cgroup_usage=0).usable == 2 * GiB  # the host's figure is lower


def _fake_root(tmp_path: Path, cgroup_line: str, files: dict[str, str], available_kib: int = 20 << 20) -> Path:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(f"MemTotal:       {24 << 20} kB\nMemFree:        1000 kB\n"
                                               f"MemAvailable:   {available_kib} kB\n")
    (tmp_path / "proc" / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in files.items():
        path = tmp_path / "sys" / "fs" / "cgroup" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


def test_the_cgroup_v2_limit_is_read_from_the_process_cgroup(tmp_path):
    root = _fake_root(tmp_path, "0::/user.slice/job", {"user.slice/job/memory.max": f"{6 * GiB}\n",
                                                       "user.slice/job/memory.current": f"{2 * GiB}\n",
                                                       "user.slice/memory.max": "max\n"})
    read = read_machine_memory(root)
    assert (read.total, read.available) == (24 * GiB, 20 * GiB)
    assert (read.cgroup_limit, read.cgroup_usage, read.usable) == (6 * GiB, 2 * GiB, 4 * GiB)
    assert size_for_cpu(read, AUTO, AUTO).pool_bytes == int(1.5 * GiB)


def test_a_parent_cgroup_with_less_room_binds(tmp_path):
    root = _fake_root(tmp_path, "0::/a/b", {"a/b/memory.max": "max\n", "a/b/memory.current": f"{GiB}\n",
                                            "a/memory.max": f"{3 * GiB}\n", "a/memory.current": f"{GiB}\n"})
    assert read_machine_memory(root).usable == 2 * GiB


def test_the_cgroup_v1_limit_and_its_unlimited_value(tmp_path):
    root = _fake_root(tmp_path, "4:memory:/docker/abc", {"memory/docker/abc/memory.limit_in_bytes": f"{5 * GiB}\n",
                                                         "memory/docker/abc/memory.usage_in_bytes": f"{GiB}\n"})
    assert read_machine_memory(root).usable == 4 * GiB
    unlimited = _fake_root(tmp_path / "u", "4:memory:/", {"memory/memory.limit_in_bytes": "9223372036854771712\n"})
    read = read_machine_memory(unlimited)
    assert read.cgroup_limit is None and read.usable == 20 * GiB


def test_explicit_sizes_win():
    sizing = size_for_cpu(machine(23), 512 * MiB, 2 * GiB)
    assert (sizing.pool, sizing.pool_bytes, sizing.host_tier, sizing.host_tier_bytes) == (
        "explicit", 512 * MiB, "explicit", 2 * GiB)
    assert sizing.why.startswith("--kv-cache-memory as given")
    off = size_for_cpu(machine(23), AUTO, 0)
    assert (off.pool, off.host_tier, off.host_tier_bytes) == ("auto", "off", 0)


def test_the_card_gives_the_pool_what_utilization_leaves_after_weights_and_activations():
    card = CardMemory(total=80 * GiB, free=60 * GiB, weight_bytes=16 * GiB, activation_bytes=1 * GiB)
    assert gpu_pool_bytes(card) == int(0.9 * 80 * GiB) - 16 * GiB - 2 * GiB  # headroom 2x the activations
    assert gpu_pool_bytes(card, 0.5) == 40 * GiB - 18 * GiB
    # another process holds most of the card: never more than is free, less the activations
    crowded = CardMemory(total=80 * GiB, free=20 * GiB, weight_bytes=16 * GiB, activation_bytes=1 * GiB)
    assert gpu_pool_bytes(crowded) == 18 * GiB
    with pytest.raises(ValueError, match="no GPU memory left"):
        gpu_pool_bytes(CardMemory(total=16 * GiB, free=2 * GiB, weight_bytes=14 * GiB, activation_bytes=GiB))
    with pytest.raises(ValueError):
        gpu_pool_bytes(card, 0)


def test_on_cuda_the_host_tier_is_on_by_default():
    card = CardMemory(total=80 * GiB, free=60 * GiB, weight_bytes=16 * GiB, activation_bytes=1 * GiB)
    sizing = size_for_gpu(card, machine(21), AUTO, AUTO)
    assert (sizing.pool, sizing.host_tier) == ("auto", "auto")
    assert sizing.pool_bytes == gpu_pool_bytes(card) and sizing.host_tier_bytes == 10 * GiB
    assert sizing.card["weight_bytes"] == 16 * GiB and sizing.rule["gpu_memory_utilization"] == 0.9
    explicit = size_for_gpu(card, machine(21), 4 * GiB, 0, pool_flag="--num-gpu-blocks 100")
    assert (explicit.pool_bytes, explicit.host_tier_bytes, explicit.host_tier) == (4 * GiB, 0, "off")
    assert explicit.why.startswith("--num-gpu-blocks 100 as given")
