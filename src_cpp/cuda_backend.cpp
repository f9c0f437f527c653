#include "copy_backend.h"
#include "errors.h"

namespace prefetch {

std::unique_ptr<CopyBackend> MakeCudaBackend() {
  throw PrefetchError(ErrorKind::kUnavailable,
                      "the CUDA backend is not built in this version");
}

}  // namespace prefetch
