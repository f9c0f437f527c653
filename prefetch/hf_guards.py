"""What an offloaded experts module refuses: a backward through the cache
(Note [No backward through the cache]) and a state_dict of its empty
parameters (Note [No state of offloaded experts])."""
from __future__ import annotations

import torch

from prefetch.hf_blocks import OFFLOAD_ATTR

__all__ = ["NoBackward", "refuse_empty_state"]


class NoBackward(torch.autograd.Function):
    """Note [No backward through the cache]
    An offloaded layer computes on cache slots that are released after the
    layer and then hold other experts, and its experts' parameters are
    empty. A backward through it read whatever the slots held by then: with
    the model in training mode (or a plain forward outside torch.no_grad)
    a backward gave every earlier parameter a wrong gradient and the
    experts none, without a word (a review: 27 of the tiny OLMoE's
    parameters). The forward still runs, without autograd, and its output
    stands for a backward that raises, naming the way out. The routing
    weights count as inputs too: with frozen hidden states and a router
    that trains, the router's gradient would be right but the experts
    would not train, without a word; an offloaded layer is for inference
    and says so either way."""

    @staticmethod
    def forward(ctx, compute, *inputs):
        return compute(*inputs)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("backward through MoE experts offloaded by prefetch is not supported: their weights are "
                           "cache slots reused after each layer and get no gradient; train or fine-tune the model "
                           "before offloading it, and run offloaded models under torch.no_grad() or "
                           "torch.inference_mode()")


def refuse_empty_state(module, prefix, keep_vars) -> None:
    """Note [No state of offloaded experts]
    An offloaded experts module keeps empty parameters (the weights live in
    the engine's host copy and cache), so `model.save_pretrained` after
    offloading wrote zero-size expert tensors without a word, and the
    checkpoint failed only when loaded again (a review). Its state_dict is
    refused instead, naming the way out; a module whose weights were put
    back (BM6's restore) gives its state as ever."""
    offload = module.__dict__.get(OFFLOAD_ATTR)
    if offload is not None and getattr(module, offload.layout.names[0]).numel() == 0:
        where = prefix.rstrip(".") or "this module"
        raise RuntimeError(f"{where}: its experts are offloaded by prefetch (their weights are in the engine, not in "
                           "the module), so its state_dict would hold empty expert tensors: save or copy the model "
                           "before offload_moe_experts, or use its checkpoint")
