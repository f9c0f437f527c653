// C++-level stress of the queue and cache: T threads hammer one handle with
// batched prefetches, acquire/verify/release, cancels and evictions, then the
// counters must reconcile. Usage: stress THREADS OPS_PER_THREAD [host|async|link]
// [lru|cyclic|next-use] (next-use: the threads send hints too)
// ("async": the fault backend claiming to be asynchronous, so acquirers
// issue their own on-demand copies, as on CUDA; "link": the same on a
// simulated link of 2 us a copy, 256-byte chunks and a 50 us poll, so that
// speculation goes a chunk at a time and the copy worker wakes late: the
// speculative cap deepens and steps down while the threads race it, Note [A
// cap that follows the worker's wake-ups]).
// Exit 0 on success; prints the first violation and exits 1 otherwise.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "archer_prefetch_handle.h"

using prefetch::ArcherPrefetchHandle;

namespace {

constexpr int kIds = 512;
constexpr size_t kBytes = 700;  // not a multiple of the slot alignment
constexpr size_t kMinSlots = 96;
constexpr size_t kMaxAcquire = 3;  // ids a thread acquires at once

uint8_t Expected(int64_t id, size_t i) {
  return static_cast<uint8_t>((i * (2 * id + 1) + id * 31 + 7) % 251 + 1);
}

std::atomic<bool> g_failed{false};

void Fail(const char* what, long a, long b) {
  if (!g_failed.exchange(true)) std::fprintf(stderr, "FAIL: %s (%ld, %ld)\n", what, a, b);
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 4;
  const int ops = argc > 2 ? std::atoi(argv[2]) : 2000;
  prefetch::HandleOptions options;
  // An acquire pins its ids while it waits for the missing ones, so with
  // fewer slots than the threads can pin at once every slot can end up
  // held by threads that wait for each other (the engine's timeout, "the
  // cache may be full of acquired tensors"): 64 threads of 3 ids did so in
  // CI's link mode, where copies take long enough. Room for every thread's
  // pins and more keeps the eviction pressure (512 ids) without that.
  const size_t slots = std::max(kMinSlots, kMaxAcquire * static_cast<size_t>(threads) + 32);
  options.device_budget_bytes = {slots * prefetch::AlignSlot(kBytes)};
  options.poison_freed_slots = true;
  const bool link = argc > 3 && std::strcmp(argv[3], "link") == 0;
  const bool async = link || (argc > 3 && std::strcmp(argv[3], "async") == 0);
  if (link) {
    options.copy_chunk_bytes = 256;
    options.copy_poll_us = 50;
  }
  if (argc > 4) options.eviction_policy = argv[4];
  const bool hints = options.eviction_policy == "next-use";
  std::unique_ptr<prefetch::CopyBackend> backend;
  if (async) {
    auto config = std::make_shared<prefetch::FaultConfig>();
    config->report_async = 1;
    if (link) config->async_copy_us = 2;
    backend = prefetch::MakeFaultBackend(1, config);
  } else {
    backend = std::make_unique<prefetch::HostBackend>();
  }
  ArcherPrefetchHandle handle(options, std::move(backend));
  std::vector<uint8_t> buf(kBytes);
  for (int64_t id = 0; id < kIds; ++id) {
    for (size_t i = 0; i < kBytes; ++i) buf[i] = Expected(id, i);
    prefetch::HostPart part{buf.data(), kBytes, 0};
    handle.RegisterTensor(id, kBytes, 0, &part, 1);
  }
  const char* arena = reinterpret_cast<const char*>(handle.ArenaAddress(0));
  std::atomic<uint64_t> requested{0}, acquired{0};
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      std::mt19937_64 rng(1234 + t);
      std::vector<int64_t> ids;
      std::vector<prefetch::SlotInfo> slots(kMaxAcquire);
      for (int k = 0; k < ops && !g_failed; ++k) {
        const int op = static_cast<int>(rng() % 10);
        try {
          if (op < 4) {
            ids.resize(1 + rng() % 64);
            for (auto& id : ids) id = static_cast<int64_t>(rng() % kIds);
            handle.EnqueuePrefetchTensors(ids.data(), ids.size(), 1 + rng() % 19);
            requested += ids.size();
          } else if (op < 8) {
            ids.resize(1 + rng() % kMaxAcquire);
            for (auto& id : ids) id = static_cast<int64_t>(rng() % kIds);
            handle.Acquire(ids.data(), ids.size(), nullptr, 60.0, slots.data());
            acquired += ids.size();
            for (size_t j = 0; j < ids.size(); ++j) {
              const uint8_t* p = reinterpret_cast<const uint8_t*>(arena + slots[j].offset);
              for (size_t i = 0; i < kBytes; i += 37) {
                if (p[i] != Expected(ids[j], i)) Fail("bytes differ", ids[j], static_cast<long>(i));
              }
            }
            handle.Release(ids.data(), ids.size(), nullptr);
          } else if (op < 9 && hints && rng() % 2 == 0) {
            // Next-use hints: random times, resident or not; only thread 0
            // moves the clock, so it never goes back.
            ids.resize(1 + rng() % 8);
            std::vector<int64_t> when(ids.size());
            for (size_t j = 0; j < ids.size(); ++j) {
              ids[j] = static_cast<int64_t>(rng() % kIds);
              when[j] = rng() % 5 == 0 ? prefetch::kNoNextUse : static_cast<int64_t>(rng() % (4 * ops));
            }
            handle.HintNextUse(ids.data(), when.data(), ids.size(), k, t == 0);
          } else if (op < 9) {
            int64_t id = static_cast<int64_t>(rng() % kIds);
            handle.Cancel(&id, 1);
          } else {
            int64_t id = static_cast<int64_t>(rng() % kIds);
            handle.Evict(&id, 1);
            prefetch::Stats s = handle.GetStats();
            if (s.resident_bytes > options.device_budget_bytes[0]) {
              Fail("budget exceeded", static_cast<long>(s.resident_bytes), 0);
            }
          }
        } catch (const std::exception& e) {
          Fail(e.what(), t, k);
        }
      }
    });
  }
  for (auto& th : pool) th.join();
  // Let the worker finish what is queued: an entry mid-copy is neither
  // queued nor copied yet, so the books balance only at rest.
  prefetch::Stats s = handle.GetStats();
  if (link) {
    // On the simulated link a copy stays in bytes_in_flight until the worker
    // next looks, and an idle worker sleeps until new work comes: at rest is
    // an empty queue with the copies and bytes in flight unchanged for 50 ms.
    uint64_t last_copies = ~uint64_t{0}, last_bytes = ~uint64_t{0};
    for (int spin = 0, stable = 0; spin < 60000 && stable < 50; ++spin) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
      s = handle.GetStats();
      stable = s.queue_depth == 0 && s.copies == last_copies && s.bytes_in_flight == last_bytes ? stable + 1 : 0;
      last_copies = s.copies;
      last_bytes = s.bytes_in_flight;
    }
  }
  for (int spin = 0; !link && spin < 60000 && (s.queue_depth != 0 || s.bytes_in_flight != 0); ++spin) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
    s = handle.GetStats();
  }
  if (s.requests != requested) Fail("requests", static_cast<long>(s.requests), static_cast<long>(requested));
  if (s.requests != s.enqueued + s.deduplicated) Fail("requests split", static_cast<long>(s.enqueued), static_cast<long>(s.deduplicated));
  if (s.acquires != acquired || s.acquires != s.hits + s.misses) Fail("acquires", static_cast<long>(s.acquires), static_cast<long>(acquired));
  if (s.enqueued + s.on_demand != s.copies + s.copy_errors + s.cancelled + s.declined + s.queue_depth) {
    Fail("queue accounting", static_cast<long>(s.enqueued + s.on_demand), static_cast<long>(s.copies + s.copy_errors + s.cancelled + s.declined + s.queue_depth));
  }
  if (s.copies != s.resident_count + s.evictions) Fail("copy accounting", static_cast<long>(s.copies), static_cast<long>(s.resident_count + s.evictions));
  if (s.pinned_count != 0) Fail("pins left", static_cast<long>(s.pinned_count), 0);
  if (s.speculative_cap_bytes < 2 * options.copy_chunk_bytes ||
      s.speculative_cap_bytes > 4 * options.copy_chunk_bytes) {
    Fail("speculative cap out of its bounds", static_cast<long>(s.speculative_cap_bytes),
         static_cast<long>(options.copy_chunk_bytes));
  }
  handle.Close();
  if (g_failed) return 1;
  if (async && s.caller_copies == 0) {
    std::fprintf(stderr, "FAIL: no caller-run copies in async mode\n");
    return 1;
  }
  std::printf("ok threads=%d ops=%d requests=%llu acquires=%llu copies=%llu evictions=%llu underruns=%llu\n",
              threads, ops, static_cast<unsigned long long>(s.requests),
              static_cast<unsigned long long>(s.acquires), static_cast<unsigned long long>(s.copies),
              static_cast<unsigned long long>(s.evictions), static_cast<unsigned long long>(s.spec_underruns));
  return 0;
}
