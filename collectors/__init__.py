"""Collectors (``tokengym.collectors``): how batches are made; ``tokengym.collectors.policies`` holds how tokens
are generated (policies, sampling, KV cache, vLLM, sequence actors)."""

from tokengym.collectors.async_collector import AsyncCollector
from tokengym.collectors.core import CollectMode, CollectorOptions, InFlight
from tokengym.collectors.dynamic_sampling import DynamicSampling
from tokengym.collectors.ray_collector import RayConfig, RayTokenCollector
from tokengym.collectors.sources import SourceKind
from tokengym.collectors.token_collector import TokenCollector

__all__ = [
    "AsyncCollector",
    "CollectMode",
    "CollectorOptions",
    "DynamicSampling",
    "InFlight",
    "RayConfig",
    "RayTokenCollector",
    "SourceKind",
    "TokenCollector",
]
