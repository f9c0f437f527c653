"""BM5's expert providers (bench/e2e.py): resident, the engine with each
predictor, and the by-hand PyTorch LRU.

``acquire(layer, x, experts)`` hands a layer a (gate_up, down) pair of
views per expert; a provider with ``acquire_stacked(layer, x, experts,
routed)`` hands the grouped decoder two tensors [n, 2I, H] and [n, H, I] in
`experts`' order instead, gathered from its slot tensors with one
index_select per weight."""
from __future__ import annotations

import os
import sys

import numpy as np

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import LruSlots  # noqa: E402


def slot_views(torch, flat, slot_bytes: int, layout) -> dict:
    """Per part of `layout` (an expert's packed layout), a [slots, *shape]
    view of `flat` (a uint8 tensor holding experts `slot_bytes` apart, the
    first at byte 0): slot s's part is view[s]. Zero-copy (as_strided)."""
    slots = flat.numel() // slot_bytes
    views = {}
    for part in layout:
        itemsize = torch.empty(0, dtype=part.dtype).element_size()
        if slot_bytes % itemsize or part.offset % itemsize:
            raise ValueError(f"part {part.name!r} is not aligned to its {itemsize}-byte items")
        typed = flat[: slots * slot_bytes].view(part.dtype)
        strides = [1] * len(part.shape)
        for i in range(len(part.shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * part.shape[i + 1]
        views[part.name] = typed.as_strided((slots, *part.shape), (slot_bytes // itemsize, *strides),
                                            part.offset // itemsize)
    return views


class SlotIndex:
    """Slot numbers (host ints) to an int64 index tensor on `device`, for
    index_select. On CUDA: one non_blocking copy from a small ring of page-
    locked buffers; an event per buffer, recorded after its copy, is waited
    on before the buffer is written again (the wait is free in BM5: the
    layer's routing read-back in between synchronised the stream). On the
    CPU: the numbers as a tensor, no copy."""

    def __init__(self, torch, device, capacity: int, depth: int = 2):
        self.torch = torch
        self.device = device
        self.cuda = device.type == "cuda"
        self.host = self.host_np = self.done = None
        self.next = 0
        if self.cuda:
            self.host = [torch.empty(capacity, dtype=torch.int64, pin_memory=True) for _ in range(depth)]
            self.host_np = [h.numpy() for h in self.host]
            self.done = [torch.cuda.Event() for _ in range(depth)]

    def send(self, slots):
        """`slots`: an int64 numpy array or a list of ints. The copy goes on
        the device's current stream (the decoder's compute stream), ahead of
        the gathers that read the index."""
        torch = self.torch
        if not self.cuda:
            return torch.from_numpy(np.asarray(slots, dtype=np.int64))
        i = self.next
        self.next = (i + 1) % len(self.host)
        self.done[i].synchronize()  # this buffer's previous copy has been read
        n = len(slots)
        self.host_np[i][:n] = slots
        index = self.host[i][:n].to(self.device, non_blocking=True)
        self.done[i].record(torch.cuda.current_stream(self.device))
        return index


class ResidentProvider:
    """Every expert on the GPU (the reference): a layer's experts come from
    the decoder's pool, mapped expert -> pool row on the device."""

    def __init__(self, dec):
        self.dec = dec
        self.trace = []  # per step, per layer experts

    def _record(self, layer, experts):
        if layer == 0:
            self.trace.append([])
        self.trace[-1].append(experts)

    def acquire(self, layer, x, experts):
        self._record(layer, experts)
        pool = self.dec.pool_gpu[self.dec.layer_dev[layer]]
        return [pool[self.dec.pool_index(layer, e)] for e in experts]

    def acquire_stacked(self, layer, x, experts, routed):
        self._record(layer, experts)
        rows = self.dec.pool_table[layer].index_select(0, routed)
        gate_up, down = self.dec.pool_stacked[self.dec.layer_dev[layer]]
        return gate_up.index_select(0, rows), down.index_select(0, rows)

    def release(self, layer, experts):
        pass

    def stats(self):
        return {}


class EngineProvider:
    """Experts through the engine; prediction through prefetch.integration."""

    def __init__(self, dec, budget: int, predictor, eviction: str, handle_options=None):
        import prefetch
        from prefetch.integration import OffloadController

        self.torch = dec.torch
        self.dec = dec
        self.handle = prefetch.PrefetchHandle(device_budget_bytes=dec.device_budgets(budget),
                                              backend="cuda" if dec.cuda else "host", eviction_policy=eviction,
                                              **(handle_options or {}))
        # The gate of layer L+1 reads layer L's hidden state: across a device
        # boundary it is moved first.
        routers = [lambda x, layer=layer: x.to(dec.router[layer].device) @ dec.router[layer].T
                   for layer in range(dec.spec["layers"])]
        self.ctl = OffloadController(self.handle, num_layers=dec.spec["layers"], num_experts=dec.spec["experts"],
                                     top_k=dec.spec["top_k"], predictor=predictor, routers=routers)
        for layer in range(dec.spec["layers"]):
            for e in range(dec.spec["experts"]):
                buffer, layout = dec.pool_host[dec.pool_index(layer, e)]
                self.ctl.prefetcher.register_packed(layer, e, buffer, layout, device=dec.layer_dev[layer])

        # Per layer, expert -> tensor id (the prefetcher's ids, looked up once).
        self._tids = [self.ctl.prefetcher.tensor_ids(layer, range(dec.spec["experts"]))
                      for layer in range(dec.spec["layers"])]
        self._slot_views = {}  # device -> (gate_up [slots, 2I, H], down [slots, H, I])
        self._index = [SlotIndex(self.torch, dev, dec.spec["experts"]) for dev in dec.devs]

    def acquire(self, layer, x, experts):
        self.ctl.on_routed(layer, x, experts)
        got = self.ctl.prefetcher.acquire_experts(layer, experts, stream=self.dec.stream(layer))
        return [(w["gate_up"], w["down"]) for w in got]

    def _views(self, device: int):
        """The engine's arena of `device` as slot tensors (built once)."""
        views = self._slot_views.get(device)
        if views is None:
            arena = self.handle.arena(device)
            if isinstance(arena, np.ndarray):  # host backend
                arena = self.torch.from_numpy(arena)
            parts = slot_views(self.torch, arena, self.dec.slot_bytes, self.dec.pool_host[0][1])
            views = (parts["gate_up"], parts["down"])
            self._slot_views[device] = views
        return views

    def acquire_stacked(self, layer, x, experts, routed):
        """Pins the experts (as acquire does: same waits, same counters) and
        gathers their slots of the arena. The gather copies the weights, so
        the release after compute releases slots nothing reads any more.
        Every expert has the same size, so the engine (first fit of equal
        slots from offset 0) places each one slot_bytes-aligned: offset //
        slot_bytes is its slot, and an offset off that grid (a handle that
        holds tensors of another size) is refused. The device needs no
        check: a layer's experts are registered on the layer's device."""
        self.ctl.on_routed(layer, x, experts)
        stream = self.dec.stream(layer)
        ids = self._tids[layer][experts]
        where = self.handle.acquire_slots(ids, stream=stream)
        slots, off_grid = np.divmod(where[:, 0], self.dec.slot_bytes)
        if off_grid.any():
            self.handle.release(ids, stream=stream)
            raise RuntimeError(f"layer {layer}: an expert's cache slot is not on the grid of "
                               f"{self.dec.slot_bytes}-byte slots (offsets {where[:, 0].tolist()}): "
                               "the handle holds tensors of another size")
        d = self.dec.layer_dev[layer]
        gate_up, down = self._views(d)
        index = self._index[d].send(slots)
        return gate_up.index_select(0, index), down.index_select(0, index)

    def release(self, layer, experts):
        self.handle.release(self._tids[layer][experts], stream=self.dec.stream(layer))

    def stats(self):
        s = self.handle.stats()
        r = self.ctl.report()
        return {"hits": s["hits"], "misses": s["misses"], "bytes": s["bytes_copied"], "late": s["late"],
                "wasted": s["wasted"], "caller_copies": s["caller_copies"], "on_demand": s["on_demand"],
                "evictions": s["evictions"], "precision": r["prediction_precision"],
                "recall": r["prediction_recall"]}

    def close(self):
        self.handle.close()


class ByHandCache:
    """What a user writes by hand, for one device: an LRU of device slots in
    Python, a copy_(non_blocking=True) per missing expert on a side stream,
    an event per copy that the compute stream waits on, and an event per use
    so a slot is not overwritten while a kernel still reads it."""

    def __init__(self, dec, budget: int, device):
        torch = dec.torch
        self.torch = torch
        self.dec = dec
        n_slots = budget // dec.slot_bytes
        self.slots = [torch.empty(dec.expert_bytes, dtype=torch.uint8, device=device) for _ in range(n_slots)]
        self.lru = LruSlots(n_slots)
        self.ready = {}  # slot -> event (copy done)
        self.used = {}  # slot -> event (last read done)
        self.side = torch.cuda.Stream(device=device) if dec.cuda else None
        self.layout = dec.pool_host[0][1]
        self.bytes = 0

    hits = property(lambda self: self.lru.hits)
    misses = property(lambda self: self.lru.misses)

    def _views(self, slot):
        raw = self.slots[slot]
        out = []
        for part in self.layout:
            out.append(raw[part.offset : part.offset + part.nbytes].view(part.dtype).view(part.shape))
        return tuple(out)

    def acquire(self, layer, experts, compute):
        torch = self.torch
        cuda = self.dec.cuda
        result = []
        busy = self.lru.held((layer, e) for e in experts)
        for e in experts:
            slot, hit = self.lru.slot_for((layer, e), busy)
            if not hit:
                if cuda and slot in self.used:  # a reused slot: its last reader first
                    self.side.wait_event(self.used[slot])
                src = self.dec.pool_host[self.dec.pool_index(layer, e)][0]
                if cuda:
                    with torch.cuda.stream(self.side):
                        self.slots[slot].copy_(src, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self.side)
                    self.ready[slot] = ev
                else:
                    self.slots[slot].copy_(src)
                self.bytes += self.dec.expert_bytes
            if cuda:
                compute.wait_event(self.ready[slot])
            result.append(self._views(slot))
        return result

    def release(self, layer, experts, compute):
        if not self.dec.cuda:
            return
        for e in experts:
            slot = self.lru.lru[(layer, e)]
            ev = self.torch.cuda.Event()
            ev.record(compute)
            self.used[slot] = ev


class ByHandProvider:
    """One ByHandCache per device; a layer uses its device's."""

    def __init__(self, dec, budget: int):
        self.dec = dec
        self.caches = [ByHandCache(dec, b, dev) for b, dev in zip(dec.device_budgets(budget), dec.devs)]

    def acquire(self, layer, x, experts):
        return self.caches[self.dec.layer_dev[layer]].acquire(layer, experts, self.dec.stream(layer))

    def release(self, layer, experts):
        self.caches[self.dec.layer_dev[layer]].release(layer, experts, self.dec.stream(layer))

    def stats(self):
        return {"hits": sum(c.hits for c in self.caches), "misses": sum(c.misses for c in self.caches),
                "bytes": sum(c.bytes for c in self.caches), "late": None, "wasted": None,
                "precision": None, "recall": None}

    def close(self):
        for c in self.caches:
            c.slots.clear()


def make_provider(dec, policy, budget, trace, eviction="cyclic", handle_options=None):
    from prefetch.integration import NextLayerGatePredictor, OraclePredictor, RoutingTrace, TracePredictor

    spec = dec.spec
    if policy == "all-resident":
        return ResidentProvider(dec)
    if policy == "torch-by-hand":
        return ByHandProvider(dec, budget)
    predictor = None
    if policy == "next-layer-gate":
        predictor = NextLayerGatePredictor()
    elif policy == "trace":
        predictor = TracePredictor(distance=2)
    elif policy in ("oracle", "oracle-cyclic"):
        predictor = OraclePredictor(RoutingTrace(spec["layers"], spec["experts"], trace), distance=2,
                                    hints=policy == "oracle")
    return EngineProvider(dec, budget, predictor, policy_eviction(policy, eviction), handle_options)


def policy_eviction(policy: str, eviction: str) -> str:
    """The engine eviction policy a BM5 policy runs with."""
    return "next-use" if policy == "oracle" else eviction
