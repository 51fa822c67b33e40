"""Collectors (``tokengym.collectors``): how batches are made; ``tokengym.collectors.policies`` holds how tokens
are generated (policies, sampling, KV cache, vLLM, sequence actors).

The exceptions a collector's iteration raises beyond ``ValueError`` / ``TypeError`` are importable here and from
:mod:`tokengym.errors`: :class:`NoServerError` (no vLLM server of a ``VLLMServerPolicy`` is left) and
:class:`DynamicSamplingError` (dynamic sampling reached its draw bound).
"""

from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.branching import BranchRule, EntropyRule, Fork, SegmentRule, TreeStep, TurnRule
from tokengym.collectors.core import CollectMode, CollectorOptions, InFlight
from tokengym.collectors.dynamic_sampling import DynamicSampling, DynamicSamplingError
from tokengym.collectors.policies._server_options import NoServerError
from tokengym.collectors.ray_collector import RayConfig, RayTokenCollector
from tokengym.collectors.recorders import Recorder
from tokengym.collectors.sources import Advance, Source, SourceKind, StepSource, WaveSource
from tokengym.collectors.token_collector import TokenCollector
from tokengym.collectors.tree_source import TreeSource

__all__ = [
    "Advance",
    "AsyncCollector",
    "BranchRule",
    "CollectMode",
    "CollectorOptions",
    "DynamicSampling",
    "DynamicSamplingError",
    "EntropyRule",
    "Fork",
    "InFlight",
    "NoServerError",
    "RayConfig",
    "RayTokenCollector",
    "Recorder",
    "SegmentRule",
    "Source",
    "SourceKind",
    "StepSource",
    "TokenCollector",
    "TreeSource",
    "TreeStep",
    "TurnRule",
    "WaveSource",
]
