"""The token cache returns exactly what tokenizing returns, bounds what it holds, and keeps tokenizers apart."""

import random

from transformers import AutoTokenizer

from blend.chunking import encode, render_chat_chunks
from blend.token_cache import MIN_CACHED_CHARS, TokenCache, cache_for


def long_text(seed: int) -> str:
    rng = random.Random(seed)
    words = ["harbour", "committee", "road", "fair", "minutes", "accounts", "<|im_end|>", "Ünïcode", "42", "\n\n"]
    text = ""
    while len(text) < MIN_CACHED_CHARS * 2:
        text += rng.choice(words) + rng.choice([" ", "", ", "])
    return text


def test_cached_encode_equals_tokenizing(tiny_llama_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    cache = cache_for(tok)
    for seed in range(5):
        text = long_text(seed)
        direct = tuple(tok.encode(text, add_special_tokens=False))
        hits = cache.stats.hits
        assert encode(tok, text) == direct  # a miss: tokenized and stored
        assert encode(tok, text) == direct  # a hit
        assert cache.stats.hits == hits + 1
    short = "a short text"
    before = (cache.stats.hits, cache.stats.misses)
    assert encode(tok, short) == tuple(tok.encode(short, add_special_tokens=False))
    assert (cache.stats.hits, cache.stats.misses) == before  # short texts bypass the cache


def test_repeated_chat_message_is_not_tokenized_again(tiny_llama_path):
    tok = AutoTokenizer.from_pretrained(tiny_llama_path)
    document = long_text(11)
    first = render_chat_chunks(tok, [{"role": "user", "content": document}])
    hits = cache_for(tok).stats.hits
    second = render_chat_chunks(tok, [{"role": "system", "content": "be brief"}, {"role": "user", "content": document}])
    assert cache_for(tok).stats.hits == hits + 1
    assert [c.tokens for c in first if c.text == document] == [c.tokens for c in second if c.text == document]


def test_tokenizers_do_not_share_entries(tiny_llama_path):
    a = AutoTokenizer.from_pretrained(tiny_llama_path)
    b = AutoTokenizer.from_pretrained(tiny_llama_path)
    text = long_text(3)
    encode(a, text)
    misses = cache_for(b).stats.misses
    encode(b, text)
    assert cache_for(a) is not cache_for(b) and cache_for(b).stats.misses == misses + 1


def test_lru_bounded_by_tokens():
    cache = TokenCache(max_tokens=10)
    calls = []

    def fake_encode(text):  # stands in for a tokenizer: one token per character
        calls.append(text)
        return tuple(ord(c) for c in text)

    for text in ["aaaa", "bbbb", "cccc"]:  # 12 tokens > 10: "aaaa" goes
        cache.get_or_encode(text, fake_encode)
        assert cache.stats.tokens <= 10
    cache.get_or_encode("bbbb", fake_encode)  # still held: a hit, and now the most recent
    cache.get_or_encode("dddd", fake_encode)  # "cccc" is the least recent now: it goes
    assert calls == ["aaaa", "bbbb", "cccc", "dddd"]
    cache.get_or_encode("cccc", fake_encode)
    assert calls[-1] == "cccc" and cache.stats.tokens <= 10
    assert cache.get_or_encode("x" * 11, fake_encode) == tuple([ord("x")] * 11)  # over budget: not stored
    assert "x" * 11 not in cache._entries
    assert cache.stats.entries == len(cache._entries)
