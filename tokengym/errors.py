"""Every exception tokengym raises beyond the built-in ``ValueError`` / ``TypeError`` / ``KeyError``: one home.

Also :class:`TokenGymWarning`, the warning of a setting that runs but would learn nothing (groups of one sample).

The classes are defined where they are raised (``tokengym.llm_envs.errors``, the adapters, the server
policy) and exported here, every one of them; a few are also exported by the package of the class a user meets
them from (``NoServerError`` and ``DynamicSamplingError`` from ``tokengym.collectors``, ``RequestRejected`` from
``tokengym.collectors.policies``, ``EpisodeError`` from ``tokengym.llm_envs.adapters``, ``AgentError`` from ``tokengym.llm_envs.agents``)::

    from tokengym.errors import PromptError, RewardFunctionError

    try:
        batch = next(it)
    except PromptError as err:  # a prompt was skipped; nothing collected is lost: iterate again
        print(err)
"""

from tokengym.collectors.dynamic_sampling import DynamicSamplingError
from tokengym.collectors.policies._server_options import NoServerError, RequestRejected
from tokengym.llm_envs.adapters._episodes import EpisodeError
from tokengym.llm_envs.agents.agent_env import AgentError
from tokengym.llm_envs.errors import (
    ContractError,
    PromptError,
    ResetNeeded,
    RewardFunctionError,
    TokenGymError,
    TokenGymWarning,
)

__all__ = [
    "AgentError",
    "ContractError",
    "DynamicSamplingError",
    "EpisodeError",
    "NoServerError",
    "PromptError",
    "RequestRejected",
    "ResetNeeded",
    "RewardFunctionError",
    "TokenGymError",
    "TokenGymWarning",
]
