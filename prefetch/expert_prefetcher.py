"""ExpertPrefetcher: (layer, expert) pairs on top of a PrefetchHandle.

Each expert is registered as one tensor id whose host buffer packs all of
the expert's weights (say w1, w2, w3) back to back, each part aligned to
256 bytes: one copy per expert instead of one per weight. After ``acquire``
the parts come back as torch tensors with their registered dtypes and shapes,
views into the device cache.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from prefetch._engine import DEFAULT_ACQUIRE_TIMEOUT_S, DEFAULT_PRIORITY, SLOT_ALIGNMENT, as_id_array
from prefetch.errors import InvalidArgumentError, UnknownIdError

PART_ALIGNMENT_BYTES = SLOT_ALIGNMENT  # each packed weight starts on the engine's slot boundary


@dataclass(frozen=True)
class PartLayout:
    """Where one weight of an expert sits in its packed buffer."""

    name: str
    dtype: object  # torch.dtype
    shape: tuple
    offset: int  # bytes from the start of the packed buffer
    nbytes: int


def _align(n: int) -> int:
    return (n + PART_ALIGNMENT_BYTES - 1) // PART_ALIGNMENT_BYTES * PART_ALIGNMENT_BYTES


def cache_slot_bytes(nbytes: int) -> int:
    """The bytes of device cache one registered tensor of `nbytes` takes:
    its size rounded up to SLOT_ALIGNMENT, and at least one SLOT_ALIGNMENT
    (the engine's slot, device_cache.h)."""
    return max(SLOT_ALIGNMENT, _align(int(nbytes)))


def _weight_items(weights) -> dict:
    if isinstance(weights, Mapping):
        items = dict(weights)
    else:
        items = {str(i): w for i, w in enumerate(weights)}
    if not items:
        raise InvalidArgumentError("an expert needs at least one weight tensor")
    return items


def expert_layout(weights) -> tuple[PartLayout, ...]:
    """Where each weight goes in an expert's packed buffer (each part aligned
    to PART_ALIGNMENT_BYTES). Weights: CPU torch tensors, by name or in order."""
    import torch

    layout = []
    offset = 0
    for name, tensor in _weight_items(weights).items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise InvalidArgumentError(f"weight {name!r} must be on the CPU, got {tensor.device}")
        nbytes = tensor.numel() * tensor.element_size()
        layout.append(PartLayout(name, tensor.dtype, tuple(tensor.shape), offset, nbytes))
        offset = _align(offset + nbytes)
    return tuple(layout)


def stacked_views(flat, rows: int, row_bytes: int, layout) -> dict:
    """Per part of `layout` (an expert's packed layout), a [rows, *shape]
    view of `flat` (a 1-D uint8 tensor holding experts `row_bytes` apart,
    the first at its byte 0, which may lie inside a larger storage): row
    r's part is view[r], the stacked weight an experts implementation
    reads. Zero-copy (as_strided)."""
    import torch

    views = {}
    for part in layout:
        itemsize = torch.empty(0, dtype=part.dtype).element_size()
        if row_bytes % itemsize or part.offset % itemsize:
            raise InvalidArgumentError(f"part {part.name!r} is not aligned to its {itemsize}-byte items")
        typed = flat[: flat.numel() // itemsize * itemsize].view(part.dtype)
        strides = [1] * len(part.shape)
        for i in range(len(part.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * part.shape[i + 1]
        views[part.name] = typed.as_strided((rows, *part.shape), (row_bytes // itemsize, *strides),
                                            typed.storage_offset() + part.offset // itemsize)
    return views


def pack_expert(weights, *, pin_memory: bool = False):
    """Packs an expert's weights into one contiguous uint8 CPU tensor (page-
    locked with pin_memory) and returns (buffer, layout) for register_packed."""
    import torch

    layout = expert_layout(weights)
    total = layout[-1].offset + layout[-1].nbytes
    buffer = torch.zeros(total, dtype=torch.uint8, pin_memory=pin_memory)
    for part, tensor in zip(layout, _weight_items(weights).values()):
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[part.offset : part.offset + part.nbytes].copy_(flat)
    return buffer, layout


class ExpertPrefetcher:
    """Maps (layer, expert) to tensor ids and issues their prefetches.

    ``engine`` is a PrefetchHandle (or anything with ``enqueue_prefetch`` and,
    optionally, ``prefetch_tensors``). ``use_batched=None`` picks the batched
    call when the engine has one; ``False`` forces the per-expert loop (the
    reference design's path, kept as a fallback and as the BM2 baseline).

    Each registered expert gets the next tensor id. By default that is the
    lowest id from 0 up that the engine does not have yet (``tid in
    engine``), so ids registered by hand or by another prefetcher on the
    same handle are skipped. ``first_tensor_id=N`` hands ids out densely
    from N instead, without looking; an id the engine already has then
    raises ValueError from its register call.
    """

    def __init__(self, engine, *, use_batched: bool | None = None, first_tensor_id: int | None = None):
        self.engine = engine
        has_batched = callable(getattr(engine, "prefetch_tensors", None))
        if use_batched and not has_batched:
            raise InvalidArgumentError("use_batched=True but the engine has no prefetch_tensors")
        self.batched = has_batched if use_batched is None else bool(use_batched)
        self._next_id = 0 if first_tensor_id is None else int(first_tensor_id)
        # Automatic ids skip the engine's: needs `in` (PrefetchHandle has it).
        self._skip_taken = first_tensor_id is None and hasattr(type(engine), "__contains__")
        self._ids: dict[int, np.ndarray] = {}  # layer -> expert-indexed ids, -1 = none
        self.version = 0  # moves at every registration (tables made from _ids compare it)
        self._layouts: dict[int, tuple[PartLayout, ...]] = {}  # tensor id -> parts
        # Per device, the cache bytes its registered experts take at once
        # (each in slots of SLOT_ALIGNMENT); None once an adopted id, whose
        # size is not known here, is among them (holds_every_expert).
        self._slot_bytes: dict[int, int] | None = {}
        self._holds_all = (-1, False)  # (version, holds_every_expert())
        # Views reused while an expert's slot stays put (see _acquire_cached):
        # engines with acquire_slots and arena only.
        self._slot_views = callable(getattr(engine, "acquire_slots", None)) and callable(
            getattr(engine, "arena", None))
        self._views: dict[int, tuple[int, int, dict]] = {}  # tensor id -> (offset, device, weights)
        self._arenas: dict[int, object] = {}  # device -> torch uint8 arena
        self._held = None  # the ids the last `layer` call acquired, released by the next

    # ------------------------------------------------------------ registry

    def register_expert(
        self,
        layer_id: int,
        expert_id: int,
        weights: Mapping[str, object] | Sequence[object],
        *,
        device: int = 0,
    ) -> int:
        """Packs an expert's weights (CPU torch tensors, by name or in order)
        into one engine tensor (one host copy) and returns its id."""
        layer_id, expert_id = self._check_new(layer_id, expert_id)
        layout = expert_layout(weights)
        parts = [(tensor, part.offset) for part, tensor in zip(layout, _weight_items(weights).values())]
        total = layout[-1].offset + layout[-1].nbytes
        tensor_id = self._free_id()
        self.engine.register_parts(tensor_id, parts, total_bytes=total, device=device)
        return self._remember(layer_id, expert_id, tensor_id, layout, device, total)

    def register_packed(self, layer_id: int, expert_id: int, buffer, layout, *, device: int = 0) -> int:
        """Registers an expert already packed by `pack_expert` without
        copying: the engine reads `buffer` (keep it unchanged; page-locked
        for full-speed CUDA copies) directly."""
        layer_id, expert_id = self._check_new(layer_id, expert_id)
        layout = tuple(layout)
        need = layout[-1].offset + layout[-1].nbytes
        if buffer.numel() * buffer.element_size() < need:
            raise InvalidArgumentError(
                f"buffer holds {buffer.numel() * buffer.element_size()} bytes, layout needs {need}")
        tensor_id = self._free_id()
        self.engine.register_external(tensor_id, buffer, device=device)
        return self._remember(layer_id, expert_id, tensor_id, layout, device, buffer.numel() * buffer.element_size())

    def register_disk(self, layer_id: int, expert_id: int, extents, layout, *, device: int = 0) -> int:
        """Registers an expert whose packed bytes (`layout`, as pack_expert
        makes it) are read from files by the engine's host tier (Note [Host
        tier]; the handle needs host_budget_bytes > 0): `extents` is a list
        of ``(file, file_offset, nbytes, offset in the packed expert)``,
        ``file`` from ``engine.open_file``. Nothing is read now."""
        layer_id, expert_id = self._check_new(layer_id, expert_id)
        layout = tuple(layout)
        tensor_id = self._free_id()
        total = layout[-1].offset + layout[-1].nbytes
        self.engine.register_disk(tensor_id, extents, total_bytes=total, device=device)
        return self._remember(layer_id, expert_id, tensor_id, layout, device, total)

    def adopt(self, layer_id: int, expert_id: int, tensor_id: int) -> int:
        """Maps (layer_id, expert_id) to `tensor_id`, an id registered on the
        handle directly (``PrefetchHandle.register`` or ``register_external``):
        ``prefetch_experts`` and ``tensor_ids`` then take it by (layer,
        expert). Having no layout of weights, it cannot come back as weights:
        ``acquire_experts`` raises ValueError for it (acquire its id on the
        handle)."""
        layer_id, expert_id = self._check_new(layer_id, expert_id)
        tensor_id = int(tensor_id)
        if tensor_id not in self.engine:
            raise UnknownIdError(f"tensor id {tensor_id} is not registered on the handle")
        if any(tensor_id in table for table in self._ids.values()):
            raise InvalidArgumentError(f"tensor id {tensor_id} already stands for an expert")
        next_id = self._next_id
        self._remember(layer_id, expert_id, tensor_id, (), None, None)
        self._next_id = max(next_id, tensor_id + 1)
        return tensor_id

    def _check_new(self, layer_id, expert_id) -> tuple[int, int]:
        layer_id = int(layer_id)
        expert_id = int(expert_id)
        if layer_id < 0 or expert_id < 0:
            raise InvalidArgumentError("layer and expert ids must be >= 0")
        if self._lookup(layer_id, expert_id) >= 0:
            raise InvalidArgumentError(f"expert ({layer_id}, {expert_id}) is already registered")
        return layer_id, expert_id

    def _free_id(self) -> int:
        """The id the next expert gets (see the class docstring)."""
        tensor_id = self._next_id
        if self._skip_taken:
            while tensor_id in self.engine:
                tensor_id += 1
        return tensor_id

    def _remember(self, layer_id: int, expert_id: int, tensor_id: int, layout, device, nbytes) -> int:
        """Files a registered expert; `device` and `nbytes` (the engine
        tensor's bytes) are None for an adopted id."""
        self._next_id = tensor_id + 1
        if nbytes is None or self._slot_bytes is None:
            self._slot_bytes = None
        else:
            self._slot_bytes[device] = self._slot_bytes.get(device, 0) + cache_slot_bytes(nbytes)
        table = self._ids.get(layer_id)
        if table is None or table.shape[0] <= expert_id:
            grown = np.full(max(expert_id + 1, 2 * (0 if table is None else table.shape[0])), -1, dtype=np.int64)
            if table is not None:
                grown[: table.shape[0]] = table
            table = grown
            self._ids[layer_id] = table
        table[expert_id] = tensor_id
        self.version += 1
        self._layouts[tensor_id] = tuple(layout)
        return tensor_id

    def holds_every_expert(self) -> bool:
        """Whether each device's cache holds every expert registered on it
        at once, each in its own slot, and the handle has no tensors but
        these: then no expert is ever evicted, and what an eviction policy
        is told about next uses changes nothing (OraclePredictor sends no
        next-use hints then, Note [No hints when everything fits] in
        prefetch/predictors.py). False for an engine without budgets, after
        an ``adopt`` (its size is not known here), while nothing is
        registered and once the handle is closed. Worked out again after
        each registration through this prefetcher; a tensor registered on
        the handle directly later is not seen until then."""
        version = self.version
        if self._holds_all[0] != version:
            self._holds_all = (version, self._fits_whole())
        return self._holds_all[1]

    def _fits_whole(self) -> bool:
        engine = self.engine
        sizes = self._slot_bytes
        if (not sizes or not callable(getattr(engine, "budget_bytes", None)) or not hasattr(engine, "stats")
                or getattr(engine, "closed", False)):
            return False
        if engine.stats()["registered"] != len(self._layouts):
            return False  # the handle holds tensors of someone else's
        return all(need <= engine.budget_bytes(device) for device, need in sizes.items())

    def _lookup(self, layer_id: int, expert_id: int) -> int:
        table = self._ids.get(layer_id)
        if table is None or expert_id >= table.shape[0]:
            return -1
        return int(table[expert_id])

    def tensor_id(self, layer_id: int, expert_id: int) -> int:
        tid = self._lookup(int(layer_id), int(expert_id))
        if tid < 0:
            raise UnknownIdError(f"expert ({layer_id}, {expert_id}) is not registered")
        return tid

    def tensor_ids(self, layer_id: int, expert_list) -> np.ndarray:
        """The tensor ids of `expert_list` in layer `layer_id`, in order, as
        a contiguous int64 array. Unknown experts raise UnknownIdError."""
        experts = as_id_array(expert_list)
        table = self._ids.get(int(layer_id))
        n = experts.shape[0]
        if table is None:
            if n == 0:
                return experts
            raise UnknownIdError(f"layer {layer_id} has no registered experts")
        if not n:
            return table[experts]
        # A layer's few experts: Python's min and max over ints beat two
        # numpy reductions each (most of a by-hand layer's Python time).
        listed = experts.tolist() if n <= 64 else None
        low, high = (min(listed), max(listed)) if listed is not None else (experts.min(), experts.max())
        if low < 0 or high >= table.shape[0]:
            bad = experts[(experts < 0) | (experts >= table.shape[0])][0]
            raise UnknownIdError(f"expert ({layer_id}, {int(bad)}) is not registered")
        ids = table[experts]
        if (min(ids.tolist()) if listed is not None else ids.min()) < 0:
            bad = experts[ids < 0][0]
            raise UnknownIdError(f"expert ({layer_id}, {int(bad)}) is not registered")
        return ids

    def layout(self, tensor_id: int) -> tuple[PartLayout, ...]:
        return self._layouts[tensor_id]

    # ------------------------------------------------------------ prefetch

    def prefetch_experts(self, layer_id: int, expert_list, priority: int = DEFAULT_PRIORITY) -> None:
        """Queues the experts of `layer_id` at `priority`: one batched engine
        call, or one call per expert on the fallback path (same ids, same
        order). Empty input is a no-op. ``prefetch_experts_list`` is the
        same method under the seed system's name."""
        ids = self.tensor_ids(layer_id, expert_list)
        if ids.shape[0] == 0:
            return
        if self.batched:
            self.engine.prefetch_tensors(ids, priority)
        else:
            enqueue = self.engine.enqueue_prefetch
            for tid in ids.tolist():
                enqueue(tid, priority)

    prefetch_experts_list = prefetch_experts  # MoE-Infinity's name, kept

    # ----------------------------------------------------- acquire/release

    def acquire_experts(self, layer_id: int, expert_list, *, stream=None, timeout: float = DEFAULT_ACQUIRE_TIMEOUT_S):
        """Pins the experts and returns, per expert, a dict of weight name to
        torch tensor (a view into the cache, valid until release)."""
        ids = self.tensor_ids(layer_id, expert_list)
        return self._acquire_ids(ids, stream=stream, timeout=timeout)

    def _acquire_ids(self, ids: np.ndarray, *, stream, timeout: float):
        for tid in ids.tolist():  # before anything is pinned
            if not self._layouts[tid]:
                raise InvalidArgumentError(
                    f"tensor id {tid} was adopted without a layout of weights: acquire it on the "
                    "handle (PrefetchHandle.acquire) instead")
        if self._slot_views:
            return self._acquire_cached(ids, stream=stream, timeout=timeout)
        import torch

        views = self.engine.acquire(ids, stream=stream, timeout=timeout)
        experts = []
        for tid, raw in zip(ids.tolist(), views):
            if isinstance(raw, np.ndarray):
                raw = torch.from_numpy(raw)
            experts.append(self._weights(tid, raw))
        return experts

    def _weights(self, tensor_id: int, raw) -> dict:
        """The parts of `tensor_id` as typed views of `raw`, its bytes."""
        weights = {}
        for part in self._layouts[tensor_id]:
            chunk = raw[part.offset : part.offset + part.nbytes]
            weights[part.name] = chunk.view(part.dtype).view(part.shape)
        return weights

    def _acquire_cached(self, ids: np.ndarray, *, stream, timeout: float):
        """acquire through the engine's slot offsets: an expert whose slot is
        where it was last time gets the same views again (views of the arena,
        so they see whatever bytes the slot holds now); only experts that
        moved get new ones. Saves the ~3 tensor ops per weight that building
        views costs, which on a slow host is most of an acquire."""
        return self.weights_in_slots(ids, self.engine.acquire_slots(ids, stream=stream, timeout=timeout))

    def weights_in_slots(self, ids: np.ndarray, where: np.ndarray, *, copy: bool = True) -> list[dict]:
        """Per tensor id of `ids` (acquired, with their (offset, device) rows
        `where`, as acquire_slots or PrefetchHandle.exchange returns them), a
        dict of weight name to a view of its cache slot (valid until
        release). Views are kept per slot: an expert found where it was
        last time gets the same ones again."""
        experts = []
        cache = self._views
        for tid, offset, device in zip(ids.tolist(), where[:, 0].tolist(), where[:, 1].tolist()):
            known = cache.get(tid)
            if known is None or known[0] != offset or known[1] != device:
                known = (offset, device, self._weights(tid, self._arena(device)[offset:]))
                cache[tid] = known
            experts.append(dict(known[2]) if copy else known[2])  # a caller may change its copy
        return experts

    def _arena(self, device: int):
        arena = self._arenas.get(device)
        if arena is None:
            arena = self.engine.arena(device)
            if isinstance(arena, np.ndarray):
                import torch

                arena = torch.from_numpy(arena)
            self._arenas[device] = arena
        return arena

    def release_experts(self, layer_id: int, expert_list, *, stream=None) -> None:
        self.engine.release(self.tensor_ids(layer_id, expert_list), stream=stream)

    @contextlib.contextmanager
    def experts(self, layer_id: int, expert_list, *, stream=None, timeout: float = DEFAULT_ACQUIRE_TIMEOUT_S):
        """``with prefetcher.experts(layer, [3, 7]) as weights:`` acquires,
        yields the weights, and releases (on `stream`) on exit."""
        ids = self.tensor_ids(layer_id, expert_list)
        weights = self._acquire_ids(ids, stream=stream, timeout=timeout)
        try:
            yield weights
        finally:
            self.engine.release(ids, stream=stream)

    def layer(self, layer_id: int, expert_list, *, prefetch=None, priority: int = DEFAULT_PRIORITY, stream=None,
              timeout: float = DEFAULT_ACQUIRE_TIMEOUT_S) -> list[dict]:
        """One MoE layer's work in one engine call (PrefetchHandle.exchange), as
        the engine's exchange is to its separate calls: releases the experts the
        previous `layer` call acquired (after the work queued on `stream`),
        acquires `expert_list` of `layer_id`, and queues `prefetch`
        ({later layer: experts}, your guesses) at `priority`. Returns, per
        expert, its weights as views of the cache, valid until the next
        `layer` call or `release_held` (the dicts are the prefetcher's own:
        read them, do not change them). Bad input raises before anything
        changes; an acquire that fails later (a timeout, a failed copy)
        leaves the previous layer's experts released."""
        if not self._slot_views:
            raise InvalidArgumentError("layer() needs an engine with exchange, acquire_slots and arena "
                                       "(PrefetchHandle)")
        ids = self.tensor_ids(layer_id, expert_list)
        guesses = None
        if prefetch:
            parts = [self.tensor_ids(later, experts) for later, experts in prefetch.items()]
            guesses = parts[0] if len(parts) == 1 else np.concatenate(parts)
        layouts = self._layouts
        for tid in ids.tolist():
            if not layouts[tid]:
                raise InvalidArgumentError(f"tensor id {tid} was adopted without a layout of weights: acquire it on "
                                           "the handle instead")
        try:
            where = self.engine.exchange(ids, release=self._held, prefetch=guesses, priority=priority,
                                         stream=stream, timeout=timeout)
        except (InvalidArgumentError, UnknownIdError):
            raise  # checked before anything changed: the previous layer's experts are still held
        except BaseException:
            self._held = None  # the release ran before the acquire failed
            raise
        self._held = ids
        return self.weights_in_slots(ids, where, copy=False)

    def release_held(self, *, stream=None) -> None:
        """Releases the experts the last `layer` call acquired (a no-op when
        none are held), e.g. after a forward's last layer."""
        held, self._held = self._held, None
        if held is not None:
            self.engine.release(held, stream=stream)

    def registered_experts(self) -> Iterable[tuple[int, int]]:
        for layer_id, table in self._ids.items():
            for expert_id in np.flatnonzero(table >= 0).tolist():
                yield layer_id, expert_id
