"""RoutingContext: what a route-ahead predictor may read of the model it
predicts for, in place of the OffloadController itself."""
from __future__ import annotations

__all__ = ["RoutingContext"]


class RoutingContext:
    """The read-only view of one offloaded model that a predictor's
    `predict`, `observe`, `plan`, `start_hints`, `observe_step` and
    `begin_request` receive first (prefetch/predictors.py): the model's
    shape, the routing clock and step, its routers, and whether next-use
    hints matter. A predictor returns guesses and hints and never changes
    the controller, so nothing here can: every member is a property or a
    method over the offload's shared state and its routers, kept in
    private slots (it does not hold the controller).

    - `num_layers`, `num_experts`, `top_k`: the offloaded model's shape.
    - `step`: the decode step of the routing at hand (from 0 each request).
    - `clock`: the routing clock (routed layers so far, minus one): the
      time base of next-use hints.
    - `router_logits(layer, hidden)`, `router_topk(layer, hidden, k)`:
      layer `layer`'s router run on `hidden` (a device tensor).
    - `honours_hints`: the engine's eviction policy reads next-use hints
      ("next-use"); the other policies ignore them.
    - `holds_every_expert`: each device's cache holds every registered
      expert at once, so nothing is ever evicted (Note [No hints when
      everything fits] in prefetch/predictors.py).
    """

    __slots__ = ("_state", "_routers", "_honours_hints")

    def __init__(self, state, routers, *, honours_hints: bool):
        object.__setattr__(self, "_state", state)
        object.__setattr__(self, "_routers", routers)
        # The handle's eviction policy is fixed when it is made.
        object.__setattr__(self, "_honours_hints", bool(honours_hints))

    def __setattr__(self, name, value):
        raise AttributeError(f"a RoutingContext is read-only: cannot set {name!r}")

    def __delattr__(self, name):
        raise AttributeError(f"a RoutingContext is read-only: cannot delete {name!r}")

    def __reduce_ex__(self, protocol):
        raise TypeError("a RoutingContext belongs to a live offload and cannot be copied or pickled")

    def __repr__(self) -> str:
        return (f"RoutingContext(num_layers={self.num_layers}, num_experts={self.num_experts}, top_k={self.top_k}, "
                f"step={self.step}, clock={self.clock})")

    @property
    def num_layers(self) -> int:
        return self._state.num_layers

    @property
    def num_experts(self) -> int:
        return self._state.num_experts

    @property
    def top_k(self) -> int:
        return self._state.top_k

    @property
    def step(self) -> int:
        return self._state.step

    @property
    def clock(self) -> int:
        return self._state.clock

    @property
    def honours_hints(self) -> bool:
        return self._honours_hints

    @property
    def holds_every_expert(self) -> bool:
        return bool(self._state.prefetcher.holds_every_expert())

    def router_logits(self, layer: int, hidden):
        """Layer `layer`'s router logits for each row of `hidden`."""
        out = self._routers[layer](hidden)
        if isinstance(out, tuple):  # HF routers return (logits, weights, indices)
            out = out[0]
        return out

    def router_topk(self, layer: int, hidden, k: int):
        """The k experts layer `layer`'s router would pick for each row of
        `hidden` (a device tensor of indices). A router with a 2-D `weight`
        (the transformers top-k routers) costs one matmul and one top-k:
        softmax keeps the order, so the top-k of the logits is the
        router's."""
        import torch

        router = self._routers[layer]
        weight = getattr(router, "weight", None)
        if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[-1] == hidden.shape[-1]:
            bias = getattr(router, "bias", None)  # gpt-oss's router has one
            bias = bias if isinstance(bias, torch.Tensor) and bias.shape == weight.shape[:1] else None
            logits = torch.nn.functional.linear(hidden.reshape(-1, hidden.shape[-1]), weight, bias)
        else:
            logits = self.router_logits(layer, hidden)
        return torch.topk(logits, min(k, logits.shape[-1]), dim=-1).indices
