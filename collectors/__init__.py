"""Policies and collectors (``tokengym.collectors``)."""

from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.kv_cache import SlotKVCache
from tokengym.collectors.policy import (
    TokenPolicy,
    check_policy,
    is_token_policy,
    supports_steps,
    supports_waves,
)
from tokengym.collectors.ray_collector import RayConfig, RayTokenCollector
from tokengym.collectors.recorders import StepRecorder, TrajectoryRecorder
from tokengym.collectors.reference_policy import PolicyWithReference, StepwiseReference
from tokengym.collectors.sampling import SamplingConfig, sample_tokens
from tokengym.collectors.sequence_actor import MaskedCategorical, PaddedSequenceActor, SequenceActor
from tokengym.collectors.sources import SourceKind, StepSource, WaveSource
from tokengym.collectors.token_collector import CollectMode, CollectorOptions, InFlight, TokenCollector
from tokengym.collectors.transformers_policy import TransformersPolicy
from tokengym.collectors.vllm_policy import VLLMPolicy

__all__ = [
    "AsyncCollector",
    "RayConfig",
    "RayTokenCollector",
    "CollectMode",
    "CollectorOptions",
    "InFlight",
    "MaskedCategorical",
    "PaddedSequenceActor",
    "PolicyWithReference",
    "SamplingConfig",
    "SequenceActor",
    "SlotKVCache",
    "SourceKind",
    "StepRecorder",
    "StepSource",
    "StepwiseReference",
    "TokenCollector",
    "TokenPolicy",
    "TrajectoryRecorder",
    "TransformersPolicy",
    "VLLMPolicy",
    "WaveSource",
    "check_policy",
    "is_token_policy",
    "sample_tokens",
    "supports_steps",
    "supports_waves",
]
