// Errors raised by the engine.
//
// Every engine failure is a PrefetchError carrying an ErrorKind, so a binding
// can map it onto its own exception classes (the Cython layer maps kinds to
// ValueError, KeyError, TimeoutError, MemoryError and RuntimeError). Worker
// threads never let an exception escape: they store the message on the entry
// and the next acquirer of that id gets it as kCopyFailed.
#pragma once

#include <stdexcept>
#include <string>

namespace prefetch {

enum class ErrorKind {
  kInvalidArgument,  // malformed argument: bad priority, bad size, bad option
  kUnknownId,        // tensor id not registered
  kAlreadyExists,    // tensor id registered twice
  kTimeout,          // a wait ran past its deadline
  kClosed,           // the handle was closed (or used in a forked child)
  kCopyFailed,       // the copy backend failed for this id
  kOutOfMemory,      // an allocation failed
  kState,            // call not valid in the entry's state (release w/o acquire)
  kUnavailable,      // backend not available on this machine
};

class PrefetchError : public std::runtime_error {
 public:
  PrefetchError(ErrorKind kind, const std::string& message)
      : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace prefetch
