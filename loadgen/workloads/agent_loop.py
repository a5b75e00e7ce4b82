"""agent-loop: agents that replay their whole context every iteration.

Each agent iteration sends: the system prompt with tool definitions (shared by all agents), the
agent's task, then every earlier step (the agent's reasoning and the outputs of the tools it
called, several in parallel). Variants break a pure prefix the way real agents do:

- `agent-loop`                 append-only: each prompt extends the previous one.
- `agent-loop-timestamp`       a clock line near the top of the system prompt changes every step.
- `agent-loop-shuffled-tools`  parallel tool results are re-serialized in a different order each step.
- `agent-loop-compaction`      when the context grows past 60% of the budget, the oldest half of the
                               steps is replaced by a summary.

An episode ends when the next prompt would not fit `max_prompt_tokens` (compaction aside); the
agent then starts a new task in a new session.
"""
from __future__ import annotations

import json
import math
import random

from loadgen.errors import UsageError
from loadgen.workloads.spec import RequestSpec, Session, Workload, WorkloadConfig
from loadgen.workloads.text import WORDS, estimate_chat_tokens, paragraph, sentence

VARIANTS = {
    "agent-loop": "append-only",
    "agent-loop-timestamp": "timestamp",
    "agent-loop-shuffled-tools": "shuffled-tools",
    "agent-loop-compaction": "compaction",
}
PARALLEL_TOOLS = 3
COMPACTION_AT = 0.6  # fraction of max_prompt_tokens
INTRO = "You are an autonomous agent.\n"


def tool_names(seed: int, count: int) -> list[str]:
    rng = random.Random(f"agent-tools:{seed}")
    verbs = ("search", "read", "write", "list", "run", "fetch", "update", "delete", "query", "open")
    names: list[str] = []
    while len(names) < count:
        name = f"{rng.choice(verbs)}_{rng.choice(WORDS)}"
        if name not in names:
            names.append(name)
    return names


def system_prompt(cfg: WorkloadConfig) -> tuple[str, list[str]]:
    """Instructions plus JSON tool definitions, about `system_tokens` long, shared by every agent."""
    rng = random.Random(f"agent-system:{cfg.seed}")
    target = cfg.tokens_to_chars(cfg.system_tokens)
    head = (f"{INTRO}Work step by step. At each step think, then call one or more "
            "tools. Available tools:\n")
    tools: list[str] = []
    names = tool_names(cfg.seed, 64)
    defs: list[str] = []
    i = 0
    while len(head) + sum(len(d) + 1 for d in defs) < target or not defs:
        name = names[i] if i < len(names) else f"{names[i % len(names)]}_{i}"
        params = {w: {"type": "string", "description": sentence(rng, 4, 9)} for w in rng.sample(WORDS, 2)}
        defs.append(json.dumps({"name": name, "description": sentence(rng), "parameters": {"type": "object", "properties": params}}))
        tools.append(name)
        i += 1
    return head + "\n".join(defs), tools


def with_timestamp(system: str, agent: int, episode: int, step: int) -> str:
    """The clock line goes right after the first line; agents started at different times."""
    seconds = 9 * 3600 + 613 * agent + 3701 * episode + 17 * step
    clock = f"Current time: 2025-03-14T{seconds // 3600 % 24:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}Z (step {step})\n"
    return INTRO + clock + system[len(INTRO):]


class _Step:
    """One agent step as it appears in later contexts: its reasoning, then its tool results."""

    def __init__(self, rng: random.Random, cfg: WorkloadConfig, tools: list[str], index: int):
        called = [rng.choice(tools) for _ in range(PARALLEL_TOOLS)]  # parallel calls, a tool maybe twice
        reply_chars = cfg.tokens_to_chars(min(cfg.output_tokens, 48))
        thought = paragraph(rng, max(1, reply_chars - 60))
        self.assistant = {"role": "assistant", "content": f"Thought: {thought} Action: call {', '.join(called)}."}
        per_tool = cfg.tokens_to_chars(cfg.tool_output_tokens / len(called))
        self.tool_results = [
            {"role": "user", "content": f"Tool result [{name} #{index}.{j}]: {paragraph(rng, per_tool)}"}
            for j, name in enumerate(called)
        ]


def _context(system: str, task: dict, steps: list[_Step], orders: list[list[int]] | None, summary: dict | None) -> list[dict]:
    messages = [{"role": "system", "content": system}, task]
    if summary is not None:
        messages.append(summary)
    for k, step in enumerate(steps):
        messages.append(step.assistant)
        order = orders[k] if orders is not None else range(len(step.tool_results))
        messages.extend(step.tool_results[j] for j in order)
    return messages


def _new_order(rng: random.Random, previous: list[int]) -> list[int]:
    order = list(previous)
    while len(order) > 1 and order == previous:
        rng.shuffle(order)
    return order


def _episode(cfg: WorkloadConfig, variant: str, agent: int, episode: int, turns: int, base_system: str, tools: list[str]) -> list[RequestSpec]:
    rng = random.Random(f"agent-loop:{variant}:{cfg.seed}:{agent}:{episode}")
    session = f"agent{agent}-ep{episode}"
    task = {"role": "user", "content": f"Task for agent {agent}: {paragraph(rng, cfg.tokens_to_chars(60))}"}
    steps: list[_Step] = []
    orders: list[list[int]] = []
    summary: dict | None = None
    out: list[RequestSpec] = []
    budget = cfg.max_prompt_tokens
    for turn in range(turns):
        system = with_timestamp(base_system, agent, episode, turn) if variant == "timestamp" else base_system
        if variant == "shuffled-tools":
            orders = [_new_order(rng, o) for o in orders]
        messages = _context(system, task, steps, orders if variant == "shuffled-tools" else None, summary)
        size = estimate_chat_tokens(messages, cfg.chars_per_token)
        if variant == "compaction" and size > COMPACTION_AT * budget and len(steps) >= 2:
            dropped = len(steps) // 2
            summary = {"role": "user", "content": f"Summary of the earlier steps (compacted at step {turn}): "
                                                  f"{paragraph(rng, cfg.tokens_to_chars(50))}"}
            steps = steps[dropped:]
            messages = _context(system, task, steps, None, summary)
            size = estimate_chat_tokens(messages, cfg.chars_per_token)
        if size > budget:
            if turn == 0:
                raise UsageError(
                    f"agent-loop: the first prompt (~{size} tokens) exceeds --max-prompt-tokens {budget}; "
                    "lower --system-tokens or raise --max-prompt-tokens")
            break
        out.append(RequestSpec(session=session, turn=turn, max_tokens=cfg.output_tokens, messages=tuple(messages)))
        steps.append(_Step(rng, cfg, tools, turn))
        orders.append(list(range(len(steps[-1].tool_results))))
    return out


def build(name: str, cfg: WorkloadConfig) -> Workload:
    variant = VARIANTS[name]
    base_system, tools = system_prompt(cfg)
    agents = max(1, min(cfg.agents, cfg.requests))
    per_episode = max(1, min(cfg.turns, math.ceil(cfg.requests / agents)))
    sessions: list[Session] = []
    last_episode: dict[int, str] = {}
    remaining = cfg.requests
    episode = 0
    while remaining > 0:
        for agent in range(agents):
            if remaining <= 0:
                break
            specs = _episode(cfg, variant, agent, episode, min(per_episode, remaining), base_system, tools)
            sessions.append(Session(id=specs[0].session, requests=specs, after=last_episode.get(agent)))
            last_episode[agent] = specs[0].session
            remaining -= len(specs)
        episode += 1
    return Workload(name=name, sessions=sessions)
