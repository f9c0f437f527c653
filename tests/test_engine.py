"""Engine semantics on the host backend: real bytes, real worker threads."""
import threading
import time

import numpy as np
import pytest
from conftest import random_bytes, wait_until

import prefetch

SLOT = 256  # engine slot alignment; tensors of SLOT bytes fill one slot each


def register_random(h, rng, ids, size=SLOT, device=0):
    data = {}
    for tid in ids:
        data[tid] = random_bytes(rng, size)
        h.register(tid, data[tid], device=device)
    return data


def use_each(h, ids):
    """Acquires and releases each id in turn, one acquire call each."""
    for tid in ids:
        h.acquire([tid], timeout=10)
        h.release([tid])


def test_acquire_returns_byte_exact_copies(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 20)
    sizes = [1, 7, 255, 256, 257, 4096, 100_003]
    data = {i: random_bytes(rng, n) for i, n in enumerate(sizes)}
    for tid, arr in data.items():
        h.register(tid, arr)
    h.prefetch_tensors(list(data))
    views = h.acquire(list(data), timeout=10)
    for arr, view in zip(data.values(), views):
        assert view.dtype == np.uint8 and view.shape == arr.shape
        np.testing.assert_array_equal(view, arr)
    h.release(list(data))


def test_register_copies_the_source(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    src = random_bytes(rng, 1000)
    expected = src.copy()
    h.register(0, src)
    src[:] = 0  # the engine owns its copy
    (view,) = h.acquire([0], timeout=10)
    np.testing.assert_array_equal(view, expected)
    h.release([0])


def test_chunked_copy_is_byte_exact(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 20, copy_chunk_bytes=1000)
    arr = random_bytes(rng, 123_457)  # not a multiple of the chunk
    h.register(5, arr)
    h.prefetch_tensors([5], 1)  # a prefetch is copied in chunks
    (view,) = h.acquire([5], timeout=10)
    np.testing.assert_array_equal(view, arr)
    h.release([5])


def test_prefetches_go_in_chunks_and_on_demand_copies_whole(rng):
    # Note [Whole on-demand copies]: the fault backend counts its copy calls.
    with prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="fault", copy_chunk_bytes=1000) as h:
        a, b = random_bytes(rng, 123_457), random_bytes(rng, 54_321)
        h.register(0, a)
        h.register(1, b)
        h.prefetch_tensors([0], 1)
        deadline = time.monotonic() + 10
        while 0 not in h.resident() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert h.fault_counts()["copies"] == 124  # ceil(123457 / 1000)
        views = h.acquire([0, 1], timeout=10)  # 1 is a miss: one call
        assert h.fault_counts()["copies"] == 125
        np.testing.assert_array_equal(views[0], a)
        np.testing.assert_array_equal(views[1], b)
        h.release([0, 1])


def test_register_parts_packs_one_buffer(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    a, b = random_bytes(rng, 100), random_bytes(rng, 50)
    h.register_parts(1, [(a, 0), (b, 256)], total_bytes=400)
    (view,) = h.acquire([1], timeout=10)
    np.testing.assert_array_equal(view[:100], a)
    np.testing.assert_array_equal(view[256:306], b)
    assert not view[100:256].any() and not view[306:].any()
    h.release([1])


def test_dedup_and_counters(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16, start_paused=True)
    register_random(h, rng, range(4))
    h.prefetch_tensors([0, 1, 2])
    h.prefetch_tensors([1, 2, 3, 3])
    s = h.stats()
    assert s["requests"] == 7
    assert s["enqueued"] == 4
    assert s["deduplicated"] == 3
    assert s["requests"] == s["enqueued"] + s["deduplicated"]
    assert s["queue_depth"] == 4
    assert h.queued() == [(1, 0), (1, 1), (1, 2), (1, 3)]


def test_requeue_keeps_the_more_urgent_band(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16, start_paused=True)
    register_random(h, rng, range(3))
    h.prefetch_tensors([0, 1, 2], priority=5)
    h.prefetch_tensors([1], priority=2)  # upgrade
    h.prefetch_tensors([2], priority=9)  # less urgent: ignored
    assert h.queued() == [(2, 1), (5, 0), (5, 2)]
    assert h.stats()["upgraded"] == 1


def test_workers_copy_most_urgent_first(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16, start_paused=True)
    register_random(h, rng, range(6))
    h.prefetch_tensors([0, 1], priority=7)
    h.prefetch_tensors([2, 3], priority=3)
    h.prefetch_tensors([4, 5], priority=0)
    h.resume()
    assert wait_until(lambda: h.stats()["copies"] == 6)
    # Resident order is copy order (nothing was touched since).
    assert h.resident() == [4, 5, 2, 3, 0, 1]


def test_resident_id_is_touched_not_copied_again(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    register_random(h, rng, range(2))
    h.prefetch_tensors([0, 1])
    assert wait_until(lambda: h.stats()["copies"] == 2)
    assert h.resident() == [0, 1]
    h.prefetch_tensors([0])
    s = h.stats()
    assert s["copies"] == 2 and s["touched"] == 1
    assert h.resident() == [1, 0]


def test_targeted_cancel(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16, start_paused=True)
    register_random(h, rng, range(5))
    h.prefetch_tensors([0, 1, 2, 3])
    assert h.cancel([1, 3, 4]) == 2  # 4 is registered but not queued
    assert h.queued() == [(1, 0), (1, 2)]
    assert h.stats()["cancelled"] == 2
    h.prefetch_tensors([1])  # a cancelled id can be queued again
    assert h.queued() == [(1, 0), (1, 2), (1, 1)]


def test_cancel_at_or_below_band(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16, start_paused=True)
    register_random(h, rng, range(6))
    for tid, band in zip(range(6), [0, 1, 2, 3, 4, 19]):
        h.prefetch_tensors([tid], priority=band)
    assert h.cancel_below(3) == 3
    assert h.queued() == [(0, 0), (1, 1), (2, 2)]
    assert h.cancel_all() == 3
    assert h.queued() == []


def test_lru_evicts_least_recently_used(make_handle, rng):
    h = make_handle(device_budget_bytes=3 * SLOT)
    data = register_random(h, rng, range(4))
    for tid in range(3):
        (v,) = h.acquire([tid], timeout=10)
        h.release([tid])
    assert h.resident() == [0, 1, 2]
    h.acquire([0], timeout=10)  # 0 becomes most recent
    h.release([0])
    views = h.acquire([3], timeout=10)  # evicts 1, the least recent
    np.testing.assert_array_equal(views[0], data[3])
    h.release([3])
    assert h.resident() == [2, 0, 3]
    s = h.stats()
    assert s["evictions"] == 1
    assert s["wasted"] == 0  # 1 was acquired before eviction


def test_prefetched_then_evicted_unused_counts_as_wasted(make_handle, rng):
    h = make_handle(device_budget_bytes=2 * SLOT)
    register_random(h, rng, range(3))
    h.prefetch_tensors([0, 1])  # both wanted by the next acquire call
    assert wait_until(lambda: h.stats()["copies"] == 2)
    for _ in range(2):  # two acquire calls: 1's time passed without a read
        h.acquire([0], timeout=10)
        h.release([0])
    h.prefetch_tensors([2])
    assert wait_until(lambda: h.stats()["copies"] == 3)
    s = h.stats()
    assert s["evictions"] == 1 and s["wasted"] == 1 and s["declined"] == 0
    assert h.resident() == [0, 2]


def test_a_guess_never_evicts_a_guess_wanted_sooner(make_handle, rng):
    # Note [Speculation never hurts]: 0 and 1 are wanted by the next acquire
    # call (band 1), 2 only by the one after (band 2): 2 is declined, the
    # cache keeps 0 and 1, and nothing is wasted.
    h = make_handle(device_budget_bytes=2 * SLOT)
    register_random(h, rng, range(3))
    h.prefetch_tensors([0, 1], priority=1)
    assert wait_until(lambda: h.stats()["copies"] == 2)
    h.prefetch_tensors([2], priority=2)
    assert wait_until(lambda: h.stats()["declined"] == 1)
    s = h.stats()
    assert s["copies"] == 2 and s["evictions"] == 0 and s["queue_depth"] == 0
    assert sorted(h.resident()) == [0, 1]
    # An on-demand miss is never refused: it evicts a guess.
    views = h.acquire([2], timeout=10)
    assert len(views) == 1
    h.release([2])
    assert h.stats()["evictions"] == 1


def test_a_guess_may_evict_one_wanted_later(make_handle, rng):
    h = make_handle(device_budget_bytes=2 * SLOT)
    register_random(h, rng, range(3))
    h.prefetch_tensors([0, 1], priority=3)
    assert wait_until(lambda: h.stats()["copies"] == 2)
    h.prefetch_tensors([2], priority=1)  # wanted sooner than 0 and 1
    assert wait_until(lambda: h.stats()["copies"] == 3)
    s = h.stats()
    assert s["evictions"] == 1 and s["declined"] == 0
    assert 2 in h.resident()


def test_budget_is_never_exceeded(make_handle, rng):
    budget = 10 * SLOT
    h = make_handle(device_budget_bytes=budget)
    sizes = rng.integers(1, 3 * SLOT, size=40)
    data = {i: random_bytes(rng, int(n)) for i, n in enumerate(sizes)}
    for tid, arr in data.items():
        h.register(tid, arr)
    for _ in range(30):
        batch = rng.choice(40, size=8, replace=False)
        h.prefetch_tensors(batch)
        pick = [int(x) for x in rng.choice(40, size=2, replace=False)]
        views = h.acquire(pick, timeout=10)
        for tid, view in zip(pick, views):
            np.testing.assert_array_equal(view, data[tid])
        assert h.stats()["resident_bytes"] <= budget
        h.release(pick)
    s = h.stats()
    assert s["resident_bytes"] <= budget
    assert s["acquires"] == s["hits"] + s["misses"] == 60
    assert s["late"] <= s["misses"]
    assert s["wasted"] <= s["evictions"]


def test_pinned_entries_are_never_evicted(make_handle, rng):
    h = make_handle(device_budget_bytes=2 * SLOT)
    data = register_random(h, rng, range(3))
    views = h.acquire([0, 1], timeout=10)
    h.prefetch_tensors([2])  # no room: both slots pinned
    with pytest.raises(TimeoutError, match="tensor id 2"):
        h.acquire([2], timeout=0.2)
    assert sorted(h.resident()) == [0, 1]
    for tid, view in zip([0, 1], views):
        np.testing.assert_array_equal(view, data[tid])
    assert h.stats()["pinned_count"] == 2  # the failed acquire unpinned 2
    h.release([0])
    (v2,) = h.acquire([2], timeout=10)
    np.testing.assert_array_equal(v2, data[2])
    np.testing.assert_array_equal(views[1], data[1])
    h.release([1, 2])


def test_acquire_waits_until_a_release_frees_room(make_handle, rng):
    h = make_handle(device_budget_bytes=SLOT)
    data = register_random(h, rng, range(2))
    h.acquire([0], timeout=10)
    got = {}

    def waiter():
        got["views"] = h.acquire([1], timeout=20)

    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    assert t.is_alive()
    h.release([0])
    t.join(timeout=20)
    assert not t.is_alive()
    np.testing.assert_array_equal(got["views"][0], data[1])
    h.release([1])


def test_tensor_larger_than_budget_is_refused(make_handle):
    h = make_handle(device_budget_bytes=4096)
    with pytest.raises(ValueError, match="budget"):
        h.register(0, np.ones(5000, np.uint8))
    assert 0 not in h
    assert h.stats()["registered"] == 0


def test_multi_device_routing(make_handle, rng):
    h = make_handle(device_budget_bytes=[4 * SLOT, 4 * SLOT])
    assert h.num_devices == 2
    d0 = register_random(h, rng, [0, 1], device=0)
    d1 = register_random(h, rng, [2, 3], device=1)
    h.prefetch_tensors([0, 2, 1, 3])
    views = h.acquire([0, 1, 2, 3], timeout=10)
    for tid, view in zip([0, 1, 2, 3], views):
        np.testing.assert_array_equal(view, {**d0, **d1}[tid])
    assert sorted(h.resident(0)) == [0, 1]
    assert sorted(h.resident(1)) == [2, 3]
    h.release([0, 1, 2, 3])


def test_two_handles_are_independent(make_handle, rng):
    a = make_handle(device_budget_bytes=1 << 16)
    b = make_handle(device_budget_bytes=1 << 16)
    da = register_random(a, rng, [0])
    db = register_random(b, rng, [0])
    (va,) = a.acquire([0], timeout=10)
    (vb,) = b.acquire([0], timeout=10)
    np.testing.assert_array_equal(va, da[0])
    np.testing.assert_array_equal(vb, db[0])
    a.release([0])
    a.close()
    np.testing.assert_array_equal(vb, db[0])
    b.release([0])
    assert b.stats()["acquires"] == 1


def test_unregister(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    register_random(h, rng, [0, 1])
    h.acquire([0], timeout=10)
    with pytest.raises(RuntimeError, match="acquired"):
        h.unregister(0)
    h.release([0])
    h.unregister(0)
    assert 0 not in h and 1 in h
    s = h.stats()
    assert s["registered"] == 1 and s["resident_count"] == 0
    with pytest.raises(KeyError):
        h.prefetch_tensors([0])


def test_gil_is_released_during_batched_call(make_handle, rng):
    # The engine sleeps 300 ms inside the nogil region; a peer Python thread
    # must make progress inside that window (it could not if the GIL were
    # held). Both clocks are CLOCK_MONOTONIC.
    h = make_handle(device_budget_bytes=1 << 16, start_paused=True, debug_issue_delay_us=300_000)
    register_random(h, rng, range(8))
    stamps = []
    stop = threading.Event()
    started = threading.Event()

    def peer():
        started.set()
        while not stop.is_set():
            stamps.append(time.monotonic_ns())

    t = threading.Thread(target=peer)
    t.start()
    started.wait()
    h.prefetch_tensors(np.arange(8, dtype=np.int64))
    stop.set()
    t.join()
    s = h.stats()
    start, end = s["last_batch_start_ns"], s["last_batch_end_ns"]
    assert end - start >= 300_000_000
    inside = [x for x in stamps if start < x < end]
    assert len(inside) > 100, f"peer thread ran {len(inside)} times during the call"
    assert s["enqueued"] == 8


def test_close_is_idempotent_and_later_calls_raise(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    register_random(h, rng, [0])
    h.close()
    h.close()
    assert h.closed
    for call in (
        lambda: h.prefetch_tensors([0]),
        lambda: h.enqueue_prefetch(0),
        lambda: h.acquire([0]),
        lambda: h.release([0]),
        lambda: h.cancel([0]),
        lambda: h.cancel_all(),
        lambda: h.stats(),
        lambda: h.register(1, b"x"),
        lambda: h.unregister(0),
        lambda: h.pause(),
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    assert 0 not in h


def test_close_wakes_a_blocked_acquirer(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16, start_paused=True)
    register_random(h, rng, [0])
    errors = []

    def waiter():
        try:
            h.acquire([0], timeout=60)
        except Exception as exc:  # noqa: BLE001 - recorded and asserted below
            errors.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    assert wait_until(lambda: h.stats()["pinned_count"] == 1)
    t0 = time.monotonic()
    h.close()
    t.join(timeout=10)
    assert not t.is_alive()
    assert time.monotonic() - t0 < 5
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert "closed" in str(errors[0])


def test_close_with_many_queued_is_bounded(rng):
    h = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host", start_paused=True)
    for tid in range(10_000):
        h.register(tid, b"\x01\x02")
    h.prefetch_tensors(np.arange(10_000))
    h.resume()
    t0 = time.monotonic()
    h.close()
    assert time.monotonic() - t0 < 2.0


def test_context_manager_closes(rng):
    with prefetch.PrefetchHandle(device_budget_bytes=1 << 16, backend="host") as h:
        h.register(0, b"abc")
        (v,) = h.acquire([0], timeout=10)
        assert bytes(v) == b"abc"
        h.release([0])
    assert h.closed


def test_on_demand_acquire_of_unrequested_id(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    data = register_random(h, rng, [0])
    (v,) = h.acquire([0], timeout=10)
    np.testing.assert_array_equal(v, data[0])
    s = h.stats()
    assert s["misses"] == 1 and s["hits"] == 0 and s["copies"] == 1
    h.release([0])
    h.acquire([0], timeout=10)
    s = h.stats()
    assert s["hits"] == 1 and s["copies"] == 1
    h.release([0])


def test_acquire_timeout_when_paused_leaves_nothing_pinned(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16, start_paused=True)
    register_random(h, rng, [0, 1])
    with pytest.raises(TimeoutError, match="paused"):
        h.acquire([0, 1], timeout=0.05)
    assert h.stats()["pinned_count"] == 0
    with pytest.raises(RuntimeError, match="not acquired"):
        h.release([0])


def test_backend_choice(make_handle):
    h = make_handle(device_budget_bytes=4096, backend="auto")
    assert h.backend in ("host", "cuda")
    with pytest.raises(ValueError, match="backend"):
        prefetch.PrefetchHandle(device_budget_bytes=4096, backend="tpu")


def test_evict_drops_unpinned_residents_only(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    register_random(h, rng, range(3))
    h.acquire([0, 1, 2], timeout=10)
    h.release([0, 1])
    assert h.evict([0, 1, 2]) == 2  # 2 is still acquired
    assert h.resident() == [2]
    assert h.evict([0]) == 0  # not resident any more
    with pytest.raises(KeyError):
        h.evict([0, 99])
    h.release([2])
    assert h.stats()["evictions"] == 2


def test_register_external_copies_from_caller_memory(make_handle, rng):
    h = make_handle(device_budget_bytes=1 << 16)
    arr = random_bytes(rng, 3000)
    h.register_external(0, arr)
    (v,) = h.acquire([0], timeout=10)
    np.testing.assert_array_equal(v, arr)  # read from the caller's array, no copy at registration
    h.release([0])
    assert h.evict([0]) == 1
    arr[:10] = 7  # the engine reads the caller's bytes at copy time
    (v,) = h.acquire([0], timeout=10)
    assert (v[:10] == 7).all()
    h.release([0])
    with pytest.raises(ValueError):
        h.register_external(1, arr[::2])  # not contiguous
    with pytest.raises(TypeError):
        h.register_external(1, b"bytes")
    with pytest.raises(ValueError, match="already registered"):
        h.register_external(0, arr)
    h.unregister(0)
    assert h.stats()["registered"] == 0


def lru_and_cyclic_hits(make_handle, rng, loops):
    """Acquires ids 0..3 in a loop, one acquire call each, through a cache of
    3 slots under each eviction policy; returns (hits, resident order) per
    policy."""
    out = {}
    for policy in ("lru", "cyclic"):
        h = make_handle(device_budget_bytes=3 * SLOT, eviction_policy=policy)
        data = register_random(h, rng, range(4))
        for _ in range(loops):
            for tid in range(4):
                (v,) = h.acquire([tid], timeout=10)
                np.testing.assert_array_equal(v, data[tid])
                h.release([tid])
        out[policy] = (h.stats()["hits"], h.resident())
    return out


def mru_loop_hits(n_ids, capacity, loops):
    """Hits of most-recently-used eviction on a loop over n_ids (the rule that
    Note [Cyclic eviction] gives for acquired entries)."""
    cache, hits = [], 0  # cache in use order, newest last
    for _ in range(loops):
        for tid in range(n_ids):
            if tid in cache:
                hits += 1
                cache.remove(tid)
            elif len(cache) == capacity:
                cache.pop()  # the most recently used
            cache.append(tid)
    return hits


def test_cyclic_eviction_hits_on_a_loop_where_lru_never_does(make_handle, rng):
    got = lru_and_cyclic_hits(make_handle, rng, loops=5)
    assert got["lru"][0] == 0  # a loop one larger than the cache: LRU always misses
    assert got["cyclic"][0] == mru_loop_hits(4, 3, 5)
    assert got["cyclic"][0] >= 10  # of 20 acquires


def test_cyclic_evicts_the_last_used_and_keeps_prefetched(make_handle, rng):
    h = make_handle(device_budget_bytes=3 * SLOT, eviction_policy="cyclic")
    data = register_random(h, rng, range(6))
    use_each(h, (0, 1))
    h.prefetch_tensors([2])  # fresh: the next layer will read it
    assert wait_until(lambda: h.stats()["copies"] == 3)
    assert h.resident() == [1, 0, 2]  # used newest first, then fresh
    (v,) = h.acquire([3], timeout=10)  # evicts 1, the last used, not 2
    np.testing.assert_array_equal(v, data[3])
    h.release([3])
    assert h.resident() == [3, 0, 2]
    assert h.stats()["wasted"] == 0
    # A prefetch request for a used resident entry makes it fresh again.
    h.prefetch_tensors([0])
    assert h.resident() == [3, 2, 0]


def test_cyclic_prefetched_but_never_acquired_goes_stale(make_handle, rng):
    h = make_handle(device_budget_bytes=3 * SLOT, eviction_policy="cyclic")
    register_random(h, rng, range(4))
    h.prefetch_tensors([2])  # a wrong prediction: never acquired
    assert wait_until(lambda: h.stats()["copies"] == 1)
    for _ in range(8):  # 8 acquire calls pass it by: still protected
        h.acquire([0], timeout=10)
        h.release([0])
    assert h.resident() == [0, 2]
    h.acquire([1], timeout=10)  # the 9th: 2 is now stale and goes first
    h.release([1])
    assert h.resident() == [2, 1, 0]
    h.acquire([3], timeout=10)
    h.release([3])
    assert 2 not in h.resident()
    assert h.stats()["wasted"] == 1


def belady_hits(seq, capacity):
    """Hits of Belady's rule (evict the farthest next use; never again first)
    on an access sequence: the optimum any cache of `capacity` can reach."""
    cache, hits = set(), 0
    for t, tid in enumerate(seq):
        if tid in cache:
            hits += 1
            continue
        if len(cache) == capacity:
            rest = seq[t + 1 :]
            cache.remove(max(cache, key=lambda x, rest=rest: rest.index(x) if x in rest else len(seq)))
        cache.add(tid)
    return hits


def next_time(seq, t):
    """When seq[t] is next read after time t, or None."""
    for u in range(t + 1, len(seq)):
        if seq[u] == seq[t]:
            return u
    return None


def test_next_use_eviction_with_true_hints_reaches_belady(make_handle, rng):
    seq = [int(x) for x in rng.integers(0, 7, size=120)]
    h = make_handle(device_budget_bytes=3 * SLOT, eviction_policy="next-use")
    data = register_random(h, rng, range(7))
    for t, tid in enumerate(seq):
        h.hint_next_use([], None, now=t)
        (v,) = h.acquire([tid], timeout=10)
        np.testing.assert_array_equal(v, data[tid])
        h.release([tid])
        h.hint_next_use([tid], next_time(seq, t))
    hits = h.stats()["hits"]
    assert hits == belady_hits(seq, 3)
    # The same accesses under LRU and cyclic do worse on this sequence.
    for policy in ("lru", "cyclic"):
        other = make_handle(device_budget_bytes=3 * SLOT, eviction_policy=policy)
        register_random(other, rng, range(7))
        for tid in seq:
            other.acquire([tid], timeout=10)
            other.release([tid])
        assert other.stats()["hits"] < hits, policy


def test_next_use_victim_order(make_handle, rng):
    h = make_handle(device_budget_bytes=6 * SLOT, eviction_policy="next-use")
    register_random(h, rng, range(7))
    assert h.hint_clock() is None and h.eviction_policy == "next-use"
    h.hint_next_use([0, 1, 2], [30, 10, 20], now=5)
    h.hint_next_use([3], 7)
    use_each(h, range(6))  # 4 and 5 have no hint; 5 was acquired last
    # No hint first (least recently used first), then farthest next use.
    assert h.resident() == [4, 5, 0, 2, 1, 3]
    h.hint_next_use([], None, now=15)  # 1's and 3's reads have passed
    assert h.resident() == [4, 5, 3, 1, 0, 2]
    h.hint_next_use([4], 100)  # a resident entry takes a new hint at once
    assert h.resident() == [5, 3, 1, 4, 0, 2]
    (v,) = h.acquire([6], timeout=10)  # evicts 5, the first in that order
    h.release([6])
    assert 5 not in h.resident() and h.stats()["evictions"] == 1
    h.hint_next_use([6, 4], None)  # cleared: back to the front, by their last use (4's is older)
    assert h.resident()[:2] == [4, 6]


def test_next_use_orders_one_time_by_arrival(make_handle, rng):
    # Within one hinted time entries go in order of arrival there (Note
    # [Next-use eviction]): a hint to another time, a use or a request is an
    # arrival (the newest); a hint to the time an entry already has leaves
    # it in place; a time whose entries all moved away can be taken again.
    # The unhinted go by their last touch, whenever their hint was cleared.
    h = make_handle(device_budget_bytes=5 * SLOT, eviction_policy="next-use")
    register_random(h, rng, range(5))
    use_each(h, range(5))
    assert h.resident() == [0, 1, 2, 3, 4]  # unhinted: least recently touched first
    h.hint_next_use([3, 1], [20, 20], now=0)
    h.hint_next_use([0, 4, 2], [20, 20, 20])  # arrivals at 20: 3, 1, 0, 4, 2
    # One valid time: the newest arrival first (farthest first, then the latest).
    assert h.resident() == [2, 4, 0, 1, 3]
    use_each(h, [1])
    assert h.resident() == [1, 2, 4, 0, 3]
    h.hint_next_use([3, 1], [20, 20])  # the same time: no move
    assert h.resident() == [1, 2, 4, 0, 3]
    h.hint_next_use([0, 1, 2, 3, 4], [10, 30, 10, 30, 10])  # time 20 emptied
    assert h.resident() == [3, 1, 4, 2, 0]
    h.hint_next_use([4, 0], [20, 20])  # time 20 again
    assert h.resident() == [3, 1, 0, 4, 2]
    h.hint_next_use([], None, now=25)  # 10 and 20 passed: expired, earliest first, first arrived first
    assert h.resident() == [2, 4, 0, 3, 1]
    h.hint_next_use([1], prefetch.NO_NEXT_USE)  # cleared: first, with the unhinted
    assert h.resident() == [1, 2, 4, 0, 3]
    h.hint_next_use([3], None)  # cleared after 1, but touched before it (1 was used again)
    assert h.resident() == [3, 1, 2, 4, 0]


def test_next_use_hint_before_the_copy_is_kept(make_handle, rng):
    h = make_handle(device_budget_bytes=3 * SLOT, eviction_policy="next-use")
    register_random(h, rng, range(3))
    h.hint_next_use([0, 1, 2], [9, 5, 7], now=0)  # none resident yet
    h.prefetch_tensors([0, 1, 2])
    assert wait_until(lambda: h.stats()["copies"] == 3)
    assert h.resident() == [0, 2, 1]


def test_next_use_bad_hints_change_nothing(make_handle, rng):
    h = make_handle(device_budget_bytes=4 * SLOT, eviction_policy="next-use")
    register_random(h, rng, range(4))
    h.hint_next_use([0, 1, 2, 3], [4, 3, 2, 1], now=1)
    use_each(h, range(4))
    order = h.resident()
    assert order == [0, 1, 2, 3]
    with pytest.raises(KeyError):
        h.hint_next_use([3, 99], [50, 50])  # 3 must not move
    with pytest.raises(ValueError, match="negative"):
        h.hint_next_use([3, 2], [50, -2])
    with pytest.raises(ValueError, match="never goes back"):
        h.hint_next_use([3], 50, now=0)
    with pytest.raises(ValueError, match="3 times for 2"):
        h.hint_next_use([3, 2], [1, 2, 3])
    with pytest.raises(TypeError):
        h.hint_next_use([3], 50, now=True)
    with pytest.raises(TypeError, match="^when must be integers, got float"):
        h.hint_next_use([3], [1.5])
    with pytest.raises(TypeError, match="^when must be a list, .* got float"):
        h.hint_next_use([3], 5.0)
    with pytest.raises(TypeError, match="^hint_when must be a list, .* got float"):
        h.exchange(hint_ids=[3], hint_when=5.0)
    assert h.resident() == order
    assert h.hint_clock() == 1
    # The clock did not move either: hints at 1 are still valid.
    h.hint_next_use([], None, now=2)
    assert h.resident() == [3, 0, 1, 2]


def test_hints_are_kept_but_ignored_by_other_policies(make_handle, rng):
    h = make_handle(device_budget_bytes=3 * SLOT, eviction_policy="lru")
    register_random(h, rng, range(3))
    use_each(h, range(3))
    h.hint_next_use([0, 1, 2], [1, 100, 2], now=0)
    assert h.resident() == [0, 1, 2]


def test_no_next_use_in_a_sequence_clears_one_hint(make_handle, rng):
    h = make_handle(device_budget_bytes=2 * SLOT, eviction_policy="next-use")
    register_random(h, rng, range(2))
    use_each(h, range(2))
    h.hint_next_use([0, 1], [5, 9], now=0)
    assert h.resident() == [1, 0]
    h.hint_next_use([0, 1], [prefetch.NO_NEXT_USE, 9])
    assert h.resident() == [0, 1]


@pytest.mark.parametrize("cycle", [0, 2])
def test_cyclic_with_a_cycle_evicts_leftovers_before_the_working_set(make_handle, rng, cycle):
    # Four leftovers (0-3, used once, like a prompt's experts) fill a cache of
    # four; then a loop of two layers reads 4 and 5 in turn. With the cycle
    # known (2 acquire calls per step) the leftovers go first and the loop
    # hits from its second step on; without it MRU evicts the loop's own
    # experts and every read misses (Note [Cyclic eviction]).
    h = make_handle(device_budget_bytes=4 * SLOT, eviction_policy="cyclic", cycle_acquires=cycle)
    register_random(h, rng, range(6))
    for tid in range(4):
        h.acquire([tid], timeout=10)
        h.release([tid])
    before = h.stats()["misses"]
    for _ in range(5):
        for tid in (4, 5):
            h.acquire([tid], timeout=10)
            h.release([tid])
    misses = h.stats()["misses"] - before
    if cycle:
        assert misses == 2
        assert sorted(h.resident())[-2:] == [4, 5]
    else:
        assert misses == 10


def test_cycle_acquires_is_checked():
    with pytest.raises(ValueError, match="cycle_acquires"):
        prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host", cycle_acquires=-1)


def test_acquire_that_can_never_fit_raises_at_once(make_handle, rng):
    # Three one-slot tensors, room for two: no wait for the timeout, a
    # ValueError naming the budget and the bytes, and nothing pinned.
    h = make_handle(device_budget_bytes=2 * SLOT)
    register_random(h, rng, range(3))
    with pytest.raises(ValueError, match=r"needs 768 bytes .* budget is 512"):
        h.acquire([0, 1, 2], timeout=30)
    assert h.stats()["pinned_count"] == 0 and h.stats()["acquires"] == 0
    h.acquire([0, 0, 1], timeout=10)  # duplicates hold one slot: fits
    h.release([0, 0, 1])


def test_exchange_runs_release_cancel_acquire_prefetch_in_one_call(make_handle, rng):
    h = make_handle(device_budget_bytes=8 * SLOT, eviction_policy="cyclic")
    data = register_random(h, rng, range(6))
    where = h.exchange([0, 1], prefetch=[2, 3], priority=1)
    assert where.shape == (2, 2)
    arena = h.arena(0)
    for tid, (offset, device) in zip([0, 1], where.tolist()):
        assert device == 0
        np.testing.assert_array_equal(arena[offset : offset + SLOT], data[tid])
    assert h.stats()["pinned_count"] == 2
    assert wait_until(lambda: h.stats()["queue_depth"] == 0)
    h.pause()
    h.prefetch_tensors([4, 5], 2)
    # Release the last layer, drop a wrong guess (5), acquire 2 and 3.
    where = h.exchange([2, 3], release=[0, 1], cancel=[5])
    s = h.stats()
    assert s["pinned_count"] == 2 and s["cancelled"] == 1
    assert [tid for _, tid in h.queued()] == [4]
    h.resume()
    h.exchange(None, release=[2, 3])
    assert h.stats()["pinned_count"] == 0


def test_exchange_refuses_bad_arguments_and_changes_nothing(make_handle, rng):
    h = make_handle(device_budget_bytes=4 * SLOT)
    register_random(h, rng, range(6))
    h.acquire([0], timeout=10)
    h.pause()
    h.prefetch_tensors([3])
    before = h.stats()
    bad = [
        (dict(acquire=[1], release=[0, 2]), RuntimeError),  # 2 is not acquired
        (dict(acquire=[1, 99], release=[0]), KeyError),
        (dict(acquire=[1], release=[0], prefetch=[77]), KeyError),
        (dict(acquire=[1], release=[0], cancel=[3], priority=20), ValueError),
        (dict(acquire=[1, 2, 4, 5, 0], release=[0]), ValueError),  # can never fit
        (dict(acquire=[1], release=[0], hint_ids=[1], hint_when=[-1]), ValueError),
        (dict(acquire=[1], release=[0], hint_ids=[1, 2], hint_when=[5]), ValueError),
        (dict(acquire=[1], release=[0], timeout=-1), ValueError),
    ]
    for kwargs, error in bad:
        with pytest.raises(error):
            h.exchange(**kwargs)
        after = h.stats()
        assert after["pinned_count"] == 1 and after["cancelled"] == 0, kwargs
        assert after["acquires"] == before["acquires"] and h.queued() == [(1, 3)], kwargs
    h.resume()
    h.release([0])


def test_an_exchange_prefetch_id_unregistered_while_it_waits_is_dropped(make_handle, rng):
    # Note [A step's prefetches after its wait]: the acquire waits with the
    # lock dropped, and another thread unregisters a prefetch id meanwhile.
    # The exchange succeeds with its acquire held and the other guess queued;
    # the gone one is dropped and counted. (It used to raise after the
    # acquire had succeeded, its pins left for good.)
    h = make_handle(device_budget_bytes=4 * SLOT)
    data = register_random(h, rng, range(6))
    h.acquire([1], timeout=10)
    h.pause()
    results = []

    def layer():
        try:
            results.append(h.exchange([0], release=[1], prefetch=[4, 5], timeout=30))
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            results.append(exc)

    t = threading.Thread(target=layer)
    t.start()
    # stats() takes the lock, which the exchange drops only in its wait.
    assert wait_until(lambda: h.stats()["acquires"] == 2)
    h.unregister(5)
    h.resume()
    t.join(30)
    assert not t.is_alive()
    assert len(results) == 1 and isinstance(results[0], np.ndarray), results
    (offset, _), = results[0].tolist()
    np.testing.assert_array_equal(h.arena(0)[offset : offset + SLOT], data[0])
    s = h.stats()
    assert s["pinned_count"] == 1 and s["prefetches_gone"] == 1
    assert wait_until(lambda: 4 in h.resident())  # the other guess was queued and copied
    h.exchange(None, release=[0])
    assert h.stats()["pinned_count"] == 0
    h.unregister(1)  # released by the exchange


def test_an_exchange_whose_handle_closes_while_it_waits_raises_closed(make_handle, rng):
    # An exchange waiting in its acquire when the handle closes raises, and its
    # prefetches are not queued. (This close lands in the acquire's wait;
    # the check Note [A step's prefetches after its wait] adds is for the
    # shorter window of the acquire's CPU waits, which no test reaches.)
    h = make_handle(device_budget_bytes=4 * SLOT)
    register_random(h, rng, range(6))
    h.pause()
    errors = []

    def layer():
        try:
            h.exchange([0], prefetch=[4], timeout=30)
        except Exception as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    t = threading.Thread(target=layer)
    t.start()
    assert wait_until(lambda: h.stats()["acquires"] == 1)
    h.close()
    t.join(30)
    assert not t.is_alive()
    assert len(errors) == 1 and "closed" in str(errors[0]), errors


def test_exchange_pins_resident_ids_without_waiting_or_fetching(make_handle, rng):
    # Note [Pins without waiting]: resident ids are pinned and their offsets
    # written; the others get -1 and are neither fetched nor queued.
    h = make_handle(device_budget_bytes=4 * SLOT, eviction_policy="lru")
    data = register_random(h, rng, range(8))
    h.acquire([0, 1, 2], timeout=10)
    h.release([0, 1, 2])
    acquires = h.stats()["acquires"]
    out = np.full(5, 7, dtype=np.int64)
    h.exchange(pin=[0, 3, 1, 6, 2], pin_into=out)
    assert out[1] == -1 and out[3] == -1
    arena = h.arena(0)
    for tid, offset in zip([0, 1, 2], out[[0, 2, 4]]):
        np.testing.assert_array_equal(arena[offset : offset + SLOT], data[tid])
    s = h.stats()
    assert s["pinned_count"] == 3 and s["queue_depth"] == 0 and s["acquires"] == acquires
    assert 3 not in h.resident() and 6 not in h.resident()
    # Pinned ids are not evicted: prefetching more than the free room keeps them.
    h.prefetch_tensors([3, 4, 5, 6, 7], 1)
    assert wait_until(lambda: h.stats()["queue_depth"] == 0 and h.stats()["bytes_in_flight"] == 0)
    assert {0, 1, 2} <= set(h.resident())
    h.exchange(release=[0, 1, 2])
    assert h.stats()["pinned_count"] == 0


def test_exchange_pin_and_use_refuse_bad_arguments_and_change_nothing(make_handle, rng):
    h = make_handle(device_budget_bytes=4 * SLOT)
    register_random(h, rng, range(4))
    h.acquire([0, 1], timeout=10)
    bad = [
        (dict(release=[0], pin=[1, 99], pin_into=np.empty(2, np.int64)), KeyError),
        (dict(release=[0], pin=[1], pin_into=np.empty(2, np.int64)), ValueError),  # wrong length
        (dict(release=[0], pin=[1]), ValueError),  # nowhere to write offsets
        (dict(release=[0], pin_into=np.empty(1, np.int64)), ValueError),
        (dict(release=[0], pin=[1], pin_into=np.empty(1, np.int32)), ValueError),  # not int64
        (dict(release=[0], use=[42]), KeyError),
    ]
    for kwargs, error in bad:
        with pytest.raises(error):
            h.exchange(**kwargs)
        assert h.stats()["pinned_count"] == 2, kwargs  # the release did not happen either
    h.release([0, 1])


def test_step_is_exchange_under_its_old_name_without_a_warning(make_handle, rng):
    # Note [priority, formerly band]: ``step`` is the same function, and a
    # call through it costs nothing more (no warning on the hot path).
    import warnings

    assert prefetch.PrefetchHandle.step is prefetch.PrefetchHandle.exchange
    h = make_handle(device_budget_bytes=4 * SLOT)
    data = register_random(h, rng, range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        where = h.step([0], prefetch=[1], priority=2)
    (offset, _), = where.tolist()
    np.testing.assert_array_equal(h.arena(0)[offset : offset + SLOT], data[0])
    h.exchange(None, release=[0])
    assert h.stats()["pinned_count"] == 0


def test_band_is_priority_under_its_old_name_with_a_deprecation_warning(make_handle, rng):
    # Note [priority, formerly band]: band= alone is used and warns; band=
    # with priority= is a TypeError that changes nothing.
    h = make_handle(device_budget_bytes=8 * SLOT, start_paused=True)
    register_random(h, rng, range(6))
    with pytest.warns(DeprecationWarning, match=r"exchange\(band=...\) is deprecated"):
        h.exchange(prefetch=[0], band=3)
    with pytest.warns(DeprecationWarning):
        h.step(prefetch=[1], band=4)
    assert h.queued() == [(3, 0), (4, 1)]
    with pytest.raises(TypeError, match="priority= or its old name band=, not both"):
        h.exchange(prefetch=[2], priority=1, band=1)
    with pytest.raises(TypeError, match="not both"):
        h.cancel_at_or_below(1, band=1)
    with pytest.raises(TypeError, match="not both"):
        h.cancel_below(priority=1, band=1)
    assert h.queued() == [(3, 0), (4, 1)]
    with pytest.warns(DeprecationWarning, match=r"cancel_at_or_below\(band=...\)"):
        assert h.cancel_below(band=4) == 1
    with pytest.warns(DeprecationWarning):
        assert h.cancel_at_or_below(band=3) == 1
    assert h.queued() == []
    with pytest.raises(ValueError, match="priority"):
        with pytest.warns(DeprecationWarning):
            h.exchange(prefetch=[2], band=20)
    with pytest.raises(TypeError, match="priority must be an integer"):
        h.cancel_at_or_below()
    assert h.cancel_at_or_below(priority=0) == 0


def test_use_reports_reads_to_the_eviction_policy(make_handle, rng):
    # Cyclic: an entry a prefetch brought and nobody used is "fresh" (kept
    # for the next layers); a use makes it "used" (the just-used go first).
    # A use of an id not resident counts once its copy lands.
    h = make_handle(device_budget_bytes=4 * SLOT, eviction_policy="cyclic")
    register_random(h, rng, range(4))
    h.exchange(use=[2])  # not resident: counts when it arrives
    h.prefetch_tensors([0, 1, 2], 1)
    assert wait_until(lambda: len(h.resident()) == 3 and h.stats()["bytes_in_flight"] == 0)
    order = h.resident()
    assert order[0] == 2  # used: next victim; 0 and 1 are fresh
    h.exchange(use=[0])
    assert h.resident()[0] == 0  # the most recently used goes first
    assert set(h.resident()[1:]) == {1, 2}
