"""Offload the experts of a PyTorch MoE model onto the prefetch engine.

    controller = prefetch.offload_moe_experts(model, device_budget_bytes=8 << 30,
                                              predictor=NextLayerGatePredictor())
    out = model.generate(...)          # experts come from the device cache
    controller.report()                # hit rate, prediction accuracy, bytes moved, host time
    controller.close()

Two kinds of MoE block are handled:

- Hugging Face transformers 5 families whose experts live in one `*Experts`
  module with stacked `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I]
  parameters dispatched through transformers' experts-implementation
  interface: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V3 and their
  relatives. The module stays; its weights move to the engine and each call
  runs the model's own experts implementation (grouped_mm, batched_mm,
  eager, ...) on views of the device cache (prefetch/hf_experts.py, Note [Experts
  on cache slots]).
- A user-defined block, `OffloadedMoEBlock(router, experts, top_k)`: a router
  (a module mapping hidden states to expert logits) and a list of expert
  modules of one architecture; softmax, top-k and optional renormalisation.

While layer L routes, the controller asks its predictor which experts later
layers will need and queues them, band = distance in layers (1 = next).

The pieces live in their own modules; this one keeps the names importable
from one place: prefetch.trace (RoutingTrace, belady_misses),
prefetch.predictors, prefetch.controller (OffloadController), prefetch.hf
(the transformers adapter).
"""
from __future__ import annotations

import functools

import numpy as np
import torch
from torch import nn

from prefetch._engine import PrefetchHandle
from prefetch.controller import OffloadController, check_predictor
from prefetch.errors import InvalidArgumentError
from prefetch.expert_prefetcher import cache_slot_bytes, expert_layout
from prefetch.hf import (
    HostExperts,
    find_hf_moe_blocks,
    install_experts_backend,
    offload_hf_model,
    offloaded_experts,
)
from prefetch.hf_blocks import routed_top_k
from prefetch.hf_guards import NoBackward
from prefetch.history_predictor import HistoryPredictor
from prefetch.predictors import NextLayerGatePredictor, OraclePredictor, RoutePredictor, TracePredictor
from prefetch.read_back import to_host
from prefetch.trace import RoutingTrace, belady_misses

__all__ = [
    "OffloadController",
    "OffloadedMoEBlock",
    "RoutePredictor",
    "NextLayerGatePredictor",
    "TracePredictor",
    "HistoryPredictor",
    "OraclePredictor",
    "RoutingTrace",
    "belady_misses",
    "offload_moe_experts",
    "offloaded_experts",
    "find_hf_moe_blocks",
    "install_experts_backend",
    "HostExperts",
]


def _acquire_stream(tensor: torch.Tensor):
    return torch.cuda.current_stream(tensor.device) if tensor.is_cuda else None


def _parameter_shapes(module: nn.Module) -> list:
    """[(name, shape)] of a module's parameters, in order."""
    return [(n, tuple(p.shape)) for n, p in module.named_parameters()]


class OffloadedMoEBlock(nn.Module):
    """The generic path: a router and a list of expert modules of one
    architecture. Routing: softmax over the router's logits, top-k, optional
    renormalisation of the k weights. Expert weights live in the engine; the
    expert modules stay as templates whose parameters are swapped for cache
    views with torch.func.functional_call."""

    def __init__(self, router: nn.Module, experts, top_k: int, *, normalize: bool = True):
        super().__init__()
        if not experts:
            raise InvalidArgumentError("an MoE block needs at least one expert")
        if top_k < 1 or top_k > len(experts):
            raise InvalidArgumentError(f"top_k must be in 1..{len(experts)}")
        self.router = router
        self.top_k = top_k
        self.normalize = normalize
        self.num_experts = len(experts)
        # Templates: structure only; parameters are replaced at call time.
        self._template = experts[0]
        self._shapes = _parameter_shapes(experts[0])
        for e in experts[1:]:
            if _parameter_shapes(e) != self._shapes:
                raise InvalidArgumentError("all experts of a block must have the same parameters (names and shapes)")
        # The experts' weights are read when the block is offloaded (attach),
        # so a load into the expert modules after building the block and
        # before offloading it is what the engine holds. A tuple: not
        # submodules (only the template is), so the block's state_dict and
        # model.to(...) see the template alone, as before.
        self._experts = tuple(experts)
        self.controller: OffloadController | None = None
        self.layer = -1

    def capacity(self, budget: int) -> int:
        """How many of this block's experts a cache of `budget` bytes holds
        at once (0: not one)."""
        return budget // self._slot_bytes()

    def _slot_bytes(self) -> int:
        """The cache slot of one expert, from the template's shapes and
        dtypes wherever it is (a model moved to a GPU before offloading);
        after offloading, the slot it was offloaded with (the template's
        parameters are freed then)."""
        if self.controller is not None:
            return self._slot
        # expert_layout reads CPU tensors: zero-stride ones of the same
        # shapes and dtypes, one element each.
        shapes = {n: torch.empty_strided(tuple(p.shape), (0,) * p.dim(), dtype=p.dtype)
                  for n, p in self._template.named_parameters()}
        layout = expert_layout(shapes)
        return cache_slot_bytes(layout[-1].offset + layout[-1].nbytes)

    def _host_weights(self, layer: int) -> list[dict]:
        """Each expert's weights as they are now, on the host, in the dtypes
        of the template: a model.to(dtype) shows in the template only (the
        other experts are not submodules), and the registered weights follow
        it, so "convert before offloading" holds for these blocks too.
        After _check_experts."""
        dtypes = {n: p.dtype for n, p in self._template.named_parameters()}
        return [{n: p.detach().to("cpu", dtype=dtypes[n]) for n, p in expert.named_parameters()}
                for expert in self._experts]

    def _check_experts(self, layer: int) -> None:
        """Every expert still has the parameters, names and shapes, that
        the block was built with: the slots are sized from expert 0's."""
        for expert_id, expert in enumerate(self._experts):
            shapes = _parameter_shapes(expert)
            if shapes != self._shapes:
                raise InvalidArgumentError(f"expert {expert_id} of MoE layer {layer} has the parameters {shapes}, not "
                                           f"those the block was built with ({self._shapes})")

    def _attach(self, controller: OffloadController, layer: int) -> None:
        """The block's own change, made once every block's experts are
        registered (nothing here can fail on the model's input)."""
        self._slot = self._slot_bytes()
        # As many experts as fit in the budget are acquired at once (at least
        # one: offload_moe_experts refused smaller budgets); a call routed to
        # more runs in pieces (forward).
        self._capacity = controller.handle.budget_bytes(0) // self._slot
        self._experts = ()  # the engine holds the bytes now
        # The dtype the engine holds the experts in: a later model.to(dtype)
        # shows in the template (its device does not matter: the weights are
        # the cache's, wherever the template is).
        first = self._shapes[0][0]
        self._packed_dtype = self._template.get_parameter(first).dtype
        # Where that parameter lives, looked up once (forward reads it each
        # time, as prefetch/hf_experts.py reads its experts module's _parameters).
        owner, _, leaf = first.rpartition(".")
        self._probe = (self._template.get_submodule(owner)._parameters, leaf)
        # The template's own parameters are not used for compute: free them.
        for p in list(self._template.parameters()):
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        self.controller = controller
        self.layer = layer

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.controller is None:
            raise RuntimeError("OffloadedMoEBlock is not attached: call offload_moe_experts on the model")
        if self.layer == 0:  # a model.to(...) converts every block: one look a forward
            params, leaf = self._probe
            dtype = params[leaf].dtype
            if dtype is not self._packed_dtype:
                raise RuntimeError(
                    f"MoE layer 0: the model was converted to {dtype} after offload_moe_experts, but its "
                    f"offloaded experts were registered as {self._packed_dtype} and stay so: convert the model "
                    "(model.to(...)) before offloading it")
        # Note [No backward through the cache]; the router's weights count
        # as the routing weights do in prefetch/hf_experts.py.
        if torch.is_grad_enabled():
            training = [p for p in self.router.parameters() if p.requires_grad]
            if hidden_states.requires_grad or training:  # the output needs a gradient: its backward raises
                return NoBackward.apply(lambda h, *_: self._forward(h), hidden_states, *training)
        return self._forward(hidden_states)

    def _forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        h = hidden_states.reshape(-1, shape[-1])
        logits = self.router(h)
        probs = torch.softmax(logits.float(), dim=-1)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        top_w = top_w.to(h.dtype)
        ctl = self.controller
        stream = _acquire_stream(h)
        # One engine call: the last block's experts released, this block's
        # acquired (held until the next block's call; the last block
        # releases), the predictor's guesses queued. A call routed to more
        # experts than the cache holds runs in pieces, in expert order as
        # one call would: each later piece's call releases the piece before,
        # whose compute is queued by then.
        cap = self._capacity
        # The last block's guesses and hints, while the GPU runs this block's
        # attention and router, before the routing read-back waits for them
        # (Note [Speculation after launch]); their engine call is this
        # block's (Note [Speculation rides on the next acquire]). The
        # routing is read back whole and made distinct on the host: on the
        # GPU, unique() waits for it first, in a pageable copy of its length
        # (Note [No hidden sync in the routing] in bench/lib/e2e_decoder.py).
        ctl.speculate(with_next_acquire=True)
        routing = to_host(top_i)
        experts, where = ctl.route_and_acquire(self.layer, h, routing, stream=stream, first=cap)
        # Each expert's (token, k) pairs without a wait per expert (torch.where
        # reads its count back): the routing's flat positions sorted by expert,
        # stably, so each expert's come in torch.where's order (token, then
        # k), cut at counts the host has from the read-back.
        order = torch.argsort(top_i.reshape(-1), stable=True)
        tokens_all, pos_all = order // self.top_k, order % self.top_k
        # Expert e's positions: order[bounds[e] : bounds[e + 1]].
        bounds = [0, *np.cumsum(np.bincount(routing, minlength=self.num_experts)).tolist()]
        out = torch.zeros_like(h)
        try:
            for start in range(0, experts.shape[0], cap):
                piece = experts[start : start + cap]
                if start:
                    where = ctl.acquire_more(self.layer, piece, stream=stream)
                weights = ctl.prefetcher.weights_in_slots(ctl.ids(self.layer, piece), where)
                for expert_idx, w in zip(piece.tolist(), weights):
                    begin, end = bounds[expert_idx], bounds[expert_idx + 1]
                    token_idx, pos = tokens_all[begin:end], pos_all[begin:end]
                    y = torch.func.functional_call(self._template, w, (h[token_idx],))
                    out.index_add_(0, token_idx, (y * top_w[token_idx, pos, None]).to(out.dtype))
        except BaseException:
            ctl.release_held(stream)
            raise
        if self.layer == ctl.num_layers - 1:
            ctl.release_held(stream)
            # The next block's call is the next step's first, after the
            # token's read-back: this block's guesses (for the next step's
            # first layers) go now, behind its queued compute.
            ctl.speculate()
        return out.reshape(shape)



def _transformers_said() -> str:
    """Which transformers is installed, against the tested range."""
    import sys

    from prefetch.hf_blocks import TRANSFORMERS_TESTED

    module = sys.modules.get("transformers")
    have = f"transformers {module.__version__} is installed" if module is not None else "transformers is not loaded"
    return f"{have}; prefetch supports {TRANSFORMERS_TESTED[0]} to {TRANSFORMERS_TESTED[1]}"


def _check_offload(hf_blocks, generic, sync_free, process_group, expert_placement, activation_counts,
                   bad_checkpoint: bool = False) -> None:
    """offload_moe_experts' checks that need no engine: what was found in
    the model and the options that go with it (`bad_checkpoint`: checkpoint
    given with host_experts, or for a model of OffloadedMoEBlocks)."""
    if bad_checkpoint:
        raise InvalidArgumentError(
            "checkpoint= reads a transformers model's experts into a new host copy: not with "
            "host_experts=, and not for OffloadedMoEBlock models (their experts are registered from "
            "the modules)")
    if any(b.controller is not None for b in generic):
        raise InvalidArgumentError("this model's OffloadedMoEBlocks are already attached to a controller; offload a "
                                   "model once (close the controller and build the model again to change the budget)")
    if not hf_blocks and not generic:
        raise InvalidArgumentError(
            f"no MoE block found: expected transformers experts modules dispatched through its "
            f"experts-implementation interface (use_experts_implementation; {_transformers_said()}), or "
            "OffloadedMoEBlock instances")
    if hf_blocks and generic:
        raise InvalidArgumentError("a model mixing transformers MoE blocks and OffloadedMoEBlock is not supported")
    if sync_free is not None and not isinstance(sync_free, (bool, np.bool_)):  # 1 == True: not by ==
        raise TypeError(f"sync_free must be None, True or False, got {sync_free!r}")
    if sync_free and generic:
        raise InvalidArgumentError(
            "sync_free=True needs transformers MoE blocks (OffloadedMoEBlock routes on the host)")
    if process_group is None and (expert_placement != "balanced" or activation_counts is not None):
        raise InvalidArgumentError("expert_placement and activation_counts need a process_group")
    if process_group is not None and generic:
        raise NotImplementedError("expert parallel (process_group) supports transformers MoE blocks only, not "
                                  "OffloadedMoEBlock")


def offload_moe_experts(
    model: nn.Module,
    *,
    device_budget_bytes: int,
    backend: str = "auto",
    predictor: RoutePredictor | None = None,
    handle_options: dict | None = None,
    record_trace: bool = False,
    progress: bool = True,
    host_experts=None,
    process_group=None,
    expert_placement: str = "balanced",
    activation_counts=None,
    sync_free: bool | None = None,
    checkpoint=None,
    host_budget_bytes: int | None = None,
    preload: bool | None = None,
) -> OffloadController:
    """Moves every MoE expert of `model` into the engine (page-locked host
    memory on CUDA) and rewires the MoE blocks to acquire their routed
    experts from a device cache of `device_budget_bytes`. The model's other
    weights stay where they are (put the model on its device first).

    Arguments, in short (each is described in full below):
      device_budget_bytes: bytes of device memory for the expert cache.
      backend: "auto" (CUDA where there is a GPU, else the host backend),
        "cuda", or "host" (copies into host memory: the CPU, and tests).
      predictor: what to prefetch while a layer runs, or None for on-demand
        only. prefetch.NextLayerGatePredictor (the next layers' routers on
        this layer's input), prefetch.TracePredictor (past requests'
        expert activations), prefetch.OraclePredictor (a recorded
        RoutingTrace: a benchmark's upper bound), or any
        prefetch.RoutePredictor. Assign controller.predictor to change it.
      handle_options: options of the PrefetchHandle made here.
      record_trace: record each step's routed experts (controller.trace, a
        RoutingTrace), for an OraclePredictor or a trace file.
      progress: print how far packing is on models with over 1 GiB of experts.
      host_experts, sync_free, checkpoint, host_budget_bytes, preload,
        process_group, expert_placement, activation_counts: below.

    `handle_options` go to PrefetchHandle; the eviction policy defaults to
    "cyclic" (each MoE block acquires once per forward, layers in a fixed
    order: Note [Cyclic eviction]). A budget smaller than what one call
    routes to is fine (the layer runs in pieces); one expert larger than the
    whole budget is refused with InvalidArgumentError. Returns the controller; the
    model is modified in place, and offloading it a second time is refused.
    transformers models: the experts are packed once into page-locked host
    memory (``controller.host_experts``, see prefetch.hf.HostExperts); pass
    that as `host_experts` to offload another copy of the same model without
    packing again. `progress` prints how far packing is on models with more
    than 1 GiB of experts.

    Expert parallel (transformers models): with a torch.distributed
    `process_group`, every MoE layer's experts are partitioned over its
    ranks (`expert_placement`: "balanced", contiguous blocks of equal bytes,
    or "activations", the same block sizes balanced by `activation_counts`,
    a [layers, experts] array or a RoutingTrace); this rank registers,
    packs and caches only its own, `device_budget_bytes` being this rank's
    cache, and each layer's output is summed over the group with one
    all-reduce. Call it on every rank with the same model and arguments;
    the ranks check that with one all_gather (Note [Expert parallel] in
    prefetch/expert_parallel.py).

    `sync_free` (transformers models): decode steps run without waiting for
    the routing on the host; an expert not in the cache is read by the GPU
    from page-locked host memory and prefetched for the next step (Note
    [Sync-free decode] in prefetch/host_experts.py). None (default): on
    where it can run (batched_mm calls of at most 64 rows, each rank of a
    process group on its own experts), each step choosing its path from
    the last step's misses (Note [Which path a step takes]); a predictor
    that guesses on the device guesses on the synced steps only. True
    insists (ValueError where it cannot run); False keeps every layer on
    the path that reads the routing first.

    `checkpoint` (transformers models; not with `host_experts`): the
    model's safetensors folder (or index_checkpoint's dict); the experts
    are read from there into the page-locked host copy, not from the model,
    whose expert weights may be on the meta device (Note [Experts from the
    checkpoint] in prefetch/checkpoint_experts.py). With
    `host_budget_bytes` as well, nothing is read up front: the experts stay
    in the checkpoint's files and the engine reads each one when it is
    first copied, through a page-locked host tier of that many bytes with
    its own eviction (Note [Experts on disk]; Note [Host tier] in
    src_cpp/archer_prefetch_handle.h), so host memory holds at most that
    much of them; the sync-free path, which reads missing experts from a
    full host copy, is off.

    `preload` (Note [Preload] in prefetch/offload/preload.py): True queues, at
    the least urgent band, as many experts as the cache holds (all of them
    where they fit, else the first ones of every layer in turn), so the
    first tokens find them cached; the copies run in the background. None
    (default): only where every expert fits (then each would be copied on
    its first use anyway, and none is ever evicted), and not from a
    checkpoint's files through a host tier. False: the cache starts
    empty."""
    if preload is not None and not isinstance(preload, (bool, np.bool_)):
        raise TypeError(f"preload must be True, False or None, not {preload!r}")
    check_predictor(predictor)  # before the model or an engine is touched
    hf_blocks = find_hf_moe_blocks(model)
    generic = [m for m in model.modules() if isinstance(m, OffloadedMoEBlock)]
    _check_offload(hf_blocks, generic, sync_free, process_group, expert_placement, activation_counts,
                   checkpoint is not None and (host_experts is not None or not hf_blocks))
    ep = None
    if process_group is not None:
        from prefetch.expert_parallel import setup_expert_parallel

        top_k = routed_top_k(model, hf_blocks)
        ep = setup_expert_parallel(process_group, hf_blocks, top_k=top_k, placement=expert_placement,
                                   counts=activation_counts)
    options = layer_handle_options(len(hf_blocks) or len(generic), handle_options)
    if host_budget_bytes is not None:
        if checkpoint is None:
            raise InvalidArgumentError(
                "host_budget_bytes is the host tier of experts left on disk: it needs checkpoint=")
        options["host_budget_bytes"] = host_budget_bytes
    handle = PrefetchHandle(device_budget_bytes=device_budget_bytes, backend=backend, **options)
    try:
        if hf_blocks:
            controller = offload_hf_model(model, hf_blocks, handle, predictor=predictor, record_trace=record_trace,
                                          progress=progress, host_experts=host_experts, ep=ep,
                                          sync_free=sync_free, checkpoint=checkpoint)
            slots = controller.read_ahead_slots
        else:
            slots = generic[0].capacity(handle.budget_bytes(0))  # before attach, which frees the templates
            controller = _offload_generic(generic, handle, predictor, record_trace)
            controller.cache_slots = slots  # Note [Host-routed step pins]
    except BaseException:
        handle.close()
        raise
    _serialize_forwards(model, controller)
    if preload or (preload is None and host_budget_bytes is None):
        controller.preload(slots, only_if_all=preload is None)
    return controller


def _serialize_forwards(model: nn.Module, controller: OffloadController) -> None:
    """Note [One forward at a time]
    An offloaded model's MoE layers share one controller, whose state runs
    across the layers of a forward: the pins one layer's call holds until
    the next layer's call releases them, each layer's slot map, the
    routings read back at the next step's first layer. Two threads calling
    the model at once interleaved those (a review, tiny OLMoE at 3 experts a
    layer): one thread's pins were overwritten before their release and
    stayed pinned for good, the other thread's acquires then waited out the
    60 s timeout, and every later request failed the same way. So the
    model's forward runs under the controller's lock (an RLock: a forward
    may call the model again), as do the controller's public calls
    (`report`, `trace`, `flush`, `new_sequence`, `preload`, `close`,
    assigning `predictor`): concurrent `generate` calls on one offloaded
    model take turns a forward (a token) at a time, each with its own
    tokens; the controller's figures and any trace then mix the requests,
    and a predictor that follows one request (the oracle) sees both. A
    submodule called directly, not through the model's forward, is not
    covered: call the model. For requests in parallel, offload a copy per
    thread (they can share the packed host experts, `host_experts=`)."""
    inner = model.forward
    while getattr(inner, "_prefetch_lock", None) is not None:  # an earlier offload's (restored since): not nested
        inner = inner.__wrapped__
    lock = controller.forward_lock

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        with lock:
            return inner(*args, **kwargs)

    forward._prefetch_lock = lock
    model.forward = forward


def layer_handle_options(num_layers: int, handle_options: dict | None = None) -> dict:
    """PrefetchHandle options for a model of `num_layers` MoE layers that
    acquire once each per step: `handle_options` over the default "cyclic"
    eviction, whose cycle is then the layer count (Note [Cyclic eviction]),
    as is "decay"'s step (Note [Decayed-frequency eviction])."""
    options = {"eviction_policy": "cyclic", **(handle_options or {})}
    if options["eviction_policy"] in ("cyclic", "decay"):
        options.setdefault("cycle_acquires", num_layers)
    return options


def _offload_generic(generic, handle, predictor, record_trace) -> OffloadController:
    """offload_moe_experts for a model of OffloadedMoEBlocks: one controller,
    each block attached; a block whose expert does not fit in the budget is
    refused before any block changes."""
    counts = [block.num_experts for block in generic]
    if len(set(counts)) > 1:
        raise NotImplementedError(f"MoE layers with different numbers of experts are not supported (experts per "
                                  f"layer: {counts})")
    small = [layer for layer, block in enumerate(generic) if block.capacity(handle.budget_bytes(0)) < 1]
    if small:
        raise InvalidArgumentError(f"device_budget_bytes={handle.budget_bytes(0)} is smaller than one expert of MoE "
                                   f"layer(s) {small}")
    controller = OffloadController(handle, num_layers=len(generic), num_experts=generic[0].num_experts,
                                   top_k=generic[0].top_k, predictor=predictor,
                                   routers=[b.router for b in generic], record_trace=record_trace)
    # Check, then read and register a block at a time (one block's host
    # copies at once: a model on a GPU or converted before offloading copies
    # its experts here), then change the blocks: a failure before the last
    # step (an expert changed since the block was built, host memory) leaves
    # every block as it was, to be offloaded again.
    for layer, block in enumerate(generic):
        block._check_experts(layer)
    for layer, block in enumerate(generic):
        for expert_id, params in enumerate(block._host_weights(layer)):
            controller.prefetcher.register_expert(layer, expert_id, params)
    for layer, block in enumerate(generic):
        block._attach(controller, layer)
    return controller
