"""Expert id lists as the controller takes them: sorted, distinct, int64,
in range; shared by the controller's synced, host-routed and sync-free
paths."""
from __future__ import annotations

import numpy as np

from prefetch._engine import distinct_short
from prefetch.errors import InvalidArgumentError
from prefetch.read_back import to_host

__all__ = ["EMPTY", "Guesses", "routed_experts", "distinct"]

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
            raise InvalidArgumentError(f"expert ids must be in 0..{num_experts - 1}")
        return np.array(distinct, dtype=np.int64)
    if hasattr(experts, "detach"):  # a torch tensor: on the host (Note [Read-back without a pageable copy])
        experts = to_host(experts)
    arr = np.asarray(experts, dtype=np.int64).reshape(-1)
    if arr.shape[0] == 0:
        return arr
    if arr.min() < 0 or arr.max() >= num_experts:
        raise InvalidArgumentError(f"expert ids must be in 0..{num_experts - 1}")
    mask = np.zeros(num_experts, dtype=bool)
    mask[arr] = True
    return np.flatnonzero(mask)


class Guesses:
    """The guesses filed to be scored when their layers route: (step, layer)
    -> sorted distinct experts, as a dict takes them (`g[key] = experts`,
    `pop`, truth, `clear`, `keys`).

    Note [Guesses filed a step at a time]
    A step plan (Note [Step pins] in prefetch/offload/sync_free.py, Note
    [Host-routed step pins] in prefetch/offload/step_plan.py) files the next
    step's reads as its guesses for every layer at once: one dict entry a
    layer was a slice and a subtraction a layer, 100 us of a host-routed
    plan's first layer on gemma-4's 30 layers (a host-only BM5 replay), and
    a step the model routes as planned only counts them (`pop_count`).
    `file_step` keeps the step's flat indices and layer bounds instead; a
    layer's entry is made when it is popped, and filing a layer of that
    step again (`g[key] = ...`) overrides it, as a dict would."""

    __slots__ = ("_filed", "_steps")

    def __init__(self):
        self._filed: dict = {}
        # step -> [flat indices, layer bounds, experts per layer, open flags, open count]
        self._steps: dict = {}

    def file_step(self, step: int, flat: np.ndarray, bounds: list, num_experts: int) -> None:
        """Files, for each layer l with bounds[l] < bounds[l + 1], the
        experts flat[bounds[l] : bounds[l + 1]] - l * num_experts as the
        guesses for (step, l), over what was filed for it."""
        open_ = [b > a for a, b in zip(bounds, bounds[1:])]
        if step in self._steps:
            self._spill(step)
        count = sum(open_)
        if count:
            self._steps[step] = [flat, bounds, num_experts, open_, count]

    def _take(self, key):
        """The lazily filed entry of `key`, taken (its (a, b, lazy) or None)."""
        lazy = self._steps.get(key[0])
        if lazy is None:
            return None
        layer = key[1]
        open_ = lazy[3]
        if not 0 <= layer < len(open_) or not open_[layer]:
            return None
        open_[layer] = False
        lazy[4] -= 1
        if not lazy[4]:
            del self._steps[key[0]]
        self._filed.pop(key, None)  # filed before the step: overridden by it
        return lazy[1][layer], lazy[1][layer + 1], lazy

    def pop(self, key, default=None):
        got = self._take(key)
        if got is None:
            return self._filed.pop(key, default)
        a, b, lazy = got
        return lazy[0][a:b] - key[1] * lazy[2]

    def pop_count(self, key):
        """How many experts were filed for `key`, taking them; None if none."""
        got = self._take(key)
        if got is None:
            guess = self._filed.pop(key, None)
            return None if guess is None else int(guess.shape[0])
        return got[1] - got[0]

    def take_step(self, step: int, num_layers: int) -> list:
        """Per layer l < num_layers, whether a guess was filed for (step, l),
        taking them all (one pass where the step was filed whole and
        nothing else: a planned step's scoring)."""
        lazy = self._steps.get(step)
        if lazy is not None and not self._filed and len(lazy[3]) == num_layers:
            del self._steps[step]
            return lazy[3]
        return [self.pop_count((step, layer)) is not None for layer in range(num_layers)]

    def __setitem__(self, key, guess) -> None:
        self._take(key)
        self._filed[key] = guess

    def __bool__(self) -> bool:
        return bool(self._filed) or bool(self._steps)

    def clear(self) -> None:
        self._filed.clear()
        self._steps.clear()

    def _spill(self, step: int) -> None:
        """`step`'s lazily filed layers as dict entries."""
        flat, bounds, num_experts, open_, _ = self._steps.pop(step)
        for layer, is_open in enumerate(open_):
            if is_open:
                self._filed[(step, layer)] = flat[bounds[layer] : bounds[layer + 1]] - layer * num_experts

    def keys(self):
        for step in list(self._steps):
            self._spill(step)
        return self._filed.keys()
