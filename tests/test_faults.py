"""Fault injection through the `fault` backend (the host backend with
injectable faults): failed copies, non-std exceptions on a worker, slow and
failed allocations, poisoned freed slots."""
import numpy as np
import pytest
from conftest import wait_drained
from payload import check, content

import prefetch

SIZE = 512


def fault_handle(**kwargs):
    kwargs.setdefault("device_budget_bytes", 64 * 1024)
    return prefetch.PrefetchHandle(backend="fault", **kwargs)


def register(h, ids, version=0):
    for tid in ids:
        h.register(tid, content(tid, version, SIZE))


def test_failed_copy_raises_only_for_that_id_and_engine_keeps_serving():
    with fault_handle() as h:
        register(h, range(6))
        h.set_faults(fail_every_nth_copy=3)  # the 3rd copy fails
        h.prefetch_tensors([0, 1, 2, 3, 4, 5])
        views = h.acquire([0, 1], timeout=10)
        for tid, v in zip([0, 1], views):
            check(v, tid, 0)
        with pytest.raises(RuntimeError, match=r"tensor id 2: copy failed: injected copy failure \(call 3\)"):
            h.acquire([2], timeout=10)
        for tid in (3, 4):
            (v,) = h.acquire([tid], timeout=10)
            check(v, tid, 0)
        # Id 5's prefetch is the 6th copy, failed only if it ran before the
        # faults are off: let the worker finish it first (CI on 464ef5a
        # caught it still queued, and it then copied fine).
        wait_drained(h)
        h.set_faults(fail_every_nth_copy=0)
        (v,) = h.acquire([2], timeout=10)  # retried on demand, now fine
        check(v, 2, 0)
        with pytest.raises(RuntimeError, match=r"tensor id 5: copy failed: injected copy failure \(call 6\)"):
            h.acquire([5], timeout=10)  # the 6th copy failed too: its error was kept for its acquirer
        s = h.stats()
        assert s["copy_errors"] == 2 == h.fault_counts()["copy_failures"]
        assert s["pinned_count"] == 5  # 0, 1, 3, 4 and 2; the failed acquires pinned nothing


def test_failed_copy_inside_a_multi_id_acquire_unpins_everything():
    with fault_handle() as h:
        register(h, range(3))
        h.set_faults(fail_every_nth_copy=2)
        with pytest.raises(RuntimeError, match="injected copy failure"):
            h.acquire([0, 1, 2], timeout=10)
        assert h.stats()["pinned_count"] == 0


def test_non_std_exception_on_a_worker_does_not_terminate_the_process():
    with fault_handle() as h:
        register(h, range(4))
        h.set_faults(throw_every_nth_copy=1)
        for tid in range(4):
            with pytest.raises(RuntimeError, match="unknown error in the copy backend"):
                h.acquire([tid], timeout=10)
        h.set_faults(throw_every_nth_copy=0)
        views = h.acquire([0, 1, 2, 3], timeout=10)
        for tid, v in zip(range(4), views):
            check(v, tid, 0)
        assert h.stats()["copy_errors"] == 4


def test_failed_allocation_is_memoryerror_and_handle_stays_usable():
    with fault_handle() as h:
        register(h, [0])
        h.set_faults(fail_every_nth_alloc=2)  # the next allocation fails
        with pytest.raises(MemoryError, match="injected host allocation failure"):
            h.register(1, content(1, 0, SIZE))
        assert 1 not in h and h.stats()["registered"] == 1
        h.set_faults(fail_every_nth_alloc=0)
        register(h, [1])
        views = h.acquire([0, 1], timeout=10)
        check(views[0], 0, 0)
        check(views[1], 1, 0)


def test_slow_allocation_and_slow_copies_still_deliver():
    with fault_handle(faults={"alloc_delay_us": 2000, "copy_delay_us": 3000}) as h:
        register(h, range(5))
        h.prefetch_tensors(range(5))
        views = h.acquire(list(range(5)), timeout=30)
        for tid, v in zip(range(5), views):
            check(v, tid, 0)


def test_acquire_times_out_on_a_stuck_copy_and_recovers():
    with fault_handle(faults={"copy_delay_us": 500_000}) as h:
        register(h, [0])
        with pytest.raises(TimeoutError):
            h.acquire([0], timeout=0.05)
        assert h.stats()["pinned_count"] == 0
        (v,) = h.acquire([0], timeout=10)  # the slow copy lands
        check(v, 0, 0)


def test_poisoned_freed_slots_expose_stale_reads():
    with fault_handle(device_budget_bytes=2 * SIZE, poison_freed_slots=True) as h:
        register(h, range(3))
        (stale,) = h.acquire([0], timeout=10)
        check(stale, 0, 0)
        h.release([0])
        h.acquire([1, 2], timeout=10)  # evicts 0: its slot is poisoned, then reused
        assert h.stats()["evictions"] == 1
        with pytest.raises(AssertionError):
            check(stale, 0, 0)  # a view kept past release sees other bytes


def test_poison_fills_the_freed_slot():
    with fault_handle(device_budget_bytes=4 * SIZE, poison_freed_slots=True) as h:
        register(h, [0])
        (v,) = h.acquire([0], timeout=10)
        h.release([0])
        assert h.evict([0]) == 1
        assert (np.asarray(v) == 0xDB).all()


def test_version_change_is_seen_after_reregistration():
    with fault_handle() as h:
        register(h, [0], version=0)
        (v,) = h.acquire([0], timeout=10)
        check(v, 0, 0)
        h.release([0])
        h.unregister(0)
        register(h, [0], version=1)
        (v,) = h.acquire([0], timeout=10)
        check(v, 0, 1)
        with pytest.raises(AssertionError):
            check(v, 0, 0)


def test_fault_settings_are_validated():
    with fault_handle() as h:
        with pytest.raises(ValueError, match="unknown fault"):
            h.set_faults(explode=1)
        with pytest.raises(ValueError, match=">= 0"):
            h.set_faults(copy_delay_us=-1)
    with pytest.raises(ValueError, match="fault"):
        prefetch.PrefetchHandle(device_budget_bytes=4096, backend="host", faults={"copy_delay_us": 1})
    with prefetch.PrefetchHandle(device_budget_bytes=4096, backend="host") as h:
        with pytest.raises(RuntimeError, match="fault"):
            h.set_faults(copy_delay_us=1)


def test_caller_runs_on_demand_copies_on_async_backends():
    # With an async backend the acquirer issues on-demand copies itself: even
    # with the worker stuck behind a slow prefetch, an acquire of another id
    # completes at once.
    with fault_handle(faults={"report_async": 1}) as h:
        register(h, range(3))
        h.set_faults(copy_delay_us=0)
        views = h.acquire([0, 1], timeout=10)
        check(views[0], 0, 0)
        check(views[1], 1, 0)
        s = h.stats()
        assert s["misses"] == 2 and s["on_demand"] == 2 and s["copies"] == 2 == s["caller_copies"]
        h.release([0, 1])
        h.pause()
        with pytest.raises(TimeoutError, match="paused"):
            h.acquire([2], timeout=0.05)  # paused means no copies, also by callers


def test_stream_zero_is_a_real_stream():
    # 0 is CUDA's legacy default stream (torch's default stream): a release on
    # it must record a last-use token, exactly like any other stream; no
    # stream at all records nothing. (Regression: 0 once meant "no stream",
    # which made default-stream users wait on the CPU and skip the token.)
    # One token per stream per call covers every id (Note [One token per
    # release]).
    with fault_handle(faults={"report_async": 1}) as h:
        register(h, range(2))
        h.acquire([0, 1], stream=0, timeout=10)
        h.release([0, 1], stream=0)
        assert h.fault_counts()["stream_records"] == 1
        h.acquire([0], timeout=10)
        h.release([0])
        assert h.fault_counts()["stream_records"] == 1
        h.acquire([1], stream={0: 0}, timeout=10)
        h.release([1], stream={0: 0})
        assert h.fault_counts()["stream_records"] == 2


def test_failed_stream_record_leaves_the_release_undone():
    # Note [One token per release]: a release records its stream tokens
    # before it unpins anything, so a record that fails (here the second
    # one: device 1's, after device 0's) raises and changes nothing: every id
    # stays pinned, and the same release then succeeds.
    with fault_handle(device_budget_bytes=[64 * 1024, 64 * 1024], faults={"report_async": 1}) as h:
        for tid, device in ((0, 0), (1, 0), (2, 1), (3, 1)):
            h.register(tid, content(tid, 0, SIZE), device=device)
        streams = {0: 11, 1: 12}
        h.acquire([0, 1, 2, 3], stream=streams, timeout=10)
        h.set_faults(fail_every_nth_record=2)
        with pytest.raises(prefetch.CopyFailedError, match="injected stream record failure"):
            h.release([0, 1, 2, 3], stream=streams)
        assert h.fault_counts()["stream_records"] == 2
        assert h.stats()["pinned_count"] == 4
        assert h.evict([0, 1, 2, 3]) == 0  # still pinned: none can go
        h.set_faults(fail_every_nth_record=0)
        h.release([0, 1, 2, 3], stream=streams)
        assert h.stats()["pinned_count"] == 0
        assert h.evict([0, 1, 2, 3]) == 4
