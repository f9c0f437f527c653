"""transformers adapter: offload_hf_model assembles an offloaded model from
its parts (Note [Experts on their own module] in prefetch/hf_blocks.py:
which modules, what an expert is made of): the packed host copy
(prefetch/host_experts.py) or the checkpoint's extents
(prefetch/checkpoint_experts.py) registered with the engine, one
ExpertsOffload per layer (prefetch/hf_experts.py, Note [Experts on cache
slots]), this rank's share with expert parallel
(prefetch/expert_parallel.py), the sync-free path, and the modules
rewired to go through the wrappers.
"""
from __future__ import annotations

import torch

from prefetch.checkpoint_experts import register_from_disk
from prefetch.controller import OffloadController
from prefetch.errors import InvalidArgumentError
from prefetch.hf_blocks import (
    OFFLOAD_ATTR,
    ExpertsLayout,
    experts_names,
    find_hf_moe_blocks,
    install_experts_backend,
    model_device,
    offloaded_experts,
    routed_top_k,
)
from prefetch.hf_experts import ExpertsOffload
from prefetch.hf_guards import refuse_empty_state
from prefetch.host_experts import HostExperts, StepRows, Universe

__all__ = ["install_experts_backend", "find_hf_moe_blocks", "offload_hf_model", "ExpertsOffload",
           "offloaded_experts", "HostExperts"]


def offload_hf_model(model, hf_blocks, handle, *, predictor=None, record_trace=False, progress=True,
                     host_experts: HostExperts | None = None, ep=None, sync_free: bool | None = None,
                     sync_free_max_rows: int = 64, checkpoint=None) -> OffloadController:
    """Registers every expert of `hf_blocks` (from find_hf_moe_blocks) with
    the engine, zero-copy from a HostExperts (made here unless given), and
    attaches an ExpertsOffload to each experts module; its weights are
    replaced by empty tensors. Nothing changes in the model before every
    expert is registered. With `ep` (an ExpertParallel), only this rank's
    experts are packed and registered. With `checkpoint` the experts are
    read from its safetensors shards, not from the modules (which may be on
    the meta device; the model's device is then its routers')."""
    install_experts_backend()
    layout = ExpertsLayout(hf_blocks[0][1])  # find_hf_moe_blocks checked that every layer has this one
    num_experts = layout.num_experts
    top_k = routed_top_k(model, hf_blocks)
    budget = handle.budget_bytes(0)
    if layout.expert_bytes > budget:
        raise InvalidArgumentError(
            f"device_budget_bytes={budget} is smaller than one expert ({layout.expert_bytes} bytes: "
            f"{layout.describe()})")
    device = model_device(hf_blocks)
    if ep is not None and handle.backend == "cuda" and device != torch.device("cuda", 0):
        raise InvalidArgumentError(
            f"the engine's cache is on CUDA device 0 of this process, the model on {device}: run one "
            "process per GPU, each seeing only its own (CUDA_VISIBLE_DEVICES=<local rank>), with the "
            "model on cuda:0")
    mine = None if ep is None else [ep.local_experts(layer) for layer in range(len(hf_blocks))]
    # Note [Experts on disk]: a checkpoint and a host tier: nothing is packed.
    on_disk = checkpoint is not None and handle.stats()["host_tier_budget_bytes"] > 0
    if on_disk:
        if sync_free:
            raise InvalidArgumentError(
                "sync_free=True reads missing experts from their packed host copy, and experts left "
                "on disk (a host tier, host_budget_bytes) have none: leave sync_free at None or False")
        sync_free = False
    elif host_experts is None:
        names = experts_names(model, hf_blocks) if checkpoint is not None else None
        host_experts = HostExperts(hf_blocks, pin=handle.backend == "cuda", progress=progress, experts=mine,
                                   checkpoint=checkpoint, experts_names=names)
    elif not host_experts.matches(hf_blocks, mine):
        raise InvalidArgumentError("host_experts was packed from a model with other expert shapes, counts or dtype, or "
                                   "for another rank's slice of the experts")
    controller = OffloadController(handle, num_layers=len(hf_blocks), num_experts=num_experts, top_k=top_k,
                                   predictor=predictor, routers=[r for _, _, r in hf_blocks],
                                   record_trace=record_trace, device=device,
                                   local=None if ep is None else ep.local)
    controller.host_experts = host_experts  # None: the experts stay on disk
    controller.expert_parallel = ep
    if on_disk:
        chosen = [range(num_experts) if mine is None else mine[layer] for layer in range(len(hf_blocks))]
        register_from_disk(controller.prefetcher, handle, checkpoint, experts_names(model, hf_blocks), chosen,
                           layout, [0] * len(hf_blocks))
    offloads = []
    for layer, (_, experts, _) in enumerate(hf_blocks):
        if not on_disk:
            for e in (range(num_experts) if mine is None else mine[layer]):
                controller.prefetcher.register_packed(layer, int(e), host_experts.expert(layer, int(e)),
                                                      host_experts.layout)
        offloads.append(ExpertsOffload(controller, layer, experts, layout, model_device(hf_blocks, layer), ep=ep))
    controller.read_ahead_slots = offloads[0].slots  # Note [Prefill read-ahead]
    controller.cache_slots = offloads[0].slots
    if sync_free is not False:
        _enable_sync_free(controller, offloads, host_experts, layout, device, ep, sync_free, sync_free_max_rows)
    for (_, experts, _), offload in zip(hf_blocks, offloads):
        _attach(experts, offload, layout)
    return controller


def _enable_sync_free(controller, offloads, host_experts, layout, device, ep, sync_free, max_rows) -> None:
    """Note [Sync-free decode]: the one tensor over the arena and the host
    experts, each layer's row maps, the controller's path choice."""
    num_experts = layout.num_experts
    # A predictor whose guesses are device tensors (the router of a later
    # layer) guesses only on synced steps: its guesses reach the engine
    # through the routing's sync. Sync-free steps are those whose experts
    # are nearly all cached, where a guess has nothing left to fetch (Note
    # [Which path a step takes]); auto lets the gate take them as well.
    try:
        universe = Universe(controller.handle.arena(0), host_experts, offloads[0].slot_bytes, device)
    except (ValueError, RuntimeError) as err:
        if sync_free is True:
            raise InvalidArgumentError(
                f"sync_free=True, but the sync-free decode path cannot run here: {err}") from err
        universe = None
    if universe is not None:
        step_rows = None if ep is not None else StepRows(universe, len(offloads), num_experts, device)
        for offload in offloads:
            offload.enable_sync_free(universe, max_rows)
            offload.step_rows = step_rows
        controller.enable_sync_free(offloads[0].num_experts, layout.data_bytes,
                                    adaptive=sync_free is None)


def _attach(experts, offload, layout) -> None:
    """The module's offloaded parts become empty tensors, and the module
    goes through `offload` from now on."""
    for name in layout.names:
        empty = torch.empty(0, dtype=offload.dtypes[name], device=offload.device)
        if name in experts._parameters:
            experts._parameters[name] = torch.nn.Parameter(empty, requires_grad=False)
        else:
            experts._buffers[name] = empty
    experts.__dict__[OFFLOAD_ATTR] = offload
    offload._params = experts._parameters  # a later model.to(...) shows in them
    if not experts.__dict__.get("_prefetch_state_hook") and hasattr(experts, "register_state_dict_pre_hook"):
        experts.register_state_dict_pre_hook(refuse_empty_state)
        experts.__dict__["_prefetch_state_hook"] = True
