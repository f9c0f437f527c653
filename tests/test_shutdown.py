"""Shutdown paths, each in its own interpreter with a timeout: a hang fails
the test instead of hanging the suite."""
import subprocess
import sys
import textwrap
import time

PRELUDE = """
import os, sys, threading, time
import numpy as np
import prefetch
"""


def run(code: str, timeout: float):
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, time.monotonic() - t0


def test_close_with_10000_queued_is_fast_and_wakes_acquirers():
    proc, _ = run(
        """
        # Two slots, both pinned: the worker is stuck for room, 10,000 prefetches
        # wait behind it and four acquirers wait for ids that cannot arrive.
        h = prefetch.PrefetchHandle(device_budget_bytes=512, backend="fault",
                                    faults={"copy_delay_us": 1000})
        for tid in range(10_006):
            h.register(tid, b"abcd")
        h.acquire([0, 1], timeout=10)
        h.prefetch_tensors(np.arange(2, 10_002))
        errors = []
        def acquirer(tid):
            try:
                h.acquire([tid], timeout=60)
            except RuntimeError as exc:
                errors.append(str(exc))
        threads = [threading.Thread(target=acquirer, args=(10_002 + k,)) for k in range(4)]
        for t in threads: t.start()
        time.sleep(0.3)
        assert h.stats()["queue_depth"] == 10_004
        t0 = time.monotonic()
        h.close()
        elapsed = time.monotonic() - t0
        for t in threads: t.join(10)
        assert not any(t.is_alive() for t in threads)
        assert len(errors) == 4 and all("closed" in e for e in errors), errors
        print(f"close took {elapsed:.3f} s")
        assert elapsed < 2.0, elapsed
        """,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "close took" in proc.stdout


def test_dropping_a_handle_mid_copy_exits_cleanly():
    proc, elapsed = run(
        """
        h = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="fault",
                                    faults={"copy_delay_us": 300_000})
        for tid in range(50):
            h.register(tid, b"x" * 1000)
        h.prefetch_tensors(range(50))
        time.sleep(0.1)  # a copy is under way
        del h
        print("dropped")
        """,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert "dropped" in proc.stdout
    assert elapsed < 10


def test_interpreter_exit_mid_copy_exits_zero():
    proc, elapsed = run(
        """
        h = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="fault",
                                    faults={"copy_delay_us": 300_000})
        for tid in range(50):
            h.register(tid, b"x" * 1000)
        h.prefetch_tensors(range(50))
        blocked = threading.Thread(target=lambda: h.acquire([49], timeout=600), daemon=True)
        blocked.start()
        time.sleep(0.1)
        sys.exit(0)  # handle still open, a copy under way, an acquirer blocked
        """,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 10


def test_use_in_a_forked_child_raises_instead_of_hanging():
    proc, _ = run(
        """
        h = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="fault",
                                    faults={"copy_delay_us": 200_000})
        for tid in range(8):
            h.register(tid, b"x" * 100)
        h.prefetch_tensors(range(8))  # a worker holds copies (and the lock) on and off
        pid = os.fork()
        if pid == 0:
            raised = 0
            for call in (lambda: h.prefetch_tensors([0]), lambda: h.acquire([1], timeout=5),
                         lambda: h.stats(), lambda: h.release([0])):
                try:
                    call()
                except RuntimeError as exc:
                    raised += "forked child" in str(exc)
            h.close()  # must not hang either
            os._exit(0 if raised == 4 else 3)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print("child exit", code)
        h.close()
        sys.exit(code)
        """,
        timeout=60,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "child exit 0" in proc.stdout


def test_a_forked_child_that_lets_its_handles_go_exits():
    # Note [A handle in a forked child]: destroying an inherited engine (or
    # DiskReader) in the child waited on condition variables whose waiters,
    # the parent's worker threads, do not exist there: `del`, the end of a
    # scope and a normal exit hung the child for good. hint_clock() in the
    # child also read the engine without the fork check.
    proc, _ = run(
        """
        h = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host")
        h.register(0, b"x" * 100)
        h.acquire([0], timeout=5)
        h.release([0])
        r = prefetch.DiskReader(threads=2)
        kept = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host")
        # Fork only once every other thread sleeps (3 reads 10 ms apart). GCC
        # 12's AddressSanitizer does not lock its allocator across fork: a
        # worker still starting up, preempted inside malloc, left the child
        # waiting on that lock at exit for good (about 1 run in 10 with the
        # CPUs busy). glibc's malloc is fork-safe; this is about the test.
        me, calm, deadline = str(threading.get_native_id()), 0, time.monotonic() + 10
        while calm < 3 and time.monotonic() < deadline:
            states = [open(f"/proc/self/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
                      for t in os.listdir("/proc/self/task") if t != me]
            calm = calm + 1 if all(s in "SD" for s in states) else 0
            time.sleep(0.01)
        pid = os.fork()
        if pid == 0:
            try:
                h.hint_clock()
                sys.exit(4)
            except RuntimeError as exc:
                if "forked child" not in str(exc):
                    sys.exit(5)
            h.close()
            del h, r  # each freed here; `kept` at the interpreter's exit
            sys.exit(0)  # a normal exit, not os._exit
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        print("child exit", code)
        h.acquire([0], timeout=5)  # the parent's engine is untouched
        h.release([0])
        h.close()
        kept.close()
        r.close()
        sys.exit(code)
        """,
        timeout=60,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "child exit 0" in proc.stdout


def test_the_ids_an_acquire_waits_for_are_its_own_copy():
    # Note [Ids copied for a wait]: the engine looked the caller's array up
    # again each time the wait woke, without the GIL; rewritten meanwhile
    # (a reused routing buffer) to an unknown id, it crashed the process.
    proc, _ = run(
        """
        h = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host", start_paused=True)
        h.register(0, np.full(1000, 7, np.uint8))
        ids = np.array([0], dtype=np.int64)
        got = {}
        def acquire():
            got["views"] = h.acquire(ids, timeout=30)
        t = threading.Thread(target=acquire)
        t.start()
        while not h.queued():  # the acquire's copy is queued: it waits
            time.sleep(0.01)
        ids[0] = 12345  # not registered
        h.resume()
        t.join()
        print("bytes", int(got["views"][0].sum()))
        h.release([0])
        h.close()
        """,
        timeout=60,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "bytes 7000" in proc.stdout


def test_a_timeout_of_years_waits_instead_of_timing_out_at_once():
    # The engine's nanosecond deadline overflowed past 9.2e9 s: a wait meant
    # as forever (1e10 s, sys.float_info.max) timed out at once.
    proc, _ = run(
        """
        h = prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host", start_paused=True)
        h.register(0, b"x" * 100)
        outcome = {}
        def acquire(timeout):
            try:
                h.acquire([0], timeout=timeout)
                outcome[timeout] = "returned"
            except Exception as exc:
                outcome[timeout] = type(exc).__name__
        threads = [threading.Thread(target=acquire, args=(t,)) for t in (1e10, sys.float_info.max)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        print("waiting", sum(t.is_alive() for t in threads))
        h.close()  # wakes them with HandleClosedError
        for t in threads:
            t.join()
        print(sorted(outcome.values()))
        """,
        timeout=60,
    )
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "waiting 2" in proc.stdout and "['HandleClosedError', 'HandleClosedError']" in proc.stdout
