// What a caller hands ArcherPrefetchHandle: its options (HandleOptions)
// with their defaults and bounds, and the plain structs its calls take and
// fill (DiskExtent, SlotInfo, StepArgs, HostPart). The Cython binding
// declares these from here (prefetch/_engine.pxd) and takes its option
// bounds from the constants below rather than repeating them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace prefetch {

constexpr int64_t kMaxTensorId = (int64_t{1} << 31) - 1;  // registry bound
constexpr int kMaxDevices = 64;                            // notify bitmask
constexpr size_t kDefaultChunkBytes = size_t{4} << 20;     // 4 MiB per copy
constexpr size_t kDefaultMaxBytesInFlight = size_t{256} << 20;
constexpr int64_t kDefaultCopyPollUs = 20;
constexpr int64_t kMaxCopyPollUs = 100000;  // 0.1 s
// disk_reader_threads, at most: the handle's own bound (a standalone
// DiskReader takes up to kMaxDiskReaderThreads).
constexpr int kMaxHandleReaderThreads = 64;

struct HandleOptions {
  // Cache budget of each device in bytes; its size is the device count.
  std::vector<size_t> device_budget_bytes;
  // Optional caller-owned arena per device (nullptr: the backend allocates
  // one). A caller-owned arena must outlive the handle's use of it.
  std::vector<void*> device_arenas;
  std::string eviction_policy = "lru";
  // "cyclic": Acquire calls per decode step (Note [Cyclic eviction]); 0 = unknown.
  uint64_t cycle_acquires = 0;
  size_t copy_chunk_bytes = kDefaultChunkBytes;  // copies split at this size
  size_t max_bytes_in_flight = kDefaultMaxBytesInFlight;  // async backends
  // Speculative (band > 0) bytes in flight before the worker waits, counted
  // by chunk (Note [Speculation in chunks]). Bounds what an on-demand copy
  // queues behind. 0: a cap of 2 * copy_chunk_bytes that grows a chunk at a
  // time, up to kMaxSpecCapChunks chunks, while the worker finds the link
  // drained when it wakes (Note [A cap that follows the worker's wake-ups]).
  size_t max_speculative_bytes_in_flight = 0;
  // How a copy worker waits for its copies in flight (Note [Polite waits]):
  // > 0: it asks the backend whether the copy is done every this many
  // microseconds and sleeps in between; 0: it blocks in the backend's wait
  // (on CUDA cuEventSynchronize, which spins a core).
  int64_t copy_poll_us = kDefaultCopyPollUs;
  int copy_lanes = 2;  // prefetch streams per device (1..kMaxCopyLanes)
  bool start_paused = false;         // workers idle until Resume()
  bool poison_freed_slots = false;   // debug: fill freed slots with kPoisonByte
  int64_t debug_issue_delay_ns = 0;  // tests: sleep inside the batched call
  // Page-locked host tier for disk-backed tensors (Note [Host tier]); 0: none.
  size_t host_budget_bytes = 0;
  bool disk_direct_io = true;  // O_DIRECT where the filesystem takes it
  int disk_reader_threads = 2;  // with a host tier: threads reading from disk
};

// One extent of a disk-backed tensor: `bytes` bytes of file `file` (an
// OpenFile index) at `file_offset` go to `tensor_offset` of the tensor.
struct DiskExtent {
  int32_t file;
  uint64_t file_offset;
  uint64_t bytes;
  uint64_t tensor_offset;
};

// Where an acquired tensor lives: its device arena and the range in it.
struct SlotInfo {
  uint64_t offset;  // byte offset of the slot in the device arena
  uint64_t bytes;   // registered size of the tensor
  int32_t device;   // device whose arena holds it
};

// The arguments of ArcherPrefetchHandle::Step; a list may be empty (n = 0).
struct StepArgs {
  const int64_t* release_ids = nullptr;
  size_t n_release = 0;
  const int64_t* cancel_ids = nullptr;
  size_t n_cancel = 0;
  const int64_t* hint_ids = nullptr;
  const int64_t* hint_when = nullptr;
  size_t n_hint = 0;
  int64_t now = 0;        // the hint clock moves here when set_now
  bool set_now = false;
  const int64_t* acquire_ids = nullptr;
  size_t n_acquire = 0;
  SlotInfo* slots = nullptr;  // n_acquire of them
  const int64_t* prefetch_ids = nullptr;
  size_t n_prefetch = 0;
  int prefetch_band = 1;
  // Note [Pins without waiting]: `pin_ids` that are resident are pinned
  // (their offset goes to pin_offsets[i]); the others get -1 and nothing
  // is fetched. No use is recorded: `use_ids` say what was read, later.
  const int64_t* pin_ids = nullptr;
  size_t n_pin = 0;
  int64_t* pin_offsets = nullptr;  // n_pin of them
  const int64_t* use_ids = nullptr;
  size_t n_use = 0;
  const uintptr_t* streams = nullptr;  // acquire: one per device, or nullptr
  const uintptr_t* release_streams = nullptr;  // release: likewise
  double timeout_s = 60.0;
};

// One part of a tensor's bytes when registering from several host buffers.
struct HostPart {
  const void* src;  // bytes to copy in
  size_t bytes;     // how many
  size_t offset;    // where they go in the registered buffer
};

}  // namespace prefetch
