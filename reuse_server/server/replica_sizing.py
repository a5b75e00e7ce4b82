"""Dividing one machine between the replicas started on it (`reuse-server cluster`, replica_set).

A server left to size its own KV cache takes a share of what is available when it starts (kv/sizing.py); N
replicas started one after another would each take that share of what the ones before left, the first the
most. So where the replicas' flags name no pool size, the machine is read once here and each replica is given
an equal part as an explicit size: on the CPU the CPU rule's budget for N servers; on CUDA (the replicas on
one card) --gpu-memory-utilization divided by N, and the host tier's budget for N."""
from __future__ import annotations

import argparse
import contextlib
import io

from reuse_server.kv.sizing import Auto, MachineMemory, cpu_budget, read_machine_memory
from reuse_server.server.args import parse_serve_flags  # the serve flags' one definition
from reuse_server.server.launcher import names_pool


def divided(serve_args: list[str], replicas: int,
            machine: MachineMemory | None = None) -> tuple[list[str], str | None]:
    """(the replicas' flags with their part of the machine added, a line saying what each gets); the flags
    as they are (and None) where they size the pool themselves or cannot be read (each replica reports why).
    machine: the figures to divide (default: read now)."""
    if names_pool(serve_args):
        return list(serve_args), None
    args = _serve_flags(serve_args)
    if args is None:
        return list(serve_args), None
    usable = (machine or read_machine_memory()).usable
    host_tier = cpu_budget(usable, replicas, args.kv_cache_share)
    if args.device.startswith("cuda"):
        utilization = args.gpu_memory_utilization / replicas
        extra = ["--gpu-memory-utilization", f"{utilization:.6g}"]
        note = f"each of the {replicas} replicas: --gpu-memory-utilization {utilization:.3g} of the card"
        if isinstance(args.cpu_cache_size, Auto):
            extra += ["--cpu-cache-size", str(host_tier)]
            note += f", a host tier of {host_tier / 2**30:.2f} GiB"
    else:
        extra = ["--kv-cache-memory", str(host_tier)]
        note = (f"each of the {replicas} replicas: a KV pool of {host_tier / 2**30:.2f} GiB ({args.kv_cache_share:g} "
                f"of the {usable / 2**30:.2f} GiB available, less a reserve each, divided by {replicas})")
    return [*serve_args, *extra], note


def _serve_flags(serve_args: list[str]) -> argparse.Namespace | None:
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return parse_serve_flags(serve_args)
    except SystemExit:
        return None
