# cython: language_level=3
"""DiskReader: the Python face of the C++ DiskReader (src_cpp/disk_reader.h),
a pool of threads reading byte ranges of files with O_DIRECT into buffers
the caller owns (the reader of issue #15's disk tier; the engine does not
use it yet).

Every call that takes the reader's lock or blocks releases the GIL. Errors
come through the engine's translator (prefetch/_errors.h), as the classes
of prefetch.errors: DiskReadError (an OSError) for a file that cannot be
opened or read, InvalidArgumentError for bad arguments, and so on.
"""
import operator
import os
import sys

import numpy as np

from prefetch import errors as _errors
from prefetch.errors import AcquireTimeoutError, HandleClosedError, InvalidArgumentError

cimport cython
from libc.stdint cimport int64_t, uint64_t, uintptr_t
from libcpp cimport bool as cbool
from libcpp.memory cimport unique_ptr
from posix.unistd cimport getpid
from libcpp.string cimport string

from prefetch._errors cimport prefetch_raise_py_error, prefetch_set_error_type


cdef extern from "disk_reader.h" namespace "prefetch" nogil:
    cdef cppclass CDiskFaultOptions "prefetch::DiskFaultOptions":
        int64_t fail_every_nth_read
        int64_t short_every_nth_read
        int64_t refuse_direct_io
        int64_t read_delay_us

    const size_t kDefaultDirectAlignment
    const int kMaxDiskReaderThreads

    cdef cppclass CDiskFileInfo "prefetch::DiskFileInfo":
        string path
        cbool direct
        size_t alignment
        uint64_t size
        int64_t mtime_ns
        uint64_t inode
        uint64_t device

    cdef cppclass CDiskStats "prefetch::DiskStats":
        uint64_t reads
        uint64_t bytes
        uint64_t span_bytes
        uint64_t errors
        uint64_t cancelled
        uint64_t direct_reads
        uint64_t buffered_reads
        double busy_seconds
        uint64_t queued
        uint64_t in_progress
        uint64_t open_files

    cdef cppclass CDiskReader "prefetch::DiskReader":
        CDiskReader(
            int threads, cbool direct_io, CDiskFaultOptions faults
        ) except +prefetch_raise_py_error
        int OpenFile(const string& path) except +prefetch_raise_py_error
        void CloseFile(int file) except +prefetch_raise_py_error
        CDiskFileInfo FileInfo(int file) except +prefetch_raise_py_error
        size_t RequiredCapacity(
            int file, uint64_t offset, uint64_t length
        ) except +prefetch_raise_py_error
        uint64_t Submit(
            int file, uint64_t offset, uint64_t length, void* dest, size_t capacity
        ) except +prefetch_raise_py_error
        size_t Wait(uint64_t ticket, double timeout_s) except +prefetch_raise_py_error
        cbool Poll(uint64_t ticket) except +prefetch_raise_py_error
        cbool Cancel(uint64_t ticket) except +prefetch_raise_py_error
        void Close()
        cbool closed() except +prefetch_raise_py_error
        CDiskStats GetStats() except +prefetch_raise_py_error


# This extension has its own copy of the translator's table: register
# prefetch.errors' classes in it too (Note in prefetch/_errors.h).
for _kind, _cls in enumerate(_errors.BY_KIND):
    prefetch_set_error_type(_kind, _cls)

# O_DIRECT's alignment when the filesystem does not report one.
DEFAULT_DIRECT_ALIGNMENT = kDefaultDirectAlignment
FAULT_SETTINGS = ("fail_every_nth_read", "short_every_nth_read", "refuse_direct_io",
                  "read_delay_us")
_PY_BOOL = type(True)
_U64_MAX = 0xFFFFFFFFFFFFFFFF


cdef object _count(str name, object value, object high=_U64_MAX, object low=0):
    """`value` as an int in low..high: bools, floats and strings are refused."""
    if type(value) is _PY_BOOL or isinstance(value, np.bool_):
        raise TypeError(f"{name} must be an int, got a bool ({value!r})")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if number < low or number > high:
        raise InvalidArgumentError(f"{name} must be in {low}..{high}, got {number}")
    return number


cdef double _timeout(object timeout) except? -2.0:
    """-1 (no limit) for None, else a finite number of seconds >= 0."""
    if timeout is None:
        return -1.0
    if type(timeout) is _PY_BOOL:
        raise TypeError("timeout must be None or a number of seconds")
    seconds = float(timeout)
    if not 0 <= seconds < float("inf"):
        raise InvalidArgumentError(
            f"timeout must be None or a finite number of seconds >= 0, got {timeout!r}")
    return seconds


cdef object _byte_array(object out):
    """`out` as a writable C-contiguous uint8 numpy array sharing its memory
    (a numpy array, a CPU torch tensor, pinned or not, or any writable
    buffer such as a bytearray); nothing is ever copied."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(out, torch.Tensor):
        if out.device.type != "cpu":
            raise InvalidArgumentError(f"out must be a CPU tensor, got one on {out.device}")
        if out.dtype != torch.uint8 or not out.is_contiguous():
            raise InvalidArgumentError(
                f"out must be a contiguous uint8 tensor, got {out.dtype}"
                f"{'' if out.is_contiguous() else ' (not contiguous)'}")
        arr = out.detach().numpy()
    elif isinstance(out, np.ndarray):
        arr = out
    else:
        try:
            arr = np.asarray(memoryview(out))
        except TypeError:
            raise TypeError("out must be a writable contiguous uint8 buffer (a numpy array, a CPU "
                            f"torch tensor, a bytearray), got {type(out).__name__}") from None
    if arr.dtype != np.uint8 or not arr.flags.c_contiguous or not arr.flags.writeable:
        raise InvalidArgumentError(
            "out must be a writable contiguous uint8 buffer, got "
            f"{'a read-only ' if not arr.flags.writeable else ''}{arr.dtype} "
            f"{'' if arr.flags.c_contiguous else 'non-contiguous '}{type(out).__name__}")
    return arr.reshape(-1)


def aligned_empty(nbytes, alignment=DEFAULT_DIRECT_ALIGNMENT):
    """A 1-D uint8 numpy array of `nbytes` (uninitialised) whose first byte's
    address is a multiple of `alignment` (a power of two), when nbytes > 0:
    a destination for O_DIRECT reads. It is not page-locked; a page-locked
    one for the GPU is a slice of ``torch.empty(n + alignment,
    dtype=torch.uint8, pin_memory=True)`` starting at an aligned address."""
    n = _count("nbytes", nbytes)
    a = _count("alignment", alignment, 1 << 30)
    if a == 0 or a & (a - 1):
        raise InvalidArgumentError(f"alignment must be a power of two, got {a}")
    raw = np.empty(n + a, dtype=np.uint8)
    skip = (-raw.ctypes.data) % a
    return raw[skip:skip + n]


@cython.no_gc_clear  # the buffers must outlive Close in __dealloc__
cdef class DiskReader:
    """DiskReader(threads=4, direct_io=True, *, faults=None)
    --

    A fixed pool of `threads` reader threads that read byte ranges of files
    into buffers the caller owns. With `direct_io`, files are opened with
    O_DIRECT (bypassing the page cache), or buffered where the filesystem
    refuses it (``file_info(f)["direct"]`` says which). A read of a direct
    file covers its range widened to the file's alignment, so the
    destination must be aligned (``aligned_empty``) and hold
    ``capacity(f, offset, length)`` bytes; ``wait`` returns where the
    requested bytes start in it. Faults (EIO, a short read, a file changed,
    replaced or removed since it was opened) raise DiskReadError on the
    read they hit; the other reads go on (Note [Disk reads] in
    src_cpp/disk_reader.h).

    faults: tests only, a dict of fail_every_nth_read (the Nth read fails
    with EIO), short_every_nth_read (the Nth read meets end of file
    halfway), refuse_direct_io (1: O_DIRECT opens fail with EINVAL, as on a
    filesystem without it) and read_delay_us (a sleep before each read).
    """
    cdef unique_ptr[CDiskReader] _reader
    cdef dict _buffers  # ticket -> (out, its array): alive while a read may write
    cdef readonly int threads
    cdef readonly bint direct_io
    cdef long _pid  # the reader's process: Note [A handle in a forked child] (_handle_base.pxi)

    def __init__(self, threads=4, direct_io=True, *, faults=None):
        cdef CDiskFaultOptions options
        if self._reader and self._pid != getpid():  # inherited by a forked child: left unfreed
            self._reader.release()
        if self._reader:  # __init__ again: the old reader stops first
            with nogil:
                self._reader.reset()
        self._buffers = {}
        self.threads = _count("threads", threads, kMaxDiskReaderThreads, 1)
        if type(direct_io) is not _PY_BOOL and not isinstance(direct_io, np.bool_):
            raise TypeError(f"direct_io must be True or False, got {direct_io!r}")
        self.direct_io = bool(direct_io)
        settings = dict.fromkeys(FAULT_SETTINGS, 0)
        for key, value in (faults or {}).items():
            if key not in settings:
                raise InvalidArgumentError(
                    f"unknown fault setting {key!r} (known: {', '.join(FAULT_SETTINGS)})")
            settings[key] = _count(key, value, (1 << 63) - 1)
        options.fail_every_nth_read = settings["fail_every_nth_read"]
        options.short_every_nth_read = settings["short_every_nth_read"]
        options.refuse_direct_io = settings["refuse_direct_io"]
        options.read_delay_us = settings["read_delay_us"]
        cdef int n = self.threads
        cdef cbool direct = self.direct_io
        with nogil:
            self._reader.reset(new CDiskReader(n, direct, options))
        self._pid = getpid()

    cdef CDiskReader* _get(self) except NULL:
        if not self._reader:
            raise HandleClosedError("DiskReader was not initialised (__init__ did not run)")
        return self._reader.get()

    def __dealloc__(self):
        # Close waits for reads in progress, before the buffers are released.
        # In a forked child the reader is left unfreed: its threads live in
        # the parent only, and destroying it waited on them for good (Note
        # [A handle in a forked child] in _handle_base.pxi).
        if self._reader and self._pid != getpid():
            self._reader.release()
        elif self._reader:
            with nogil:
                self._reader.reset()

    def open(self, path):
        """Opens a file (str, bytes or os.PathLike) and returns its index.
        A missing file raises DiskReadError (errno ENOENT) naming it."""
        cdef string p = os.fsencode(os.fspath(path))
        cdef int index
        cdef CDiskReader* r = self._get()
        with nogil:
            index = r.OpenFile(p)
        return index

    def close_file(self, file):
        """Forgets a file index; its descriptor closes once its queued reads
        are done."""
        cdef int f = _count("file", file, (1 << 31) - 1)
        cdef CDiskReader* r = self._get()
        with nogil:
            r.CloseFile(f)

    def file_info(self, file):
        """The file as it was opened: a dict of path, direct (O_DIRECT or
        buffered), alignment (1 when buffered), size, mtime_ns, inode,
        device."""
        cdef int f = _count("file", file, (1 << 31) - 1)
        cdef CDiskFileInfo info
        cdef CDiskReader* r = self._get()
        with nogil:
            info = r.FileInfo(f)
        return {"path": os.fsdecode(bytes(info.path)), "direct": info.direct,
                "alignment": info.alignment, "size": info.size, "mtime_ns": info.mtime_ns,
                "inode": info.inode, "device": info.device}

    def capacity(self, file, offset, length):
        """Bytes of destination a read of [offset, offset + length) needs:
        its span aligned to the file's alignment (`length` when buffered)."""
        cdef int f = _count("file", file, (1 << 31) - 1)
        cdef uint64_t off = _count("offset", offset), n = _count("length", length)
        cdef size_t cap
        cdef CDiskReader* r = self._get()
        with nogil:
            cap = r.RequiredCapacity(f, off, n)
        return cap

    def read_into(self, file, offset, length, out):
        """Queues a read of `length` bytes at `offset` of `file` into `out` (a
        writable contiguous uint8 numpy array or CPU torch tensor, aligned
        for a direct file, of at least ``capacity(...)`` bytes) and returns
        its ticket. The reader keeps `out` alive until the ticket is waited
        for or cancelled, or the reader closed. Bad arguments raise and
        queue nothing."""
        cdef int f = _count("file", file, (1 << 31) - 1)
        cdef uint64_t off = _count("offset", offset), n = _count("length", length)
        arr = _byte_array(out)
        cdef uintptr_t dest = arr.ctypes.data
        cdef size_t cap = arr.nbytes
        cdef uint64_t ticket
        cdef CDiskReader* r = self._get()
        with nogil:
            ticket = r.Submit(f, off, n, <void*>dest, cap)
        self._buffers[ticket] = (out, arr)
        return ticket

    def wait(self, ticket, timeout=None):
        """Waits for a read and returns where its bytes start in its `out`.
        Raises the read's DiskReadError, HandleClosedError if close dropped
        it, AcquireTimeoutError after `timeout` seconds (the ticket stays
        pending), UnknownIdError for a ticket not pending. The ticket is
        forgotten unless the wait timed out."""
        cdef uint64_t t = _count("ticket", ticket)
        cdef double seconds = _timeout(timeout)
        cdef size_t start
        cdef CDiskReader* r = self._get()
        try:
            with nogil:
                start = r.Wait(t, seconds)
        except AcquireTimeoutError:
            raise
        except BaseException:
            self._buffers.pop(t, None)
            raise
        self._buffers.pop(t, None)
        return start

    def poll(self, ticket):
        """True when the read has finished (``wait`` will not block)."""
        cdef uint64_t t = _count("ticket", ticket)
        cdef CDiskReader* r = self._get()
        cdef cbool done
        with nogil:
            done = r.Poll(t)
        return bool(done)

    def cancel(self, ticket):
        """Drops a read and forgets its ticket: True if it had not started,
        False if it had (a read in progress is waited for, so `out` is free
        when this returns) or had finished. Its result is discarded."""
        cdef uint64_t t = _count("ticket", ticket)
        cdef cbool dropped
        cdef CDiskReader* r = self._get()
        with nogil:
            dropped = r.Cancel(t)
        self._buffers.pop(t, None)
        return dropped

    def stats(self):
        """Counters: reads (succeeded), bytes (requested bytes they
        delivered), span_bytes (bytes read, aligned spans), errors, cancelled
        (dropped before they ran, or discarded while running), direct_reads
        and buffered_reads (successful reads by how the file was opened),
        busy_seconds (reader-thread time spent reading), queued and
        in_progress (now), open_files."""
        cdef CDiskStats s
        cdef CDiskReader* r = self._get()
        with nogil:
            s = r.GetStats()
        return {"reads": s.reads, "bytes": s.bytes, "span_bytes": s.span_bytes,
                "errors": s.errors, "cancelled": s.cancelled, "direct_reads": s.direct_reads,
                "buffered_reads": s.buffered_reads, "busy_seconds": s.busy_seconds,
                "queued": s.queued, "in_progress": s.in_progress, "open_files": s.open_files}

    def close(self):
        """Cancels queued reads (their wait raises HandleClosedError), waits
        for reads in progress, stops the threads and closes the files.
        Idempotent; later open and read_into raise HandleClosedError."""
        cdef CDiskReader* r = self._get()
        with nogil:
            r.Close()
        self._buffers.clear()

    @property
    def closed(self):
        """True once close() has been called."""
        cdef CDiskReader* r = self._get()
        cdef cbool done
        with nogil:
            done = r.closed()
        return done

    def read(self, path_or_file, offset, length, timeout=None):
        """The bytes [offset, offset + length) of a path (opened and closed
        here) or an open file index, as bytes: one read_into and wait."""
        own = not isinstance(path_or_file, (int, np.integer)) or type(path_or_file) is _PY_BOOL
        file = self.open(path_or_file) if own else path_or_file
        try:
            buf = aligned_empty(self.capacity(file, offset, length),
                                max(self.file_info(file)["alignment"], DEFAULT_DIRECT_ALIGNMENT))
            ticket = self.read_into(file, offset, length, buf)
            try:
                start = self.wait(ticket, timeout)
            except AcquireTimeoutError:
                self.cancel(ticket)
                raise
            return buf[start:start + length].tobytes()
        finally:
            if own and not self.closed:
                self.close_file(file)

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return (f"DiskReader(threads={self.threads}, direct_io={self.direct_io}) "
                f"[{state}]")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
