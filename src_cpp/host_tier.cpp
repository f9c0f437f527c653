// ArcherPrefetchHandle: the host tier of disk-backed tensors (Note [Host
// tier] in archer_prefetch_handle.h): files, registration, staging into
// page-locked slots and the two-hop copy.
#include "archer_prefetch_handle.h"
#include "handle_internal.h"

#include <algorithm>
#include <chrono>
#include <cstring>

namespace prefetch {

using detail::IdText;
using detail::TokenDone;

namespace {

constexpr size_t kStageAlignment = 4096;  // every region of a host slot

size_t AlignUp(size_t n, size_t a) { return (n + a - 1) / a * a; }

// Extent `x`'s span as the host tier reads it into `region`: 4096-aligned
// for an O_DIRECT file (O_DIRECT alignments above that are refused at
// OpenFile), the bytes themselves for a buffered one. Never throws for a
// registered extent: RegisterDisk computed its 4096-aligned span already.
DiskSpan ExtentSpan(const DiskFileInfo& info, const DiskExtent& x,
                    void* region) {
  return AlignedSpan(info.path, x.file_offset, x.bytes,
                     info.direct ? kStageAlignment : 1, region);
}

}  // namespace

void ArcherPrefetchHandle::BuildHostTier(const HandleOptions& options) {
  const size_t budget = options.host_budget_bytes;
  if (budget == 0) return;
  if (budget < kStageAlignment) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "host_budget_bytes must be 0 (no host tier) or at "
                        "least " + std::to_string(kStageAlignment));
  }
  // Page-locked (the backend's host memory) and 4096-aligned for O_DIRECT.
  host_tier_alloc_bytes_ = budget + kStageAlignment;
  host_tier_alloc_ = backend_->AllocateHost(host_tier_alloc_bytes_);
  const uintptr_t base = reinterpret_cast<uintptr_t>(host_tier_alloc_);
  char* arena = reinterpret_cast<char*>(AlignUp(base, kStageAlignment));
  try {
    host_tier_ = std::make_unique<DeviceCache>(arena, budget,
                                               MakeEvictionPolicy("lru", 0));
  } catch (...) {
    backend_->FreeHost(host_tier_alloc_, host_tier_alloc_bytes_);
    host_tier_alloc_ = nullptr;
    throw;
  }
}

void ArcherPrefetchHandle::StartReaders() {
  if (!host_tier_) return;
  for (int i = 0; i < disk_reader_threads_; ++i) {
    readers_.emplace_back([this] {
      try {
        ReaderLoop();
      } catch (...) {
        // As a worker's: nothing escapes the thread. Staging stops;
        // acquirers of disk-backed tensors time out with a clear error.
      }
    });
  }
}

void ArcherPrefetchHandle::FreeHostTierLocked() {
  // Close: readers and workers are joined, no copy or read runs any more.
  for (auto& spec : disk_specs_) {
    if (spec) DropStageLocked(spec.get());
  }
  disk_specs_.clear();
  files_.clear();  // closes the descriptors
  if (host_tier_alloc_ != nullptr) {
    backend_->FreeHost(host_tier_alloc_, host_tier_alloc_bytes_);
    host_tier_alloc_ = nullptr;
  }
}

void ArcherPrefetchHandle::CheckExtentLocked(int64_t id, size_t i,
                                             const DiskExtent& x,
                                             size_t total_bytes) const {
  const std::string where = IdText(id) + ": extent " + std::to_string(i);
  if (x.file < 0 || static_cast<size_t>(x.file) >= files_.size()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        where + " names file " + std::to_string(x.file) +
                            ", not one OpenFile returned");
  }
  const DiskFileInfo& info = files_[static_cast<size_t>(x.file)]->info;
  if (x.bytes == 0 || x.file_offset > info.size ||
      x.bytes > info.size - x.file_offset) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        where + " (" + std::to_string(x.bytes) +
                            " bytes at " + std::to_string(x.file_offset) +
                            ") is empty or runs past the end of " + info.path +
                            " (" + std::to_string(info.size) + " bytes)");
  }
  if (x.tensor_offset > total_bytes ||
      x.bytes > total_bytes - x.tensor_offset) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        where + " runs past the tensor's " +
                            std::to_string(total_bytes) + " bytes");
  }
}

int32_t ArcherPrefetchHandle::OpenFile(const std::string& path) {
  CheckNotForked();
  auto file = std::make_unique<DiskFile>();
  OpenDiskFile(path, disk_direct_io_, /*refuse_direct=*/false, file.get());
  if (file->info.alignment > kStageAlignment) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        path + ": O_DIRECT needs " +
                            std::to_string(file->info.alignment) +
                            "-byte alignment; the host tier aligns to " +
                            std::to_string(kStageAlignment));
  }
  MutexGuard lk(mu_);
  CheckUsableLocked();
  if (files_.size() >= static_cast<size_t>(INT32_MAX)) {
    throw PrefetchError(ErrorKind::kInvalidArgument, "too many open files");
  }
  files_.push_back(std::move(file));
  return static_cast<int32_t>(files_.size() - 1);
}

DiskFileInfo ArcherPrefetchHandle::FileInfo(int32_t file) const {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckUsableLocked();
  if (file < 0 || static_cast<size_t>(file) >= files_.size()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "file " + std::to_string(file) +
                            " is not one OpenFile returned");
  }
  return files_[static_cast<size_t>(file)]->info;
}

void ArcherPrefetchHandle::RegisterDisk(int64_t id, const DiskExtent* extents,
                                        size_t n, size_t total_bytes,
                                        int device) {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckUsableLocked();
  if (!host_tier_) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + ": a disk-backed tensor needs a host "
                                     "tier (host_budget_bytes > 0)");
  }
  CheckRegistrationLocked(id, total_bytes, device);
  if (n == 0) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + ": no extents");
  }
  auto spec = std::make_unique<DiskSpec>();
  for (size_t i = 0; i < n; ++i) {
    const DiskExtent& x = extents[i];
    CheckExtentLocked(id, i, x, total_bytes);
    spec->region.push_back(spec->stage_bytes);
    // Each region as an O_DIRECT read needs it (a buffered file's is smaller).
    const DiskFileInfo& info = files_[static_cast<size_t>(x.file)]->info;
    spec->stage_bytes +=
        AlignedSpan(info.path, x.file_offset, x.bytes, kStageAlignment, nullptr)
            .span_bytes;
    spec->extents.push_back(x);
  }
  if (spec->stage_bytes > host_tier_->budget_bytes()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + " needs " +
                            std::to_string(spec->stage_bytes) +
                            " bytes of the host tier, whose budget is " +
                            std::to_string(host_tier_->budget_bytes()));
  }
  // The bytes no extent covers (offset, length), zeroed after each copy.
  std::vector<std::pair<uint64_t, uint64_t>> covered;
  for (const DiskExtent& x : spec->extents) {
    covered.emplace_back(x.tensor_offset, x.tensor_offset + x.bytes);
  }
  std::sort(covered.begin(), covered.end());
  uint64_t at = 0;
  for (const auto& c : covered) {
    if (c.first > at) spec->gaps.emplace_back(at, c.first - at);
    at = std::max(at, c.second);
  }
  if (at < total_bytes) spec->gaps.emplace_back(at, total_bytes - at);
  spec->stage.id = id;
  spec->stage.bytes = spec->stage_bytes;
  spec->stage.owns_host = false;
  InsertEntryLocked(id, nullptr, total_bytes, device, /*owns_host=*/false);
  Entry* e = LookupLocked(id);
  e->disk = static_cast<int32_t>(disk_specs_.size());
  // The shadow has no host bytes of its own: host_ptr names its owner
  // (entries never move: registry pages are never reallocated).
  spec->stage.host_ptr = e;
  disk_specs_.push_back(std::move(spec));
}

void ArcherPrefetchHandle::DropStageLocked(DiskSpec* spec) {
  Entry* s = &spec->stage;
  if (s->state == EntryState::kResident) {
    host_tier_->RemoveResident(s);
    host_tier_->Free(s->slot_offset, s->slot_bytes);
  }
  backend_->ReleaseToken(s->last_use);
  s->last_use = kTokenDone;
  s->state = EntryState::kHost;
}

bool ArcherPrefetchHandle::ReserveHostSlotLocked(DiskSpec* spec) {
  Entry* s = &spec->stage;
  // A staged tensor may go unless a copy is issued from it (pins), a copy
  // from it is in flight (last_use), or its owner (stage.host_ptr, see
  // RegisterDisk) is still queued for the copy it was staged for.
  auto evictable = [](Entry* v, void* raw) {
    auto* backend = static_cast<CopyBackend*>(raw);
    const Entry* owner = static_cast<const Entry*>(v->host_ptr);
    return v->pins == 0 && owner->state != EntryState::kQueued &&
           TokenDone(backend, &v->last_use);
  };
  for (;;) {
    if (host_tier_->Allocate(spec->stage_bytes, &s->slot_offset,
                             &s->slot_bytes)) {
      return true;
    }
    Entry* victim = host_tier_->PickVictim(evictable, backend_.get());
    if (victim == nullptr) return false;
    host_tier_->RemoveResident(victim);
    host_tier_->Free(victim->slot_offset, victim->slot_bytes);
    backend_->ReleaseToken(victim->last_use);
    victim->last_use = kTokenDone;
    victim->state = EntryState::kHost;
    ++stats_.host_tier_evictions;
  }
}

bool ArcherPrefetchHandle::ReadyToCopyLocked(const Entry* e) const {
  return e->disk < 0 ||
         disk_specs_[static_cast<size_t>(e->disk)]->stage.state ==
             EntryState::kResident;
}

Entry* ArcherPrefetchHandle::NextReadyLocked(DeviceState* dev) const {
  Entry* head = dev->queue.PeekMostUrgent();
  if (head == nullptr || ReadyToCopyLocked(head)) return head;
  Entry* ready = nullptr;
  // The lambdas below run under the caller's mu_ (TaskQueue::ForEach calls
  // them in place); clang checks a lambda on its own and cannot see that.
  dev->queue.ForEach([&](Entry* e) NO_THREAD_SAFETY_ANALYSIS {
    if (ready == nullptr && ReadyToCopyLocked(e)) ready = e;
  });
  return ready;
}

Entry* ArcherPrefetchHandle::NextToStageLocked() const {
  Entry* best = nullptr;
  for (const auto& dev : devices_) {
    dev->queue.ForEach([&](Entry* e) NO_THREAD_SAFETY_ANALYSIS {
      if (e->disk < 0) return;
      const Entry& stage = disk_specs_[static_cast<size_t>(e->disk)]->stage;
      if (stage.state != EntryState::kHost) return;  // staged, or being staged
      if (best == nullptr || e->band < best->band) best = e;
    });
  }
  return best;
}

void ArcherPrefetchHandle::ReaderLoop() {
  MutexLock lk(mu_);
  while (!stop_) {
    Entry* owner = paused_ ? nullptr : NextToStageLocked();
    if (owner == nullptr) {
      stage_cv_.wait(lk);
      continue;
    }
    if (!ReserveHostSlotLocked(disk_specs_[static_cast<size_t>(owner->disk)].get())) {
      // Every slot is read by a copy or waits for one: a worker frees it.
      stage_cv_.wait_for(lk, std::chrono::microseconds(100));
      continue;
    }
    StageLocked(owner, lk);
  }
}

void ArcherPrefetchHandle::StageLocked(Entry* owner, MutexLock& lk) {
  DiskSpec* spec = disk_specs_[static_cast<size_t>(owner->disk)].get();
  Entry* s = &spec->stage;
  s->state = EntryState::kCopying;  // being staged: Unregister refuses meanwhile
  char* host = host_tier_->arena() + s->slot_offset;
  std::string error;
  for (size_t i = 0; i < spec->extents.size() && error.empty(); ++i) {
    const DiskExtent& x = spec->extents[i];
    const DiskFile& file = *files_[static_cast<size_t>(x.file)];
    const DiskSpan span = ExtentSpan(file.info, x, host + spec->region[i]);
    const DiskFault fault = backend_->NextReadFault();
    DropLock(lk);
    int sys_errno = 0;
    error = ReadSpan(file, span, fault, &sys_errno);
    RetakeLock(lk);
    if (error.empty()) {
      ++stats_.disk_reads;
      stats_.disk_read_bytes += span.span_bytes;
    } else {
      ++stats_.disk_errors;
      error = IdText(owner->id) + ": " + error;
    }
    if (error.empty() && stop_ && i + 1 < spec->extents.size()) {
      error = "PrefetchHandle closed while reading from disk";
    }
  }
  if (error.empty()) {
    s->state = EntryState::kResident;
    s->prefetched_unused = true;  // read for a copy not made yet
    host_tier_->AddResident(s);
  } else {
    host_tier_->Free(s->slot_offset, s->slot_bytes);
    s->state = EntryState::kHost;
    // The owner fails only if it still waits for this copy (a cancelled
    // prefetch has nobody to tell).
    if (owner->state == EntryState::kQueued && !stop_) {
      FailUnstartedLocked(devices_[owner->device].get(), owner, error);
    }
  }
  devices_[owner->device]->work_cv.notify_one();
  stage_cv_.notify_all();  // another reader may find room, or work, now
}

void ArcherPrefetchHandle::CopyFromDiskLocked(DeviceState* dev, Entry* e,
                                              MutexLock& lk) {
  e->state = EntryState::kCopying;
  dev->copying_bytes += e->bytes;
  DiskSpec* spec = disk_specs_[static_cast<size_t>(e->disk)].get();
  Entry* s = &spec->stage;
  const bool urgent = e->band == kOnDemandBand;
  const int lane = urgent ? 0 : static_cast<int>(dev->next_lane++ % copy_lanes_);
  std::string error;
  CopyToken token = kTokenDone;
  if (s->state != EntryState::kResident) {  // callers check ReadyToCopyLocked
    error = IdText(e->id) + ": not staged in the host tier";
  } else {
    if (!s->prefetched_unused) ++stats_.host_tier_hits;  // staged before, reused
    s->prefetched_unused = false;
    host_tier_->Used(s);
    ++s->pins;  // no eviction of the slot while copies are issued from it
    const char* host = host_tier_->arena() + s->slot_offset;
    char* dst = dev->cache->arena() + e->slot_offset;
    for (size_t i = 0; i < spec->extents.size() && error.empty(); ++i) {
      const DiskExtent& x = spec->extents[i];
      const DiskSpan span = ExtentSpan(
          files_[static_cast<size_t>(x.file)]->info, x, nullptr);
      DropLock(lk);
      const Clock::time_point start = Clock::now();
      error = IssueCopy(dev->index, dst + x.tensor_offset,
                        host + spec->region[i] + span.lead, x.bytes, urgent,
                        lane, &token);
      const double seconds =
          std::chrono::duration<double>(Clock::now() - start).count();
      RetakeLock(lk);
      stats_.copy_seconds += seconds;
    }
    if (error.empty() && !spec->gaps.empty()) {
      // Bytes no extent covers read as zero, as a registered tensor's do;
      // the backend's Fill completes before it returns.
      DropLock(lk);
      try {
        backend_->Wait(token);
        for (const auto& gap : spec->gaps) {
          backend_->Fill(dev->index, dst + gap.first, gap.second, 0);
        }
      } catch (const std::exception& ex) {
        error = ex.what();
      }
      RetakeLock(lk);
    }
    --s->pins;
    if (token != kTokenDone) {
      // The slot's last reader so far: not reused before this copy is done.
      backend_->RetainToken(token);
      backend_->ReleaseToken(s->last_use);
      s->last_use = token;
    }
    stage_cv_.notify_all();  // a reader waiting for room may find it soon
  }
  if (!urgent) {
    // Under the speculative cap as one chunk (its extents' copies share a
    // lane, so the last token covers them).
    TrackSpecChunkLocked(dev, token, e->bytes);
  }
  dev->copying_bytes -= e->bytes;
  FinishCopyLocked(dev, e, token, error, lk);
}

}  // namespace prefetch
