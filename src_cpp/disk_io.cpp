// The system calls of the disk reader (disk_io.h).
#include "disk_io.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>

#include "errors.h"

namespace prefetch {
namespace {

std::string ErrnoText(int err) {
  char buf[256];
  // GNU strerror_r (g++ defines _GNU_SOURCE): thread-safe, returns the text.
  const char* text = strerror_r(err, buf, sizeof(buf));
  return text;  // the number is the exception's errno
}

int64_t MtimeNs(const struct stat& st) {
  return static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 +
         st.st_mtim.tv_nsec;
}

// O_NONBLOCK: opening a FIFO (or a device) named as a file must not block
// before the S_ISREG check can refuse it (a FIFO's open waits for a writer,
// with the GIL released: it hung the caller for good). OpenDiskFile clears
// the flag on the regular file it keeps.
int OpenRetrying(const std::string& path, int flags) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// A of Note [Disk reads] for a file opened with O_DIRECT.
size_t DirectAlignment(int fd) {
#ifdef STATX_DIOALIGN
  struct statx stx;
  std::memset(&stx, 0, sizeof(stx));
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) == 0 &&
      (stx.stx_mask & STATX_DIOALIGN) != 0) {
    const size_t a = std::max<size_t>(stx.stx_dio_mem_align,
                                      stx.stx_dio_offset_align);
    if (a > 0 && (a & (a - 1)) == 0 && a <= (size_t{1} << 20)) return a;
  }
#else
  (void)fd;
#endif
  return kDefaultDirectAlignment;
}

// Empty when the descriptor and the path still show the file as it was at
// open; else what changed (Note [Disk reads]).
std::string ChangedSinceOpen(int fd, const DiskFileInfo& info) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    return "fstat of the open file failed: " + ErrnoText(errno);
  }
  std::string diff;
  auto add = [&diff](const std::string& what) {
    diff += (diff.empty() ? "" : ", ") + what;
  };
  if (static_cast<uint64_t>(st.st_size) != info.size) {
    add("size " + std::to_string(info.size) + " -> " +
        std::to_string(st.st_size) + " bytes");
  }
  if (MtimeNs(st) != info.mtime_ns) add("mtime changed");
  if (static_cast<uint64_t>(st.st_ino) != info.inode) add("inode changed");
  if (!diff.empty()) {
    return "the file changed since it was opened (" + diff + ")";
  }
  struct stat now;
  if (::stat(info.path.c_str(), &now) != 0) {
    return "the path no longer names the file that was opened (stat: " +
           ErrnoText(errno) + "): it was removed or renamed since";
  }
  if (static_cast<uint64_t>(now.st_ino) != info.inode ||
      static_cast<uint64_t>(now.st_dev) != info.device) {
    return "the path now names another file (inode " +
           std::to_string(now.st_ino) + ", opened as inode " +
           std::to_string(info.inode) + "): it was replaced since it was "
           "opened";
  }
  return "";
}

// pread into the span until the requested bytes are in, or end of file (at
// `eof` bytes into the span, for an injected short read), or an error:
// returns the bytes read, *err the errno (0: none).
size_t ReadLoop(const DiskFile& f, const DiskSpan& s, size_t eof,
                bool inject_eio, int* err) {
  const size_t need = s.lead + s.length;  // bytes up to offset + length
  char* dest = static_cast<char*>(s.dest);
  size_t done = 0;
  *err = 0;
  while (done < need && done < eof) {
    ssize_t n = -1;
    if (inject_eio) {
      errno = EIO;  // as a failing device answers
    } else {
      n = ::pread(f.fd, dest + done, eof - done,
                  static_cast<off_t>(s.span_start + done));
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *err = errno;
      break;
    }
    if (n == 0) break;  // end of file
    done += static_cast<size_t>(n);
  }
  return done;
}

}  // namespace

DiskFile::~DiskFile() {
  if (fd >= 0) ::close(fd);
}

std::string RangeText(const std::string& path, uint64_t offset,
                      uint64_t length) {
  return path + ": read of " + std::to_string(length) + " bytes at offset " +
         std::to_string(offset);
}

DiskSpan AlignedSpan(const std::string& path, uint64_t offset, uint64_t length,
                     uint64_t alignment, void* dest) {
  const uint64_t a = alignment;
  const uint64_t end = offset + length;  // inside the file: no overflow
  uint64_t end_up = 0;
  if (__builtin_add_overflow(end, a - 1, &end_up)) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        RangeText(path, offset, length) +
                            ": its aligned end overflows");
  }
  end_up -= end_up % a;
  DiskSpan span;
  span.offset = offset;
  span.length = length;
  span.span_start = offset - offset % a;
  const uint64_t bytes = end_up - span.span_start;
  if (bytes > std::numeric_limits<size_t>::max()) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        RangeText(path, offset, length) +
                            ": its span does not fit in memory");
  }
  span.span_bytes = static_cast<size_t>(bytes);
  span.lead = static_cast<size_t>(offset - span.span_start);
  span.dest = dest;
  return span;
}

void OpenDiskFile(const std::string& path, bool direct, bool refuse_direct,
                  DiskFile* out) {
  // open(2) reads the path up to its first NUL: "a\0b" would open "a".
  if (path.empty() || path.find('\0') != std::string::npos) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        "a file path must be non-empty, without NUL bytes");
  }
  int err = 0;
  if (direct) {
    if (refuse_direct) {
      err = EINVAL;  // as a filesystem without O_DIRECT answers
    } else {
      out->fd = OpenRetrying(path, O_RDONLY | O_DIRECT | O_CLOEXEC);
      err = out->fd < 0 ? errno : 0;
    }
  }
  const bool got_direct = out->fd >= 0;
  if (out->fd < 0 && (!direct || err == EINVAL)) {
    out->fd = OpenRetrying(path, O_RDONLY | O_CLOEXEC);
    err = out->fd < 0 ? errno : 0;
  }
  if (out->fd < 0) {
    throw PrefetchError(ErrorKind::kIoError,
                        path + ": cannot open: " + ErrnoText(err), err);
  }
  struct stat st;
  if (::fstat(out->fd, &st) != 0) {
    err = errno;
    throw PrefetchError(ErrorKind::kIoError,
                        path + ": fstat failed: " + ErrnoText(err), err);
  }
  if (!S_ISREG(st.st_mode)) {
    throw PrefetchError(ErrorKind::kInvalidArgument,
                        path + ": not a regular file");
  }
  const int flags = ::fcntl(out->fd, F_GETFL);
  if (flags < 0 || ::fcntl(out->fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    err = errno;
    throw PrefetchError(ErrorKind::kIoError,
                        path + ": fcntl failed: " + ErrnoText(err), err);
  }
  DiskFileInfo& info = out->info;
  info.path = path;
  info.direct = got_direct;
  info.alignment = got_direct ? DirectAlignment(out->fd) : 1;
  info.size = static_cast<uint64_t>(st.st_size);
  info.mtime_ns = MtimeNs(st);
  info.inode = static_cast<uint64_t>(st.st_ino);
  info.device = static_cast<uint64_t>(st.st_dev);
}

std::string ReadSpan(const DiskFile& f, const DiskSpan& s, DiskFault fault,
                     int* sys_errno) noexcept {
  *sys_errno = 0;
  try {
    const size_t need = s.lead + s.length;
    // End of the readable bytes, relative to span_start: halfway for an
    // injected short read.
    size_t eof = s.span_bytes;
    if (fault == DiskFault::kShortRead) {
      eof = need / 2 - need / 2 % f.info.alignment;
    }
    int err = 0;
    const size_t done = ReadLoop(f, s, eof, fault == DiskFault::kEio, &err);
    const std::string what = RangeText(f.info.path, s.offset, s.length);
    const std::string changed = ChangedSinceOpen(f.fd, f.info);
    const std::string and_changed = changed.empty() ? "" : "; " + changed;
    if (err != 0) {
      *sys_errno = err;
      return what + " failed: pread: " + ErrnoText(err) +
             (fault == DiskFault::kEio ? " (injected)" : "") + and_changed;
    }
    if (done < need) {
      const size_t got = done > s.lead ? done - s.lead : 0;
      return what + " failed: short read: end of file after " +
             std::to_string(got) + " of the " + std::to_string(s.length) +
             " bytes (the file had " + std::to_string(f.info.size) +
             " bytes when opened" +
             (fault == DiskFault::kShortRead ? "; injected" : "") + ")" +
             and_changed;
    }
    if (!changed.empty()) return what + " failed: " + changed;
    return "";
  } catch (...) {  // std::bad_alloc building a message: still an error
    *sys_errno = ENOMEM;
    return "out of memory";  // short: no allocation
  }
}

}  // namespace prefetch
