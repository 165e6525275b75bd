// Kernels compiled at run time for vnfarm-models (src/nn/ops.rs, src/nn/fused.rs): CUDA C source
// compiled by NVRTC for the device's architecture, loaded as a module with the driver API and
// launched on libtorch's current stream (so that CUDA graph capture records them).
//
// Nothing here links libcuda or libnvrtc. Both are reached as libtorch's own jiterator reaches
// them: through libcaffe2_nvrtc.so, the stub library beside libtorch that depends on both. The
// PyPI wheel does not ship the stub's header (ATen/cuda/nvrtc_stub/ATenNVRTC.h), so the functions
// are looked up by name in that library's dependency tree (dlsym), typed from the CUDA wheel's
// own cuda.h and nvrtc.h. A program that never compiles a kernel never loads them.
//
// Errors come back through `guarded` (guarded.h), freed with vn_ops_error_free (ops.cpp).

#include "guarded.h"

#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <dlfcn.h>
#include <nvrtc.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace {


// The NVRTC and driver entry points used here, resolved once.
struct Api {
  decltype(&::nvrtcCreateProgram) nvrtcCreateProgram;
  decltype(&::nvrtcCompileProgram) nvrtcCompileProgram;
  decltype(&::nvrtcGetProgramLogSize) nvrtcGetProgramLogSize;
  decltype(&::nvrtcGetProgramLog) nvrtcGetProgramLog;
  decltype(&::nvrtcGetCUBINSize) nvrtcGetCUBINSize;
  decltype(&::nvrtcGetCUBIN) nvrtcGetCUBIN;
  decltype(&::nvrtcDestroyProgram) nvrtcDestroyProgram;
  decltype(&::nvrtcGetErrorString) nvrtcGetErrorString;
  decltype(&::cuGetErrorString) cuGetErrorString;
  decltype(&::cuCtxGetCurrent) cuCtxGetCurrent;
  decltype(&::cuCtxSetCurrent) cuCtxSetCurrent;
  decltype(&::cuDevicePrimaryCtxRetain) cuDevicePrimaryCtxRetain;
  decltype(&::cuDeviceGetAttribute) cuDeviceGetAttribute;
  decltype(&::cuModuleLoadData) cuModuleLoadData;
  decltype(&::cuModuleGetFunction) cuModuleGetFunction;
  decltype(&::cuLaunchKernel) cuLaunchKernel;
};

template <typename F>
void resolve(void* lib, const char* name, F& out) {
  void* f = dlsym(lib, name);
  if (f == nullptr) {
    throw std::runtime_error(std::string("libcaffe2_nvrtc.so has no ") + name);
  }
  out = reinterpret_cast<F>(f);
}

const Api& api() {
  static Api a;
  static std::string failure;
  static std::once_flag once;
  std::call_once(once, [] {
    try {
      void* lib = dlopen("libcaffe2_nvrtc.so", RTLD_NOW | RTLD_GLOBAL);
      if (lib == nullptr) {
        const char* e = dlerror();
        throw std::runtime_error(std::string("cannot load libtorch's NVRTC stub: ") +
                                 (e != nullptr ? e : "libcaffe2_nvrtc.so not found"));
      }
      resolve(lib, "nvrtcCreateProgram", a.nvrtcCreateProgram);
      resolve(lib, "nvrtcCompileProgram", a.nvrtcCompileProgram);
      resolve(lib, "nvrtcGetProgramLogSize", a.nvrtcGetProgramLogSize);
      resolve(lib, "nvrtcGetProgramLog", a.nvrtcGetProgramLog);
      resolve(lib, "nvrtcGetCUBINSize", a.nvrtcGetCUBINSize);
      resolve(lib, "nvrtcGetCUBIN", a.nvrtcGetCUBIN);
      resolve(lib, "nvrtcDestroyProgram", a.nvrtcDestroyProgram);
      resolve(lib, "nvrtcGetErrorString", a.nvrtcGetErrorString);
      resolve(lib, "cuGetErrorString", a.cuGetErrorString);
      resolve(lib, "cuCtxGetCurrent", a.cuCtxGetCurrent);
      resolve(lib, "cuCtxSetCurrent", a.cuCtxSetCurrent);
      // cuda.h maps the names below to their current versioned symbols.
      resolve(lib, "cuDevicePrimaryCtxRetain", a.cuDevicePrimaryCtxRetain);
      resolve(lib, "cuDeviceGetAttribute", a.cuDeviceGetAttribute);
      resolve(lib, "cuModuleLoadData", a.cuModuleLoadData);
      resolve(lib, "cuModuleGetFunction", a.cuModuleGetFunction);
      resolve(lib, "cuLaunchKernel", a.cuLaunchKernel);
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) {
    throw std::runtime_error(failure);
  }
  return a;
}

std::string cu_error(const Api& a, CUresult r) {
  const char* s = nullptr;
  a.cuGetErrorString(r, &s);
  return s != nullptr ? std::string(s) : "CUDA driver error " + std::to_string(static_cast<int>(r));
}

void check(const Api& a, CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error(std::string(what) + ": " + cu_error(a, r));
  }
}

// Makes `device`'s primary context (the one the CUDA runtime, hence libtorch, uses) current on
// this thread for the driver API.
void use_primary_context(const Api& a, int device) {
  CUcontext ctx = nullptr;
  check(a, a.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {
    check(a, a.cuDevicePrimaryCtxRetain(&ctx, device), "cuDevicePrimaryCtxRetain");
    check(a, a.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  }
}

// Makes `device` libtorch's current device for the scope (c10's CUDAGuard header pulls in
// CUDA runtime calls this shim does not link).
class DeviceScope {
 public:
  explicit DeviceScope(int device) : previous_(c10::cuda::current_device()) {
    c10::cuda::set_device(static_cast<c10::DeviceIndex>(device));
  }
  ~DeviceScope() { c10::cuda::set_device(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::DeviceIndex previous_;
};

}  // namespace

using vnfarm_shim::guarded;

extern "C" {

// Compiles `source` for `device`, loads it into the device's primary context and looks up the
// `count` kernels named in `names` (extern "C" names), writing their CUfunction handles to
// `functions`. Modules stay loaded for the life of the process.
char* vn_rtc_build(const char* source, const char* program_name, int device, const char** names,
                   int count, void** functions) {
  return guarded([&] {
    const Api& a = api();
    DeviceScope scope(device);
    use_primary_context(a, device);
    int major = 0, minor = 0;
    check(a, a.cuDeviceGetAttribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
          "cuDeviceGetAttribute");
    check(a, a.cuDeviceGetAttribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
          "cuDeviceGetAttribute");
    const std::string arch =
        "--gpu-architecture=sm_" + std::to_string(major) + std::to_string(minor);
    nvrtcProgram prog;
    nvrtcResult r = a.nvrtcCreateProgram(&prog, source, program_name, 0, nullptr, nullptr);
    if (r != NVRTC_SUCCESS) {
      throw std::runtime_error(std::string("nvrtcCreateProgram: ") + a.nvrtcGetErrorString(r));
    }
    std::vector<const char*> opts = {arch.c_str(), "--std=c++17"};
    r = a.nvrtcCompileProgram(prog, static_cast<int>(opts.size()), opts.data());
    if (r != NVRTC_SUCCESS) {
      size_t n = 0;
      a.nvrtcGetProgramLogSize(prog, &n);
      std::string log(n, '\0');
      a.nvrtcGetProgramLog(prog, log.data());
      a.nvrtcDestroyProgram(&prog);
      throw std::runtime_error(std::string("NVRTC could not compile ") + program_name + " for " +
                               arch + ": " + a.nvrtcGetErrorString(r) + "\n" + log);
    }
    size_t size = 0;
    a.nvrtcGetCUBINSize(prog, &size);
    std::vector<char> cubin(size);
    a.nvrtcGetCUBIN(prog, cubin.data());
    a.nvrtcDestroyProgram(&prog);
    CUmodule module;
    check(a, a.cuModuleLoadData(&module, cubin.data()), "cuModuleLoadData");
    for (int i = 0; i < count; ++i) {
      CUfunction f;
      check(a, a.cuModuleGetFunction(&f, module, names[i]), names[i]);
      functions[i] = reinterpret_cast<void*>(f);
    }
  });
}

// Launches `function` on `device`'s current stream with `args` (pointers to each argument's
// value, as cuLaunchKernel takes them).
char* vn_rtc_launch(void* function, int device, unsigned grid_x, unsigned grid_y, unsigned block_x,
                    unsigned block_y, unsigned shared_bytes, void** args) {
  return guarded([&] {
    const Api& a = api();
    DeviceScope scope(device);
    use_primary_context(a, device);
    cudaStream_t stream =
        c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
    check(a,
          a.cuLaunchKernel(reinterpret_cast<CUfunction>(function), grid_x, grid_y, 1, block_x,
                           block_y, 1, shared_bytes, stream, args, nullptr),
          "cuLaunchKernel");
  });
}

}  // extern "C"
