"""The workloads `reuse-loadgen run` can drive, by name. Each `build(name, config)` returns a Workload."""
from __future__ import annotations

from typing import Callable

from loadgen.errors import UsageError
from loadgen.workloads import (agent_loop, agent_replay, agent_sdk, anthropic_tools, long_doc_qa, multi_turn,
                               rag_shuffle, shared_doc, trace)
from loadgen.workloads.spec import RequestSpec, Session, Workload, WorkloadConfig

# Workloads written in advance from the seed: `all` runs these.
BUILDERS: dict[str, Callable[[str, WorkloadConfig], Workload]] = {
    **{name: agent_loop.build for name in agent_loop.VARIANTS},
    "rag-shuffle": rag_shuffle.build,
    "shared-doc": shared_doc.build,
    "long-doc-qa": long_doc_qa.build,
    "multi-turn": multi_turn.build,
    "trace": trace.build,
}
WORKLOAD_NAMES = tuple(BUILDERS)
# Workloads whose prompts depend on the model's answers (a real agent framework) or on a real agent's recording
# made at run time (agent-replay): run only when named.
LIVE_BUILDERS: dict[str, Callable[[str, WorkloadConfig], Workload]] = {
    agent_sdk.NAME: agent_sdk.build,
    agent_sdk.RESPONSES_NAME: agent_sdk.build,
    anthropic_tools.NAME: anthropic_tools.build,
    **{name: agent_replay.build for name in agent_replay.AGENTS},
}


def parse_workload_names(text: str) -> list[str]:
    """`a,b,c` or `all`; unknown names are a usage error."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if names == ["all"]:
        return list(WORKLOAD_NAMES)
    unknown = [n for n in names if n not in BUILDERS and n not in LIVE_BUILDERS]
    if unknown or not names:
        raise UsageError(f"unknown workload {', '.join(unknown) or repr(text)}; choose from "
                         f"{', '.join(WORKLOAD_NAMES + tuple(LIVE_BUILDERS))} or all")
    return list(dict.fromkeys(names))


def build_workload(name: str, config: WorkloadConfig) -> Workload:
    return {**BUILDERS, **LIVE_BUILDERS}[name](name, config)


__all__ = ["BUILDERS", "LIVE_BUILDERS", "WORKLOAD_NAMES", "RequestSpec", "Session", "Workload", "WorkloadConfig",
           "build_workload", "parse_workload_names"]
