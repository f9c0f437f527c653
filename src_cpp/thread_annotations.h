// Lock discipline the compiler checks: clang's thread-safety annotations, as
// LevelDB (port/thread_annotations.h) and abseil use them.
//
// Note [Checked lock discipline]
// GUARDED_BY(mu) on a member: reading it needs `mu` held, writing it needs it
// held exclusively. REQUIRES(mu) on a function: every caller holds `mu`
// (the *Locked helpers). EXCLUDES(mu): callers must not hold it (the public
// entry points, which take it). ACQUIRE/RELEASE: the function takes or drops
// it. Only clang reads them: tools/thread_safety_check.py parses every
// engine source with clang's -Wthread-safety (`tox -e lint`) and fails on
// any finding.
//
// Under gcc, the compiler that builds the engine, every macro expands to
// nothing and Mutex, MutexLock, MutexGuard and CondVar are exactly
// std::mutex, std::unique_lock<std::mutex>, std::lock_guard<std::mutex> and
// std::condition_variable: the annotations change no generated code. Under
// clang they are thin annotated wrappers with the member functions the
// engine calls, so the analysis knows which calls take and drop the lock.
//
// What the analysis cannot see (clang 18):
// - A MutexLock passed by reference to a helper that unlocks and relocks
//   it: it cannot tie the reference to the mutex it holds. Such a helper is
//   REQUIRES(mu_) and drops and retakes the lock through functions that name
//   the mutex (ArcherPrefetchHandle::DropLock / RetakeLock), so code between
//   the two that touches guarded state is still caught.
// - Condition-variable waits drop the lock inside the call; to the analysis
//   the lock stays held across CondVar::wait*, which is what their callers
//   may rely on (it is held again when the wait returns). Headers of
//   functions that wait say so.
// - Members of a struct other than the lock's owner (the handle's
//   DeviceState, Entry, TaskQueue, DeviceCache): GUARDED_BY cannot name the
//   owner's mutex from there. Their contract is a comment, and they are
//   reached only from REQUIRES(mu_) functions or under a lock.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#if defined(__clang__)
#define PREFETCH_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define PREFETCH_THREAD_ANNOTATION(x)  // gcc: no analysis, no attributes
#endif

#define CAPABILITY(x) PREFETCH_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY PREFETCH_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) PREFETCH_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) PREFETCH_THREAD_ANNOTATION(pt_guarded_by(x))
#define REQUIRES(...) \
  PREFETCH_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define EXCLUDES(...) PREFETCH_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ACQUIRE(...) \
  PREFETCH_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) \
  PREFETCH_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) \
  PREFETCH_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) PREFETCH_THREAD_ANNOTATION(assert_capability(x))
#define NO_THREAD_SAFETY_ANALYSIS \
  PREFETCH_THREAD_ANNOTATION(no_thread_safety_analysis)

namespace prefetch {

#if !defined(__clang__)

using Mutex = std::mutex;
// Relockable: condition-variable waits and helpers that drop the lock.
using MutexLock = std::unique_lock<std::mutex>;
using MutexGuard = std::lock_guard<std::mutex>;  // held for its whole scope
using CondVar = std::condition_variable;         // waits on a MutexLock

#else  // clang: the thread-safety analysis parses these.

// The bodies below are the primitives the analysis trusts: they forward to
// the std types, whose own code it cannot follow (NO_THREAD_SAFETY_ANALYSIS).

class CAPABILITY("mutex") Mutex {
 public:
  void lock() ACQUIRE() NO_THREAD_SAFETY_ANALYSIS { mu_.lock(); }
  void unlock() RELEASE() NO_THREAD_SAFETY_ANALYSIS { mu_.unlock(); }
  bool try_lock() TRY_ACQUIRE(true) NO_THREAD_SAFETY_ANALYSIS {
    return mu_.try_lock();
  }
  std::mutex& native() { return mu_; }

 private:
  std::mutex mu_;
};

class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) NO_THREAD_SAFETY_ANALYSIS
      : lk_(mu.native()) {}
  ~MutexLock() RELEASE() NO_THREAD_SAFETY_ANALYSIS {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;
  void lock() ACQUIRE() NO_THREAD_SAFETY_ANALYSIS { lk_.lock(); }
  void unlock() RELEASE() NO_THREAD_SAFETY_ANALYSIS { lk_.unlock(); }
  std::unique_lock<std::mutex>& native() { return lk_; }

 private:
  std::unique_lock<std::mutex> lk_;
};

// The analysis needs nothing more for a guard than for a MutexLock held to
// the end of its scope. That the engine never unlocks a guard gcc checks:
// std::lock_guard has no unlock().
using MutexGuard = MutexLock;

// Waits drop and retake the lock inside the call; to the analysis the lock
// is held throughout (see above), as it is before and after the call.
class CondVar {
 public:
  void notify_one() noexcept { cv_.notify_one(); }
  void notify_all() noexcept { cv_.notify_all(); }
  void wait(MutexLock& lk) { cv_.wait(lk.native()); }
  template <class Predicate>
  void wait(MutexLock& lk, Predicate pred) {
    cv_.wait(lk.native(), pred);
  }
  template <class Rep, class Period>
  std::cv_status wait_for(MutexLock& lk,
                          const std::chrono::duration<Rep, Period>& rel) {
    return cv_.wait_for(lk.native(), rel);
  }
  template <class Clock, class Duration>
  std::cv_status wait_until(
      MutexLock& lk, const std::chrono::time_point<Clock, Duration>& abs) {
    return cv_.wait_until(lk.native(), abs);
  }

 private:
  std::condition_variable cv_;
};

#endif  // __clang__

}  // namespace prefetch
