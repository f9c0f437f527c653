"""BM6 with real routing (bench/generate.py --trace-in): a transformers model
whose MoE blocks route as a recorded routing trace says (Note [Forced
routing]), and the model shapes to replay the real traces (../shared/traces
and traces/) with."""
from __future__ import annotations

import types

import numpy as np

from bench.lib.generate_model import MODELS

# The trace's own layer and expert counts; top-k is set from the trace's
# decode steps. The expert widths are BM5's for the same trace
# (bench/lib/e2e_decoder.py: hidden 2816, expert intermediate 704, quoted from
# the published config, not checked here). The rest is qwen3_moe's
# architecture with an attention chosen here (gemma-4: 16 heads of 176, 8
# kv heads; gpt-oss: 64 heads of 64, 8 kv heads), not the real model's:
# what is replayed is the routing and the expert bytes.
# gpt-oss-120b at its widths (hidden and expert intermediate 2880) has 36 x
# 128 experts of 229 GB in all, more than the H200 machine's GPU or host
# memory holds: its entry keeps the hidden width and makes each expert a
# quarter as wide (intermediate 720: 12.4 MB an expert, 57 GB in all), so
# the routing is the trace's and the bytes a step moves a quarter of the
# real model's ("-narrow" says so).
# Qwen3-30B-A3B (traces/qwen3-30b-a3b-*.json): BM6's own qwen3-30b-a3b model,
# its published widths, at the trace's top-k.
TRACE_MODELS = {
    "qwen3-30b-a3b": MODELS["qwen3-30b-a3b"],
    "gemma4-26b-a4b": ("qwen3_moe", dict(hidden_size=2816, intermediate_size=2816, moe_intermediate_size=704,
                                         num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
                                         head_dim=176, num_experts=128, num_experts_per_tok=6, norm_topk_prob=True,
                                         rms_norm_eps=1e-6, max_position_embeddings=4096,
                                         rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
    "gpt-oss-120b-narrow": ("qwen3_moe", dict(hidden_size=2880, intermediate_size=2880, moe_intermediate_size=720,
                                              num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8,
                                              head_dim=64, num_experts=128, num_experts_per_tok=2,
                                              norm_topk_prob=True, rms_norm_eps=1e-5, max_position_embeddings=4096,
                                              rope_parameters={"rope_type": "default", "rope_theta": 150000.0})),
}
# The families whose router forced_gate_forward stands in for (a router
# module with `weight` [experts, hidden], `hidden_dim`, `norm_topk_prob`,
# returning (logits, weights, indices), as transformers 5's Qwen3-MoE).
FORCED_FAMILIES = ("qwen3_moe",)


class ForcedRouting:
    """Note [Forced routing]
    BM6's models have random weights, so their routers pick experts at
    random: no temporal or cross-layer structure, nothing a predictor or a
    cache can learn from. With --trace-in, each MoE block of the model (and
    of its twin, Note [Paired generates]) routes as a real routing trace
    says, inside transformers' own forward: the router still computes its
    logits and softmax (the same work as the model's router), then takes
    the trace's experts where it would take its top-k (a gather in place of
    torch.topk: the same count of kernels, no host sync) with their
    probabilities as weights, normalised where the config says so. What
    the experts implementation gets, resident or offloaded, is then
    transformers' usual (indices, weights) pair.

    Which step of the trace: each generate starts over. Its prefill (a call
    of more tokens than the batch) routes each prompt token to k of the
    experts the trace's step 0 (the recorded prompt) used in that layer, in
    turn (token t takes the t*k-th to (t*k+k-1)-th of them, cyclically),
    so the prompt touches those experts and no others; decode token i (its
    i-th call of `batch` tokens after the prefill) routes batch row b as
    the trace's decode step start + i + b * (D // batch) says, cycling over
    the D decode steps. The step count moves at the first MoE layer's
    block forward only, so a router called by anyone else (a predictor)
    reads the current step and moves nothing.

    The trace is untrusted input: every decode step must route each layer
    to the same number of distinct experts (the model's top-k), or it is
    refused with a ValueError naming the step and layer. (It keeps no
    reference to the torch module: a deep copy of the model copies it.)"""

    def __init__(self, trace, device, start: int = 1):
        steps = trace.steps
        if len(steps) < 2:
            raise ValueError("the trace has no decode step: a forced routing needs its prompt step and "
                             "one or more decode steps")
        if not 1 <= start < len(steps):
            raise ValueError(f"trace start {start} is not a decode step of the trace (1..{len(steps) - 1})")
        k = len(steps[1][0])
        if k < 1:
            raise ValueError("the trace's step 1 routes layer 0 to no expert")
        for s in range(1, len(steps)):
            for layer, experts in enumerate(steps[s]):
                if len(experts) != k or len(set(experts)) != k:
                    raise ValueError(f"trace step {s} layer {layer} routes to {len(set(experts))} distinct of "
                                     f"{len(experts)} experts, step 1 layer 0 to {k}: every decode step must route "
                                     f"each layer to the same top-k")
        self.device = device
        self.num_layers, self.num_experts, self.top_k = trace.num_layers, trace.num_experts, k
        self.start = start
        self._decode = np.asarray(steps[1:], dtype=np.int64)  # [D, layers, k]
        # Per layer, the distinct experts the prompt step used (all of them
        # where it used fewer than k: a prompt token still routes to k
        # distinct experts).
        unions = [np.unique(np.asarray(steps[0][layer], dtype=np.int64)) for layer in range(trace.num_layers)]
        self._union = [u if u.shape[0] >= k else np.arange(trace.num_experts, dtype=np.int64) for u in unions]
        self.batch = None
        self.pos = -1  # the current decode token of this generate (-1: its prefill)
        self._dec = None  # device [D, layers, batch, k]
        self._pre = None  # device [layers, tokens, k]

    def set_batch(self, batch: int) -> None:
        """The batch of the generates to come: decode calls are calls of
        `batch` tokens; row b starts D // batch decode steps after row b - 1."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        d = self._decode.shape[0]
        offset = d // batch
        steps = (np.arange(d)[:, None] + self.start - 1 + offset * np.arange(batch)[None, :]) % d  # [D, batch]
        table = self._decode[steps]  # [D, batch, layers, k]
        import torch

        self._dec = torch.from_numpy(np.ascontiguousarray(table.transpose(0, 2, 1, 3))).to(self.device)
        self.batch = batch
        self.pos = -1

    def _prefill_table(self, tokens: int):
        if self._pre is None or self._pre.shape[1] < tokens:
            k = self.top_k
            picks = np.arange(tokens)[:, None] * k + np.arange(k)[None, :]  # [tokens, k]
            table = np.stack([union[picks % union.shape[0]] for union in self._union])  # [layers, tokens, k]
            import torch

            self._pre = torch.from_numpy(table).to(self.device)
        return self._pre

    def enter(self, layer: int, tokens: int) -> None:
        """A block forward of `tokens` rows at `layer` starts: the first
        layer's moves the step (a prefill starts the generate over)."""
        if self.batch is None:
            raise RuntimeError("ForcedRouting.set_batch was not called before the model ran")
        if layer == 0:
            self.pos = self.pos + 1 if tokens == self.batch else -1

    def indices(self, layer: int, tokens: int):
        """The experts `tokens` rows of `layer` route to now: a [tokens, k]
        int64 device tensor (a view of a table made once; read it only)."""
        if tokens != self.batch:
            return self._prefill_table(tokens)[layer, :tokens]
        return self._dec[max(self.pos, 0) % self._dec.shape[0], layer]


def _forced_block_forward(self, hidden_states):
    routing, layer = self._forced_routing
    routing.enter(layer, hidden_states.shape[0] * hidden_states.shape[1])
    return type(self).forward(self, hidden_states)


def _forced_gate_forward(self, hidden_states):
    import torch

    routing, layer = self._forced_routing
    x = hidden_states.reshape(-1, self.hidden_dim)
    logits = torch.nn.functional.linear(x, self.weight)
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    index = routing.indices(layer, x.shape[0])
    weights = probs.gather(1, index)
    if self.norm_topk_prob:
        weights /= weights.sum(dim=-1, keepdim=True)
    return logits, weights.to(logits.dtype), index


def force_routing(model, blocks, routing: ForcedRouting) -> None:
    """Makes each of `blocks` ((block, experts, gate) of `model`, in layer
    order) route as `routing` says (Note [Forced routing]): instance
    forwards on each block and router, so a deep copy of the model (the
    twin) routes the same way with its own copy of `routing`."""
    if len(blocks) != routing.num_layers:
        raise ValueError(f"the model has {len(blocks)} MoE layers, the trace {routing.num_layers}")
    for layer, (block, _, gate) in enumerate(blocks):
        weight = getattr(gate, "weight", None)
        if weight is None or weight.dim() != 2 or weight.shape[0] != routing.num_experts:
            raise ValueError(f"layer {layer}: the router has no [experts={routing.num_experts}, hidden] weight")
        if getattr(gate, "top_k", routing.top_k) != routing.top_k:
            raise ValueError(f"layer {layer}: the model routes to top-{gate.top_k}, the trace to {routing.top_k}")
        block._forced_routing = gate._forced_routing = (routing, layer)
        block.forward = types.MethodType(_forced_block_forward, block)
        gate.forward = types.MethodType(_forced_gate_forward, gate)
    model._forced_routing = routing


def trace_shape(shape: dict, trace) -> dict:
    """`shape` (a model's config kwargs) with the trace's top-k; a
    ValueError where its layer or expert count is not the trace's."""
    if shape["num_hidden_layers"] != trace.num_layers or shape["num_experts"] != trace.num_experts:
        raise ValueError(f"the model has {shape['num_hidden_layers']} layers of {shape['num_experts']} experts, "
                         f"the trace {trace.num_layers} of {trace.num_experts}")
    if len(trace.steps) < 2:
        raise ValueError("the trace has no decode step")
    return {**shape, "num_experts_per_tok": len(trace.steps[1][0])}
