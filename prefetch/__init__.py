"""prefetch: a Cython-accelerated expert prefetcher for MoE inference.

``PrefetchHandle`` is the C++ engine (registry, per-device caches, priority
queue, copy workers); ``ExpertPrefetcher`` maps (layer, expert) pairs onto it.
"""
from prefetch._engine import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_PRIORITY,
    MAX_TENSOR_ID,
    NUM_BANDS,
    PrefetchHandle,
    as_id_array,
)
from prefetch.expert_prefetcher import ExpertPrefetcher

__all__ = [
    "DEFAULT_ACQUIRE_TIMEOUT_S",
    "DEFAULT_PRIORITY",
    "MAX_TENSOR_ID",
    "NUM_BANDS",
    "ExpertPrefetcher",
    "PrefetchHandle",
    "as_id_array",
]
__version__ = "0.1.0"
