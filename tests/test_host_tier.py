"""The engine's host tier (Note [Host tier] in src_cpp/archer_prefetch_handle.h):
tensors registered as extents of files, read into page-locked host slots
and copied on to the device cache, on the CPU (host and fault backends, real
files, real reads). Byte-exact against the files; every fault a clear error
on the acquire that needed it, the engine serving everything else; the
host tier's memory within its budget; no descriptor left open."""
from __future__ import annotations

import errno
import os
import threading

import numpy as np
import pytest
from conftest import wait_until

import prefetch
from prefetch.errors import CopyFailedError, DiskReadError, InvalidArgumentError

MIB = 1 << 20


@pytest.fixture
def data_file(tmp_path):
    data = np.random.default_rng(3).integers(0, 256, 3 * MIB, dtype=np.uint8)
    path = tmp_path / "shard.bin"
    data.tofile(path)
    return path, data


def expected(data, extents, total):
    want = np.zeros(total, dtype=np.uint8)
    for _, off, n, dst in extents:
        want[dst:dst + n] = data[off:off + n]
    return want


def read_slot(handle, tid, nbytes):
    where = handle.acquire_slots([tid], timeout=10)
    off = int(where[0, 0])
    got = np.asarray(handle.arena(0))[off:off + nbytes].copy()
    handle.release([tid])
    return got


def open_fds():
    return set(os.listdir("/proc/self/fd"))


# Three tensors: one of two extents at unaligned offsets with a gap (zeros)
# and a zero tail, two of one extent each.
TENSORS = {
    0: ([(0, 12345, 100_000, 0), (0, 2_000_001, 50_000, 100_352)], 160_000),
    1: ([(0, 777, 900_000, 0)], 900_000),
    2: ([(0, 1_500_000, 900_000, 0)], 900_000),
}


def register_all(handle, path):
    f = handle.open_file(path)
    assert f == 0
    for tid, (extents, total) in TENSORS.items():
        handle.register_disk(tid, extents, total_bytes=total)


def test_disk_tensors_arrive_byte_exact_through_a_small_host_tier(data_file):
    path, data = data_file
    # The device cache holds one large tensor, the host tier two of the three
    # staged (1.96 MB in all): every device miss after the first three
    # recopies, some from the host tier, some from disk again.
    handle = prefetch.PrefetchHandle(device_budget_bytes=MIB, backend="host", host_budget_bytes=3 * MIB // 2)
    try:
        register_all(handle, path)
        for tid in (0, 1, 0, 1, 2, 0, 2, 1, 0):
            extents, total = TENSORS[tid]
            assert np.array_equal(read_slot(handle, tid, total), expected(data, extents, total)), tid
            s = handle.stats()
            assert 0 < s["host_tier_used_bytes"] <= s["host_tier_budget_bytes"] == 3 * MIB // 2
        s = handle.stats()
        # no two tensors fit the device cache together: every acquire copied
        assert s["copies"] == s["misses"] == 9 and s["copy_errors"] == 0 and s["disk_errors"] == 0
        assert s["host_tier_hits"] > 0 and s["host_tier_evictions"] > 0
        # each copy read its extents (tensor 0 has two) or was a host-tier hit
        assert s["disk_reads"] + s["host_tier_hits"] >= 9
    finally:
        handle.close()


def test_disk_tensors_under_concurrent_acquirers(data_file):
    path, data = data_file
    handle = prefetch.PrefetchHandle(device_budget_bytes=2 * MIB, backend="host", host_budget_bytes=2 * MIB)
    errors = []
    try:
        register_all(handle, path)

        def worker(order):
            try:
                for tid in order:
                    extents, total = TENSORS[tid]
                    if not np.array_equal(read_slot(handle, tid, total), expected(data, extents, total)):
                        errors.append(f"tensor {tid} differs")
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(repr(exc))

        threads = [threading.Thread(target=worker, args=([0, 1, 2, 1, 0, 2] * 3,)),
                   threading.Thread(target=worker, args=([2, 0, 1, 0, 2, 1] * 3,))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert handle.stats()["host_tier_used_bytes"] <= 2 * MIB
    finally:
        handle.close()


@pytest.mark.parametrize("setting,words", [("eio_every_nth_read", "Input/output error (injected)"),
                                           ("short_every_nth_read", "short read")])
def test_injected_read_faults_fail_only_their_acquire(data_file, setting, words):
    path, data = data_file
    handle = prefetch.PrefetchHandle(device_budget_bytes=2 * MIB, backend="fault", host_budget_bytes=2 * MIB,
                                     faults={setting: 1})
    try:
        register_all(handle, path)
        handle.register(9, b"memory-backed")
        with pytest.raises(CopyFailedError) as info:
            handle.acquire_slots([1], timeout=10)
        message = str(info.value)
        assert "tensor id 1" in message and str(path) in message and words in message
        assert handle.stats()["pinned_count"] == 0  # nothing stays pinned
        # the engine serves everything else, and the same tensor once the disk heals
        assert read_slot(handle, 9, 13).tobytes() == b"memory-backed"
        handle.set_faults(**{setting: 0})
        extents, total = TENSORS[1]
        assert np.array_equal(read_slot(handle, 1, total), expected(data, extents, total))
        s = handle.stats()
        assert s["disk_errors"] == 1 and s["copy_errors"] == 1
    finally:
        handle.close()


def test_a_file_changed_under_the_engine_is_an_error(data_file):
    path, data = data_file
    handle = prefetch.PrefetchHandle(device_budget_bytes=2 * MIB, backend="host", host_budget_bytes=2 * MIB)
    try:
        register_all(handle, path)
        os.truncate(path, 2 * MIB)  # tensor 2 now runs past the end
        with pytest.raises(CopyFailedError, match="tensor id 2.*(short read|changed|size)"):
            handle.acquire_slots([2], timeout=10)
        # an extent the truncation left whole is still read, and checked: the
        # file is not the one opened (its size changed), so that fails too
        with pytest.raises(CopyFailedError, match="tensor id 1"):
            handle.acquire_slots([1], timeout=10)
        handle.register(9, b"still serving")
        assert read_slot(handle, 9, 13).tobytes() == b"still serving"
    finally:
        handle.close()


def test_missing_files_and_bad_registrations_are_refused(tmp_path, data_file):
    path, _ = data_file
    with prefetch.PrefetchHandle(device_budget_bytes=MIB, backend="host", host_budget_bytes=MIB) as handle:
        with pytest.raises(DiskReadError) as info:
            handle.open_file(tmp_path / "no-such-shard.bin")
        assert info.value.errno == errno.ENOENT
        f = handle.open_file(path)
        before = handle.stats()["registered"]
        with pytest.raises(InvalidArgumentError, match="past the end"):
            handle.register_disk(0, [(f, 3 * MIB - 10, 100, 0)])
        with pytest.raises(InvalidArgumentError, match="not one OpenFile returned"):
            handle.register_disk(0, [(f + 1, 0, 100, 0)])
        with pytest.raises(InvalidArgumentError, match="runs past the tensor"):
            handle.register_disk(0, [(f, 0, 100, 50)], total_bytes=120)
        with pytest.raises(InvalidArgumentError, match="of the host tier"):
            handle.register_disk(0, [(f, 1, MIB, 0)])  # unaligned: its span is a page more than the budget
        with pytest.raises(InvalidArgumentError, match="no extents"):
            handle.register_disk(0, [], total_bytes=100)
        with pytest.raises(InvalidArgumentError, match="empty tensor"):
            handle.register_disk(0, [])
        with pytest.raises(InvalidArgumentError, match=r"\(file, file_offset, nbytes, tensor_offset\)"):
            handle.register_disk(0, [(f, 0, 100)])
        assert handle.stats()["registered"] == before  # nothing changed
        handle.register_disk(0, [(f, 0, 100, 0)])  # the id is still free
    with prefetch.PrefetchHandle(device_budget_bytes=MIB, backend="host") as handle:
        f = handle.open_file(path)
        with pytest.raises(InvalidArgumentError, match="needs a host tier"):
            handle.register_disk(0, [(f, 0, 100, 0)])


def test_sizes_near_2_64_are_refused_not_wrapped(data_file):
    # AlignSlot of a size within 255 bytes of 2**64 wrapped to 0: such a
    # tensor passed the budget check with a 0-byte slot, and its first copy
    # zero-filled 2**64 bytes (a segfault).
    path, _ = data_file
    with prefetch.PrefetchHandle(device_budget_bytes=MIB, backend="host", host_budget_bytes=MIB) as handle:
        f = handle.open_file(path)
        for total in (2**64 - 1, 2**64 - 200, 2**64 - 256):
            with pytest.raises(InvalidArgumentError, match=f"needs {total} bytes of cache"):
                handle.register_disk(1, [(f, 0, 100, 0)], total_bytes=total)
            with pytest.raises(InvalidArgumentError, match=f"needs {total} bytes of cache"):
                handle.register_parts(2, [(np.ones(10, np.uint8), 0)], total_bytes=total)
        # Fields past 2**64 or of the wrong kind: the error names the field (an OverflowError and
        # a bool taken as 1 before).
        with pytest.raises(InvalidArgumentError, match="nbytes must be in 0..18446744073709551615"):
            handle.register_disk(1, [(f, 0, 2**64, 0)])
        with pytest.raises(InvalidArgumentError, match="file_offset must be in"):
            handle.register_disk(1, [(f, -1, 100, 0)])
        with pytest.raises(TypeError, match="tensor_offset must be an int, got a bool"):
            handle.register_disk(1, [(f, 0, 100, True)])
        with pytest.raises(InvalidArgumentError, match="the extents end past 2\\*\\*64"):
            handle.register_disk(1, [(f, 0, 100, 2**64 - 5)])
        with pytest.raises(InvalidArgumentError, match="total_bytes must be in"):
            handle.register_disk(1, [(f, 0, 100, 0)], total_bytes=2**64)
        assert handle.stats()["registered"] == 0


def test_open_file_refuses_a_path_with_a_nul_and_a_fifo(tmp_path, data_file):
    # open(2) stops at a NUL: "a\0b" opened "a" and served its bytes. A
    # FIFO's open waited for a writer, with the GIL released (run in a
    # child, so a hang fails the test instead of stopping the suite).
    import subprocess
    import sys

    path, _ = data_file
    with prefetch.PrefetchHandle(device_budget_bytes=MIB, backend="host", host_budget_bytes=MIB) as handle:
        with pytest.raises(InvalidArgumentError, match="without NUL bytes"):
            handle.open_file(str(path) + "\0.other")
        with pytest.raises(InvalidArgumentError, match="without NUL bytes"):
            handle.open_file("")
    fifo = tmp_path / "f.bin"
    os.mkfifo(fifo)
    code = f"""
import prefetch
from prefetch.errors import InvalidArgumentError
for make in (lambda: prefetch.PrefetchHandle(device_budget_bytes=1 << 20, backend="host", host_budget_bytes=1 << 20),
             lambda: prefetch.DiskReader()):
    with make() as h:
        try:
            (h.open_file if hasattr(h, "open_file") else h.open)({str(fifo)!r})
        except InvalidArgumentError as e:
            print("refused:", e)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("not a regular file") == 2, done.stdout


def test_file_info_tells_the_file_as_opened(data_file):
    path, data = data_file
    with prefetch.PrefetchHandle(device_budget_bytes=MIB, backend="host", host_budget_bytes=MIB) as handle:
        f = handle.open_file(path)
        info = handle.file_info(f)
        st = os.stat(path)
        assert info["path"] == str(path) and info["size"] == data.nbytes == st.st_size
        assert info["mtime_ns"] == st.st_mtime_ns and info["inode"] == st.st_ino
        with pytest.raises(InvalidArgumentError, match="not one OpenFile returned"):
            handle.file_info(f + 1)
        with pytest.raises(TypeError):
            handle.file_info(True)
    with pytest.raises(prefetch.HandleClosedError):
        handle.file_info(f)


def test_unregister_frees_the_host_slot(data_file):
    path, data = data_file
    with prefetch.PrefetchHandle(device_budget_bytes=2 * MIB, backend="host", host_budget_bytes=2 * MIB) as handle:
        register_all(handle, path)
        read_slot(handle, 1, TENSORS[1][1])
        used = handle.stats()["host_tier_used_bytes"]
        assert used > 0
        handle.unregister(1)
        assert handle.stats()["host_tier_used_bytes"] == 0
        extents, total = TENSORS[2]
        assert np.array_equal(read_slot(handle, 2, total), expected(data, extents, total))


def test_close_with_reads_in_flight_leaves_no_descriptor(tmp_path):
    data = np.random.default_rng(5).integers(0, 256, 16 * MIB, dtype=np.uint8)
    path = tmp_path / "big.bin"
    data.tofile(path)
    fds = open_fds()
    for _ in range(3):
        handle = prefetch.PrefetchHandle(device_budget_bytes=4 * MIB, backend="host", host_budget_bytes=4 * MIB)
        f = handle.open_file(path)
        for i in range(16):
            handle.register_disk(i, [(f, i * MIB + 1, MIB - 1, 0)])
        handle.prefetch_tensors(list(range(16)))
        handle.close()  # reads and copies in flight: bounded, nothing leaks
    assert open_fds() == fds


def test_reader_threads_stage_ahead_and_respect_pause(tmp_path):
    # Prefetched disk-backed tensors: paused, nothing is read; resumed, the
    # reader threads stage them (several at once) and the worker copies them
    # as they land; every byte checked afterwards. A bad thread count is refused.
    data = np.random.default_rng(9).integers(0, 256, 8 * MIB, dtype=np.uint8)
    path = tmp_path / "shard.bin"
    data.tofile(path)
    with pytest.raises(InvalidArgumentError, match="disk_reader_threads"):
        prefetch.PrefetchHandle(device_budget_bytes=MIB, backend="host", host_budget_bytes=MIB,
                                disk_reader_threads=0)
    handle = prefetch.PrefetchHandle(device_budget_bytes=8 * MIB + 8 * 4096, backend="host",
                                     host_budget_bytes=2 * MIB, disk_reader_threads=4, start_paused=True)
    try:
        f = handle.open_file(path)
        for i in range(16):
            handle.register_disk(i, [(f, i * (MIB // 2) + 7, MIB // 2 - 7, 0)])
        handle.prefetch_tensors(list(range(16)))
        assert handle.stats()["disk_reads"] == 0  # paused: readers idle too
        handle.resume()
        for i in range(16):
            n = MIB // 2 - 7
            want = data[i * (MIB // 2) + 7: i * (MIB // 2) + 7 + n]
            assert np.array_equal(read_slot(handle, i, n), want), i
        s = handle.stats()
        assert s["disk_reads"] == 16 and s["copies"] == 16 and s["host_tier_used_bytes"] <= 2 * MIB
    finally:
        handle.close()


def test_a_failed_prefetch_read_goes_to_the_next_acquirer(data_file):
    # A prefetch whose read fails has no acquirer waiting: the error stays on
    # the tensor and the next acquire of it raises it (as for a failed copy);
    # the one after that reads again.
    import time

    path, data = data_file
    handle = prefetch.PrefetchHandle(device_budget_bytes=2 * MIB, backend="fault", host_budget_bytes=2 * MIB,
                                     faults={"eio_every_nth_read": 1})
    try:
        register_all(handle, path)
        handle.prefetch_tensors([2])
        deadline = time.monotonic() + 10
        while handle.stats()["disk_errors"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert handle.stats()["disk_errors"] == 1 and handle.stats()["queue_depth"] == 0
        handle.set_faults(eio_every_nth_read=0)
        with pytest.raises(CopyFailedError, match="tensor id 2.*Input/output error"):
            handle.acquire_slots([2], timeout=10)
        extents, total = TENSORS[2]
        assert np.array_equal(read_slot(handle, 2, total), expected(data, extents, total))
    finally:
        handle.close()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc (Linux)")
@pytest.mark.skipif(bool(os.environ.get("PREFETCH_SANITIZE")),
                    reason="a sanitizer's shadow memory grows with the memory touched (ThreadSanitizer: "
                           "82.7 MiB for these 16 MiB of budgets): RSS no longer measures the engine")
def test_host_memory_stays_within_the_budgets_whatever_the_model_size(tmp_path):
    # #15: a "model" of 2 GiB of experts (a sparse file: its holes read as
    # zeros, so the test costs no disk space) streamed through a host tier of
    # 8 MiB and a device cache of 8 MiB, every expert acquired in turn with
    # the next one prefetched: the process's resident memory grows by at most
    # the two budgets (+5 %) plus a little for the per-tensor records, never
    # with the bytes read (256 x the host tier).
    expert, count = 4 * MIB, 512
    path = tmp_path / "sparse-experts.bin"
    with open(path, "wb") as f:
        f.truncate(expert * count)
    host_budget = device_budget = 2 * (expert + 8192)
    with prefetch.PrefetchHandle(device_budget_bytes=device_budget, backend="host",
                                 host_budget_bytes=host_budget) as handle:
        f = handle.open_file(path)
        for tid in range(count):
            handle.register_disk(tid, [(f, tid * expert, expert, 0)])
        before = rss_bytes()
        peak = before
        for tid in range(count):
            ahead = list(range(tid + 1, min(tid + 2, count)))
            if ahead:
                handle.prefetch_tensors(ahead, 1)
            where = handle.acquire_slots([tid], timeout=60)
            assert where.shape == (1, 2)
            handle.release([tid])
            if tid % 16 == 0:
                peak = max(peak, rss_bytes())
        peak = max(peak, rss_bytes())
        s = handle.stats()
        assert s["disk_read_bytes"] >= expert * count  # every expert came from the file
        assert s["host_tier_used_bytes"] <= s["host_tier_budget_bytes"] == host_budget
    grown = peak - before
    assert grown <= 1.05 * (host_budget + device_budget) + 4 * MIB, (
        f"resident memory grew by {grown / MIB:.1f} MiB streaming {expert * count / MIB:.0f} MiB "
        f"through budgets of {(host_budget + device_budget) / MIB:.1f} MiB")


@pytest.mark.parametrize("poll_us", [0, 20])
def test_speculative_copies_from_the_host_tier_stay_under_the_cap(tmp_path, poll_us):
    # Note [Speculation counts what is on the link]: a staged tensor's copy
    # to the device is a speculative copy like any other; with a cap of one
    # tensor no two of them are on the (simulated) link at once.
    data = np.random.default_rng(11).integers(0, 256, 4 * MIB, dtype=np.uint8)
    path = tmp_path / "spec.bin"
    data.tofile(path)
    size = 256 * 1024
    tids = range(8)
    with prefetch.PrefetchHandle(device_budget_bytes=4 * MIB, backend="fault", host_budget_bytes=4 * MIB,
                                 max_speculative_bytes_in_flight=size, copy_poll_us=poll_us,
                                 faults={"report_async": 1, "async_copy_us": 5000}) as handle:
        handle.open_file(path)
        for tid in tids:
            handle.register_disk(tid, [(0, tid * size, size, 0)], total_bytes=size)
        handle.prefetch_tensors(list(tids), priority=1)
        # Every copy issued before the first acquire: an acquire that found a
        # tensor still on its way from the file would make its copy urgent
        # (not a lane copy), and on a slow machine that could take all eight.
        assert wait_until(lambda: handle.fault_counts()["copies"] == len(tids), timeout=60)
        for tid in tids:
            assert np.array_equal(read_slot(handle, tid, size), data[tid * size:(tid + 1) * size])
        counts = handle.fault_counts()
        assert counts["copies"] == len(tids)
        assert 0 < counts["max_lane_bytes_in_flight"] <= size
