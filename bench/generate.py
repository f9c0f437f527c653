"""BM6: transformers `generate` end to end, every row of a block in one process.

    python bench/generate.py [--models olmoe-1b-7b qwen3-30b-a3b] [--batches 1 8]
        [--shares 0.1 0.25 0.5] [--rows ROW ...] [--new-tokens 64] [--warmup-tokens 8]
        [--prompt-tokens 32] [--ttft-tokens 512] [--accelerate-tokens 4] [--vocab 32000]
        [--mpl-capacity memory|slots] [--budget-s 540] [--json PATH] [--plot PATH.png]
    python bench/generate.py --smoke-cpu [--json PATH]

Models: transformers OlmoeConfig / Qwen3MoeConfig at the real shapes of
OLMoE-1B-7B-0924 (16 layers, 64 experts, top-8, hidden 2048, expert
intermediate 1024, 16 heads) and Qwen3-30B-A3B (48 layers, 128 experts, top-8,
hidden 2048, moe_intermediate_size 768, 32 heads, 4 kv heads, head_dim 128),
random bf16 weights initialised on the GPU (nothing is downloaded), the vocab
cut to --vocab (the output says so). A block is one model and one batch size;
the model is built once per model and every row of every block runs in this
one process. Prompts are fixed random ids; decoding is greedy with
min_new_tokens = max_new_tokens (no eos), so every row generates the same
count. Each row first runs a warm-up generate on a different prompt, then
the measured generate, then the time-to-first-token generate.

Rows (share = device cache budget / all expert bytes; share-free rows have none):
  resident          every expert on the GPU, transformers' default experts
                    implementation (grouped_mm in 5.17): the reference
  resident-eager    every expert on the GPU, experts_implementation "eager"
  on-demand         prefetch.offload_moe_experts, predictor=None (records the
                    routing trace the oracle replays)
  gate              ... predictor=NextLayerGatePredictor()
  oracle            ... predictor=OraclePredictor(trace of on-demand's measured
                    generate), eviction_policy "next-use"
                    (all three with the default sync_free=None: on-demand and
                    oracle decode without a routing sync, Note [Sync-free
                    decode]; the gate's guesses need that sync, so it stays
                    on the synced path)
  on-demand-synced / oracle-synced
                    the same with sync_free=False: every layer reads its
                    routing on the host first
  torch-by-hand     plain PyTorch a user would write: an LRU over (layer,
                    expert) of budget // expert-bytes device slots (one
                    preallocated [slots, ...] tensor per weight), experts in
                    pinned host memory, copy_(non_blocking=True) per miss on a
                    side stream with events; hooked in as a transformers
                    experts implementation, computing with grouped_mm on the
                    slot tensors (expert ids remapped to slots); a layer routed
                    to more experts than slots runs in pieces
  accelerate-cpu-offload
                    accelerate.cpu_offload of each layer's experts module (what
                    device_map offload does: the whole layer's experts copied in
                    at every call); only --accelerate-tokens tokens
  moe-policylang-lru / moe-policylang-lookahead
                    the pip package moe-policylang (transformers experts
                    backend; plain copies), cache {eviction = lru}, the second
                    with prefetch {strategy = lookahead} and async transfers
                    (CUDA only: without them its prefetch moves nothing).
                    Its cache is keyed by expert id across all layers and each
                    layer keeps its own device copies of the ids it holds, so
                    its capacity C holds up to layers x C experts: --mpl-capacity
                    memory (default) sets C = budget slots // layers (the same
                    device bytes as our budget), slots sets C = min(budget
                    slots, experts). Null with the reason where the package is
                    not importable.

Figures per row:
  p50_ms, p90_ms    decode ms/token: time between consecutive logits calls of
                    the measured generate (torch.cuda.synchronize before each
                    reading), the prefill step excluded
  tokens_equal      generated ids equal to the resident row's (accelerate:
                    its first --accelerate-tokens)
  hit_rate, bytes_moved, copies
                    over the decode steps only (counters read at the first
                    logits call and at the end). Engine: its hits / (hits +
                    misses); torch-by-hand: routed (layer, expert) found in a
                    slot; moe-policylang: routed (layer, expert) needing no
                    copy at use (its prefetched experts count as copies);
                    accelerate: no cache, hit rate null
  precision, recall engine rows: the controller's prediction scores
  host_us_per_layer engine: report()["host_us_per_layer"] where the controller
                    gives it; torch-by-hand: Python time in its LRU (acquire
                    and release) per layer call, the routing sync and compute
                    launches excluded; null elsewhere
  ttft_ms           a separate generate with max_new_tokens=1 on a
                    --ttft-tokens prompt per batch row, synchronised;
                    ttft_floor_ms = max(resident's TTFT (the resident
                    prefill, timed after one untimed run of that shape),
                    distinct (layer, expert) the prompt routes x expert
                    bytes / raw H2D)
  x_resident        p50_ms / resident p50_ms (the faster of the resident row
                    and its rerun after the block, as the block's
                    resident_ref_p50_ms)
  x_adjacent        p50_ms / resident_adjacent_p50_ms: the resident model's
                    generate run again right after this row (the host's
                    speed drifts over a block; this pair is seconds apart)
  io_floor_ms       Belady's fewest loads (prefetch.integration.belady_misses
                    over the recorded routing, decode steps, capacity = budget
                    slots) x expert bytes / raw H2D GB/s / decode tokens;
                    floor_ms = max(resident ref p50, io_floor_ms); over_floor =
                    p50_ms / floor_ms
  raw H2D           bench.common.raw_copy_gbps, pinned copies of expert-sized
                    rows, measured when a model is built and after its rows;
                    the faster of the two
A row that cannot run reports null figures with a reason; rows not started
before --budget-s are null with that reason. During offloaded rows the
model's own GPU expert weights stay allocated (kept to restore the model for
the next row; nothing reads them): device memory is not what is measured.
After each block the resident row runs again to check the model was restored.

--smoke-cpu: tiny Qwen3-MoE, OLMoE and Mixtral configs (4 layers, 8 experts,
top-2, hidden 64) in float32 on the CPU, a few tokens, every row that can run
there (engine rows with the host backend, torch-by-hand without pinning,
accelerate and moe-policylang if importable; moe-policylang calls
torch.cuda.synchronize on the compute device, which is made a no-op for the
CPU device during its rows). It checks the logic; its timings mean nothing.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from collections import OrderedDict

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import fmt, machine_info, raw_copy_gbps, write_json  # noqa: E402

MODELS = {
    # OLMoE-1B-7B-0924's config.json: intermediate_size is the expert width.
    "olmoe-1b-7b": ("olmoe", dict(hidden_size=2048, intermediate_size=1024, num_hidden_layers=16,
                                  num_attention_heads=16, num_key_value_heads=16, num_experts=64,
                                  num_experts_per_tok=8, norm_topk_prob=False, rms_norm_eps=1e-5,
                                  max_position_embeddings=4096, rope_parameters={"rope_type": "default",
                                                                                 "rope_theta": 10000.0})),
    "qwen3-30b-a3b": ("qwen3_moe", dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                                        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                                        head_dim=128, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                                        rms_norm_eps=1e-6, max_position_embeddings=40960,
                                        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}
SMOKE_MODELS = {
    "smoke-qwen3-moe": ("qwen3_moe", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "smoke-olmoe": ("olmoe", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
                                  num_key_value_heads=4, num_experts=8, num_experts_per_tok=2)),
    "smoke-mixtral": ("mixtral", dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                      num_experts_per_tok=2)),
}
SHARE_FREE_ROWS = ("resident", "resident-eager", "accelerate-cpu-offload")
SHARE_ROWS = ("on-demand", "gate", "oracle", "on-demand-synced", "oracle-synced", "torch-by-hand",
              "moe-policylang-lru", "moe-policylang-lookahead")
ROWS = ("resident", "resident-eager", *SHARE_ROWS, "accelerate-cpu-offload")
ENGINE_ROWS = ("on-demand", "gate", "oracle", "on-demand-synced", "oracle-synced")
MPL_ROWS = ("moe-policylang-lru", "moe-policylang-lookahead")
BY_HAND_IMPL = "bench_torch_by_hand"
FIGURES = ("p50_ms", "p90_ms", "prefill_ms", "ttft_ms", "tokens_equal", "hit_rate", "bytes_moved", "copies",
           "precision", "recall", "host_us_per_layer", "x_resident", "x_adjacent", "over_floor", "ttft_over_floor")


class RowSkipped(Exception):
    """A row that cannot run here; the message is the reason."""


# ---------------------------------------------------------------- the model


def build_model(torch, family: str, shape: dict, vocab: int, device, dtype, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, vocab_size=vocab, eos_token_id=None, bos_token_id=None, pad_token_id=0,
                               tie_word_embeddings=False, **shape)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def moe_blocks(model):
    """(block, experts, gate) per MoE layer in module order: a module whose
    `.experts` holds 3-D gate_up_proj / down_proj and that has a `.gate`."""
    found = []
    for module in model.modules():
        experts, gate = getattr(module, "experts", None), getattr(module, "gate", None)
        gu = getattr(experts, "gate_up_proj", None)
        if gate is not None and gu is not None and getattr(gu, "dim", lambda: 0)() == 3:
            found.append((module, experts, gate))
    return found


class ModelState:
    """What a row may change, saved once: each block's experts module, its
    parameter objects and their data, and the experts implementation.
    restore() puts all of it back (no copy: the saved data tensors are the
    originals) and checks it."""

    NAMES = ("gate_up_proj", "down_proj")

    def __init__(self, model):
        self.model = model
        self.impl = model.config._experts_implementation
        self.saved = []
        for block, experts, _ in moe_blocks(model):
            params = {n: (getattr(experts, n), getattr(experts, n).data) for n in self.NAMES}
            self.saved.append((block, experts, params, (set(block.__dict__), set(experts.__dict__)),
                               experts.forward))
        gu = self.saved[0][2]["gate_up_proj"][1]
        dn = self.saved[0][2]["down_proj"][1]
        self.num_layers = len(self.saved)
        self.num_experts = gu.shape[0]
        self.expert_bytes = gu[0].numel() * gu.element_size() + dn[0].numel() * dn.element_size()
        self.total_bytes = self.expert_bytes * self.num_experts * self.num_layers

    def restore(self):
        with contextlib.suppress(ImportError):
            from accelerate.hooks import remove_hook_from_module

            for _, experts, _, _, _ in self.saved:
                remove_hook_from_module(experts, recurse=True)
        for block, experts, params, (block_attrs, experts_attrs), _ in self.saved:
            block.experts = experts
            for module, attrs in ((block, block_attrs), (experts, experts_attrs)):
                for key in [k for k in module.__dict__ if k not in attrs]:
                    delattr(module, key)  # what a row added (contexts, wrapped forwards)
            for name, (param, data) in params.items():
                param.data = data
                experts._parameters[name] = param
        self.model.config._experts_implementation = self.impl
        self.check()

    def check(self):
        for block, experts, params, (block_attrs, experts_attrs), forward in self.saved:
            ok = block.experts is experts and experts.forward == forward
            ok = ok and set(block.__dict__) == block_attrs and set(experts.__dict__) == experts_attrs
            for name, (param, data) in params.items():
                live = experts._parameters.get(name)
                ok = ok and live is param and live.data.data_ptr() == data.data_ptr()
            if not ok:
                raise RuntimeError("the model could not be restored to its resident state")
        if self.model.config._experts_implementation != self.impl:
            raise RuntimeError("experts implementation not restored")


# ------------------------------------------------------------- generation


def make_sync(torch, cuda: bool):
    if cuda:
        return torch.cuda.synchronize
    return lambda: None


class StepTimer:
    """A logits processor that reads the clock (after a device sync) once per
    generated token; `on_first` runs at the first call (the prefill's logits)."""

    def __init__(self, sync, on_first=None, on_step=None):
        self.sync = sync
        self.on_first = on_first
        self.on_step = on_step
        self.times = []

    def __call__(self, input_ids, scores):
        self.sync()
        self.times.append(time.perf_counter())
        if len(self.times) == 1 and self.on_first is not None:
            self.on_first()
        if self.on_step is not None:
            self.on_step()
        return scores


def generate(torch, model, ids, new_tokens: int, sync, timer=None):
    """Greedy generate of exactly `new_tokens`; returns (new ids on the CPU,
    start time, end time), both after a sync."""
    from transformers import LogitsProcessorList

    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  do_sample=False, pad_token_id=0)
    if timer is not None:
        kwargs["logits_processor"] = LogitsProcessorList([timer])
    sync()
    t0 = time.perf_counter()
    out = model.generate(ids, **kwargs)
    sync()
    t1 = time.perf_counter()
    return out[:, ids.shape[1]:].cpu(), t0, t1


def percentile(values, q):
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class RoutingRecorder:
    """Forward hooks on the routers: keeps each call's top-k index tensor on
    its device (no sync while generating); steps() turns them into a routing
    trace (per step, per layer, sorted distinct experts)."""

    def __init__(self, model):
        self.calls = []
        self.handles = []
        for layer, (_, _, gate) in enumerate(moe_blocks(model)):
            self.handles.append(gate.register_forward_hook(
                lambda module, args, out, layer=layer: self.calls.append((layer, out[-1].detach()))))
        self.layers = len(self.handles)

    def mark(self) -> int:
        return len(self.calls)

    def distinct_accesses(self, start: int = 0, end: int | None = None) -> int:
        return sum(len(set(idx.flatten().tolist())) for _, idx in self.calls[start:end])

    def steps(self) -> list:
        out = []
        for i, (layer, idx) in enumerate(self.calls):
            if i % self.layers == 0:
                out.append([[] for _ in range(self.layers)])
            out[-1][layer] = sorted(set(idx.flatten().tolist()))
        return out

    def close(self):
        for h in self.handles:
            h.remove()
        self.handles = []


# ------------------------------------------------------------ the modes


class Mode:
    """A way of running the experts, attached to the model for one row.
    counters(): cumulative numbers (hits, misses, bytes, copies, ...), any
    of them None where not known."""

    accesses_from_routing = False

    def counters(self) -> dict:
        return {}

    def new_sequence(self):
        pass

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


_HOST_EXPERTS = {}  # id(model) -> the packed host copy its first offload made (same weights every row)


class EngineMode(Mode):
    def __init__(self, model, budget, row, trace, cuda):
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
        self.ctl = prefetch.offload_moe_experts(model, device_budget_bytes=budget, predictor=predictor,
                                                handle_options=options, record_trace=True, sync_free=sync_free,
                                                host_experts=_HOST_EXPERTS.get(id(model)), **kwargs)
        _HOST_EXPERTS[id(model)] = self.ctl.host_experts

    def counters(self):
        r = self.ctl.report()  # reads the routings still on their way back first
        # Bytes moved: the engine's copies plus the experts the sync-free path
        # read straight from host memory; hits and misses likewise.
        out = {"bytes": r.get("bytes_copied") + r.get("zero_copy_bytes", 0), "copies": r.get("copies"),
               "hits": None, "misses": None, "evictions": r.get("evictions"), "wasted": r.get("wasted"),
               "late": r.get("late"), "zero_copy_reads": r.get("zero_copy_reads")}
        handle = getattr(self.ctl, "handle", None)
        if handle is not None and hasattr(handle, "stats"):
            s = handle.stats()
            out["hits"] = s.get("hits") + getattr(self.ctl, "pinned_hits", 0)
            out["misses"] = s.get("misses") + getattr(self.ctl, "zero_copy_reads", 0)
        return out

    def new_sequence(self):
        self.ctl.new_sequence()

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
                "declined": r.get("declined")}

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

    def __init__(self, torch, state: ModelState, budget: int, device, cuda: bool):
        self.torch = torch
        self.cuda = cuda
        self.slots = max(1, budget // state.expert_bytes)
        self.host = []  # per layer: (gate_up [E, 2I, H], down [E, H, I]) on the host
        for _, _, params, _, _ in state.saved:
            pair = []
            for name in ModelState.NAMES:
                src = params[name][1]
                dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=cuda)
                dst.copy_(src)
                pair.append(dst)
            self.host.append(tuple(pair))
        gu, dn = self.host[0]
        self.gate_up = torch.empty((self.slots, *gu.shape[1:]), dtype=gu.dtype, device=device)
        self.down = torch.empty((self.slots, *dn.shape[1:]), dtype=dn.dtype, device=device)
        self.lru = OrderedDict()  # (layer, expert) -> slot
        self.free = list(range(self.slots))[::-1]
        self.ready = [None] * self.slots
        self.used = [None] * self.slots
        self.side = torch.cuda.Stream(device=device) if cuda else None
        self.hits = self.misses = self.bytes = self.copies = 0
        self.host_s = 0.0
        self.calls = 0
        self.expert_bytes = state.expert_bytes

    def acquire(self, layer, experts, compute):
        torch = self.torch
        busy = {self.lru[(layer, e)] for e in experts if (layer, e) in self.lru}
        slots = []
        for e in experts:
            key = (layer, e)
            slot = self.lru.get(key)
            if slot is not None:
                self.hits += 1
                self.lru.move_to_end(key)
            else:
                self.misses += 1
                if self.free:
                    slot = self.free.pop()
                else:
                    victim = next(k for k, s in self.lru.items() if s not in busy)
                    slot = self.lru.pop(victim)
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
                self.lru[key] = slot
                busy.add(slot)
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
        # expert id -> slot id (the sentinel `slots` for other pieces' experts),
        # built on the host and sent without a stream sync
        remap = torch.full((self.num_experts,), cache.slots, dtype=top_k_index.dtype)
        remap[piece] = torch.tensor(slots, dtype=top_k_index.dtype)
        remap = remap.to(top_k_index.device, non_blocking=True)
        part = _grouped_rows(torch, self, (cache.gate_up, cache.down), hidden_states, remap[top_k_index],
                             top_k_weights, cache.slots)
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
        self.cache = ByHandCache(torch, state, budget, device, cuda)
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


class Block:
    """One model and batch: prompts, the resident reference and the routing."""

    def __init__(self, torch, model, state, batch, args, cuda, device, sync):
        self.torch, self.model, self.state, self.batch = torch, model, state, batch
        self.args, self.cuda, self.device, self.sync = args, cuda, device, sync
        vocab = model.config.vocab_size

        def prompt(seed, length):
            g = torch.Generator().manual_seed(seed)
            return torch.randint(1, vocab, (batch, length), generator=g).to(device)

        self.prompt = prompt(100 + batch, args.prompt_tokens)
        self.warm_prompt = prompt(200 + batch, args.prompt_tokens)
        self.ttft_prompt = prompt(300 + batch, args.ttft_tokens)
        self.reference = None  # resident's generated ids
        self.resident_p50 = None
        self.resident_ttft = None
        self.routing = None  # resident routing of the measured prompt: per step, per layer
        self.ttft_routed = None  # distinct (layer, expert) the TTFT prompt routes
        self.traces = {}  # share -> on-demand's recorded steps


def run_row(block: Block, row: str, share, trace=None) -> dict:
    """Sets up `row`, runs the warm-up, measured and TTFT generates, tears
    down and restores the model. Returns the figures."""
    torch, model, state, args = block.torch, block.model, block.state, block.args
    sync = block.sync
    budget = None if share is None else int(share * state.total_bytes)
    new_tokens = args.accelerate_tokens if row == "accelerate-cpu-offload" else args.new_tokens
    warm_tokens = 1 if row == "accelerate-cpu-offload" else args.warmup_tokens
    out = {"budget_bytes": budget, "new_tokens": new_tokens}
    mode = None
    recorder = None
    try:
        with cpu_sync_noop(torch, row in MPL_ROWS and not block.cuda):
            if row == "resident":
                mode = ResidentMode(model, None)
            elif row == "resident-eager":
                mode = ResidentMode(model, "eager")
            elif row in ENGINE_ROWS:
                mode = EngineMode(model, budget, row, trace, block.cuda)
                out["device_expert_bytes"] = budget
            elif row == "torch-by-hand":
                mode = ByHandMode(torch, model, state, budget, block.device, block.cuda)
                out["device_expert_bytes"] = mode.device_bytes
            elif row == "accelerate-cpu-offload":
                mode = AccelerateMode(model, state, block.device)
                out["device_expert_bytes"] = mode.layer_bytes
            elif row in MPL_ROWS:
                mode = PolicyLangMode(torch, model, state, budget, row, block.device, block.cuda,
                                      args.mpl_capacity)
                out["device_expert_bytes"] = mode.pool_bytes
            else:
                raise ValueError(row)
            if mode.accesses_from_routing:
                recorder = RoutingRecorder(model)
            generate(torch, model, block.warm_prompt, warm_tokens, sync)
            mode.new_sequence()
            marks = {}

            def first():
                marks["counters"] = mode.counters()
                marks["calls"] = recorder.mark() if recorder else None

            timer = StepTimer(sync, on_first=first, on_step=mode.on_step)
            mode.start_measuring()
            before = mode.counters()
            ids, t0, _ = generate(torch, model, block.prompt, new_tokens, sync, timer)
            after = mode.counters()
            accesses = recorder.distinct_accesses(marks["calls"]) if recorder else None
            extra = mode.extra()
            if isinstance(mode, EngineMode):
                out["trace_steps"] = mode.trace_steps(new_tokens)
            mode.new_sequence()
            if row == "resident":
                # The floor of every row's TTFT: not the process's first
                # prefill of this shape.
                generate(torch, model, block.ttft_prompt, 1, sync)
            _, s0, s1 = generate(torch, model, block.ttft_prompt, 1, sync)
    finally:
        if recorder is not None:
            recorder.close()
        if mode is not None:
            with contextlib.suppress(Exception):
                mode.close()
        mode = None
        block.state.restore()
        gc.collect()
        if block.cuda:
            torch.cuda.empty_cache()
    times = timer.times
    decode = [b - a for a, b in zip(times, times[1:])]
    out.update({
        "p50_ms": statistics.median(decode) * 1e3 if decode else None,
        "p90_ms": percentile(decode, 0.9) * 1e3 if decode else None,
        "decode_tokens": len(decode),
        "prefill_ms": (times[0] - t0) * 1e3,
        "ttft_ms": (s1 - s0) * 1e3,
        "generated": ids,
    })
    out.update(decode_counters(marks["counters"], after, accesses))
    out["prefill_bytes"] = delta(before, marks["counters"], "bytes")
    out.update({k: v for k, v in extra.items() if k not in out})
    return out


def delta(a, b, key):
    if a.get(key) is None or b.get(key) is None:
        return None
    return b[key] - a[key]


def decode_counters(at_first: dict, end: dict, accesses) -> dict:
    """Counter figures over the decode steps (first logits call to the end)."""
    hits, misses = delta(at_first, end, "hits"), delta(at_first, end, "misses")
    hit_rate = hits / (hits + misses) if hits is not None and misses is not None and hits + misses else None
    out = {"bytes_moved": delta(at_first, end, "bytes"), "copies": delta(at_first, end, "copies"),
           "hit_rate": hit_rate}
    copies_at_use = delta(at_first, end, "copies_at_use")
    if accesses and copies_at_use is not None:
        out["hit_rate"] = 1.0 - copies_at_use / accesses
        out["copies"] = copies_at_use
        out["routed_accesses"] = accesses
    calls = delta(at_first, end, "calls")
    host_s = delta(at_first, end, "host_s")
    if calls and host_s is not None:
        out["host_us_per_layer"] = host_s / calls * 1e6
    return out


def record_routing(block: Block):
    """The resident model's routing of the measured prompt (per decode step)
    and the distinct (layer, expert) the TTFT prompt routes: untimed runs
    with router hooks."""
    torch, model, sync = block.torch, block.model, block.sync
    rec = RoutingRecorder(model)
    try:
        generate(torch, model, block.prompt, block.args.new_tokens, sync)
        block.routing = rec.steps()
        rec.calls = []
        generate(torch, model, block.ttft_prompt, 1, sync)
        block.ttft_routed = sum(len(layer) for layer in rec.steps()[0])
    finally:
        rec.close()


def raw_h2d_gbps(torch, nbytes_each: int, count: int = 32) -> float:
    src = torch.empty((count, nbytes_each), dtype=torch.uint8, pin_memory=True).fill_(7)
    dst = torch.empty((count, nbytes_each), dtype=torch.uint8, device="cuda")
    gbps = statistics.median(raw_copy_gbps(torch, src, dst, [torch.cuda.Stream()], reps=3))
    del src, dst
    return gbps


def null_row(base: dict, reason: str) -> dict:
    row = dict(base)
    for key in FIGURES:
        row.setdefault(key, None)
    row["reason"] = reason
    return row


def run_model(torch, name, family, shape, args, cuda, device, dtype, started, rows, blocks, models_info):
    sync = make_sync(torch, cuda)
    t_build = time.perf_counter()
    model = build_model(torch, family, shape, args.vocab, device, dtype)
    state = ModelState(model)
    build_s = time.perf_counter() - t_build
    raw = [raw_h2d_gbps(torch, state.expert_bytes)] if cuda else []
    info = {"family": family, "shape": shape, "vocab": args.vocab, "dtype": str(dtype).replace("torch.", ""),
            "layers": state.num_layers, "experts": state.num_experts, "top_k": model.config.num_experts_per_tok,
            "expert_bytes": state.expert_bytes, "total_expert_bytes": state.total_bytes,
            "default_experts_implementation": state.impl, "build_s": build_s}
    models_info[name] = info
    print(f"{name}: expert {state.expert_bytes / 2**20:.2f} MiB, all experts {state.total_bytes / 2**30:.2f} GiB, "
          f"vocab {args.vocab}, default experts implementation {state.impl!r}, built in {build_s:.1f} s"
          + (f", raw H2D {raw[0]:.1f} GB/s" if raw else ""), file=sys.stderr, flush=True)
    model_rows = []
    for batch in args.batches:
        block = Block(torch, model, state, batch, args, cuda, device, sync)
        block_rows = []
        wanted = [r for r in ROWS if r in args.rows]
        plan = []
        for r in wanted:
            if r in SHARE_FREE_ROWS:
                plan.append((r, None))
        for share in args.shares:
            plan.extend((r, share) for r in SHARE_ROWS if r in wanted)
        # accelerate last: it is slow and its tokens are few
        plan.sort(key=lambda p: p[0] == "accelerate-cpu-offload")
        for row, share in plan:
            base = {"model": name, "batch": batch, "share": share, "row": row}
            if time.monotonic() - started > args.budget_s:
                block_rows.append(null_row(base, f"not run: --budget-s {args.budget_s:g} s spent"))
                continue
            if row != "resident" and block.reference is None:
                block_rows.append(null_row(base, "not run: the resident row did not run"))
                continue
            trace = None
            if row in ("oracle", "oracle-synced"):
                trace = oracle_trace(block, share)
                if trace is None:
                    block_rows.append(null_row(base, "not run: no recorded routing trace (on-demand did not run)"))
                    continue
            try:
                res = run_row(block, row, share, trace)
            except RowSkipped as exc:
                block_rows.append(null_row(base, str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - a row that fails reports why; the others still run
                block_rows.append(null_row(base, f"failed: {type(exc).__name__}: {str(exc)[:300]}"))
                print(f"  {name} b{batch} {row} failed: {exc!r}", file=sys.stderr, flush=True)
                continue
            generated = res.pop("generated")
            steps = res.pop("trace_steps", None)
            if row == "resident":
                block.reference = generated
                block.resident_p50, block.resident_ttft = res["p50_ms"], res["ttft_ms"]
                record_routing(block)
            if row == "on-demand" and steps is not None:
                block.traces[share] = steps
            if row in ("oracle", "oracle-synced") and steps is not None:
                res["oracle_replayed_exactly"] = steps == trace.steps
            ref = block.reference[:, :generated.shape[1]]
            res["tokens_equal"] = bool(torch.equal(generated, ref))
            if row != "resident" and block.reference is not None:
                res["resident_adjacent_p50_ms"] = resident_p50_now(block)
                if res["resident_adjacent_p50_ms"] and res.get("p50_ms") is not None:
                    res["x_adjacent"] = res["p50_ms"] / res["resident_adjacent_p50_ms"]
            if block.routing is not None and row in ENGINE_ROWS and steps is not None:
                res["routing_equals_resident"] = steps == block.routing[:len(steps)]
            block_rows.append({**base, **res})
            r = block_rows[-1]
            print(f"  {name} b{batch} {fmt(share) if share is not None else '-':>5} {row:<26} p50 "
                  f"{fmt(r['p50_ms']):>9} ms  ttft {fmt(r['ttft_ms']):>9} ms  hit {fmt(r.get('hit_rate'))}  "
                  f"equal {r['tokens_equal']}", file=sys.stderr, flush=True)
        blocks.append(restore_check(block, name))
        model_rows.extend(block_rows)
    if cuda:
        raw.append(raw_h2d_gbps(torch, state.expert_bytes))
    info["raw_h2d_gbps_runs"] = raw
    info["raw_h2d_gbps"] = max(raw) if raw else None
    by_block = {}
    for r in model_rows:
        by_block.setdefault(r["batch"], []).append(r)
    for batch, block_rows in by_block.items():
        block = next(b for b in blocks if b["model"] == name and b["batch"] == batch)
        settle(block_rows, block, info)
    explain_nulls(model_rows, cuda)
    rows.extend(model_rows)
    _HOST_EXPERTS.pop(id(model), None)  # its page-locked copy goes with the model
    del model, state
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()


def oracle_trace(block: Block, share):
    from prefetch.integration import RoutingTrace

    steps = block.traces.get(share)
    if steps is None and block.traces:
        steps = next(iter(block.traces.values()))
    if steps is None:
        return None
    return RoutingTrace(block.state.num_layers, block.state.num_experts, [list(map(list, s)) for s in steps])


def resident_p50_now(block: Block):
    """The resident model's decode p50 (ms) measured now, on the restored
    model; None if the model is not in its resident state."""
    try:
        block.state.check()
    except RuntimeError:
        return None
    timer = StepTimer(block.sync)
    generate(block.torch, block.model, block.prompt, block.args.new_tokens, block.sync, timer)
    decode = [b - a for a, b in zip(timer.times, timer.times[1:])]
    return statistics.median(decode) * 1e3 if decode else None


def restore_check(block: Block, name) -> dict:
    """The resident generate once more after the block's rows: the model must
    generate the same ids (the rows restored it)."""
    out = {"model": name, "batch": block.batch, "resident_p50_ms": block.resident_p50,
           "resident_ttft_ms": block.resident_ttft, "routing": block.routing, "traces": block.traces,
           "ttft_routed_experts": block.ttft_routed}
    if block.reference is None:
        out["restore_check"] = None
        return out
    try:
        block.state.check()
    except RuntimeError as exc:
        out["restore_check"] = False
        out["restore_reason"] = str(exc)
        return out
    timer = StepTimer(block.sync)
    ids, _, _ = generate(block.torch, block.model, block.prompt, block.args.new_tokens, block.sync, timer)
    decode = [b - a for a, b in zip(timer.times, timer.times[1:])]
    out["restore_check"] = bool(block.torch.equal(ids, block.reference))
    out["resident_again_p50_ms"] = statistics.median(decode) * 1e3 if decode else None
    return out


def settle(block_rows, block: dict, info: dict):
    """Ratios within the block and the floors (after the model's second raw
    bandwidth reading)."""
    from prefetch.integration import RoutingTrace, belady_misses

    # The reference: the faster of the resident row and its rerun after the
    # block (a transient slowdown of the host is not the model's speed).
    runs = [v for v in (block["resident_p50_ms"], block.get("resident_again_p50_ms")) if v is not None]
    res_p50 = min(runs) if runs else None
    block["resident_ref_p50_ms"] = res_p50
    res_ttft = block["resident_ttft_ms"]
    raw = info.get("raw_h2d_gbps")
    eb = info["expert_bytes"]
    routing = block.get("routing")
    traces = block.get("traces") or {}
    ttft_floor = None
    if res_ttft is not None:
        io = block["ttft_routed_experts"] * eb / (raw * 1e9) * 1e3 if raw and block["ttft_routed_experts"] else None
        ttft_floor = max(res_ttft, io) if io is not None else res_ttft
        block["ttft_io_floor_ms"] = io
    block["ttft_floor_ms"] = ttft_floor
    for r in block_rows:
        p50 = r.get("p50_ms")
        r["x_resident"] = p50 / res_p50 if p50 is not None and res_p50 else None
        r["ttft_floor_ms"] = ttft_floor
        r["ttft_over_floor"] = r["ttft_ms"] / ttft_floor if r.get("ttft_ms") is not None and ttft_floor else None
        if r["share"] is None or routing is None:
            continue
        budget = int(r["share"] * info["total_expert_bytes"])
        capacity = budget // eb
        # The routing on-demand recorded at this share (what the oracle
        # replays); the resident's where there is none.
        steps = traces.get(r["share"])
        r["io_floor_trace"] = "on-demand" if steps is not None else "resident"
        steps = steps if steps is not None else routing
        decode_tokens = len(steps) - 1
        io_floor = None
        if raw and capacity >= 1 and decode_tokens > 0:
            loads = belady_misses(RoutingTrace(info["layers"], info["experts"], steps), capacity, start_step=1)
            r["belady_loads"] = loads
            io_floor = loads * eb / (raw * 1e9) / decode_tokens * 1e3
        r["io_floor_ms"] = io_floor
        floor = max(res_p50, io_floor) if res_p50 is not None and io_floor is not None else res_p50
        r["floor_ms"] = floor
        r["over_floor"] = p50 / floor if p50 is not None and floor else None
    block.pop("routing", None)
    block.pop("traces", None)


def why_null(row: str, key: str, cuda: bool, share) -> str:
    """Why a figure of a row that ran is null."""
    resident = row.startswith("resident")
    if key in ("hit_rate", "bytes_moved", "copies", "prefill_bytes") and resident:
        return "every expert is resident: nothing is cached or moved"
    if key == "hit_rate" and row == "accelerate-cpu-offload":
        return "no cache: every call copies all of its layer's experts"
    if key == "copies" and row == "accelerate-cpu-offload":
        return "not counted: a layer's experts move as one module per call"
    if key in ("hit_rate", "bytes_moved", "copies") and row in ENGINE_ROWS:
        return "the engine's counters were not readable"
    if key in ("precision", "recall"):
        return "no predictions scored for this row" if row in ENGINE_ROWS else "no predictor in this row"
    if key == "host_us_per_layer":
        if row in ENGINE_ROWS:
            return "the controller's report() has no host_us_per_layer"
        return "not measured for this row"
    if key in ("io_floor_ms", "floor_ms", "over_floor"):
        if share is None:
            return "no cache budget: no IO floor"
        if not cuda:
            return "no CUDA: no H2D bandwidth measured"
    return "not measured for this row"


def explain_nulls(rows, cuda: bool):
    for r in rows:
        for key in (*FIGURES, "io_floor_ms", "floor_ms"):
            r.setdefault(key, None)
        if r.get("reason"):
            continue
        reasons = {key: why_null(r["row"], key, cuda, r["share"])
                   for key in (*FIGURES, "io_floor_ms", "floor_ms") if r[key] is None}
        if reasons:
            r["null_reasons"] = reasons


# ------------------------------------------------------------------ output


def format_table(rows) -> str:
    head = (f"{'model':<16}{'b':>3}{'share':>6}  {'row':<26}{'p50 ms':>9}{'p90 ms':>9}{'x res':>7}{'x adj':>7}"
            f"{'equal':>6}"
            f"{'hit':>6}{'GB moved':>9}{'host us':>8}{'ttft ms':>9}{'x ttft fl':>10}{'x floor':>8}  reason")
    lines = [head]
    for r in rows:
        gb = None if r.get("bytes_moved") is None else r["bytes_moved"] / 1e9
        share = "-" if r["share"] is None else f"{r['share']:.0%}"
        eq = "null" if r.get("tokens_equal") is None else str(r["tokens_equal"])
        lines.append(
            f"{r['model']:<16}{r['batch']:>3}{share:>6}  {r['row']:<26}{fmt(r.get('p50_ms')):>9}"
            f"{fmt(r.get('p90_ms')):>9}{fmt(r.get('x_resident')):>7}{fmt(r.get('x_adjacent')):>7}{eq:>6}"
            f"{fmt(r.get('hit_rate')):>6}"
            f"{fmt(gb, 3):>9}{fmt(r.get('host_us_per_layer'), 0):>8}{fmt(r.get('ttft_ms')):>9}"
            f"{fmt(r.get('ttft_over_floor')):>10}{fmt(r.get('over_floor')):>8}  {r.get('reason') or ''}")
    return "\n".join(lines)


def plot(rows, path) -> str | None:
    """ms/token p50 per row against the share, one panel per model and batch;
    share-free rows as horizontal lines. Returns why not, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        return f"matplotlib not importable ({exc})"
    groups = sorted({(r["model"], r["batch"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.2), squeeze=False)
    for ax, (model, batch) in zip(axes[0], groups):
        sub = [r for r in rows if r["model"] == model and r["batch"] == batch and r.get("p50_ms") is not None]
        for name in SHARE_ROWS:
            pts = sorted((r["share"] * 100, r["p50_ms"]) for r in sub if r["row"] == name)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        for name, style in (("resident", "k-"), ("resident-eager", "k:"), ("accelerate-cpu-offload", "r--")):
            for r in sub:
                if r["row"] == name:
                    ax.axhline(r["p50_ms"], color=style[0], linestyle=style[1:], linewidth=1, label=name)
        floors = sorted({(r["share"] * 100, r["floor_ms"]) for r in sub if r.get("floor_ms") and r["share"]})
        if floors:
            ax.plot([f[0] for f in floors], [f[1] for f in floors], "k--", alpha=0.5, label="max(resident, IO floor)")
        ax.set_title(f"{model}, batch {batch}")
        ax.set_xlabel("device cache share of expert bytes (%)")
        ax.set_ylabel("decode ms/token (p50)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=None, help=f"of {list(MODELS)} (smoke: {list(SMOKE_MODELS)})")
    parser.add_argument("--batches", type=int, nargs="+", default=None)
    parser.add_argument("--shares", type=float, nargs="+", default=None)
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS),
                        help="resident always runs (every row is compared to it)")
    parser.add_argument("--new-tokens", type=int, default=None, help="measured tokens per row (default 64)")
    parser.add_argument("--warmup-tokens", type=int, default=None, help="tokens of the warm-up generate (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=None, help="prompt length of the measured generate")
    parser.add_argument("--ttft-tokens", type=int, default=None, help="prompt length of the TTFT generate (512)")
    parser.add_argument("--accelerate-tokens", type=int, default=None, help="measured tokens of accelerate (4)")
    parser.add_argument("--vocab", type=int, default=None, help="vocab size (default 32000; the real ones are larger)")
    parser.add_argument("--mpl-capacity", choices=["memory", "slots"], default="memory",
                        help="moe-policylang capacity: budget slots // layers (same device bytes) or budget slots")
    parser.add_argument("--budget-s", type=float, default=None, help="start no row after this many seconds")
    parser.add_argument("--json")
    parser.add_argument("--plot", help="PNG of ms/token per row per share")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="tiny configs on the CPU in float32: checks the logic, measures nothing")
    args = parser.parse_args(argv)

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    smoke = args.smoke_cpu
    table = SMOKE_MODELS if smoke else MODELS
    defaults = dict(models=list(table), batches=[2] if smoke else [1, 8], shares=[0.5] if smoke
                    else [0.1, 0.25, 0.5], new_tokens=4 if smoke else 64, warmup_tokens=2 if smoke else 8,
                    prompt_tokens=8 if smoke else 32, ttft_tokens=32 if smoke else 512,
                    accelerate_tokens=3 if smoke else 4, vocab=128 if smoke else 32000,
                    budget_s=300 if smoke else 540)
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    unknown = [m for m in args.models if m not in table]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(table)}")
    if "resident" not in args.rows:
        args.rows = ["resident", *args.rows]
    if args.new_tokens < 2 or args.accelerate_tokens < 2:
        parser.error("--new-tokens and --accelerate-tokens must be >= 2 (the decode figure excludes the prefill)")

    cuda = not smoke and torch.cuda.is_available()
    report = {"benchmark": "BM6 generate", "machine": machine_info(), "smoke_cpu": smoke,
              "config": {k: getattr(args, k) for k in ("models", "batches", "shares", "rows", "new_tokens",
                                                        "warmup_tokens", "prompt_tokens", "ttft_tokens",
                                                        "accelerate_tokens", "vocab", "mpl_capacity", "budget_s")},
              "transformers": transformers.__version__,
              "notes": [f"vocab reduced to {args.vocab} (the real models' are 50304 and 151936)",
                        "random weights; routing is the random model's, not a trained one's"],
              "models": {}, "blocks": [], "rows": None}
    if not smoke and not cuda:
        print("BM6 needs a CUDA device (or --smoke-cpu): not measured", file=sys.stderr)
        if args.json:
            write_json(args.json, report)
        return 1
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    started = time.monotonic()
    rows = []
    torch.set_grad_enabled(False)
    for name in args.models:
        family, shape = table[name]
        run_model(torch, name, family, shape, args, cuda, device, dtype, started, rows, report["blocks"],
                  report["models"])
    report["rows"] = rows
    report["wall_s"] = time.monotonic() - started
    print(format_table(rows))
    if args.plot:
        why = plot(rows, args.plot)
        report["plot"] = args.plot if why is None else None
        if why:
            report["plot_reason"] = why
            print(f"plot not made: {why}", file=sys.stderr)
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
