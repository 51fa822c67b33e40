"""tokengym: TensorDict-native token-level environments, collectors and transforms for RL on LLMs.

The top level holds what a quickstart types; everything else is importable from its subpackage
(``tokengym.llm_envs``, ``tokengym.transforms``, ``tokengym.collectors``).
"""

from tokengym.collectors import AsyncCollector, CollectMode, RayTokenCollector, TokenCollector
from tokengym.collectors.policies import (
    PaddedSequenceActor,
    PolicyWithReference,
    SamplingConfig,
    SequenceActor,
    TokenPolicy,
    TransformersPolicy,
    VLLMPolicy,
    VLLMServerPolicy,
)
from tokengym.llm_envs import MathAnswerReward, MultiTurnTokenEnv, PromptSource, TokenEnv, check_env, keys
from tokengym.llm_envs.turns import Turn
from tokengym.training import train
from tokengym.transforms import (
    AdaptiveKLController,
    GAEAdvantage,
    GroupAdvantage,
    KLRewardTransform,
    to_padded,
)

__version__ = "0.1.0"
__all__ = [
    "AdaptiveKLController",
    "AsyncCollector",
    "CollectMode",
    "GAEAdvantage",
    "GroupAdvantage",
    "KLRewardTransform",
    "MathAnswerReward",
    "MultiTurnTokenEnv",
    "PaddedSequenceActor",
    "PolicyWithReference",
    "PromptSource",
    "RayTokenCollector",
    "SamplingConfig",
    "SequenceActor",
    "TokenCollector",
    "TokenEnv",
    "TokenPolicy",
    "TransformersPolicy",
    "Turn",
    "VLLMPolicy",
    "VLLMServerPolicy",
    "check_env",
    "keys",
    "to_padded",
    "train",
]
