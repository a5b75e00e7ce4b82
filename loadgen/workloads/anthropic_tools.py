"""anthropic-tools: a tool loop driven by the official `anthropic` SDK over the Messages API (`/v1/messages`),
the way Claude Code's traffic reaches a server: the system prompt, the tools, and the whole conversation (every
`tool_use` and `tool_result` so far) sent again on every step.

The tasks and their local tools are agent-sdk's (the same deterministic outputs, the same shared policy text in
the system prompt); each step is one streamed `messages.stream` with `tool_choice: {"type": "any"}`, so every
step calls a tool, and its result goes back as the next user turn. A step whose answer holds no call ends the
task early. Like agent-sdk, prompts depend on the model's answers; it runs only when named.
"""
from __future__ import annotations

import inspect

from loadgen.errors import UsageError
from loadgen.workloads.agent_sdk import Task, task_sessions
from loadgen.workloads.spec import Workload, WorkloadConfig

NAME = "anthropic-tools"


def tool_specs(task: Task) -> list[dict]:
    """Anthropic tool definitions (name, description, input_schema) for the task's functions; the schemas are
    the ones the Agents SDK derives from the same signatures, so both agent workloads offer the same tools."""
    from agents import function_tool

    specs = []
    for f in task.tools:
        tool = function_tool(f)
        specs.append({"name": tool.name, "description": inspect.getdoc(f) or tool.description,
                      "input_schema": tool.params_json_schema})
    return specs


def assistant_content(message) -> list[dict]:
    """The answer's blocks as the next request sends them back (only the fields the API defines)."""
    blocks = []
    for block in message.content:
        if block.type == "text" and block.text:
            blocks.append({"type": "text", "text": block.text})
        elif block.type == "tool_use":
            blocks.append({"type": "tool_use", "id": block.id, "name": block.name, "input": block.input})
    return blocks


def run_tool(task: Task, name: str, arguments: dict) -> tuple[str, bool]:
    """The tool's output, or the error a model's bad call earns (sent back as an error result, as agents do)."""
    for f in task.tools:
        if f.__name__ == name:
            try:
                return f(**arguments), False
            except TypeError as exc:
                return f"bad arguments for {name}: {exc}", True
    return f"no tool named {name}", True


def _driver(task: Task, instructions: str, request: str, steps: int, max_tokens: int):
    async def drive(client, model: str, cache_body: dict) -> None:
        tools = tool_specs(task)
        messages: list[dict] = [{"role": "user", "content": request}]
        # the anthropic SDK 2.x has no temperature argument; greedy keeps the traffic fixed by the seed
        body = {"temperature": 0.0, **(cache_body or {})}
        for _ in range(steps):
            async with client.messages.stream(model=model, max_tokens=max_tokens, system=instructions, tools=tools,
                                              tool_choice={"type": "any"}, messages=messages,
                                              extra_body=body) as stream:
                answer = await stream.get_final_message()
            calls = [b for b in answer.content if b.type == "tool_use"]
            if not calls:
                return
            messages.append({"role": "assistant", "content": assistant_content(answer)})
            results = []
            for call in calls:
                output, failed = run_tool(task, call.name, dict(call.input or {}))
                results.append({"type": "tool_result", "tool_use_id": call.id, "content": output,
                                **({"is_error": True} if failed else {})})
            messages.append({"role": "user", "content": results})

    return drive


def build(name: str, cfg: WorkloadConfig) -> Workload:
    try:
        import agents  # noqa: F401
        import anthropic  # noqa: F401
    except ImportError:
        raise UsageError(f"{NAME} needs the anthropic SDK and the OpenAI Agents SDK (its tool schemas): "
                         "pip install -e '.[loadgen]'") from None
    return task_sessions(name, cfg, _driver, client="anthropic")
