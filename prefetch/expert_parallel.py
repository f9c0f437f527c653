"""Expert parallel over torch.distributed: every MoE layer's experts are
partitioned over the ranks of a process group; each rank keeps only its own
experts (its own PrefetchHandle, device cache and host copy), computes its
local routed experts for the whole batch, and the partial outputs are summed
with one all-reduce per layer. Attention and the dense weights are
replicated: every rank runs the whole model on the whole batch.

    dist.init_process_group("nccl")        # under torchrun; "gloo" on the CPU
    ctl = prefetch.offload_moe_experts(model, device_budget_bytes=per_rank_budget,
                                       process_group=dist.group.WORLD)

Note [Expert parallel]
Placement is by expert id, the same table on every rank (`partition_experts`):
"balanced" gives each rank a contiguous block of near-equal size (experts of
a model are one size, so equal counts are equal bytes); "activations" keeps
those block sizes but assigns experts to ranks by recorded activation
counts, heaviest first onto the rank with the least load so far (longest
processing time first), so the routed load evens out while the bytes stay
balanced. A layer on a rank then (1) reads its full routing back once (as
without a group; the predictor's guesses ride along), (2) scores the
predictor and records the trace on the full routing, (3) makes one engine
call acquiring only the routed experts it owns, the controller dropping the
guesses and hints for experts it does not own, (4) runs the experts
implementation with the other experts' routing weights set to 0 and their
rows sent to the sentinel slot for grouped_mm (it skips them) or to a slot
the call acquired for the others (they read it and multiply by 0; a slot
not held could be mid-copy, and 0 x NaN is NaN), and (5)
all-reduces the output over the group. For batched_mm and grouped_mm that
output is per (token, k) pair: each pair runs as a row of its own with
weight 1, so a rank's row is the pair's expert output exactly, or an exact
0 where another rank owns the expert; the all-reduce adds only zeros to
each value, and the weighting and the sum over k are then the
implementation's own two ops on the same values (`_weighted_sum`
below): bit-equal to one process for any top-k (a partial sum per
rank, all-reduced, rounded differently with top-8 in bf16 and turned a
greedy token on the H200). It costs k times the all-reduce bytes
(decode: 8 x 2048 bf16 values per token for OLMoE). batched_mm gathers
every row's expert weights, a row routed to another rank's expert
included: with the routing on the host (the synced path, in one piece), a
rank computes only its own pairs and writes them into an output of exact
zeros (`ExpertParallelForward._local_pairs`), half the gathers and products
on two ranks. A bmm row's bits do not depend on which other rows are in
the batch (a one-off probe on the H200: every count of 1..64 pairs, at
OLMoE's and Qwen3-30B-A3B's expert shapes; the CPU test checks the
logits). The sync-free path has no routing on the host and computes every
pair. The eager loop keeps
the partial sums ([tokens, hidden]): its adds run in expert order, which no
per-pair sum reproduces; bit-equal with top-2 (x + 0 + y = x + y).

Every collective here is blocking and bounded by the process group's
timeout: a rank that dies or stops answering makes the others raise (gloo)
or be aborted by NCCL's watchdog, never hang for ever. `offload_moe_experts`
checks first, with one all_gather, that every rank has the same model
(layers, experts, shapes, dtype, top-k, the routers' bytes) and the same
placement, and that every rank could set up; a rank that could not still
joins the gather, so all ranks raise together.
"""
from __future__ import annotations

import hashlib
import time

import numpy as np
import torch

from prefetch.errors import InvalidArgumentError
from prefetch.hf_blocks import ExpertsLayout, model_device

__all__ = ["partition_experts", "activation_counts", "ExpertParallel", "LayerShare", "ExpertParallelForward",
           "setup_expert_parallel"]

PLACEMENTS = ("balanced", "activations")
_FIELDS = ("status", "layers", "experts", "expert layout (its tensors' names, shapes and dtypes)", "top_k",
           "world size", "placement", "routers")


class LayerShare:
    """One offloaded layer's share on this rank (Note [Expert parallel]):
    which of its experts the rank owns, the per-(token, k) form of a call
    and the all-reduce that sums the ranks' outputs."""

    def __init__(self, ep, layer: int, device, controller):
        self.ep = ep
        self.controller = controller
        self.local = ep.local[layer]  # expert -> this rank owns it
        self.foreign = torch.from_numpy(~self.local).to(device)  # expert -> not ours, on the device
        self.own_weight = {}  # dtype -> expert -> 1 if ours else 0, on the device (pairs)
        self.ones = {}  # dtype -> a column of 1s, on the device (the layer's local pairs)
        self.pair_weights = None  # this call's routing weights, when its output is per (token, k) pair

    def foreign_rows(self, pinned: np.ndarray, rows: np.ndarray) -> None:
        """Other ranks' experts (weight 0) are still read: from the slot of
        an expert this call pinned where there is one (HBM, held until this
        layer's kernel has run), not over PCIe."""
        held = np.flatnonzero(pinned)
        if held.shape[0]:
            rows[~self.local] = rows[held[0]]

    def pairs(self, hidden_states, top_k_index, top_k_weights, routing):
        """batched_mm and grouped_mm: each (token, k) pair as a row of its
        own, routed to its one expert with weight 1 where this rank owns the
        expert (`routing`: the pairs' expert ids) and 0 elsewhere. The
        output is then the pair's expert output, exact, and on every rank
        but its expert's an exact 0; the all-reduce adds those zeros and
        `all_reduce` weights and sums over k as the implementation does.
        Returns the inputs to call it with: the weights are one gather from
        a per-expert table of 1s and 0s (one kernel launch, not three)."""
        k = top_k_index.shape[-1]
        self.pair_weights = top_k_weights
        self.ep.rows_routed += top_k_index.numel()
        self.ep.rows_computed += top_k_index.numel()
        own = self.own_weight.get(top_k_weights.dtype)
        if own is None:
            own = self.own_weight[top_k_weights.dtype] = (~self.foreign).to(top_k_weights.dtype)
        return (hidden_states.repeat_interleave(k, dim=0), top_k_index.reshape(-1, 1),
                own[routing.reshape(-1, 1)])

    def all_reduce(self, out):
        """Sums the layer's output over the group (and finishes a per-pair
        output). Returns (output, ns spent)."""
        t0 = time.perf_counter_ns()
        self.ep.all_reduce(out)
        comm = time.perf_counter_ns() - t0
        self.controller.comm_ns += comm
        if self.pair_weights is not None:
            out = _weighted_sum(out, self.pair_weights, out.dtype)  # the pair outputs are in the hidden dtype
            self.pair_weights = None
        return out, comm


def _weighted_sum(pairs, top_k_weights, dtype):
    """batched_mm's and grouped_mm's last two steps on the [tokens x k,
    hidden] expert outputs: weight each pair, sum over k, in the same ops
    and dtypes, so the result is theirs bit for bit."""
    k = top_k_weights.shape[-1]
    weighted = pairs * top_k_weights.reshape(-1).unsqueeze(-1)
    return weighted.view(-1, k, pairs.shape[-1]).sum(dim=1).to(dtype)


# The implementations whose output is sum over k of (expert output x weight),
# weighted then summed in one reshape + sum (transformers.integrations.moe):
# expert parallel reproduces that op on the all-reduced pair outputs.
_PER_PAIR = ("batched_mm", "grouped_mm")


class ExpertParallelForward:
    """The expert-parallel forward of an offloaded layer (Note [Expert
    parallel]): mixed into ExpertsOffload (prefetch/hf_experts.py), whose
    slot mapping it runs on (`_remap`, `_stand_for`, `_slot_ids`,
    `_slot_index`, `_staging`, `_send`, `_run`, `_pieces`) with the layer's
    LayerShare (`share`, `ep`, `_local`)."""

    def _forward_local(self, fn, name, hidden_states, top_k_index, top_k_weights, routed, experts, guesses, hints,
                       stream):
        """Expert parallel: this rank's share of the layer. One engine call
        for the routed experts it owns (the controller drops the guesses for
        the others); the rows routed to other ranks' experts get weight 0
        and a slot this call acquired (every implementation reads them and
        multiplies by 0). Returns
        (partial output, t before compute, t after compute)."""
        ctl = self.controller
        self.share.pair_weights = None  # nothing left from a call that raised
        per_pair = name in _PER_PAIR
        mine = experts[self._local[experts]]
        # batched_mm in one piece: only this rank's pairs (_local_pairs).
        local_pairs = name == "batched_mm" and mine.shape[0] <= self.slots
        if per_pair and not local_pairs:  # every rank takes this form, whatever its pieces
            hidden_states, top_k_index, top_k_weights = self.share.pairs(hidden_states, top_k_index, top_k_weights,
                                                                    top_k_index)
        if mine.shape[0] > self.slots:
            t2 = time.perf_counter_ns()
            out, inner_ns = self._pieces(fn, name, hidden_states, top_k_index, top_k_weights, mine, guesses,
                                         hints, stream)
            return out, t2, t2 + inner_ns
        where = ctl.exchange(self.layer, mine, guesses, hints, stream=stream)
        if local_pairs:
            self.share.pair_weights = top_k_weights
            stand = self._stand_for(name, self._slot_ids(where), mine) if mine.shape[0] else None
            out, inner = self._local_pairs(fn, stand, hidden_states, routed, top_k_weights)
            t2 = time.perf_counter_ns()
            return out, t2, t2 + inner
        t2 = time.perf_counter_ns()
        if not mine.shape[0]:
            return torch.zeros_like(hidden_states), t2, time.perf_counter_ns()
        stand = self._stand_for(name, self._slot_ids(where), mine)
        # Other ranks' experts go to a slot this call acquired, with routing
        # weight 0, so the rows add exact zeros: a slot we do not hold may be
        # mid-copy or never written, and 0 x NaN is NaN (a batched_mm rank
        # under ASan). Not past the last slot: how an implementation treats
        # such a sentinel row differs between transformers releases (5.25's
        # grouped_mm masks it only on modules marked expert-parallel, and
        # leaves it uninitialized otherwise).
        self._remap[~self._local] = self._remap[mine[0]]
        index = self._slot_index(routed, top_k_index.shape)
        # Per pair, other ranks' weights are 0 already (_pairs).
        weights = top_k_weights if per_pair else top_k_weights.masked_fill(self.share.foreign[top_k_index], 0)
        t2 = time.perf_counter_ns()
        out = self._run(fn, stand, hidden_states, index, weights)
        return out, t2, time.perf_counter_ns()

    def _local_pairs(self, fn, stand, hidden_states, routed: np.ndarray, top_k_weights):
        """Expert parallel, batched_mm with the routing on the host: only the
        (token, k) pairs this rank owns are computed, each as a row of
        weight 1, and written into a [tokens x k, hidden] output of exact
        zeros; the other ranks' pairs stay 0 (Note [Expert parallel]).
        batched_mm gathers every row's weights, so a row routed to another
        rank costs a full expert's gather and product for nothing: half the
        layer's expert time on two ranks at batch 8. Returns (output, ns in
        the implementation)."""
        k = top_k_weights.shape[-1]
        rows = np.flatnonzero(self._local[routed])
        n = rows.shape[0]
        self.ep.rows_routed += routed.shape[0]
        self.ep.rows_computed += n
        out = hidden_states.new_zeros((routed.shape[0], hidden_states.shape[-1]))
        if not n:
            return out, 0
        staged = self._staging(3 * n)  # one copy: tokens, slots, pair rows
        np.floor_divide(rows, k, out=staged[:n])
        np.take(self._remap, routed[rows], out=staged[n : 2 * n])
        staged[2 * n :] = rows
        sent = self._send(staged)
        ones = self.share.ones.get(top_k_weights.dtype)
        if ones is None or ones.shape[0] < n:
            ones = self.share.ones[top_k_weights.dtype] = torch.ones((max(n, routed.shape[0]), 1),
                                                                dtype=top_k_weights.dtype, device=self.device)
        picked = hidden_states.index_select(0, sent[:n])
        t0 = time.perf_counter_ns()
        part = self._run(fn, stand, picked, sent[n : 2 * n].view(n, 1), ones[:n])
        inner = time.perf_counter_ns() - t0
        out.index_copy_(0, sent[2 * n :], part.to(out.dtype))
        return out, inner


def activation_counts(trace, num_layers: int | None = None, num_experts: int | None = None) -> np.ndarray:
    """Per layer, per expert: how many steps of a RoutingTrace routed to the
    expert (what each step would have to copy or compute)."""
    layers = trace.num_layers if num_layers is None else num_layers
    experts = trace.num_experts if num_experts is None else num_experts
    counts = np.zeros((layers, experts), dtype=np.int64)
    for step in trace.steps:
        for layer, routed in enumerate(step[:layers]):
            for e in routed:
                if 0 <= e < experts:
                    counts[layer, e] += 1
    return counts


def _block_sizes(num_experts: int, world_size: int) -> np.ndarray:
    sizes = np.full(world_size, num_experts // world_size, dtype=np.int64)
    sizes[: num_experts % world_size] += 1
    return sizes


def partition_experts(num_layers: int, num_experts: int, world_size: int, placement: str = "balanced",
                      counts=None) -> np.ndarray:
    """The owner rank of every (layer, expert), as an int64 [layers, experts]
    table. "balanced": contiguous blocks, the first `experts % world_size`
    ranks one expert more. "activations": the same number of experts per
    rank, experts assigned heaviest first (by `counts`, [layers, experts] or
    a RoutingTrace) to the rank with the least load so far; ties go to the
    lower expert id and the lower rank, so every rank computes the same
    table."""
    if placement not in PLACEMENTS:
        raise InvalidArgumentError(f"expert_placement must be one of {PLACEMENTS}, got {placement!r}")
    if world_size < 1:
        raise InvalidArgumentError(f"world size must be >= 1, got {world_size}")
    if world_size > num_experts:
        raise InvalidArgumentError(
            f"expert parallel over {world_size} ranks needs at least {world_size} experts per layer; "
            f"this model has {num_experts}: use a group of at most {num_experts} ranks")
    sizes = _block_sizes(num_experts, world_size)
    if placement == "balanced":
        if counts is not None:
            raise InvalidArgumentError('activation_counts is only used with expert_placement="activations"')
        row = np.repeat(np.arange(world_size, dtype=np.int64), sizes)
        return np.tile(row, (num_layers, 1))
    if counts is None:
        raise InvalidArgumentError(
            'expert_placement="activations" needs activation_counts (a [layers, experts] array or '
            "a RoutingTrace)")
    if hasattr(counts, "steps"):
        if counts.num_layers != num_layers or counts.num_experts != num_experts:
            raise InvalidArgumentError(
                f"the trace has {counts.num_layers} layers x {counts.num_experts} experts, the model "
                f"{num_layers} x {num_experts}")
        counts = activation_counts(counts)
    counts = np.asarray(counts)
    if counts.shape != (num_layers, num_experts):
        raise InvalidArgumentError(
            f"activation_counts must have shape ({num_layers}, {num_experts}) (layers, experts), "
            f"got {counts.shape}")
    if not np.issubdtype(counts.dtype, np.number) or not np.isfinite(counts).all() or (counts < 0).any():
        raise InvalidArgumentError("activation_counts must be finite and non-negative")
    owner = np.empty((num_layers, num_experts), dtype=np.int64)
    for layer in range(num_layers):
        load = np.zeros(world_size, dtype=np.float64)
        room = sizes.copy()
        for e in np.argsort(-counts[layer].astype(np.float64), kind="stable"):
            open_ranks = np.flatnonzero(room > 0)
            r = open_ranks[np.argmin(load[open_ranks])]
            owner[layer, e] = r
            load[r] += float(counts[layer, e])
            room[r] -= 1
    return owner


def _hash63(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


class ExpertParallel:
    """This rank's share of the experts and the per-layer all-reduce."""

    def __init__(self, group, owner: np.ndarray, rank: int, world_size: int):
        self.group = group
        self.owner = owner
        self.rank = rank
        self.world_size = world_size
        self.local = owner == rank  # [layers, experts] bool
        # (token, k) rows of the per-pair implementations: routed to any
        # rank, and computed here (all of them, or only this rank's:
        # ExpertParallelForward._local_pairs).
        self.rows_routed = 0
        self.rows_computed = 0

    def local_experts(self, layer: int) -> np.ndarray:
        return np.flatnonzero(self.local[layer])

    def all_reduce(self, out: torch.Tensor) -> torch.Tensor:
        """Sums this layer's partial outputs over the group, in place."""
        torch.distributed.all_reduce(out, group=self.group)
        return out

    def __repr__(self) -> str:
        counts = self.local.sum(axis=1)
        return (f"<ExpertParallel rank {self.rank}/{self.world_size}: {int(counts.sum())} of {self.owner.size} "
                f"experts ({int(counts.min())}..{int(counts.max())} per layer)>")


def _collective_device(group, device: torch.device) -> torch.device:
    backend = str(torch.distributed.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        if device.type != "cuda":
            raise InvalidArgumentError(f"an NCCL process group needs the model on a CUDA device, got {device}")
        return device
    return torch.device("cpu")


def setup_expert_parallel(group, hf_blocks, *, top_k: int, placement: str = "balanced",
                          counts=None) -> ExpertParallel:
    """Checks that every rank of `group` offloads the same model with the same
    placement (one all_gather, bounded by the group's timeout) and returns
    this rank's ExpertParallel. A rank whose setup failed still joins the
    gather, then every rank raises."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group given but torch.distributed is not initialised: call "
                           "torch.distributed.init_process_group first (torchrun sets up the environment)")
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    if rank < 0:
        raise InvalidArgumentError("this process is not a member of process_group")
    layout = ExpertsLayout(hf_blocks[0][1])
    device = model_device(hf_blocks)  # the experts may be on meta (read from a checkpoint)
    num_layers, num_experts = len(hf_blocks), layout.num_experts
    error = None
    owner = None
    fields = [0, num_layers, num_experts, _hash63(layout.fingerprint().encode()), top_k, world, 0, 0]
    try:
        owner = partition_experts(num_layers, num_experts, world, placement, counts)
        fields[-2] = _hash63(owner.tobytes())
        routers = hashlib.blake2b(digest_size=8)
        for _, _, router in hf_blocks:
            weight = getattr(router, "weight", None)
            if isinstance(weight, torch.Tensor):
                routers.update(_tensor_bytes(weight))
        fields[-1] = _hash63(routers.digest())
    except (ValueError, TypeError) as exc:
        error = exc
        fields[0] = 1
    mine = torch.tensor(fields, dtype=torch.int64, device=_collective_device(group, device))
    gathered = [torch.empty_like(mine) for _ in range(world)]
    try:
        dist.all_gather(gathered, mine, group=group, async_op=True).wait()
    except RuntimeError as exc:
        raise RuntimeError(f"expert parallel setup: rank {rank} could not hear from every rank of the group within "
                           f"its timeout ({exc})") from exc
    rows = [g.cpu().tolist() for g in gathered]
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[0] != 0]
    if failed:
        raise RuntimeError(f"expert parallel setup failed on rank(s) {failed} (see their errors); rank {rank} "
                           "stops too")
    for r, row in enumerate(rows):
        if row != rows[0]:
            diff = [f"{name}: rank 0 {a}, rank {r} {b}" for name, a, b in zip(_FIELDS, rows[0], row) if a != b]
            raise InvalidArgumentError(
                "the ranks of the process group do not offload the same model with the same expert "
                f"placement ({'; '.join(diff)}): load the same checkpoint on every rank and pass the "
                "same expert_placement and activation_counts")
    return ExpertParallel(group, owner, rank, world)
