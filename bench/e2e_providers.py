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

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import LruSlots  # noqa: E402


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

    def acquire(self, layer, x, experts):
        self.ctl.on_routed(layer, x, experts)
        got = self.ctl.prefetcher.acquire_experts(layer, experts, stream=self.dec.stream(layer))
        return [(w["gate_up"], w["down"]) for w in got]

    def release(self, layer, experts):
        self.ctl.prefetcher.release_experts(layer, experts, stream=self.dec.stream(layer))

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
