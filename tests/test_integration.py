"""Offloaded MoE models compute exactly what the original computes: tiny
random-weight configs of each supported transformers family (no downloads),
greedy decoding, logits compared bit for bit against the untouched model
running the same experts implementation (the offloaded path calls that very
implementation on views of the cache: Note [Experts on cache slots] in
prefetch/hf_experts.py). Budgets smaller than a layer's routed experts run in
pieces and give the same tokens. Plus the generic block, the predictors and
traces."""
import copy
import json
import time

import numpy as np
import pytest
import torch
from conftest import CountingHandle, wait_drained
from torch import nn

import prefetch
from prefetch.hf_blocks import ExpertsLayout
from prefetch.integration import (
    NextLayerGatePredictor,
    OffloadController,
    OffloadedMoEBlock,
    OraclePredictor,
    RoutingTrace,
    TracePredictor,
    belady_misses,
    find_hf_moe_blocks,
    offload_moe_experts,
    offloaded_experts,
)

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128)


def family_configs():
    out = {}
    out["mixtral"] = transformers.MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=6,
                                                num_experts_per_tok=2)
    out["qwen3_moe"] = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=40,
                                                   num_experts=8, num_experts_per_tok=2, head_dim=8,
                                                   decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    out["olmoe"] = transformers.OlmoeConfig(**COMMON, intermediate_size=40, num_experts=8, num_experts_per_tok=2)
    out["qwen2_moe"] = transformers.Qwen2MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=40,
                                                   shared_expert_intermediate_size=48, num_experts=8,
                                                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[])
    # biased, transposed experts and the clamped SwiGLU; a router named `router`
    out["gpt_oss"] = transformers.GptOssConfig(**COMMON, intermediate_size=40, head_dim=8, num_local_experts=8,
                                               num_experts_per_tok=2, sliding_window=4,
                                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    return out


def build(cfg, device="cpu", dtype=torch.float32, experts_implementation="eager"):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=experts_implementation)
    return model.to(device, dtype).eval()


def expert_bytes(model):
    """(bytes of one expert's tensors, experts per layer)."""
    layout = ExpertsLayout(find_hf_moe_blocks(model)[0][1])
    return sum(p.nbytes for p in layout.parts), layout.num_experts


def greedy(model, ids, steps=4):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, out.logits


def assert_same_decode(ref, model, ids, steps=4):
    """`model` decodes `ids` greedily to `ref`'s tokens and bit-equal logits."""
    seq_ref, logits_ref = greedy(ref, ids, steps)
    seq, logits = greedy(model, ids, steps)
    assert torch.equal(seq, seq_ref)
    for a, b in zip(logits, logits_ref):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("predictor", [None, "next-layer"])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_offloaded_model_matches_original(family, predictor, impl):
    cfg = family_configs()[family]
    ref = build(cfg, experts_implementation=impl)
    model = copy.deepcopy(ref)
    per, num_experts = expert_bytes(model)
    # Room for one layer's experts and a few more: later layers evict earlier ones.
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="host",
                              predictor=NextLayerGatePredictor() if predictor else None)
    try:
        assert len(offloaded_experts(model)) == cfg.num_hidden_layers
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
        assert_same_decode(ref, model, ids)
        report = ctl.report()
        s = ctl.handle.stats()
        assert s["evictions"] > 0  # the budget really was too small for all experts
        assert s["pinned_count"] == 0
        # The copy worker's underruns and the cap they set, as the engine has them.
        assert (report["spec_underruns"], report["speculative_cap_bytes"]) == (
            s["spec_underruns"], s["speculative_cap_bytes"])
        assert report["speculative_cap_bytes"] > 0
        if predictor:
            assert 0 < report["prediction_precision"] <= 1 and 0 < report["prediction_recall"] <= 1
    finally:
        ctl.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe", "qwen2_moe", "gpt_oss"])
@pytest.mark.parametrize("slots", [3, "layer+3", "all"])
def test_sync_free_decode_matches_original(family, slots):
    # Note [Sync-free decode]: batched_mm calls run on the one strided tensor
    # over the arena and the host experts; an expert not pinned is read from
    # host memory. The same bits as the untouched model, whatever the budget,
    # and the same routing as the synced path records.
    cfg = family_configs()[family]
    ref = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(ref)
    count = {3: 3, "layer+3": num_experts + 3, "all": num_experts * cfg.num_hidden_layers}[slots]
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    seq_ref, logits_ref = greedy(ref, ids, steps=6)
    traces = {}
    for sync_free in (None, False):
        model = copy.deepcopy(ref)
        # preload=False: the first reads of every expert come from host
        # memory (a preloaded cache would hold them all at "all").
        ctl = offload_moe_experts(model, device_budget_bytes=count * (per + 512), backend="host",
                                  record_trace=True, sync_free=sync_free, preload=False)
        try:
            assert ctl.sync_free is (sync_free is None)
            seq, logits = greedy(model, ids, steps=6)
            assert torch.equal(seq, seq_ref)
            for a, b in zip(logits, logits_ref):
                assert torch.equal(a, b)
            report = ctl.report()
            assert 0 <= report["hit_rate"] <= 1
            if sync_free is None:
                assert report["zero_copy_reads"] > 0  # the first reads of every expert at least
                assert report["zero_copy_bytes"] == report["zero_copy_reads"] * per
                assert ctl.pinned_hits + report["zero_copy_reads"] > 0
            else:
                assert report["zero_copy_reads"] == 0
            assert ctl.handle.stats()["pinned_count"] == 0
            ctl.new_sequence()  # the last step's routing is read now, into this request's trace
            assert not ctl.sync._routings
            traces[sync_free] = ctl.trace.steps
        finally:
            ctl.close()
    assert traces[None] == traces[False]


def test_sync_free_warms_the_cache_and_then_hits():
    # Every expert fits: after the first steps read them from host memory
    # (and prefetched them), decode reads them from the cache.
    cfg = family_configs()["olmoe"]
    model = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=num_experts * cfg.num_hidden_layers * (per + 512),
                              backend="host", preload=False)
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
        greedy(model, ids, steps=4)
        ctl.flush()  # the last step's routing: read, its misses prefetched
        wait_drained(ctl.handle)
        before = ctl.report()["zero_copy_reads"]
        hits_before = ctl.pinned_hits
        greedy(model, ids, steps=4)  # the same prompt: the same experts, now resident
        assert ctl.report()["zero_copy_reads"] == before
        assert ctl.pinned_hits > hits_before
    finally:
        ctl.close()


class _CountingGate(NextLayerGatePredictor):
    """The next-layer gate, counting the controller's observe calls."""

    def __init__(self, observes: bool):
        super().__init__()
        self.observes = observes
        self.observed = 0

    def observe(self, controller, step, layer, experts):
        self.observed += 1
        return None


def test_a_predictor_that_does_not_observe_is_not_called_and_the_trace_is_still_recorded():
    # Note [Routings nobody reads]: a predictor with observes = False is
    # never given the routings, on either path, and a sync-free step with
    # no guess to score records its trace without observe: the same trace
    # as a predictor that observes, and the same tokens. A predictor
    # assigned after construction is taken with what it says of itself.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(ref)
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(4))
    seq_ref, _ = greedy(ref, ids, steps=6)
    traces = {}
    for observes in (False, True, "assigned"):
        model = copy.deepcopy(ref)
        gate = _CountingGate(observes is not False)
        ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host",
                                  predictor=None if observes == "assigned" else gate, record_trace=True,
                                  preload=False)
        try:
            if observes == "assigned":
                ctl.predictor = gate
            seq, _ = greedy(model, ids, steps=6)
            ctl.flush()
            assert torch.equal(seq, seq_ref)
            assert ctl.sync_free_steps > 0  # the sync-free path ran (and the synced one: the prefill)
            routed_layers = sum(1 for step in ctl.trace.steps for experts in step if experts)
            assert routed_layers == 6 * cfg.num_hidden_layers
            if observes is False:
                assert gate.observed == 0
            else:
                assert gate.observed == routed_layers  # every layer of every step, either path
            traces[observes] = ctl.trace.steps
        finally:
            ctl.close()
    assert traces[False] == traces[True] == traces["assigned"]


def _decode_calls(ref, ids, count, per, steps, gate):
    """Decodes `ids` on a copy of `ref` offloaded with a cache of `count`
    experts, the engine drained after every step (so that the two runs
    compared see the same cache), and with the next-layer gate from the
    first decode step on when `gate`. Returns (the engine calls of each
    decode step, whether each ran sync-free, the tokens, the controller's
    predicted_total)."""
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=count * (per + 512), backend="host", preload=False)
    log, marks = [], []

    class EachStep(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):  # after each forward: the prompt's, then each decode step's
            ctl.flush()
            wait_drained(ctl.handle.real)
            if gate and ctl.predictor is None:
                ctl.predictor = NextLayerGatePredictor()
            marks.append((len(log), ctl.sync_free_active))
            return scores

    try:
        ctl.handle = CountingHandle(ctl.handle, log)
        seq = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=steps, do_sample=False,
                             pad_token_id=0, logits_processor=transformers.LogitsProcessorList([EachStep()]))
        calls = [log[i:j] for (i, _), (j, _) in zip(marks, marks[1:])]
        return calls, [free for _, free in marks[1:]], seq, ctl.predicted_total
    finally:
        ctl.close()


def test_the_gate_decodes_a_sync_free_step_as_on_demand_does():
    # Note [Routings nobody reads]: the next-layer gate guesses on synced
    # steps only (its guesses ride on their routing read-back), so a
    # sync-free step of the gate makes on-demand's engine calls, argument
    # for argument, from the same cache. Both offloads here make the same
    # calls up to the prompt's logits; the gate is set from then on.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(ref)
    every = num_experts * cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(2))
    # A cache of every expert, a prompt that reads them all: every decode
    # step runs sync-free, and each makes the same calls on both sides.
    od_calls, od_free, od_seq, _ = _decode_calls(ref, ids, every, per, 8, gate=False)
    gate_calls, gate_free, gate_seq, _ = _decode_calls(ref, ids, every, per, 8, gate=True)
    assert torch.equal(od_seq, gate_seq)
    assert od_free == gate_free == [True] * 7
    assert all(calls for calls in od_calls)
    assert gate_calls == od_calls
    # Two experts fewer: some decode steps run synced, and on those the gate
    # is live (it sends guesses that on-demand does not), so the equality
    # above is not a gate that never ran.
    # Which steps run synced is not compared between the two runs: with a
    # cache short of a step's reads, a sync-free step's prefetches race its
    # later layers' pins (host backend: a worker thread), so its misses, and
    # the paths after it, vary with the machine's load (seen on a loaded
    # 2-core VM, in the on-demand run alone).
    od_calls, od_free, od_seq, _ = _decode_calls(ref, ids, every - 2, per, 8, gate=False)
    gate_calls, gate_free, gate_seq, predicted = _decode_calls(ref, ids, every - 2, per, 8, gate=True)
    assert torch.equal(od_seq, gate_seq)

    def guessed(calls):
        return any(k.get("prefetch") is not None for name, _, k in calls if name == "exchange")

    assert False in gate_free and predicted > 0
    assert guessed(gate_calls[gate_free.index(False)])  # its first synced step: the gate guessed
    assert not any(guessed(calls) for calls, free in zip(od_calls, od_free) if not free)


def test_prefill_reads_the_next_layer_ahead():
    # Note [Prefill read-ahead]: with no predictor, a prompt's call, routed
    # to every expert of its layer, queues the next layer's experts; the
    # tokens do not change. Not with a predictor, nor on a cache that does
    # not hold two layers' experts, nor on decode calls.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(ref)
    layers = cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(3))
    seq_ref, logits_ref = greedy(ref, ids, steps=3)
    for count, predictor, expect in ((num_experts * layers, None, layers - 1),
                                     (num_experts * layers, NextLayerGatePredictor(), 0),
                                     (num_experts + 3, None, 0)):
        model = copy.deepcopy(ref)
        ctl = offload_moe_experts(model, device_budget_bytes=count * (per + 512), backend="host",
                                  predictor=predictor, sync_free=False, preload=False)
        try:
            seq, logits = greedy(model, ids, steps=1)  # the prefill only
            assert ctl.read_aheads == expect
            if predictor is None:  # no other prefetch on this path: the read-ahead's ids, each layer's experts
                assert ctl.handle.stats()["requests"] == expect * num_experts
            seq, logits = greedy(model, ids, steps=3)  # a second prefill and two decode steps
            assert ctl.read_aheads == 2 * expect
            assert ctl.report()["read_aheads"] == 2 * expect
            assert torch.equal(seq, seq_ref)
            for a, b in zip(logits, logits_ref):
                assert torch.equal(a, b)
        finally:
            ctl.close()


@pytest.mark.parametrize("gate", [False, True], ids=["on-demand", "gate"])
def test_each_step_takes_the_path_its_misses_call_for(gate):
    # Note [Which path a step takes]: a cache far smaller than the working
    # set misses often, and the steps go synced; one that holds everything
    # misses only while it warms, and the steps go back to sync-free. The
    # gate follows the same choice and guesses on the synced steps.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(ref)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    seq_ref, _ = greedy(ref, ids, steps=8)
    for count, sync_free_at_end in ((3, False), (num_experts * cfg.num_hidden_layers, True)):
        model = copy.deepcopy(ref)
        ctl = offload_moe_experts(model, device_budget_bytes=count * (per + 512), backend="host",
                                  predictor=NextLayerGatePredictor() if gate else None, preload=False)
        try:
            seq, _ = greedy(model, ids, steps=8)
            assert torch.equal(seq, seq_ref)
            assert ctl.path_switches >= 1  # the first steps miss (a cold cache)
            assert (ctl.predicted_total > 0) is gate  # the gate guessed on the synced steps
            # The same prompt again, on the cache as the first run left it
            # (every copy landed): the big cache misses nothing and the steps
            # go sync-free; the small one keeps missing and stays synced.
            ctl.flush()
            wait_drained(ctl.handle)
            seq, _ = greedy(model, ids, steps=8)
            assert torch.equal(seq, seq_ref)
            assert ctl.sync_free_active is sync_free_at_end
        finally:
            ctl.close()
    # sync_free=True: every step sync-free, whatever it misses
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host", sync_free=True)
    try:
        seq, _ = greedy(model, ids, steps=8)
        assert torch.equal(seq, seq_ref)
        assert ctl.path_switches == 0 and ctl.sync_free_active
    finally:
        ctl.close()


def test_sync_free_counts_a_routing_against_the_pins_it_ran_on():
    # A noted routing's hits and host reads are those of the pins its layer
    # made: pinning the same layer again (here without a layer 0 between,
    # as a caller driving the layers itself might) reads the noted routings
    # first, before the layer's pinned row is rewritten.
    cfg = family_configs()["olmoe"]
    model = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=4 * (per + 512), backend="host", sync_free=True)
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
        greedy(model, ids, steps=2)
        ctl.flush()
        ctl.release_held()
        wait_drained(ctl.handle)
        every = np.arange(num_experts)
        slots = offloaded_experts(model)[0].__dict__["_prefetch_offload"].slots
        assert 2 <= slots < num_experts
        ctl.exchange(1, every[:slots], {}, None)  # layer 1 fills the cache
        ctl.release_held()
        _, pinned = ctl.pin_layer(1, None, None)
        first = pinned.copy()
        assert first.sum() == slots
        ctl.note_routing(1, torch.from_numpy(every).view(1, -1))  # routed to every expert
        ctl.release_held()
        ctl.exchange(2, every[:slots], {}, None)  # layer 2 takes the whole cache
        ctl.release_held()
        hits, reads = ctl.pinned_hits, ctl.zero_copy_reads
        _, pinned = ctl.pin_layer(1, None, None)
        assert not pinned.any()  # this call pinned nothing of layer 1...
        # ...and the routing noted before it counted the pins it ran on.
        assert (ctl.pinned_hits - hits, ctl.zero_copy_reads - reads) == (slots, num_experts - slots)
        assert len(ctl.sync._routings) == 0
    finally:
        ctl.close()


def test_an_exchange_drops_a_guess_unregistered_behind_it():
    # The guesses beyond the nearest layer are queued after the step, which
    # has acquired by then. One whose id was unregistered behind the
    # controller is dropped there, as the engine's step drops its own (Note
    # [A step's prefetches after its wait]): the exchange returns, holds what
    # it acquired and queues the other guesses.
    cfg = family_configs()["olmoe"]
    model = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=num_experts * (per + 512), backend="host",
                              sync_free=False)
    try:
        ctl.exchange(0, np.array([0, 1]), {}, None)  # layer 0's two experts resident
        ctl.release_held()
        wait_drained(ctl.handle)
        ctl.handle.pause()  # the guesses stay queued, where the test can see them
        gone = int(ctl.ids(2, np.array([3]))[0])
        ctl.handle.unregister(gone)
        where = ctl.exchange(0, np.array([0, 1]), {1: np.array([5]), 2: np.array([2, 3, 4])}, None)
        assert where.shape[0] == 2  # acquired, and held until the next exchange
        assert ctl._held.tolist() == ctl.ids(0, np.array([0, 1])).tolist()
        queued = ctl.handle.queued()
        want = [(1, int(ctl.ids(1, np.array([5]))[0]))] + [(2, int(i)) for i in ctl.ids(2, np.array([2, 4]))]
        assert sorted(queued) == sorted(want) and all(i != gone for _, i in queued)
        ctl.handle.resume()
    finally:
        ctl.close()


def test_sync_free_clears_hints_none_of_which_are_this_ranks():
    # Expert parallel: the hints read from the last step are filtered to this
    # rank's experts before they reach its engine. When none is, they are
    # still done with: kept, they would be filtered again at every layer and
    # pile up step after step.
    cfg = family_configs()["olmoe"]
    model = build(cfg, experts_implementation="batched_mm")
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", sync_free=True)
    try:
        ctl.local = np.zeros((cfg.num_hidden_layers, cfg.num_experts), dtype=bool)  # as if all were another rank's
        ctl._late_hints = [(1, np.array([0, 1]), 5)]
        ctl.pin_layer(0, None, None)
        assert ctl._late_hints == []
        ctl.release_held()
    finally:
        ctl.close()


def test_sync_free_option():
    cfg = family_configs()["qwen3_moe"]
    model = build(cfg, experts_implementation="batched_mm")
    for bad in ("yes", 1, 0.0):  # 1 == True: refused all the same
        with pytest.raises(TypeError, match="sync_free"):
            offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", sync_free=bad)
    with pytest.raises(ValueError, match="OffloadedMoEBlock"):
        from prefetch.integration import OffloadedMoEBlock
        router = torch.nn.Linear(8, 4, bias=False)
        block = OffloadedMoEBlock(router, [torch.nn.Linear(8, 8) for _ in range(4)], top_k=2)
        offload_moe_experts(torch.nn.Sequential(block), device_budget_bytes=1 << 20, backend="host",
                            sync_free=True)
    assert not offloaded_experts(model)
    # A device-side predictor guesses on the synced steps; auto lets the
    # per-step choice run the others sync-free (the choice is tested below).
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host",
                              predictor=NextLayerGatePredictor())
    assert ctl.sync_free is True and ctl.sync._adaptive
    ctl.close()
    model = build(cfg, experts_implementation="batched_mm")
    ref = build(cfg, experts_implementation="batched_mm")
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host",
                              predictor=NextLayerGatePredictor(), sync_free=True)
    try:
        assert ctl.sync_free is True
        ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
        assert torch.equal(greedy(model, ids)[0], greedy(ref, ids)[0])
    finally:
        ctl.close()


@pytest.mark.parametrize("sync_free", [True, False])
def test_a_device_side_predictor_guesses_on_synced_forwards_only(sync_free):
    # The next-layer gate's guesses are device tensors that ride a layer's
    # routing read-back; a sync-free forward reads no routing back per
    # layer, so the gate is not called there and such a step makes the
    # engine calls on-demand makes (docs/results.md, stop 48: why the gate
    # and on-demand tie at batch 1 and a quarter cached). A synced forward
    # calls it on every layer (with no pause for a cache that fetches
    # nothing: Note [Speculation with nothing to fetch]). Same tokens
    # either way.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    model = copy.deepcopy(ref)
    gate = NextLayerGatePredictor()
    calls = []
    predict = gate.predict

    def counted(ctl, step, layer, hidden):
        calls.append((step, layer))
        return predict(ctl, step, layer, hidden)

    gate.predict = counted
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", predictor=gate,
                              sync_free=sync_free)
    ctl.probe_when_nothing_fetched = False
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
        assert_same_decode(ref, model, ids, steps=4)
        forwards = 4
        if sync_free:
            assert calls == [] and ctl.report()["sync_free_steps"] == forwards
        else:
            assert calls == [(s, layer) for s in range(forwards) for layer in range(cfg.num_hidden_layers)]
    finally:
        ctl.close()


def test_sync_free_engine_calls_per_layer_then_per_step():
    # A sync-free step makes one engine call a layer; once a step missed
    # nothing and left nothing to fetch, the next ones make one call in all
    # (Note [Steady pins]): every layer's resident experts pinned at layer
    # 0, released once at the last layer. The same bits either way.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", preload=False)
    real = ctl.handle
    ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
    greedy(model, ids, steps=3)  # reads every expert it routes to once, and prefetches it
    ctl.flush()
    wait_drained(real)
    assert ctl.report()["zero_copy_reads"] > 0  # the sync-free path ran
    assert ctl.steady_steps == 0  # every step so far missed
    ctl.handle = CountingHandle(real)
    calls = ctl.handle.calls
    try:
        seq, logits = greedy(model, ids, steps=3)  # the same routing, now every expert cached
        seq_ref, logits_ref = greedy(ref, ids, steps=3)
        assert torch.equal(seq, seq_ref)
        for a, b in zip(logits, logits_ref):
            assert torch.equal(a, b)
        # Three forwards (the prompt's and two decode steps), each released
        # once; a steady one made one step call, the others one a layer.
        # The first may be either (the last request's last step is what it
        # reads); the decode steps after a steady one are steady.
        steady = ctl.steady_steps
        assert steady >= 2
        assert calls["exchange"] == steady + (3 - steady) * cfg.num_hidden_layers
        assert calls["release"] == 3 and calls["other"] == 0
        assert real.stats()["pinned_count"] == 0
    finally:
        ctl.handle = real
        ctl.close()


def test_steady_pins_end_at_a_miss():
    # Note [Steady pins]: a request whose experts are all cached decodes with
    # one pin call a step; another request that routes elsewhere misses,
    # and its steps go back to one call a layer. The bits are the untouched
    # model's throughout, and nothing stays pinned after a forward.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    model = copy.deepcopy(ref)
    # Room for every expert: the first request, run again once its copies
    # have landed, misses nothing; the other one's prompt and batch of 2
    # route to experts the first never read (first reads: misses).
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", sync_free=True, preload=False)
    real = ctl.handle
    try:
        first = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
        other = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(7))
        greedy(model, first, steps=6)
        ctl.flush()
        wait_drained(real)
        greedy(model, first, steps=6)
        assert ctl.steady_steps >= 5  # every decode step of the second run
        steady = ctl.steady_steps
        ctl.handle = CountingHandle(real)
        seq, logits = greedy(model, other, steps=6)
        seq_ref, logits_ref = greedy(ref, other, steps=6)
        assert torch.equal(seq, seq_ref)
        for a, b in zip(logits, logits_ref):
            assert torch.equal(a, b)
        assert ctl.report()["zero_copy_reads"] > 0  # the other request missed...
        # ...and its missing steps made one call a layer: more calls than forwards.
        layered = 6 - (ctl.steady_steps - steady)
        assert layered > 0
        assert ctl.handle.calls["exchange"] >= layered * cfg.num_hidden_layers
        assert real.stats()["pinned_count"] == 0
    finally:
        ctl.handle = real
        ctl.close()


def test_sync_free_scores_host_guesses_and_pauses_wrong_ones():
    # The sync-free path scores a host-side predictor's guesses when it reads
    # the routings back, a step late, as the synced path scores them at once:
    # the report's precision is the predictor's, and guesses that are always
    # wrong pause its speculation there too (Note [Speculation by its
    # precision]): the predictor then runs on one layer in eight.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    per, _ = expert_bytes(ref)
    ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host", sync_free=False,
                              record_trace=True)
    seq_ref, _ = greedy(model, ids, steps=12)
    trace = ctl.trace
    ctl.close()
    for right in (True, False):
        predictor = SwitchingPredictor(trace)
        predictor.right = right
        model = copy.deepcopy(ref)
        ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host", sync_free=True,
                                  predictor=predictor)
        try:
            seq, _ = greedy(model, ids, steps=12)
            assert torch.equal(seq, seq_ref)
            r = ctl.report()
            assert r["zero_copy_reads"] > 0 and ctl.predicted_total > 0  # sync-free steps, and scored
            layers = 12 * cfg.num_hidden_layers
            if right:
                assert r["prediction_precision"] == 1.0 and r["speculation_paused_layers"] == 0
                assert predictor.calls == layers
            else:
                assert r["prediction_precision"] == 0.0 and ctl.speculation_paused
                assert r["speculation_paused_layers"] > 0 and predictor.calls < layers // 2
        finally:
            ctl.close()


def next_layer_routing(trace, controller, step, layer):
    """(the layer after `layer`, the set of experts `trace` routes there),
    the next step's first layer after the last; None past the trace."""
    nxt, nstep = layer + 1, step
    if nxt == controller.num_layers:
        nxt, nstep = 0, step + 1
    if nstep >= len(trace.steps):
        return None
    return nxt, set(trace.steps[nstep][nxt])


class PaddedPredictor:
    """Guesses the next layer's experts from the trace and `pad` experts it
    does not route to: right about each routed expert, and wrong about as
    many more as `pad`."""

    host_guesses = True

    def __init__(self, trace, pad: int):
        self.trace = trace
        self.pad = pad

    def predict(self, controller, step, layer, hidden):
        got = next_layer_routing(self.trace, controller, step, layer)
        if got is None:
            return {}
        nxt, want = got
        wrong = [e for e in range(controller.num_experts) if e not in want][: self.pad]
        return {nxt: np.array(sorted(want | set(wrong)), dtype=np.int64)}

    def observe(self, controller, step, layer, experts):
        return None


def test_speculation_pauses_while_most_of_its_copies_are_wasted():
    # Note [Speculation by what its copies waste]: a predictor right about
    # every routed expert that also names 6 others (precision about 0.4,
    # above the precision pause's 0.25) in a cache of 8 slots, which one
    # step's 16 reads overflow: most of its copies are evicted unused, and
    # speculation pauses. speculation_max_wasted = 1 never pauses (and the
    # guesses then copy more); the same predictor without the wrong guesses
    # wastes nothing and never pauses. Tokens are the untouched model's.
    cfg = transformers.OlmoeConfig(**{**COMMON, "num_hidden_layers": 4}, intermediate_size=40, num_experts=16,
                                   num_experts_per_tok=4)
    ref = build(cfg, experts_implementation="batched_mm")
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    seq_ref, _ = greedy(ref, ids, steps=24)
    recorder = copy.deepcopy(ref)
    ctl = offload_moe_experts(recorder, device_budget_bytes=1 << 22, backend="host", record_trace=True)
    try:
        assert torch.equal(greedy(recorder, ids, steps=24)[0], seq_ref)
        trace = ctl.trace
    finally:
        ctl.close()
    per, _ = expert_bytes(ref)
    got = {}
    for name, pad, max_wasted in (("wasteful", 6, 0.5), ("never paused", 6, 1.0), ("right", 0, 0.5)):
        model = copy.deepcopy(ref)
        ctl = offload_moe_experts(model, device_budget_bytes=8 * (per + 512), backend="host",
                                  predictor=PaddedPredictor(trace, pad), sync_free=False)
        ctl.speculation_max_wasted = max_wasted
        try:
            seq, _ = greedy(model, ids, steps=24)
            assert torch.equal(seq, seq_ref)
            report = ctl.report()
            assert report["prediction_precision"] > 0.35  # never a precision pause
            got[name] = (report["speculation_paused_layers"], ctl.handle.stats())
        finally:
            ctl.close()
    paused, stats = got["wasteful"]
    assert paused > 0 and stats["wasted"] > 0
    never, never_stats = got["never paused"]
    assert never == 0 and never_stats["copies"] > stats["copies"]
    assert never_stats["wasted"] > 0.5 * (never_stats["copies"] - never_stats["on_demand"])
    right, right_stats = got["right"]
    assert right == 0 and right_stats["wasted"] == 0


def test_wait_preloaded_returns_once_every_preloaded_expert_is_cached(capsys):
    # Note [Waiting for the preload]: copies of 30 ms each on the fault
    # backend, so the preload is still going right after offloading: a zero
    # timeout says so, and the wait without one returns once every
    # preloaded expert is resident, nothing queued, the bits unchanged.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(ref)
    total = num_experts * cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    seq_ref, _ = greedy(ref, ids, steps=3)
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=total * (per + 512), backend="fault",
                              handle_options={"faults": {"copy_delay_us": 30_000}})
    try:
        assert ctl.preloaded == total
        for bad in (-1, float("nan")):
            with pytest.raises(ValueError, match="timeout"):
                ctl.wait_preloaded(timeout=bad)
        assert ctl.wait_preloaded(timeout=0) is False  # 30 ms a copy: not all landed yet
        assert ctl.wait_preloaded(progress=True) is True
        s = ctl.handle.stats()
        assert s["queue_depth"] == 0 and s["copies"] == total and s["resident_count"] == total
        assert "prefetch: preloading," in capsys.readouterr().out
        before = ctl.handle.stats()["copies"]
        assert torch.equal(greedy(model, ids, steps=3)[0], seq_ref)
        assert ctl.handle.stats()["copies"] == before  # every expert was there: nothing copied
    finally:
        ctl.close()
    with pytest.raises(prefetch.HandleClosedError, match="closed"):
        ctl.wait_preloaded()


def test_preload_fills_the_cache_before_the_first_token():
    # Note [Preload]: where every expert fits, the cache starts filling at
    # offload (the least urgent band) and the first tokens find every
    # expert cached; a smaller cache preloads only when asked, the first
    # experts of every layer in turn, as many as it holds. The bits are the
    # untouched model's either way.
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    per, num_experts = expert_bytes(ref)
    layers = cfg.num_hidden_layers
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
    seq_ref, logits_ref = greedy(ref, ids, steps=4)
    for count, preload, want in ((num_experts * layers, None, num_experts * layers), (5, None, 0),
                                 (5, True, 5), (num_experts * layers, False, 0)):
        model = copy.deepcopy(ref)
        ctl = offload_moe_experts(model, device_budget_bytes=count * (per + 512), backend="host",
                                  preload=preload)
        try:
            assert ctl.preloaded == want and ctl.report()["preloaded"] == want
            s = wait_drained(ctl.handle)
            assert s["resident_count"] == want and s["copies"] == want and s["evictions"] == 0
            held = set(ctl.handle.resident())
            resident = [(layer, e) for layer in range(layers) for e in range(num_experts)
                        if ctl.prefetcher.tensor_id(layer, e) in held]
            if want == 5:  # the first experts of every layer in turn
                assert resident == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0)]
            seq, logits = greedy(model, ids, steps=4)
            assert torch.equal(seq, seq_ref)
            for a, b in zip(logits, logits_ref):
                assert torch.equal(a, b)
            report = ctl.report()
            if count == num_experts * layers and preload is None:
                # every read found its expert cached: no read from host
                # memory, no copy after the preload's
                assert report["hit_rate"] == 1.0 and report["zero_copy_reads"] == 0
                assert report["copies"] == want
        finally:
            ctl.close()
    untouched = copy.deepcopy(ref)
    for bad in ("yes", 1, 0.0):
        with pytest.raises(TypeError, match="preload"):
            offload_moe_experts(untouched, device_budget_bytes=1 << 20, backend="host", preload=bad)
    assert offloaded_experts(untouched) == []
    assert torch.equal(greedy(untouched, ids, steps=4)[0], seq_ref)


def test_offloaded_experts_hold_no_weights():
    model = build(family_configs()["mixtral"])
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host")
    try:
        for m in offloaded_experts(model):
            assert sum(p.numel() for p in m.parameters()) == 0
        assert ctl.handle.stats()["registered"] == 3 * 6
    finally:
        ctl.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
@pytest.mark.parametrize("impl", ["eager", "grouped_mm", "batched_mm"])
def test_layers_larger_than_the_cache_run_in_pieces(family, impl):
    # A budget of 3 of a layer's 8 (mixtral: 6) experts; a 6-token prompt at
    # batch 2 routes to nearly all of them, so prefill layers run in pieces.
    cfg = family_configs()[family]
    ref = build(cfg, experts_implementation=impl)
    model = copy.deepcopy(ref)
    per, _ = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host",
                              predictor=NextLayerGatePredictor(), record_trace=True)
    try:
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
        seq_ref, _ = greedy(ref, ids, steps=5)
        seq, _ = greedy(model, ids, steps=5)
        assert torch.equal(seq, seq_ref)
        # The prompt's layers routed to more experts than fit: pieces ran.
        assert max(len(experts) for experts in ctl.trace.steps[0]) > 3
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


def test_one_expert_larger_than_the_budget_is_refused_at_once():
    model = build(family_configs()["olmoe"])
    per, _ = expert_bytes(model)
    before = [p.clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="budget"):
        offload_moe_experts(model, device_budget_bytes=per // 2, backend="host")
    after = list(model.parameters())
    assert len(before) == len(after) and all(torch.equal(a, b) for a, b in zip(before, after))
    assert not offloaded_experts(model)


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
def test_a_backward_through_offloaded_experts_raises_and_the_forward_still_runs(impl):
    # Note [No backward through the cache]: a forward outside torch.no_grad
    # gives the untouched model's logits; its backward raises instead of
    # giving wrong gradients (the slots hold other experts by then).
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation=impl)
    model = copy.deepcopy(ref)
    per, num_experts = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 1) * (per + 512), backend="host",
                              progress=False)
    try:
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
        with torch.enable_grad():
            logits = model(ids).logits
            assert logits.requires_grad
            assert torch.equal(logits, ref(ids).logits)
            with pytest.raises(RuntimeError, match="backward through MoE experts offloaded by prefetch"):
                logits.sum().backward()
            # Only the last layer's router trains: its experts' input needs no gradient, their routing weights do.
            last = f"model.layers.{cfg.num_hidden_layers - 1}.mlp.gate.weight"
            for name, p in model.named_parameters():
                p.requires_grad_(name == last)
            logits = model(ids).logits
            assert logits.requires_grad
            with pytest.raises(RuntimeError, match="backward through MoE experts offloaded by prefetch"):
                logits.sum().backward()
        with torch.no_grad():
            assert torch.equal(model(ids).logits, ref(ids).logits)
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


@pytest.mark.parametrize("trains", ["input", "router"])
def test_a_backward_through_a_generic_offloaded_block_raises(trains):
    # Note [No backward through the cache]; with a frozen input and a router
    # that trains, the experts got no gradient, without a word. (One layer:
    # a second one's input would need a gradient through the first's router.)
    torch.manual_seed(3)
    layers_ref, layers_off = generic_layers(1, 4)
    ctl = offload_moe_experts(layers_off, device_budget_bytes=1 << 20, backend="host")
    try:
        x = torch.randn(3, 16, requires_grad=trains == "input")
        a, b = x, x
        with torch.enable_grad():
            for ref_layer, off_layer in zip(layers_ref, layers_off):
                a = a + ref_layer(a)
                b = b + off_layer(b)
            assert torch.equal(a, b) and b.requires_grad
            a.sum().backward()  # the reference trains
            with pytest.raises(RuntimeError, match="backward through MoE experts offloaded by prefetch"):
                b.sum().backward()
    finally:
        ctl.close()


def test_a_generic_block_converted_after_offloading_says_so():
    torch.manual_seed(3)
    layers_ref, layers_off = generic_layers(1, 4)
    # Converted before offloading (after the blocks were built): the experts follow.
    layers_ref.double()
    layers_off.double()
    x = torch.randn(3, 16, dtype=torch.float64)
    ctl = offload_moe_experts(layers_off, device_budget_bytes=1 << 20, backend="host")
    try:
        with torch.no_grad():
            assert torch.equal(layers_off[0](x), layers_ref[0](x))
        layers_off.float()
        with pytest.raises(RuntimeError, match=r"converted to torch.float32 after offload_moe_experts, but its "
                                               r"offloaded experts were registered as torch.float64"):
            with torch.no_grad():
                layers_off[0](x.float())
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


@pytest.mark.parametrize("convert", ["dtype", "half"])
def test_converting_the_model_after_offloading_says_so(convert):
    # The experts stay as packed (float32 here): a model converted after
    # offloading used to fail inside the experts with a dtype mismatch that
    # did not mention the offload.
    cfg = family_configs()["qwen3_moe"]
    model = build(cfg)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", progress=False)
    try:
        model.to(torch.float64) if convert == "dtype" else model.half()
        ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
        want = "float64" if convert == "dtype" else "float16"
        with pytest.raises(RuntimeError, match=rf"converted to torch.{want} on cpu after offload_moe_experts, but "
                                               r"its offloaded experts were packed as torch.float32"):
            with torch.no_grad():
                model(ids)
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


def test_offloading_twice_says_so():
    model = build(family_configs()["olmoe"])
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host")
    try:
        with pytest.raises(ValueError, match="already offloaded"):
            offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host")
    finally:
        ctl.close()


def test_one_engine_call_per_layer():
    # Each MoE layer crosses into the engine once (PrefetchHandle.step), plus
    # one release at the end of each forward; the guesses ride along.
    cfg = family_configs()["qwen3_moe"]
    model = build(cfg, experts_implementation="grouped_mm")
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host",
                              predictor=NextLayerGatePredictor())
    real = ctl.handle
    ctl.handle = CountingHandle(real)
    calls = ctl.handle.calls
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 4), generator=torch.Generator().manual_seed(1))
        greedy(model, ids, steps=3)
        forwards = 3
        assert calls["exchange"] == forwards * cfg.num_hidden_layers
        assert calls["release"] == forwards and calls["other"] == 0
        assert real.stats()["pinned_count"] == 0
    finally:
        ctl.handle = real
        ctl.close()


class TinyExpert(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.w1 = nn.Linear(h, i, bias=False)
        self.w3 = nn.Linear(h, i, bias=False)
        self.w2 = nn.Linear(i, h, bias=False)

    def forward(self, x):
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class ReferenceBlock(nn.Module):
    def __init__(self, router, experts, top_k):
        super().__init__()
        self.router, self.experts, self.top_k = router, experts, top_k

    def forward(self, x):
        h = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(h).float(), dim=-1)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(h.dtype)
        out = torch.zeros_like(h)
        for e in sorted(set(idx.flatten().tolist())):
            tok, pos = torch.where(idx == e)
            out.index_add_(0, tok, self.experts[e](h[tok]) * w[tok, pos, None])
        return out.reshape(x.shape)


def generic_layers(layers: int, experts: int):
    """`layers` reference MoE blocks (hidden 16, top-2 of `experts` TinyExperts)
    and OffloadedMoEBlocks with copies of the same weights."""
    layers_ref, layers_off = nn.ModuleList(), nn.ModuleList()
    for _ in range(layers):
        router = nn.Linear(16, experts, bias=False)
        block = nn.ModuleList(TinyExpert(16, 24) for _ in range(experts))
        layers_ref.append(ReferenceBlock(router, block, 2))
        layers_off.append(OffloadedMoEBlock(copy.deepcopy(router), list(copy.deepcopy(block)), 2))
    return layers_ref, layers_off


def test_generic_block_matches_reference():
    torch.manual_seed(3)
    layers_ref, layers_off = generic_layers(4, 5)
    ctl = offload_moe_experts(layers_off, device_budget_bytes=7 * 4 * (3 * 16 * 24) + 4096, backend="host",
                              predictor=NextLayerGatePredictor())
    real = ctl.handle
    ctl.handle = counting = CountingHandle(real)
    try:
        x = torch.randn(3, 2, 16)
        for forward in range(1, 4):
            a, b = x, x
            for ref_layer, off_layer in zip(layers_ref, layers_off):
                a = a + ref_layer(a)
                b = b + off_layer(b)
            assert torch.equal(a, b)
            # One engine call per block (release the last block's, acquire
            # this one's, queue the guesses); the last block releases its own.
            assert counting.calls == {"exchange": 4 * forward, "release": forward, "other": 0}
            assert real.stats()["pinned_count"] == 0
            x = torch.randn(3, 2, 16)
        assert real.stats()["evictions"] > 0
    finally:
        ctl.handle = real
        ctl.close()


def test_generic_block_rejects_bad_input():
    with pytest.raises(ValueError):
        OffloadedMoEBlock(nn.Linear(4, 2), [], 1)
    with pytest.raises(ValueError):
        OffloadedMoEBlock(nn.Linear(4, 2), [TinyExpert(4, 4), TinyExpert(4, 4)], 3)
    with pytest.raises(ValueError, match="same parameters \\(names and shapes\\)"):
        OffloadedMoEBlock(nn.Linear(4, 2), [TinyExpert(4, 4), TinyExpert(4, 8)], 1)
    block = OffloadedMoEBlock(nn.Linear(4, 2), [TinyExpert(4, 4), TinyExpert(4, 4)], 1)
    with pytest.raises(RuntimeError, match="not attached"):
        block(torch.randn(1, 4))
    with pytest.raises(ValueError, match="no MoE block"):
        offload_moe_experts(nn.Linear(3, 3), device_budget_bytes=1 << 20, backend="host")


def test_generic_block_serves_the_weights_its_experts_have_at_offload():
    # Weights loaded after the block is built and before it is offloaded
    # (load_state_dict(assign=True) replaces the parameters: a copy taken at
    # build would keep the old ones) are the weights the engine serves.
    torch.manual_seed(5)
    layers_ref, layers_off = nn.ModuleList(), nn.ModuleList()
    for _ in range(2):
        router = nn.Linear(16, 4, bias=False)
        experts = [TinyExpert(16, 24) for _ in range(4)]
        layers_off.append(OffloadedMoEBlock(copy.deepcopy(router), experts, 2))
        fresh = [TinyExpert(16, 24) for _ in range(4)]
        for expert, new in zip(experts, fresh):
            expert.load_state_dict(new.state_dict(), assign=True)
        layers_ref.append(ReferenceBlock(router, nn.ModuleList(fresh), 2))
    ctl = offload_moe_experts(layers_off, device_budget_bytes=1 << 20, backend="host")
    try:
        x = torch.randn(2, 3, 16)
        a, b = x, x
        for ref_layer, off_layer in zip(layers_ref, layers_off):
            a, b = a + ref_layer(a), b + off_layer(b)
        assert torch.equal(a, b)
    finally:
        ctl.close()


def test_generic_block_capacity_comes_from_the_template_shapes_wherever_it_is():
    # A model moved to a GPU before offloading has its template there
    # (test_generic_block_waits_for_the_gpu_once_a_layer offloads one): the
    # slot comes from shapes and dtypes, which a meta template has too.
    experts = [TinyExpert(16, 24) for _ in range(3)]
    block = OffloadedMoEBlock(nn.Linear(16, 3, bias=False), experts, 2)
    slot = 3 * 16 * 24 * 4  # three float32 weights of 16 x 24, each a multiple of the alignment
    assert block.capacity(10 * slot) == 10
    experts[0].to("meta")
    assert block.capacity(10 * slot) == 10
    experts[0].to(torch.float64)
    assert block.capacity(10 * slot) == 5


def test_generic_expert_changed_since_build_is_refused_and_no_block_changes():
    layers_off = nn.ModuleList()
    for _ in range(3):
        experts = [TinyExpert(16, 24) for _ in range(4)]
        layers_off.append(OffloadedMoEBlock(nn.Linear(16, 4, bias=False), experts, 2))
    last = experts[3]
    last.extra = nn.Linear(2, 2)  # a parameter expert 0 does not have
    with pytest.raises(ValueError, match="expert 3 of MoE layer 2 has the parameters"):
        offload_moe_experts(layers_off, device_budget_bytes=1 << 20, backend="host")
    assert all(b.controller is None for b in layers_off)
    assert all(p.numel() > 0 for b in layers_off for p in b._template.parameters())
    del last.extra
    # Weights of another shape: the slots are sized from expert 0's, so it
    # is refused here rather than failing in a forward.
    wide = last.w1.weight
    last.w1.weight = nn.Parameter(torch.zeros(48, 16))
    with pytest.raises(ValueError, match=r"expert 3 of MoE layer 2 has the parameters .*\('w1.weight', \(48, 16\)\)"):
        offload_moe_experts(layers_off, device_budget_bytes=1 << 20, backend="host")
    assert all(b.controller is None for b in layers_off)
    last.w1.weight = wide
    ctl = offload_moe_experts(layers_off, device_budget_bytes=1 << 20, backend="host")
    ctl.close()


def record(model, ids):
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", record_trace=True)
    greedy(model, ids)
    return ctl


def test_oracle_replays_a_recorded_trace_exactly(tmp_path):
    cfg = family_configs()["olmoe"]
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(2))
    recorder = record(build(cfg), ids)
    trace = recorder.trace
    recorder.close()
    path = tmp_path / "trace.json"
    trace.save(str(path))
    loaded = RoutingTrace.load(str(path))
    assert loaded.steps == trace.steps and len(loaded.steps) == 4  # prefill + 3 decode steps
    model = build(cfg)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", predictor=OraclePredictor(loaded))
    try:
        greedy(model, ids)
        report = ctl.report()
        assert report["prediction_precision"] == 1.0 and report["prediction_recall"] == 1.0
        assert ctl.handle.eviction_policy == "cyclic"
        assert ctl.handle.hint_clock() is None  # hints=None: none sent to a policy that ignores them
    finally:
        ctl.close()


def test_oracle_with_next_use_eviction_matches_original():
    # A real model, a budget that forces evictions, the oracle's hints on the
    # next-use policy: the logits must not change and the hints must count.
    cfg = family_configs()["qwen3_moe"]
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(3))
    recorder = record(build(cfg), ids)
    trace = recorder.trace
    recorder.close()
    ref = build(cfg)
    model = copy.deepcopy(ref)
    per, num_experts = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="host",
                              predictor=OraclePredictor(trace, distance=1),
                              handle_options={"eviction_policy": "next-use"})
    try:
        assert_same_decode(ref, model, ids)
        s = ctl.handle.stats()
        assert s["evictions"] > 0 and s["pinned_count"] == 0
        assert ctl.handle.hint_clock() == ctl.clock >= 4 * cfg.num_hidden_layers - 1
    finally:
        ctl.close()


def test_trace_file_is_validated(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="not a prefetch routing trace"):
        RoutingTrace.load(str(path))
    path.write_text(json.dumps({"format": "prefetch-routing-trace/1", "num_layers": 2, "num_experts": 4,
                                "steps": [[[0], [9]]]}))
    with pytest.raises(ValueError, match="out of range"):
        RoutingTrace.load(str(path))


_HEADER = {"format": "prefetch-routing-trace/1", "num_layers": 2, "num_experts": 4}


@pytest.mark.parametrize("content, message", [
    (b"\xff\xfe not text", "not JSON"),
    (b'{"format": "prefetch-routing-trace/1", "steps": [', "not JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not JSON|a JSON list"),  # too deep for the parser, or a list
    (json.dumps([_HEADER]).encode(), "a JSON list, not an object"),
    (json.dumps({**_HEADER, "num_layers": "2", "steps": []}).encode(), "num_layers must be a positive integer"),
    (json.dumps({**_HEADER, "num_layers": 2.0, "steps": []}).encode(), "num_layers must be a positive integer"),
    (json.dumps({**_HEADER, "num_layers": True, "steps": []}).encode(), "num_layers must be a positive integer"),
    (json.dumps({**_HEADER, "num_layers": 0, "steps": []}).encode(), "num_layers must be a positive integer"),
    (json.dumps({**_HEADER, "num_experts": -4, "steps": []}).encode(), "num_experts must be a positive integer"),
    (json.dumps({k: v for k, v in _HEADER.items() if k != "num_experts"} | {"steps": []}).encode(),
     "num_experts must be a positive integer, got None"),
    (json.dumps(_HEADER).encode(), "steps must be a list, got NoneType"),
    (json.dumps({**_HEADER, "steps": {"0": []}}).encode(), "steps must be a list, got dict"),
    (json.dumps({**_HEADER, "steps": [7]}).encode(), "step 0 has a int, expected a list of 2 layers"),
    (json.dumps({**_HEADER, "steps": [[[0], [1]], [[0]]]}).encode(), "step 1 has 1 layers"),
    (json.dumps({**_HEADER, "steps": [[[0], 3]]}).encode(), "step 0, layer 1: expected a list of experts"),
    (json.dumps({**_HEADER, "steps": [[[0], [1.5]]]}).encode(), "integers, got 1.5"),
    (json.dumps({**_HEADER, "steps": [[[0], [1.0]]]}).encode(), "integers, got 1.0"),
    (json.dumps({**_HEADER, "steps": [[[True], [1]]]}).encode(), "integers, got True"),
    (json.dumps({**_HEADER, "steps": [[["1"], [1]]]}).encode(), "integers, got '1'"),
    (json.dumps({**_HEADER, "steps": [[[0], [None]]]}).encode(), "integers, got None"),
    (json.dumps({**_HEADER, "steps": [[[0], [-1]]]}).encode(), "step 0, layer 1: expert index out of range 0..3"),
    (json.dumps({**_HEADER, "steps": [[[0], [2, 1, 2]]]}).encode(), "listed twice"),
    # A repeated key: json keeps the last one, so the file said two things.
    (b'{"format": "prefetch-routing-trace/1", "num_layers": 2, "num_experts": 4, "steps": [[[0], [1]]], '
     b'"steps": []}', "the key 'steps' is repeated"),
    (b'{"format": "other", "format": "prefetch-routing-trace/1", "num_layers": 2, "num_experts": 4, "steps": []}',
     "the key 'format' is repeated"),
])
def test_a_malformed_trace_file_gets_a_clear_error(tmp_path, content, message):
    """A trace is an untrusted file: every way of breaking the format is a
    ValueError that says where, never a KeyError, TypeError or a trace
    with values the format does not allow."""
    path = tmp_path / "trace.json"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        RoutingTrace.load(str(path))


def test_a_trace_that_is_a_fifo_is_refused_not_waited_on(tmp_path):
    import os
    import subprocess
    import sys

    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    code = ("from prefetch.trace import RoutingTrace\n"
            f"try:\n    RoutingTrace.load({str(fifo)!r})\nexcept ValueError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{fifo}: not a prefetch routing trace (not a regular file)", done.stdout


def test_a_trace_file_loads_sorted_and_an_empty_layer_is_allowed(tmp_path):
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({**_HEADER, "steps": [[[3, 0], []], [[1], [2, 0]]]}))
    trace = RoutingTrace.load(str(path))
    assert (trace.num_layers, trace.num_experts) == (2, 4)
    assert trace.steps == [[[0, 3], []], [[1], [0, 2]]]
    trace.save(str(path))
    assert RoutingTrace.load(str(path)).steps == trace.steps


def test_a_trace_records_a_table_of_layers_as_add_does():
    # add_routed: many layers of a [layers, experts] bool table in one pass,
    # over two steps, with an empty row and a layer of the later step read
    # before one of the earlier (as a sync-free read may hold them).
    routed = np.zeros((3, 6), dtype=bool)
    routed[0, [5, 1]] = True
    routed[2, [0, 2, 3]] = True
    keys = [(1, 2), (0, 0), (1, 1)]
    fast, slow = RoutingTrace(3, 6), RoutingTrace(3, 6)
    fast.add_routed(keys, routed)
    for step, layer in keys:
        slow.add(step, layer, np.flatnonzero(routed[layer]))
    assert fast.steps == slow.steps == [[[1, 5], [], []], [[], [], [0, 2, 3]]]
    assert all(type(e) is int for step in fast.steps for layer in step for e in layer)


def test_trace_predictor_learns_from_past_requests():
    cfg = family_configs()["mixtral"]
    model = build(cfg)
    predictor = TracePredictor(distance=1)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", predictor=predictor)
    # The cache holds every expert: after the first steps nothing is copied
    # and the predictor would only probe (Note [Speculation with nothing to
    # fetch]); what is tested here is what it learned.
    ctl.probe_when_nothing_fetched = False
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(4))
        greedy(model, ids)
        assert ctl.predicted_total == 0  # nothing learned yet
        ctl.new_sequence()
        greedy(model, ids)  # the same request again: the past matrix matches
        report = ctl.report()
        assert report["prediction_recall"] > 0.5
    finally:
        ctl.close()


def recorded_olmoe(prompt_len: int, steps: int):
    """The tiny OLMoE (batched_mm), a prompt, the untouched model's greedy
    tokens and logits over `steps`, and the routing trace an offloaded copy
    with room for every expert recorded of them (for an oracle to replay)."""
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="batched_mm")
    ids = torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(1))
    seq_ref, logits_ref = greedy(ref, ids, steps=steps)
    recorder = copy.deepcopy(ref)
    ctl = offload_moe_experts(recorder, device_budget_bytes=1 << 20, backend="host", record_trace=True)
    try:
        assert torch.equal(greedy(recorder, ids, steps=steps)[0], seq_ref)
    finally:
        ctl.close()
    return cfg, ref, ids, seq_ref, logits_ref, ctl.trace


@pytest.mark.parametrize("whole", [True, False], ids=["cache-holds-all", "small-cache"])
def test_predictor_probes_while_the_cache_fetches_nothing(whole):
    # Note [Speculation with nothing to fetch]: with every expert cached the
    # oracle's guesses name resident experts, so after two steps that copied
    # nothing it runs on one layer in eight; a cache that keeps copying keeps
    # it on every layer. Tokens are the untouched model's either way.
    cfg, ref, ids, seq_ref, _, trace = recorded_olmoe(6, 12)
    per, num_experts = expert_bytes(ref)
    model = copy.deepcopy(ref)
    budget = (1 << 20) if whole else 3 * (per + 512)
    ctl = offload_moe_experts(model, device_budget_bytes=budget, backend="host",
                              predictor=OraclePredictor(trace, distance=2), sync_free=False)
    try:
        seq, _ = greedy(model, ids, steps=12)
        assert torch.equal(seq, seq_ref)
        report = ctl.report()
        assert report["prediction_precision"] > 0.9  # the oracle is right: no precision pause
        if whole:
            assert ctl.nothing_fetched and report["speculation_paused_layers"] > 0
        else:
            assert ctl.handle.stats()["copies"] > 0
            assert not ctl.nothing_fetched and report["speculation_paused_layers"] == 0
    finally:
        ctl.close()


def test_failed_sync_free_tries_are_held_off():
    # Note [Which path a step takes]: with a cache smaller than one step's
    # reads (3 layers x 2 experts, 4 slots) the oracle's copies land in time
    # on synced steps and not on sync-free ones, and without the hold after
    # a failed try the path flipped every step (27 switches in these 40
    # steps, hit rate 0.75; with it 7 switches, 0.90).
    cfg, ref, ids, seq_ref, _, trace = recorded_olmoe(6, 40)
    per, _ = expert_bytes(ref)
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=4 * (per + 512), backend="host",
                              predictor=OraclePredictor(trace, distance=2),
                              handle_options={"eviction_policy": "next-use"})
    try:
        seq, _ = greedy(model, ids, steps=40)
        assert torch.equal(seq, seq_ref)
        report = ctl.report()
        assert report["path_switches"] == ctl.path_switches <= 10
        assert report["sync_free_steps"] == ctl.sync_free_steps <= 8
        # Where a try failed the synced steps after it waited (a slow machine
        # whose synced steps miss more never tries again).
        assert ctl.sync_free_held > 0 or ctl.path_switches <= 3
    finally:
        ctl.close()


def test_the_oracles_plan_serves_the_synced_transformers_path():
    # Note [The oracle's plan]: on the synced path a host-guess predictor
    # predicts after the routing read-back, so with a next-use handle the
    # oracle's guesses and hints come from its plan on every layer but the
    # request's first; tokens are the untouched model's, and its guesses
    # are scored right.
    cfg, ref, ids, seq_ref, logits_ref, trace = recorded_olmoe(6, 12)
    per, _ = expert_bytes(ref)
    model = copy.deepcopy(ref)
    oracle = OraclePredictor(trace, distance=2)
    made = {"plan": 0, "none": 0}
    plan = oracle.plan

    def counted(*args):
        got = plan(*args)
        made["none" if got is None else "plan"] += 1
        return got

    oracle.plan = counted
    ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host", predictor=oracle,
                              sync_free=False, handle_options={"eviction_policy": "next-use"})
    try:
        seq, logits = greedy(model, ids, steps=12)
        assert torch.equal(seq, seq_ref)
        for a, b in zip(logits, logits_ref):
            assert torch.equal(a, b)
        assert made["none"] == 1 and made["plan"] == 12 * cfg.num_hidden_layers - 1
        assert ctl.report()["prediction_precision"] == 1.0
        assert ctl.handle.hint_clock() == ctl.clock  # the last layer's hints went with its call
    finally:
        ctl.close()


@pytest.mark.parametrize("policy,hints", [("lru", None), ("next-use", None), ("next-use", True)])
def test_sync_free_oracle_goes_steady_once_nothing_is_fetched(policy, hints):
    # Note [Steady pins] with a host-side predictor: every expert cached,
    # the oracle probes only (Note [Speculation with nothing to fetch]), and
    # then its steps pin once a step without running it; tokens are the
    # untouched model's, and nothing stays pinned. The cache holds every
    # expert, so on a next-use handle the oracle sends no hints by default
    # (Note [No hints when everything fits]); forced to, its hints ride on
    # the steady call (run 56 found no steady step while hints kept a step
    # layer by layer).
    cfg, ref, ids, seq_ref, logits_ref, trace = recorded_olmoe(6, 12)
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host",
                              predictor=OraclePredictor(trace, distance=2, hints=hints), sync_free=True,
                              handle_options={"eviction_policy": policy})
    try:
        assert ctl.prefetcher.holds_every_expert()
        seq, logits = greedy(model, ids, steps=12)
        assert torch.equal(seq, seq_ref)
        for a, b in zip(logits, logits_ref):
            assert torch.equal(a, b)
        assert ctl.nothing_fetched and ctl.steady_steps > 0
        if hints:  # the last step (steady) sent hints at its first layer
            assert ctl.handle.hint_clock() == ctl.clock - (cfg.num_hidden_layers - 1)
        else:
            assert ctl.handle.hint_clock() is None
        assert ctl.report()["speculation_paused_layers"] >= ctl.steady_steps * cfg.num_hidden_layers
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


def test_an_oracle_step_whose_reads_are_all_pinned_goes_steady():
    # Note [Steady pins]: a host-side predictor that knows the whole step
    # (the oracle's step_reads: the step's reads and the next step's first
    # `distance` layers) goes steady when the last pins cover all of it,
    # without waiting for two steps that copied nothing; one unpinned read,
    # or a step past the trace, keeps it layer by layer.
    cfg, ref, ids, seq_ref, _, trace = recorded_olmoe(6, 12)
    model = copy.deepcopy(ref)
    oracle = OraclePredictor(trace, distance=2)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", predictor=oracle,
                              sync_free=True)
    try:
        assert torch.equal(greedy(model, ids, steps=12)[0], seq_ref)
        assert ctl.steady_steps > 0
        num_experts = cfg.num_experts
        layers = cfg.num_hidden_layers
        reads = oracle.step_reads(3, layers, num_experts)
        # A model of another shape than the trace's: nothing known.
        assert oracle.step_reads(3, layers + 1, num_experts) is None
        assert oracle.step_reads(3, layers, num_experts - 1) is None
        want = {la * num_experts + e for la, row in enumerate(trace.steps[3]) for e in row}
        want |= {la * num_experts + e for la, row in enumerate(trace.steps[4][:2]) for e in row}
        assert set(reads.tolist()) == want
        ctl.step = 3
        ctl.sync._pinned[:] = True
        # The last step missed nothing and fetches nothing; nothing_fetched
        # (two idle steps) is off: the pins alone decide.
        ctl.sync._last_misses, ctl._fetch, ctl.nothing_fetched = 0, None, False
        assert ctl.sync._step_pinned() and ctl.sync._steady_step()
        layer, expert = divmod(int(reads[-1]), num_experts)  # a read of step 4's first layers
        ctl.sync._pinned[layer, expert] = False
        assert not ctl.sync._step_pinned() and not ctl.sync._steady_step()
        ctl.sync._pinned[:] = True
        ctl.step = len(trace.steps)
        assert oracle.step_reads(ctl.step, layers, num_experts) is None and not ctl.sync._step_pinned()
    finally:
        ctl.close()


def test_step_pins_make_one_engine_call_a_decode_step():
    # Note [Step pins]: the oracle knows each step's reads and the next
    # step's; with room for both, a sync-free decode step makes one engine
    # call (this step's resident reads pinned in every layer, the next
    # step's queued) and the other layers none. The prompt (6 tokens, 12
    # rows: sync-free too) reads more than fits beside the next step's and
    # goes layer by layer. Bits are the untouched model's, the plan's
    # guesses score 1.0, the pins are read from, and nothing stays pinned.
    cfg, ref, ids, seq_ref, logits_ref, trace = recorded_olmoe(6, 12)
    per, _ = expert_bytes(ref)
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=12 * (per + 512), backend="host",
                              predictor=OraclePredictor(trace), sync_free=True,
                              handle_options={"eviction_policy": "next-use"})
    real = ctl.handle
    try:
        assert ctl.cache_slots == 12
        assert torch.equal(greedy(model, ids, steps=12)[0], seq_ref)
        ctl.new_sequence()  # the oracle replays the trace from its start
        pins, hits = ctl.step_pins, ctl.pinned_hits
        ctl.handle = CountingHandle(real)
        seq, logits = greedy(model, ids, steps=12)
        calls = dict(ctl.handle.calls)
        assert torch.equal(seq, seq_ref)
        for a, b in zip(logits, logits_ref):
            assert torch.equal(a, b)
        assert ctl.step_pins - pins == 11
        assert calls == {"exchange": cfg.num_hidden_layers + 11, "release": 12, "other": 0}
        # The layers shared one row map, made from the last step's pins: a
        # pinned expert's row is its slot's, every other expert's its host row.
        offloads = [m.__dict__["_prefetch_offload"] for m in offloaded_experts(model)]
        rows = offloads[0].step_rows
        assert all(o.step_rows is rows for o in offloads)
        pinned = rows.last >= 0
        assert pinned.any() and (rows.last >= -1).all()
        assert np.array_equal(rows.np[pinned], rows.arena_row0 + rows.last[pinned] // prefetch.SLOT_ALIGNMENT)
        assert np.array_equal(rows.np[~pinned], rows.host_rows[~pinned])
        r = ctl.report()
        assert r["prediction_precision"] == 1.0
        assert ctl.pinned_hits > hits
        assert real.stats()["pinned_count"] == 0
    finally:
        ctl.handle = real
        ctl.close()


def test_step_pins_stop_when_the_plan_is_wrong():
    # Note [Step pins]: a plan that names none of what the model reads (each
    # layer's routed experts swapped for others) pins and fetches the wrong
    # experts; the routed ones are read from host memory, the same bits.
    # Its guesses score 0, speculation pauses, and the next request gets no
    # step plan.
    cfg, ref, ids, seq_ref, logits_ref, trace = recorded_olmoe(6, 12)
    per, num_experts = expert_bytes(ref)
    wrong = RoutingTrace(trace.num_layers, num_experts,
                         [[[e for e in range(num_experts) if e not in layer][: len(layer)] for layer in step]
                          for step in trace.steps])
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=12 * (per + 512), backend="host",
                              predictor=OraclePredictor(wrong), sync_free=True,
                              handle_options={"eviction_policy": "next-use"})
    try:
        seq, logits = greedy(model, ids, steps=12)
        assert torch.equal(seq, seq_ref)
        for a, b in zip(logits, logits_ref):
            assert torch.equal(a, b)
        r = ctl.report()
        assert ctl.step_pins > 0 and r["zero_copy_reads"] > 0
        assert r["prediction_precision"] == 0.0 and ctl.speculation_paused
        ctl.new_sequence()
        pins = ctl.step_pins
        assert torch.equal(greedy(model, ids, steps=12)[0], seq_ref)
        assert ctl.step_pins == pins
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


def test_a_step_plan_needs_room_for_two_steps():
    # Note [Step pins]: the plan is taken only where this step's reads and
    # the next step's fit the cache together; past the trace there is none.
    cfg, ref, ids, seq_ref, _, trace = recorded_olmoe(6, 12)
    per, num_experts = expert_bytes(ref)
    model = copy.deepcopy(ref)
    oracle = OraclePredictor(trace)
    ctl = offload_moe_experts(model, device_budget_bytes=12 * (per + 512), backend="host", predictor=oracle,
                              sync_free=True)
    try:
        layers = cfg.num_hidden_layers
        ctl.step = 3
        now = oracle.step_reads(3, layers, num_experts, ahead=False)
        nxt = oracle.step_reads(4, layers, num_experts, ahead=False)
        assert now.tolist() == sorted(la * num_experts + e for la, row in enumerate(trace.steps[3]) for e in row)
        assert not now.flags.writeable  # shared by the calls of a step
        ctl.cache_slots = now.shape[0] + nxt.shape[0]
        plan = ctl.sync.step_plan()
        assert plan is not None and plan[0] is now and plan[1] is nxt
        ctl.cache_slots -= 1
        assert ctl.sync.step_plan() is None
        ctl.cache_slots += 1
        ctl.step = len(trace.steps)  # past the trace
        assert ctl.sync.step_plan() is None
        ctl.step = len(trace.steps) - 1  # the last step: nothing after it to fetch
        plan = ctl.sync.step_plan()
        assert plan is not None and plan[1].shape[0] == 0
    finally:
        ctl.close()


def test_nothing_fetched_counts_copies_asked_for_not_finished():
    # Note [Speculation with nothing to fetch]: a step that asked the engine
    # for copies is not idle, however slow the copies are to finish (a
    # loaded CI machine). With the copy workers paused none finishes; the
    # oracle's guesses keep asking, so it keeps predicting on every layer.
    cfg, ref, ids, seq_ref, _, trace = recorded_olmoe(4, 8)
    per, _ = expert_bytes(ref)
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="host", sync_free=True,
                              predictor=OraclePredictor(trace))
    try:
        ctl.handle.pause()
        seq, _ = greedy(model, ids, steps=8)
        assert torch.equal(seq, seq_ref)
        assert ctl.handle.stats()["queue_depth"] > 0  # asked for, not copied
        assert not ctl.nothing_fetched and ctl.report()["speculation_paused_layers"] == 0
    finally:
        ctl.handle.resume()
        ctl.close()


def test_belady_floor():
    # Accesses 0 1 0 2 0 1 3. Capacity 2: miss 0, 1; hit 0; miss 2 (evict 1,
    # next used later than 0); hit 0; miss 1; miss 3 -> 5 loads.
    trace = RoutingTrace(1, 4, [[[0, 1]], [[0, 2]], [[0, 1]], [[3]]])
    assert belady_misses(trace, 2) == 5
    assert belady_misses(trace, 4) == 4  # compulsory misses only
    assert belady_misses(trace, 1) == 7


@pytest.mark.gpu
@pytest.mark.parametrize("impl,dtype,predictor", [
    pytest.param("eager", torch.float32, True, id="eager-fp32-gate"),
    pytest.param("grouped_mm", torch.bfloat16, True, id="grouped_mm-bf16-gate"),
    pytest.param("batched_mm", torch.bfloat16, True, id="batched_mm-bf16-gate"),
    pytest.param("grouped_mm", torch.bfloat16, False, id="grouped_mm-bf16-sync-free"),
    pytest.param("batched_mm", torch.bfloat16, False, id="batched_mm-bf16-sync-free"),
    pytest.param("batched_mm", torch.float32, False, id="batched_mm-fp32-sync-free"),
])
def test_offloaded_model_on_gpu_matches_original(impl, dtype, predictor):
    # On the GPU generate's decode switches grouped_mm to batched_mm: both
    # the resident and the offloaded model follow it, bit for bit. Without a
    # predictor batched_mm decodes sync-free, reading missing experts from
    # page-locked host memory over PCIe (Note [Sync-free decode]).
    cfg = family_configs()["qwen3_moe"]
    ref = build(cfg, device="cuda", dtype=dtype, experts_implementation=impl)
    model = copy.deepcopy(ref)
    per, num_experts = expert_bytes(model)
    # Without a predictor every batched_mm step is sync-free (sync_free=True:
    # the per-step choice would go synced after the first, missing, steps);
    # with the gate every step is synced (its guesses ride on the routing's sync).
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="cuda",
                              predictor=NextLayerGatePredictor() if predictor else None,
                              sync_free=not predictor)
    try:
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1)).cuda()
        assert_same_decode(ref, model, ids)
        assert ctl.handle.backend == "cuda" and ctl.handle.stats()["evictions"] > 0
        assert ctl.sync_free is (not predictor)
        if not predictor and impl == "batched_mm":  # read over PCIe by the kernel, and from the cache
            assert ctl.report()["zero_copy_reads"] > 0 and ctl.pinned_hits > 0
            # Each step's routings came back through the copy its last layer
            # queued (Note [Routing read-back queued early]), not a sync.
            assert ctl.early_read_backs > 0
    finally:
        ctl.close()


@pytest.mark.gpu
def test_wait_preloaded_on_gpu_bf16():
    # Note [Waiting for the preload] on CUDA: the copies counted are issued,
    # and the wait then synchronizes the engine's copy streams; afterwards
    # the model decodes its original tokens without another copy, every
    # read a hit. (bf16 grouped_mm, as served; the name says so, for
    # gpu-csan's initcheck, which leaves out bf16 tests: the untouched bf16
    # model alone, no prefetch in the process, gets 9,160 uninitialized-read
    # reports in torch's cutlass grouped GEMM, run 130,
    # tools/initcheck_probe.py.)
    cfg = family_configs()["qwen3_moe"]
    ref = build(cfg, device="cuda", dtype=torch.bfloat16, experts_implementation="grouped_mm")
    model = copy.deepcopy(ref)
    per, num_experts = expert_bytes(model)
    total = num_experts * cfg.num_hidden_layers
    ctl = offload_moe_experts(model, device_budget_bytes=total * (per + 512), backend="cuda")
    try:
        assert ctl.preloaded == total
        assert ctl.wait_preloaded(timeout=60) is True
        s = ctl.handle.stats()
        assert s["queue_depth"] == 0 and s["copies"] == total and s["resident_count"] == total
        assert ctl.wait_preloaded(timeout=0) is True  # nothing left: at once
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1)).cuda()
        assert_same_decode(ref, model, ids)
        assert ctl.handle.stats()["copies"] == total and ctl.report()["hit_rate"] == 1.0
    finally:
        ctl.close()


@pytest.mark.gpu
def test_steady_pins_on_gpu():
    # Note [Steady pins] on CUDA, where a copy's bytes stay counted in
    # bytes_in_flight until the copy worker next wakes: a request whose
    # experts are all cached decodes with one pin call a step there too
    # (run 52 found none steady while the check waited for that gauge), with
    # the untouched model's bits, and nothing stays pinned after it.
    cfg = family_configs()["qwen3_moe"]
    ref = build(cfg, device="cuda", dtype=torch.float32, experts_implementation="batched_mm")
    model = copy.deepcopy(ref)
    per, num_experts = expert_bytes(model)  # per layer
    ctl = offload_moe_experts(model, device_budget_bytes=cfg.num_hidden_layers * num_experts * (per + 512),
                              backend="cuda", sync_free=True)  # room for every expert
    try:
        ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1)).cuda()
        greedy(model, ids, steps=6)  # first reads: misses, then copied
        ctl.flush()
        torch.cuda.synchronize()
        deadline = time.monotonic() + 10
        while ctl.handle.stats()["queue_depth"]:
            assert time.monotonic() < deadline, "copies still queued"
            time.sleep(0.001)
        before = ctl.steady_steps
        seq, logits = greedy(model, ids, steps=6)
        seq_ref, logits_ref = greedy(ref, ids, steps=6)
        assert torch.equal(seq, seq_ref)
        for a, b in zip(logits, logits_ref):
            assert torch.equal(a, b)
        assert ctl.steady_steps - before >= 4  # the decode steps after the first
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


def test_package_exposes_offload():
    assert prefetch.offload_moe_experts is offload_moe_experts


def random_trace(seed: int, layers: int, experts: int, steps: int) -> RoutingTrace:
    """A trace of `steps` steps, each layer routed to up to 3 random experts."""
    gen = torch.Generator().manual_seed(seed)
    return RoutingTrace(layers, experts, [[sorted(set(torch.randint(0, experts, (3,), generator=gen).tolist()))
                                           for _ in range(layers)] for _ in range(steps)])


def run_oracle_loop(trace, capacity, eviction, hints, distance=1):
    """Decodes `trace` through an OffloadController with the oracle (no model:
    route, let the prefetches land, acquire, check the bytes, release);
    returns the engine's copies. Waiting for the prefetches (copies faster
    than compute) makes the victims, and so the count, deterministic."""
    ctl = loop_controller(trace, capacity, eviction, OraclePredictor(trace, distance=distance, hints=hints))
    try:
        decode_loop(ctl, trace)
        return ctl.handle.stats()["copies"]
    finally:
        ctl.close()


def loop_controller(trace, capacity, eviction, predictor):
    """An OffloadController on a host handle of `capacity` 256-byte slots,
    with every (layer, expert) of `trace` registered (its bytes say which)."""
    handle = prefetch.PrefetchHandle(device_budget_bytes=capacity * 256, backend="host", eviction_policy=eviction)
    ctl = OffloadController(handle, num_layers=trace.num_layers, num_experts=trace.num_experts, top_k=2,
                            predictor=predictor)
    for layer in range(trace.num_layers):
        for e in range(trace.num_experts):
            ctl.prefetcher.register_expert(layer, e, {"w": torch.full((64,), layer * 100 + e, dtype=torch.int32)})
    return ctl


def decode_loop(ctl, trace):
    """run_oracle_loop's decode: per layer, route, let the prefetches land,
    acquire, check the bytes, release."""
    for step in trace.steps:
        for layer, experts in enumerate(step):
            ctl.on_routed(layer, None, experts)
            wait_drained(ctl.handle)
            got = ctl.prefetcher.acquire_experts(layer, experts, timeout=10)
            for e, w in zip(experts, got):
                assert torch.equal(w["w"], torch.full((64,), layer * 100 + e, dtype=torch.int32))
            ctl.prefetcher.release_experts(layer, experts)


def test_oracle_hints_make_next_use_eviction_approach_belady():
    layers, experts, capacity = 4, 8, 10
    trace = random_trace(7, layers, experts, 40)
    steps = trace.steps
    floor = belady_misses(trace, capacity)
    hinted = run_oracle_loop(trace, capacity, "next-use", hints=True)
    unhinted = run_oracle_loop(trace, capacity, "next-use", hints=False)  # no hints: LRU order
    cyclic = run_oracle_loop(trace, capacity, "cyclic", hints=False)
    assert floor <= hinted < min(cyclic, unhinted)
    # The gap to Belady is the prefetch: while a layer's experts are pinned
    # the next layer's arrive, so about one layer of the cache is not free to
    # choose. Measured: within Belady's count for a cache one layer smaller.
    widest = max(len(e) for step in steps for e in step)
    assert hinted <= belady_misses(trace, capacity - widest)
    with pytest.raises(ValueError, match="distance"):
        OraclePredictor(trace, distance=0)


def copies_of_a_second_request(first, second, capacity, prime: bool) -> int:
    """Runs `first` then, after new_sequence, `second` through an oracle
    controller as run_oracle_loop does (each layer's prefetches land before
    its acquire: the count is deterministic); returns the second request's
    copies. prime=False skips Note [Hints at a request's start]."""
    ctl = loop_controller(first, capacity, "next-use", OraclePredictor(first, distance=2))
    try:
        decode_loop(ctl, first)
        ctl.new_sequence()
        ctl.predictor = OraclePredictor(second, distance=2)
        ctl.predictor._primed = not prime
        before = ctl.handle.stats()["copies"]
        decode_loop(ctl, second)
        return ctl.handle.stats()["copies"] - before
    finally:
        ctl.close()


def test_a_request_start_hints_keep_the_residents_read_soonest():
    # Note [Hints at a request's start]: a request whose first step (a
    # prefill) reads every expert, after another request filled the cache.
    # Without the hints the residents, their hints expired, went in the
    # order they were hinted, and the oracle's guesses two layers ahead
    # evicted ones the next layers read; with them, fewer copies.
    layers, experts, capacity = 6, 8, 32  # 4 layers' experts: the residents of 1 of them can stay
    first = random_trace(3, layers, experts, 12)
    decode = random_trace(4, layers, experts, 6).steps
    second = RoutingTrace(layers, experts, [[list(range(experts))] * layers, *decode])
    primed = copies_of_a_second_request(first, second, capacity, prime=True)
    unprimed = copies_of_a_second_request(first, second, capacity, prime=False)
    assert primed < unprimed
    assert primed == copies_of_a_second_request(first, second, capacity, prime=True)  # deterministic


class HostListPredictor:
    """Guesses the next layer's experts from a fixed table, as host lists,
    without saying so (no host_guesses): the controller must treat it as a
    predictor whose guesses it cannot defer."""

    def __init__(self, table):
        self.table = table

    def predict(self, controller, step, layer, hidden):
        nxt = layer + 1
        return {nxt: self.table[nxt]} if nxt < controller.num_layers else {}

    def observe(self, controller, step, layer, experts):
        return None


def oracle_controller(trace, capacity, predictor=None, record_trace=True):
    handle = prefetch.PrefetchHandle(device_budget_bytes=capacity * 256, backend="host", eviction_policy="next-use")
    ctl = OffloadController(handle, num_layers=trace.num_layers, num_experts=trace.num_experts, top_k=2,
                            predictor=predictor or OraclePredictor(trace, distance=2), record_trace=record_trace)
    for layer in range(trace.num_layers):
        for e in range(trace.num_experts):
            ctl.prefetcher.register_expert(layer, e, {"w": torch.full((64,), layer * 100 + e, dtype=torch.int32)})
    return ctl


def decode_host_routed(ctl, trace, speculate):
    """route_and_acquire per layer as OffloadedMoEBlock calls it, checking the
    bytes; `speculate` calls speculate() before each layer's call (as the
    block does before its routing read-back; "ride": with_next_acquire, as
    the block does) and after a step's last layer (as the block does), else
    the next call runs it."""
    for step in trace.steps:
        for layer, experts in enumerate(step):
            if speculate:
                ctl.speculate(with_next_acquire=speculate == "ride")
            routed, where = ctl.route_and_acquire(layer, None, list(experts), timeout=10)
            got = ctl.prefetcher.weights_in_slots(ctl.ids(layer, routed), where)
            for e, w in zip(routed.tolist(), got):
                assert torch.equal(w["w"], torch.full((64,), layer * 100 + e, dtype=torch.int32))
            if layer == trace.num_layers - 1:
                ctl.release_held()
                if speculate:
                    ctl.speculate()
            wait_drained(ctl.handle)


def test_host_routed_speculation_runs_after_the_acquire():
    # Note [Speculation after launch]: with host guesses (the oracle) the
    # acquire is made alone and the guesses and hints are sent by
    # speculate(); nothing is lost when the caller never calls it.
    trace = random_trace(11, 4, 8, 12)
    steps = trace.steps
    ctl = oracle_controller(trace, capacity=12)
    try:
        ctl.route_and_acquire(0, None, steps[0][0], timeout=10)
        s = ctl.handle.stats()
        assert s["enqueued"] == 0 and s["on_demand"] == len(steps[0][0])  # the acquire only
        ctl.speculate()
        guessed = len(steps[0][1]) + len(steps[0][2])  # distance 2
        assert ctl.handle.stats()["enqueued"] == guessed
        ctl.speculate()  # nothing left to do: no second call
        assert ctl.handle.stats()["enqueued"] == guessed
        ctl.release_held()
    finally:
        ctl.close()
    copies = {}
    for speculate in (True, False, "ride"):
        ctl = oracle_controller(trace, capacity=12)
        try:
            decode_host_routed(ctl, trace, speculate)
            r = ctl.report()  # runs the last layer's deferred part
            assert ctl.trace.steps == [[list(e) for e in step] for step in steps]
            assert r["prediction_precision"] == 1.0 and r["prediction_recall"] == 1.0
            # every layer but the request's first was guessed, and scored
            assert ctl.actual_total == sum(len(e) for step in steps for e in step) - len(steps[0][0])
            copies[speculate] = ctl.handle.stats()["copies"]
        finally:
            ctl.close()
    assert copies[True] == copies[False] == copies["ride"]
    assert belady_misses(trace, 12) <= copies[True]


def test_speculation_rides_on_the_next_acquire():
    # Note [Speculation rides on the next acquire]: one engine call a layer,
    # and one more a step for the last layer's guesses; the guesses land as
    # the separate calls would land them, and what is left unsent goes with
    # whatever engine call comes first.
    trace = random_trace(12, 4, 8, 10)
    ctl = oracle_controller(trace, capacity=12)
    real = ctl.handle
    ctl.handle = counting = CountingHandle(real)
    try:
        decode_host_routed(ctl, trace, "ride")
        assert counting.calls["exchange"] == len(trace.steps) * (trace.num_layers + 1)
        # a riding call guesses one layer (the other is its own); the last
        # layer's call two, the farther in a prefetch_tensors (band 2),
        # except after the trace's last step
        assert counting.calls["other"] == len(trace.steps) - 1
        r = ctl.report()
        assert r["prediction_precision"] == 1.0 and r["prediction_recall"] == 1.0
    finally:
        ctl.handle = real
        ctl.close()
    steps = trace.steps
    ctl = oracle_controller(trace, capacity=12)
    try:
        ctl.route_and_acquire(0, None, steps[0][0], timeout=10)
        ctl.speculate(with_next_acquire=True)
        assert ctl.handle.stats()["enqueued"] == 0  # left for the next acquire
        ctl.release_held()  # comes first: sends them
        guessed = len(steps[0][1]) + len(steps[0][2])
        assert ctl.handle.stats()["enqueued"] == guessed
        wait_drained(ctl.handle)
        ctl.route_and_acquire(1, None, steps[0][1], timeout=10)
        s = ctl.handle.stats()
        assert s["enqueued"] == guessed and s["misses"] == len(steps[0][0])  # layer 1 hit: its guesses landed
        ctl.release_held()
    finally:
        ctl.close()


def test_host_routed_speculation_is_not_deferred_for_other_predictors():
    # A predictor that does not say its guesses are host data might read the
    # hidden state: its guesses go with the acquire, in the same call.
    trace = RoutingTrace(3, 6, [[[0, 1], [2, 3], [4, 5]]])
    ctl = oracle_controller(trace, capacity=8, predictor=HostListPredictor({1: [2, 3], 2: [4, 5]}))
    real = ctl.handle
    ctl.handle = counting = CountingHandle(real)
    try:
        ctl.route_and_acquire(0, None, [0, 1], timeout=10)
        assert real.stats()["enqueued"] == 2 and counting.calls["exchange"] == 1
        ctl.speculate()
        assert counting.calls["exchange"] == 1
        ctl.release_held()
    finally:
        ctl.handle = real
        ctl.close()


def test_close_records_a_deferred_routing():
    trace = RoutingTrace(2, 4, [[[0, 1], [2, 3]]])
    ctl = oracle_controller(trace, capacity=6)
    ctl.route_and_acquire(0, None, [1, 0], timeout=10)
    ctl.release_held()
    ctl.close()
    assert ctl.trace.steps == [[[0, 1], []]]  # layer 1 never routed


def test_host_experts_are_reused_by_a_second_offload():
    cfg = family_configs()["olmoe"]
    ref = build(cfg, experts_implementation="grouped_mm")
    first, second = copy.deepcopy(ref), copy.deepcopy(ref)
    per, _ = expert_bytes(ref)
    ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(5))
    seq_ref, _ = greedy(ref, ids)
    ctl = offload_moe_experts(first, device_budget_bytes=4 * (per + 512), backend="host")
    host = ctl.host_experts
    assert host is not None and host.buffer.numel() >= cfg.num_hidden_layers * cfg.num_experts * per
    ctl.close()
    ctl = offload_moe_experts(second, device_budget_bytes=5 * (per + 512), backend="host", host_experts=host)
    try:
        assert ctl.host_experts is host
        assert ctl.sync_free  # the reused buffer and the new arena share the 256-byte row grid
        seq, _ = greedy(second, ids)
        assert torch.equal(seq, seq_ref)
    finally:
        ctl.close()
    # batched_mm decodes sync-free on the reused buffer, bit for bit
    ref_b = build(cfg, experts_implementation="batched_mm")
    seq_b, _ = greedy(ref_b, ids)
    third = copy.deepcopy(ref_b)
    ctl = offload_moe_experts(third, device_budget_bytes=3 * (per + 512), backend="host", host_experts=host)
    try:
        seq, _ = greedy(third, ids)
        assert torch.equal(seq, seq_b)
        assert ctl.report()["zero_copy_reads"] > 0
    finally:
        ctl.close()
    other = build(family_configs()["mixtral"])  # 6 experts of another size
    with pytest.raises(ValueError, match="other expert shapes"):
        offload_moe_experts(other, device_budget_bytes=1 << 20, backend="host", host_experts=host)
    assert not offloaded_experts(other)


@pytest.mark.parametrize("slots", [11, 3])
def test_grouped_mm_over_more_slots_than_it_takes(monkeypatch, slots):
    # torch's grouped_mm refuses 1024 groups or more; a cache with more
    # slots gathers the routed slots for it. Lowering the limit to 2 sends
    # every grouped_mm call here down that path (with 3 slots, in pieces).
    # (On the CPU every grouped_mm call gathers, for its bits: Note in
    # ExpertsOffload._stand_for; the GPU test below covers the limit there.)
    import prefetch.hf_experts

    monkeypatch.setattr(prefetch.hf_experts, "_GROUPED_MM_MAX_GROUPS", 2)
    cfg = family_configs()["qwen3_moe"]
    ref = build(cfg, experts_implementation="grouped_mm")
    model = copy.deepcopy(ref)
    per, _ = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=slots * (per + 512), backend="host")
    try:
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
        seq_ref, logits_ref = greedy(ref, ids)
        seq, logits = greedy(model, ids)
        assert torch.equal(seq, seq_ref)
        if slots == 11:  # no pieces: bit-equal
            for a, b in zip(logits, logits_ref):
                assert torch.equal(a, b)
    finally:
        ctl.close()


@pytest.mark.gpu
@pytest.mark.parametrize("slots", [1023, 1024])
def test_grouped_mm_at_the_group_limit_on_gpu_bf16(slots):
    # torch's CUDA grouped_mm takes fewer than 1024 groups: a cache of
    # exactly 1024 slots (OLMoE-1B-7B at 100 %) failed every prefill with
    # "Can't process more than 1024 groups" (BM6, run 47) and now gathers
    # the routed slots; 1023 still runs on the slot views. (bf16: the only
    # dtype of torch's CUDA grouped_mm. The name says so, for gpu-csan's
    # initcheck, which leaves out bf16 tests: the untouched bf16 model's own
    # generate has uninitialized-read reports (run 24), and this test gave
    # 4,840 in run 48, in the router's softmax, which both models run.)
    cfg = transformers.Qwen3MoeConfig(**COMMON, intermediate_size=64, moe_intermediate_size=8, num_experts=512,
                                      num_experts_per_tok=2, head_dim=8, decoder_sparse_step=1, mlp_only_layers=[],
                                      norm_topk_prob=True)
    cfg.num_hidden_layers = 2
    ref = build(cfg, device="cuda", dtype=torch.bfloat16, experts_implementation="grouped_mm")
    model = copy.deepcopy(ref)
    from prefetch.expert_prefetcher import _align

    _, experts, _ = find_hf_moe_blocks(model)[0]
    size = experts.gate_up_proj.element_size()
    slot_bytes = _align(_align(experts.gate_up_proj[0].numel() * size) + experts.down_proj[0].numel() * size)
    ctl = offload_moe_experts(model, device_budget_bytes=slots * slot_bytes, backend="cuda")
    try:
        assert offloaded_experts(model)[0].__dict__["_prefetch_offload"].slots == slots
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1)).cuda()
        assert_same_decode(ref, model, ids)
    finally:
        ctl.close()


@pytest.mark.gpu
def test_host_indices_reach_the_gpu_without_a_stream_sync():
    # Note [Host indices without a stream sync]: the gathered grouped_mm's
    # slots and a piece's remap went to the GPU with a pageable copy that
    # synchronized the stream, so the host waited for the layer's expert
    # copies before launching its compute. Under torch's sync debug mode
    # "error" that copy raises; ExpertsOffload._to_device must not, and
    # must deliver the bytes.
    cfg = family_configs()["qwen3_moe"]
    model = build(cfg, device="cuda")
    per, _ = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend="cuda")
    try:
        off = offloaded_experts(model)[0].__dict__["_prefetch_offload"]
        values = np.arange(7, dtype=np.int64) * 3
        with pytest.raises(RuntimeError, match="synchroniz"):
            _with_sync_errors(lambda: torch.from_numpy(values).to(off.device))  # the old copy
        got = _with_sync_errors(lambda: off._to_device(values))
        assert got.is_cuda and got.dtype == torch.int64
        values[:] = -1  # the copy was staged: a later write to the array does not reach it
        assert got.tolist() == [0, 3, 6, 9, 12, 15, 18]
    finally:
        ctl.close()


def _with_sync_errors(fn):
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def test_distinct_takes_any_tensor():
    # Guesses come back as tensors: on a device (read back once in
    # on_routed), or carrying autograd state; numpy() alone refuses both
    # (BM5's trace replays on the H200 hit the device case, run 18).
    from prefetch.expert_ids import distinct as _distinct

    assert _distinct(torch.tensor([3.0, 1.0, 3.0], requires_grad=True), 8).tolist() == [1, 3]
    assert _distinct(torch.tensor([[5, 0], [5, 2]]), 8).tolist() == [0, 2, 5]
    with pytest.raises(ValueError, match="0..7"):
        _distinct([8], 8)


@pytest.mark.gpu
def test_generic_block_waits_for_the_gpu_once_a_layer():
    # Note [No hidden sync in the routing] (bench/lib/e2e_decoder.py): the
    # generic block took its experts from unique() and each expert's tokens
    # from torch.where, and both wait for the GPU in a pageable copy of a
    # count: one wait before the speculation meant to overlap the GPU's
    # work, and one more per routed expert. Now the routing's read-back is
    # the block's only wait, and the output keeps the reference's bits.
    import warnings

    torch.manual_seed(7)
    layers_ref, layers_off = generic_layers(3, 6)
    layers_ref, layers_off = layers_ref.cuda(), layers_off.cuda()
    ctl = offload_moe_experts(layers_off, device_budget_bytes=18 * (3 * 16 * 24 * 4 + 256), backend="cuda")
    try:
        x = torch.randn(5, 16, device="cuda")
        for forward in range(2):  # the second finds every expert cached
            a = b = x
            for ref_layer in layers_ref:
                a = a + ref_layer(a)
            torch.cuda.synchronize()
            previous = torch.cuda.get_sync_debug_mode()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    for off_layer in layers_off:
                        b = b + off_layer(b)
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
            assert len(syncs) == len(layers_off), (forward, syncs)
            assert torch.equal(a, b)
    finally:
        ctl.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_offloaded_blocks_replaying_their_routing_take_the_step_plan(device):
    # Note [Host-routed step pins]: OffloadedMoEBlocks decoding one row a
    # step replay their recorded routing with the oracle: one plan a step
    # (on CUDA its pins taken on the stream, a copy still in flight waited
    # for there), the reference blocks' bits, and nothing left pinned.
    torch.manual_seed(9)
    layers_ref, layers_off = generic_layers(4, 6)
    layers_ref, layers_off = layers_ref.to(device), layers_off.to(device)
    second = copy.deepcopy(layers_off)
    backend = "cuda" if device == "cuda" else "host"
    budget = 20 * (3 * 16 * 24 * 4 + 256)  # 21 slots: room for 8 reads a step + max(8, 6)
    xs = [torch.randn(1, 16, device=device) for _ in range(8)]

    def run(layers):
        outs = []
        for x in xs:
            h = x
            for layer in layers:
                h = h + layer(h)
            outs.append(h)
        return outs

    ref = run(layers_ref)
    ctl = offload_moe_experts(layers_off, device_budget_bytes=budget, backend=backend, record_trace=True)
    try:
        for a, b in zip(ref, run(layers_off)):
            assert torch.equal(a, b)
        trace = ctl.trace
    finally:
        ctl.close()
    ctl = offload_moe_experts(second, device_budget_bytes=budget, backend=backend,
                              predictor=OraclePredictor(trace, distance=2),
                              handle_options={"eviction_policy": "next-use"})
    try:
        assert ctl.cache_slots >= 16  # room for the plan
        for a, b in zip(ref, run(second)):
            assert torch.equal(a, b)
        r = ctl.report()
        assert r["step_pins"] == len(xs) and r["prediction_precision"] == 1.0
        if device == "cuda":
            torch.cuda.synchronize()
        assert ctl.handle.stats()["pinned_count"] == 0
    finally:
        ctl.close()


@pytest.mark.parametrize("predictor", [None, "gate", "oracle"])
def test_generic_block_larger_than_the_cache_runs_in_pieces(predictor):
    # 64 rows route to all 6 experts of every block; the cache holds 3: each
    # block runs in two pieces, in expert order, with the same bits.
    torch.manual_seed(5)
    layers_ref, layers_off = generic_layers(3, 6)
    trace = RoutingTrace(3, 6, [[list(range(6))] * 3] * 2)
    chosen = {None: None, "gate": NextLayerGatePredictor(), "oracle": OraclePredictor(trace, distance=2)}[predictor]
    per = 3 * 16 * 24 * 4
    ctl = offload_moe_experts(layers_off, device_budget_bytes=3 * per + 1024, backend="host", predictor=chosen,
                              handle_options={"eviction_policy": "next-use"} if predictor == "oracle" else None,
                              record_trace=True)
    real = ctl.handle
    ctl.handle = counting = CountingHandle(real)
    try:
        for _ in range(2):
            a = b = torch.randn(64, 16)
            for ref_layer, off_layer in zip(layers_ref, layers_off):
                a = a + ref_layer(a)
                b = b + off_layer(b)
            assert torch.equal(a, b)
            assert real.stats()["pinned_count"] == 0
        # two pieces a block; the oracle's guesses and hints ride on the next
        # block's first call (Note [Speculation rides on the next acquire]),
        # the last block's go in one more call right after it (nothing left
        # deferred): one a forward
        assert counting.calls["exchange"] == 2 * 3 * 2 + (2 if predictor == "oracle" else 0)
        assert ctl.trace.steps == [[list(range(6))] * 3] * 2  # the whole routing, not a piece
    finally:
        ctl.handle = real
        ctl.close()


def test_generic_expert_larger_than_the_budget_is_refused_before_anything_changes():
    blocks = nn.ModuleList(OffloadedMoEBlock(nn.Linear(16, 4, bias=False), [TinyExpert(16, 24) for _ in range(4)], 2)
                           for _ in range(2))
    with pytest.raises(ValueError, match="smaller than one expert"):
        offload_moe_experts(blocks, device_budget_bytes=1024, backend="host")
    assert all(b.controller is None for b in blocks)  # not attached: can be offloaded with a larger budget
    ctl = offload_moe_experts(blocks, device_budget_bytes=1 << 20, backend="host")
    ctl.close()


class SwitchingPredictor:
    """Guesses the next layer's experts from the trace (right) or their
    complement (wrong), switching when told: a predictor whose precision
    changes during a run."""

    host_guesses = True

    def __init__(self, trace):
        self.trace = trace
        self.right = False
        self.calls = 0

    def predict(self, controller, step, layer, hidden):
        self.calls += 1
        got = next_layer_routing(self.trace, controller, step, layer)
        if got is None:
            return {}
        nxt, want = got
        if not self.right:
            want = set(range(controller.num_experts)) - want
        return {nxt: np.array(sorted(want), dtype=np.int64)}

    def observe(self, controller, step, layer, experts):
        return None


@pytest.mark.parametrize("host_guesses", [True, False])  # speculated after launch / guessed before the routing
def test_speculation_pauses_at_a_low_precision_and_resumes(host_guesses):
    # Note [Speculation by its precision]: always-wrong guesses are sent
    # until enough of them were scored, then held back (the prefetch calls
    # stop naming ids) while the acquires go on; right guesses make the
    # recent precision climb and speculation resume. While paused the
    # predictor runs on one layer in eight (its guesses scored, not sent).
    layers, experts = 4, 16
    trace = random_trace(5, layers, experts, 80)
    steps = trace.steps
    predictor = SwitchingPredictor(trace)
    predictor.host_guesses = host_guesses
    ctl = oracle_controller(trace, capacity=40, predictor=predictor)
    try:
        assert ctl.speculation.defers() is host_guesses
        half = RoutingTrace(layers, experts, steps[:20])
        decode_host_routed(ctl, half, speculate=True)
        assert ctl.speculation_paused and ctl.report()["speculation_paused_layers"] > 0
        named = ctl.handle.stats()["requests"]
        paused_before = ctl.speculation_paused_layers
        calls_before = predictor.calls
        decode_host_routed(ctl, RoutingTrace(layers, experts, steps[20:28]), speculate=True)  # 32 layers
        assert ctl.handle.stats()["requests"] == named  # nothing speculated while paused
        assert ctl.speculation_paused_layers - paused_before == 32  # each layer counted once
        assert predictor.calls - calls_before == 4  # probes only
        assert ctl.report()["prediction_precision"] < 0.25  # still scored
        predictor.right = True
        decode_host_routed(ctl, RoutingTrace(layers, experts, steps[28:]), speculate=True)
        assert not ctl.speculation_paused
        assert ctl.handle.stats()["requests"] > named  # right guesses are sent again
    finally:
        ctl.close()


def test_speculation_never_pauses_with_its_pauses_off_or_right_guesses():
    trace = random_trace(6, 4, 16, 20)
    # Wrong guesses with both pauses turned off (a bar of 0 for the
    # precision, 1 for the copies wasted: Note [Speculation by what its
    # copies waste] would pause these); right ones with the defaults.
    ctl = oracle_controller(trace, capacity=40, predictor=SwitchingPredictor(trace))
    ctl.speculation_min_precision = 0
    ctl.speculation_max_wasted = 1
    oracle = oracle_controller(trace, capacity=40)
    try:
        decode_host_routed(ctl, trace, speculate=True)
        decode_host_routed(oracle, trace, speculate=True)
        assert ctl.handle.stats()["wasted"] > 0  # what would have paused them
        for c in (ctl, oracle):
            assert not c.speculation_paused and c.report()["speculation_paused_layers"] == 0
    finally:
        ctl.close()
        oracle.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_an_offload_inside_inference_mode_generates_outside_it_too(device):
    # A serving stack may offload and serve its first request under
    # torch.inference_mode and a later one outside it (or the reverse): every
    # buffer the offload or a step makes and a later step writes is a normal
    # tensor, so neither fails with "Inplace update to inference tensor".
    cfg = family_configs()["olmoe"]
    ref = build(cfg, device=device, experts_implementation="batched_mm")
    per, _ = expert_bytes(ref)
    ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1)).to(device)
    seq_ref, _ = greedy(ref, ids, steps=6)
    for sync_free in (True, None):
        model = copy.deepcopy(ref)
        backend = "cuda" if device == "cuda" else "host"
        with torch.inference_mode():
            ctl = offload_moe_experts(model, device_budget_bytes=3 * (per + 512), backend=backend,
                                      sync_free=sync_free)
            inside, _ = greedy(model, ids, steps=6)
        try:
            outside, _ = greedy(model, ids, steps=6)
            assert torch.equal(inside, seq_ref) and torch.equal(outside, seq_ref)
        finally:
            ctl.close()


def test_the_state_of_an_offloaded_model_is_refused_not_saved_empty(tmp_path):
    # Note [No state of offloaded experts]: save_pretrained after offloading
    # wrote zero-size expert tensors without a word (the checkpoint failed
    # only when loaded again).
    ref = build(family_configs()["olmoe"], experts_implementation="batched_mm")
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 22, backend="host", progress=False)
    try:
        with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.experts: its experts are offloaded"):
            model.state_dict()
        with pytest.raises(RuntimeError, match="its experts are offloaded"):
            model.save_pretrained(tmp_path / "saved")
        assert not any((tmp_path / "saved").glob("*.safetensors"))
        ids = torch.randint(0, ref.config.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
        assert torch.equal(greedy(model, ids)[0], greedy(ref, ids)[0])  # still serves
    finally:
        ctl.close()
    assert set(ref.state_dict()) == set(copy.deepcopy(ref).state_dict())  # an untouched model is as ever


def test_an_offloaded_model_is_not_copied_or_pickled():
    # copy.deepcopy and torch.save of an offloaded model raised Cython's
    # "no default __reduce__ due to non-trivial __cinit__", and copy.copy of
    # its controller made a second controller on the same engine.
    import io
    import pickle

    cfg = family_configs()["olmoe"]
    ref = build(cfg)
    model = copy.deepcopy(ref)
    ctl = offload_moe_experts(model, device_budget_bytes=1 << 20, backend="host", progress=False)
    try:
        for attempt in (lambda: copy.deepcopy(model), lambda: torch.save(model, io.BytesIO()),
                        lambda: copy.copy(ctl), lambda: pickle.dumps(ctl)):
            with pytest.raises(TypeError, match="offloaded by prefetch .* cannot be copied or pickled"):
                attempt()
        # The way out the message names: a copy made before, offloaded on the same packed experts.
        ids = torch.randint(0, cfg.vocab_size, (1, 5), generator=torch.Generator().manual_seed(0))
        other = copy.deepcopy(ref)
        ctl2 = offload_moe_experts(other, device_budget_bytes=1 << 20, backend="host", progress=False,
                                   host_experts=ctl.host_experts)
        try:
            assert torch.equal(greedy(other, ids)[0], greedy(ref, ids)[0])
            assert torch.equal(greedy(model, ids)[0], greedy(ref, ids)[0])
        finally:
            ctl2.close()
    finally:
        ctl.close()
