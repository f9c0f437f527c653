"""BM5's expert providers (bench/e2e.py): resident, the engine with each
predictor, and the by-hand PyTorch LRU.

Each provider has two ways to hand a layer its routed experts' weights:
``acquire(layer, x, experts)``, a (gate_up, down) pair of views per expert
(--expert-compute loop), and ``acquire_stacked(layer, x, experts, routed)``,
two tensors [n, 2I, H] and [n, H, I] in `experts`' order (grouped, the
default). The stacked path is the same for every provider, so the ratios
between them stay fair: each keeps its weights as a slot tensor per device
([slots, 2I, H] and [slots, H, I]: the resident pool, strided views of the
engine's arena, the by-hand LRU's slots) and gathers the routed experts'
slots with one kernel per weight: the resident reference maps `routed` to
its pool rows on the device and index_selects them; the engine and the
by-hand LRU know their slot numbers on the host and concatenate those
slots' views (SlotRows: one torch.cat per weight, no index sent to the
device). No tensor op per expert: the per-expert host work left is each
provider's own bookkeeping (the engine's one call per layer,
route_and_acquire, the by-hand LRU's Python dict)."""
from __future__ import annotations

import tempfile
import time

import numpy as np
from prefetch._engine import slot_numbers

from bench.lib.common import LruSlots


def slot_views(torch, flat, slot_bytes: int, layout) -> dict:
    """Per part of `layout` (an expert's packed layout), a [slots, *shape]
    view of `flat` (a uint8 tensor holding experts `slot_bytes` apart, the
    first at its byte 0, which may lie inside a larger storage: a
    HostExperts buffer starts at its allocation's first 256-byte boundary):
    slot s's part is view[s]. Zero-copy (as_strided)."""
    from prefetch.expert_prefetcher import stacked_views

    return stacked_views(flat, flat.numel() // slot_bytes, slot_bytes, layout)


class SlotRows:
    """A gather of cache slots as one torch.cat per weight. Per weight of
    `parts` ({name: [slots, *shape] view of a slot tensor}, from
    slot_views), every slot's [1, *shape] view is made once; a gather of
    slots s1..sn concatenates those views in order: one kernel per weight,
    the slots reaching it as the kernel's source pointers, so nothing goes
    to the device first. (Until stop 38 the slot numbers went to the
    device as an index tensor from a ring of page-locked buffers: an event
    wait before reusing a buffer, a copy_ and an event record, then one
    index_select per weight: three more torch calls on the decode step's
    host path, which the resident row does not make.)"""

    def __init__(self, torch, parts: dict):
        self.torch = torch
        self.rows = tuple([view[s : s + 1] for s in range(view.shape[0])] for view in parts.values())

    def gather(self, slots) -> tuple:
        """The weights of `slots` (a list of ints, in range), stacked in
        that order: one [n, *shape] tensor per weight, copies (the slots
        may be reused once the kernels reading these have run)."""
        cat = self.torch.cat
        return tuple(cat([rows[s] for s in slots]) for rows in self.rows)


def resident_gather(dec, layer, routed) -> tuple:
    """The resident reference's gather: `layer`'s routed experts (`routed`,
    a device tensor) mapped to their pool rows on the device and
    index_selected from the stacked pool, [n, 2I, H] and [n, H, I]."""
    rows = dec.pool_table[layer].index_select(0, routed)
    gate_up, down = dec.pool_stacked[dec.layer_dev[layer]]
    return gate_up.index_select(0, rows), down.index_select(0, rows)


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
        return resident_gather(self.dec, layer, routed)

    def release(self, layer, experts):
        pass

    def stats(self):
        return {}


class EngineProvider:
    """Experts through the engine; prediction through prefetch.integration."""

    def __init__(self, dec, budget: int, predictor, eviction: str, handle_options=None, disk=None,
                 step_plan: bool = True, resident_gather: bool = False):
        """`disk`: (folder, host tier bytes): the experts are read from the
        decoder's pool file there through the engine's host tier instead of
        registered from host memory (the on-demand-disk policy).
        `step_plan`: the controller knows the cache's slot count, so a
        predictor that knows whole steps (the oracle) gets step plans (Note
        [Host-routed step pins] in prefetch/offload/step_plan.py); False keeps it
        layer by layer. `resident_gather`: Note [Engine calls, resident
        weights]."""
        import prefetch
        from prefetch.integration import OffloadController, layer_handle_options

        self.torch = dec.torch
        self.dec = dec
        # As offload_moe_experts sets them: one acquire per layer and step.
        extra = {} if disk is None else {"host_budget_bytes": disk[1]}
        options = layer_handle_options(dec.spec["layers"], {"eviction_policy": eviction, **extra,
                                                           **(handle_options or {})})
        self.handle = prefetch.PrefetchHandle(device_budget_bytes=dec.device_budgets(budget),
                                              backend="cuda" if dec.cuda else "host", **options)
        # The gate of layer L+1 reads layer L's hidden state: across a device
        # boundary it is moved first.
        routers = [lambda x, layer=layer: x.to(dec.router[layer].device) @ dec.router[layer].T
                   for layer in range(dec.spec["layers"])]
        self.ctl = OffloadController(self.handle, num_layers=dec.spec["layers"], num_experts=dec.spec["experts"],
                                     top_k=dec.spec["top_k"], predictor=predictor, routers=routers)
        if step_plan:
            # As offload_moe_experts sets it: slots of one device (with
            # several, the controller makes no step plan).
            self.ctl.cache_slots = self.handle.budget_bytes(0) // dec.slot_bytes
        pool = None
        if disk is not None:
            path, offsets = dec.pool_file(disk[0])
            pool = (self.handle.open_file(path), offsets)
        for layer in range(dec.spec["layers"]):
            for e in range(dec.spec["experts"]):
                index = dec.pool_index(layer, e)
                buffer, layout = dec.pool_host[index]
                if pool is None:
                    self.ctl.prefetcher.register_packed(layer, e, buffer, layout, device=dec.layer_dev[layer])
                else:
                    self.ctl.prefetcher.register_disk(layer, e, [(pool[0], pool[1][index], dec.expert_bytes, 0)],
                                                      layout, device=dec.layer_dev[layer])

        self.resident_gather = resident_gather
        self._slot_views = {}  # device -> (gate_up [slots, 2I, H], down [slots, H, I])
        self._slot_rows = {}  # device -> SlotRows of its arena
        self._slot_buf = np.empty(dec.spec["experts"], dtype=np.int64)  # a layer's slot numbers

    def acquire(self, layer, x, experts):
        routed, where = self.ctl.route_and_acquire(layer, x, experts, stream=self.dec.stream(layer))
        got = self.ctl.prefetcher.weights_in_slots(self.ctl.ids(layer, routed), where)
        return [(w["gate_up"], w["down"]) for w in got]

    def _views(self, device: int):
        """The engine's arena of `device` as slot tensors (built once, with
        their SlotRows)."""
        views = self._slot_views.get(device)
        if views is None:
            arena = self.handle.arena(device)
            if isinstance(arena, np.ndarray):  # host backend
                arena = self.torch.from_numpy(arena)
            parts = slot_views(self.torch, arena, self.dec.slot_bytes, self.dec.pool_host[0][1])
            views = (parts["gate_up"], parts["down"])
            self._slot_views[device] = views
            self._slot_rows[device] = SlotRows(self.torch, {"gate_up": views[0], "down": views[1]})
        return views

    # Note [The acquire's parts]
    # With the decoder's timers on, the acquire phase of an engine row is
    # also split (host seconds, summed like the phases, so per layer they
    # are means over every layer): acquire.route_l0, the controller's call
    # at each step's layer 0 (a step plan's one engine call is made there);
    # acquire.route, its calls at the other layers (a planned layer's
    # lookup, or the layer's engine call); acquire.gather, the slot
    # numbers and SlotRows' two torch.cat. BM5's engine rows spent 40-50
    # us a layer more than the resident row's three index_select in this
    # phase on the H200 host (runs 135, 162) and 35-40 on the development
    # VM (tools/bm5_host_proxy.py); the split says which part it is. Run
    # 167 (gemma-4's oracle): layer 0's call 24 us a layer, the others' 27,
    # the gather 64, though alone (tools/gather_cost_probe.py) the two
    # torch.cat take 22 us against the resident row's 33.
    #
    # Note [Engine calls, resident weights]
    # The policy option resident_gather=1 (a diagnostic: "oracle:
    # resident_gather=1") makes every engine call of the policy, copies and
    # waits included, and then gathers the layer's weights from the
    # decoder's resident pool as the resident row does (its three
    # index_select), not from the engine's arena. Its output is the
    # resident row's; the step differs from the resident row's only by the
    # engine's presence (the controller, the engine calls, the copy
    # workers and their copies), and from the policy's own row only by
    # where the gather reads. Run 167 left open why every CUDA call of an
    # engine row's step costs more than the same call in the resident
    # row's (the gather 64 us a layer against 22 alone, the compute launch
    # +25): this row's gather and compute phases against the resident
    # row's say whether the engine's presence does it. Grouped compute only
    # (the default): --expert-compute loop reads the engine's views as ever.

    def acquire_stacked(self, layer, x, experts, routed):
        """Pins the experts (as acquire does: same waits, same counters) and
        gathers their slots of the arena. The gather copies the weights, so
        the release after compute releases slots nothing reads any more.
        Every expert has the same size, so the engine (first fit of equal
        slots from offset 0) places each one slot_bytes-aligned: offset //
        slot_bytes is its slot, and an offset off that grid (a handle that
        holds tensors of another size) is refused. The device needs no
        check: a layer's experts are registered on the layer's device."""
        stream = self.dec.stream(layer)
        timers = self.dec.timers
        if timers is not None:
            t0 = time.perf_counter()
        _, where = self.ctl.route_and_acquire(layer, x, experts, stream=stream)
        if timers is not None:
            t1 = time.perf_counter()
        try:
            if self.resident_gather:  # Note [Engine calls, resident weights]
                got = resident_gather(self.dec, layer, routed)
            else:
                got = self.gather(layer, where)
        except ValueError as e:
            self.ctl.release_held(stream)
            raise RuntimeError(f"layer {layer}: {e}") from e
        if timers is not None:
            # Note [The acquire's parts]
            key = "acquire.route_l0" if layer == 0 else "acquire.route"
            timers[key] = timers.get(key, 0.0) + t1 - t0
            timers["acquire.gather"] = timers.get("acquire.gather", 0.0) + time.perf_counter() - t1
        return got

    def gather(self, layer, where):
        """The weights in the cache slots of acquire's rows `where` (in
        order) of `layer`'s device as two tensors [n, 2I, H] and [n, H, I]:
        the slot numbers made in one C call (`slot_numbers`: an offset off
        the slot grid raises ValueError), one torch.cat per weight
        (SlotRows)."""
        d = self.dec.layer_dev[layer]
        rows = self._slot_rows.get(d)
        if rows is None:
            self._views(d)
            rows = self._slot_rows[d]
        n = slot_numbers(where, self.dec.slot_bytes, self._slot_buf)
        return rows.gather(self._slot_buf[:n].tolist())

    def before_sync(self, layer):
        """The last layer's predictor part (Note [Speculation after launch]
        in prefetch/offload/deferred.py): the decoder calls this once it has
        queued this layer's attention and router and before it reads the
        routing back, so the host runs it while the GPU works. Its engine
        call rides on this layer's acquire (Note [Speculation rides on the
        next acquire])."""
        self.ctl.speculate(with_next_acquire=True)

    def release(self, layer, experts):
        """The next layer's engine call releases this layer's experts (one
        call per layer); the last layer releases its own here, and runs its
        predictor part now (the next call is the next step's first: its
        guesses are for that step's first layers)."""
        if layer == self.dec.spec["layers"] - 1:
            self.ctl.release_held(self.dec.stream(layer))
            self.ctl.speculate()

    def stats(self):
        s = self.handle.stats()
        r = self.ctl.report()
        # Experts read from the step plan's pins were not acquired (Note
        # [Host-routed step pins]): the controller counts them.
        return {"hits": s["hits"] + self.ctl.pinned_hits, "misses": s["misses"], "step_pins": self.ctl.step_pins,
                "bytes": s["bytes_copied"], "late": s["late"],
                "disk_read_bytes": s["disk_read_bytes"], "host_tier_hits": s["host_tier_hits"],
                "wasted": s["wasted"], "caller_copies": s["caller_copies"], "on_demand": s["on_demand"],
                "upgraded": s["upgraded"], "declined": s["declined"], "cancelled": s["cancelled"],
                "spec_underruns": s["spec_underruns"],
                "evictions": s["evictions"], "engine_ns": self.ctl.engine_ns,
                "speculation_paused_layers": r["speculation_paused_layers"], "precision": r["prediction_precision"],
                "recall": r["prediction_recall"]}

    def close(self):
        self.handle.close()


class ByHandCache:
    """What a user writes by hand, for one device: an LRU of device slots in
    Python (one [slots, slot_bytes] tensor, typed per weight as [slots, ...]
    views), a copy_(non_blocking=True) per missing expert on a side stream,
    one event after a call's copies that the compute stream waits on, and an
    event per release (noted for each of the layer's slots) so a slot is not
    overwritten while a kernel still reads it. A hit costs the LRU's Python
    bookkeeping only: its copy was waited for by the call that made it, on
    the same compute stream."""

    def __init__(self, dec, budget: int, device):
        torch = dec.torch
        self.torch = torch
        self.dec = dec
        n_slots = budget // dec.slot_bytes
        self.slots = torch.empty(n_slots, dec.slot_bytes, dtype=torch.uint8, device=device)
        parts = slot_views(torch, self.slots.view(-1), dec.slot_bytes, dec.pool_host[0][1])
        self.gate_up, self.down = parts["gate_up"], parts["down"]
        self.lru = LruSlots(n_slots)
        self.used = {}  # slot -> event (last read done)
        self.side = torch.cuda.Stream(device=device) if dec.cuda else None
        self.rows = SlotRows(torch, {"gate_up": self.gate_up, "down": self.down})
        self.in_use = {}  # layer -> its acquired experts' slots, until release
        self.bytes = 0

    hits = property(lambda self: self.lru.hits)
    misses = property(lambda self: self.lru.misses)

    def _fill(self, layer, experts, compute) -> list:
        """The experts' slots, in order; misses copied in (the compute stream
        waits for those copies)."""
        torch = self.torch
        cuda = self.dec.cuda
        lru = self.lru
        slots = []
        copied = False
        busy = lru.held((layer, e) for e in experts)
        for e in experts:
            slot, hit = lru.slot_for((layer, e), busy)
            slots.append(slot)
            if hit:
                continue
            src = self.dec.pool_host[self.dec.pool_index(layer, e)][0]
            dst = self.slots[slot, : src.numel()]
            if cuda:
                if slot in self.used:  # a reused slot: its last reader first
                    self.side.wait_event(self.used[slot])
                with torch.cuda.stream(self.side):
                    dst.copy_(src, non_blocking=True)
                copied = True
            else:
                dst.copy_(src)
            self.bytes += self.dec.expert_bytes
        if copied:
            ev = torch.cuda.Event()
            ev.record(self.side)
            compute.wait_event(ev)
        self.in_use[layer] = slots
        return slots

    def acquire(self, layer, experts, compute):
        return [(self.gate_up[s], self.down[s]) for s in self._fill(layer, experts, compute)]

    def acquire_stacked(self, layer, experts, compute):
        return self.rows.gather(self._fill(layer, experts, compute))

    def release(self, layer, experts, compute):
        slots = self.in_use.pop(layer)
        if not self.dec.cuda:
            return
        ev = self.torch.cuda.Event()
        ev.record(compute)
        used = self.used
        for slot in slots:
            used[slot] = ev


class ByHandProvider:
    """One ByHandCache per device; a layer uses its device's."""

    def __init__(self, dec, budget: int):
        self.dec = dec
        self.caches = [ByHandCache(dec, b, dev) for b, dev in zip(dec.device_budgets(budget), dec.devs)]

    def acquire(self, layer, x, experts):
        return self.caches[self.dec.layer_dev[layer]].acquire(layer, experts, self.dec.stream(layer))

    def acquire_stacked(self, layer, x, experts, routed):
        return self.caches[self.dec.layer_dev[layer]].acquire_stacked(layer, experts, self.dec.stream(layer))

    def release(self, layer, experts):
        self.caches[self.dec.layer_dev[layer]].release(layer, experts, self.dec.stream(layer))

    def stats(self):
        return {"hits": sum(c.hits for c in self.caches), "misses": sum(c.misses for c in self.caches),
                "bytes": sum(c.bytes for c in self.caches), "late": None, "wasted": None,
                "precision": None, "recall": None}

    def close(self):
        for c in self.caches:
            c.slots = c.gate_up = c.down = None


def int_options(items, what: str) -> dict:
    """"name=int" items (handle options) as {name: int}; a ValueError
    naming `what` for an item of another form."""
    options = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key.isidentifier():
            raise ValueError(f"{what}: write each option as name=int")
        try:
            options[key] = int(value)
        except ValueError:
            raise ValueError(f"{what}: {key} must be an int, got {value!r}") from None
    return options


def split_policy(policy: str):
    """A BM5 policy with PrefetchHandle options, "oracle:copy_poll_us=0" or
    "on-demand:copy_lanes=1,copy_chunk_bytes=8388608": (the policy, {option:
    int}); a plain policy gives {}. Options only go with engine policies;
    "distance" (the oracle's and oracle-cyclic's, over --oracle-distance) is
    the predictor's, "step_plan=0" (an engine policy's) turns the
    controller's step plans off (Note [Host-routed step pins]),
    "resident_gather=1" (an engine policy's) gathers the weights from the
    resident pool after the engine calls (Note [Engine calls, resident
    weights]), the others
    are the handle's."""
    from bench.lib.e2e_decoder import ENGINE_POLICIES, POLICIES

    base, _, rest = policy.partition(":")
    if base not in POLICIES:
        raise ValueError(f"unknown policy {base!r} (one of {', '.join(POLICIES)})")
    options = int_options(filter(None, rest.split(",")), f"policy {policy!r}")
    if options and base not in ENGINE_POLICIES:
        raise ValueError(f"policy {policy!r}: handle options need an engine policy ({', '.join(ENGINE_POLICIES)})")
    if "distance" in options and (base not in ("oracle", "oracle-cyclic") or options["distance"] < 1):
        raise ValueError(f"policy {policy!r}: distance goes with oracle or oracle-cyclic, and is >= 1")
    for flag in ("step_plan", "resident_gather"):
        if options.get(flag, 0) not in (0, 1):
            raise ValueError(f"policy {policy!r}: {flag} is 0 or 1")
    return base, options


def make_provider(dec, policy, budget, trace, eviction="cyclic", handle_options=None, disk_dir=None,
                  oracle_distance=4):
    from prefetch.integration import NextLayerGatePredictor, OraclePredictor, RoutingTrace, TracePredictor

    policy, options = split_policy(policy)
    oracle_distance = options.pop("distance", oracle_distance)
    step_plan = bool(options.pop("step_plan", 1))
    resident_gather = bool(options.pop("resident_gather", 0))
    handle_options = {**(handle_options or {}), **options} or None
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
        # "oracle": the library's default, hints to its next-use handle
        # unless the cache holds every expert; "oracle-cyclic": none.
        predictor = OraclePredictor(RoutingTrace(spec["layers"], spec["experts"], trace), distance=oracle_distance,
                                    hints=None if policy == "oracle" else False)
    disk = None
    if policy == "on-demand-disk":
        from bench.lib.e2e_decoder import DISK_HOST_SHARE

        total = spec["layers"] * spec["experts"] * dec.slot_bytes
        disk = (disk_dir or tempfile.gettempdir(), max(int(DISK_HOST_SHARE * total), 3 * dec.slot_bytes + 3 * 4096))
    return EngineProvider(dec, budget, predictor, policy_eviction(policy, eviction), handle_options, disk,
                          step_plan=step_plan, resident_gather=resident_gather)


def policy_eviction(policy: str, eviction: str) -> str:
    """The engine eviction policy a BM5 policy (with or without options)
    runs with."""
    return "next-use" if split_policy(policy)[0] == "oracle" else eviction
