// Helpers shared by the files that implement ArcherPrefetchHandle
// (archer_prefetch_handle.cpp: construction, checks and control;
// prefetch_cancel.cpp; registry.cpp; acquire_release.cpp; copy_worker.cpp;
// host_tier.cpp). Not part of the API.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>

#include "copy_backend.h"
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

// Note [Completed tokens]
// Whether a copy or a use has completed is a driver call on the CUDA
// backend (an event query under a context guard). Once a token is seen
// complete, the entry holding it returns it to the backend and holds
// kTokenDone instead, so every later question about that entry is one
// compare. It matters where the engine asks about many entries per call: a
// layer's pins ask about every resident expert of the layer (Note [Pins
// without waiting]), each layer of each step. A token that Query reports
// done because the backend could not tell (its contract) goes the same
// way: nothing waits on a token after Query called it done. A thread that
// waits on an entry's token outside mu_ holds its own reference
// (RetainToken) for the wait, so another thread collapsing the entry's
// token cannot hand the event back to the pool under it.
// REQUIRES: the engine's mu_ (the token belongs to an entry).
inline bool TokenDone(CopyBackend* backend, CopyToken* token) {
  if (*token == kTokenDone) return true;
  if (!backend->Query(*token)) return false;
  backend->ReleaseToken(*token);
  *token = kTokenDone;
  return true;
}

inline int64_t SteadyNs(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             t.time_since_epoch())
      .count();
}

}  // namespace detail
}  // namespace prefetch
