"""The packed host copy of a model's experts (HostExperts) and the one
tensor over it and the engine's device arena that the sync-free decode path
reads (Universe, Note [Sync-free decode])."""
from __future__ import annotations

import weakref

import numpy as np
import torch

from prefetch._engine import SLOT_ALIGNMENT, fill_rows, same_offsets
from prefetch.checkpoint_experts import fill_from_checkpoint
from prefetch.errors import InvalidArgumentError, OutOfMemoryError, UnknownIdError
from prefetch.hf_blocks import ExpertsLayout
from prefetch.progress import report_progress

__all__ = ["HostExperts", "Universe", "RowMap", "StepRows"]

# The slot alignment of the engine (kSlotAlignmentBytes) and of HostExperts:
# the row grid of the sync-free path's one tensor (Note [Sync-free decode]).
_ROW_BYTES = SLOT_ALIGNMENT


def _unregister_host(buffer) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


class HostExperts:
    """Every expert of a model packed in one host buffer, each expert at a
    fixed stride in the engine's packed layout (its parts, each
    256-byte aligned: ExpertsLayout), page-locked in place with cudaHostRegister
    when `pin` (one registration of touched memory costs a fraction of
    allocating that much page-locked memory piece by piece). The engine
    copies straight from it (register_external): no second host copy.

    Made by offload_moe_experts and kept as ``controller.host_experts``;
    pass it as ``host_experts=`` to a later offload of a model with the same
    expert shapes (another budget or predictor) to skip packing again. The
    buffer lives while any handle registered from it does. `experts` (per
    layer, the expert ids to pack) packs only a subset: an expert-parallel
    rank's own slice (prefetch/expert_parallel.py). `checkpoint` (a folder
    of safetensors shards, or prefetch.checkpoint.index_checkpoint's dict)
    reads the experts from there instead of from the modules, whose
    weights may then be on the meta device (Note [Experts from the
    checkpoint] in prefetch/checkpoint_experts.py; `experts_names`: each
    experts module's path, `reader_threads`: DiskReader threads)."""

    def __init__(self, hf_blocks, *, pin: bool, progress: bool = False, experts=None, checkpoint=None,
                 experts_names=None, reader_threads: int = 4):
        first = hf_blocks[0][1]
        self.num_layers = len(hf_blocks)
        self.experts_layout = ExpertsLayout(first)
        self.num_experts = self.experts_layout.num_experts
        self.layout = self.experts_layout.parts
        self.expert_bytes = self.experts_layout.expert_bytes
        self.stride = self.experts_layout.slot_bytes
        # experts: per layer, the expert ids packed here (an expert-parallel
        # rank's slice); None packs them all. _row maps (layer, expert) to
        # its row in the buffer, -1 where not packed.
        if experts is None:
            self.experts = None
            chosen = [np.arange(self.num_experts)] * self.num_layers
        else:
            chosen = [np.asarray(ex, dtype=np.int64).reshape(-1) for ex in experts]
            if len(chosen) != self.num_layers or any(
                    ex.shape[0] and (ex.min() < 0 or ex.max() >= self.num_experts
                                     or np.unique(ex).shape[0] != ex.shape[0]) for ex in chosen):
                raise InvalidArgumentError(
                    f"experts must list, for each of the {self.num_layers} layers, distinct expert ids "
                    f"in 0..{self.num_experts - 1}")
            self.experts = tuple(tuple(int(e) for e in ex) for ex in chosen)
        self._row = np.full((self.num_layers, self.num_experts), -1, dtype=np.int64)
        rows_before = 0
        for layer, ex in enumerate(chosen):
            self._row[layer, ex] = rows_before + np.arange(ex.shape[0])
            rows_before += ex.shape[0]
        total = rows_before * self.stride
        # 256-byte aligned, as every cache slot is: one strided tensor can then
        # address both (Note [Sync-free decode]).
        self._raw = torch.empty(total + _ROW_BYTES, dtype=torch.uint8)
        shift = -self._raw.data_ptr() % _ROW_BYTES
        self.buffer = self._raw[shift : shift + total]
        if checkpoint is None:
            self._pack_modules(hf_blocks, chosen, total, progress)
        else:
            if experts_names is None or len(experts_names) != self.num_layers:
                raise InvalidArgumentError("checkpoint needs experts_names: the module path of each experts module")
            fill_from_checkpoint(self.buffer, self._row, self.stride, checkpoint, experts_names, chosen,
                                 self.experts_layout, threads=reader_threads, progress=progress)
        self.pinned = False
        if pin and total:
            err = torch.cuda.cudart().cudaHostRegister(self._raw.data_ptr(), self._raw.numel(), 0)
            if int(getattr(err, "value", err)) != 0:
                raise OutOfMemoryError(f"could not page-lock {total} bytes of host memory for the experts "
                                       f"(cudaHostRegister error {err})")
            self.pinned = True
            weakref.finalize(self, _unregister_host, self._raw)

    def _pack_modules(self, hf_blocks, chosen, total: int, progress: bool) -> None:
        """Copies the chosen experts' weights from the modules into the buffer."""
        done = 0
        next_report = 1 << 30
        for layer, (_, module, _) in enumerate(hf_blocks):
            ex = chosen[layer]
            if not ex.shape[0]:
                continue
            start = int(self._row[layer, ex[0]]) * self.stride
            rows = self.buffer[start : start + ex.shape[0] * self.stride].view(ex.shape[0], self.stride)
            # A contiguous run of experts (all of them, or a balanced slice) is
            # one view of the weight; another subset is copied expert by
            # expert (no gathered temporary on the weight's device).
            run = int(ex[-1] - ex[0]) + 1 == ex.shape[0] and bool((np.diff(ex) == 1).all())
            for part in self.layout:
                weight = getattr(module, part.name)
                dst = rows[:, part.offset : part.offset + part.nbytes].view(part.dtype).view(ex.shape[0], *part.shape)
                if run:
                    dst.copy_(weight.detach().narrow(0, int(ex[0]), ex.shape[0]))
                else:
                    for i, e in enumerate(ex.tolist()):
                        dst[i].copy_(weight.detach()[e])
            done += ex.shape[0] * self.stride
            next_report = report_progress(progress, "packed", "into host memory", done, total, next_report)

    def matches(self, hf_blocks, experts=None) -> bool:
        """Whether this buffer holds the experts of `hf_blocks`' shapes that an
        offload would pack (`experts`: the same per-layer subset, None = all)."""
        subset = None if experts is None else tuple(tuple(int(e) for e in ex) for ex in experts)
        return (len(hf_blocks) == self.num_layers and ExpertsLayout(hf_blocks[0][1]).key == self.experts_layout.key
                and subset == self.experts)

    def expert(self, layer: int, expert: int) -> torch.Tensor:
        row = int(self._row[layer, expert])
        if row < 0:
            raise UnknownIdError(f"expert {expert} of layer {layer} is not in this HostExperts (another rank's slice)")
        start = row * self.stride
        return self.buffer[start : start + self.expert_bytes]


def _address(buffer) -> int:
    return buffer.data_ptr() if isinstance(buffer, torch.Tensor) else buffer.ctypes.data


class _RawBytes:
    """`nbytes` bytes at address `ptr` through the array interfaces (no copy,
    no ownership): what torch.as_tensor needs to view memory it did not
    allocate."""

    def __init__(self, ptr: int, nbytes: int, cuda: bool):
        face = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3}
        if cuda:
            self.__cuda_array_interface__ = face
        else:
            self.__array_interface__ = face


class Universe:
    """Note [Sync-free decode]
    With unified virtual addressing a kernel reads page-locked host memory
    registered with CUDA through the same kind of pointer as device memory,
    over PCIe (a one-off probe on the H200: a gather of 8
    OLMoE experts from host memory moves 51 GB/s, the copy engine 55). The
    engine's arena and the packed host experts (both 256-byte aligned) are
    then rows of ONE strided tensor whose rows start every 256 bytes from
    the lower of the two: an expert's row is its address over 256, in a
    cache slot or in host memory (rows overlap; each is read from its start
    for one expert's bytes). An experts
    implementation run on that tensor with expert ids mapped to rows reads a
    cached expert from HBM and a missing one straight from host memory, so a
    layer needs no routing on the host before it computes: no sync. Per
    layer the host (1) pins every resident expert of the layer in one engine
    call (Note [Pins without waiting]) and releases the last layer's, (2)
    sends the layer's expert -> row map (resident: its slot; else its host
    row) in one small copy, (3) runs the implementation with the routing
    mapped through it on the GPU, and (4) queues a copy of the routing back
    to the host. That copy is read a layer or more later, without waiting:
    it says which experts were read (a use, for the eviction policy), which
    of them came from host memory (those are prefetched into the cache for
    the next step), and feeds the trace, the scoring and the predictor.
    batched_mm (generate's decode on a GPU) gathers rows by index, so it
    runs this way; grouped_mm and eager need the routing on the host (group
    sizes, loops) and take the synced path, as does a call with more rows
    than `max_rows` (batched_mm reads an expert once per row routed to it,
    over PCIe when missing)."""

    def __init__(self, arena, host: HostExperts, slot_bytes: int, device: torch.device):
        if host.stride != slot_bytes:
            raise InvalidArgumentError("host experts and cache slots differ in stride")
        a, h = _address(arena), host.buffer.data_ptr()
        size_a = arena.numel() if isinstance(arena, torch.Tensor) else arena.nbytes
        if a % _ROW_BYTES or h % _ROW_BYTES:
            raise InvalidArgumentError(f"the arena or the host experts are not {_ROW_BYTES}-byte aligned")
        base = min(a, h)
        end = max(a + size_a, h + host.buffer.numel())
        cuda = device.type == "cuda"
        raw = _RawBytes(base, end - base, cuda)
        flat = torch.as_tensor(raw, device=device) if cuda else torch.from_numpy(np.asarray(raw))
        # Rows start every _ROW_BYTES bytes (they overlap: a row is read as one
        # expert from its start), so any two aligned buffers share the grid.
        last = end - base - host.expert_bytes
        self.rows = last // _ROW_BYTES + 1
        self.arena_row0 = (a - base) // _ROW_BYTES
        usable = flat[: (end - base) // 16 * 16]
        # Rows start every _ROW_BYTES bytes: row r's parts at r * _ROW_BYTES.
        self.views = host.experts_layout.views(usable, self.rows, _ROW_BYTES)
        # expert -> its host row, per layer (-1: not packed here)
        host_row0 = (h - base) // _ROW_BYTES
        self.host_rows = np.where(host._row >= 0, host._row * (host.stride // _ROW_BYTES) + host_row0, -1)
        # One read through the tensor, checked against the bytes: a platform
        # where a kernel cannot read registered host memory by its address
        # fails here, at offload, not with wrong tokens.
        first = int(np.flatnonzero(host._row[0] >= 0)[0])
        want = host.expert(0, first)[: min(64, host.layout[0].nbytes)]
        part = host.layout[0]
        view = self.views[part.name][int(self.host_rows[0, first])]
        got = view.reshape(-1).view(torch.uint8)[: want.numel()]
        if not torch.equal(got.to(torch.int32).cpu(), want.to(torch.int32)):
            raise RuntimeError("a kernel read of page-locked host memory by its address gave other bytes")


class RowMap:
    """An expert -> row map of the sync-free path (Note [Sync-free decode]):
    a pinned expert's slot row in the arena, any other's host row
    (`host_rows`, one per expert). Made in page-locked host memory and sent
    to the device with one copy when the pins it was made from change (a
    CPU model reads the host one). Made outside inference mode: written
    with copy_ at each step, so an offload done inside it does not fail a
    later generate outside it."""

    def __init__(self, host_rows: np.ndarray, arena_row0: int, device: torch.device):
        self.host_rows = host_rows
        self.arena_row0 = arena_row0
        self.cuda = device.type == "cuda"
        n = host_rows.shape[0]
        with torch.inference_mode(False):
            self.host = torch.empty(n, dtype=torch.int64, pin_memory=self.cuda)
            self.dev = torch.empty(n, dtype=torch.int64, device=device) if self.cuda else self.host
        self.np = self.host.numpy()
        self.last = np.full(n, -2, dtype=np.int64)  # the offsets the map was made from (-2: none yet)
        self.event = None

    def update(self, offsets: np.ndarray, adjust=None) -> None:
        """The map for `offsets` (each expert's pinned slot offset, -1: not
        pinned), sent on the current stream unless it is the last one's
        (compared and made in C, prefetch/_routing.pxi: np.array_equal
        alone cost more than the rest of the branch test's layer).
        `adjust(rows)` edits the host map before it is sent."""
        if same_offsets(offsets, self.last):
            return
        if self.event is not None:
            self.event.synchronize()  # the buffer's last copy (a step ago: done)
        fill_rows(offsets, self.host_rows, self.arena_row0, _ROW_BYTES, self.np, self.last)
        if adjust is not None:
            adjust(self.np)
        if self.cuda:
            self.dev.copy_(self.host, non_blocking=True)
            if self.event is None:
                self.event = torch.cuda.Event()
            self.event.record()


class StepRows(RowMap):
    """Note [Step pins] in prefetch/offload/sync_free.py: every layer's expert ->
    row map made at a step's first layer from the pins of the whole step
    (`update` with every layer's offsets), and sent in one copy, not one a
    layer; each layer gathers through its slice. Shared by the offloaded
    layers of one model (no expert parallel)."""

    def __init__(self, universe: Universe, num_layers: int, num_experts: int, device: torch.device):
        host_rows = np.ascontiguousarray(universe.host_rows[:num_layers], dtype=np.int64).reshape(-1)
        if host_rows.shape[0] != num_layers * num_experts or (host_rows < 0).any():
            raise InvalidArgumentError("the host experts do not hold every expert of every layer")
        super().__init__(host_rows, universe.arena_row0, device)
        self.layers = [self.dev[la * num_experts : (la + 1) * num_experts] for la in range(num_layers)]
