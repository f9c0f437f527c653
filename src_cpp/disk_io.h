// The system-call side of DiskReader (Note [Disk reads] in disk_reader.h):
// opening a file, reading an aligned span of it with pread, and checking
// that the file is still the one that was opened. No locks and no threads:
// DiskReader calls OpenDiskFile from OpenFile and ReadSpan from its reader
// threads, and so does the engine's host tier (Note [Host tier]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace prefetch {

constexpr size_t kDefaultDirectAlignment = 4096;  // when statx says nothing

// A file as it was when it was opened.
struct DiskFileInfo {
  std::string path;
  bool direct = false;   // opened with O_DIRECT (else buffered)
  size_t alignment = 1;  // A of Note [Disk reads]: 1 for a buffered file
  uint64_t size = 0;
  int64_t mtime_ns = 0;
  uint64_t inode = 0;
  uint64_t device = 0;
};

// An open descriptor, closed by the destructor, and the file at open.
struct DiskFile {
  int fd = -1;
  DiskFileInfo info;

  DiskFile() = default;
  DiskFile(const DiskFile&) = delete;
  DiskFile& operator=(const DiskFile&) = delete;
  ~DiskFile();
};

// Opens `path` into `out` (Note [Disk reads]): with O_DIRECT when `direct`,
// buffered when the filesystem refuses it with EINVAL (or when
// `refuse_direct`, which injects that refusal). A path that cannot be opened
// throws kIoError with its errno; one that is not a regular file,
// kInvalidArgument.
void OpenDiskFile(const std::string& path, bool direct, bool refuse_direct,
                  DiskFile* out);

// One read: the span [span_start, span_start + span_bytes) into dest, of
// which the requested [offset, offset + length) starts `lead` bytes in.
struct DiskSpan {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t span_start = 0;
  size_t span_bytes = 0;
  size_t lead = 0;
  void* dest = nullptr;
};

// The span of [offset, offset + length) of `path` widened to multiples of
// `alignment` (1: the range itself), read into `dest`. Throws
// kInvalidArgument when its aligned end overflows or it does not fit in
// memory. REQUIRES: the range inside the file, alignment >= 1.
DiskSpan AlignedSpan(const std::string& path, uint64_t offset, uint64_t length,
                     uint64_t alignment, void* dest);

enum class DiskFault { kNone, kEio, kShortRead };  // injected (tests)

// Reads `span` of `file` (pread until the requested bytes are in, EINTR
// retried), then checks the file is unchanged. Returns "" on success, else
// the error naming the file, offset and length, with *sys_errno set to the
// failed call's errno (0: none failed). Never throws.
std::string ReadSpan(const DiskFile& file, const DiskSpan& span,
                     DiskFault fault, int* sys_errno) noexcept;

// "<path>: read of <length> bytes at offset <offset>".
std::string RangeText(const std::string& path, uint64_t offset,
                      uint64_t length);

}  // namespace prefetch
