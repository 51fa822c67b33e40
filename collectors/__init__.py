"""Policies and collectors (``tokengym.collectors``)."""

from tokengym.collectors.kv_cache import SlotKVCache
from tokengym.collectors.reference_policy import StepwiseReference
from tokengym.collectors.sampling import SamplingConfig, sample_tokens
from tokengym.collectors.sequence_actor import SequenceActor
from tokengym.collectors.token_collector import CollectMode, TokenCollector
from tokengym.collectors.transformers_policy import TransformersPolicy
from tokengym.collectors.unroll_collector import UnrollCollector

__all__ = ["CollectMode", "SamplingConfig", "SequenceActor", "SlotKVCache", "StepwiseReference", "TokenCollector", "TransformersPolicy", "UnrollCollector", "sample_tokens"]
