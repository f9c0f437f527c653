"""Offload the experts of a PyTorch MoE model onto the prefetch engine.

    controller = prefetch.offload_moe_experts(model, device_budget_bytes=8 << 30,
                                              predictor=NextLayerGatePredictor())
    out = model.generate(...)          # experts come from the device cache
    controller.report()                # hit rate, prediction accuracy, bytes moved
    controller.close()

Two kinds of MoE block are handled:

- Hugging Face transformers 5 families whose experts live in one `*Experts`
  module with stacked `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]
  parameters, called as `experts(hidden, top_k_index, top_k_weights)`:
  Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and their relatives. The
  `*Experts` module is replaced by `OffloadedExperts`, which computes exactly
  what the eager implementation computes (same loop, same op order) with each
  expert's weights acquired from the cache.
- A user-defined block, `OffloadedMoEBlock(router, experts, top_k)`: a router
  (a module mapping hidden states to expert logits) and a list of expert
  modules of one architecture; softmax, top-k and optional renormalisation.

While layer L routes, the controller asks its predictor which experts later
layers will need and prefetches them, band = distance in layers (1 = next).
"""
from __future__ import annotations

import bisect
import heapq
import json
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import nn

from prefetch._engine import NO_NEXT_USE, PrefetchHandle
from prefetch.expert_prefetcher import ExpertPrefetcher

__all__ = [
    "OffloadController",
    "OffloadedExperts",
    "OffloadedMoEBlock",
    "RoutePredictor",
    "NextLayerGatePredictor",
    "TracePredictor",
    "OraclePredictor",
    "RoutingTrace",
    "offload_moe_experts",
    "find_hf_moe_blocks",
]


# --------------------------------------------------------------------- traces


@dataclass
class RoutingTrace:
    """Which experts each MoE layer used at each step (one forward pass).

    File format (JSON): {"format": "prefetch-routing-trace/1", "num_layers": L,
    "num_experts": E, "steps": [[[e, ...] per layer] per step]}; experts of a
    layer are the distinct experts any token of the batch routed to, sorted.
    See docs/trace_format.md.
    """

    num_layers: int
    num_experts: int
    steps: list[list[list[int]]] = field(default_factory=list)

    def add(self, step: int, layer: int, experts) -> None:
        while len(self.steps) <= step:
            self.steps.append([[] for _ in range(self.num_layers)])
        self.steps[step][layer] = sorted(int(e) for e in experts)

    def experts(self, step: int, layer: int) -> list[int] | None:
        if step >= len(self.steps) or layer >= self.num_layers:
            return None
        return self.steps[step][layer]

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(
                {"format": "prefetch-routing-trace/1", "num_layers": self.num_layers,
                 "num_experts": self.num_experts, "steps": self.steps},
                f,
            )

    @classmethod
    def load(cls, path: str) -> RoutingTrace:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != "prefetch-routing-trace/1":
            raise ValueError(f"{path}: not a prefetch routing trace (format {data.get('format')!r})")
        trace = cls(int(data["num_layers"]), int(data["num_experts"]), [])
        for step in data["steps"]:
            if len(step) != trace.num_layers:
                raise ValueError(f"{path}: a step has {len(step)} layers, expected {trace.num_layers}")
            for layer in step:
                if any(not (0 <= int(e) < trace.num_experts) for e in layer):
                    raise ValueError(f"{path}: expert index out of range 0..{trace.num_experts - 1}")
            trace.steps.append([sorted(int(e) for e in layer) for layer in step])
        return trace


# ----------------------------------------------------------------- predictors


class RoutePredictor(Protocol):
    """Predicts the experts of later layers while layer `layer` routes.

    `predict` returns {future_layer: experts}; `observe` is told what layer
    `layer` actually used (for learning predictors). Both run on the serving
    thread, between routing and expert compute, so keep them cheap."""

    def predict(
        self, controller: OffloadController, step: int, layer: int, hidden: torch.Tensor
    ) -> dict[int, list[int]]: ...

    def observe(self, controller: OffloadController, step: int, layer: int, experts: list[int]) -> None: ...


class NextLayerGatePredictor:
    """The router of layer L+d applied to layer L's hidden state (the MoE
    input), for d = 1..distance: hidden states change slowly across layers, so
    the next router's choice on this layer's input is a good guess."""

    def __init__(self, distance: int = 1, extra_per_token: int = 0):
        if distance < 1:
            raise ValueError("distance must be >= 1")
        self.distance = distance
        self.extra_per_token = extra_per_token  # prefetch top_k + extra per token

    def predict(self, controller, step, layer, hidden):
        out = {}
        for d in range(1, self.distance + 1):
            target = layer + d
            if target >= controller.num_layers:
                break
            logits = controller.router_logits(target, hidden)
            k = min(controller.top_k + self.extra_per_token, logits.shape[-1])
            idx = torch.topk(logits, k, dim=-1).indices
            out[target] = sorted(set(idx.flatten().tolist()))
        return out

    def observe(self, controller, step, layer, experts):
        pass


class TracePredictor:
    """MoE-Infinity's activation-matrix idea: remember each past request's
    expert activation matrix (layers x experts, counts); during a request,
    match its partial matrix (layers seen so far) against the past ones by
    cosine similarity and prefetch, for the next `distance` layers, the
    experts the closest past request used most there."""

    def __init__(self, distance: int = 2, max_experts: int | None = None, history: int = 256):
        self.distance = distance
        self.max_experts = max_experts
        self.history = history
        self.past: list[np.ndarray] = []
        self.current: np.ndarray | None = None

    def begin_request(self, controller) -> None:
        self.current = np.zeros((controller.num_layers, controller.num_experts), dtype=np.float32)

    def end_request(self) -> None:
        if self.current is not None and self.current.any():
            self.past.append(self.current)
            self.past = self.past[-self.history :]
        self.current = None

    def observe(self, controller, step, layer, experts):
        if self.current is None:
            self.begin_request(controller)
        self.current[layer, experts] += 1

    def predict(self, controller, step, layer, hidden):
        if not self.past:
            return {}
        if self.current is None:
            self.begin_request(controller)
        seen = self.current[: layer + 1].ravel()
        best, best_score = None, -1.0
        norm = float(np.linalg.norm(seen)) or 1.0
        for eam in self.past:
            part = eam[: layer + 1].ravel()
            score = float(part @ seen) / ((float(np.linalg.norm(part)) or 1.0) * norm)
            if score > best_score:
                best, best_score = eam, score
        out = {}
        k = self.max_experts or controller.top_k * 2
        for d in range(1, self.distance + 1):
            target = layer + d
            if target >= controller.num_layers:
                break
            row = best[target]
            order = np.argsort(-row, kind="stable")
            out[target] = sorted(int(e) for e in order[:k] if row[e] > 0)
        return out


class OraclePredictor:
    """Replays a recorded routing trace: predicts exactly what step s, layer
    L+d will use (the ceiling of any predictor). With hints it also tells
    the engine when each expert will next be read, on the controller's
    routing clock, so a handle made with ``eviction_policy="next-use"``
    evicts by Belady's rule. ``hints=None`` (default) sends them only to such
    a handle (other policies ignore hints, so they would cost host time for
    nothing); True or False forces it."""

    def __init__(self, trace: RoutingTrace, distance: int = 1, hints: bool | None = None):
        if distance < 1:
            raise ValueError("distance must be >= 1")
        self.trace = trace
        self.distance = distance
        self.hints = hints
        # layer -> expert -> the steps that read it, ascending
        self._steps_of: list[dict[int, list[int]]] = [{} for _ in range(trace.num_layers)]
        for s, step in enumerate(trace.steps):
            for layer, experts in enumerate(step):
                for e in experts:
                    self._steps_of[layer].setdefault(int(e), []).append(s)
        self._routed = None  # (step, layer, experts, clock) of the last routing
        self._hints: list = []  # (layer, experts, one time or a list) not yet sent

    def predict(self, controller, step, layer, hidden):
        out = {}
        hints = self._sends_hints(controller)
        for d in range(1, self.distance + 1):
            target, target_step = layer + d, step
            if target >= controller.num_layers:
                target -= controller.num_layers
                target_step += 1
            experts = self.trace.experts(target_step, target)
            if experts:
                out[target] = experts
                if hints:  # read d layers from now
                    self._hints.append((target, experts, controller.clock + d))
        if hints:
            self._flush(controller)
        return out

    def _sends_hints(self, controller) -> bool:
        if self.hints is None:
            return getattr(controller.handle, "eviction_policy", None) == "next-use"
        return self.hints

    def observe(self, controller, step, layer, experts):
        # The controller calls observe, then predict: hints collect here and
        # go to the engine in one call at the end of predict.
        if not self._sends_hints(controller):
            return
        now = controller.clock
        # The experts routed now are read now: their hint moves on only once
        # the next layer routes (they are released by then), or a prefetch
        # for the next layer could evict them before their acquire.
        self._hints = self._next_reads(controller, *self._routed) if self._routed is not None else []
        self._hints.append((layer, list(experts), now))
        self._routed = (step, layer, list(experts), now)

    def _next_reads(self, controller, step, layer, experts, at):
        """[(layer, experts, times)]: the next read of experts read at clock
        `at` (step, layer); NO_NEXT_USE = never again in the trace."""
        steps_of = self._steps_of[layer] if layer < len(self._steps_of) else {}
        times = []
        for e in experts:
            steps = steps_of.get(int(e), ())
            i = bisect.bisect_right(steps, step)
            times.append(at + (steps[i] - step) * controller.num_layers if i < len(steps) else NO_NEXT_USE)
        return [(layer, experts, times)]

    def _flush(self, controller):
        hints, self._hints = self._hints, []
        if not hints:
            return
        table = controller.prefetcher
        ids = np.concatenate([table.tensor_ids(layer, experts) for layer, experts, _ in hints])
        when = np.concatenate([np.asarray(t, dtype=np.int64) if isinstance(t, list)
                               else np.full(len(experts), t, dtype=np.int64) for _, experts, t in hints])
        controller.handle.hint_next_use(ids, when, now=controller.clock)


# ------------------------------------------------------------------ controller


class OffloadController:
    """Owns the engine, the (layer, expert) mapping, the predictor and the
    accounting for one offloaded model."""

    def __init__(self, handle: PrefetchHandle, *, num_layers: int, num_experts: int, top_k: int,
                 predictor: RoutePredictor | None = None, routers=None, record_trace: bool = False,
                 device: torch.device | None = None):
        self.handle = handle
        self.prefetcher = ExpertPrefetcher(handle)
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.top_k = top_k
        self.predictor = predictor
        self.routers = routers or []
        self.device = device
        self.step = 0
        self.clock = -1  # routing calls so far, minus one: never goes back (hint_next_use)
        self._seen_layer0 = False  # a second layer-0 routing starts a new step
        self.trace = RoutingTrace(num_layers, num_experts) if record_trace else None
        self._pending: dict[tuple[int, int], set[int]] = {}  # (step, layer) -> predicted
        self.prediction_hits = 0
        self.predicted_total = 0
        self.actual_total = 0

    # -- called by the offloaded modules

    def router_logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        router = self.routers[layer]
        out = router(hidden)
        if isinstance(out, tuple):  # HF routers return (logits, weights, indices)
            out = out[0]
        return out

    def on_routed(self, layer: int, hidden: torch.Tensor, experts: list[int]) -> None:
        """Layer `layer` chose `experts`: score earlier predictions for it,
        record the trace, and prefetch what later layers will need."""
        self.clock += 1
        if layer == 0:
            if self._seen_layer0:
                self.step += 1
            self._seen_layer0 = True
        key = (self.step, layer)
        predicted = self._pending.pop(key, None)
        if predicted is not None:
            actual = set(experts)
            self.prediction_hits += len(predicted & actual)
            self.predicted_total += len(predicted)
            self.actual_total += len(actual)
        if self.trace is not None:
            self.trace.add(self.step, layer, experts)
        if self.predictor is None:
            return
        self.predictor.observe(self, self.step, layer, experts)
        for target, guess in self.predictor.predict(self, self.step, layer, hidden).items():
            if not guess:
                continue
            distance = (target - layer) % self.num_layers or self.num_layers
            self.prefetcher.prefetch_experts_list(target, guess, priority=min(19, max(1, distance)))
            target_step = self.step + (1 if target <= layer else 0)
            self._pending.setdefault((target_step, target), set()).update(guess)

    def new_sequence(self) -> None:
        """Call between requests: resets the step counter and lets a learning
        predictor file the finished request."""
        if hasattr(self.predictor, "end_request"):
            self.predictor.end_request()
        self.step = 0
        self._seen_layer0 = False
        self._pending.clear()

    # -- reporting

    def report(self) -> dict:
        s = self.handle.stats()
        acquired = s["hits"] + s["misses"]
        return {
            "hit_rate": s["hits"] / acquired if acquired else None,
            "prediction_precision": self.prediction_hits / self.predicted_total if self.predicted_total else None,
            "prediction_recall": self.prediction_hits / self.actual_total if self.actual_total else None,
            "bytes_copied": s["bytes_copied"],
            "copies": s["copies"],
            "evictions": s["evictions"],
            "wasted": s["wasted"],
            "late": s["late"],
        }

    def close(self) -> None:
        self.handle.close()


def _acquire_stream(tensor: torch.Tensor):
    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


class OffloadedExperts(nn.Module):
    """Drop-in for a transformers 5 `*Experts` module (stacked gate_up_proj /
    down_proj, concatenated gate|up, no bias). Same forward signature and the
    same arithmetic as the eager implementation, with each expert's weights
    acquired from the device cache for the duration of the call."""

    def __init__(self, controller: OffloadController, layer: int, act_fn, num_experts: int):
        super().__init__()
        self.controller = controller
        self.layer = layer
        self.act_fn = act_fn
        self.num_experts = num_experts

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        final_hidden_states = torch.zeros_like(hidden_states)
        with torch.no_grad():
            expert_mask = torch.nn.functional.one_hot(top_k_index, num_classes=self.num_experts)
            expert_mask = expert_mask.permute(2, 1, 0)
            expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()
        experts = [int(e) for e in expert_hit[:, 0].tolist() if int(e) != self.num_experts]
        self.controller.on_routed(self.layer, hidden_states, experts)
        if not experts:
            return final_hidden_states
        stream = _acquire_stream(hidden_states)
        pf = self.controller.prefetcher
        weights = pf.acquire_experts(self.layer, experts, stream=stream)
        try:
            for expert_idx, w in zip(experts, weights):
                top_k_pos, token_idx = torch.where(expert_mask[expert_idx])
                current_state = hidden_states[token_idx]
                gate, up = nn.functional.linear(current_state, w["gate_up_proj"]).chunk(2, dim=-1)
                current_hidden_states = self.act_fn(gate) * up
                current_hidden_states = nn.functional.linear(current_hidden_states, w["down_proj"])
                current_hidden_states = current_hidden_states * top_k_weights[token_idx, top_k_pos, None]
                final_hidden_states.index_add_(0, token_idx, current_hidden_states.to(final_hidden_states.dtype))
        finally:
            pf.release_experts(self.layer, experts, stream=stream)
        return final_hidden_states


class OffloadedMoEBlock(nn.Module):
    """The generic path: a router and a list of expert modules of one
    architecture. Routing: softmax over the router's logits, top-k, optional
    renormalisation of the k weights. Expert weights live in the engine; the
    expert modules stay as templates whose parameters are swapped for cache
    views with torch.func.functional_call."""

    def __init__(self, router: nn.Module, experts, top_k: int, *, normalize: bool = True):
        super().__init__()
        if not experts:
            raise ValueError("an MoE block needs at least one expert")
        if top_k < 1 or top_k > len(experts):
            raise ValueError(f"top_k must be in 1..{len(experts)}")
        self.router = router
        self.top_k = top_k
        self.normalize = normalize
        self.num_experts = len(experts)
        # Templates: structure only; parameters are replaced at call time.
        self._template = experts[0]
        self._names = [n for n, _ in experts[0].named_parameters()]
        for e in experts[1:]:
            if [n for n, _ in e.named_parameters()] != self._names:
                raise ValueError("all experts of a block must have the same parameters")
        self._experts_cpu = [{n: p.detach().to("cpu") for n, p in e.named_parameters()} for e in experts]
        self.controller: OffloadController | None = None
        self.layer = -1

    def attach(self, controller: OffloadController, layer: int) -> None:
        for expert_id, params in enumerate(self._experts_cpu):
            controller.prefetcher.register_expert(layer, expert_id, params)
        self._experts_cpu = None  # the engine holds the bytes now
        # The template's own parameters are not used for compute: free them.
        for p in list(self._template.parameters()):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.controller = controller
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.controller is None:
            raise RuntimeError("OffloadedMoEBlock is not attached: call offload_moe_experts on the model")
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        logits = self.router(h)
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(h.dtype)
        experts = sorted(set(top_i.flatten().tolist()))
        self.controller.on_routed(self.layer, h, experts)
        stream = _acquire_stream(h)
        pf = self.controller.prefetcher
        weights = pf.acquire_experts(self.layer, experts, stream=stream)
        out = torch.zeros_like(h)
        try:
            for expert_idx, w in zip(experts, weights):
                token_idx, pos = torch.where(top_i == expert_idx)
                y = torch.func.functional_call(self._template, w, (h[token_idx],))
                out.index_add_(0, token_idx, (y * top_w[token_idx, pos, None]).to(out.dtype))
        finally:
            pf.release_experts(self.layer, experts, stream=stream)
        return out.reshape(shape)


def find_hf_moe_blocks(model: nn.Module):
    """(block, experts_module, router) for each transformers-5 MoE block, in
    module order: a module with `.experts` holding 3-D `gate_up_proj` and
    `down_proj` parameters and a `.gate` router."""
    found = []
    for module in model.modules():
        experts = getattr(module, "experts", None)
        router = getattr(module, "gate", None)
        if experts is None or router is None or isinstance(experts, OffloadedExperts):
            continue
        gu = getattr(experts, "gate_up_proj", None)
        dp = getattr(experts, "down_proj", None)
        if isinstance(gu, torch.Tensor) and isinstance(dp, torch.Tensor) and gu.dim() == 3 and dp.dim() == 3:
            layout_ok = (
                not getattr(experts, "has_bias", False)
                and not getattr(experts, "is_transposed", False)
                and getattr(experts, "is_concatenated", True)
                and getattr(experts, "has_gate", True)
            )
            if not layout_ok:
                raise NotImplementedError(
                    f"{type(experts).__name__}: only concatenated gate|up, untransposed, bias-free expert "
                    "weights are supported (this layout is not)"
                )
            found.append((module, experts, router))
    return found


def offload_moe_experts(
    model: nn.Module,
    *,
    device_budget_bytes: int,
    backend: str = "auto",
    predictor: RoutePredictor | None = None,
    handle_options: dict | None = None,
    record_trace: bool = False,
    progress: bool = True,
) -> OffloadController:
    """Moves every MoE expert of `model` into the engine (page-locked host
    memory on CUDA) and rewires the MoE blocks to acquire their routed
    experts from a device cache of `device_budget_bytes`. The model's other
    weights stay where they are (put the model on its device first).
    `handle_options` go to PrefetchHandle; the eviction policy defaults to
    "cyclic" (each MoE block acquires once per forward, layers in a fixed
    order: Note [Cyclic eviction]). Returns the controller; the model is
    modified in place."""
    hf_blocks = find_hf_moe_blocks(model)
    generic = [m for m in model.modules() if isinstance(m, OffloadedMoEBlock)]
    if not hf_blocks and not generic:
        raise ValueError(
            "no MoE block found: expected transformers-5 *Experts modules (gate_up_proj/down_proj) "
            "or OffloadedMoEBlock instances"
        )
    if hf_blocks and generic:
        raise ValueError("a model mixing transformers MoE blocks and OffloadedMoEBlock is not supported")
    options = {"eviction_policy": "cyclic", **(handle_options or {})}
    handle = PrefetchHandle(device_budget_bytes=device_budget_bytes, backend=backend, **options)
    try:
        if hf_blocks:
            num_experts = hf_blocks[0][1].gate_up_proj.shape[0]
            top_k = getattr(hf_blocks[0][2], "top_k", None) or getattr(model.config, "num_experts_per_tok", 1)
            routers = [router for _, _, router in hf_blocks]
            controller = OffloadController(handle, num_layers=len(hf_blocks), num_experts=num_experts, top_k=top_k,
                                           predictor=predictor, routers=routers, record_trace=record_trace)
            total = sum(e.gate_up_proj.numel() * e.gate_up_proj.element_size()
                        + e.down_proj.numel() * e.down_proj.element_size() for _, e, _ in hf_blocks)
            done = 0
            for layer, (block, experts, _) in enumerate(hf_blocks):
                gate_up = experts.gate_up_proj.detach()
                down = experts.down_proj.detach()
                for e in range(gate_up.shape[0]):
                    controller.prefetcher.register_expert(
                        layer, e, {"gate_up_proj": gate_up[e].to("cpu"), "down_proj": down[e].to("cpu")})
                done += gate_up.numel() * gate_up.element_size() + down.numel() * down.element_size()
                block.experts = OffloadedExperts(controller, layer, experts.act_fn, gate_up.shape[0])
                if progress and total >= (1 << 30):
                    print(f"prefetch: offloaded {done / 2**30:.1f} of {total / 2**30:.1f} GiB of experts",
                          flush=True)
        else:
            num_experts = generic[0].num_experts
            controller = OffloadController(handle, num_layers=len(generic), num_experts=num_experts,
                                           top_k=generic[0].top_k, predictor=predictor,
                                           routers=[b.router for b in generic], record_trace=record_trace)
            for layer, block in enumerate(generic):
                block.attach(controller, layer)
    except BaseException:
        handle.close()
        raise
    return controller


def belady_misses(trace: RoutingTrace, capacity: int, start_step: int = 0) -> int:
    """Fewest expert loads any cache of `capacity` experts needs to serve
    `trace` (Belady's MIN: evict the expert used furthest in the future);
    the floor for bytes that had to move. Loads before `start_step` (a
    warm-up) are not counted, though the cache fills during them."""
    if capacity < 1:
        raise ValueError("capacity must be >= 1 expert")
    seq = []
    first_counted = None
    for s, step in enumerate(trace.steps):
        if s == start_step:
            first_counted = len(seq)
        seq.extend((layer, e) for layer, experts in enumerate(step) for e in experts)
    if first_counted is None:
        first_counted = len(seq)
    next_use = [0] * len(seq)
    last = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = last.get(seq[i], float("inf"))
        last[seq[i]] = i
    cache: dict = {}
    misses = 0
    heap: list = []
    for i, key in enumerate(seq):
        if key in cache:
            cache[key] = next_use[i]
            heapq.heappush(heap, (-next_use[i], key))
            continue
        if i >= first_counted:
            misses += 1
        if len(cache) >= capacity:
            while True:
                neg, victim = heapq.heappop(heap)
                if victim in cache and cache[victim] == -neg:
                    del cache[victim]
                    break
        cache[key] = next_use[i]
        heapq.heappush(heap, (-next_use[i], key))
    return misses

