"""agent-sdk: a real agent framework, the OpenAI Agents SDK, works through scripted tasks with local tools
against the server, a fixed number of steps per task. `agent-sdk` drives it with its Chat Completions model,
`agent-sdk-responses` with its default model, which speaks the Responses API (`/v1/responses`).

Each step is one streamed request as the SDK writes it: its instructions (the system message, or the
Responses `instructions`), the tools, the task, and every earlier call and tool output, with
`tool_choice: "required"` so that every step calls a tool (the SDK's `reset_tool_choice` is off, and the run
ends after `steps` model calls, the SDK's `max_turns`). In Responses mode the SDK sends the whole input every
step (no `previous_response_id`), as Codex does: the prefix cache does the reuse. The server's constrained decoding makes even a small model's calls valid.
The tools run here, deterministic for their arguments; their outputs are about `tool_output_tokens` long.

Unlike the other workloads, prompts depend on the model's answers (which tool it calls, with what), so
the traffic is fixed by the seed only as far as the model is deterministic (temperature 0). It is not
part of `--workload all`; name it. The SDK is the `loadgen` extra (`pip install -e '.[loadgen]'`).
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Annotated, Any, Callable, Literal

from pydantic import Field

from loadgen.errors import UsageError
from loadgen.workloads.spec import Session, Workload, WorkloadConfig
from loadgen.workloads.text import paragraph

NAME = "agent-sdk"
RESPONSES_NAME = "agent-sdk-responses"
STEP_MAX_TOKENS = 160  # a step's answer is one call, which ends by itself; this only bounds a runaway
CALL_TOKENS = 60  # a call as it appears in later prompts, with its framing (estimate)

City = Literal["Paris", "Lisbon", "Tokyo", "Lima", "Nairobi", "Oslo"]
Currency = Literal["EUR", "USD", "JPY", "GBP"]
Month = Literal["January", "February", "March", "April", "May", "June"]


@dataclass(frozen=True)
class Task:
    name: str
    instructions: str
    request: str
    tools: tuple[Callable[..., str], ...]


class ToolBox:
    """The local tools of every task. Outputs are filler text seeded by the call itself: the same call
    answers the same, as a real lookup would."""

    def __init__(self, seed: int, output_chars: int):
        self.seed = seed
        self.output_chars = output_chars

    def answer(self, tool: str, **args: Any) -> str:
        key = json.dumps(args, sort_keys=True)
        rng = random.Random(f"agent-sdk-tool:{self.seed}:{tool}:{key}")
        return f"{tool}({key}): {paragraph(rng, self.output_chars)}"

    def tasks(self) -> list[Task]:
        box = self

        def get_weather(city: City) -> str:
            """The current weather in a city."""
            return box.answer("get_weather", city=city)

        def get_forecast(city: City, days: Annotated[int, Field(ge=1, le=7)]) -> str:
            """The weather forecast for a city, for the next few days."""
            return box.answer("get_forecast", city=city, days=days)

        def find_hotels(city: City, max_price: Annotated[int, Field(ge=50, le=500)]) -> str:
            """Hotels in a city with a room under a price per night, in euros."""
            return box.answer("find_hotels", city=city, max_price=max_price)

        def search_notes(query: Annotated[str, Field(max_length=40)]) -> str:
            """Search the research notes; returns matching note ids with a snippet each."""
            return box.answer("search_notes", query=query)

        def read_note(note_id: Annotated[int, Field(ge=1, le=50)]) -> str:
            """The full text of one research note."""
            return box.answer("read_note", note_id=note_id)

        def get_invoice(invoice_id: Annotated[int, Field(ge=1000, le=1999)]) -> str:
            """One invoice: customer, lines, total and due date."""
            return box.answer("get_invoice", invoice_id=invoice_id)

        def convert_currency(amount: Annotated[int, Field(ge=1, le=100000)], currency: Currency) -> str:
            """Convert an amount in euros into another currency."""
            return box.answer("convert_currency", amount=amount, currency=currency)

        def list_overdue(month: Month) -> str:
            """Invoices that became overdue in a month."""
            return box.answer("list_overdue", month=month)

        return [
            Task("travel", "You are a travel planning agent. Use the tools to check weather, forecasts and hotels "
                           "before you recommend anything.",
                 "Plan a three-day trip for two people to {city} next week, on a budget of 200 euros a night.",
                 (get_weather, get_forecast, find_hotels)),
            Task("research", "You are a research assistant. Search the notes, read the relevant ones and collect "
                             "the facts before you answer.",
                 "Find out what the notes say about the {word} project and who worked on it.",
                 (search_notes, read_note)),
            Task("accounting", "You are an accounting agent. Look invoices up, convert amounts and list what is "
                               "overdue before you report.",
                 "Report the invoices that are overdue since {month} and their totals in {currency}.",
                 (get_invoice, convert_currency, list_overdue)),
        ]


def _instructions(task: Task, cfg: WorkloadConfig) -> str:
    """The task's instructions padded with a policy text shared by all agents, about `system_tokens` long."""
    policy = paragraph(random.Random(f"agent-sdk-policy:{cfg.seed}"), cfg.tokens_to_chars(cfg.system_tokens))
    return f"{task.instructions}\n\nPolicy:\n{policy}"


def steps_that_fit(cfg: WorkloadConfig) -> int:
    """Steps per task within --turns and within --max-prompt-tokens (instructions, tools, task, then a call
    and a tool output per step, estimated)."""
    base = cfg.system_tokens + 400
    per_step = CALL_TOKENS + cfg.tool_output_tokens + 10
    fit = (cfg.max_prompt_tokens - base) // per_step
    if fit < 1:
        raise UsageError(f"agent workloads: not even one step fits --max-prompt-tokens {cfg.max_prompt_tokens}; lower "
                         "--system-tokens or --tool-output-tokens")
    return min(cfg.turns, fit)


def _request_text(task: Task, rng: random.Random) -> str:
    from loadgen.workloads.text import WORDS

    return task.request.format(city=rng.choice(City.__args__), word=rng.choice(WORDS),
                               month=rng.choice(Month.__args__), currency=rng.choice(Currency.__args__))


def _driver(task: Task, instructions: str, request: str, steps: int, max_tokens: int, responses: bool):
    async def drive(client, model: str, cache_body: dict) -> None:
        from agents import (Agent, MaxTurnsExceeded, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel,
                            RunConfig, Runner, function_tool)

        kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
        agent = Agent(
            name=task.name, instructions=instructions, tools=[function_tool(f) for f in task.tools],
            model=kind(model=model, openai_client=client),
            model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0.0,
                                         max_tokens=max_tokens, include_usage=True, extra_body=cache_body or None),
            reset_tool_choice=False)
        run = Runner.run_streamed(agent, input=request, max_turns=steps, run_config=RunConfig(tracing_disabled=True))
        try:
            async for _ in run.stream_events():
                pass
        except MaxTurnsExceeded:  # the fixed number of steps is done
            pass

    return drive


def task_sessions(name: str, cfg: WorkloadConfig, driver, client: str = "openai") -> Workload:
    """The workload's tasks as sessions of `steps_that_fit` steps each (the last one shorter), each driven by
    `driver(task, instructions, request, steps, max_tokens)`; every agent workload asks the same tasks."""
    steps = steps_that_fit(cfg)
    tasks = ToolBox(cfg.seed, cfg.tokens_to_chars(cfg.tool_output_tokens)).tasks()
    sessions: list[Session] = []
    remaining = cfg.requests
    for k in range(math.ceil(cfg.requests / steps)):
        task = tasks[k % len(tasks)]
        n = min(steps, remaining)
        rng = random.Random(f"agent-sdk:{cfg.seed}:{k}")
        sessions.append(Session(id=f"{task.name}{k}", requests=[], planned=n, client=client, driver=driver(
            task, _instructions(task, cfg), _request_text(task, rng), n, max(cfg.output_tokens, STEP_MAX_TOKENS))))
        remaining -= n
    return Workload(name=name, sessions=sessions)


def build(name: str, cfg: WorkloadConfig) -> Workload:
    try:
        import agents  # noqa: F401
    except ImportError:
        raise UsageError(f"{NAME} needs the OpenAI Agents SDK: pip install -e '.[loadgen]' (or openai-agents)") from None
    responses = name == RESPONSES_NAME
    return task_sessions(name, cfg, lambda *args: _driver(*args, responses=responses))
