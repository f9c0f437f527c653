// The CUDA copy backend, loaded at run time.
//
// Building and importing prefetch needs no CUDA toolkit: this file declares
// the few driver-API types it uses and resolves the functions from
// libcuda.so.1 with dlopen when a handle asks for the CUDA backend (as
// PyTorch and Triton do). It works on each device's *primary* context, the
// one the CUDA runtime and so PyTorch use, so torch streams and tensors and
// our events interoperate.
//
// Per device it owns two non-blocking copy streams (normal priority for
// prefetches, the highest priority for on-demand band-0 copies) and a pool of
// timing-disabled events that serve as completion tokens (Note [Completion
// tokens] in copy_backend.h). Host memory is page-locked with cuMemHostAlloc
// at its exact size (rounded to a page by the driver, never to a power of
// two).
//
// Threads: copies run on the engine's worker threads, which bind the primary
// context once. Calls from other threads (acquire/release/query from Python)
// push the device's context for the call and pop it after, so the caller's
// current context (torch's current device) is left as it was.
// Lock: `mu_` guards the lazily built per-device state and the event pool.
#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "copy_backend.h"
#include "errors.h"

namespace prefetch {
namespace {

// ---- the slice of cuda.h this backend uses (driver ABI, stable) ----
using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
using CUcontext = CUctx_st*;
using CUstream = CUstream_st*;
using CUevent = CUevent_st*;

constexpr CUresult kCudaSuccess = 0;
constexpr CUresult kCudaErrorNotReady = 600;
constexpr unsigned kStreamNonBlocking = 0x1;    // CU_STREAM_NON_BLOCKING
constexpr unsigned kEventDisableTiming = 0x2;   // CU_EVENT_DISABLE_TIMING
constexpr unsigned kMemHostAllocPortable = 0x1; // CU_MEMHOSTALLOC_PORTABLE

struct DriverApi {
  void* library = nullptr;
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int*);
  CUresult (*cuDeviceGet)(CUdevice*, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
  CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxGetCurrent)(CUcontext*);
  CUresult (*cuCtxPushCurrent)(CUcontext);
  CUresult (*cuCtxPopCurrent)(CUcontext*);
  CUresult (*cuCtxGetStreamPriorityRange)(int*, int*);
  CUresult (*cuStreamCreateWithPriority)(CUstream*, unsigned, int);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamWaitEvent)(CUstream, CUevent, unsigned);
  CUresult (*cuEventCreate)(CUevent*, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuEventSynchronize)(CUevent);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
  CUresult (*cuMemHostAlloc)(void**, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void*);
  CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuGetErrorString)(CUresult, const char**);
  CUresult (*cuMemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream);
};

template <typename Fn>
void Resolve(void* library, const char* name, Fn* out) {
  void* symbol = dlsym(library, name);
  if (symbol == nullptr) {
    throw PrefetchError(ErrorKind::kUnavailable,
                        std::string("libcuda.so.1 lacks ") + name);
  }
  *out = reinterpret_cast<Fn>(symbol);
}

struct Token {
  CUevent event = nullptr;  // recorded on a copy or consumer stream
  int device = 0;           // whose context the event belongs to
  CUcontext context = nullptr;  // that context (set once, at creation)
  std::atomic<int> refs{0};  // holders; back to the pool at zero
};

class CudaBackend final : public CopyBackend {
 public:
  CudaBackend() {
    api_.library = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (api_.library == nullptr) {
      const char* why = dlerror();
      throw PrefetchError(ErrorKind::kUnavailable,
                          std::string("CUDA driver not found (libcuda.so.1): ") +
                              (why ? why : "dlopen failed"));
    }
    try {
      void* l = api_.library;
      Resolve(l, "cuInit", &api_.cuInit);
      Resolve(l, "cuDeviceGetCount", &api_.cuDeviceGetCount);
      Resolve(l, "cuDeviceGet", &api_.cuDeviceGet);
      Resolve(l, "cuDevicePrimaryCtxRetain", &api_.cuDevicePrimaryCtxRetain);
      Resolve(l, "cuDevicePrimaryCtxRelease_v2", &api_.cuDevicePrimaryCtxRelease);
      Resolve(l, "cuCtxSetCurrent", &api_.cuCtxSetCurrent);
      Resolve(l, "cuCtxGetCurrent", &api_.cuCtxGetCurrent);
      Resolve(l, "cuCtxPushCurrent_v2", &api_.cuCtxPushCurrent);
      Resolve(l, "cuCtxPopCurrent_v2", &api_.cuCtxPopCurrent);
      Resolve(l, "cuCtxGetStreamPriorityRange", &api_.cuCtxGetStreamPriorityRange);
      Resolve(l, "cuStreamCreateWithPriority", &api_.cuStreamCreateWithPriority);
      Resolve(l, "cuStreamDestroy_v2", &api_.cuStreamDestroy);
      Resolve(l, "cuStreamSynchronize", &api_.cuStreamSynchronize);
      Resolve(l, "cuStreamWaitEvent", &api_.cuStreamWaitEvent);
      Resolve(l, "cuEventCreate", &api_.cuEventCreate);
      Resolve(l, "cuEventDestroy_v2", &api_.cuEventDestroy);
      Resolve(l, "cuEventRecord", &api_.cuEventRecord);
      Resolve(l, "cuEventQuery", &api_.cuEventQuery);
      Resolve(l, "cuEventSynchronize", &api_.cuEventSynchronize);
      Resolve(l, "cuMemcpyHtoDAsync_v2", &api_.cuMemcpyHtoDAsync);
      Resolve(l, "cuMemHostAlloc", &api_.cuMemHostAlloc);
      Resolve(l, "cuMemFreeHost", &api_.cuMemFreeHost);
      Resolve(l, "cuMemAlloc_v2", &api_.cuMemAlloc);
      Resolve(l, "cuMemFree_v2", &api_.cuMemFree);
      Resolve(l, "cuGetErrorString", &api_.cuGetErrorString);
      Resolve(l, "cuMemsetD8Async", &api_.cuMemsetD8Async);
      CUresult r = api_.cuInit(0);
      if (r != kCudaSuccess) {
        throw PrefetchError(ErrorKind::kUnavailable,
                            "cuInit failed: " + ErrorText(r));
      }
      int count = 0;
      r = api_.cuDeviceGetCount(&count);
      if (r != kCudaSuccess || count <= 0) {
        throw PrefetchError(ErrorKind::kUnavailable, "no CUDA device found");
      }
      devices_.resize(static_cast<size_t>(count));
    } catch (...) {
      dlclose(api_.library);
      throw;
    }
  }

  ~CudaBackend() override {
    for (size_t d = 0; d < devices_.size(); ++d) {
      Device& dev = devices_[d];
      if (dev.context == nullptr) continue;
      ContextGuard guard(this, static_cast<int>(d));
      for (CUstream s : dev.lanes) {
        if (s) api_.cuStreamSynchronize(s);
      }
      if (dev.urgent) api_.cuStreamSynchronize(dev.urgent);
      for (auto& t : dev.all_tokens) api_.cuEventDestroy(t->event);
      for (CUstream s : dev.lanes) {
        if (s) api_.cuStreamDestroy(s);
      }
      if (dev.urgent) api_.cuStreamDestroy(dev.urgent);
    }
    for (size_t d = 0; d < devices_.size(); ++d) {
      if (devices_[d].context != nullptr) {
        api_.cuDevicePrimaryCtxRelease(devices_[d].cu_device);
      }
    }
    // Tokens still handed out belong to entries the engine already waited
    // on and released; all were returned before the engine dropped us.
    // libcuda stays loaded: unloading the driver under torch is never safe.
  }

  const char* Name() const override { return "cuda"; }
  bool IsAsync() const override { return true; }
  int DeviceCount() const override { return static_cast<int>(devices_.size()); }

  void BindWorkerThread(int device) override {
    Device& dev = Prepare(device);
    Check(api_.cuCtxSetCurrent(dev.context), "cuCtxSetCurrent");
  }

  void* AllocateHost(size_t bytes) override {
    ContextGuard guard(this, 0);
    void* p = nullptr;
    CUresult r = api_.cuMemHostAlloc(&p, bytes, kMemHostAllocPortable);
    if (r != kCudaSuccess || p == nullptr) {
      throw PrefetchError(ErrorKind::kOutOfMemory,
                          "could not page-lock " + std::to_string(bytes) +
                              " bytes of host memory: " + ErrorText(r));
    }
    return p;
  }

  void FreeHost(void* ptr, size_t) noexcept override {
    if (ptr == nullptr) return;
    try {
      ContextGuard guard(this, 0);
      api_.cuMemFreeHost(ptr);
    } catch (...) {
    }
  }

  void* AllocateDevice(int device, size_t bytes) override {
    ContextGuard guard(this, device);
    CUdeviceptr p = 0;
    CUresult r = api_.cuMemAlloc(&p, bytes);
    if (r != kCudaSuccess) {
      throw PrefetchError(ErrorKind::kOutOfMemory,
                          "could not allocate " + std::to_string(bytes) +
                              " bytes on device " + std::to_string(device) +
                              ": " + ErrorText(r));
    }
    return reinterpret_cast<void*>(static_cast<uintptr_t>(p));
  }

  void FreeDevice(int device, void* ptr, size_t) noexcept override {
    try {
      ContextGuard guard(this, device);
      api_.cuMemFree(static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(ptr)));
    } catch (...) {
    }
  }

  CopyToken Copy(int device, void* dst, const void* src, size_t bytes,
                 bool urgent, int lane, bool want_token) override {
    Device& dev = Prepare(device);
    ContextGuard guard(this, device);
    CUstream stream = urgent ? dev.urgent : LaneStream(device, dev, lane);
    CUresult r = api_.cuMemcpyHtoDAsync(
        static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(dst)), src, bytes,
        stream);
    if (r != kCudaSuccess) {
      throw PrefetchError(ErrorKind::kCopyFailed,
                          "cuMemcpyHtoDAsync failed: " + ErrorText(r));
    }
    if (!want_token) return kTokenDone;
    return Record(device, stream);
  }

  // Never throws (the engine queries under its lock, also on worker
  // threads): an error, a sticky context failure say, counts as done so
  // nothing waits forever on it; Wait reports it.
  bool Query(CopyToken token) override {
    if (token == kTokenDone) return true;
    Token* t = AsToken(token);
    try {
      ContextGuard guard(this, t->context);
      return api_.cuEventQuery(t->event) != kCudaErrorNotReady;
    } catch (...) {
      return true;
    }
  }

  void Wait(CopyToken token) override {
    if (token == kTokenDone) return;
    Token* t = AsToken(token);
    ContextGuard guard(this, t->context);
    CUresult r = api_.cuEventSynchronize(t->event);
    if (r != kCudaSuccess) {
      throw PrefetchError(ErrorKind::kCopyFailed,
                          "cuEventSynchronize failed: " + ErrorText(r));
    }
  }

  void ReleaseToken(CopyToken token) noexcept override {
    if (token == kTokenDone) return;
    Token* t = AsToken(token);
    if (t->refs.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    std::lock_guard<std::mutex> lk(mu_);
    devices_[static_cast<size_t>(t->device)].free_tokens.push_back(t);
  }

  void RetainToken(CopyToken token) noexcept override {
    if (token == kTokenDone) return;
    AsToken(token)->refs.fetch_add(1, std::memory_order_relaxed);
  }

  void StreamWait(uintptr_t stream, CopyToken token) override {
    if (token == kTokenDone) return;
    Token* t = AsToken(token);
    ContextGuard guard(this, t->context);
    Check(api_.cuStreamWaitEvent(reinterpret_cast<CUstream>(stream), t->event,
                                 0),
          "cuStreamWaitEvent");
  }

  CopyToken RecordOnStream(int device, uintptr_t stream) override {
    Prepare(device);
    ContextGuard guard(this, device);
    return Record(device, reinterpret_cast<CUstream>(stream));
  }

  // Debug poisoning: on lane 0, then waited for, so no copy stream can write
  // the slot before the fill is done.
  void Fill(int device, void* dst, size_t bytes, uint8_t value) override {
    Device& dev = Prepare(device);
    ContextGuard guard(this, device);
    Check(api_.cuMemsetD8Async(
              static_cast<CUdeviceptr>(reinterpret_cast<uintptr_t>(dst)),
              value, bytes, dev.normal),
          "cuMemsetD8Async");
    Check(api_.cuStreamSynchronize(dev.normal), "cuStreamSynchronize");
  }

  void HoldCopiesUntil(int device, uintptr_t stream) override {
    Device& dev = Prepare(device);
    ContextGuard guard(this, device);
    const CopyToken gate = Record(device, reinterpret_cast<CUstream>(stream));
    Token* t = AsToken(gate);
    CUresult r = api_.cuStreamWaitEvent(dev.urgent, t->event, 0);
    for (int lane = 0; lane < kMaxCopyLanes && r == kCudaSuccess; ++lane) {
      r = api_.cuStreamWaitEvent(LaneStream(device, dev, lane), t->event, 0);
    }
    ReleaseToken(gate);  // the waits hold their own reference to the record
    Check(r, "cuStreamWaitEvent");
  }

 private:
  struct Device {
    CUdevice cu_device = 0;
    CUcontext context = nullptr;         // retained primary context
    CUstream normal = nullptr;           // prefetch copies, lane 0
    CUstream lanes[kMaxCopyLanes] = {};  // prefetch lanes (lanes[0] == normal)
    int least_priority = 0;              // stream priority of the lanes
    CUstream urgent = nullptr;           // on-demand copies (highest priority)
    std::vector<Token*> free_tokens;     // pooled events, GUARDED_BY(mu_)
    std::vector<std::unique_ptr<Token>> all_tokens;  // owner of every token
  };

  // Makes a device's primary context current for one scope, restoring the
  // caller's context afterwards (no-op when it is already current).
  class ContextGuard {
   public:
    ContextGuard(CudaBackend* backend, int device)
        : ContextGuard(backend, backend->Prepare(device).context) {}
    // A token's own context: no Prepare, so no lock (the queries of a
    // layer's pins run this once per resident expert).
    ContextGuard(CudaBackend* backend, CUcontext want) : backend_(backend) {
      CUcontext current = nullptr;
      backend->api_.cuCtxGetCurrent(&current);
      if (current != want) {
        backend->Check(backend->api_.cuCtxPushCurrent(want), "cuCtxPushCurrent");
        pushed_ = true;
      }
    }
    ~ContextGuard() {
      if (pushed_) {
        CUcontext popped = nullptr;
        backend_->api_.cuCtxPopCurrent(&popped);
      }
    }

   private:
    CudaBackend* backend_;
    bool pushed_ = false;
  };

  static Token* AsToken(CopyToken token) {
    return reinterpret_cast<Token*>(static_cast<uintptr_t>(token));
  }

  std::string ErrorText(CUresult r) const {
    const char* text = nullptr;
    if (api_.cuGetErrorString != nullptr) api_.cuGetErrorString(r, &text);
    return std::string(text ? text : "unknown error") + " (CUresult " +
           std::to_string(r) + ")";
  }

  void Check(CUresult r, const char* what) const {
    if (r != kCudaSuccess) {
      throw PrefetchError(ErrorKind::kCopyFailed,
                          std::string(what) + " failed: " + ErrorText(r));
    }
  }

  // Retains the primary context and makes the streams on first use.
  Device& Prepare(int device) {
    if (device < 0 || static_cast<size_t>(device) >= devices_.size()) {
      throw PrefetchError(ErrorKind::kInvalidArgument,
                          "no CUDA device " + std::to_string(device));
    }
    std::lock_guard<std::mutex> lk(mu_);
    Device& dev = devices_[static_cast<size_t>(device)];
    if (dev.normal != nullptr) return dev;
    if (dev.context == nullptr) {
      Check(api_.cuDeviceGet(&dev.cu_device, device), "cuDeviceGet");
      Check(api_.cuDevicePrimaryCtxRetain(&dev.context, dev.cu_device),
            "cuDevicePrimaryCtxRetain");
    }
    CUcontext current = nullptr;
    api_.cuCtxGetCurrent(&current);
    const bool push = current != dev.context;
    if (push) Check(api_.cuCtxPushCurrent(dev.context), "cuCtxPushCurrent");
    int least = 0, greatest = 0;
    CUresult r = api_.cuCtxGetStreamPriorityRange(&least, &greatest);
    if (r == kCudaSuccess) {
      r = api_.cuStreamCreateWithPriority(&dev.normal, kStreamNonBlocking, least);
      dev.lanes[0] = dev.normal;
      dev.least_priority = least;
    }
    if (r == kCudaSuccess) {
      r = api_.cuStreamCreateWithPriority(&dev.urgent, kStreamNonBlocking,
                                          greatest);
    }
    if (push) {
      CUcontext popped = nullptr;
      api_.cuCtxPopCurrent(&popped);
    }
    if (r != kCudaSuccess) {
      throw PrefetchError(ErrorKind::kUnavailable,
                          "could not create copy streams on device " +
                              std::to_string(device) + ": " + ErrorText(r));
    }
    return dev;
  }

  // The stream of prefetch lane `lane`, made on first use.
  // REQUIRES: the device's context current.
  CUstream LaneStream(int device, Device& dev, int lane) {
    if (lane <= 0 || lane >= kMaxCopyLanes) return dev.normal;
    std::lock_guard<std::mutex> lk(mu_);
    if (dev.lanes[lane] == nullptr) {
      CUresult r = api_.cuStreamCreateWithPriority(
          &dev.lanes[lane], kStreamNonBlocking, dev.least_priority);
      if (r != kCudaSuccess) {
        dev.lanes[lane] = nullptr;
        throw PrefetchError(ErrorKind::kCopyFailed,
                            "could not create copy lane " +
                                std::to_string(lane) + " on device " +
                                std::to_string(device) + ": " + ErrorText(r));
      }
    }
    return dev.lanes[lane];
  }

  // REQUIRES: the device's context current.
  CopyToken Record(int device, CUstream stream) {
    Token* t = nullptr;
    CUcontext context = nullptr;
    {
      std::lock_guard<std::mutex> lk(mu_);
      Device& dev = devices_[static_cast<size_t>(device)];
      context = dev.context;
      if (!dev.free_tokens.empty()) {
        t = dev.free_tokens.back();
        dev.free_tokens.pop_back();
      }
    }
    if (t == nullptr) {
      auto fresh = std::make_unique<Token>();
      fresh->device = device;
      fresh->context = context;
      Check(api_.cuEventCreate(&fresh->event, kEventDisableTiming),
            "cuEventCreate");
      t = fresh.get();
      std::lock_guard<std::mutex> lk(mu_);
      devices_[static_cast<size_t>(device)].all_tokens.push_back(
          std::move(fresh));
    }
    t->refs.store(1, std::memory_order_relaxed);
    CUresult r = api_.cuEventRecord(t->event, stream);
    if (r != kCudaSuccess) {
      ReleaseToken(reinterpret_cast<uintptr_t>(t));
      throw PrefetchError(ErrorKind::kCopyFailed,
                          "cuEventRecord failed: " + ErrorText(r));
    }
    return reinterpret_cast<uintptr_t>(t);
  }

  DriverApi api_;
  std::mutex mu_;                // guards devices_' lazy state and pools
  std::vector<Device> devices_;  // one per driver device
};

}  // namespace

std::unique_ptr<CopyBackend> MakeCudaBackend() {
  return std::make_unique<CudaBackend>();
}

}  // namespace prefetch
