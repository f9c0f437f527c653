// Helpers shared by the files that implement ArcherPrefetchHandle
// (archer_prefetch_handle.cpp: construction, registration, prefetch and
// control; acquire_release.cpp; copy_worker.cpp). Not part of the API.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "entry.h"

namespace prefetch {
namespace detail {

inline std::string IdText(int64_t id) { return "tensor id " + std::to_string(id); }

inline const char* StateName(EntryState s) {
  switch (s) {
    case EntryState::kHost: return "not requested";
    case EntryState::kQueued: return "queued";
    case EntryState::kCopying: return "copying";
    case EntryState::kResident: return "resident";
  }
  return "?";
}

inline int64_t SteadyNs(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             t.time_since_epoch())
      .count();
}

}  // namespace detail
}  // namespace prefetch
