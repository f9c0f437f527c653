"""Expert id lists as the controller takes them: sorted, distinct, int64,
in range; shared by the controller's synced, host-routed and sync-free
paths."""
from __future__ import annotations

import numpy as np

from prefetch._engine import distinct_short
from prefetch.read_back import to_host

__all__ = ["EMPTY", "routed_experts", "distinct"]

EMPTY = np.empty(0, dtype=np.int64)


def routed_experts(routed: np.ndarray, num_experts: int) -> np.ndarray:
    """Sorted distinct experts of a routing read back from the model: router
    top-k indices, in 0..num_experts-1 by construction (so no range scan;
    one past the end still raises IndexError). Half the cost of distinct,
    twice a layer on the serving path."""
    mask = np.zeros(num_experts, dtype=bool)
    mask[routed] = True
    return mask.nonzero()[0]


def distinct(experts, num_experts: int) -> np.ndarray:
    """Sorted distinct expert ids of a host sequence, numpy array or CPU
    tensor, as int64."""
    short = distinct_short(experts, num_experts)  # Note [Short expert lists in C]
    if short is not None:
        return short
    if type(experts) is np.ndarray and experts.ndim == 1 and experts.dtype.kind in "iu" and experts.shape[0] <= 64:
        experts = experts.tolist()
    if type(experts) is list and len(experts) <= 64:
        # A short host list or integer array (a layer's routing at small
        # batch, a predictor's guess): sorting a set costs a fraction of the
        # array path's five numpy calls, and this runs once per layer or more.
        distinct = sorted({int(e) for e in experts})
        if distinct and (distinct[0] < 0 or distinct[-1] >= num_experts):
            raise ValueError(f"expert ids must be in 0..{num_experts - 1}")
        return np.array(distinct, dtype=np.int64)
    if hasattr(experts, "detach"):  # a torch tensor: on the host (Note [Read-back without a pageable copy])
        experts = to_host(experts)
    arr = np.asarray(experts, dtype=np.int64).reshape(-1)
    if arr.shape[0] == 0:
        return arr
    if arr.min() < 0 or arr.max() >= num_experts:
        raise ValueError(f"expert ids must be in 0..{num_experts - 1}")
    mask = np.zeros(num_experts, dtype=bool)
    mask[arr] = True
    return np.flatnonzero(mask)
