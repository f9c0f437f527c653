// Errors raised by the engine.
//
// Every engine failure is a PrefetchError carrying an ErrorKind, so a binding
// can map it onto its own exception classes (the Cython layer maps kinds to
// ValueError, KeyError, TimeoutError, MemoryError, RuntimeError and OSError),
// and, for a failed system call, the errno it set (0: none). Worker
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
  kIoError,          // a file could not be opened or read (DiskReader)
};

class PrefetchError : public std::runtime_error {
 public:
  PrefetchError(ErrorKind kind, const std::string& message, int sys_errno = 0)
      : std::runtime_error(message), kind_(kind), sys_errno_(sys_errno) {}
  ErrorKind kind() const noexcept { return kind_; }
  // The errno of the failed system call behind it; 0 when there is none.
  int sys_errno() const noexcept { return sys_errno_; }

 private:
  ErrorKind kind_;
  int sys_errno_;
};

}  // namespace prefetch
