"""How tokens are generated (``tokengym.collectors.policies``): the policy protocols (:class:`TokenPolicy`, the
base; :class:`StepPolicy` and :class:`WavePolicy`; one "fits this env" check, :func:`check_fits_env`) and their
backends — transformers with a per-slot KV cache (steps and waves), vLLM in-process, and a fleet of running
servers of any engine (waves: :class:`ServerPolicy`; :class:`VLLMServerPolicy` is it with vLLM's dialect), the engine
dialects (:class:`WaveDialect`, :class:`ServerDialect`, :class:`FleetDialect`, :class:`EngineDialect`, in
``tokengym.collectors.policies.dialects``: what another engine implements; vLLM's and SGLang's
:class:`SGLangServerDialect`), a policy
stepped with a reference model, the sampler, the sequence actors the losses read, and LoRA (PEFT) models as
policies (:class:`~tokengym.collectors.policies.AdaptersDisabled`, :func:`~tokengym.collectors.policies.adapter_weights`,
:func:`~tokengym.collectors.policies.merged_weights`).

How batches are made (sources, recorders, the collector, Ray and async collection) lives one level up,
in ``tokengym.collectors``.
"""

from tokengym.collectors.policies._server_options import RequestRejected
from tokengym.collectors.policies._vllm_dialect import VLLMEngineDialect, VLLMServerDialect
from tokengym.collectors.policies._wave_core import WaveCore
from tokengym.collectors.policies.compiled_decode import CompiledDecode
from tokengym.collectors.policies.dialects import (
    EngineDialect,
    FleetDialect,
    ServerDialect,
    WaveDialect,
    check_dialect,
)
from tokengym.collectors.policies.graph_decode import GraphDecode
from tokengym.collectors.policies.kv_cache import SlotKVCache
from tokengym.collectors.policies.lora import AdaptersDisabled, adapter_weights, merged_weights
from tokengym.collectors.policies.prefix_store import PrefixStore
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
from tokengym.collectors.policies.sequence_actor import (
    ChunkedCategorical,
    MaskedCategorical,
    PaddedSequenceActor,
    SequenceActor,
)
from tokengym.collectors.policies.server_policy import ServerPolicy
from tokengym.collectors.policies.sglang_dialect import SGLangServerDialect
from tokengym.collectors.policies.shared_prefix_actor import SharedPrefixActor
from tokengym.collectors.policies.static_kv_cache import StaticSlotKVCache
from tokengym.collectors.policies.transformers_policy import TransformersPolicy
from tokengym.collectors.policies.vllm_policy import VLLMPolicy
from tokengym.collectors.policies.vllm_server import LocalVLLMServer
from tokengym.collectors.policies.vllm_server_policy import ServerOptions, VLLMServerPolicy

__all__ = [
    "AdaptersDisabled",
    "CompiledDecode",
    "EngineDialect",
    "FleetDialect",
    "GraphDecode",
    "ChunkedCategorical",
    "MaskedCategorical",
    "PaddedSequenceActor",
    "PolicyWithReference",
    "RequestRejected",
    "SamplingConfig",
    "SGLangServerDialect",
    "ServerDialect",
    "ServerPolicy",
    "SequenceActor",
    "SharedPrefixActor",
    "SlotKVCache",
    "StaticSlotKVCache",
    "PrefixStore",
    "StepPolicy",
    "StepwiseReference",
    "TokenPolicy",
    "TransformersPolicy",
    "VLLMEngineDialect",
    "VLLMPolicy",
    "VLLMServerDialect",
    "VLLMServerPolicy",
    "WaveCore",
    "WaveDialect",
    "WavePolicy",
    "LocalVLLMServer",
    "ServerOptions",
    "adapter_weights",
    "check_dialect",
    "check_fits_env",
    "check_policy",
    "is_token_policy",
    "merged_weights",
    "sample_tokens",
    "supports_cache_state",
    "supports_steps",
    "supports_waves",
]
