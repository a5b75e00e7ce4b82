"""multi-turn: ordinary chats that grow turn by turn; some users leave and come back later.

Each user's conversation is resent in full every turn (it extends the previous prompt). A share
(`return_fraction`) of the users stop half-way and return only after every other user has had
their first visit, by which time a small cache may have evicted their history.
"""
from __future__ import annotations

import random

from loadgen.errors import UsageError
from loadgen.workloads.spec import RequestSpec, Session, Workload, WorkloadConfig
from loadgen.workloads.text import estimate_chat_tokens, paragraph, question

SYSTEM = "You are a helpful assistant."


def conversation(cfg: WorkloadConfig, user: int, turns: int) -> list[RequestSpec]:
    rng = random.Random(f"multi-turn:{cfg.seed}:{user}")
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    out: list[RequestSpec] = []
    for turn in range(turns):
        ask = f"{paragraph(rng, cfg.tokens_to_chars(30))} {question(rng)}"
        messages.append({"role": "user", "content": ask})
        size = estimate_chat_tokens(messages, cfg.chars_per_token)
        if size > cfg.max_prompt_tokens:
            if turn == 0:
                raise UsageError(f"multi-turn: --max-prompt-tokens {cfg.max_prompt_tokens} is too small for one turn")
            break
        out.append(RequestSpec(session=f"user{user}", turn=turn, max_tokens=cfg.output_tokens, messages=tuple(messages)))
        messages.append({"role": "assistant", "content": paragraph(rng, cfg.tokens_to_chars(min(cfg.output_tokens, 64)))})
    return out


def build(name: str, cfg: WorkloadConfig) -> Workload:
    rng = random.Random(f"multi-turn-returns:{cfg.seed}")
    first_visits: list[Session] = []
    returns: list[Session] = []
    remaining = cfg.requests
    user = 0
    while remaining > 0:
        specs = conversation(cfg, user, min(cfg.turns, remaining))
        remaining -= len(specs)
        split = len(specs) // 2
        if split >= 1 and rng.random() < cfg.return_fraction:
            first = Session(id=f"user{user}", requests=specs[:split])
            first_visits.append(first)
            returns.append(Session(id=f"user{user}-return", requests=specs[split:], after=first.id))
        else:
            first_visits.append(Session(id=f"user{user}", requests=specs))
        user += 1
    return Workload(name=name, sessions=first_visits + returns)
