"""Stored responses without a server: the store's bounds (count and bytes, oldest first), a record belongs to
its tenant, records survive their encoding; and the continuation of a stored turn is its exact tokens
followed by what the chat template writes for the new messages."""
import pytest

from reuse_server.api.chat_template import NO_TOOLS, render_chat_prompt, render_continuation
from reuse_server.api.prompt_chunks import PromptChunks
from reuse_server.api.protocol import ChatMessage
from reuse_server.api.response_store import ResponseStore, StoredResponse
from tiny_checkpoint import build_tokenizer


def record(rid: str, tenant: str | None = None, tokens: int = 10) -> StoredResponse:
    return StoredResponse(rid, tenant, {"id": rid}, list(range(tokens)), [7, 8, 2**31 - 1], [{"role": "user",
                          "content": "hi"}], "framing", [(0, 3)])


def test_a_record_survives_its_encoding():
    r = record("resp_1", "t")
    assert StoredResponse.decode(r.encode()) == r


def test_the_store_is_bounded_by_count_oldest_first():
    store = ResponseStore(max_count=2)
    for rid in ("a", "b", "c"):
        store.put(record(rid))
    assert store.get(None, "a") is None and store.get(None, "b").id == "b" and store.get(None, "c").id == "c"
    assert len(store) == 2


def test_the_store_is_bounded_by_bytes_and_a_read_keeps_a_record():
    size = len(record("a", tokens=100).encode())
    store = ResponseStore(max_bytes=2 * size + size // 2)
    store.put(record("a", tokens=100))
    store.put(record("b", tokens=100))
    assert store.get(None, "a") is not None  # read: now the newest
    store.put(record("c", tokens=100))
    assert store.get(None, "b") is None and store.get(None, "a") and store.get(None, "c")
    assert store.bytes <= store.max_bytes
    store.put(record("huge", tokens=10_000))  # larger than the whole store: not kept, nothing else lost
    assert store.get(None, "huge") is None and len(store) == 2


def test_a_record_belongs_to_its_tenant():
    store = ResponseStore()
    store.put(record("r", "alpha"))
    assert store.get("beta", "r") is None and store.get(None, "r") is None
    assert not store.delete("beta", "r") and store.get("alpha", "r") is not None
    assert store.delete("alpha", "r") and store.get("alpha", "r") is None


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


@pytest.mark.parametrize("ended_with_eos", [True, False])
def test_a_continuation_is_the_stored_tokens_then_the_new_turn(tokenizer, ended_with_eos):
    first = [ChatMessage(role="user", content="What is a KV cache?")]
    prompt = render_chat_prompt(tokenizer, first)
    answer = list(tokenizer.encode("It keeps keys and values.", add_special_tokens=False))
    if ended_with_eos:
        answer.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
    prefix = PromptChunks(prompt.token_ids + answer, prompt.chunk_spans)
    new = [ChatMessage(role="user", content="And a radix tree?")]
    eos = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    ids, spans = render_continuation(tokenizer, new, NO_TOOLS, prefix, eos)
    assert ids[:len(prefix.token_ids)] == prefix.token_ids
    # what follows is what the template writes after an answer: the same text as a whole rendering's
    whole = render_chat_prompt(tokenizer, first + [ChatMessage(role="assistant", content="It keeps keys and values."),
                                                   *new])
    assert tokenizer.decode(ids) == tokenizer.decode(whole.token_ids)
    assert spans[:len(prompt.chunk_spans)] == prompt.chunk_spans
    assert [tokenizer.decode(ids[s:s + n]) for s, n in spans[len(prompt.chunk_spans):]] == ["And a radix tree?"]


TEMPLATE_WITH = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | FILTER }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_changes_content_cannot_be_continued(tokenizer):
    """A template that rewrites content does not render it verbatim: no continuation (the whole conversation
    is rendered again instead)."""
    upper = build_tokenizer()
    upper.chat_template = TEMPLATE_WITH.replace("FILTER", "upper")
    prefix = PromptChunks([1, 2, 3], [])
    assert render_continuation(upper, [ChatMessage(role="user", content="padded")], NO_TOOLS, prefix, []) is None


def test_a_template_that_trims_content_is_continued_with_the_trimmed_text(tokenizer):
    """Trimming (Gemma 3's template trims every message but a first system one) is how the template writes a
    message: the continuation holds the new message as trimmed, between the template's framing."""
    trimming = build_tokenizer()
    trimming.chat_template = TEMPLATE_WITH.replace("FILTER", "trim")
    prefix = PromptChunks([1, 2, 3], [])
    ids, spans = render_continuation(trimming, [ChatMessage(role="user", content=" padded\n")], NO_TOOLS, prefix, [])
    assert ids[:3] == [1, 2, 3]
    assert trimming.decode(ids[3:]) == "<|im_end|>\n<|im_start|>user\npadded<|im_end|>\n<|im_start|>assistant\n"
    assert [trimming.decode(ids[s:s + n]) for s, n in spans] == ["padded"]
