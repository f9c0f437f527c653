// DiskReader: a fixed pool of threads that read byte ranges of plain files
// into buffers the caller owns (the reader of issue #15's disk tier).
//
// It stands alone: the engine (ArcherPrefetchHandle) does not call it, and
// nothing here knows about tensors, the cache or CUDA. Its system calls
// (open, pread, the change checks) are in disk_io.{h,cpp}; the binding is
// prefetch/_disk.pyx (prefetch.DiskReader).
//
// Note [Disk reads]
// Files. OpenFile opens a path with O_RDONLY|O_DIRECT|O_CLOEXEC when the
// reader was made with direct_io, and again without O_DIRECT only when the
// filesystem refuses it (EINVAL); DiskFileInfo::direct says which one the
// file got. It records the file's size, mtime, inode and device from fstat.
// A direct file's alignment A is the larger of the memory and offset
// alignments statx(STATX_DIOALIGN) reports, or 4096 when it reports none; a
// buffered file's is 1.
//
// Reads. Submit(file, offset, length, dest, capacity) checks everything
// before it queues anything (file index, length > 0, the range inside the
// size recorded at open, dest aligned to A, capacity), so a refused call
// changes nothing. A thread then reads the span [align_down(offset, A),
// align_up(offset + length, A)) into dest, so the requested bytes start
// `offset - align_down(offset, A)` bytes into dest, which Wait returns
// (always 0 for a buffered file). RequiredCapacity says how large dest must
// be. pread is called until the bytes up to offset + length are in (EINTR
// is retried); a span that ends past the end of the file reads up to it.
//
// Faults are errors, never silent. Each one fails only its own read (Wait
// throws it, kIoError, naming the file, offset and length; an errno when a
// system call failed); the threads keep serving the other reads:
// - pread returns -1 (EIO, ...), or end of file comes before offset + length
//   (a short read);
// - the file changed since it was opened: after every read, successful or
//   not, the descriptor is fstat'ed again and its size, mtime and inode
//   compared with those at open (a truncation or an append shows in the
//   size, a write in place in the mtime, to the filesystem's timestamp
//   granularity), and the path is stat'ed and its inode and device compared
//   (a file replaced by rename, or removed: the old descriptor still reads
//   the old bytes, which would otherwise pass unnoticed). Both checks cost two
//   system calls per read, nothing next to reading megabytes;
// - a missing file, at OpenFile.
// Fault injection for tests (DiskFaultOptions, as the engine's FaultBackend
// does it in host_backend.cpp): the Nth read (counted when a thread starts
// it, 1-based) gets -1/EIO from its first pread, or end of file halfway
// through its span; opens can be made to see O_DIRECT refused.
//
// Tickets. Wait(ticket) returns where the bytes start, or throws the read's
// error, and forgets the ticket. Cancel drops a queued read; a read in
// progress is not interrupted: Cancel waits for it (one read's time) and
// discards its result, so when Cancel returns the reader no longer touches
// dest. Close cancels every queued read (their Wait throws kClosed),
// waits for the reads in progress (their Wait still returns their outcome),
// joins the threads and closes the files. No exception ever leaves a reader
// thread: a read's error is stored on its request and rethrown by Wait. In a
// forked child (the threads live only in the parent) every other call
// throws kClosed and Close returns at once, as PrefetchHandle does.
//
// One mutex, mu_, guards the queue, the requests, the open files and the
// counters; no thread holds it while it reads or sleeps (Note [Checked lock
// discipline] in thread_annotations.h: GUARDED_BY, REQUIRES, EXCLUDES).
// Request and File are touched only under mu_ (a request's fields) or are
// immutable after open (a file's), but clang cannot name the reader's mutex
// from inside them: that part is this comment.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "disk_io.h"
#include "errors.h"
#include "thread_annotations.h"

namespace prefetch {

constexpr int kMaxDiskReaderThreads = 256;

// Faults a DiskReader injects (tests). 0 turns each one off.
struct DiskFaultOptions {
  int64_t fail_every_nth_read = 0;   // the Nth read's pread fails with EIO
  int64_t short_every_nth_read = 0;  // the Nth read meets end of file halfway
  int64_t refuse_direct_io = 0;      // 1: O_DIRECT opens fail with EINVAL
  int64_t read_delay_us = 0;         // sleep before each read
};

struct DiskStats {
  uint64_t reads = 0;           // reads that succeeded
  uint64_t bytes = 0;           // requested bytes they delivered
  uint64_t span_bytes = 0;      // bytes they read (aligned spans)
  uint64_t errors = 0;          // reads that failed (a fault of Note [Disk reads])
  uint64_t cancelled = 0;       // reads dropped by Cancel or Close, or discarded
  uint64_t direct_reads = 0;    // successful reads of O_DIRECT files
  uint64_t buffered_reads = 0;  // successful reads of buffered files
  double busy_seconds = 0;      // thread time spent reading, all threads
  uint64_t queued = 0;          // reads waiting for a thread now
  uint64_t in_progress = 0;     // reads a thread is running now
  uint64_t open_files = 0;      // files opened and not closed
};

class DiskReader {
 public:
  // `threads` in 1..kMaxDiskReaderThreads, all started here.
  DiskReader(int threads, bool direct_io, DiskFaultOptions faults = {});
  ~DiskReader();  // Close()
  DiskReader(const DiskReader&) = delete;
  DiskReader& operator=(const DiskReader&) = delete;

  // Opens `path` (Note [Disk reads]) and returns its file index. A path that
  // cannot be opened throws kIoError naming it and the errno's text; one
  // that is not a regular file, kInvalidArgument.
  int OpenFile(const std::string& path) EXCLUDES(mu_);
  // Forgets the index; the descriptor closes once reads queued on it are
  // done.
  void CloseFile(int file) EXCLUDES(mu_);
  DiskFileInfo FileInfo(int file) const EXCLUDES(mu_);
  // Bytes of destination a read of [offset, offset + length) needs (its
  // aligned span); checks the range as Submit does.
  size_t RequiredCapacity(int file, uint64_t offset, uint64_t length) const
      EXCLUDES(mu_);

  // Queues a read of [offset, offset + length) into `dest` (`capacity`
  // bytes, which must stay valid until Wait or Cancel returns for the
  // ticket, or Close). Bad input throws kInvalidArgument, queuing nothing.
  uint64_t Submit(int file, uint64_t offset, uint64_t length, void* dest,
                  size_t capacity) EXCLUDES(mu_);
  // Waits for the read (timeout_s < 0: without limit), forgets the ticket
  // and returns the offset of the requested bytes in dest; throws the
  // read's error, kClosed if Close dropped it, kTimeout (the ticket stays
  // valid), kUnknownId for a ticket not pending.
  size_t Wait(uint64_t ticket, double timeout_s) EXCLUDES(mu_);
  // True when the read has finished (Wait will not block).
  bool Poll(uint64_t ticket) const EXCLUDES(mu_);
  // Drops the read and forgets the ticket: true if it had not started; false
  // if it had (a read in progress is waited for) or had finished; its
  // result is discarded either way.
  bool Cancel(uint64_t ticket) EXCLUDES(mu_);
  // Cancels queued reads, waits for reads in progress, joins the threads,
  // closes the files. Idempotent; later OpenFile/Submit throw kClosed.
  void Close() noexcept EXCLUDES(mu_);
  bool closed() const EXCLUDES(mu_);
  DiskStats GetStats() const EXCLUDES(mu_);
  int thread_count() const { return thread_count_; }
  bool direct_io() const { return direct_io_; }

 private:
  using File = DiskFile;  // disk_io.h; immutable once open

  enum class ReadState { kQueued, kRunning, kDone, kDroppedByClose };

  // A submitted read. Its fields are guarded by mu_ (Note [Disk reads]).
  struct Request {
    std::shared_ptr<const File> file;  // reset once the read is done
    DiskSpan span;
    ReadState state = ReadState::kQueued;
    std::string error;  // empty: the read succeeded
    int sys_errno = 0;
  };

  // What a thread reads, copied out of a Request so that it reads unlocked.
  struct ReadJob {
    std::shared_ptr<const File> file;
    DiskSpan span;
  };
  struct ReadOutcome {
    std::string error;  // empty: success
    int sys_errno = 0;
  };

  void WorkerLoop() EXCLUDES(mu_);
  // Takes the next queued read, marking it running; false once stopping.
  bool NextJobLocked(MutexLock& lk, uint64_t* ticket, ReadJob* job)
      REQUIRES(mu_);
  void FinishLocked(uint64_t ticket, const ReadJob& job, ReadOutcome outcome,
                    double seconds) REQUIRES(mu_);
  ReadOutcome Read(const ReadJob& job) const noexcept;
  const File& FileLocked(int file) const REQUIRES(mu_);
  // The aligned span of a read, after checking it (Submit's checks but
  // dest's).
  void SpanLocked(const File& f, uint64_t offset, uint64_t length,
                  uint64_t* start, size_t* bytes) const REQUIRES(mu_);
  Request& RequestLocked(uint64_t ticket) REQUIRES(mu_);
  const Request& RequestLocked(uint64_t ticket) const REQUIRES(mu_);
  void CheckOpenLocked(const char* call) const REQUIRES(mu_);
  // Before taking mu_: at a fork a thread may have held it (Note [Disk reads]).
  void CheckNotForked() const;

  const int thread_count_;
  const bool direct_io_;
  const DiskFaultOptions faults_;
  const long owner_pid_;  // the process that made the reader
  mutable std::atomic<int64_t> reads_started_{0};  // numbers reads (faults)

  mutable Mutex mu_;
  CondVar work_cv_;  // a read was queued, or stopping
  CondVar done_cv_;  // a read finished, or Close finished
  std::deque<uint64_t> queue_ GUARDED_BY(mu_);  // tickets; stale ones skipped
  std::unordered_map<uint64_t, Request> requests_ GUARDED_BY(mu_);
  std::unordered_map<int, std::shared_ptr<const File>> files_ GUARDED_BY(mu_);
  int next_file_ GUARDED_BY(mu_) = 0;
  uint64_t next_ticket_ GUARDED_BY(mu_) = 1;
  bool closing_ GUARDED_BY(mu_) = false;  // Close has begun
  bool stopping_ GUARDED_BY(mu_) = false;  // threads exit
  bool closed_ GUARDED_BY(mu_) = false;   // Close has finished
  DiskStats stats_ GUARDED_BY(mu_);
  std::vector<std::thread> threads_;  // written by the constructor and Close
};

}  // namespace prefetch
