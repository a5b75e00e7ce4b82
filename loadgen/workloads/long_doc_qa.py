"""long-doc-qa: LMCache's long-document QA benchmark (benchmarks/long_doc_qa in LMCache): `documents`
distinct documents of `doc_tokens`, each asked once in order (the first pass, all misses), then asked again
in a shuffled order, each as often as the request count allows (36 requests over 12 documents: each twice).

The second pass hits only what the cache kept of the first: a working set larger than the cache, under LRU
and a shuffled order, evicts each document just before it comes back. Every request of the second pass waits
for the first pass to end (`after`), so its time-to-first-token measures the cache, not the cold prefills.
"""
from __future__ import annotations

import random

from loadgen.errors import UsageError
from loadgen.workloads.spec import RequestSpec, Session, Workload, WorkloadConfig
from loadgen.workloads.text import document_question, paragraph, question

SYSTEM = "You are a careful reader. Answer the question about the document."


def document(cfg: WorkloadConfig, index: int) -> str:
    """Document `index`: filler text of about doc_tokens, its own from the first word."""
    rng = random.Random(f"long-doc-qa:{cfg.seed}:{index}")
    return f"Document {index}.\n" + paragraph(rng, cfg.tokens_to_chars(cfg.doc_tokens))


def first_pass_ids(workload: Workload) -> list[str]:
    """The sessions of the first pass (the rest are the second)."""
    return [s.id for s in workload.sessions if s.after is None]


def build(name: str, cfg: WorkloadConfig) -> Workload:
    if cfg.documents < 1:
        raise UsageError(f"{name}: --documents must be at least 1")
    rng = random.Random(f"long-doc-qa:{cfg.seed}")
    count = min(cfg.documents, cfg.requests)
    asks = list(range(count))  # the first pass: each document once, in order
    while len(asks) < cfg.requests:  # then shuffled rounds of all of them
        again = list(range(count))
        rng.shuffle(again)
        asks += again
    sessions = []
    for n, doc in enumerate(asks[: cfg.requests]):
        body = f"{document(cfg, doc)}\n\nQuestion: {question(rng)}"
        messages = document_question(name, SYSTEM, body, cfg)
        sid = f"doc{doc}" if n < count else f"ask{n}-doc{doc}"
        sessions.append(Session(id=sid, after=None if n < count else f"doc{count - 1}",
                                requests=[RequestSpec(session=sid, turn=0, max_tokens=cfg.output_tokens,
                                                      messages=messages)]))
    return Workload(name=name, sessions=sessions)
