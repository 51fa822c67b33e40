"""Collectors (``tokengym.collectors``): how batches are made; ``policies/`` holds how tokens are generated."""

from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.core import CollectMode, CollectorOptions, InFlight
from tokengym.collectors.policies import (
    LocalVLLMServer,
    MaskedCategorical,
    PaddedSequenceActor,
    PolicyWithReference,
    SamplingConfig,
    SequenceActor,
    ServerOptions,
    SlotKVCache,
    StepwiseReference,
    TokenPolicy,
    TransformersPolicy,
    VLLMPolicy,
    VLLMServerPolicy,
    check_policy,
    is_token_policy,
    sample_tokens,
    supports_steps,
    supports_waves,
)
from tokengym.collectors.ray_collector import RayConfig, RayTokenCollector
from tokengym.collectors.recorders import StepRecorder, TrajectoryRecorder
from tokengym.collectors.sources import SourceKind, StepSource, WaveSource
from tokengym.collectors.token_collector import TokenCollector

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
    "VLLMServerPolicy",
    "LocalVLLMServer",
    "ServerOptions",
    "WaveSource",
    "check_policy",
    "is_token_policy",
    "sample_tokens",
    "supports_steps",
    "supports_waves",
]
