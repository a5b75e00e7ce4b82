"""trace: replay a Mooncake-format trace (`timestamp` ms, `input_length`, `output_length`, `hash_ids`).

Traces carry no text, so each hash id becomes a deterministic block of `trace_block_tokens` token
ids (seeded by the workload seed and the id) and requests go to /v1/completions as token-id
prompts. Two requests share a prefix exactly when the trace says they share blocks. Lengths scale
with the block size (the trace's blocks are 512 tokens), prompts are cut to `max_prompt_tokens`,
and arrivals follow the trace's clock times `time_scale` (0: as fast as concurrency allows).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from loadgen.errors import UsageError
from loadgen.workloads.spec import RequestSpec, Session, Workload, WorkloadConfig

TRACE_BLOCK = 512  # tokens per hash id in Mooncake traces
SHARED_TRACE = Path("data") / "traces" / "conversation_trace.jsonl"


def default_trace_file() -> Path | None:
    repo = Path(__file__).resolve().parents[2]
    for base in (repo.parent / "shared", Path.cwd().parent / "shared"):
        if (base / SHARED_TRACE).is_file():
            return base / SHARED_TRACE
    return None


def read_trace(path: Path, limit: int) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                rows.append({"timestamp": float(row["timestamp"]), "input_length": int(row["input_length"]),
                             "output_length": int(row["output_length"]), "hash_ids": [int(h) for h in row["hash_ids"]]})
            except (ValueError, KeyError, TypeError) as exc:
                raise UsageError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
    return rows


def token_range(vocab_size: int) -> tuple[int, int]:
    """Ids drawn from [low, vocab_size): the lowest ids are usually special tokens."""
    return min(32, vocab_size // 2), vocab_size


def block_tokens(seed: int, hash_id: int, size: int, vocab_size: int) -> list[int]:
    low, high = token_range(vocab_size)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, hash_id])))
    return rng.integers(low, high, size=size).tolist()


def prompt_for(row: dict, cfg: WorkloadConfig) -> list[int]:
    scale = cfg.trace_block_tokens / TRACE_BLOCK
    length = min(max(1, math.ceil(row["input_length"] * scale)), len(row["hash_ids"]) * cfg.trace_block_tokens,
                 cfg.max_prompt_tokens)
    ids: list[int] = []
    for h in row["hash_ids"]:
        if len(ids) >= length:
            break
        ids.extend(block_tokens(cfg.seed, h, cfg.trace_block_tokens, cfg.vocab_size))
    return ids[:length]


def build(name: str, cfg: WorkloadConfig) -> Workload:
    path = cfg.trace_file or default_trace_file()
    if path is None:
        raise UsageError(f"trace needs a Mooncake trace: pass --trace-file (the default ../shared/{SHARED_TRACE} was not found)")
    if not Path(path).is_file():
        raise UsageError(f"--trace-file {path}: no such file")
    if cfg.vocab_size < 2:
        raise UsageError("--vocab-size must be at least 2")
    rows = read_trace(Path(path), cfg.requests)
    if not rows:
        raise UsageError(f"{path}: the trace is empty")
    t0 = rows[0]["timestamp"]
    sessions = []
    for i, row in enumerate(rows):
        arrival = (row["timestamp"] - t0) / 1000.0 * cfg.time_scale if cfg.time_scale > 0 else None
        spec = RequestSpec(session=f"trace{i}", turn=0, max_tokens=max(1, min(cfg.output_tokens, row["output_length"])),
                           prompt_token_ids=tuple(prompt_for(row, cfg)), arrival_s=arrival)
        sessions.append(Session(id=spec.session, requests=[spec]))
    return Workload(name=name, sessions=sessions)
