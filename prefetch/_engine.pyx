# cython: language_level=3
"""PrefetchHandle: the Python face of the C++ ArcherPrefetchHandle engine.

The hot call is ``prefetch_tensors``: all Python work (type checks and the
conversion to a contiguous int64 array) happens first, then one ``with
nogil:`` call hands a typed memoryview to the engine, which validates every
id, takes its lock once and queues them.
"""
import builtins
import operator
import os
import warnings

import numpy as np

from prefetch import errors as _errors
from prefetch.errors import HandleClosedError, InvalidArgumentError

cimport cython
from cython.operator cimport dereference as deref
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libcpp.memory cimport make_shared, shared_ptr, unique_ptr
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.utility cimport move
from libcpp.vector cimport vector
from libc.math cimport INFINITY
from posix.unistd cimport getpid

from prefetch._engine cimport (
    CArcherPrefetchHandle,
    CCopyBackend,
    CDiskExtent,
    CFaultConfig,
    CHandleOptions,
    CHostPart,
    CSlotInfo,
    CStats,
    CStepArgs,
    MakeBackend,
    MakeFaultBackend,
    kNoStream,
    kDefaultPrefetchBand,
    kMaxCopyLanes,
    kMaxCopyPollUs,
    kMaxDevices,
    kMaxHandleReaderThreads,
    kMaxTensorId,
    kNoNextUse,
    kNumBands,
    kSlotAlignmentBytes,
)

NUM_BANDS = kNumBands
DEFAULT_PRIORITY = kDefaultPrefetchBand
MAX_TENSOR_ID = kMaxTensorId
DEFAULT_ACQUIRE_TIMEOUT_S = 60.0
NO_NEXT_USE = kNoNextUse  # hint_next_use: no known next read
# Cache slots start and end on this boundary (so do packed weights, arenas
# and prefetch.hf_experts' row grid).
SLOT_ALIGNMENT = kSlotAlignmentBytes

# Argument conversion: ids, bands, buffers, streams, timeouts, hint times, options.
include "_conversions.pxi"
# The constructor's work: budgets, limits, the backend, the arenas.
include "_handle_setup.pxi"
# What the calls share: streams per device, exchange's arguments, slot tables.
include "_handle_calls.pxi"
# PrefetchHandle's base: its fields, control, inspection and test hooks.
include "_handle_base.pxi"
# Between the two: registration (host bytes, caller memory, disk extents).
include "_handle_registry.pxi"
# The sync-free decode path's per-step bookkeeping (prefetch/offload/sync_free.py).
include "_routing.pxi"


# Engine errors raise prefetch.errors' classes (Note in prefetch/_errors.h).
for _kind, _cls in enumerate(_errors.BY_KIND):
    prefetch_set_error_type(_kind, _cls)


cdef class PrefetchHandle(_HandleRegistry):
    """PrefetchHandle(*, device_budget_bytes, backend='auto', num_devices=None,
        eviction_policy='lru', cycle_acquires=0, copy_chunk_bytes=4194304,
        max_bytes_in_flight=268435456, max_speculative_bytes_in_flight=None,
        copy_lanes=2, copy_poll_us=20, start_paused=False,
        poison_freed_slots=False, host_budget_bytes=0, disk_direct_io=True, disk_reader_threads=2,
        faults=None, debug_issue_delay_us=0)
--

    An expert prefetch engine: a registry of host tensors and, per device,
    a cache arena, a priority queue and a copy worker.

    Every constructor option is keyword-only:

    device_budget_bytes (required)
        Cache size in bytes: one int for every device, or a list with one int
        per device (each at least SLOT_ALIGNMENT, 256). Each device's arena of that size is
        taken once (on CUDA from torch's allocator). A tensor larger than its
        device's budget cannot be registered.
    backend="auto"
        "host" (the cache is a host arena, copies are memcpy; runs anywhere),
        "cuda" (the driver is loaded at run time from libcuda.so.1), or
        "auto" (CUDA when the driver and a device are present, else host).
        "fault" is the host backend with injectable faults, for tests
        (``faults={...}``, see ``set_faults``).
    num_devices=None
        How many devices get a cache when ``device_budget_bytes`` is one int
        (None: 1). With a list of budgets it may be omitted; if given it must
        equal the list's length. More devices than the backend has is a
        ValueError.
    eviction_policy="lru"
        Which resident entry makes room: "lru" (least recently used first),
        "cyclic" (for decode loops that acquire once per layer in a fixed
        order: the most recently used entry goes first, prefetched entries
        not yet acquired last, unless 8 acquire calls passed them by; Note
        [Cyclic eviction] in src_cpp/eviction_policy.h), "next-use" (Belady's
        rule fed by ``hint_next_use``: entries never hinted first, least
        recently used first, then hints whose time has passed, then the
        farthest next use first; Note [Next-use eviction]) or "decay" (the
        least used first, each use weighted down over about 16 decode
        steps; prefetched entries not yet acquired last, as under
        "cyclic"; Note [Decayed-frequency eviction] in
        src_cpp/decay_policy.h). On real routing traces "decay" hits most
        at 10 and 25 % of the experts cached (docs/benchmarks.md, "Eviction
        policies on real routing").
    cycle_acquires=0
        "cyclic" and "decay": acquire calls per decode step (the MoE layer
        count; offload_moe_experts sets it). Under "cyclic" an acquired
        entry not used within the last cycle is out of the loop's working
        set and goes first, least recently used first; "decay" counts its
        time constant in steps of this many calls. 0: unknown (plain cyclic
        order; "decay" counts one call a step).
    copy_chunk_bytes=4 MiB
        Prefetch copies are issued in pieces of at most this many bytes;
        between the pieces the worker copies any on-demand (band 0) work
        first, so an acquire overtakes a long low-priority copy. An
        on-demand copy goes whole (Note [Whole on-demand copies]).
    max_bytes_in_flight=256 MiB
        Asynchronous (CUDA) backends: bytes of issued copies not yet
        finished, at most (one entry larger than this still goes alone).
        The worker waits for the oldest copy before issuing past it.
    max_speculative_bytes_in_flight=None
        Asynchronous backends: bytes of prefetch (band > 0) copies in flight
        at most, so an on-demand copy queues behind little speculation; no
        prefetch copy starts while an on-demand one is in flight (Note
        [Speculation never hurts]). Counted by chunk: a prefetch larger than
        this is issued a chunk at a time (Note [Speculation in chunks]).
        None: 2 x copy_chunk_bytes, raised a chunk at a time up to 4 x
        copy_chunk_bytes while the copy worker wakes too late to keep the
        link busy, and lowered again once it keeps up (Note [A cap that
        follows the worker's wake-ups]; stats' spec_underruns and
        speculative_cap_bytes). A number: that cap, fixed.
    copy_lanes=2
        Copy streams per device for prefetches (1..8): entries alternate
        between them, which lifts small copies closer to full bandwidth on
        CUDA; on-demand copies have a stream of their own, of the highest
        priority. The host backend copies with memcpy on its worker thread
        whatever this says.
    copy_poll_us=20
        Asynchronous backends: how a copy worker waits for its copies in
        flight (0..100000). It asks whether the copy is done every this many
        microseconds and sleeps in between; 0 blocks in the backend's wait
        instead, which on CUDA spins a CPU core inside the driver and slows
        the serving thread beside it (Note [Polite waits]).
    start_paused=False
        True: the workers start paused and copy nothing until ``resume()``
        (benchmarks and tests fill the queue first).
    poison_freed_slots=False
        True: every freed cache slot is filled with 0xDB, so a reader of
        stale bytes sees them (debugging).
    host_budget_bytes=0
        The host tier of disk-backed tensors (``register_disk``; Note [Host
        tier]): a page-locked arena of this many bytes (0: none) staging
        them between disk and device, with its own LRU eviction.
    disk_direct_io=True
        Open ``open_file``'s files with O_DIRECT (bypassing the page cache)
        where the filesystem takes it; buffered otherwise, or with False.
    disk_reader_threads=2
        With a host tier: threads (1..64) reading the most urgent queued
        disk-backed tensors into it while the workers copy those read.

    Tests only: ``faults`` (a dict for backend="fault") and
    ``debug_issue_delay_us`` (a sleep inside the batched call).
    Bad options raise TypeError or ValueError naming the option; nothing is
    allocated then.
    """

    def __init__(
        self,
        *,
        device_budget_bytes,
        backend="auto",
        num_devices=None,
        eviction_policy="lru",
        cycle_acquires=0,
        copy_chunk_bytes=4 << 20,
        max_bytes_in_flight=256 << 20,
        max_speculative_bytes_in_flight=None,
        copy_lanes=2,
        copy_poll_us=20,
        start_paused=False,
        poison_freed_slots=False,
        host_budget_bytes=0,
        disk_direct_io=True,
        disk_reader_threads=2,
        faults=None,
        debug_issue_delay_us=0,
    ):
        """Builds the engine; the options are described on the class."""
        if self._c != NULL:
            raise RuntimeError("PrefetchHandle is already initialised")
        if not isinstance(backend, str):
            raise TypeError(
                f"backend must be 'host', 'cuda' or 'auto', got {type(backend).__name__}"
            )
        if not isinstance(eviction_policy, str):
            raise TypeError(
                "eviction_policy must be 'lru', 'cyclic', 'next-use' or 'decay', "
                f"got {type(eviction_policy).__name__}"
            )
        budgets = _device_budgets(device_budget_bytes, num_devices)
        cdef CHandleOptions options
        _check_limits(options, cycle_acquires, copy_chunk_bytes, max_bytes_in_flight,
                      max_speculative_bytes_in_flight, copy_lanes, start_paused,
                      poison_freed_slots, debug_issue_delay_us)
        options.copy_poll_us = _int_option("copy_poll_us", copy_poll_us, 0, kMaxCopyPollUs)
        options.host_budget_bytes = _int_option(
            "host_budget_bytes", host_budget_bytes, 0, _INT64_MAX)
        options.disk_direct_io = _flag_option("disk_direct_io", disk_direct_io)
        options.disk_reader_threads = _int_option("disk_reader_threads", disk_reader_threads, 1,
                                                  kMaxHandleReaderThreads)
        if faults is not None and not isinstance(faults, dict):
            raise TypeError("faults must be a dict of setting -> int")
        cdef unique_ptr[CCopyBackend] cbackend
        name = _make_backend(backend, faults, len(budgets), self._faults, cbackend)
        arenas = _make_arenas(name, budgets, options)
        options.eviction_policy = eviction_policy.encode()
        options.debug_issue_delay_ns = int(debug_issue_delay_us * 1000)
        self._owner.reset(new CArcherPrefetchHandle(options, move(cbackend)))
        self._c = self._owner.get()
        self._pid = getpid()
        self._arenas = arenas
        self._external = {}
        self.backend = name
        self.eviction_policy = eviction_policy
        self.num_devices = len(budgets)
        self._closed = False

    # ------------------------------------------------------------ prefetch

    def prefetch_tensors(self, tensor_ids, priority=DEFAULT_PRIORITY):
        """Queues every id at `priority` (0 most urgent .. 19) in one engine
        call with the GIL released. All-or-nothing: one unknown id raises
        KeyError and nothing is queued. Empty input is a no-op."""
        self._check_open()
        cdef int band = _as_priority(priority)
        cdef const int64_t[::1] ids = as_id_array(tensor_ids)
        cdef size_t n = ids.shape[0]
        if n == 0:
            return
        with nogil:
            self._c.EnqueuePrefetchTensors(&ids[0], n, band)

    def enqueue_prefetch(self, tensor_id, priority=DEFAULT_PRIORITY):
        """Queues one id (the per-expert path)."""
        self._check_open()
        cdef int band = _as_priority(priority)
        cdef int64_t tid = _as_single_id(tensor_id)
        with nogil:
            self._c.EnqueuePrefetch(tid, band)

    cdef size_t _drop(self, tensor_ids, bint evict) except? 0:
        """cancel (evict False) or evict of `tensor_ids`: one GIL-free call;
        returns how many ids it dropped."""
        self._check_open()
        cdef const int64_t[::1] ids = as_id_array(tensor_ids)
        cdef size_t n = ids.shape[0]
        cdef size_t dropped = 0
        if n == 0:
            return 0
        with nogil:
            if evict:
                dropped = self._c.Evict(&ids[0], n)
            else:
                dropped = self._c.Cancel(&ids[0], n)
        return dropped

    def cancel(self, tensor_ids):
        """Removes queued ids (not copying or resident ones, and not ids an
        acquirer waits for). Returns how many were removed."""
        return self._drop(tensor_ids, False)

    def cancel_at_or_below(self, priority=None, *, band=None):
        """Removes every queued id at `priority` or less urgent (priority >=
        `priority`). Returns how many were removed. (``cancel_below`` is the
        same call, under its first name.) ``band=`` is the old name of
        ``priority`` (Note [priority, formerly band])."""
        self._check_open()
        cdef int b = _priority_arg(priority, band, "cancel_at_or_below")
        cdef size_t removed = 0
        with nogil:
            removed = self._c.CancelAtOrBelow(b)
        return removed

    def cancel_below(self, priority=None, *, band=None):
        """The same as ``cancel_at_or_below`` (this priority included)."""
        return self.cancel_at_or_below(priority, band=band)

    def cancel_all(self):
        """Empties the queue (ids acquirers wait for stay)."""
        return self.cancel_below(0)

    def evict(self, tensor_ids):
        """Drops resident ids from the cache (not acquired ones, nor ones a
        stream still reads). Returns how many were evicted."""
        return self._drop(tensor_ids, True)

    def hint_next_use(self, tensor_ids, when, *, now=None):
        """Says when each id will next be read, on the caller's own clock
        (any count that only grows, e.g. MoE layers routed so far): ``when``
        is one time for all ids, a sequence of times (one per id), or None
        (no known next use; NO_NEXT_USE = 2**63 - 1 says the same for one id
        of a sequence). ``now``, if given, moves the clock; a hint whose
        time is before the clock has expired (evicted before valid ones).
        Only the "next-use" eviction policy reads hints (Note [Next-use
        eviction] in src_cpp/eviction_policy.h); the others keep them. Unknown
        ids, negative times or a clock that goes back raise and change
        nothing."""
        self._check_open()
        cdef const int64_t[::1] ids = as_id_array(tensor_ids)
        cdef size_t n = ids.shape[0]
        cdef const int64_t[::1] ctimes = _hint_times(when, n, "when", "tensor ids")
        cdef bint set_now = now is not None
        cdef int64_t cnow = _as_clock(now) if set_now else 0
        if n == 0:
            if set_now:
                self._c.HintNextUse(NULL, NULL, 0, cnow, True)
            return
        with nogil:
            self._c.HintNextUse(&ids[0], &ctimes[0], n, cnow, set_now)

    def hint_clock(self):
        """The clock ``hint_next_use(now=...)`` last set; None before any."""
        self._check_open()
        cdef int64_t now
        with nogil:
            now = self._c.HintClock()
        return None if now == -_INT64_MAX - 1 else now

    # ----------------------------------------------------- acquire/release

    def acquire(self, tensor_ids, *, stream=None,
                timeout=DEFAULT_ACQUIRE_TIMEOUT_S):
        """Waits until every id is in its device cache, pins it, and returns
        one uint8 view per id into the cache (numpy for the host backend,
        torch for CUDA). A missing id is fetched on demand (band 0).

        With ``stream`` (a torch.cuda.Stream, a raw handle, or a dict device
        -> stream) on the CUDA backend, a copy still in flight is waited for
        on the GPU: that stream waits, the CPU does not. Without one, the CPU
        waits until the bytes have arrived. The host backend has no streams:
        a stream there raises ValueError (and nothing is pinned). Raises
        TimeoutError after ``timeout`` seconds (one past about 31 years is
        taken as that: a wait meant as forever), with nothing left pinned.
        The ids are copied before the wait: the caller's array may change
        meanwhile. Views stay valid until release."""
        self._check_open()
        cdef const int64_t[::1] ids = as_id_array(tensor_ids)
        cdef size_t n = ids.shape[0]
        if n == 0:
            return []
        cdef vector[CSlotInfo] slots
        self._acquire_into(ids, stream, timeout, slots)
        views = []
        cdef size_t i
        for i in range(n):
            arena = self._arenas[slots[i].device]
            start = slots[i].offset
            views.append(arena[start:start + slots[i].bytes])
        return views

    def acquire_slots(self, tensor_ids, *, stream=None,
                      timeout=DEFAULT_ACQUIRE_TIMEOUT_S):
        """``acquire`` without building views: returns an int64 array of
        shape (n, 2), the byte offset of each id's slot in ``arena(device)``
        and that device. For callers that keep their own views of the arena
        (ExpertPrefetcher reuses an expert's views while its slot is the
        same). Same waits, pins and errors as ``acquire``."""
        self._check_open()
        cdef const int64_t[::1] ids = as_id_array(tensor_ids)
        cdef size_t n = ids.shape[0]
        out = np.empty((n, 2), dtype=np.int64)
        if n == 0:
            return out
        cdef vector[CSlotInfo] slots
        self._acquire_into(ids, stream, timeout, slots)
        _fill_slot_table(out, slots)
        return out

    cdef int _acquire_into(self, const int64_t[::1] ids, object stream,
                           object timeout, vector[CSlotInfo]& slots) except -1:
        cdef size_t n = ids.shape[0]
        cdef vector[uintptr_t] streams = self._streams(stream, False)
        cdef double ctimeout = _as_timeout(timeout)
        # Note [Ids copied for a wait]: the engine looks the ids up again
        # each time the wait wakes, without the GIL; the caller's array
        # (taken without a copy) could change meanwhile from another
        # thread (a reused routing buffer), and an id that turned unknown
        # crashed the process. The wait reads this copy instead.
        cdef vector[int64_t] own
        own.assign(&ids[0], &ids[0] + n)
        slots.resize(n)
        with nogil:
            self._c.Acquire(
                own.data(), n, streams.data(), ctimeout, slots.data()
            )
        return 0

    def exchange(self, acquire=None, *, release=None, prefetch=None,
                 priority=_DEFAULT_PRIORITY_ARG, cancel=None, hint_ids=None,
                 hint_when=None, now=None, stream=None,
                 timeout=DEFAULT_ACQUIRE_TIMEOUT_S, pin=None, pin_into=None,
                 use=None, band=None):
        """One MoE layer's exchange with the engine in one GIL-free call, in
        this order: ``release`` (ids a previous acquire took; their slots
        are reused only after the work queued so far on ``stream`` -
        default torch's current stream on CUDA), ``cancel`` (queued guesses
        to drop), hints (``hint_ids`` read next at ``hint_when``, and the
        hint clock moved to ``now``: see ``hint_next_use``), ``acquire``
        (as ``acquire_slots``) and ``prefetch`` (queued at ``priority``,
        DEFAULT_PRIORITY when left out). Every argument is checked before
        anything changes (unknown ids, releases without an acquire, bad
        hints, an acquire that can never fit: nothing happens); after that
        a failing acquire (timeout, copy error) leaves the release, cancel,
        hints, pins and uses done (release the pins), and the prefetches
        not queued. A prefetch id that another thread unregisters while the
        acquire waits is dropped (``stats()["prefetches_gone"]``); the
        others are queued. Returns the (n, 2) int64 array of (offset,
        device) for ``acquire``.

        ``pin`` (with ``pin_into``, a writable int64 array of the same
        length) pins those ids that are resident, without waiting, fetching
        or counting a use, and writes each one's slot offset into
        ``pin_into`` (-1: not resident, not pinned); a copy issued but not
        complete is waited for on ``stream`` (on the GPU). Pinned ids are
        released like acquired ones. ``use`` reports ids read since (an id
        not resident counts as used when its copy lands). Both run after
        the hints and before ``acquire`` (Note [Pins without waiting]).

        ``band=`` is the old name of ``priority`` (Note [priority, formerly
        band]), and ``step`` the old name of this call: both still work,
        and go in a later release."""
        self._check_open()
        cdef CStepArgs args
        # The id views, arrays and pin_into's view live until Step returns:
        # args points into them.
        cdef const int64_t[::1] _rel, _can, _use
        cdef int64_t[::1] _pin_out
        cdef vector[uintptr_t] streams
        cdef vector[uintptr_t] release_streams
        cdef vector[CSlotInfo] slots  # local: another thread may call too
        # Note [Ids copied for a wait]: the acquire's and the prefetches' ids
        # are read again after the wait (and with the lock dropped): copies.
        cdef vector[int64_t] own_acq, own_pre
        args.prefetch_band = _priority_arg(priority, band, "exchange")
        args.timeout_s = _as_timeout(timeout)
        if release is not None:
            _rel = _step_ids(release, &args.release_ids, &args.n_release)
        if cancel is not None:
            _can = _step_ids(cancel, &args.cancel_ids, &args.n_cancel)
        _hints = _step_hints(hint_ids, hint_when, args)
        if now is not None:
            args.now = _as_clock(now)
            args.set_now = True
        if acquire is not None:
            _own_ids(acquire, own_acq, &args.acquire_ids, &args.n_acquire)
        out = np.empty((args.n_acquire, 2), dtype=np.int64)
        if args.n_acquire > 0:
            slots.resize(args.n_acquire)
            args.slots = slots.data()
        if prefetch is not None:
            _own_ids(prefetch, own_pre, &args.prefetch_ids, &args.n_prefetch)
        pin_ids = None if pin is None else as_id_array(pin)
        _pin_out = _step_pins(pin_ids, pin_into, args)
        if use is not None:
            _use = _step_ids(use, &args.use_ids, &args.n_use)
        _step_streams(self.backend, self.num_devices, stream, args, streams, release_streams)
        with nogil:
            self._c.Step(args)
        _fill_slot_table(out, slots)
        return out

    # The name ``exchange`` had before it (a decode step is many layers'
    # exchanges): the same function, no cost to call through; it goes in a
    # later release.
    step = exchange

    def release(self, tensor_ids, *, stream=None):
        """Unpins ids taken by acquire. On the CUDA backend the slot is not
        reused until the work queued so far on ``stream`` (default: torch's
        current stream of the id's device) has finished. The host backend
        takes no stream (ValueError; the ids stay acquired).
        Releasing an id that is not acquired raises RuntimeError and changes
        nothing."""
        self._check_open()
        cdef const int64_t[::1] ids = as_id_array(tensor_ids)
        cdef size_t n = ids.shape[0]
        if n == 0:
            return
        cdef vector[uintptr_t] streams = self._streams(stream, True)
        with nogil:
            self._c.Release(&ids[0], n, streams.data())

    # ----------------------------------------------------------- lifecycle

    @property
    def closed(self):
        """True after close() (or if the constructor failed)."""
        return self._closed

    def close(self):
        """Cancels queued copies, wakes waiting acquirers with an error and
        joins the workers. Idempotent; every other call raises afterwards."""
        if self._closed or self._c == NULL:
            return
        self._closed = True
        with nogil:
            self._c.Close()
        self._external.clear()  # the workers are joined: nothing reads them

    def __enter__(self):
        self._check_open()
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __repr__(self):
        state = "closed" if self._closed else "open"
        return (
            f"<PrefetchHandle backend={self.backend!r} "
            f"devices={self.num_devices} {state}>"
        )
