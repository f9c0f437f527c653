// DiskReader (disk_reader.h): the file table, checking and queuing reads,
// tickets, the reader threads and the injected faults; the system calls are
// in disk_io.cpp.
#include "disk_reader.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <utility>

namespace prefetch {

namespace {

// True when `call` (1-based) is a multiple of n > 0 (as host_backend.cpp).
bool NthCall(int64_t n, int64_t call) { return n > 0 && call % n == 0; }

}  // namespace

DiskReader::DiskReader(int threads, bool direct_io, DiskFaultOptions faults)
    : thread_count_(threads),
      direct_io_(direct_io),
      faults_(faults),
      owner_pid_(static_cast<long>(::getpid())) {
  if (threads < 1 || threads > kMaxDiskReaderThreads) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "threads must be in 1.." +
                            std::to_string(kMaxDiskReaderThreads) + ", got " +
                            std::to_string(threads));
  }
  const int64_t settings[] = {faults.fail_every_nth_read,
                              faults.short_every_nth_read,
                              faults.refuse_direct_io, faults.read_delay_us};
  for (int64_t v : settings) {
    if (v < 0) {
      throw PrefetchError(ErrorKind::kInvalidArgument,
                          "disk reader fault settings must be >= 0");
    }
  }
  threads_.reserve(threads);
  try {
    for (int i = 0; i < threads; ++i) {
      threads_.emplace_back([this] { WorkerLoop(); });
    }
  } catch (...) {
    Close();  // joins the threads that did start
    throw;
  }
}

DiskReader::~DiskReader() { Close(); }

void DiskReader::CheckNotForked() const {
  if (static_cast<long>(::getpid()) != owner_pid_) {
    throw PrefetchError(ErrorKind::kClosed,
                        "DiskReader used in a forked child process; its "
                        "threads exist only in the parent. Create a new one");
  }
}

void DiskReader::CheckOpenLocked(const char* call) const {
  if (closing_) {
    throw PrefetchError(ErrorKind::kClosed,
                        std::string("DiskReader is closed (") + call + ")");
  }
}

int DiskReader::OpenFile(const std::string& path) {
  CheckNotForked();
  {
    MutexGuard lk(mu_);
    CheckOpenLocked("OpenFile");
  }
  if (path.empty() || path.find('\0') != std::string::npos) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "a file path must be non-empty, without NUL bytes");
  }
  auto file = std::make_shared<File>();
  OpenDiskFile(path, direct_io_, faults_.refuse_direct_io > 0, file.get());
  MutexGuard lk(mu_);
  CheckOpenLocked("OpenFile");  // closed meanwhile: `file` closes its fd
  if (next_file_ == std::numeric_limits<int>::max()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "DiskReader ran out of file indices");
  }
  const int index = next_file_;
  files_.emplace(index, std::move(file));
  ++next_file_;
  return index;
}

const DiskReader::File& DiskReader::FileLocked(int file) const {
  auto it = files_.find(file);
  if (it == files_.end()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "unknown file index " + std::to_string(file) +
                            " (never opened, or closed)");
  }
  return *it->second;
}

void DiskReader::CloseFile(int file) {
  CheckNotForked();
  std::shared_ptr<const File> last;  // destroyed (fd closed) after unlocking
  MutexGuard lk(mu_);
  CheckOpenLocked("CloseFile");
  FileLocked(file);  // throws for an unknown index
  auto it = files_.find(file);
  last = std::move(it->second);
  files_.erase(it);
}

DiskFileInfo DiskReader::FileInfo(int file) const {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckOpenLocked("FileInfo");
  return FileLocked(file).info;
}

void DiskReader::SpanLocked(const File& f, uint64_t offset, uint64_t length,
                            uint64_t* start, size_t* bytes) const {
  const DiskFileInfo& info = f.info;
  if (length == 0) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        RangeText(info.path, offset, length) +
                            ": the length must be > 0");
  }
  if (offset > info.size || length > info.size - offset) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        RangeText(info.path, offset, length) +
                            " runs past the end of the file (" +
                            std::to_string(info.size) +
                            " bytes when it was opened)");
  }
  const DiskSpan span =
      AlignedSpan(info.path, offset, length, info.alignment, nullptr);
  *start = span.span_start;
  *bytes = span.span_bytes;
}

size_t DiskReader::RequiredCapacity(int file, uint64_t offset,
                                    uint64_t length) const {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckOpenLocked("RequiredCapacity");
  uint64_t start = 0;
  size_t bytes = 0;
  SpanLocked(FileLocked(file), offset, length, &start, &bytes);
  return bytes;
}

uint64_t DiskReader::Submit(int file, uint64_t offset, uint64_t length,
                            void* dest, size_t capacity) {
  CheckNotForked();
  MutexGuard lk(mu_);
  CheckOpenLocked("Submit");
  const File& f = FileLocked(file);
  uint64_t start = 0;
  size_t bytes = 0;
  SpanLocked(f, offset, length, &start, &bytes);
  const std::string what = RangeText(f.info.path, offset, length);
  if (dest == nullptr) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        what + ": the destination is a null pointer");
  }
  const size_t a = f.info.alignment;
  if (reinterpret_cast<uintptr_t>(dest) % a != 0) {
    char addr[32];
    std::snprintf(addr, sizeof(addr), "%p", dest);
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        what + ": the destination address " + addr +
                            " is not a multiple of " + std::to_string(a) +
                            " (O_DIRECT reads need aligned buffers)");
  }
  if (capacity < bytes) {
    throw PrefetchError(
        ErrorKind::kInvalidArgument,
        what + " needs a destination of " + std::to_string(bytes) +
            " bytes (the span [" + std::to_string(start) + ", " +
            std::to_string(start + bytes) + ") aligned to " +
            std::to_string(a) + "), got " + std::to_string(capacity));
  }
  const uint64_t ticket = next_ticket_;
  Request& r = requests_[ticket];  // may throw: nothing changed yet
  try {
    queue_.push_back(ticket);
  } catch (...) {
    requests_.erase(ticket);
    throw;
  }
  ++next_ticket_;
  r.file = files_.at(file);
  r.span.offset = offset;
  r.span.length = length;
  r.span.span_start = start;
  r.span.span_bytes = bytes;
  r.span.lead = static_cast<size_t>(offset - start);
  r.span.dest = dest;
  ++stats_.queued;
  work_cv_.notify_one();
  return ticket;
}

DiskReader::Request& DiskReader::RequestLocked(uint64_t ticket) {
  auto it = requests_.find(ticket);
  if (it == requests_.end()) {
    throw PrefetchError(ErrorKind::kUnknownId,
                        "ticket " + std::to_string(ticket) +
                            " is not pending (already waited for or "
                            "cancelled, or never submitted)");
  }
  return it->second;
}

const DiskReader::Request& DiskReader::RequestLocked(uint64_t ticket) const {
  return const_cast<DiskReader*>(this)->RequestLocked(ticket);
}

size_t DiskReader::Wait(uint64_t ticket, double timeout_s) {
  CheckNotForked();
  if (std::isnan(timeout_s)) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "timeout must be a number of seconds, got NaN");
  }
  using Clock = std::chrono::steady_clock;
  const bool forever = timeout_s < 0 || timeout_s > 1e9;
  const auto deadline =
      Clock::now() + std::chrono::duration_cast<Clock::duration>(
                         std::chrono::duration<double>(forever ? 0 : timeout_s));
  MutexLock lk(mu_);
  for (;;) {
    const Request& r = RequestLocked(ticket);
    if (r.state == ReadState::kDone || r.state == ReadState::kDroppedByClose) {
      break;
    }
    if (!forever && Clock::now() >= deadline) {
      throw PrefetchError(
          ErrorKind::kTimeout,
          "ticket " + std::to_string(ticket) + ": " +
              RangeText(r.file->info.path, r.span.offset, r.span.length) + " is still " +
              (r.state == ReadState::kQueued ? "queued" : "in progress") +
              " after " + std::to_string(timeout_s) + " s");
    }
    if (forever) {
      done_cv_.wait(lk);
    } else {
      done_cv_.wait_until(lk, deadline);
    }
  }
  auto it = requests_.find(ticket);
  Request r = std::move(it->second);
  requests_.erase(it);
  if (r.state == ReadState::kDroppedByClose) {
    throw PrefetchError(ErrorKind::kClosed,
                        "ticket " + std::to_string(ticket) +
                            ": the DiskReader was closed before its read ran");
  }
  if (!r.error.empty()) {
    throw PrefetchError(ErrorKind::kIoError, r.error, r.sys_errno);
  }
  return r.span.lead;
}

bool DiskReader::Poll(uint64_t ticket) const {
  CheckNotForked();
  MutexGuard lk(mu_);
  const ReadState s = RequestLocked(ticket).state;
  return s == ReadState::kDone || s == ReadState::kDroppedByClose;
}

bool DiskReader::Cancel(uint64_t ticket) {
  CheckNotForked();
  std::shared_ptr<const File> last;  // destroyed (fd closed) after unlocking
  MutexLock lk(mu_);
  Request* r = &RequestLocked(ticket);
  const bool dropped = r->state == ReadState::kQueued;
  if (dropped) {
    --stats_.queued;  // its stale queue entry is skipped by the threads
    ++stats_.cancelled;
  } else if (r->state == ReadState::kRunning) {
    ++stats_.cancelled;
    for (;;) {  // the read finishes into dest; wait so dest is free after
      done_cv_.wait(lk);
      auto it = requests_.find(ticket);
      if (it == requests_.end()) return false;  // a Wait took the outcome
      r = &it->second;
      if (r->state != ReadState::kRunning) break;
    }
  }
  last = std::move(r->file);
  requests_.erase(ticket);
  return dropped;
}

void DiskReader::Close() noexcept {
  if (static_cast<long>(::getpid()) != owner_pid_) {
    for (std::thread& t : threads_) {  // they exist only in the parent
      if (t.joinable()) t.detach();
    }
    return;
  }
  std::unordered_map<int, std::shared_ptr<const File>> files;
  std::vector<std::thread> threads;
  {
    MutexLock lk(mu_);
    if (closing_) {  // another Close: wait until it has finished
      while (!closed_) done_cv_.wait(lk);
      return;
    }
    closing_ = true;
    for (auto& entry : requests_) {
      Request& r = entry.second;
      if (r.state != ReadState::kQueued) continue;
      r.state = ReadState::kDroppedByClose;
      r.file.reset();
      ++stats_.cancelled;
    }
    stats_.queued = 0;
    queue_.clear();
    done_cv_.notify_all();  // waiters of dropped reads throw kClosed
    while (stats_.in_progress > 0) done_cv_.wait(lk);
    stopping_ = true;
    work_cv_.notify_all();
    files.swap(files_);
    threads.swap(threads_);  // only the first Close gets here
  }
  for (std::thread& t : threads) {
    if (t.joinable()) t.join();
  }
  files.clear();  // closes the descriptors
  MutexGuard lk(mu_);
  closed_ = true;
  done_cv_.notify_all();
}

bool DiskReader::closed() const {
  CheckNotForked();
  MutexGuard lk(mu_);
  return closing_;
}

DiskStats DiskReader::GetStats() const {
  CheckNotForked();
  MutexGuard lk(mu_);
  DiskStats s = stats_;
  s.open_files = files_.size();
  return s;
}

bool DiskReader::NextJobLocked(MutexLock& lk, uint64_t* ticket, ReadJob* job) {
  for (;;) {
    while (!stopping_ && queue_.empty()) work_cv_.wait(lk);
    if (stopping_) return false;
    const uint64_t t = queue_.front();
    queue_.pop_front();
    auto it = requests_.find(t);
    if (it == requests_.end() || it->second.state != ReadState::kQueued) {
      continue;  // cancelled while queued
    }
    Request& r = it->second;
    r.state = ReadState::kRunning;
    --stats_.queued;
    ++stats_.in_progress;
    *ticket = t;
    *job = ReadJob{r.file, r.span};
    return true;
  }
}

void DiskReader::FinishLocked(uint64_t ticket, const ReadJob& job,
                              ReadOutcome outcome, double seconds) {
  --stats_.in_progress;
  stats_.busy_seconds += seconds;
  if (outcome.error.empty()) {
    ++stats_.reads;
    stats_.bytes += job.span.length;
    stats_.span_bytes += job.span.span_bytes;
    ++(job.file->info.direct ? stats_.direct_reads : stats_.buffered_reads);
  } else {
    ++stats_.errors;
  }
  // Always present: Cancel and Close wait for a running read, and Wait
  // takes only finished ones.
  auto it = requests_.find(ticket);
  if (it != requests_.end()) {
    Request& r = it->second;
    r.state = ReadState::kDone;
    r.error = std::move(outcome.error);
    r.sys_errno = outcome.sys_errno;
    r.file.reset();  // `job` still holds it: not the last reference
  }
  done_cv_.notify_all();
}

void DiskReader::WorkerLoop() {
  MutexLock lk(mu_);
  for (;;) {
    uint64_t ticket = 0;
    ReadJob job{};
    if (!NextJobLocked(lk, &ticket, &job)) return;
    lk.unlock();
    const auto t0 = std::chrono::steady_clock::now();
    ReadOutcome outcome = Read(job);
    const std::chrono::duration<double> took =
        std::chrono::steady_clock::now() - t0;
    lk.lock();
    FinishLocked(ticket, job, std::move(outcome), took.count());
    lk.unlock();
    job.file.reset();  // may be the last reference: close the fd unlocked
    lk.lock();
  }
}

DiskReader::ReadOutcome DiskReader::Read(const ReadJob& job) const noexcept {
  const int64_t call = ++reads_started_;
  if (faults_.read_delay_us > 0) {
    std::this_thread::sleep_for(
        std::chrono::microseconds(faults_.read_delay_us));
  }
  DiskFault fault = DiskFault::kNone;
  if (NthCall(faults_.fail_every_nth_read, call)) {
    fault = DiskFault::kEio;
  } else if (NthCall(faults_.short_every_nth_read, call)) {
    fault = DiskFault::kShortRead;
  }
  ReadOutcome out;
  out.error = ReadSpan(*job.file, job.span, fault, &out.sys_errno);
  return out;
}

}  // namespace prefetch
