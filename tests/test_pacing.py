"""Note [Speculation in chunks] and Note [Polite waits] on the fault
backend's simulated link (async_copy_us): each copy's token completes a
fixed time after the link's previous copy, so bytes in flight and how long a
miss queued are measured by the backend itself, in simulated link time, not
by the test's clock."""
import numpy as np
import pytest
from conftest import wait_until
from payload import check, content

import prefetch

CHUNK = 4096
BIG = 12 * CHUNK  # a speculative entry of twelve chunks


def linked_handle(delay_us, **kwargs):
    kwargs.setdefault("device_budget_bytes", 256 * 1024)
    return prefetch.PrefetchHandle(backend="fault", copy_chunk_bytes=CHUNK,
                                   faults={"report_async": 1, "async_copy_us": delay_us}, **kwargs)


def wait_issued(h, entries):
    """Until the queue is empty and `entries` copies have been issued whole
    (stats' bytes_in_flight stays stale until a worker looks again)."""
    def issued():
        s = h.stats()
        return s["queue_depth"] == 0 and s["copies"] >= entries

    assert wait_until(issued)


@pytest.mark.parametrize("poll_us", [0, 20])
def test_a_speculative_copy_larger_than_the_cap_goes_a_chunk_at_a_time(poll_us):
    # A cap of two chunks (the default's start; fixed here, so that a slow
    # wake-up on a loaded machine cannot deepen it). Counted per entry it let
    # all twelve chunks of one prefetch onto the link at once.
    with linked_handle(2000, copy_poll_us=poll_us, max_speculative_bytes_in_flight=2 * CHUNK) as h:
        h.register(0, content(0, 0, BIG))
        h.prefetch_tensors([0], priority=1)
        wait_issued(h, 1)
        counts = h.fault_counts()
        assert counts["copies"] == 12
        assert 0 < counts["max_lane_bytes_in_flight"] <= 2 * CHUNK
        (view,) = h.acquire([0], timeout=10)
        check(view, 0, 0)
        h.release([0])


def test_the_cap_option_sets_the_bound():
    with linked_handle(1000, max_speculative_bytes_in_flight=5 * CHUNK) as h:
        h.register(0, content(0, 0, BIG))
        h.prefetch_tensors([0], priority=1)
        wait_issued(h, 1)
        assert 3 * CHUNK < h.fault_counts()["max_lane_bytes_in_flight"] <= 5 * CHUNK


@pytest.mark.parametrize("poll_us", [0, 20])
def test_the_link_does_not_idle_between_speculative_entries(poll_us):
    # Note [Speculation counts what is on the link]: counted whole, an entry
    # held the next one back until its last chunk had landed, and the link
    # idled for the worker's wake-up at every entry boundary. Counted by
    # chunk, the next entry's first chunk is queued behind the last one's
    # while that is still on the link (20 ms a chunk: the worker has all of
    # it to issue the next). Only the link's first copy has no predecessor.
    with linked_handle(20_000, copy_poll_us=poll_us) as h:
        entries = 4
        for t in range(entries):
            h.register(t, content(t, 0, 3 * CHUNK))
        h.prefetch_tensors(list(range(entries)), priority=1)
        wait_issued(h, entries)
        counts = h.fault_counts()
        assert counts["copies"] == 3 * entries
        assert counts["link_idle_before_lane_us"] == 0
        assert 0 < counts["max_lane_bytes_in_flight"] <= 2 * CHUNK
        # Note [A cap that follows the worker's wake-ups]: a worker that
        # keeps the link busy finds a chunk still on it after every wait,
        # and the default cap stays at two chunks.
        s = h.stats()
        assert s["spec_underruns"] == 0 and s["speculative_cap_bytes"] == 2 * CHUNK
        views = h.acquire(list(range(entries)), timeout=10)
        for t, view in enumerate(views):
            check(view, t, 0)
        h.release(list(range(entries)))


def test_a_miss_queues_behind_at_most_the_cap():
    # A miss issued while a long prefetch is on the link waits for at most the
    # two chunks of it in flight, then its own copy: 3 copy times on the
    # simulated link (it was 13 when the prefetch went whole).
    delay = 5000
    with linked_handle(delay, max_speculative_bytes_in_flight=2 * CHUNK) as h:
        h.register(0, content(0, 0, BIG))
        h.register(1, content(1, 0, CHUNK))
        h.prefetch_tensors([0], priority=1)
        assert wait_until(lambda: h.fault_counts()["copies"] >= 2)
        (view,) = h.acquire([1], timeout=10)
        check(view, 1, 0)
        h.release([1])
        wait_issued(h, 2)
        counts = h.fault_counts()
        assert counts["copies"] == 13
        assert delay <= counts["max_urgent_latency_us"] <= 3 * delay
        assert counts["max_lane_bytes_in_flight"] <= 2 * CHUNK
        (view,) = h.acquire([0], timeout=10)
        check(view, 0, 0)


def _late_worker_run(**kwargs):
    """Four prefetches of twelve chunks on a link that moves a chunk in
    0.2 ms, their copy worker polling every 3 ms: after each wait for the
    cap it finds the link drained. One lane, so that the link's bytes in
    flight are the cap's. Returns (stats, fault counts)."""
    entries = 4
    with linked_handle(200, copy_poll_us=3000, copy_lanes=1, device_budget_bytes=512 * 1024, **kwargs) as h:
        for t in range(entries):
            h.register(t, content(t, 0, BIG))
        h.prefetch_tensors(list(range(entries)), priority=1)
        wait_issued(h, entries)
        views = h.acquire(list(range(entries)), timeout=10)
        for t, view in enumerate(views):
            check(view, t, 0)
        h.release(list(range(entries)))
        return h.stats(), h.fault_counts()


def test_a_worker_that_wakes_late_deepens_the_default_cap():
    # Note [A cap that follows the worker's wake-ups]: each underrun adds a
    # chunk to the default cap, up to four; a cap given as an option stays
    # as given and its underruns are still counted. The deeper cap keeps the
    # link busy for more of each of the worker's sleeps.
    grown, grown_link = _late_worker_run()
    fixed, fixed_link = _late_worker_run(max_speculative_bytes_in_flight=2 * CHUNK)
    assert grown["spec_underruns"] >= 2 and grown["speculative_cap_bytes"] == 4 * CHUNK
    assert 2 * CHUNK < grown_link["max_lane_bytes_in_flight"] <= 4 * CHUNK
    assert fixed["spec_underruns"] >= 2 and fixed["speculative_cap_bytes"] == 2 * CHUNK
    assert fixed_link["max_lane_bytes_in_flight"] <= 2 * CHUNK
    # 48 chunks each: about 1.3 ms of idle link a chunk under the fixed cap
    # (two chunks of 0.2 ms a 3 ms sleep), about 0.55 ms under the grown one.
    assert grown_link["link_idle_before_lane_us"] < 0.75 * fixed_link["link_idle_before_lane_us"]


def test_a_miss_queues_behind_at_most_the_deepened_cap():
    # Deepened to four chunks by late wake-ups, the cap still bounds what a
    # miss waits behind: at most four chunks of speculation, then its own
    # copy (5 copy times on the simulated link; a prefetch issued whole would
    # put up to 12 ahead of it).
    delay = 500
    with linked_handle(delay, copy_poll_us=3000, copy_lanes=1, device_budget_bytes=512 * 1024) as h:
        for t in range(4):
            h.register(t, content(t, 0, BIG))
        h.register(9, content(9, 0, CHUNK))
        h.prefetch_tensors([0, 1, 2, 3], priority=1)
        assert wait_until(lambda: h.stats()["speculative_cap_bytes"] == 4 * CHUNK)
        (view,) = h.acquire([9], timeout=10)
        check(view, 9, 0)
        h.release([9])
        counts = h.fault_counts()
        assert counts["max_lane_bytes_in_flight"] <= 4 * CHUNK
        assert delay <= counts["max_urgent_latency_us"] <= 5 * delay
        views = h.acquire([0, 1, 2, 3], timeout=10)
        for t, view in enumerate(views):
            check(view, t, 0)
        h.release([0, 1, 2, 3])


def test_the_deepened_cap_steps_back_down_once_the_worker_keeps_up():
    # Deepened to four chunks by late wake-ups, then a link slow enough
    # (25 ms a chunk) that the worker, polling every 2 ms, always finds a
    # chunk still on it: every 64 chunks without an underrun take one chunk
    # off the cap, back to two. An underrun needs a wake-up 50 ms late (at
    # three chunks; at 10 ms a chunk, 20 ms late was enough, and CI once saw
    # the cap stay up for 30 s), and 22 entries of 12 chunks leave room for
    # one.
    entries = 24
    with linked_handle(200, copy_poll_us=2000, copy_lanes=1, device_budget_bytes=2 * 1024 * 1024) as h:
        for t in range(entries):
            h.register(t, content(t, 0, BIG))
        h.prefetch_tensors([0, 1], priority=1)
        assert wait_until(lambda: h.stats()["speculative_cap_bytes"] == 4 * CHUNK)
        h.set_faults(async_copy_us=25_000)
        h.prefetch_tensors(list(range(2, entries)), priority=1)
        assert wait_until(lambda: h.stats()["speculative_cap_bytes"] == 2 * CHUNK, timeout=30)
        h.cancel_all()
        h.set_faults(async_copy_us=200)
        views = h.acquire(list(range(entries)), timeout=60)
        for t, view in enumerate(views):
            check(view, t, 0)
        h.release(list(range(entries)))


def test_an_acquire_of_a_copy_under_way_takes_the_rest_at_once():
    # Pinned by an acquire mid-copy, the prefetch stops pacing: what is left
    # goes in one copy instead of the remaining chunks one by one.
    with linked_handle(100_000) as h:
        h.register(0, content(0, 0, BIG))
        h.prefetch_tensors([0], priority=1)
        assert wait_until(lambda: h.fault_counts()["copies"] >= 1)
        (view,) = h.acquire([0], timeout=30)
        check(view, 0, 0)
        s = h.stats()
        assert s["late"] == 1 and s["copies"] == 1
        # Up to two chunks at once, then one chunk each 0.1 s until the
        # acquire (within about one of them on an idle machine), then the
        # rest: paced to the end it would be twelve. Two is the acquire
        # landing between the first two chunks' issues (a slow worker: seen
        # once under ThreadSanitizer in CI), then the other eleven at once.
        assert 2 <= h.fault_counts()["copies"] <= 6
        h.release([0])


def test_every_simulated_token_is_returned_at_close():
    # The chunk tokens of a paced copy each hold a reference; all of them,
    # and the entries' own, go back by close.
    h = linked_handle(200)
    h.register(0, content(0, 0, BIG))
    h.register(1, content(1, 0, CHUNK))
    h.prefetch_tensors([0], priority=1)
    h.acquire([1], timeout=10)
    h.release([1])
    wait_issued(h, 2)
    assert h.fault_counts()["live_tokens"] > 0  # the entries' ready tokens
    h.close()
    assert h.fault_counts()["live_tokens"] == 0


def test_polite_and_blocking_waits_copy_the_same_bytes():
    rng = np.random.default_rng(3)
    payloads = {tid: rng.integers(0, 255, size=BIG + 17 * tid, dtype=np.uint8) for tid in range(6)}
    for poll_us in (0, 1, 50):
        with linked_handle(300, copy_poll_us=poll_us, max_bytes_in_flight=3 * CHUNK,
                           device_budget_bytes=512 * 1024) as h:
            for tid, data in payloads.items():
                h.register(tid, data)
            h.prefetch_tensors(list(payloads), priority=2)
            views = h.acquire(list(payloads), timeout=30)
            for tid, view in zip(payloads, views):
                assert np.array_equal(np.asarray(view), payloads[tid]), (poll_us, tid)
            h.release(list(payloads))
