"""How tokens are generated (``tokengym.collectors.policies``): the policy protocols (:class:`TokenPolicy`, the
base; :class:`StepPolicy` and :class:`WavePolicy`; one "fits this env" check, :func:`check_fits_env`) and their
backends — transformers with a per-slot KV cache (steps and waves), vLLM in-process and on running
servers (waves), a policy
stepped with a reference model, the sampler, and the sequence actors the losses read.

How batches are made (sources, recorders, the collector, Ray and async collection) lives one level up,
in ``tokengym.collectors``.
"""

from tokengym.collectors.policies.kv_cache import SlotKVCache
from tokengym.collectors.policies.protocol import (
    StepPolicy,
    TokenPolicy,
    WavePolicy,
    check_fits_env,
    check_policy,
    is_token_policy,
    supports_cache_state,
    supports_steps,
    supports_waves,
)
from tokengym.collectors.policies.reference_policy import PolicyWithReference, StepwiseReference
from tokengym.collectors.policies.sampling import SamplingConfig, sample_tokens
from tokengym.collectors.policies.sequence_actor import MaskedCategorical, PaddedSequenceActor, SequenceActor
from tokengym.collectors.policies.transformers_policy import TransformersPolicy
from tokengym.collectors.policies.vllm_policy import VLLMPolicy
from tokengym.collectors.policies.vllm_server import LocalVLLMServer
from tokengym.collectors.policies.vllm_server_policy import ServerOptions, VLLMServerPolicy

__all__ = [
    "MaskedCategorical",
    "PaddedSequenceActor",
    "PolicyWithReference",
    "SamplingConfig",
    "SequenceActor",
    "SlotKVCache",
    "StepPolicy",
    "StepwiseReference",
    "TokenPolicy",
    "TransformersPolicy",
    "VLLMPolicy",
    "VLLMServerPolicy",
    "WavePolicy",
    "LocalVLLMServer",
    "ServerOptions",
    "check_fits_env",
    "check_policy",
    "is_token_policy",
    "sample_tokens",
    "supports_cache_state",
    "supports_steps",
    "supports_waves",
]
