"""tokengym: TensorDict-native token-level environments, collectors and transforms for RL on LLMs."""

from tokengym.collectors import *  # noqa: F401,F403
from tokengym.collectors import __all__ as _collectors_all
from tokengym.llm_envs import *  # noqa: F401,F403
from tokengym.llm_envs import __all__ as _envs_all
from tokengym.transforms import *  # noqa: F401,F403
from tokengym.transforms import __all__ as _transforms_all

__version__ = "0.1.0"
__all__ = [*_envs_all, *_transforms_all, *_collectors_all]
