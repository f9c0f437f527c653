"""The "decay" eviction policy (Note [Decayed-frequency eviction] in
src_cpp/decay_policy.h): the least used first, each use weighted by
exp(-age / tau), tau = 16 decode steps of `cycle_acquires` calls;
prefetched entries not yet acquired last unless stale."""
import math

import numpy as np
import pytest

import prefetch

SLOT = prefetch.SLOT_ALIGNMENT


def handle(make_handle, slots, ids, **kw):
    h = make_handle(device_budget_bytes=slots * SLOT, eviction_policy="decay", **kw)
    for tid in ids:
        h.register(tid, np.full(SLOT, tid % 251, np.uint8))
    return h


def use(h, ids):
    views = h.acquire(list(ids), timeout=10)
    for tid, v in zip(ids, views):
        assert int(v[0]) == tid % 251  # the right bytes arrived
    h.release(list(ids))


def test_the_least_used_goes_first(make_handle):
    h = handle(make_handle, 3, range(4), cycle_acquires=1)
    for ids in ([0], [1], [2], [0], [2], [0]):
        use(h, ids)
    # uses: 0 three times, 2 twice, 1 once (and longest ago)
    assert h.resident() == [1, 2, 0]
    use(h, [3])
    assert sorted(h.resident()) == [0, 2, 3]
    assert h.stats()["evictions"] == 1


def old_then_recent(make_handle, cycle):
    """0 used three times, then 100 calls of 2, then 1 once."""
    h = handle(make_handle, 3, range(4), cycle_acquires=cycle)
    for _ in range(3):
        use(h, [0])
    for _ in range(100):
        use(h, [2])
    use(h, [1])
    return h


def test_old_uses_fade(make_handle):
    # tau = 16 calls (cycle 1): 0's three uses, 100 calls ago, weigh less
    # than one recent use of 1.
    h = old_then_recent(make_handle, cycle=1)
    assert h.resident()[0] == 0
    use(h, [3])
    assert 0 not in h.resident()
    # With a cycle of 64 calls a step, tau is 1,024 calls: 0 is still ahead.
    h = old_then_recent(make_handle, cycle=64)
    assert h.resident()[0] == 1


def test_prefetched_last_until_stale(make_handle):
    h = handle(make_handle, 3, range(5), cycle_acquires=1)
    use(h, [0])
    use(h, [1])
    h.prefetch_tensors([2])  # fresh: the next layer will read it
    assert prefetch_done(h, 3)
    assert h.resident() == [0, 1, 2]  # scored (0 older), then fresh
    for _ in range(8):  # 8 acquire calls pass it by: still protected
        use(h, [0])
    assert h.resident()[-1] == 2
    use(h, [1])  # the 9th: 2 is now stale and goes first
    assert h.resident()[0] == 2
    use(h, [3])
    assert 2 not in h.resident()
    assert h.stats()["wasted"] == 1


def prefetch_done(h, copies):
    import time

    deadline = time.monotonic() + 10
    while h.stats()["copies"] < copies:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def reference_hits(seq, capacity, tau):
    """The Note's rule, written again in Python for on-demand acquires:
    per call the clock moves, then each id is a hit or is copied in (the
    victim: the lowest (key, last use) not in this call), then every id of
    the call is used: key = now + log1p(exp(key - now)), now = clock / tau."""
    key, used_at, resident = {}, {}, set()
    clock = hits = 0
    for ids in seq:
        clock += 1
        for tid in ids:
            if tid in resident:
                hits += 1
                continue
            if len(resident) >= capacity:
                victim = min((t for t in resident if t not in ids), key=lambda t: (key[t], used_at[t]))
                resident.discard(victim)
            resident.add(tid)
        now = clock / tau
        for tid in ids:
            key[tid] = now + math.log1p(math.exp(key.get(tid, -math.inf) - now))
            used_at[tid] = clock
    order = sorted(resident, key=lambda t: (key[t], used_at[t]))
    return hits, order


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_matches_the_rule_on_skewed_routing(make_handle, seed):
    rng = np.random.default_rng(seed)
    layers, experts, top_k, capacity = 4, 16, 3, 20
    popular = rng.dirichlet(np.full(experts, 0.3), size=layers)  # a few favourites per layer
    seq = []
    for _ in range(60):
        for layer in range(layers):
            chosen = rng.choice(experts, size=top_k, replace=False, p=popular[layer])
            seq.append(sorted(int(layer * experts + e) for e in chosen))
    h = handle(make_handle, capacity, range(layers * experts), cycle_acquires=layers)
    for ids in seq:
        use(h, ids)
    want_hits, want_order = reference_hits(seq, capacity, tau=16 * layers)
    assert h.stats()["hits"] == want_hits
    assert h.resident() == want_order
    # and it is not LRU: the same accesses under LRU hit differently
    lru = make_handle(device_budget_bytes=capacity * SLOT, backend="host", eviction_policy="lru")
    for tid in range(layers * experts):
        lru.register(tid, np.zeros(SLOT, np.uint8))
    for ids in seq:
        lru.acquire(ids, timeout=10)
        lru.release(ids)
    assert lru.stats()["hits"] != want_hits


def test_an_unknown_policy_names_decay_among_the_known():
    with pytest.raises(ValueError, match="decay"):
        prefetch.PrefetchHandle(device_budget_bytes=SLOT, backend="host", eviction_policy="lfu")


@pytest.mark.hf
@pytest.mark.parametrize("predictor", [None, "next-layer"])
def test_an_offloaded_model_under_decay_decodes_as_the_original(predictor):
    import copy

    import torch

    from prefetch.integration import NextLayerGatePredictor, offload_moe_experts
    from tests.test_integration import assert_same_decode, build, expert_bytes, family_configs

    cfg = family_configs()["qwen3_moe"]
    ref = build(cfg, experts_implementation="grouped_mm")
    model = copy.deepcopy(ref)
    per, num_experts = expert_bytes(model)
    ctl = offload_moe_experts(model, device_budget_bytes=(num_experts + 3) * (per + 512), backend="host",
                              predictor=NextLayerGatePredictor() if predictor else None,
                              handle_options={"eviction_policy": "decay"})
    try:
        assert ctl.handle.eviction_policy == "decay"
        ids = torch.randint(0, cfg.vocab_size, (2, 6), generator=torch.Generator().manual_seed(1))
        assert_same_decode(ref, model, ids)
        s = ctl.handle.stats()
        assert s["evictions"] > 0 and s["hits"] > 0  # the cache was too small for every expert
    finally:
        ctl.close()


def test_offload_gives_decay_the_layer_count_as_its_step():
    from prefetch.integration import layer_handle_options

    assert layer_handle_options(7, {"eviction_policy": "decay"})["cycle_acquires"] == 7
    assert layer_handle_options(7, {"eviction_policy": "decay", "cycle_acquires": 3})["cycle_acquires"] == 3
    assert "cycle_acquires" not in layer_handle_options(7, {"eviction_policy": "lru"})
