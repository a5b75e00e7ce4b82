"""The coding agents' runners live in loadgen (the agent-replay workload records sessions with them too);
tests import them from here as before."""
from loadgen.coding_agents import (AGENT_BIN, DUMMY_KEY, REPO, AgentError, AgentRun, ClaudeCode, ClaudeResult,  # noqa: F401
                                   CodexCLI, CodingAgent, agent_binary, codex_events)
