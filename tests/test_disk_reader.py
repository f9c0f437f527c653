"""prefetch.DiskReader (src_cpp/disk_reader.h, Note [Disk reads]): byte-exact
reads of safetensors tensors located by prefetch.checkpoint, O_DIRECT and
buffered, every fault raising on the read it hits while the other reads go
on, bad arguments changing nothing, cancel and close with reads in flight,
and no descriptor or thread left behind. No timing is asserted."""
import errno
import os
import threading
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import prefetch
from prefetch.checkpoint import index_checkpoint
from prefetch.errors import (
    AcquireTimeoutError,
    DiskReadError,
    HandleClosedError,
    InvalidArgumentError,
    UnknownIdError,
)

# Odd sizes and dtypes: tensors start and end off any block boundary.
SHAPES = {"a": ((3, 5), np.float32), "b": ((7,), np.float16), "c": ((1000, 3), np.float32),
          "d": ((4097,), np.uint8), "e": ((2, 4096), np.float32), "f": ((1,), np.int64)}


def save(path, tensors):
    """A safetensors file: with the safetensors package when installed, else
    by the documented format (8-byte header length, JSON header, data)."""
    try:
        from safetensors.numpy import save_file
    except ImportError:
        import json
        import struct

        codes = {np.float32: "F32", np.float16: "F16", np.uint8: "U8", np.int64: "I64"}
        entries, blobs, pos = {}, [], 0
        for name, arr in tensors.items():
            data = arr.tobytes()
            entries[name] = {"dtype": codes[arr.dtype.type], "shape": list(arr.shape),
                             "data_offsets": [pos, pos + len(data)]}
            blobs.append(data)
            pos += len(data)
        head = json.dumps(entries).encode()
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(head)) + head + b"".join(blobs))
        return
    save_file(tensors, str(path))


def make_checkpoint(folder, shards=2, seed=0):
    """`shards` safetensors files in `folder`: ({name: array}, {name: TensorLocation})."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for s in range(shards):
        tensors = {}
        for key, (shape, dtype) in SHAPES.items():
            values = rng.standard_normal(shape) * 100 if dtype != np.uint8 else rng.integers(0, 256, shape)
            tensors[f"layers.{s}.{key}"] = values.astype(dtype)
        save(os.path.join(folder, f"model-{s:05d}.safetensors"), tensors)
        arrays.update(tensors)
    return arrays, index_checkpoint(folder)


def supports_o_direct(folder) -> bool:
    path = os.path.join(folder, ".o_direct_probe")
    with open(path, "wb") as f:
        f.write(b"\0" * 8192)
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(path)


@pytest.fixture
def direct_dir(tmp_path):
    """A folder whose filesystem takes O_DIRECT (tmp_path, else /var/tmp or
    the checkout), so the direct path really runs."""
    if supports_o_direct(tmp_path):
        yield tmp_path
        return
    import shutil
    import tempfile

    for base in ("/var/tmp", os.path.dirname(os.path.dirname(os.path.abspath(__file__)))):
        try:
            folder = tempfile.mkdtemp(prefix="prefetch-disk-", dir=base)
        except OSError:
            continue
        if supports_o_direct(folder):
            yield folder
            shutil.rmtree(folder, ignore_errors=True)
            return
        shutil.rmtree(folder, ignore_errors=True)
    pytest.skip("no folder here (tmp_path, /var/tmp, the checkout) takes O_DIRECT")


@pytest.fixture
def checkpoint(tmp_path):
    return make_checkpoint(tmp_path)


def read_all(reader, locations, files):
    """Every location read at once into its own aligned buffer: {name: bytes}."""
    pending = {}
    for name, loc in locations.items():
        f = files[loc.path]
        buf = prefetch.aligned_empty(reader.capacity(f, loc.offset, loc.nbytes))
        pending[name] = (reader.read_into(f, loc.offset, loc.nbytes, buf), buf, loc.nbytes)
    out = {}
    for name, (ticket, buf, n) in pending.items():
        start = reader.wait(ticket, timeout=60)
        out[name] = buf[start:start + n].tobytes()
    return out


def open_all(reader, locations):
    return {path: reader.open(path) for path in sorted({loc.path for loc in locations.values()})}


@pytest.mark.parametrize("direct_io", [True, False])
def test_every_tensor_reads_byte_exact(direct_dir, direct_io):
    arrays, index = make_checkpoint(direct_dir)
    with prefetch.DiskReader(threads=3, direct_io=direct_io) as r:
        files = open_all(r, index)
        for f in files.values():
            info = r.file_info(f)
            assert info["direct"] is direct_io and info["alignment"] >= 1
            assert (info["alignment"] > 1) is direct_io
        got = read_all(r, index, files)
        assert got == {name: arr.tobytes() for name, arr in arrays.items()}
        s = r.stats()
        assert s["reads"] == len(index) and s["errors"] == 0
        assert s["bytes"] == sum(loc.nbytes for loc in index.values()) <= s["span_bytes"]
        assert (s["direct_reads"], s["buffered_reads"]) == ((len(index), 0) if direct_io else (0, len(index)))
        assert s["open_files"] == len(files) and s["queued"] == s["in_progress"] == 0
        # The convenience call, by path and by index.
        loc = index["layers.1.c"]
        assert r.read(loc.path, loc.offset, loc.nbytes) == arrays["layers.1.c"].tobytes()
        assert r.read(files[loc.path], loc.offset, 5) == arrays["layers.1.c"].tobytes()[:5]


def test_refused_o_direct_falls_back_to_buffered_and_says_so(checkpoint):
    arrays, index = checkpoint
    with prefetch.DiskReader(threads=2, faults={"refuse_direct_io": 1}) as r:
        files = open_all(r, index)
        assert all(r.file_info(f)["direct"] is False and r.file_info(f)["alignment"] == 1 for f in files.values())
        assert read_all(r, index, files) == {name: arr.tobytes() for name, arr in arrays.items()}
        s = r.stats()
        assert s["direct_reads"] == 0 and s["buffered_reads"] == len(index)
    if not supports_o_direct(os.path.dirname(next(iter(index.values())).path)):
        # This filesystem refuses O_DIRECT itself (tmpfs on older kernels).
        with prefetch.DiskReader(threads=1) as r:
            assert r.file_info(r.open(next(iter(index.values())).path))["direct"] is False


def test_direct_reads_cover_the_aligned_span(direct_dir, rng):
    path = os.path.join(direct_dir, "blob.bin")
    data = rng.integers(0, 256, 3 * 4096 + 123, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    with prefetch.DiskReader(threads=2) as r:
        f = r.open(path)
        a = r.file_info(f)["alignment"]
        assert a > 1 and a & (a - 1) == 0
        for offset, length in [(0, 1), (0, len(data)), (len(data) - 1, 1), (a - 1, 2), (a, a), (17, 2 * a + 5),
                               (len(data) - 200, 200)]:
            lo, hi = offset - offset % a, -(-(offset + length) // a) * a
            assert r.capacity(f, offset, length) == hi - lo
            buf = prefetch.aligned_empty(hi - lo)
            start = r.wait(r.read_into(f, offset, length, buf))
            assert start == offset - lo
            assert buf[start:start + length].tobytes() == data[offset:offset + length]


@pytest.mark.parametrize("direct_io", [True, False])
def test_random_ranges_read_exact(tmp_path, direct_io):
    path = tmp_path / "blob.bin"
    data = np.random.default_rng(7).integers(0, 256, 5 * 4096 + 77, dtype=np.uint8).tobytes()
    path.write_bytes(data)
    with prefetch.DiskReader(threads=2, direct_io=direct_io) as r:
        f = r.open(path)

        @settings(max_examples=150, deadline=None)
        @given(st.integers(0, len(data) - 1).flatmap(lambda o: st.tuples(st.just(o), st.integers(1, len(data) - o))))
        def check(offset_length):
            offset, length = offset_length
            assert r.read(f, offset, length) == data[offset:offset + length]

        check()
        assert r.stats()["errors"] == 0


def submit_reads(r, f, data, count, length=1000):
    """`count` reads of `length` bytes at distinct offsets: [(ticket, buf, offset)]."""
    out = []
    for i in range(count):
        offset = (i * 977) % (len(data) - length)
        buf = prefetch.aligned_empty(r.capacity(f, offset, length))
        out.append((r.read_into(f, offset, length, buf), buf, offset))
    return out


def blob(folder, size=64 * 1024, name="blob.bin", seed=3):
    path = os.path.join(folder, name)
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        f.write(data)
    return path, data


@pytest.mark.parametrize("fault, match, code", [
    ("fail_every_nth_read", r"pread: Input/output error \(injected\)", errno.EIO),
    ("short_every_nth_read", r"short read: end of file after \d+ of the 1000 bytes .*injected", None),
])
def test_injected_faults_fail_only_their_read(tmp_path, fault, match, code):
    path, data = blob(tmp_path)
    with prefetch.DiskReader(threads=1, faults={fault: 3}) as r:  # one thread: reads run in order
        f = r.open(path)
        for i, (ticket, buf, offset) in enumerate(submit_reads(r, f, data, 7), start=1):
            if i % 3 == 0:
                with pytest.raises(DiskReadError, match=match) as err:
                    r.wait(ticket)
                assert err.value.errno == code
                assert f"{path}: read of 1000 bytes at offset {offset}" in str(err.value)
            else:
                start = r.wait(ticket)
                assert buf[start:start + 1000].tobytes() == data[offset:offset + 1000]
        s = r.stats()
        assert s["errors"] == 2 and s["reads"] == 5


def test_a_file_truncated_under_the_reader_fails_its_reads_only(tmp_path):
    path, data = blob(tmp_path)
    other, other_data = blob(tmp_path, name="other.bin", seed=4)
    with prefetch.DiskReader(threads=2) as r:
        f, g = r.open(path), r.open(other)
        assert r.read(f, 100, 10) == data[100:110]
        os.truncate(path, len(data) // 2)
        with pytest.raises(DiskReadError, match=r"short read.*changed since it was opened \(size 65536 -> 32768"):
            r.read(f, len(data) - 1000, 1000)  # past the new end
        with pytest.raises(DiskReadError, match=r"changed since it was opened \(size 65536 -> 32768"):
            r.read(f, 0, 1000)  # inside it, but the file is not the one opened
        assert r.read(g, 5, 5000) == other_data[5:5005]
        with pytest.raises(InvalidArgumentError, match="runs past the end"):
            r.read(f, len(data), 1)  # still checked against the size at open


def test_a_file_written_in_place_is_detected(tmp_path):
    path, data = blob(tmp_path)
    with prefetch.DiskReader(threads=1) as r:
        f = r.open(path)
        st = os.stat(path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        with pytest.raises(DiskReadError, match="mtime changed") as err:
            r.read(f, 0, 10)
        assert err.value.errno is None


def test_a_replaced_or_removed_file_is_detected(tmp_path):
    path, data = blob(tmp_path)
    other, other_data = blob(tmp_path, name="other.bin", seed=4)
    with prefetch.DiskReader(threads=2) as r:
        f, g = r.open(path), r.open(other)
        replacement = tmp_path / "new.bin"
        replacement.write_bytes(data[::-1])
        os.replace(replacement, path)  # the open descriptor still reads the old bytes
        with pytest.raises(DiskReadError, match="now names another file.*replaced since it was opened"):
            r.read(f, 0, 100)
        assert r.read(g, 0, 100) == other_data[:100]
        os.unlink(other)
        with pytest.raises(DiskReadError, match="removed or renamed"):
            r.read(g, 0, 100)
        # The new file opens and reads as itself.
        assert r.read(path, 0, 100) == data[::-1][:100]


def test_a_missing_shard_raises_naming_it(tmp_path):
    arrays, index = make_checkpoint(tmp_path)
    gone = next(iter(index.values())).path
    os.unlink(gone)
    with prefetch.DiskReader(threads=1) as r:
        before = r.stats()
        with pytest.raises(DiskReadError, match=f"{gone}: cannot open: No such file") as err:
            r.open(gone)
        assert err.value.errno == errno.ENOENT and isinstance(err.value, OSError)
        assert r.stats() == before
        kept = {n: loc for n, loc in index.items() if loc.path != gone}
        assert read_all(r, kept, open_all(r, kept)) == {n: arrays[n].tobytes() for n in kept}
        with pytest.raises(InvalidArgumentError, match="not a regular file"):
            r.open(tmp_path)


def bad_calls(r, f, b, g, size):
    """(call, error) pairs of bad arguments: f is a direct file of reader r,
    g a buffered file of reader b, both of `size` bytes."""
    ok = prefetch.aligned_empty(8192)
    return [
        (lambda: r.read_into(f, 0, 0, ok), InvalidArgumentError),  # length 0
        (lambda: r.read_into(f, size, 1, ok), InvalidArgumentError),  # offset at the end
        (lambda: r.read_into(f, size - 10, 11, ok), InvalidArgumentError),  # runs past it
        (lambda: r.read_into(f, 2**64 - 1, 2**64 - 1, ok), InvalidArgumentError),  # would overflow
        (lambda: r.read_into(f, 2**64, 1, ok), InvalidArgumentError),  # not a uint64
        (lambda: r.read_into(f, -1, 1, ok), InvalidArgumentError),
        (lambda: r.read_into(f, 0, 1.0, ok), TypeError),
        (lambda: r.read_into(f, True, 1, ok), TypeError),
        (lambda: r.read_into(99, 0, 1, ok), InvalidArgumentError),  # unknown file index
        (lambda: r.read_into(f, 0, 10, ok[1:]), InvalidArgumentError),  # unaligned for O_DIRECT
        (lambda: r.read_into(f, 0, 8192, ok[:4096]), InvalidArgumentError),  # capacity too small
        (lambda: b.read_into(g, 0, 100, ok[:99]), InvalidArgumentError),
        (lambda: b.read_into(g, 0, 10, b"x" * 4096), InvalidArgumentError),  # read-only
        (lambda: b.read_into(g, 0, 10, np.zeros(64, np.float32)), InvalidArgumentError),  # not uint8
        (lambda: b.read_into(g, 0, 10, np.zeros((64, 2), np.uint8)[:, 0]), InvalidArgumentError),
        (lambda: b.read_into(g, 0, 10, [0] * 64), TypeError),
        (lambda: r.wait(12345), UnknownIdError),
        (lambda: r.cancel(12345), UnknownIdError),
        (lambda: r.poll(12345), UnknownIdError),
        (lambda: r.wait(12345, timeout=-1), InvalidArgumentError),
        (lambda: r.wait(12345, timeout=float("nan")), InvalidArgumentError),
        (lambda: r.capacity(f, 0, 0), InvalidArgumentError),
        (lambda: r.close_file(99), InvalidArgumentError),
        (lambda: r.file_info(99), InvalidArgumentError),
        (lambda: r.open(""), InvalidArgumentError),
    ]


def test_bad_arguments_raise_and_change_nothing(direct_dir):
    path, data = blob(direct_dir)
    with prefetch.DiskReader(threads=2) as r, prefetch.DiskReader(threads=1, direct_io=False) as b:
        f, g = r.open(path), b.open(path)
        assert r.file_info(f)["direct"] and not b.file_info(g)["direct"]
        for i, (call, error) in enumerate(bad_calls(r, f, b, g, len(data))):
            before = r.stats(), b.stats()
            with pytest.raises(error):
                call()
            assert (r.stats(), b.stats()) == before, f"bad call {i} changed a reader"
        assert r.read(f, 1, 3) == data[1:4] and b.read(g, 1, 3) == data[1:4]  # still serving
    for kwargs, error in [({"threads": 0}, InvalidArgumentError), ({"threads": 1.5}, TypeError),
                          ({"direct_io": 1}, TypeError), ({"faults": {"nope": 1}}, InvalidArgumentError),
                          ({"faults": {"read_delay_us": -1}}, InvalidArgumentError)]:
        with pytest.raises(error):
            prefetch.DiskReader(**kwargs)


def test_cancel_drops_queued_reads_and_frees_running_ones(tmp_path):
    path, data = blob(tmp_path)
    with prefetch.DiskReader(threads=1, faults={"read_delay_us": 2000}) as r:
        f = r.open(path)
        reads = submit_reads(r, f, data, 20)
        dropped = [r.cancel(ticket) for ticket, _, _ in reads[10:]]
        for ticket, _, _ in reads[10:]:
            with pytest.raises(UnknownIdError, match=f"ticket {ticket} is not pending"):
                r.wait(ticket)
        for ticket, buf, offset in reads[:10]:
            start = r.wait(ticket)
            assert buf[start:start + 1000].tobytes() == data[offset:offset + 1000]
        s = r.stats()
        # A read that had started ran to the end (counted); one dropped never ran.
        assert s["reads"] == 20 - sum(dropped) and s["cancelled"] >= sum(dropped)
        assert s["queued"] == s["in_progress"] == 0 and s["errors"] == 0


def test_wait_timeout_keeps_the_ticket(tmp_path):
    path, data = blob(tmp_path)
    with prefetch.DiskReader(threads=1, faults={"read_delay_us": 500_000}) as r:
        f = r.open(path)
        buf = prefetch.aligned_empty(r.capacity(f, 0, 100))
        ticket = r.read_into(f, 0, 100, buf)
        with pytest.raises(AcquireTimeoutError, match=f"ticket {ticket}: .* is still (queued|in progress)"):
            r.wait(ticket, timeout=0)
        start = r.wait(ticket, timeout=60)
        assert buf[start:start + 100].tobytes() == data[:100]
        with pytest.raises(UnknownIdError):
            r.poll(ticket)  # waited for: forgotten


def test_close_with_reads_in_flight_wakes_every_waiter(tmp_path):
    path, data = blob(tmp_path)
    r = prefetch.DiskReader(threads=2, faults={"read_delay_us": 1000})
    f = r.open(path)
    reads = submit_reads(r, f, data, 200)
    outcomes = {}

    def waiter(chunk):
        for ticket, buf, offset in chunk:
            try:
                start = r.wait(ticket)
                outcomes[ticket] = buf[start:start + 1000].tobytes() == data[offset:offset + 1000]
            except HandleClosedError:
                outcomes[ticket] = "closed"

    threads = [threading.Thread(target=waiter, args=(reads[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    r.close()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a wait hung across close()"
    assert sorted(outcomes) == sorted(ticket for ticket, _, _ in reads)
    assert set(outcomes.values()) <= {True, "closed"}  # never wrong bytes
    s = r.stats()
    assert s["reads"] + s["cancelled"] == 200 and s["queued"] == s["in_progress"] == s["open_files"] == 0
    assert r.closed
    r.close()  # idempotent
    for call in (lambda: r.open(path), lambda: r.read_into(f, 0, 10, prefetch.aligned_empty(4096))):
        with pytest.raises(HandleClosedError, match="closed"):
            call()


def count_fds_and_threads():
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def counts_once_settled(before, limit_s=10.0):
    """The descriptor and thread counts, once they are back to `before` or
    after `limit_s`. pthread_join returns when the kernel clears the thread's
    id, early in its exit; its /proc/self/task entry goes a moment later, when
    the kernel reaps it. A joined thread can still be listed for that moment
    (once in CI, under AddressSanitizer), so a count above `before` is read
    again; a thread or descriptor really left behind stays and fails."""
    deadline = time.monotonic() + limit_s
    counts = count_fds_and_threads()
    while not (counts[0] <= before[0] and counts[1] <= before[1]) and time.monotonic() < deadline:
        time.sleep(0.01)
        counts = count_fds_and_threads()
    return counts


def test_no_descriptor_or_thread_is_left_behind(tmp_path):
    arrays, index = make_checkpoint(tmp_path)
    before = count_fds_and_threads()
    with prefetch.DiskReader(threads=4) as r:
        files = open_all(r, index)
        read_all(r, index, files)
        r.close_file(next(iter(files.values())))
        with pytest.raises(DiskReadError):
            r.open(tmp_path / "missing.safetensors")
    after = counts_once_settled(before)
    assert after[0] <= before[0] and after[1] <= before[1], (after, before)
    # Dropped without close(): deallocation closes it, reads in flight included.
    r = prefetch.DiskReader(threads=3, faults={"read_delay_us": 500})
    f = r.open(next(iter(index.values())).path)
    submit_reads(r, f, b"\0" * 4096, 30)
    del r
    after = counts_once_settled(before)
    assert after[0] <= before[0] and after[1] <= before[1], (after, before)


def test_reads_into_cpu_torch_tensors(tmp_path):
    torch = pytest.importorskip("torch")
    arrays, index = make_checkpoint(tmp_path, shards=1)
    pin = torch.cuda.is_available()
    with prefetch.DiskReader(threads=2) as r:
        for name, loc in index.items():
            f = r.open(loc.path)
            cap = r.capacity(f, loc.offset, loc.nbytes)
            raw = torch.empty(cap + 4096, dtype=torch.uint8, pin_memory=pin)
            skip = -raw.data_ptr() % 4096
            out = raw[skip:skip + cap]
            start = r.wait(r.read_into(f, loc.offset, loc.nbytes, out))
            assert out[start:start + loc.nbytes].numpy().tobytes() == arrays[name].tobytes()
            r.close_file(f)
        with pytest.raises(InvalidArgumentError, match="uint8"):
            r.read_into(r.open(loc.path), 0, 4, torch.empty(4096, dtype=torch.float32))


def test_aligned_empty():
    for n in (1, 4095, 1 << 20):
        for a in (1, 512, 4096, 1 << 16):
            buf = prefetch.aligned_empty(n, a)
            assert buf.dtype == np.uint8 and buf.shape == (n,) and buf.ctypes.data % a == 0
    assert prefetch.aligned_empty(0).shape == (0,)
    with pytest.raises(InvalidArgumentError, match="power of two"):
        prefetch.aligned_empty(10, 3000)
    with pytest.raises(InvalidArgumentError):
        prefetch.aligned_empty(-1)


def test_disk_read_error_is_an_oserror_and_a_prefetch_error():
    assert issubclass(DiskReadError, OSError) and issubclass(DiskReadError, prefetch.PrefetchError)
    assert prefetch.DiskReadError is DiskReadError


def test_use_in_a_forked_child_raises_instead_of_hanging(tmp_path):
    import subprocess
    import sys
    import textwrap

    path, _ = blob(tmp_path)
    code = textwrap.dedent(f"""
        import os, sys
        import prefetch
        r = prefetch.DiskReader(threads=1, faults={{"read_delay_us": 100_000}})
        f = r.open({str(path)!r})
        tickets = [r.read_into(f, 0, 100, prefetch.aligned_empty(8192)) for _ in range(5)]
        pid = os.fork()
        if pid == 0:
            raised = 0
            for call in (lambda: r.wait(tickets[-1]), lambda: r.open({str(path)!r}), lambda: r.stats(),
                         lambda: r.read_into(f, 0, 10, prefetch.aligned_empty(4096))):
                try:
                    call()
                except prefetch.HandleClosedError as exc:
                    raised += "forked child" in str(exc)
            r.close()  # returns at once: the threads live in the parent
            os._exit(0 if raised == 4 else 3)
        _, status = os.waitpid(pid, 0)
        print("child exit", os.waitstatus_to_exitcode(status))
        print("parent reads", [r.wait(t) for t in tickets])
        r.close()
    """)
    # The child imports the same package as this test (a sanitizer build's copy, say).
    root = os.path.dirname(os.path.dirname(os.path.abspath(prefetch.__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, (proc.stdout, proc.stderr)
    assert "child exit 0" in proc.stdout and "parent reads [0, 0, 0, 0, 0]" in proc.stdout
