"""Disk read throughput: prefetch.DiskReader against a plain O_DIRECT read
loop, measured in the same run.

    python bench/disk.py [--dir DIR] [--files 4] [--size-mib 1024]
        [--range-mib 12] [--threads 1 2 4] [--reps 3] [--json PATH]
    python bench/disk.py --smoke-cpu    # tiny, for CI

Writes --files files of --size-mib MiB of random bytes into a new folder
under --dir (removed at the end), then runs --reps rounds. Each round runs
every measurement once, in turn (in reverse order every other round, so a
drift of the disk favours none):
  raw     one Python thread reads every file front to back in --range-mib
          ranges with os.preadv into one aligned buffer, files opened with
          O_DIRECT: the baseline of every "vs raw" ratio;
  raw-par the same ranges spread round-robin over 2 x the largest --threads
          Python threads, each with its own aligned buffer (os.preadv
          releases the GIL): plain O_DIRECT reads with as many in flight as
          the largest DiskReader keeps ("vs par"); #15's "90 % of raw
          O_DIRECT" is judged against the faster of raw and raw-par (on
          the 2-core development VM one thread was faster, 2.8 against
          2.2 GB/s);
  reader  prefetch.DiskReader with each --threads count reads the same ranges
          into aligned buffers, 2 reads per thread in flight;
  engine  the engine's own disk tier (Note [Host tier]): every range registered
          as a disk-backed tensor of one PrefetchHandle with the largest
          --threads count of reader threads, whose host tier and device
          cache (on CUDA, the GPU) each hold 2 x that + 2 ranges (far less
          than the files: the "host budget below the experts" case); the
          ranges are acquired in order, each acquire preceded by a prefetch
          of the next 2 x threads (as many reads queued as raw-par keeps in
          flight), and released: disk -> page-locked host
          slot -> device slot, timed until the last acquire returned with
          its bytes in place (no stream: the CPU waits for each copy);
  gpu     (CUDA only) the same with the largest thread count into page-locked
          buffers, each range copied to the GPU with copy_(non_blocking=True)
          on a side stream while the next ranges are read (each buffer reused
          once its copy has completed); timed until the last copy is done.
Figures: GB/s = bytes requested / host-clock seconds of the pass (files
already open); a ratio divides by the raw pass of the same round; each is
the median over rounds. Before timing, the first and last range of every
file is read both ways and compared byte for byte. The raw loop reuses one
buffer, the reader rotates through its 2 per thread: where the "disk" is
memory-fast (a virtual disk served from the host's cache), one buffer that
stays in the CPU's cache gives raw an edge that is not the reader's cost.

Page cache: with O_DIRECT (`direct: true` in the report) every read goes to
the device and the page cache serves nothing. Where the filesystem refuses
O_DIRECT (tmpfs on older kernels) both loops fall back to buffered reads
and the report says `direct: false`; each pass is then preceded by
posix_fadvise(POSIX_FADV_DONTNEED) on every file, which asks the kernel to
drop their cached pages, but it may keep some (and on tmpfs the page cache
is the file): buffered figures may come from memory. Without CUDA the gpu
row is null, with the reason.
"""
from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque

if __package__ in (None, ""):
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.lib.common import fmt, machine_info, write_json  # noqa: E402

MIB = 1 << 20
ALIGN = 4096  # buffers and ranges; a multiple of every O_DIRECT alignment seen
SMOKE_REPS = 2  # --smoke-cpu's rounds: one in each order


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def write_files(folder: str, count: int, size: int, seed: int = 0) -> list[str]:
    """`count` files of `size` random bytes (written in 64 MiB pieces,
    synced, then dropped from the page cache)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        path = os.path.join(folder, f"shard-{i:03d}.bin")
        with open(path, "wb") as f:
            left = size
            while left:
                piece = min(left, 64 * MIB)
                f.write(rng.bytes(piece))
                left -= piece
            f.flush()
            os.fsync(f.fileno())
        paths.append(path)
    drop_cache(paths)
    return paths


def drop_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def open_raw(paths) -> tuple[list[int], bool]:
    """Descriptors for the raw loop: O_DIRECT where the filesystem takes it."""
    fds, direct = [], True
    for path in paths:
        try:
            fds.append(os.open(path, os.O_RDONLY | os.O_DIRECT))
        except OSError:
            fds.append(os.open(path, os.O_RDONLY))
            direct = False
    return fds, direct


def ranges_of(size: int, range_bytes: int) -> list[tuple[int, int]]:
    return [(off, min(range_bytes, size - off)) for off in range(0, size, range_bytes)]


def read_range(fd: int, view: memoryview, off: int, n: int) -> None:
    """One raw read of the range (whole aligned blocks into `view`)."""
    got = os.preadv(fd, [view[:-(-n // ALIGN) * ALIGN]], off)
    if got < n:
        raise RuntimeError(f"raw read: short read at offset {off} ({got} of {n} bytes)")


def raw_pass(fds, size: int, range_bytes: int, buf) -> tuple[int, float]:
    """Every range of every file through os.preadv into `buf`: (bytes, seconds)."""
    view = memoryview(buf)
    total = 0
    t0 = time.perf_counter()
    for fd in fds:
        for off, n in ranges_of(size, range_bytes):
            read_range(fd, view, off, n)
            total += n
    return total, time.perf_counter() - t0


def raw_parallel_pass(fds, size: int, range_bytes: int, bufs) -> tuple[int, float]:
    """Every range of every file through os.preadv, spread round-robin over
    len(bufs) threads (one buffer each): (bytes, seconds)."""
    import threading

    tasks = [(fd, off, n) for fd in fds for off, n in ranges_of(size, range_bytes)]
    errors = []

    def work(k):
        view = memoryview(bufs[k])
        try:
            for fd, off, n in tasks[k::len(bufs)]:
                read_range(fd, view, off, n)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the calling thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(len(bufs))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return sum(n for _, _, n in tasks), seconds


def reader_pass(reader, files, size: int, range_bytes: int, buffers, on_read=None) -> tuple[int, float]:
    """Every range of every file through `reader`, len(buffers) reads in
    flight: (bytes, seconds). `on_read(buffer index, start, n)` runs on each
    finished read before its buffer is reused; it returns a callable that
    blocks until the buffer may be overwritten (or None)."""
    pending = deque()  # (ticket, buffer index, n)
    free = deque(range(len(buffers)))
    release = [None] * len(buffers)
    total = 0

    def finish():
        nonlocal total
        ticket, b, n = pending.popleft()
        start = reader.wait(ticket)
        total += n
        release[b] = on_read(b, start, n) if on_read else None
        free.append(b)

    t0 = time.perf_counter()
    for f in files:
        for off, n in ranges_of(size, range_bytes):
            if not free:
                finish()
            b = free.popleft()
            if release[b] is not None:
                release[b]()
            pending.append((reader.read_into(f, off, n, buffers[b]), b, n))
    while pending:
        finish()
    for done in release:
        if done is not None:
            done()
    return total, time.perf_counter() - t0


def engine_layout(threads: int) -> tuple[int, int]:
    """The engine pass with `threads` reader threads: (ranges queued ahead
    of each acquire, as many as raw-par has in flight; ranges its host tier
    and its device cache each hold)."""
    return 2 * threads, 2 * threads + 2


def engine_pass(prefetch, paths, size: int, range_bytes: int, backend: str, threads: int) -> tuple[int, float]:
    """Every range of every file through the engine's disk tier (see the
    module docstring) with `threads` reader threads: (bytes, seconds)."""
    span = -(-range_bytes // ALIGN) * ALIGN + ALIGN
    ahead, held = engine_layout(threads)
    handle = prefetch.PrefetchHandle(device_budget_bytes=held * (range_bytes + 512), backend=backend,
                                     host_budget_bytes=held * span, disk_reader_threads=threads)
    try:
        ids = []
        for path in paths:
            f = handle.open_file(path)
            for off, n in ranges_of(size, range_bytes):
                handle.register_disk(len(ids), [(f, off, n, 0)])
                ids.append(n)
        total = 0
        t0 = time.perf_counter()
        for i, n in enumerate(ids):
            later = list(range(i + 1, min(i + 1 + ahead, len(ids))))
            if later:
                handle.prefetch_tensors(later, 1)
            handle.acquire_slots([i], timeout=600)
            handle.release([i])
            total += n
        seconds = time.perf_counter() - t0
        if handle.stats()["disk_errors"]:
            raise RuntimeError("engine pass: disk reads failed")
        return total, seconds
    finally:
        handle.close()


def check_bytes(prefetch, paths, fds, size: int, range_bytes: int) -> None:
    """The first and last range of every file, read both ways, must agree."""
    with prefetch.DiskReader(threads=2) as reader:
        for path, fd in zip(paths, fds):
            for off, n in (ranges_of(size, range_bytes)[0], ranges_of(size, range_bytes)[-1]):
                buf = prefetch.aligned_empty(-(-n // ALIGN) * ALIGN)
                os.preadv(fd, [memoryview(buf)], off)
                if reader.read(path, off, n) != buf[:n].tobytes():
                    raise RuntimeError(f"{path}: DiskReader and preadv disagree on [{off}, {off + n})")


class GpuSink:
    """Page-locked buffers whose reads are copied to the GPU on a side
    stream; a buffer is reused once its copy has completed."""

    def __init__(self, torch, count: int, nbytes: int):
        self.torch = torch
        self.stream = torch.cuda.Stream()
        self.host, self.device, self.events = [], [], []
        for _ in range(count):
            raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=True)
            skip = -raw.data_ptr() % ALIGN
            self.host.append(raw[skip:skip + nbytes])
            self.device.append(torch.empty(nbytes, dtype=torch.uint8, device="cuda"))
            self.events.append(torch.cuda.Event())

    def on_read(self, b: int, start: int, n: int):
        with self.torch.cuda.stream(self.stream):
            self.device[b][:n].copy_(self.host[b][start:start + n], non_blocking=True)
            self.events[b].record(self.stream)
        return self.events[b].synchronize


def gpu_reason():
    """None when CUDA can run the gpu row, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    return None


def measure(prefetch, paths, size: int, args) -> dict:
    fds, direct = open_raw(paths)
    readers = {}
    try:
        check_bytes(prefetch, paths, fds, size, args.range_bytes)
        raw_buf = prefetch.aligned_empty(-(-args.range_bytes // ALIGN) * ALIGN + ALIGN)
        par_bufs = [prefetch.aligned_empty(-(-args.range_bytes // ALIGN) * ALIGN + ALIGN)
                    for _ in range(2 * max(args.threads))]
        for t in args.threads:
            r = prefetch.DiskReader(threads=t, direct_io=True)
            bufs = [prefetch.aligned_empty(args.range_bytes + 2 * ALIGN) for _ in range(2 * t)]
            readers[t] = (r, [r.open(p) for p in paths], bufs)
        sink = None
        reason = gpu_reason()
        if reason is None:
            import torch

            top = max(args.threads)
            sink = GpuSink(torch, 2 * top, args.range_bytes + 2 * ALIGN)
        samples = {"raw": [], "raw-par": [], **{t: [] for t in args.threads}, "engine": [], "gpu": []}
        backend = "cuda" if reason is None else "host"
        for rep in range(args.reps):
            kinds = ["raw", "raw-par", *args.threads, "engine"] + (["gpu"] if sink else [])
            for kind in (kinds if rep % 2 == 0 else kinds[::-1]):
                drop_cache(paths)
                if kind == "raw":
                    samples["raw"].append(gbps(*raw_pass(fds, size, args.range_bytes, raw_buf)))
                elif kind == "raw-par":
                    samples["raw-par"].append(gbps(*raw_parallel_pass(fds, size, args.range_bytes, par_bufs)))
                elif kind == "engine":
                    samples["engine"].append(gbps(*engine_pass(prefetch, paths, size, args.range_bytes, backend,
                                                               max(args.threads))))
                elif kind == "gpu":
                    r, files, _ = readers[max(args.threads)]
                    samples["gpu"].append(gbps(*reader_pass(r, files, size, args.range_bytes, sink.host,
                                                            sink.on_read)))
                else:
                    r, files, bufs = readers[kind]
                    samples[kind].append(gbps(*reader_pass(r, files, size, args.range_bytes, bufs)))
        reader_direct = all(r.file_info(files[0])["direct"] for r, files, _ in readers.values())
        out = summarize(samples, args.threads, direct and reader_direct, reason)
        held = engine_layout(max(args.threads))[1]
        out["engine"] = {"backend": backend, "gbps": statistics.median(samples["engine"]),
                         "over_raw": ratio(samples["engine"], samples["raw"]),
                         "over_raw_parallel": ratio(samples["engine"], samples["raw-par"]),
                         "samples_gbps": samples["engine"], "reader_threads": max(args.threads),
                         "host_tier_ranges": held, "device_cache_ranges": held}
        return out
    finally:
        for r, _, _ in readers.values():
            r.close()
        for fd in fds:
            os.close(fd)


def ratio(samples, base):
    """Median of the per-round ratios of two sample lists."""
    return statistics.median(a / b for a, b in zip(samples, base)) if samples else None


def summarize(samples: dict, threads, direct: bool, gpu_reason_text) -> dict:
    raw, par = samples["raw"], samples["raw-par"]
    rows = [{"threads": t, "gbps": statistics.median(samples[t]), "over_raw": ratio(samples[t], raw),
             "over_raw_parallel": ratio(samples[t], par), "samples_gbps": samples[t]} for t in threads]
    if gpu_reason_text is None:
        gpu = {"threads": max(threads), "gbps": statistics.median(samples["gpu"]),
               "over_raw": ratio(samples["gpu"], raw), "over_raw_parallel": ratio(samples["gpu"], par),
               "samples_gbps": samples["gpu"], "reason": None}
    else:
        gpu = {"threads": max(threads), "gbps": None, "over_raw": None, "over_raw_parallel": None,
               "samples_gbps": [], "reason": gpu_reason_text}
    return {"direct": direct,
            "page_cache": ("bypassed: O_DIRECT" if direct else
                           "buffered reads: posix_fadvise(DONTNEED) before each pass; may be served from memory"),
            "raw_gbps": statistics.median(raw), "raw_samples_gbps": raw,
            "raw_parallel_threads": 2 * max(threads), "raw_parallel_gbps": statistics.median(par),
            "raw_parallel_samples_gbps": par, "reader": rows, "gpu": gpu, "byte_exact": True}


def format_table(report: dict) -> str:
    m = report["result"]
    cfg = report["config"]
    lines = [f"Disk reads: {cfg['files']} files x {cfg['size_mib']} MiB, {cfg['range_mib']} MiB ranges, "
             f"{cfg['reps']} rounds (median); direct={m['direct']} ({m['page_cache']})",
             f"{'what':>22}{'GB/s':>10}{'vs raw':>10}{'vs par':>10}",
             f"{'raw preadv (1 thread)':>22}{fmt(m['raw_gbps']):>10}{'1.00':>10}{'':>10}",
             f"{'raw preadv x' + str(m['raw_parallel_threads']):>22}{fmt(m['raw_parallel_gbps']):>10}"
             f"{fmt(m['raw_parallel_gbps'] / m['raw_gbps']):>10}{'1.00':>10}"]
    for row in m["reader"]:
        lines.append(f"{'DiskReader x' + str(row['threads']):>22}{fmt(row['gbps']):>10}{fmt(row['over_raw']):>10}"
                     f"{fmt(row['over_raw_parallel']):>10}")
    eng = m["engine"]
    label = f"engine tier -> {'GPU' if eng['backend'] == 'cuda' else 'host'}"
    lines.append(f"{label:>22}{fmt(eng['gbps']):>10}{fmt(eng['over_raw']):>10}{fmt(eng['over_raw_parallel']):>10}")
    g = m["gpu"]
    label = f"reader x{g['threads']} -> GPU"
    lines.append(f"{label:>22}{fmt(g['gbps']):>10}{fmt(g['over_raw']):>10}{fmt(g['over_raw_parallel']):>10}"
                 + (f"  ({g['reason']})" if g["reason"] else ""))
    return "\n".join(lines)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", default="/var/tmp" if os.path.isdir("/var/tmp") else tempfile.gettempdir(),
                        help="where the test files are written (a new folder inside, removed at the end)")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--size-mib", type=int, default=1024, help="size of each file")
    parser.add_argument("--range-mib", type=float, default=12, help="bytes per read (an expert's size)")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4], help="DiskReader thread counts")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json")
    parser.add_argument("--smoke-cpu", action="store_true",
                        help=f"tiny files, {SMOKE_REPS} rounds (one in each order), threads 1 and 2 (CI): checks "
                             "the bench runs, measures nothing")
    args = parser.parse_args(argv)
    if args.smoke_cpu:
        args.files, args.size_mib, args.range_mib, args.threads, args.reps = 2, 4, 1.5, [1, 2], SMOKE_REPS
    if not math.isfinite(args.range_mib):
        parser.error(f"--range-mib must be finite, got {args.range_mib}")
    args.range_bytes = -(-int(args.range_mib * MIB) // ALIGN) * ALIGN
    if min(args.files, args.size_mib, args.range_bytes, args.reps, *args.threads) < 1:
        parser.error("--files, --size-mib, --range-mib, --reps and --threads must be positive")
    if len(set(args.threads)) != len(args.threads):
        # Each count is one reader and one sample a round: a repeat would
        # leave one reader unclosed and pair its samples with the wrong rounds.
        parser.error(f"--threads counts must differ, got {' '.join(map(str, args.threads))}")
    if not os.path.isdir(args.dir):
        parser.error(f"--dir {args.dir}: no such directory")
    if not os.access(args.dir, os.W_OK | os.X_OK):
        parser.error(f"--dir {args.dir}: not writable")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    import prefetch

    folder = tempfile.mkdtemp(prefix="prefetch-disk-bench-", dir=args.dir)
    try:
        size = args.size_mib * MIB
        print(f"writing {args.files} x {args.size_mib} MiB into {folder}", file=sys.stderr, flush=True)
        paths = write_files(folder, args.files, size)
        result = measure(prefetch, paths, size, args)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report = {"benchmark": "disk read", "machine": machine_info(),
              "config": {"dir": args.dir, "files": args.files, "size_mib": args.size_mib,
                         "range_mib": args.range_bytes / MIB, "threads": args.threads, "reps": args.reps,
                         "smoke_cpu": args.smoke_cpu},
              "result": result}
    print(format_table(report))
    if args.json:
        write_json(args.json, report)
    if args.smoke_cpu:
        ok = (result["raw_gbps"] > 0 and result["raw_parallel_gbps"] > 0 and result["engine"]["gbps"] > 0
              and all(row["gbps"] > 0 for row in result["reader"]))
        print("smoke ok" if ok else "smoke FAILED")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
