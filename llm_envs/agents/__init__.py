"""Agent programs written against the OpenAI chat API as token environments (:func:`make_agent_env`)."""

from tokengym.llm_envs.agents.agent_env import AgentError, AgentSource, AgentTurns, make_agent_env
from tokengym.llm_envs.agents.tool_calls import HermesToolParser, ParsedTurn, ToolCallParser, tool_parser

__all__ = ["AgentError", "AgentSource", "AgentTurns", "HermesToolParser", "ParsedTurn", "ToolCallParser",
           "make_agent_env", "tool_parser"]  # fmt: skip
