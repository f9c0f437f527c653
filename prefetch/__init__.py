"""prefetch: a Cython-accelerated expert prefetcher for MoE inference.

``PrefetchHandle`` is the C++ engine (registry, per-device caches, priority
queue, copy workers); ``ExpertPrefetcher`` maps (layer, expert) pairs onto it.
``DiskReader`` reads byte ranges of files with O_DIRECT into caller-owned
buffers (the engine's host tier reads experts left on disk itself, through
the same system-call layer, `src_cpp/disk_io.*`).
"""
from prefetch._disk import DiskReader, aligned_empty
from prefetch._engine import (
    DEFAULT_ACQUIRE_TIMEOUT_S,
    DEFAULT_PRIORITY,
    MAX_TENSOR_ID,
    NO_NEXT_USE,
    NUM_BANDS,
    SLOT_ALIGNMENT,
    PrefetchHandle,
    as_id_array,
)
from prefetch.errors import (
    AcquireTimeoutError,
    AlreadyRegisteredError,
    BackendUnavailableError,
    CheckpointError,
    CopyFailedError,
    DiskReadError,
    HandleClosedError,
    InvalidArgumentError,
    OutOfMemoryError,
    PrefetchError,
    StateError,
    UnknownIdError,
)
from prefetch.expert_prefetcher import ExpertPrefetcher, pack_expert
from prefetch.history_predictor import HistoryPredictor
from prefetch.predictors import NextLayerGatePredictor, OraclePredictor, RoutePredictor, TracePredictor
from prefetch.read_back import to_host


def __getattr__(name):
    # The model integration needs torch (load_without_experts, transformers
    # too); import it on first use so that `import prefetch` stays light.
    if name in ("offload_moe_experts", "integration"):
        import prefetch.integration as integration

        return integration if name == "integration" else integration.offload_moe_experts
    if name == "load_without_experts":
        from prefetch.hf_load import load_without_experts

        return load_without_experts
    raise AttributeError(f"module 'prefetch' has no attribute {name!r}")

__all__ = [
    "HistoryPredictor",
    "NextLayerGatePredictor",
    "OraclePredictor",
    "RoutePredictor",
    "TracePredictor",
    "AcquireTimeoutError",
    "AlreadyRegisteredError",
    "BackendUnavailableError",
    "CheckpointError",
    "CopyFailedError",
    "DiskReadError",
    "HandleClosedError",
    "InvalidArgumentError",
    "OutOfMemoryError",
    "PrefetchError",
    "StateError",
    "UnknownIdError",
    "DEFAULT_ACQUIRE_TIMEOUT_S",
    "DEFAULT_PRIORITY",
    "MAX_TENSOR_ID",
    "NO_NEXT_USE",
    "NUM_BANDS",
    "SLOT_ALIGNMENT",
    "DiskReader",
    "ExpertPrefetcher",
    "PrefetchHandle",
    "aligned_empty",
    "as_id_array",
    "load_without_experts",
    "offload_moe_experts",
    "pack_expert",
    "to_host",
]
__version__ = "0.1.0"
