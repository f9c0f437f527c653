// ArcherPrefetchHandle: the registry (register, register external,
// unregister, lookups by id).
#include "archer_prefetch_handle.h"
#include "handle_internal.h"

#include <algorithm>
#include <cstring>

namespace prefetch {

using detail::IdText;

// ------------------------------------------------------------ registration

void ArcherPrefetchHandle::CheckRegistrationLocked(int64_t id, size_t bytes,
                                                   int device) const {
  if (id < 0 || id > kMaxTensorId) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + " out of range 0.." +
                            std::to_string(kMaxTensorId));
  }
  if (device < 0 || device >= DeviceCount()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "device " + std::to_string(device) +
                            " out of range 0.." +
                            std::to_string(DeviceCount() - 1));
  }
  if (bytes == 0) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + ": cannot register an empty tensor");
  }
  const size_t budget = devices_[device]->cache->budget_bytes();
  // `bytes > budget` first: AlignSlot of a size within 255 bytes of 2**64
  // wraps to 0, and such a tensor passed this check and was given a 0-byte
  // slot (a memset of 2**64 bytes followed).
  if (bytes > budget || AlignSlot(bytes) > budget) {
    const size_t need = bytes > budget ? bytes : AlignSlot(bytes);
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + " needs " +
                            std::to_string(need) +
                            " bytes of cache but device " +
                            std::to_string(device) + " has a budget of " +
                            std::to_string(budget));
  }
  if (LookupLocked(id) != nullptr) {
    throw PrefetchError(ErrorKind::kAlreadyExists,
                        IdText(id) + " is already registered");
  }
}

void ArcherPrefetchHandle::InsertEntryLocked(int64_t id, void* host,
                                             size_t bytes, int device,
                                             bool owns_host) {
  const size_t page = static_cast<size_t>(id) >> kPageBits;
  try {
    if (page >= pages_.size()) pages_.resize(page + 1);
    if (!pages_[page]) pages_[page].reset(new Entry[kPageSize]);
  } catch (const std::bad_alloc&) {
    throw PrefetchError(ErrorKind::kOutOfMemory,
                        IdText(id) + ": no memory for the registry page");
  }
  Entry* entry = &pages_[page][static_cast<size_t>(id) & (kPageSize - 1)];
  *entry = Entry();
  entry->id = id;
  entry->host_ptr = host;
  entry->owns_host = owns_host;
  entry->bytes = bytes;
  entry->device = device;
  ++registered_;
  registered_bytes_ += bytes;
}

void ArcherPrefetchHandle::RegisterTensor(int64_t id, size_t total_bytes,
                                          int device, const HostPart* parts,
                                          size_t n_parts) {
  {
    CheckNotForked();
    MutexGuard lk(mu_);
    CheckUsableLocked();
    CheckRegistrationLocked(id, total_bytes, device);
    for (size_t p = 0; p < n_parts; ++p) {
      if (parts[p].offset > total_bytes ||
          parts[p].bytes > total_bytes - parts[p].offset) {
        throw PrefetchError(ErrorKind::kInvalidArgument,
                            IdText(id) + ": part " + std::to_string(p) +
                                " runs past the tensor's " +
                                std::to_string(total_bytes) + " bytes");
      }
    }
    ++active_calls_;
  }
  // Allocate and fill outside the lock: registering gigabytes must not stall
  // issuance or the workers.
  void* host = nullptr;
  std::string failure;
  ErrorKind failure_kind = ErrorKind::kOutOfMemory;
  try {
    host = backend_->AllocateHost(total_bytes);
    size_t covered = 0;
    for (size_t p = 0; p < n_parts; ++p) covered += parts[p].bytes;
    if (covered < total_bytes) std::memset(host, 0, total_bytes);
    for (size_t p = 0; p < n_parts; ++p) {
      std::memcpy(static_cast<char*>(host) + parts[p].offset, parts[p].src,
                  parts[p].bytes);
    }
  } catch (const PrefetchError& e) {
    failure = e.what();
    failure_kind = e.kind();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  MutexGuard lk(mu_);
  --active_calls_;
  if (active_calls_ == 0) idle_cv_.notify_all();
  if (!failure.empty()) throw PrefetchError(failure_kind, failure);
  try {
    CheckUsableLocked();
    CheckRegistrationLocked(id, total_bytes, device);  // raced with another
    InsertEntryLocked(id, host, total_bytes, device, /*owns_host=*/true);
  } catch (...) {
    backend_->FreeHost(host, total_bytes);
    throw;
  }
}

void ArcherPrefetchHandle::RegisterExternal(int64_t id, const void* host_ptr,
                                            size_t bytes, int device) {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckUsableLocked();
  if (host_ptr == nullptr) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        IdText(id) + ": null host pointer");
  }
  CheckRegistrationLocked(id, bytes, device);
  InsertEntryLocked(id, const_cast<void*>(host_ptr), bytes, device,
                    /*owns_host=*/false);
}

void ArcherPrefetchHandle::UnregisterTensor(int64_t id) {
  void* host = nullptr;
  size_t bytes = 0;
  {
    CheckNotForked();
    MutexGuard lk(mu_);
    CheckUsableLocked();
    Entry* e = LookupLocked(id);
    if (e == nullptr) {
      throw PrefetchError(ErrorKind::kUnknownId,
                          IdText(id) + " is not registered");
    }
    if (e->pins > 0) {
      throw PrefetchError(ErrorKind::kState,
                          IdText(id) + " is acquired; release it first");
    }
    DeviceState* dev = devices_[e->device].get();
    if (e->state == EntryState::kCopying) {
      throw PrefetchError(ErrorKind::kState,
                          IdText(id) + " is being copied; retry later");
    }
    if (e->disk >= 0 &&
        disk_specs_[static_cast<size_t>(e->disk)]->stage.state ==
            EntryState::kCopying) {
      throw PrefetchError(ErrorKind::kState,
                          IdText(id) + " is being read from disk; retry later");
    }
    if (e->state == EntryState::kResident) {
      if (!detail::TokenDone(backend_.get(), &e->ready) ||
          !detail::TokenDone(backend_.get(), &e->last_use)) {
        throw PrefetchError(ErrorKind::kState,
                            IdText(id) + " is still in use on a stream; "
                                         "retry after it synchronises");
      }
      DropSlotLocked(dev, e);
    } else if (e->state == EntryState::kQueued) {
      dev->queue.Remove(e);
    }
    if (e->disk >= 0) {  // Note [Host tier]: its host slot, if staged, goes
      DropStageLocked(disk_specs_[static_cast<size_t>(e->disk)].get());
      disk_specs_[static_cast<size_t>(e->disk)].reset();
    }
    host = e->owns_host ? e->host_ptr : nullptr;
    bytes = e->bytes;
    *e = Entry();  // id -1: the registry slot is free again
    --registered_;
    registered_bytes_ -= bytes;
    dev->work_cv.notify_one();  // a freed slot may unblock the worker
  }
  if (host != nullptr) backend_->FreeHost(host, bytes);
}

bool ArcherPrefetchHandle::IsRegistered(int64_t id) const {
  CheckNotForked();
  MutexGuard lk(mu_);
  return !closed_ && LookupLocked(id) != nullptr;
}

}  // namespace prefetch
