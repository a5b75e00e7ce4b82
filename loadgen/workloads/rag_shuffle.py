"""rag-shuffle: every request retrieves k documents from a pool, in an order that varies, then asks.

Only the short instruction before the first document is a shared prefix; the documents themselves
come back again and again at other positions, which prefix caching cannot reuse (blending can).
Each document's text is identical wherever it appears (its header names the document, not its slot).
"""
from __future__ import annotations

import random

from loadgen.errors import UsageError
from loadgen.workloads.documents import documents
from loadgen.workloads.spec import RequestSpec, Session, Workload, WorkloadConfig
from loadgen.workloads.text import estimate_chat_tokens, question, truncate_words

SYSTEM = "You answer questions using only the retrieved documents. Cite the document ids you used."
INSTRUCTION = "Retrieved documents:\n\n"


def document_block(doc_id: int, text: str) -> str:
    return f"[doc {doc_id}]\n{text}\n\n"


def build(name: str, cfg: WorkloadConfig) -> Workload:
    if cfg.rag_k > cfg.rag_pool:
        raise UsageError(f"--rag-k {cfg.rag_k} is larger than --rag-pool {cfg.rag_pool}")
    docs = documents(cfg.docs_file, name, minimum=cfg.rag_pool)
    overhead = estimate_chat_tokens([{"role": "system", "content": SYSTEM},
                                     {"role": "user", "content": INSTRUCTION + "Question: " + "x" * 120}], cfg.chars_per_token)
    per_doc = min(cfg.doc_tokens, (cfg.max_prompt_tokens - overhead) // cfg.rag_k - 8)
    if per_doc < 16:
        raise UsageError(f"rag-shuffle: {cfg.rag_k} documents do not fit --max-prompt-tokens {cfg.max_prompt_tokens}; "
                         "lower --rag-k or raise --max-prompt-tokens")
    pool = [truncate_words(d, cfg.tokens_to_chars(per_doc)) for d in docs[: cfg.rag_pool]]
    rng = random.Random(f"rag-shuffle:{cfg.seed}")
    sessions = []
    for i in range(cfg.requests):
        picked = rng.sample(range(len(pool)), cfg.rag_k)  # sample() returns them in random order
        # one text part per document, as a RAG client sends them: each part is a chunk the server can reuse
        parts = [INSTRUCTION] + [document_block(d, pool[d]) for d in picked] + [f"Question: {question(rng)}"]
        messages = ({"role": "system", "content": SYSTEM},
                    {"role": "user", "content": [{"type": "text", "text": t} for t in parts]})
        sessions.append(Session(id=f"rag{i}", requests=[RequestSpec(session=f"rag{i}", turn=0, max_tokens=cfg.output_tokens, messages=messages)]))
    return Workload(name=name, sessions=sessions)
