"""Replicas on one machine divide it (server/replica_sizing.py): flags that size no pool get an equal explicit
part each; flags that size it, or that cannot be read, are left as they are."""
from reuse_server.kv.sizing import GiB, MachineMemory, cpu_budget
from reuse_server.server.replica_sizing import divided

MACHINE = MachineMemory(total=24 * GiB, available=21 * GiB)


def flag(args: list[str], name: str) -> str | None:
    """The value argparse reads: the last one given."""
    at = [i for i, arg in enumerate(args) if arg == name]
    return args[at[-1] + 1] if at else None


def test_cpu_replicas_get_an_equal_explicit_pool_each():
    args, note = divided(["--model", "m"], 3, MACHINE)
    assert int(flag(args, "--kv-cache-memory")) == cpu_budget(21 * GiB, replicas=3) == 3 * GiB
    assert "each of the 3 replicas" in note
    two, _ = divided(["--model", "m", "--kv-cache-share", "0.25"], 2, MACHINE)
    assert int(flag(two, "--kv-cache-memory")) == cpu_budget(21 * GiB, replicas=2, share=0.25)


def test_cuda_replicas_divide_the_card_and_the_host_tier():
    args, _ = divided(["--device", "cuda", "--gpu-memory-utilization", "0.8"], 2, MACHINE)
    assert float(flag(args, "--gpu-memory-utilization")) == 0.4 and args.count("--gpu-memory-utilization") == 2
    assert int(flag(args, "--cpu-cache-size")) == cpu_budget(21 * GiB, replicas=2)
    kept, _ = divided(["--device", "cuda", "--cpu-cache-size", "0"], 2, MACHINE)
    assert kept.count("--cpu-cache-size") == 1


def test_explicit_or_unreadable_flags_are_left_alone():
    for args in (["--kv-cache-memory", "512MiB"], ["--num-gpu-blocks=64"], ["--no-such-flag"]):
        assert divided(args, 2, MACHINE) == (args, None)
