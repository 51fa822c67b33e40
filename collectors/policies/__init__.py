"""How tokens are generated (``tokengym.collectors.policies``): the :class:`TokenPolicy` protocol and its
backends — transformers with a per-slot KV cache (steps and waves), vLLM in-process and on running
servers (waves), a policy
stepped with a reference model, the sampler, and the sequence actors the losses read.

How batches are made (sources, recorders, the collector, Ray and async collection) lives one level up,
in ``tokengym.collectors``.
"""

from tokengym.collectors.policies.kv_cache import SlotKVCache
from tokengym.collectors.policies.protocol import (
    TokenPolicy,
    check_policy,
    is_token_policy,
    supports_steps,
    supports_waves,
)
from tokengym.collectors.policies.reference_policy import PolicyWithReference, StepwiseReference
from tokengym.collectors.policies.sampling import SamplingConfig, sample_tokens
from tokengym.collectors.policies.sequence_actor import MaskedCategorical, PaddedSequenceActor, SequenceActor
from tokengym.collectors.policies.transformers_policy import TransformersPolicy
from tokengym.collectors.policies.vllm_policy import VLLMPolicy
from tokengym.collectors.policies.vllm_server import LocalVLLMServer
from tokengym.collectors.policies.vllm_server_policy import NoServerError, ServerOptions, VLLMServerPolicy

__all__ = [
    "MaskedCategorical",
    "PaddedSequenceActor",
    "PolicyWithReference",
    "SamplingConfig",
    "SequenceActor",
    "SlotKVCache",
    "StepwiseReference",
    "TokenPolicy",
    "TransformersPolicy",
    "VLLMPolicy",
    "VLLMServerPolicy",
    "LocalVLLMServer",
    "NoServerError",
    "ServerOptions",
    "check_policy",
    "is_token_policy",
    "sample_tokens",
    "supports_steps",
    "supports_waves",
]
