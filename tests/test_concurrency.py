"""8 Python threads x 2,000 mixed operations on one handle: batched prefetch
of 1-64 ids, acquire/verify/release, cancel, stats. Every request is counted
once and the counters reconcile at the end. A hang dumps every thread's stack
(faulthandler) and fails at 120 s."""
import faulthandler
import sys
import threading

import numpy as np
import pytest
from conftest import wait_drained
from payload import check, content

import prefetch

THREADS = 8
OPS = 2000
IDS = 256
SIZE = 1024
HANG_S = 120


@pytest.mark.parametrize("mode", ["host", "caller-runs"])
def test_many_threads_one_handle(mode):
    # Budget: 64 slots for 256 ids, so eviction runs all the time; at most
    # 8 threads x 3 pinned ids can never fill it. "caller-runs": the fault
    # backend claims to be asynchronous, so acquirers issue their own
    # on-demand copies (the CUDA path) while the worker copies prefetches.
    backend = "host" if mode == "host" else "fault"
    faults = {"report_async": 1} if mode == "caller-runs" else None
    h = prefetch.PrefetchHandle(device_budget_bytes=64 * SIZE, backend=backend, faults=faults,
                                poison_freed_slots=True)
    for tid in range(IDS):
        h.register(tid, content(tid, 0, SIZE))
    counts = [dict(requests=0, acquires=0, cancels=0, stats=0, errors=0) for _ in range(THREADS)]
    failures = []
    start = threading.Barrier(THREADS)

    def worker(k):
        rng = np.random.default_rng(1000 + k)
        c = counts[k]
        start.wait()
        try:
            for _ in range(OPS):
                op = rng.integers(0, 10)
                if op < 4:
                    ids = rng.integers(0, IDS, size=int(rng.integers(1, 65)))
                    h.prefetch_tensors(ids, priority=int(rng.integers(1, 20)))
                    c["requests"] += len(ids)
                elif op < 8:
                    ids = [int(x) for x in rng.choice(IDS, size=int(rng.integers(1, 4)), replace=False)]
                    views = h.acquire(ids, timeout=60)
                    c["acquires"] += len(ids)
                    for tid, v in zip(ids, views):
                        check(v, tid, 0)
                    h.release(ids)
                elif op < 9:
                    h.cancel(rng.integers(0, IDS, size=8))
                    c["cancels"] += 1
                else:
                    s = h.stats()
                    assert s["resident_bytes"] <= 64 * SIZE
                    c["stats"] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            failures.append((k, repr(exc)))

    faulthandler.dump_traceback_later(HANG_S, exit=True, file=sys.stderr)
    try:
        threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(HANG_S)
        assert not any(t.is_alive() for t in threads), "a thread hung"
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert failures == []
    # At rest the books balance: an entry mid-copy is neither queued nor copied.
    s = wait_drained(h, timeout=60)
    assert s["requests"] == sum(c["requests"] for c in counts)
    assert s["requests"] == s["enqueued"] + s["deduplicated"]
    assert s["acquires"] == sum(c["acquires"] for c in counts)
    assert s["acquires"] == s["hits"] + s["misses"]
    assert s["late"] <= s["misses"]
    assert s["wasted"] <= s["evictions"]
    assert s["copy_errors"] == 0
    assert s["bytes_copied"] == s["copies"] * SIZE
    assert s["pinned_count"] == 0
    if mode == "caller-runs":
        assert s["caller_copies"] > 0  # acquirers really issued copies themselves
    else:
        assert s["caller_copies"] == 0
    # Every copy either is still resident or was evicted.
    assert s["copies"] == s["resident_count"] + s["evictions"]
    # Every id that entered a queue left it exactly once (or is still there).
    assert s["enqueued"] + s["on_demand"] == (s["copies"] + s["copy_errors"] + s["cancelled"] + s["declined"]
                                                 + s["queue_depth"])
    h.close()
