# Declarations only: the C++ engine in src_cpp/, seen from Cython.
# Every call that can throw is `except +prefetch_raise_py_error`, which turns
# engine errors into the classes of prefetch.errors (each also a builtin:
# ValueError, KeyError, TimeoutError, MemoryError or RuntimeError).
from libc.stdint cimport int32_t, int64_t, uint64_t, uintptr_t
from libcpp cimport bool
from libcpp.memory cimport shared_ptr, unique_ptr
from libcpp.pair cimport pair
from libcpp.string cimport string
from libcpp.vector cimport vector

from prefetch._errors cimport prefetch_raise_py_error, prefetch_set_error_type


cdef extern from "copy_backend.h" namespace "prefetch" nogil:
    const uintptr_t kNoStream
    const int kMaxCopyLanes
    cdef cppclass CCopyBackend "prefetch::CopyBackend":
        const char* Name()
        int DeviceCount()

    cdef cppclass CFaultConfig "prefetch::FaultConfig":
        void Set(const string& name, int64_t value) except +prefetch_raise_py_error
        int64_t Get(const string& name) except +prefetch_raise_py_error

    unique_ptr[CCopyBackend] MakeBackend(
        const string& name, int host_device_count
    ) except +prefetch_raise_py_error
    unique_ptr[CCopyBackend] MakeFaultBackend(
        int device_count, shared_ptr[CFaultConfig] config
    ) except +prefetch_raise_py_error


cdef extern from "task_queue.h" namespace "prefetch" nogil:
    const int kNumBands
    const int kOnDemandBand
    const int kDefaultPrefetchBand


cdef extern from "device_cache.h" namespace "prefetch" nogil:
    const size_t kSlotAlignmentBytes


cdef extern from "entry.h" namespace "prefetch" nogil:
    const int64_t kNoNextUse


cdef extern from "stats.h" namespace "prefetch" nogil:
    cdef struct CStats "prefetch::Stats":
        uint64_t requests
        uint64_t enqueued
        uint64_t deduplicated
        uint64_t upgraded
        uint64_t touched
        uint64_t cancelled
        uint64_t declined
        uint64_t prefetches_gone
        uint64_t acquires
        uint64_t hits
        uint64_t misses
        uint64_t late
        uint64_t on_demand
        uint64_t evictions
        uint64_t wasted
        uint64_t copies
        uint64_t caller_copies
        uint64_t copy_errors
        uint64_t spec_underruns
        uint64_t bytes_copied
        double copy_seconds
        uint64_t queue_depth
        uint64_t bytes_in_flight
        uint64_t resident_count
        uint64_t resident_bytes
        uint64_t pinned_count
        uint64_t speculative_cap_bytes
        uint64_t disk_reads
        uint64_t disk_read_bytes
        uint64_t disk_errors
        uint64_t host_tier_hits
        uint64_t host_tier_evictions
        uint64_t host_tier_used_bytes
        uint64_t host_tier_budget_bytes
        uint64_t registered
        uint64_t registered_bytes
        uint64_t last_batch_ns
        int64_t last_batch_start_ns
        int64_t last_batch_end_ns


cdef extern from "disk_io.h" namespace "prefetch" nogil:
    cdef cppclass CDiskFileInfo "prefetch::DiskFileInfo":
        string path
        bool direct
        size_t alignment
        uint64_t size
        int64_t mtime_ns
        uint64_t inode
        uint64_t device


cdef extern from "handle_args.h" namespace "prefetch" nogil:
    const int64_t kMaxTensorId
    const int kMaxDevices
    const int64_t kMaxCopyPollUs
    const int kMaxHandleReaderThreads

    cdef cppclass CHandleOptions "prefetch::HandleOptions":
        vector[size_t] device_budget_bytes
        vector[void*] device_arenas
        string eviction_policy
        uint64_t cycle_acquires
        size_t copy_chunk_bytes
        size_t max_bytes_in_flight
        size_t max_speculative_bytes_in_flight
        int copy_lanes
        int64_t copy_poll_us
        bool start_paused
        bool poison_freed_slots
        int64_t debug_issue_delay_ns
        size_t host_budget_bytes
        bool disk_direct_io
        int disk_reader_threads

    cdef struct CDiskExtent "prefetch::DiskExtent":
        int32_t file
        uint64_t file_offset
        uint64_t bytes
        uint64_t tensor_offset

    cdef struct CSlotInfo "prefetch::SlotInfo":
        uint64_t offset
        uint64_t bytes
        int32_t device

    cdef struct CStepArgs "prefetch::StepArgs":
        const int64_t* release_ids
        size_t n_release
        const int64_t* cancel_ids
        size_t n_cancel
        const int64_t* hint_ids
        const int64_t* hint_when
        size_t n_hint
        int64_t now
        bool set_now
        const int64_t* acquire_ids
        size_t n_acquire
        CSlotInfo* slots
        const int64_t* prefetch_ids
        size_t n_prefetch
        int prefetch_band
        const int64_t* pin_ids
        size_t n_pin
        int64_t* pin_offsets
        const int64_t* use_ids
        size_t n_use
        const uintptr_t* streams
        const uintptr_t* release_streams
        double timeout_s
    cdef struct CHostPart "prefetch::HostPart":
        const void* src
        size_t bytes
        size_t offset


cdef extern from "archer_prefetch_handle.h" namespace "prefetch" nogil:
    cdef cppclass CArcherPrefetchHandle "prefetch::ArcherPrefetchHandle":
        CArcherPrefetchHandle(
            CHandleOptions options, unique_ptr[CCopyBackend] backend
        ) except +prefetch_raise_py_error
        const char* BackendName()
        int DeviceCount()
        uintptr_t ArenaAddress(int device) except +prefetch_raise_py_error
        size_t BudgetBytes(int device) except +prefetch_raise_py_error
        void RegisterTensor(
            int64_t id, size_t total_bytes, int device,
            const CHostPart* parts, size_t n_parts
        ) except +prefetch_raise_py_error
        void RegisterExternal(
            int64_t id, const void* host_ptr, size_t bytes, int device
        ) except +prefetch_raise_py_error
        int32_t OpenFile(const string& path) except +prefetch_raise_py_error
        CDiskFileInfo FileInfo(int32_t file) except +prefetch_raise_py_error
        void RegisterDisk(
            int64_t id, const CDiskExtent* extents, size_t n,
            size_t total_bytes, int device
        ) except +prefetch_raise_py_error
        void UnregisterTensor(int64_t id) except +prefetch_raise_py_error
        bool IsRegistered(int64_t id) except +prefetch_raise_py_error
        void EnqueuePrefetch(
            int64_t id, int priority
        ) except +prefetch_raise_py_error
        void EnqueuePrefetchTensors(
            const int64_t* ids, size_t n, int priority
        ) except +prefetch_raise_py_error
        size_t Cancel(
            const int64_t* ids, size_t n
        ) except +prefetch_raise_py_error
        size_t CancelAtOrBelow(int band) except +prefetch_raise_py_error
        size_t Evict(
            const int64_t* ids, size_t n
        ) except +prefetch_raise_py_error
        void HintNextUse(
            const int64_t* ids, const int64_t* when, size_t n, int64_t now,
            bool set_now
        ) except +prefetch_raise_py_error
        int64_t HintClock() except +prefetch_raise_py_error
        void Acquire(
            const int64_t* ids, size_t n, const uintptr_t* streams,
            double timeout_s, CSlotInfo* slots
        ) except +prefetch_raise_py_error
        void Release(
            const int64_t* ids, size_t n, const uintptr_t* streams
        ) except +prefetch_raise_py_error
        void Step(const CStepArgs& args) except +prefetch_raise_py_error
        vector[pair[int, int64_t]] QueueSnapshot(
            int device
        ) except +prefetch_raise_py_error
        vector[int64_t] ResidentSnapshot(
            int device
        ) except +prefetch_raise_py_error
        void DebugHoldCopies(
            int device, uintptr_t stream
        ) except +prefetch_raise_py_error
        void Pause() except +prefetch_raise_py_error
        void Resume() except +prefetch_raise_py_error
        CStats GetStats() except +prefetch_raise_py_error
        uint64_t LastBatchNs() except +prefetch_raise_py_error
        void Close() except +prefetch_raise_py_error
