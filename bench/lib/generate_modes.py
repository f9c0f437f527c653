"""BM6's rows (bench/generate.py): how each alternative is set up on the model
(resident, prefetch's engine, a by-hand PyTorch LRU, accelerate,
moe-policylang) and the row names."""
from __future__ import annotations

import contextlib
import time
import weakref

from bench.lib.common import LruSlots
from bench.lib.generate_model import ModelState, RowSkipped
from prefetch.hf_experts import _GROUPED_MM_MAX_GROUPS

SHARE_FREE_ROWS = ("resident", "resident-eager", "accelerate-cpu-offload")
SHARE_ROWS = ("on-demand", "gate", "oracle", "on-demand-synced", "oracle-synced", "torch-by-hand",
              "moe-policylang-lru", "moe-policylang-lookahead")
ROWS = ("resident", "resident-eager", *SHARE_ROWS, "accelerate-cpu-offload")
ENGINE_ROWS = ("on-demand", "gate", "oracle", "on-demand-synced", "oracle-synced")
MPL_ROWS = ("moe-policylang-lru", "moe-policylang-lookahead")
BY_HAND_IMPL = "bench_torch_by_hand"
FIGURES = ("p50_ms", "p90_ms", "prefill_ms", "ttft_ms", "tokens_equal", "hit_rate", "bytes_moved", "copies",
           "precision", "recall", "host_us_per_layer", "x_resident", "x_adjacent", "x_adjacent_best", "x_paired",
           "over_floor", "ttft_over_floor")


class Mode:
    """A way of running the experts, attached to the model for one row.
    counters(): cumulative numbers (hits, misses, bytes, copies, ...), any
    of them None where not known."""

    accesses_from_routing = False

    def counters(self) -> dict:
        return {}

    def new_sequence(self):
        pass

    def before_ttft(self, steps):
        """The TTFT generate comes next; `steps`: its prompt's recorded
        routing (None if not recorded)."""

    def on_step(self):
        pass

    def start_measuring(self):
        pass

    def close(self):
        pass

    def extra(self) -> dict:
        return {}


class ResidentMode(Mode):
    def __init__(self, model, impl):
        if impl is not None:
            model.config._experts_implementation = impl


# model -> the packed host copy of its experts (same weights every row).
# Weak keys: an entry goes with its model. Keyed by id(model) it outlived
# the model, and a later model given the same id (another test's, in one
# pytest process) got that stale copy: experts of other shapes or weights.
_HOST_EXPERTS = weakref.WeakKeyDictionary()


def shared_host_experts(model, cuda: bool):
    """The model's experts packed once in host memory (page-locked on CUDA),
    for every offloaded row of its block: the engine rows offload from it
    and the by-hand LRU copies its misses from it. One copy, not one per
    row: Qwen3-30B-A3B's 54 GiB of experts twice did not fit the one-H200
    machine's 128 GiB (run 37)."""
    host = _HOST_EXPERTS.get(model)
    if host is None:
        from prefetch.hf import find_hf_moe_blocks
        from prefetch.host_experts import HostExperts

        host = HostExperts(find_hf_moe_blocks(model), pin=cuda, progress=True)
        _HOST_EXPERTS[model] = host
    return host


class EngineMode(Mode):
    def __init__(self, model, budget, row, trace, cuda, host=None):
        """`host`: the packed host experts to offload from (default: the
        model's own, shared_host_experts); the twin of --ab offloads from
        the model's, which holds the same weights."""
        import prefetch
        from prefetch.integration import NextLayerGatePredictor, OraclePredictor

        predictor, options = None, None
        sync_free = False if row.endswith("-synced") else None
        row = row.removesuffix("-synced")
        if row == "gate":
            predictor = NextLayerGatePredictor()
        elif row == "oracle":
            predictor = OraclePredictor(trace)
            options = {"eviction_policy": "next-use"}
        kwargs = {} if cuda else {"backend": "host"}
        host = host if host is not None else shared_host_experts(model, cuda)
        self.ctl = prefetch.offload_moe_experts(model, device_budget_bytes=budget, predictor=predictor,
                                                handle_options=options, record_trace=True, sync_free=sync_free,
                                                host_experts=host, **kwargs)
        # Note [Waiting for the preload] in prefetch/offload/preload.py: a cache
        # of every expert is filled before the row's first generate, so the
        # measured ones find it full (run 102: Qwen3-30B-A3B's 54 GiB were
        # still landing in the first measured generate, 173 copies).
        t0 = time.perf_counter()
        self.ctl.wait_preloaded(progress=True)
        self.preload_wait_s = time.perf_counter() - t0

    def counters(self):
        r = self.ctl.report()  # reads the routings still on their way back first
        # Bytes moved: the engine's copies plus the experts the sync-free path
        # read straight from host memory; hits and misses likewise.
        out = {"bytes": r.get("bytes_copied") + r.get("zero_copy_bytes", 0), "copies": r.get("copies"),
               "hits": None, "misses": None, "evictions": r.get("evictions"), "wasted": r.get("wasted"),
               "late": r.get("late"), "zero_copy_reads": r.get("zero_copy_reads")}
        # Host time of the offloaded layers, to take over the decode steps
        # only (a prefill's read-back waits for its copies: tens of ms).
        if hasattr(self.ctl, "layers_run"):
            out.update(calls=self.ctl.layers_run, host_s=self.ctl.host_ns / 1e9,
                       engine_s=self.ctl.engine_ns / 1e9, sync_s=self.ctl.sync_ns / 1e9)
        handle = getattr(self.ctl, "handle", None)
        if handle is not None and hasattr(handle, "stats"):
            s = handle.stats()
            out["hits"] = s.get("hits") + getattr(self.ctl, "pinned_hits", 0)
            out["misses"] = s.get("misses") + getattr(self.ctl, "zero_copy_reads", 0)
            out.update({k: s.get(k) for k in ("on_demand", "upgraded", "declined", "cancelled", "spec_underruns")})
        return out

    def new_sequence(self):
        self.ctl.new_sequence()

    def before_ttft(self, steps):
        # The oracle replays the routing of the generate it runs: for the
        # TTFT prompt, that prompt's own (recorded on the resident model),
        # not the measured prompt's.
        from prefetch.integration import OraclePredictor, RoutingTrace

        self.ctl.new_sequence()
        if isinstance(self.ctl.predictor, OraclePredictor) and steps is not None:
            trace = self.ctl.predictor.trace
            self.ctl.predictor = OraclePredictor(RoutingTrace(trace.num_layers, trace.num_experts, steps),
                                                 distance=self.ctl.predictor.distance,
                                                 hints=self.ctl.predictor.hints)

    def start_measuring(self):
        # Score predictions on the measured generate only (as BM5 does);
        # where the controller has no such counters the scores cover the row.
        self.scores_scope = "row"
        if all(hasattr(self.ctl, k) for k in ("prediction_hits", "predicted_total", "actual_total")):
            self.ctl.prediction_hits = self.ctl.predicted_total = self.ctl.actual_total = 0
            self.scores_scope = "measured generate"

    def extra(self):
        r = self.ctl.report()
        return {"precision": r.get("prediction_precision"), "recall": r.get("prediction_recall"),
                "prediction_scope": self.scores_scope, "host_us_per_layer": r.get("host_us_per_layer"),
                "engine_us_per_layer": r.get("engine_us_per_layer"), "sync_us_per_layer": r.get("sync_us_per_layer"),
                "speculation_paused_layers": r.get("speculation_paused_layers"),
                "steady_steps": r.get("steady_steps"), "step_pins": r.get("step_pins"), "preloaded": r.get("preloaded"),
                "sync_free_steps": r.get("sync_free_steps"), "path_switches": r.get("path_switches"),
                "preload_wait_s": self.preload_wait_s}

    def trace_steps(self, n):
        trace = getattr(self.ctl, "trace", None)
        return [list(map(list, step)) for step in trace.steps[:n]] if trace is not None else None

    def close(self):
        self.ctl.close()


class ByHandCache:
    """The plain-PyTorch LRU: (layer, expert) -> slot of preallocated device
    tensors; misses copied from pinned host memory with copy_(non_blocking=
    True) on a side stream; an event per copy the compute stream waits on and
    an event per use so a slot is not overwritten while a kernel reads it."""

    def __init__(self, torch, state: ModelState, budget: int, device, cuda: bool, host_experts):
        """`host_experts`: the block's packed host copy (shared_host_experts),
        read through typed views: a user's own page-locked copy would hold
        the same bytes, and two copies of Qwen3-30B-A3B's experts do not fit
        the one-H200 machine."""
        from bench.lib.e2e_providers import slot_views

        self.torch = torch
        self.cuda = cuda
        self.slots = max(1, budget // state.expert_bytes)
        if host_experts.experts is not None:
            raise ValueError("the by-hand LRU needs a host copy of every expert, not an expert-parallel slice")
        module = state.saved[0][1]
        if tuple(state.NAMES) != ("gate_up_proj", "down_proj") or getattr(module, "is_transposed", False):
            raise RowSkipped(f"the by-hand LRU runs grouped_mm on untransposed gate_up_proj/down_proj experts "
                             f"without biases; this model's are {state.layout.describe()}")
        views = slot_views(torch, host_experts.buffer, host_experts.stride, host_experts.layout)
        first = host_experts._row[:, 0]  # every expert packed: a layer's rows are consecutive
        self.host = []  # per layer: (gate_up [E, 2I, H], down [E, H, I]) on the host
        for layer in range(state.num_layers):
            rows = slice(int(first[layer]), int(first[layer]) + state.num_experts)
            self.host.append(tuple(views[name][rows] for name in state.NAMES))
        gu, dn = self.host[0]
        self.gate_up = torch.empty((self.slots, *gu.shape[1:]), dtype=gu.dtype, device=device)
        self.down = torch.empty((self.slots, *dn.shape[1:]), dtype=dn.dtype, device=device)
        self.lru = LruSlots(self.slots)
        self.ready = [None] * self.slots
        self.used = [None] * self.slots
        self.side = torch.cuda.Stream(device=device) if cuda else None
        self.bytes = self.copies = 0
        self.host_s = 0.0
        self.calls = 0
        self.expert_bytes = state.expert_bytes

    hits = property(lambda self: self.lru.hits)
    misses = property(lambda self: self.lru.misses)

    def acquire(self, layer, experts, compute):
        torch = self.torch
        busy = self.lru.held((layer, e) for e in experts)
        slots = []
        for e in experts:
            slot, hit = self.lru.slot_for((layer, e), busy)
            if not hit:
                gu, dn = self.host[layer]
                if self.cuda:
                    if self.used[slot] is not None:
                        self.side.wait_event(self.used[slot])
                    with torch.cuda.stream(self.side):
                        self.gate_up[slot].copy_(gu[e], non_blocking=True)
                        self.down[slot].copy_(dn[e], non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self.side)
                    self.ready[slot] = ev
                else:
                    self.gate_up[slot].copy_(gu[e])
                    self.down[slot].copy_(dn[e])
                self.bytes += self.expert_bytes
                self.copies += 1
            if self.cuda and self.ready[slot] is not None:
                compute.wait_event(self.ready[slot])
            slots.append(slot)
        return slots

    def release(self, slots, compute):
        if not self.cuda:
            return
        ev = self.torch.cuda.Event()
        ev.record(compute)
        for slot in slots:
            self.used[slot] = ev


def _grouped_rows(torch, module, weights, hidden_states, slot_ids, top_k_weights, num_slots):
    """transformers' grouped_mm experts forward on the slot tensors, up to
    the weighted (token, k) rows in their original order: rows whose slot id
    is the sentinel `num_slots` (another piece's expert) come out as zeros."""
    from transformers.integrations.moe import _grouped_linear

    num_top_k = slot_ids.size(-1)
    ids = slot_ids.reshape(-1)
    sample_weights = top_k_weights.reshape(-1)
    ids_g, perm = torch.sort(ids)
    states_g = hidden_states[perm // num_top_k]
    weights_g = sample_weights[perm]
    device = hidden_states.device
    histc_input = ids_g.float() if device.type in ("cpu", "mps") else ids_g.int()
    per_slot = torch.histc(histc_input, bins=num_slots, min=0, max=num_slots - 1)
    offsets = torch.cumsum(per_slot, dim=0, dtype=torch.int32)
    sentinel = (ids_g >= num_slots).unsqueeze(-1)
    states_g = states_g.masked_fill(sentinel, 0.0)
    proj = _grouped_linear(states_g, weights[0], offsets).masked_fill(sentinel, 0.0)
    proj = module._apply_gate(proj)
    proj = _grouped_linear(proj, weights[1], offsets).masked_fill(sentinel, 0.0)
    weighted = (proj * weights_g.unsqueeze(-1)).masked_fill(sentinel, 0.0)
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.size(0), device=device)
    return weighted[inv]


def by_hand_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts implementation torch-by-hand registers: the experts of
    this layer from the LRU, then grouped_mm on the slot tensors."""
    import torch

    cache, layer = self._bench_by_hand
    experts = top_k_index.unique().tolist()  # the routing sync every offloader needs
    compute = torch.cuda.current_stream(hidden_states.device) if cache.cuda else None
    num_tokens, num_top_k = top_k_index.shape
    rows = None
    for start in range(0, len(experts), cache.slots):  # in pieces when the slots cannot hold them all
        piece = experts[start:start + cache.slots]
        t0 = time.perf_counter()
        slots = cache.acquire(layer, piece, compute)
        cache.host_s += time.perf_counter() - t0
        weights, groups, ids = (cache.gate_up, cache.down), cache.slots, slots
        if groups > _GROUPED_MM_MAX_GROUPS:
            # grouped_mm takes at most 1023 groups (Qwen3-30B-A3B at 25 % has
            # 1,536 slots, OLMoE-1B-7B at 100 % 1,024): the piece's slots gathered, as offload_moe_experts
            # does for such a cache.
            picked = torch.tensor(slots, dtype=torch.int64).to(hidden_states.device, non_blocking=True)
            weights = (cache.gate_up.index_select(0, picked), cache.down.index_select(0, picked))
            groups, ids = len(slots), list(range(len(slots)))
        # expert id -> group id (the sentinel `groups` for other pieces'
        # experts), built on the host and sent without a stream sync
        remap = torch.full((self.num_experts,), groups, dtype=top_k_index.dtype)
        remap[piece] = torch.tensor(ids, dtype=top_k_index.dtype)
        remap = remap.to(top_k_index.device, non_blocking=True)
        part = _grouped_rows(torch, self, weights, hidden_states, remap[top_k_index], top_k_weights, groups)
        rows = part if rows is None else rows + part  # the other pieces' rows are exact zeros
        t0 = time.perf_counter()
        cache.release(slots, compute)
        cache.host_s += time.perf_counter() - t0
    cache.calls += 1
    if rows is None:
        return torch.zeros_like(hidden_states)
    return rows.view(num_tokens, num_top_k, -1).sum(dim=1).to(hidden_states.dtype)


class ByHandMode(Mode):
    def __init__(self, torch, model, state, budget, device, cuda):
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS.register(BY_HAND_IMPL, by_hand_experts_forward)
        self.cache = ByHandCache(torch, state, budget, device, cuda, shared_host_experts(model, cuda))
        for layer, (_, experts, _, _, _) in enumerate(state.saved):
            experts._bench_by_hand = (self.cache, layer)
            experts.config._experts_implementation = BY_HAND_IMPL
        self.device_bytes = self.cache.slots * state.expert_bytes

    def counters(self):
        c = self.cache
        return {"hits": c.hits, "misses": c.misses, "bytes": c.bytes, "copies": c.copies, "host_s": c.host_s,
                "calls": c.calls}

    def close(self):
        self.cache = None


class AccelerateMode(Mode):
    def __init__(self, model, state, device):
        try:
            from accelerate import cpu_offload
        except ImportError as exc:
            raise RowSkipped(f"accelerate is not importable ({exc})") from exc
        self.calls = 0
        self.layer_bytes = state.expert_bytes * state.num_experts
        self.handles = []
        for _, experts, _, _, _ in state.saved:
            cpu_offload(experts, execution_device=device)
            self.handles.append(experts.register_forward_pre_hook(self._count))

    def _count(self, module, args):
        self.calls += 1

    def counters(self):
        # Every call copies all of its layer's experts in (no cache).
        return {"bytes": self.calls * self.layer_bytes, "copies": None, "hits": None, "misses": None}

    def close(self):
        for h in self.handles:
            h.remove()


@contextlib.contextmanager
def cpu_sync_noop(torch, active: bool):
    """moe-policylang calls torch.cuda.synchronize(compute_device); on the
    CPU smoke that device is the CPU: make that one call a no-op."""
    if not active:
        yield
        return
    original = torch.cuda.synchronize

    def synchronize(device=None):
        if device is not None and torch.device(device).type == "cpu":
            return None
        return original(device)

    torch.cuda.synchronize = synchronize
    try:
        yield
    finally:
        torch.cuda.synchronize = original


class PolicyLangMode(Mode):
    accesses_from_routing = True

    def __init__(self, torch, model, state, budget, row, device, cuda, capacity_mode):
        try:
            import moe_policylang
        except ImportError as exc:
            raise RowSkipped(f"moe-policylang is not importable ({exc})") from exc
        self.version = getattr(moe_policylang, "__version__", None)
        slots = max(1, budget // state.expert_bytes)
        if capacity_mode == "memory":
            self.capacity = max(1, slots // state.num_layers)
        else:
            self.capacity = max(1, min(slots, state.num_experts))
        top_k = model.config.num_experts_per_tok
        if row == "moe-policylang-lru":
            policy = f"policy bench_lru {{ cache {{ capacity = {self.capacity} eviction = lru }} }}"
            self.async_transfers = False
        else:
            budget_k = min(top_k, self.capacity)
            policy = (f"policy bench_lookahead {{ cache {{ capacity = {self.capacity} eviction = lru }} "
                      f"prefetch {{ strategy = lookahead lookahead = 1 budget = {budget_k} }} }}")
            # Its prefetches move bytes only through the async transfer manager.
            self.async_transfers = cuda
        self.policy = policy
        self.expert_bytes = state.expert_bytes
        gpu_device = torch.cuda.current_device() if cuda else device  # an index: it compares devices
        self.mgr = moe_policylang.attach(model, policy, gpu_device=gpu_device, async_transfers=self.async_transfers)
        if getattr(self.mgr, "_mode", "backend") != "backend":
            raise RowSkipped(f"moe-policylang attached in {self.mgr._mode!r} mode, not its experts backend")
        self.peak_cached = 0
        self.pool_bytes = state.num_layers * self.capacity * state.expert_bytes

    def _cached(self):
        return sum(len(ctx.get("gpu_cache", ())) for ctx in getattr(self.mgr, "_backend_contexts", []) or [])

    def on_step(self):
        self.peak_cached = max(self.peak_cached, self._cached())

    def counters(self):
        s = self.mgr.stats
        transfers, nbytes = s.cpu_to_gpu_transfers, s.bytes_transferred
        atm = getattr(self.mgr, "_atm", None)
        if atm is not None:
            # A prefetched expert is counted by the manager when used and by
            # the transfer manager when copied: count its bytes once.
            used = atm.stats.prefetch_hits
            nbytes = nbytes - used * self.expert_bytes + atm.stats.bytes_transferred
        return {"bytes": nbytes, "copies_at_use": transfers, "hits": None, "misses": None}

    def extra(self):
        self.on_step()
        return {"mpl_capacity": self.capacity, "mpl_policy": self.policy, "mpl_version": self.version,
                "mpl_async_transfers": self.async_transfers, "mpl_pool_bytes": self.pool_bytes,
                "mpl_peak_cached_expert_bytes": self.peak_cached * self.expert_bytes}

    def close(self):
        self.mgr.detach()


# ------------------------------------------------------------------- rows
