# Included by _engine.pyx: _HandleBase, the root of PrefetchHandle's classes
# (_HandleBase -> _HandleRegistry -> PrefetchHandle, each with only that
# subclass) - the handle's fields, control (pause, resume), inspection
# (arena, queued, resident, budget_bytes, stats, last_batch_ns) and the
# fault backend's and tests' hooks. _HandleRegistry (_handle_registry.pxi)
# adds registration; PrefetchHandle (_engine.pyx) adds construction, the
# data path and the lifecycle (close, with, repr).


cdef class _HandleBase:
    """The fields, control and inspection calls of PrefetchHandle, through
    _HandleRegistry (see PrefetchHandle's docstring); not for use on its own."""

    cdef unique_ptr[CArcherPrefetchHandle] _owner
    cdef shared_ptr[CFaultConfig] _faults
    cdef CArcherPrefetchHandle* _c
    cdef list _arenas
    cdef dict _external  # id -> caller object kept alive for register_external
    cdef readonly str backend
    cdef readonly str eviction_policy
    cdef readonly int num_devices
    cdef bint _closed
    cdef long _pid  # the process that made the engine (Note [A handle in a forked child])

    def __cinit__(self, *args, **kwargs):
        # Fields only: __init__ (whose signature help() and inspect show)
        # does the work. Positional arguments are caught here to name them.
        self._c = NULL
        self._closed = True
        self._arenas = []
        self._external = {}
        self.num_devices = 0
        if args:
            first = repr(args[0]) if len(args) == 1 else "..."
            raise TypeError(
                f"PrefetchHandle takes keyword arguments only, got {len(args)} "
                f"positional: write PrefetchHandle(device_budget_bytes={first}, ...)"
            )

    def __dealloc__(self):
        # The unique_ptr's destructor runs Close(), which is bounded and
        # idempotent; except in a forked child.
        #
        # Note [A handle in a forked child]
        # A child made by fork() has the parent's memory but none of its
        # threads. Every engine call there raises (CheckNotForked) and Close
        # touches nothing, yet destroying the engine still destroyed its
        # members, and glibc's pthread_cond_destroy waits for the waiters
        # it has recorded on a condition variable: the parent's copy
        # workers, idle on theirs, which do not exist in the child. So a
        # child that let the handle go (del, the end of a scope, a normal
        # exit) hung for good; a pre-fork server's workers would hang at
        # shutdown. In a child the engine is left unfreed instead: its
        # memory goes with the process.
        if self._owner and self._pid != getpid():
            self._owner.release()

    cdef vector[uintptr_t] _streams(self, object stream, bint for_release):
        # One handle per device: _device_streams in _handle_calls.pxi.
        return _device_streams(self.backend, self.num_devices, stream, for_release)

    cdef inline int _check_open(self) except -1:
        if self._closed:
            raise HandleClosedError("PrefetchHandle is closed")
        return 0

    # ------------------------------------------------ control, inspection

    def arena(self, device=0):
        """The cache arena of `device` as one flat uint8 buffer: a torch CUDA
        tensor (CUDA backend) or a numpy array (host backends). Offsets from
        ``acquire_slots`` index it; bytes there are valid while acquired."""
        self._check_open()
        d = operator.index(device)
        if d < 0 or d >= self.num_devices:
            raise InvalidArgumentError(f"no device {d} (this handle has {self.num_devices})")
        return self._arenas[d]

    def pause(self):
        """Stops workers from starting new copies (benchmarks, tests)."""
        self._check_open()
        with nogil:
            self._c.Pause()

    def resume(self):
        """Lets paused workers copy again (undoes ``pause()`` and
        ``start_paused=True``); queued ids are copied most urgent first."""
        self._check_open()
        with nogil:
            self._c.Resume()

    def queued(self, device=0):
        """Queued ids of `device` as (band, id) pairs, most urgent first and
        in issue order within a band (inspection and tests)."""
        self._check_open()
        cdef int d = operator.index(device)
        cdef vector[pair[int, int64_t]] snapshot
        with nogil:
            snapshot = self._c.QueueSnapshot(d)
        return [(p.first, p.second) for p in snapshot]

    def resident(self, device=0):
        """Resident ids of `device` in eviction order, next victim first."""
        self._check_open()
        cdef int d = operator.index(device)
        cdef vector[int64_t] snapshot
        with nogil:
            snapshot = self._c.ResidentSnapshot(d)
        return list(snapshot)

    def budget_bytes(self, device=0):
        """The cache budget of `device` in bytes, as given to the
        constructor (the size of ``arena(device)``)."""
        self._check_open()
        return self._c.BudgetBytes(operator.index(device))

    def stats(self):
        """A consistent snapshot of the engine's counters and gauges, as a
        dict (all devices together). Counters, since the handle was made:

        requests        ids named by prefetch calls (prefetch_tensors,
                        enqueue_prefetch), duplicates included
        enqueued        of those, newly queued
        deduplicated    of those, already queued, copying or resident
                        (requests == enqueued + deduplicated)
        upgraded        queued ids moved to a more urgent band (by a prefetch
                        or by an acquire waiting for them)
        touched         resident ids a prefetch call refreshed (a use, for
                        the eviction policy) instead of copying
        cancelled       queued ids removed by cancel, cancel_below, cancel_all
                        or an exchange's cancel
        declined        prefetches dropped because only entries needed
                        sooner could make room (Note [Speculation never
                        hurts])
        prefetches_gone an exchange's prefetch ids that another thread
                        unregistered while its acquire waited: dropped, not
                        counted in requests (Note [A step's prefetches
                        after its wait])
        acquires        ids named by acquire calls (acquires == hits + misses)
        hits            acquired while resident with the copy complete
        misses          acquired while not resident, or still being copied
        late            misses whose copy was already under way (prefetched,
                        but too late to arrive first); late <= misses
        on_demand       ids an acquire had to queue itself (at band 0): not
                        queued, copying or resident when acquired (never
                        prefetched, evicted first, or a failed copy)
        evictions       resident entries evicted to make room, or by evict()
        wasted          evictions of entries copied by a prefetch and never
                        acquired while resident (copied for nothing);
                        wasted <= evictions
        copies          completed copies
        caller_copies   of those, issued by the acquiring thread itself
                        (asynchronous backends: Note [Caller-runs on-demand
                        copies] in docs/design.md)
        copy_errors     failed copies (the acquirer of that id gets the error)
        spec_underruns  waits for the cap on speculative bytes in flight
                        after which none were left on the link (the copy
                        worker woke too late to keep it busy: Note [A cap
                        that follows the worker's wake-ups])
        bytes_copied    bytes of the completed copies
        copy_seconds    time spent issuing (CUDA) or doing (host) copies,
                        by the workers and by acquirers issuing their own
        disk_reads      host tier: extent reads of disk-backed tensors
        disk_read_bytes their aligned spans' bytes
        disk_errors     reads that failed (their copies count in copy_errors)
        host_tier_hits  copies of disk-backed tensors the host tier served
                        (no read)
        host_tier_evictions  staged tensors evicted from the host tier

        Gauges, now:

        queue_depth       queued ids
        bytes_in_flight   bytes being copied (CUDA: until the copy worker
                          next sees them done, which may be its next copy)
        resident_count    entries in the caches
        resident_bytes    bytes of cache slots in use
        pinned_count      entries acquired and not yet released
        speculative_cap_bytes  the cap on speculative bytes in flight now
                          (the largest device's; max_speculative_bytes_in_flight)
        registered        registered ids
        registered_bytes  their bytes
        host_tier_used_bytes    bytes of host-tier slots in use
        host_tier_budget_bytes  the host tier's arena (host_budget_bytes)

        Last batched prefetch call (prefetch_tensors), engine's steady clock:
        last_batch_ns (its duration), last_batch_start_ns,
        last_batch_end_ns.

        With no unregister: enqueued + on_demand == copies + copy_errors +
        cancelled + declined + queue_depth."""
        self._check_open()
        cdef CStats s
        with nogil:
            s = self._c.GetStats()
        return s  # Cython's struct-to-dict: one key per field of CStats

    def last_batch_ns(self):
        """Nanoseconds the engine spent in the last batched prefetch call
        (its own steady-clock timer)."""
        self._check_open()
        cdef uint64_t ns
        with nogil:
            ns = self._c.LastBatchNs()
        return ns

    # ------------------------------------------ fault backend, tests only

    def set_faults(self, **settings):
        """Fault backend only: change injected faults while running.
        copy_delay_us, fail_every_nth_copy (a PrefetchError), throw_every_nth_copy
        (a non-std C++ exception), alloc_delay_us, fail_every_nth_alloc,
        report_async, fail_every_nth_record (a release's stream token),
        async_copy_us and async_copy_ns_per_kib (with report_async: copies
        complete that long, plus that much per KiB, after the last one on a
        simulated link per device); 0 = off."""
        self._check_open()
        if self._faults.get() == NULL:
            raise RuntimeError("set_faults needs backend='fault'")
        for key, value in settings.items():
            self._faults.get().Set(key.encode(), operator.index(value))

    def fault_counts(self):
        """Fault backend only: calls seen and faults injected so far."""
        if self._faults.get() == NULL:
            raise RuntimeError("fault_counts needs backend='fault'")
        return {
            k: self._faults.get().Get(k.encode())
            for k in ("copies", "allocs", "copy_failures", "alloc_failures", "stream_records",
                      "max_lane_bytes_in_flight", "max_urgent_latency_us", "live_tokens",
                      "link_idle_before_lane_us", "link_idle_before_urgent_us")
        }

    def _debug_fill_cache(self, int value):
        """Tests only: overwrite every device arena with `value` (poison)."""
        self._check_open()
        for arena in self._arenas:
            if self.backend == "cuda":
                arena.fill_(value)
            else:
                arena.fill(value)
        if self.backend == "cuda":
            import torch
            torch.cuda.synchronize()  # the copy streams are not ordered after it

    def _debug_hold_copies(self, stream):
        """Tests only: make this device's copy streams wait on everything
        queued so far on `stream` (a torch.cuda.Stream), so a test can stall
        copies on the GPU with a spin kernel and release them later."""
        self._check_open()
        if self.backend != "cuda":
            raise RuntimeError("_debug_hold_copies needs the CUDA backend")
        device = stream.device.index or 0
        cdef uintptr_t handle = _stream_handle(stream)
        self._c.DebugHoldCopies(device, handle)
