"""shared-doc: many users asking different questions about the same long document at once.

The document (Lee corpus articles joined up to `doc_tokens`) comes first, the question last, so
every request after the first shares the whole document as a prefix.
"""
from __future__ import annotations

import random

from loadgen.workloads.documents import documents
from loadgen.workloads.spec import RequestSpec, Session, Workload, WorkloadConfig
from loadgen.workloads.text import document_question, question, truncate_words

SYSTEM = "You are a careful reader. Answer the user's question about the document."


def long_document(cfg: WorkloadConfig, name: str) -> str:
    docs = documents(cfg.docs_file, name)
    target = cfg.tokens_to_chars(cfg.doc_tokens)
    text = ""
    for d in docs:
        if len(text) >= target:
            break
        text += d + "\n\n"
    return truncate_words(text.strip(), target)


def build(name: str, cfg: WorkloadConfig) -> Workload:
    doc = long_document(cfg, name)
    rng = random.Random(f"shared-doc:{cfg.seed}")
    sessions = []
    for i in range(cfg.requests):
        body = f"Document:\n{doc}\n\nQuestion from user {i}: {question(rng)}"
        messages = document_question("shared-doc", SYSTEM, body, cfg)
        sessions.append(Session(id=f"user{i}", requests=[RequestSpec(session=f"user{i}", turn=0, max_tokens=cfg.output_tokens, messages=messages)]))
    return Workload(name=name, sessions=sessions)
