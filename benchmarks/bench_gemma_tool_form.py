"""Which form of tool calls Gemma 3 270M is prompted with: what the model writes, unconstrained, when given tools.

With `tool_choice: "auto"` the model decodes freely until it writes the opening of a call; only then does the
grammar hold it to a known function and its parameters' schema (api/tools.py). So what a form is worth here is
how often the base model, shown the tools and a question that needs one, opens a call in that form by itself,
and how often what it writes then parses as a call. Three forms, each described in the first user turn:
- `hermes`: the fallback the server renders (api/tools.py: a `# Tools` block, calls as
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>`), exactly as served: render_chat_prompt on the
  bundled Gemma tokenizer;
- `gemma_json`: Google's "Function calling with Gemma" JSON variant (`{"name": function name, "parameters":
  dictionary of argument name and its value}`), the call in a ```` ```tool_code ```` block as Google's Gemma
  guides wrap calls;
- `gemma_python`: Google's Python variant (`[func_name(param=value)]`) in a ```` ```tool_code ```` block.
Greedy, --max-tokens tokens, over the QUESTIONS, through a real server's /v1/completions with the rendered
token ids (so the three prompts differ only in the tool text).

    python -m benchmarks.bench_gemma_tool_form [--max-tokens 64]

Prints one JSON line per form: opened (answers that begin with a call in the form: text that merely contains
the opening, e.g. an echo of the prompt's description, is not a call), parsed (answers whose first call parses:
a known function, arguments an object), echoed (answers that repeat the prompt's first 40 characters of tool
text) and the first answer of each form. Then the served path itself, /v1/chat/completions with
`tool_choice: "auto"`: called (answers with tool_calls), called_after_content (those with content before the
call, e.g. an echo of the prompt that reached `<tool_call>`)."""
from __future__ import annotations

import argparse
import ast
import json
import re
import tempfile
from pathlib import Path

import httpx

from reuse_server.api.chat_template import render_chat_prompt
from reuse_server.api.protocol import ChatCompletionRequest
from reuse_server.api.tools import CALL_OPEN, parse_tool_calls, tool_settings
from reuse_server.model import load_tokenizer, resolve_model
from reuse_server.server.launcher import served, with_small_pool

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "The text of a file in the repository.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
]
NAMES = {t["function"]["name"] for t in TOOLS}
QUESTIONS = [
    "What is the weather in Paris right now?", "Is it raining in Lima?", "How warm is it in Oslo today?",
    "Tell me the weather in Tokyo.", "Show me what README.md says.", "Read the file setup.py for me.",
    "What is in docs/architecture.md?", "Open src/main.rs and show it to me.",
]
GEMMA_JSON = ("You have access to functions. If you decide to invoke any of the function(s), you MUST put it in "
              "the format of\n```tool_code\n{\"name\": function name, \"parameters\": dictionary of argument name "
              "and its value}\n```\n\nYou SHOULD NOT include any other text in the response if you call a function\n")
GEMMA_PYTHON = ("You have access to functions. If you decide to invoke any of the function(s), you MUST put it in "
                "the format of\n```tool_code\n[func_name1(params_name1=params_value1, params_name2=params_value2...), "
                "func_name2(params)]\n```\n\nYou SHOULD NOT include any other text in the response if you call a "
                "function\n")
FENCE = re.compile(r"```tool_code\s*\n(.*?)(?:\n```|\Z)", re.S)


def gemma_prompt(tokenizer, preamble: str, question: str) -> list[int]:
    tools = json.dumps([t["function"] for t in TOOLS], indent=2)
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{preamble}{tools}\n\n{question}"}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def hermes_prompt(tokenizer, question: str) -> list[int]:
    body = ChatCompletionRequest(messages=[{"role": "user", "content": question}], tools=TOOLS)
    return render_chat_prompt(tokenizer, body.messages, tool_settings(body)).token_ids


def read_hermes(text: str) -> tuple[bool, bool]:
    if not text.lstrip().startswith(CALL_OPEN):
        return False, False
    calls = parse_tool_calls(text).calls
    return True, bool(calls) and calls[0].name in NAMES


def read_gemma_json(text: str) -> tuple[bool, bool]:
    block = FENCE.match(text.lstrip())
    if not block:
        return False, False
    try:
        call = json.loads(block.group(1))
    except json.JSONDecodeError:
        return True, False
    return True, isinstance(call, dict) and call.get("name") in NAMES and isinstance(call.get("parameters"), dict)


def read_gemma_python(text: str) -> tuple[bool, bool]:
    block = FENCE.match(text.lstrip())
    if not block:
        return False, False
    try:
        tree = ast.parse(block.group(1).strip(), mode="eval").body
    except SyntaxError:
        return True, False
    calls = tree.elts if isinstance(tree, ast.List) else [tree]
    return True, bool(calls) and all(isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and c.func.id in NAMES
                                     and all(isinstance(k.value, ast.Constant) for k in c.keywords) for c in calls)


def unconstrained_forms(url: str, model: str, tokenizer, max_tokens: int) -> None:
    """Each form's prompt through /v1/completions, nothing constrained: what the model writes by itself."""
    forms = {"hermes": (lambda q: hermes_prompt(tokenizer, q), read_hermes),
             "gemma_json": (lambda q: gemma_prompt(tokenizer, GEMMA_JSON, q), read_gemma_json),
             "gemma_python": (lambda q: gemma_prompt(tokenizer, GEMMA_PYTHON, q), read_gemma_python)}
    for form, (prompt, read) in forms.items():
        opened = parsed = echoed = 0
        first = None
        for question in QUESTIONS:
            ids = prompt(question)
            r = httpx.post(url + "/v1/completions", timeout=300, json={
                "model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            text = r.json()["choices"][0]["text"]
            first = text if first is None else first
            did_open, did_parse = read(text)
            opened, parsed = opened + did_open, parsed + did_parse
            echoed += tokenizer.decode(ids).split("<start_of_turn>user\n")[1][:40] in text
        print(json.dumps({"form": form, "answers": len(QUESTIONS), "opened": opened, "parsed": parsed,
                          "echoed": echoed, "first_answer": first}), flush=True)


def served_auto(url: str, model: str, max_tokens: int) -> None:
    """The served path with tool_choice "auto": free text until "<tool_call>", then the grammar."""
    called = with_content = 0
    first = None
    for question in QUESTIONS:
        r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
            "model": model, "messages": [{"role": "user", "content": question}], "tools": TOOLS,
            "tool_choice": "auto", "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        message = r.json()["choices"][0]["message"]
        first = message if first is None else first
        called += bool(message.get("tool_calls"))
        with_content += bool(message.get("tool_calls")) and bool(message.get("content"))
    print(json.dumps({"form": "hermes_auto", "answers": len(QUESTIONS), "called": called,
                      "called_after_content": with_content, "first_answer": first}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    tokenizer = load_tokenizer(resolve_model("gemma3-270m", "int8"))
    serve_args = with_small_pool(["--model", "gemma3-270m"])
    with tempfile.TemporaryDirectory() as tmp, served(serve_args, Path(tmp) / "server.log") as (url, _):
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        unconstrained_forms(url, model, tokenizer, args.max_tokens)
        served_auto(url, model, args.max_tokens)


if __name__ == "__main__":
    main()
