"""The workloads `reuse-loadgen run` can drive, by name. Each `build(name, config)` returns a Workload."""
from __future__ import annotations

from typing import Callable

from loadgen.errors import UsageError
from loadgen.workloads import agent_loop, multi_turn, rag_shuffle, shared_doc, trace
from loadgen.workloads.spec import RequestSpec, Session, Workload, WorkloadConfig

BUILDERS: dict[str, Callable[[str, WorkloadConfig], Workload]] = {
    **{name: agent_loop.build for name in agent_loop.VARIANTS},
    "rag-shuffle": rag_shuffle.build,
    "shared-doc": shared_doc.build,
    "multi-turn": multi_turn.build,
    "trace": trace.build,
}
WORKLOAD_NAMES = tuple(BUILDERS)


def parse_workload_names(text: str) -> list[str]:
    """`a,b,c` or `all`; unknown names are a usage error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(WORKLOAD_NAMES)
    unknown = [n for n in names if n not in BUILDERS]
    if unknown or not names:
        raise UsageError(f"unknown workload {', '.join(unknown) or repr(text)}; choose from {', '.join(WORKLOAD_NAMES)} or all")
    return list(dict.fromkeys(names))


def build_workload(name: str, config: WorkloadConfig) -> Workload:
    return BUILDERS[name](name, config)


__all__ = ["BUILDERS", "WORKLOAD_NAMES", "RequestSpec", "Session", "Workload", "WorkloadConfig",
           "build_workload", "parse_workload_names"]
