"""Agent programs written against the OpenAI chat API as token environments (:func:`make_agent_env`)."""

from tokengym.llm_envs.agents.agent_env import AgentError, AgentTurns, make_agent_env, task_prompts
from tokengym.llm_envs.agents.tool_calls import HermesToolParser, ParsedTurn, ToolCallParser, tool_parser

__all__ = ["AgentError", "AgentTurns", "HermesToolParser", "ParsedTurn", "ToolCallParser", "make_agent_env",
           "task_prompts", "tool_parser"]  # fmt: skip
