"""The experts-interface wrapper: one offloaded MoE layer (ExpertsOffload),
attached to its experts module, runs transformers' own experts
implementation on the device cache's slots (Note [Experts on their own
module] in prefetch/hf_blocks.py) on the synced path, in pieces, and on the
sync-free path. Its expert-parallel forward is
prefetch/expert_parallel.py's ExpertParallelForward; offload_hf_model
(prefetch/hf.py) builds and attaches it.

Note [Experts on cache slots]
Every expert of a model has one packed layout (its parts, each 256-byte
aligned: ExpertsLayout) and so one slot size S in the engine's device
arena; with one size the arena's first-fit allocator only ever hands out
offsets that are multiples of S, so the arena is an array of n = budget
// S slots. Viewed with strides, each part is a stacked tensor [n, ...]
over the arena, exactly the stacked parameters an experts implementation
expects, with slot s in place of expert e. A layer then (1) reads its
routing back to the host once (the predictor's guesses ride along in the
same copy), (2) makes one engine call that acquires its experts and queues
the guesses, (3) maps each routed expert to its slot on the device with one
gather, and (4) calls the implementation on the experts module itself,
its parts read as the slot views and its `num_experts` as n (on_slots).
Per row, the arithmetic is the resident model's, on the same bytes. A
layer routing to more experts than there are slots (a long prompt on a
small budget) runs in pieces of at most n experts: acquire, compute with
the other experts' routing weights zeroed (their rows sent to a slot of
the piece: every implementation then reads real weights for them, and
multiplies them by 0), release, next; the pieces are summed. torch's
grouped_mm takes at most 1023 groups: with more slots than that (Qwen3-30B-A3B at 25 % has
1,536; OLMoE-1B-7B at 100 % has 1,024), a grouped_mm call gets the routed slots' weights gathered into
[k, ...] tensors (one device copy of the routed experts, in prefill where
grouped_mm runs; decode on a GPU runs batched_mm, which gathers anyway).
"""
from __future__ import annotations

import functools
import time

import numpy as np
import torch

from prefetch.controller import OffloadController
from prefetch.errors import HandleClosedError, InvalidArgumentError
from prefetch.expert_ids import routed_experts as _routed_experts
from prefetch.expert_parallel import ExpertParallelForward, LayerShare
from prefetch.hf_blocks import ExpertsLayout, on_slots
from prefetch.hf_guards import NoBackward
from prefetch.host_experts import RowMap, Universe

__all__ = ["ExpertsOffload"]

# The most groups torch's grouped_mm takes on CUDA: it checks group_count <
# 1024 ("Can't process more than 1024 groups"), so a cache of exactly 1024
# slots (OLMoE-1B-7B at 100 %) is one too many. A cache with more slots runs
# grouped_mm on a gathered copy of the routed slots instead (Note [Experts
# on cache slots]).
_GROUPED_MM_MAX_GROUPS = 1023


_current_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _raw_stream(device: torch.device):
    """The raw handle of torch's current stream on `device` (None on CPU)."""
    if device.type != "cuda":
        return None
    if _current_raw_stream is not None:
        return _current_raw_stream(device.index if device.index is not None else torch.cuda.current_device())
    return torch.cuda.current_stream(device).cuda_stream


def _no_stream():
    return None


class ExpertsOffload(ExpertParallelForward):
    """One offloaded MoE layer (attached to its experts module)."""

    def __init__(self, controller: OffloadController, layer: int, module, layout: ExpertsLayout,
                 device: torch.device, ep=None):
        self.controller = controller
        self.layer = layer
        self.device = device
        self.module = module
        self.layout = layout
        self.dtypes = {p.name: p.dtype for p in layout.parts}
        self._params = None  # the module's (empty) parameters, set by offload_hf_model
        self.last_layer = layer == controller.num_layers - 1
        self.slot_bytes = layout.slot_bytes
        arena = controller.handle.arena(0)
        if isinstance(arena, np.ndarray):
            arena = torch.from_numpy(arena)
        self.slots = arena.numel() // self.slot_bytes
        if self.slots < 1:
            raise InvalidArgumentError(
                f"device_budget_bytes={arena.numel()} holds no expert of {self.slot_bytes} bytes")
        # (views of each part, experts in them): the whole arena as slots
        self.on_cache = (layout.views(arena[: self.slots * self.slot_bytes], self.slots, self.slot_bytes),
                         self.slots)
        self.num_experts = controller.num_experts
        self._cuda = device.type == "cuda"
        # The raw handle of torch's current stream on the device (None on CPU).
        if not self._cuda:
            self._stream = _no_stream
        elif _current_raw_stream is not None and device.index is not None:
            self._stream = functools.partial(_current_raw_stream, device.index)
        else:
            self._stream = functools.partial(_raw_stream, device)
        self._remap = np.zeros(self.num_experts, dtype=np.int64)  # expert -> slot, for this call's experts
        self._index_host = None  # page-locked staging for the slot index (CUDA)
        self._index_np = None
        # Sync-free decode (Note [Sync-free decode]): set by offload_hf_model.
        self.universe = None
        self.step_rows = None  # StepRows (Note [Step pins]); None with expert parallel
        self._on_universe = None  # (views, rows) of the sync-free path's one tensor
        self._rowmap = None  # this layer's RowMap, for steps not pinned whole
        # Expert parallel (Note [Expert parallel] in prefetch/expert_parallel.py):
        # this rank's share of the layer; None without a process group.
        self.ep = ep
        self.share = None if ep is None else LayerShare(ep, layer, device, controller)
        self._local = None if ep is None else self.share.local

    def enable_sync_free(self, universe: Universe, max_rows: int) -> None:
        self.universe = universe
        self._on_universe = (universe.views, universe.rows)
        self.max_rows = max_rows
        host_rows = universe.host_rows[self.layer].copy()
        if self._local is not None:
            # Other ranks' experts get weight 0 but are still read: point them
            # at one of this rank's host rows (real weights: 0 x a finite
            # value is 0; a slot not pinned could be mid-copy or never
            # written), or at a pinned slot (_forward_sync_free).
            own = host_rows[self._local]
            if not own.size or (own < 0).any():
                raise InvalidArgumentError(f"layer {self.layer}: this rank's experts are not all in its host experts")
            host_rows[~self._local] = own[0]
        self._rowmap = RowMap(host_rows, universe.arena_row0, self.device)

    def _forward_sync_free(self, fn, hidden_states, top_k_index, top_k_weights):
        """Note [Sync-free decode]: pin the layer's resident experts, map
        every expert to its cache row or host row, compute, queue the routing
        read-back."""
        ctl = self.controller
        t_start = time.perf_counter_ns()
        engine_before, sync_before = ctl.engine_ns, ctl.sync_ns
        layer = self.layer
        ctl.begin_layer(layer)
        stream = self._stream()
        offsets, pinned = ctl.pin_layer(layer, hidden_states, stream)
        whole = ctl.whole_step_offsets() if self.step_rows is not None else None
        if whole is not None:
            # Every layer was pinned at layer 0 (Note [Step pins], Note
            # [Steady pins]): so is every layer's map.
            if layer == 0:
                self.step_rows.update(whole)
            rowmap = self.step_rows.layers[layer]
        else:
            # Row of each expert: its slot when pinned, else its host row. In
            # a steady decode the pins are the same every step: the map on
            # the device is still right and nothing is sent.
            adjust = None if self.share is None else functools.partial(self.share.foreign_rows, pinned)
            self._rowmap.update(offsets, adjust)
            rowmap = self._rowmap.dev
        # torch.take: the same gather as indexing, through less dispatch.
        index = torch.take(rowmap, top_k_index)
        routing = top_k_index
        if self.ep is not None:  # this rank's experts, per (token, k) pair (Note [Expert parallel])
            hidden_states, index, top_k_weights = self.share.pairs(hidden_states, index, top_k_weights, routing)
        t2 = time.perf_counter_ns()
        out = self._run(fn, self._on_universe, hidden_states, index, top_k_weights)
        t3 = time.perf_counter_ns()
        ctl.note_routing(layer, routing)
        if self.last_layer:
            ctl.queue_read_back()
            ctl.release_held(stream)
        comm = 0
        if self.share is not None:
            out, comm = self.share.all_reduce(out)
        t_end = time.perf_counter_ns()
        ctl.layers_run += 1
        # As on the synced path: the engine calls, the routing read-back and
        # the all-reduce are counted apart, not as "our other host work".
        engine, sync = ctl.engine_ns - engine_before, ctl.sync_ns - sync_before
        ctl.host_ns += (t_end - t_start) - (t3 - t2) - engine - sync - comm
        return out

    def _slot_index(self, routed: np.ndarray, shape) -> torch.Tensor:
        """The routing with expert ids replaced by slots (self._remap), on the
        device: mapped on the host, where the routing already is, and sent
        in one copy from page-locked memory."""
        staged = self._staging(routed.shape[0])
        np.take(self._remap, routed, out=staged)
        return self._send(staged).view(shape)

    def _staging(self, n: int) -> np.ndarray:
        """n int64s of host staging for one copy to the device (_send):
        page-locked on CUDA, reused. Its previous copy was queued before
        this layer's routing read-back, which waited for it, so one layer
        stages once."""
        if not self._cuda:
            return np.empty(n, dtype=np.int64)
        if self._index_np is None or self._index_np.shape[0] < n:
            self._index_host = torch.empty(max(n, 64), dtype=torch.int64, pin_memory=True)
            self._index_np = self._index_host.numpy()
        return self._index_np[:n]

    def _send(self, staged: np.ndarray) -> torch.Tensor:
        if not self._cuda:
            return torch.from_numpy(staged)
        return self._index_host[: staged.shape[0]].to(self.device, non_blocking=True)

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """Note [Host indices without a stream sync]
        A host array on the device, queued on the current stream without
        waiting for it. `torch.from_numpy(a).to(device)` copies from pageable
        memory and then synchronizes the stream (torch's memcpy_and_sync):
        the host waits there for everything queued before, this layer's
        expert copies included, and the GPU then idles while the host
        launches the layer's compute and the next layer's work. The gathered
        grouped_mm (more slots than grouped_mm takes: a prefill of
        Qwen3-30B-A3B at 25 %) and every piece of a layer larger than the
        cache paid that once per call. Here the array goes through page-locked
        memory from torch's caching host allocator, which keeps the block
        until the copy that reads it has run, so nothing waits. (Not
        _staging's buffer: the same call stages its slot index there after
        this, before this copy need have run.) On the CPU: the array itself."""
        tensor = torch.from_numpy(array)
        if not self._cuda:
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _stand_for(self, name, slots: np.ndarray, experts: np.ndarray):
        """The weights to run `name` on, as (views of each part, expert
        count), with self._remap mapping `experts` to their indices: the
        slot views, or for a grouped_mm over more slots than it takes, or on
        the CPU, the routed slots gathered (in `experts`' order).

        Why the CPU gathers: grouped_mm sorts the routing (torch.sort, not
        stable) and on the CPU a row's result depends on its position in
        its group (MKL on an AMD EPYC host: a group of 7 or 9 rows, its rows
        permuted, differs by an ulp). Slot ids are not in expert order, so
        the sort breaks ties differently from the resident model's and the
        logits differed by 3e-8 from it. Group ids in expert order (the
        gathered slots, `experts` sorted) make the same comparisons, the same
        order and the same bits. On CUDA, grouped_mm on slot ids gives the
        resident model's bits, and prefill is not charged a copy of the
        routed experts."""
        if name != "grouped_mm" or (self._cuda and self.slots <= _GROUPED_MM_MAX_GROUPS):
            self._remap[experts] = slots
            return self.on_cache
        picked = self._to_device(slots)
        views = {n: v.index_select(0, picked) for n, v in self.on_cache[0].items()}
        self._remap[experts] = np.arange(slots.shape[0])
        return views, int(slots.shape[0])

    def _run(self, fn, weights, hidden_states, index, top_k_weights):
        """The implementation `fn` on the experts module itself, its parts
        read as `weights` (views, expert count): Note [Experts on their own
        module]."""
        views, count = weights
        with on_slots(self.module, views, count):
            return fn(self.module, hidden_states, index, top_k_weights)

    def _slot_ids(self, where: np.ndarray) -> np.ndarray:
        offsets = where[:, 0]
        size = self.slot_bytes
        if offsets.shape[0] <= 64:  # a decode layer's few experts: Python ints beat two numpy calls
            listed = offsets.tolist()
            slots, off_grid = np.array([o // size for o in listed], dtype=np.int64), any(o % size for o in listed)
        else:
            slots, off_grid = np.divmod(offsets, size)
            off_grid = off_grid.any()
        if off_grid:
            raise RuntimeError("an expert's cache slot is not on the slot grid: the handle holds tensors of "
                               "another size (offload_moe_experts needs a handle of its own)")
        return slots

    def forward(self, fn, name, hidden_states, top_k_index, top_k_weights):
        if self.layer == 0:  # a model.to(...) converts every layer: one look a forward
            first = self.layout.parts[0].name
            weight = self._params.get(first) if self._params is not None else None
            if weight is not None and (weight.dtype is not self.dtypes[first] or weight.device != self.device):
                raise self._converted(weight)
            if self.controller.handle.closed:
                raise HandleClosedError(
                    "this model's experts were offloaded by a controller that is now closed (controller.close()): "
                    "their weights lived in its engine and are gone with it, so the model cannot run. Build or load "
                    "the model again and offload it anew (offload_moe_experts)")
        if (hidden_states.requires_grad or top_k_weights.requires_grad) and torch.is_grad_enabled():
            # Note [No backward through the cache]
            return NoBackward.apply(functools.partial(self._forward, fn, name), hidden_states, top_k_index,
                                    top_k_weights)
        return self._forward(fn, name, hidden_states, top_k_index, top_k_weights)

    def _converted(self, weight) -> RuntimeError:
        return RuntimeError(
            f"MoE layer {self.layer}: the model was converted to {weight.dtype} on {weight.device} after "
            f"offload_moe_experts, but its offloaded experts were packed as {self.dtypes[self.layout.parts[0].name]} "
            f"for {self.device} and "
            "stay so: convert or move the model (model.to(...)) before offloading it")

    def _forward(self, fn, name, hidden_states, top_k_index, top_k_weights):
        if self._on_universe is not None and name == "batched_mm" and top_k_index.numel() <= self.max_rows:
            ctl = self.controller
            if self.layer == 0:  # once a step: read the last step's routings, pick this one's path
                t0, engine_before, sync_before = time.perf_counter_ns(), ctl.engine_ns, ctl.sync_ns
                ctl.choose_path()
                ctl.host_ns += (time.perf_counter_ns() - t0 - (ctl.engine_ns - engine_before)
                                - (ctl.sync_ns - sync_before))
            if ctl.sync_free_active:
                return self._forward_sync_free(fn, hidden_states, top_k_index, top_k_weights)
        ctl = self.controller
        t_start = time.perf_counter_ns()
        layer = self.layer
        ctl.begin_layer(layer)
        sync_before = ctl.sync_ns
        # A predictor with host guesses predicts after the read-back, in one
        # go with observe (with a plan: Note [The oracle's plan] in
        # prefetch/predictors.py); the others' guesses may be device
        # tensors, read back with the routing.
        host_guesses = getattr(ctl.predictor, "host_guesses", False)
        routed, guesses = ctl.read_back({} if host_guesses else ctl.predict(layer, hidden_states), top_k_index)
        experts = _routed_experts(routed, self.num_experts)
        if host_guesses:
            guesses, hints = ctl.observe_and_guess(layer, experts)
        else:
            guesses, hints = ctl.observe(layer, experts, guesses)
        guesses = ctl.read_ahead(layer, experts, guesses)
        stream = self._stream()
        engine_before = ctl.engine_ns
        if self._local is not None:
            out, t2, t3 = self._forward_local(fn, name, hidden_states, top_k_index, top_k_weights, routed,
                                               experts, guesses, hints, stream)
        elif experts.shape[0] <= self.slots:
            where = ctl.exchange(layer, experts, guesses, hints, stream=stream)
            stand = self._stand_for(name, self._slot_ids(where), experts)
            index = self._slot_index(routed, top_k_index.shape)
            t2 = time.perf_counter_ns()
            out = self._run(fn, stand, hidden_states, index, top_k_weights)
            t3 = time.perf_counter_ns()
        else:
            t2 = time.perf_counter_ns()
            out, inner_ns = self._pieces(fn, name, hidden_states, top_k_index, top_k_weights, experts,
                                         guesses, hints, stream)
            t3 = t2 + inner_ns
        if self.last_layer:
            ctl.release_held(stream)
        out, comm = self.share.all_reduce(out) if self.share is not None else (out, 0)
        t_end = time.perf_counter_ns()
        ctl.layers_run += 1
        engine = ctl.engine_ns - engine_before
        sync = ctl.sync_ns - sync_before
        ctl.host_ns += (t_end - t_start) - sync - (t3 - t2) - engine - comm
        return out

    def _pieces(self, fn, name, hidden_states, top_k_index, top_k_weights, experts, guesses, hints, stream):
        """More routed experts than slots: acquire, compute and release at
        most `slots` experts at a time; the other experts' routing weights
        are zero in each piece, and their rows go to a slot of the piece
        (see ExpertParallelForward._forward_local, prefetch/expert_parallel.py,
        for why not past the last slot)."""
        ctl = self.controller
        out = None
        inner_ns = 0
        for start in range(0, experts.shape[0], self.slots):
            piece = experts[start : start + self.slots]
            first = start == 0
            where = ctl.exchange(self.layer, piece, guesses if first else {}, hints if first else None,
                                 stream=stream)
            stand = self._stand_for(name, self._slot_ids(where), piece)
            sentinel = stand[1]  # past the last slot: marks the rows outside the piece
            in_piece = np.zeros(self.num_experts, dtype=bool)
            in_piece[piece] = True
            remap = np.where(in_piece, self._remap, sentinel)
            index = self._to_device(remap)[top_k_index]
            inside = index < sentinel
            weights = top_k_weights.masked_fill(~inside, 0)
            index = index.masked_fill(~inside, int(remap[piece[0]]))
            t0 = time.perf_counter_ns()
            part = self._run(fn, stand, hidden_states, index, weights)
            inner_ns += time.perf_counter_ns() - t0
            out = part if out is None else out + part
        return out, inner_ns

