"""A Responses request's tools as the chat path takes them: function tools as they are, each function of a
`namespace` tool as one function under its flat name, hosted tools left out and reported.

Namespaces: Codex groups functions (its sub-agent tools, each MCP server's tools) in `{"type": "namespace",
"name", "tools": [functions]}`. The model sees every one as `<namespace>__<name>`, the flat name codex-rs
gives a namespaced tool where a boundary cannot keep the split (protocol/src/tool_name.rs,
`canonical_flat_name`: the namespace's trailing and the name's leading underscores trimmed). A call the model
writes under a flat name goes out as a `function_call` item with `namespace` and the inner `name`, which is
what Codex dispatches on (core/src/tools/router.rs builds `ToolName::new(namespace, name)`; a flat name alone
is an "unsupported call" there); a call sent back the same way is rendered under the flat name again, so the
next prompt repeats the tokens the model wrote.

Hosted tools (web_search, file_search, code_interpreter, custom grammar tools...) are run by OpenAI or need
decoding this server does not do; they are left out of the prompt, named in the response's `skipped_tools`
and in one warning per request, rather than refused: Codex always sends web_search."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from reuse_server.api.responses_protocol import FunctionTool, HostedChoice, NamespaceTool, ResponsesRequest
from reuse_server.engine.sampling_params import InvalidRequest

logger = logging.getLogger("reuse_server.api")

NAMESPACE_DELIMITER = "__"


def flat_name(namespace: str, name: str) -> str:
    """The name the model sees and writes for function `name` of `namespace` (codex-rs's canonical flat name)."""
    return f"{namespace.rstrip('_')}{NAMESPACE_DELIMITER}{name.lstrip('_')}"


def model_name(item: dict) -> str:
    """The name under which a function_call item (ours or one sent back) is rendered into the prompt."""
    return flat_name(item["namespace"], item["name"]) if item.get("namespace") else item["name"]


def _chat_function(tool: FunctionTool, name: str) -> dict:
    return {"type": "function", "function": {**tool.model_dump(exclude={"type", "name"}, exclude_none=True),
                                             "name": name}}


@dataclass(frozen=True)
class ResponsesTools:
    """`functions`: chat tool definitions, as the model sees them; `namespaced`: flat name -> (namespace,
    name) of each namespaced function; `skipped`: the hosted tools left out, as the response reports them;
    `skipped_choice`: a tool_choice of a hosted tool, taken as "auto"."""

    functions: list[dict]
    namespaced: dict[str, tuple[str, str]]
    skipped: list[dict]
    skipped_choice: dict | None = None

    def call_fields(self, name: str) -> dict:
        """The `name` (and `namespace`) of a function_call item for a call the model wrote under `name`."""
        if name in self.namespaced:
            namespace, inner = self.namespaced[name]
            return {"name": inner, "namespace": namespace}
        return {"name": name}

    def chat_choice(self, choice) -> str | dict | None:
        """tool_choice as chat takes it. A choice of a hosted tool is "auto": that tool is not offered, the
        model may still answer or call the others (it is reported with the skipped tools)."""
        if choice is None or isinstance(choice, str):
            return choice
        if isinstance(choice, HostedChoice):
            return "auto"
        name = flat_name(choice.namespace, choice.name) if choice.namespace else choice.name
        return {"type": "function", "function": {"name": name}}


def responses_tools(body: ResponsesRequest) -> ResponsesTools:
    functions, namespaced, skipped = [], {}, []
    for tool in body.tools or []:
        if isinstance(tool, FunctionTool):
            functions.append(_chat_function(tool, tool.name))
        elif isinstance(tool, NamespaceTool):
            for inner in tool.tools:
                name = flat_name(tool.name, inner.name)
                if name in namespaced:
                    raise InvalidRequest(f"tools: the function {inner.name!r} is defined twice in namespace "
                                         f"{tool.name!r}.", "tools")
                namespaced[name] = (tool.name, inner.name)
                functions.append(_chat_function(inner, name))
        else:
            skipped.append(tool.reported())
    choice = body.tool_choice.reported() if isinstance(body.tool_choice, HostedChoice) else None
    return ResponsesTools(functions, namespaced, skipped, choice)


def warn_skipped(response_id: str, tools: ResponsesTools) -> None:
    """One warning a request, naming every tool left out (and a tool_choice of one, taken as "auto")."""
    if not tools.skipped and tools.skipped_choice is None:
        return
    names = ", ".join(t.get("name") or t["type"] for t in tools.skipped) or "none"
    choice = f"; tool_choice {tools.skipped_choice} taken as 'auto'" if tools.skipped_choice else ""
    logger.warning("response %s: left out tools this server cannot run (hosted or custom): %s%s",
                   response_id, names, choice)
