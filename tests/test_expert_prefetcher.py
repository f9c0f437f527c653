"""ExpertPrefetcher: (layer, expert) mapping, both issuing paths, weights back
as torch tensors."""
import numpy as np
import pytest
import torch

import prefetch
from prefetch import ExpertPrefetcher
from prefetch.expert_prefetcher import cache_slot_bytes, expert_layout


class RecordingEngine:
    """Records what the prefetcher sends; `batched` decides whether it offers
    prefetch_tensors (the fallback test uses one without it)."""

    def __init__(self, batched: bool):
        self.calls = []
        if batched:
            self.prefetch_tensors = self._prefetch_tensors

    def register_parts(self, tensor_id, parts, *, total_bytes=None, device=0):
        pass

    def _prefetch_tensors(self, ids, priority=1):
        self.calls.append(("batched", [int(i) for i in ids], priority))

    def enqueue_prefetch(self, tensor_id, priority=1):
        self.calls.append(("single", [int(tensor_id)], priority))


def expert_weights(seed: int, dtype=torch.bfloat16, hidden=16, inter=24):
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(inter, hidden, generator=g).to(dtype),
        "w2": torch.randn(hidden, inter, generator=g).to(dtype),
        "w3": torch.randn(inter, hidden, generator=g).to(dtype),
    }


def populate(pf, layers=3, experts=5):
    for layer in range(layers):
        for expert in range(experts):
            pf.register_expert(layer, expert, expert_weights(layer * 100 + expert))


def test_batched_and_fallback_send_identical_ordered_ids():
    batched = ExpertPrefetcher(RecordingEngine(batched=True))
    single = ExpertPrefetcher(RecordingEngine(batched=False))
    assert batched.batched and not single.batched
    populate(batched)
    populate(single)
    for layer, experts, band in [(0, [4, 0, 2], 1), (2, [1, 1, 3], 6), (1, np.array([2, 4]), 0)]:
        batched.prefetch_experts_list(layer, experts, priority=band)
        single.prefetch_experts_list(layer, experts, priority=band)
    sent_batched = [(i, band) for _, ids, band in batched.engine.calls for i in ids]
    sent_single = [(i, band) for _, ids, band in single.engine.calls for i in ids]
    assert sent_batched == sent_single
    assert len(batched.engine.calls) == 3
    assert len(single.engine.calls) == 8
    assert [ids for _, ids, _ in batched.engine.calls][0] == [
        batched.tensor_id(0, 4),
        batched.tensor_id(0, 0),
        batched.tensor_id(0, 2),
    ]


def test_both_paths_leave_the_same_queue_in_a_real_engine(make_handle):
    queues = []
    for use_batched in (True, False):
        h = make_handle(device_budget_bytes=1 << 20, start_paused=True)
        pf = ExpertPrefetcher(h, use_batched=use_batched)
        populate(pf)
        pf.prefetch_experts_list(1, [3, 0, 4], priority=2)
        pf.prefetch_experts_list(0, [1], priority=5)
        pf.prefetch_experts_list(1, [4, 2], priority=1)
        queues.append(h.queued())
    assert queues[0] == queues[1]
    assert len(queues[0]) == 5


def test_empty_expert_list_is_a_noop():
    pf = ExpertPrefetcher(RecordingEngine(batched=True))
    populate(pf)
    pf.prefetch_experts_list(0, [])
    pf.prefetch_experts_list(0, np.array([], dtype=np.int64))
    assert pf.engine.calls == []


def test_unknown_experts_raise_keyerror():
    pf = ExpertPrefetcher(RecordingEngine(batched=True))
    populate(pf, layers=2, experts=3)
    for layer, experts in [(5, [0]), (0, [3]), (0, [-1]), (1, [0, 9])]:
        with pytest.raises(KeyError):
            pf.prefetch_experts_list(layer, experts)
    with pytest.raises(TypeError):
        pf.prefetch_experts_list(0, [0.5])
    assert pf.engine.calls == []


def test_register_expert_rejects_bad_weights():
    pf = ExpertPrefetcher(RecordingEngine(batched=True))
    with pytest.raises(ValueError):
        pf.register_expert(0, 0, {})
    with pytest.raises(TypeError):
        pf.register_expert(0, 0, {"w1": np.zeros(3)})
    pf.register_expert(0, 0, expert_weights(1))
    with pytest.raises(ValueError, match="already registered"):
        pf.register_expert(0, 0, expert_weights(1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int8])
def test_weights_come_back_exact(make_handle, dtype):
    h = make_handle(device_budget_bytes=1 << 20)
    pf = ExpertPrefetcher(h)
    originals = {}
    for expert in range(4):
        w = {k: (v * 10).to(dtype) for k, v in expert_weights(expert, dtype=torch.float32).items()}
        originals[expert] = w
        pf.register_expert(0, expert, w)
    pf.prefetch_experts_list(0, [2, 3])
    got = pf.acquire_experts(0, [3, 0, 2])
    for expert, weights in zip([3, 0, 2], got):
        for name, tensor in weights.items():
            ref = originals[expert][name]
            assert tensor.dtype == ref.dtype and tensor.shape == ref.shape
            assert torch.equal(tensor, ref)
    pf.release_experts(0, [3, 0, 2])
    assert h.stats()["pinned_count"] == 0


def test_experts_context_manager_releases(make_handle):
    h = make_handle(device_budget_bytes=1 << 20)
    pf = ExpertPrefetcher(h)
    populate(pf, layers=1, experts=2)
    with pf.experts(0, [1, 0]) as weights:
        assert torch.equal(weights[0]["w2"], expert_weights(1)["w2"])
        assert h.stats()["pinned_count"] == 2
    assert h.stats()["pinned_count"] == 0


def test_one_copy_per_expert(make_handle):
    h = make_handle(device_budget_bytes=1 << 20)
    pf = ExpertPrefetcher(h)
    populate(pf, layers=1, experts=3)
    pf.acquire_experts(0, [0, 1, 2])
    assert h.stats()["copies"] == 3  # packed: not one per weight
    pf.release_experts(0, [0, 1, 2])


def test_use_batched_true_needs_the_batched_call():
    with pytest.raises(ValueError):
        ExpertPrefetcher(RecordingEngine(batched=False), use_batched=True)


def test_prefetcher_over_public_handle_api():
    assert prefetch.ExpertPrefetcher is ExpertPrefetcher


def test_pack_and_register_packed_is_zero_copy(make_handle):
    h = make_handle(device_budget_bytes=1 << 20)
    pf = ExpertPrefetcher(h)
    w = expert_weights(7)
    buffer, layout = prefetch.pack_expert(w)
    pf.register_packed(0, 0, buffer, layout)
    pf.register_expert(0, 1, expert_weights(8))
    got = pf.acquire_experts(0, [0, 1])
    for name in w:
        assert torch.equal(got[0][name], w[name])
        assert torch.equal(got[1][name], expert_weights(8)[name])
    pf.release_experts(0, [0, 1])
    with pytest.raises(ValueError, match="layout needs"):
        pf.register_packed(0, 2, buffer[:10], layout)


def expert_slot_bytes(pf, layer=0, expert=0):
    layout = pf.layout(pf.tensor_id(layer, expert))
    return (layout[-1].offset + layout[-1].nbytes + 255) // 256 * 256


def test_views_follow_an_expert_that_moved_slots(make_handle):
    # A cache of two expert slots: expert 0 is evicted and comes back in the
    # other slot; its views must be rebuilt there, and reused when it stays.
    probe = ExpertPrefetcher(make_handle(device_budget_bytes=1 << 20))
    probe.register_expert(0, 0, expert_weights(0))
    h = make_handle(device_budget_bytes=2 * expert_slot_bytes(probe), eviction_policy="lru")
    pf = ExpertPrefetcher(h)
    populate(pf, layers=1, experts=3)
    seen = {}
    for order in ([0], [1], [0], [2], [1], [0], [0]):
        (got,) = pf.acquire_experts(0, order)
        where = h.acquire_slots(pf.tensor_ids(0, order))  # a second pin of the same slot
        (expert,) = order
        for name, tensor in got.items():
            assert torch.equal(tensor, expert_weights(expert)[name])
        seen.setdefault(expert, set()).add(int(where[0, 0]))
        assert got["w1"].data_ptr() == h.arena(0).ctypes.data + int(where[0, 0])
        h.release(pf.tensor_ids(0, order))
        pf.release_experts(0, order)
    assert len(seen[0]) == 2  # it did move
    assert h.stats()["pinned_count"] == 0


def test_acquired_weights_dict_is_the_callers(make_handle):
    h = make_handle(device_budget_bytes=1 << 20)
    pf = ExpertPrefetcher(h)
    populate(pf, layers=1, experts=1)
    (first,) = pf.acquire_experts(0, [0])
    first.pop("w1")
    first["junk"] = None
    pf.release_experts(0, [0])
    (again,) = pf.acquire_experts(0, [0])
    assert sorted(again) == ["w1", "w2", "w3"]
    pf.release_experts(0, [0])


def test_acquire_slots_and_arena(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    data = {tid: rng.integers(0, 256, size=300 + tid, dtype=np.uint8) for tid in range(3)}
    for tid, arr in data.items():
        h.register(tid, arr)
    where = h.acquire_slots([2, 0, 1])
    assert where.shape == (3, 2) and where.dtype == np.int64
    arena = h.arena(0)
    for tid, (offset, device) in zip([2, 0, 1], where.tolist()):
        assert device == 0 and offset % 256 == 0
        np.testing.assert_array_equal(arena[offset : offset + data[tid].size], data[tid])
    h.release([2, 0, 1])
    assert h.acquire_slots([]).shape == (0, 2)
    with pytest.raises(ValueError, match="no device 1"):
        h.arena(1)
    with pytest.raises(KeyError):
        h.acquire_slots([0, 99])
    assert h.stats()["pinned_count"] == 0


def test_automatic_ids_skip_ids_the_handle_already_has(make_handle):
    h = make_handle(device_budget_bytes=1 << 20)
    for tid in (0, 1, 4):
        h.register(tid, bytes([tid + 1]) * 64)
    pf = ExpertPrefetcher(h)
    populate(pf, layers=1, experts=2)
    other = ExpertPrefetcher(h)  # a second prefetcher on the same handle
    other.register_expert(0, 0, expert_weights(50))
    buffer, layout = prefetch.pack_expert(expert_weights(2))
    pf.register_packed(0, 2, buffer, layout)
    assert pf.tensor_ids(0, [0, 1, 2]).tolist() == [2, 3, 6]  # 4 was taken, 5 went to `other`
    assert other.tensor_id(0, 0) == 5
    got = pf.acquire_experts(0, [0, 1, 2])
    for expert, weights in enumerate(got):
        assert torch.equal(weights["w3"], expert_weights(expert)["w3"])
    pf.release_experts(0, [0, 1, 2])
    with other.experts(0, [0]) as (weights,):
        assert torch.equal(weights["w1"], expert_weights(50)["w1"])
    views = h.acquire([0, 1, 4])  # the ids registered by hand kept their bytes
    assert [bytes(v[:2]) for v in views] == [b"\x01\x01", b"\x02\x02", b"\x05\x05"]
    h.release([0, 1, 4])


def test_explicit_first_tensor_id_is_dense_and_refuses_taken_ids(make_handle):
    h = make_handle(device_budget_bytes=1 << 20)
    h.register(11, b"x" * 64)
    pf = ExpertPrefetcher(h, first_tensor_id=10)
    pf.register_expert(0, 0, expert_weights(0))
    assert pf.tensor_id(0, 0) == 10
    with pytest.raises(ValueError, match="tensor id 11 is already registered"):
        pf.register_expert(0, 1, expert_weights(1))
    with pytest.raises(KeyError):
        pf.tensor_id(0, 1)  # the failed expert is not half-registered
    assert list(pf.registered_experts()) == [(0, 0)]


def test_adopt_maps_an_id_registered_by_hand():
    import prefetch

    h = prefetch.PrefetchHandle(device_budget_bytes=1 << 16, backend="host", start_paused=True)
    try:
        h.register(7, np.arange(256, dtype=np.uint8))
        pf = prefetch.ExpertPrefetcher(h, use_batched=True)
        assert pf.adopt(2, 5, 7) == 7
        assert pf.tensor_ids(2, [5]).tolist() == [7]
        pf.prefetch_experts(2, [5], priority=3)
        assert h.queued() == [(3, 7)]
        with pytest.raises(ValueError, match="already registered"):
            pf.adopt(2, 5, 7)
        with pytest.raises(ValueError, match="already stands"):
            pf.adopt(3, 0, 7)
        with pytest.raises(KeyError, match="not registered"):
            pf.adopt(3, 0, 99)
        h.resume()
        with pytest.raises(ValueError, match="adopted without a layout"):
            pf.acquire_experts(2, [5], timeout=10)
        assert h.stats()["pinned_count"] == 0
    finally:
        h.close()


def packed_slot_bytes(weights) -> int:
    """The cache bytes an expert packed by pack_expert takes: its packed
    size (each part starts on a SLOT_ALIGNMENT boundary) rounded up to a
    whole slot."""
    last = expert_layout(weights)[-1]
    slot = prefetch.SLOT_ALIGNMENT
    return -(-(last.offset + last.nbytes) // slot) * slot


def test_holds_every_expert_follows_registrations_and_the_budgets(make_handle):
    # Note [No hints when everything fits]: each device's budget against the
    # slots its experts take (whole multiples of SLOT_ALIGNMENT), worked out
    # again at every registration through the prefetcher.
    weights = expert_weights(0)
    per = packed_slot_bytes(weights)
    h = make_handle(device_budget_bytes=[3 * per, 2 * per])
    pf = ExpertPrefetcher(h)
    assert not pf.holds_every_expert()  # nothing registered
    for expert in range(3):
        pf.register_expert(0, expert, weights, device=0)
    pf.register_expert(1, 0, weights, device=1)
    assert pf.holds_every_expert()
    pf.register_expert(1, 1, weights, device=1)
    assert pf.holds_every_expert()  # device 1 exactly full
    pf.register_expert(1, 2, weights, device=1)
    assert not pf.holds_every_expert()  # one too many on device 1; device 0 still fits
    # A packed buffer takes its whole size (the engine copies all of it).
    h2 = make_handle(device_budget_bytes=2 * per)
    pf2 = ExpertPrefetcher(h2)
    buffer, layout = prefetch.pack_expert(weights)
    pf2.register_packed(0, 0, buffer, layout)
    assert pf2.holds_every_expert()
    pf2.register_packed(0, 1, torch.zeros(per + 1, dtype=torch.uint8), layout)  # a slot more than per
    assert not pf2.holds_every_expert()
    # Tensors on the handle that are not the prefetcher's, and adopted ids
    # (their size is not known here), count as not fitting.
    h3 = make_handle(device_budget_bytes=1 << 20)
    h3.register(100, np.zeros(256, dtype=np.uint8))
    pf3 = ExpertPrefetcher(h3)
    pf3.register_expert(0, 0, weights)
    assert not pf3.holds_every_expert()
    h4 = make_handle(device_budget_bytes=1 << 20)
    pf4 = ExpertPrefetcher(h4)
    pf4.register_expert(0, 0, weights)
    assert pf4.holds_every_expert()
    h4.register(100, np.zeros(256, dtype=np.uint8))
    pf4.adopt(0, 1, 100)
    assert not pf4.holds_every_expert()
    # A closed handle holds nothing (asked again after a registration).
    h5 = make_handle(device_budget_bytes=1 << 20)
    pf5 = ExpertPrefetcher(h5)
    pf5.register_expert(0, 0, weights)
    assert pf5.holds_every_expert()
    h5.close()
    pf5.version += 1  # as a registration would (none is possible after close)
    assert not pf5.holds_every_expert()
    # An engine without budgets never holds everything.
    assert not ExpertPrefetcher(RecordingEngine(batched=True)).holds_every_expert()


def test_a_cache_that_holds_every_expert_never_evicts(make_handle, rng):
    # What Note [No hints when everything fits] rests on: with every
    # expert's slot inside the budget, acquires, releases, prefetches and
    # cancels in any order evict nothing, on every eviction policy.
    sizes = [(16, 24), (16, 8), (32, 24), (8, 8)]  # experts of four sizes
    for policy in ("lru", "cyclic", "next-use"):
        experts = [expert_weights(i, hidden=sizes[i % 4][0], inter=sizes[i % 4][1]) for i in range(12)]
        need = sum(packed_slot_bytes(e) for e in experts)
        h = make_handle(device_budget_bytes=need, eviction_policy=policy)
        pf = ExpertPrefetcher(h)
        for i, e in enumerate(experts):
            pf.register_expert(i // 4, i % 4, e)
        assert pf.holds_every_expert()
        for _ in range(60):
            layer = int(rng.integers(0, 3))
            chosen = sorted(set(rng.integers(0, 4, size=3).tolist()))
            ids = pf.tensor_ids(layer, chosen)
            what = rng.integers(0, 3)
            if what == 0:
                h.prefetch_tensors(ids, int(rng.integers(0, 5)))
            elif what == 1:
                h.cancel(ids)
            else:
                h.acquire(ids, timeout=10)
                h.release(ids)
        h.acquire(np.arange(12, dtype=np.int64), timeout=10)  # every expert at once still fits
        h.release(np.arange(12, dtype=np.int64))
        s = h.stats()
        assert s["evictions"] == 0 and s["resident_count"] == 12, (policy, s)


@pytest.mark.parametrize("nbytes", [1, 255, 256, 257, 1000, 4096])
def test_cache_slot_bytes_is_what_the_engine_charges(make_handle, nbytes):
    h = make_handle(device_budget_bytes=1 << 16)
    h.register(0, np.zeros(nbytes, dtype=np.uint8))
    h.acquire_slots([0])
    h.release([0])
    assert h.stats()["resident_bytes"] == cache_slot_bytes(nbytes)


def test_layer_makes_one_engine_call_and_releases_the_previous_layer(rng):
    # ExpertPrefetcher.layer: release the last layer's experts, acquire this
    # layer's, queue the guesses, in one step; the weights are the bytes
    # registered; bad input raises before anything changes.
    import torch

    import prefetch

    handle = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host")
    pf = prefetch.ExpertPrefetcher(handle)
    want = {}
    for layer in range(3):
        for expert in range(4):
            w = torch.from_numpy(rng.standard_normal(64).astype(np.float32) + 1.0)
            want[layer, expert] = w
            pf.register_expert(layer, expert, {"w": w})
    try:
        calls = []
        real_exchange = handle.exchange

        class Counting:
            def __getattr__(self, name):
                if name == "exchange":
                    def exchange(*a, **k):
                        calls.append(k.get("release") is not None)
                        return real_exchange(*a, **k)
                    return exchange
                return getattr(handle, name)

        pf.engine = Counting()
        got = pf.layer(0, [1, 3], prefetch={1: [0, 2]})
        assert [torch.equal(g["w"], want[0, e]) for g, e in zip(got, (1, 3))] == [True, True]
        assert handle.stats()["pinned_count"] == 2
        got = pf.layer(1, [0, 2], prefetch={2: [1]})
        assert [torch.equal(g["w"], want[1, e]) for g, e in zip(got, (0, 2))] == [True, True]
        assert calls == [False, True] and handle.stats()["pinned_count"] == 2  # layer 0's released
        before = (handle.stats()["pinned_count"], handle.queued())
        with pytest.raises(prefetch.UnknownIdError):
            pf.layer(2, [7])
        with pytest.raises(prefetch.UnknownIdError):
            pf.layer(2, [0], prefetch={9: [0]})
        assert (handle.stats()["pinned_count"], handle.queued()) == before  # unchanged
        pf.release_held()
        assert handle.stats()["pinned_count"] == 0
        pf.release_held()  # a no-op now
    finally:
        handle.close()
