// Kernels compiled at run time for vnfarm-models (src/nn/ops.rs, src/nn/fused.rs): CUDA C source
// compiled for the device's architecture by NVRTC (CUDA) or hiprtc (ROCm, built with -DVN_HIP),
// loaded as a module with the driver API (CUDA) or HIP's module API, and launched on libtorch's
// current stream (so that graph capture records them).
//
// Nothing here links libcuda, libnvrtc, libamdhip64 or libhiprtc. They are reached as libtorch's
// own jiterator reaches them: through libcaffe2_nvrtc.so, the stub library beside libtorch. Its
// one export is `load_nvrtc()`, a table of function pointers whose layout is in a header the PyPI
// wheel does not ship (ATen/cuda/nvrtc_stub/ATenNVRTC.h) and which changes with the CUDA version.
// What the stub imports, though, is linked into it: `nm -D libcaffe2_nvrtc.so` on the torch 2.11
// CUDA 13 wheel lists `U cuLaunchKernel`, `U cuModuleLoadData`, `U cuLinkCreate_v2`, ...
// and `U nvrtcCompileProgram@libnvrtc.so.13`, with libnvrtc.so.13 and libcuda.so.1 as its
// DT_NEEDED libraries. dlsym on the stub's handle searches the stub and then those dependencies,
// so it finds each function under the symbol its header maps the name to. VN_RESOLVE looks up
// exactly that symbol: it stringifies the name after macro expansion, so `cuLinkCreate` would be
// looked up as `cuLinkCreate_v2` (cuda.h's #define) and `hipGetDeviceProperties` as
// `hipGetDevicePropertiesR0600` (HIP 6's #define), the same function the field's type (decltype)
// names. Of the CUDA functions used here, CUDA 13's cuda.h maps only cuLaunchKernel, to itself
// (`_ptsz` under per-thread default streams, which neither PyTorch nor this shim compiles with).
//
// On ROCm the same stub is backed by hiprtc and HIP (PyTorch source, read 2026-12-01, BSD):
// - caffe2/CMakeLists.txt, `if(USE_ROCM)`: "caffe2_nvrtc's stubs to driver APIs are useful for
//   HIP", `add_library(caffe2_nvrtc SHARED ${ATen_NVRTC_STUB_SRCS})`,
//   `target_link_libraries(caffe2_nvrtc hip::amdhip64 hiprtc::hiprtc)`, compiled with
//   `USE_ROCM __HIP_PLATFORM_AMD__`: the ROCm stub's dependencies are libamdhip64 and libhiprtc.
// - aten/src/ATen/cuda/nvrtc_stub/ATenNVRTC.h: `#if !defined(USE_ROCM)` the CUDA list
//   (AT_FORALL_NVRTC_BASE ... nvrtcGetCUBIN); `#else`, NOTE [ ATen NVRTC Stub and HIP ], a shorter
//   AT_FORALL_NVRTC: nvrtcVersion, nvrtcCreateProgram, nvrtcAddNameExpression,
//   nvrtcDestroyProgram, nvrtcGetPTXSize, nvrtcGetPTX, cuModuleLoadData, cuModuleLoad,
//   cuGetErrorString, cuModuleGetFunction, the occupancy query, nvrtcGetErrorString,
//   nvrtcGetProgramLogSize, nvrtcGetProgramLog, cuLaunchKernel, nvrtcCompileProgram,
//   cuCtxGetCurrent, nvrtcGetLoweredName, cuModuleUnload, cuDevicePrimaryCtxGetState. A ROCm build
//   compiles the hipified copy (ATen/hip/nvrtc_stub/ATenNVRTC.h), where hipify
//   (torch/utils/hipify/cuda_to_hip_mappings.py) has renamed them to hiprtcCreateProgram,
//   hiprtcGetCodeSize, hiprtcGetCode, hipModuleLoadData, hipModuleGetFunction,
//   hipModuleLaunchKernel, hipCtxGetCurrent, ...: the symbols the ROCm stub imports.
// - aten/src/ATen/native/cuda/jit_utils.cpp (the jiterator): `#ifdef USE_ROCM` the compile options
//   are just `--std=c++17` (no architecture: hiprtc then compiles for the current device), kernels
//   are cached per `prop->gcnArchName`, and the same code then calls nvrtcGetPTXSize / nvrtcGetPTX
//   (hiprtcGetCodeSize / hiprtcGetCode: no CUBIN functions on ROCm), cuModuleLoadData,
//   cuModuleGetFunction and cuLaunchKernel on the current stream.
// So the HIP path resolves hiprtcCreateProgram, hiprtcCompileProgram, hiprtcGetProgramLog(Size),
// hiprtcGetCode(Size), hiprtcDestroyProgram, hiprtcGetErrorString, hipModuleLoadData,
// hipModuleGetFunction, hipModuleLaunchKernel, and from libamdhip64 hipDeviceGetAttribute,
// hipGetDeviceProperties and hipGetErrorString. It names the architecture explicitly,
// `--offload-arch=<gcnArchName>` of the device being compiled for (the `sm_XX` of CUDA), and
// passes the device's wavefront width as `-DVN_WARP=32|64` (kernels/norms.cu). HIP has no
// primary-context step: hipModuleLoadData loads into the current device, which DeviceScope sets.
//
// Every return code is checked; a failure is thrown and comes back through `guarded` (guarded.h),
// freed with vn_ops_error_free (ops.cpp).

#include "backend.h"
#include "guarded.h"

#if defined(VN_HIP)
#include <hip/hip_runtime_api.h>
#include <hip/hiprtc.h>
#else
#include <cuda.h>
#include <nvrtc.h>
#endif
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

namespace {

namespace gpu = vnfarm_shim::gpu;

#if defined(VN_HIP)
using RtcProgram = hiprtcProgram;
using RtcResult = hiprtcResult;
constexpr RtcResult kRtcSuccess = HIPRTC_SUCCESS;
using DriverResult = hipError_t;
constexpr DriverResult kDriverSuccess = hipSuccess;
using Module = hipModule_t;
using Function = hipFunction_t;
constexpr const char* kCompiler = "hiprtc";
constexpr const char* kDriver = "HIP";
#else
using RtcProgram = nvrtcProgram;
using RtcResult = nvrtcResult;
constexpr RtcResult kRtcSuccess = NVRTC_SUCCESS;
using DriverResult = CUresult;
constexpr DriverResult kDriverSuccess = CUDA_SUCCESS;
using Module = CUmodule;
using Function = CUfunction;
constexpr const char* kCompiler = "NVRTC";
constexpr const char* kDriver = "CUDA driver";
#endif

// The compiler and driver entry points used here, resolved once, named by what they do.
struct Api {
#if defined(VN_HIP)
  decltype(&::hiprtcCreateProgram) create_program;
  decltype(&::hiprtcCompileProgram) compile_program;
  decltype(&::hiprtcGetProgramLogSize) program_log_size;
  decltype(&::hiprtcGetProgramLog) program_log;
  decltype(&::hiprtcGetCodeSize) code_size;
  decltype(&::hiprtcGetCode) code;
  decltype(&::hiprtcDestroyProgram) destroy_program;
  decltype(&::hiprtcGetErrorString) rtc_error_string;
  decltype(&::hipGetErrorString) driver_error_string;
  decltype(&::hipDeviceGetAttribute) device_attribute;
  decltype(&::hipGetDeviceProperties) device_properties;
  decltype(&::hipModuleLoadData) module_load_data;
  decltype(&::hipModuleGetFunction) module_get_function;
  decltype(&::hipModuleLaunchKernel) launch_kernel;
#else
  decltype(&::nvrtcCreateProgram) create_program;
  decltype(&::nvrtcCompileProgram) compile_program;
  decltype(&::nvrtcGetProgramLogSize) program_log_size;
  decltype(&::nvrtcGetProgramLog) program_log;
  decltype(&::nvrtcGetCUBINSize) code_size;
  decltype(&::nvrtcGetCUBIN) code;
  decltype(&::nvrtcDestroyProgram) destroy_program;
  decltype(&::nvrtcGetErrorString) rtc_error_string;
  decltype(&::cuGetErrorString) driver_error_string;
  decltype(&::cuDeviceGetAttribute) device_attribute;
  decltype(&::cuCtxGetCurrent) ctx_get_current;
  decltype(&::cuCtxSetCurrent) ctx_set_current;
  decltype(&::cuDevicePrimaryCtxRetain) primary_ctx_retain;
  decltype(&::cuModuleLoadData) module_load_data;
  decltype(&::cuModuleGetFunction) module_get_function;
  decltype(&::cuLaunchKernel) launch_kernel;
#endif
};

void resolve_symbol(void* lib, const char* symbol, void** out) {
  *out = dlsym(lib, symbol);
  if (*out == nullptr) {
    throw std::runtime_error(std::string("libcaffe2_nvrtc.so and its dependencies have no ") +
                             symbol);
  }
}

// `field` = the function `fn` names in the headers, looked up under the symbol `fn` expands to.
#define VN_SYMBOL_TEXT(x) #x
#define VN_SYMBOL(x) VN_SYMBOL_TEXT(x)
#define VN_RESOLVE(lib, field, fn)                                                  \
  do {                                                                              \
    static_assert(std::is_same_v<decltype(field), decltype(&::fn)>, "type of " #fn); \
    void* vn_f = nullptr;                                                           \
    resolve_symbol(lib, VN_SYMBOL(fn), &vn_f);                                      \
    field = reinterpret_cast<decltype(&::fn)>(vn_f);                                \
  } while (0)

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
#if defined(VN_HIP)
      VN_RESOLVE(lib, a.create_program, hiprtcCreateProgram);
      VN_RESOLVE(lib, a.compile_program, hiprtcCompileProgram);
      VN_RESOLVE(lib, a.program_log_size, hiprtcGetProgramLogSize);
      VN_RESOLVE(lib, a.program_log, hiprtcGetProgramLog);
      VN_RESOLVE(lib, a.code_size, hiprtcGetCodeSize);
      VN_RESOLVE(lib, a.code, hiprtcGetCode);
      VN_RESOLVE(lib, a.destroy_program, hiprtcDestroyProgram);
      VN_RESOLVE(lib, a.rtc_error_string, hiprtcGetErrorString);
      VN_RESOLVE(lib, a.driver_error_string, hipGetErrorString);
      VN_RESOLVE(lib, a.device_attribute, hipDeviceGetAttribute);
      VN_RESOLVE(lib, a.device_properties, hipGetDeviceProperties);
      VN_RESOLVE(lib, a.module_load_data, hipModuleLoadData);
      VN_RESOLVE(lib, a.module_get_function, hipModuleGetFunction);
      VN_RESOLVE(lib, a.launch_kernel, hipModuleLaunchKernel);
#else
      VN_RESOLVE(lib, a.create_program, nvrtcCreateProgram);
      VN_RESOLVE(lib, a.compile_program, nvrtcCompileProgram);
      VN_RESOLVE(lib, a.program_log_size, nvrtcGetProgramLogSize);
      VN_RESOLVE(lib, a.program_log, nvrtcGetProgramLog);
      VN_RESOLVE(lib, a.code_size, nvrtcGetCUBINSize);
      VN_RESOLVE(lib, a.code, nvrtcGetCUBIN);
      VN_RESOLVE(lib, a.destroy_program, nvrtcDestroyProgram);
      VN_RESOLVE(lib, a.rtc_error_string, nvrtcGetErrorString);
      VN_RESOLVE(lib, a.driver_error_string, cuGetErrorString);
      VN_RESOLVE(lib, a.device_attribute, cuDeviceGetAttribute);
      VN_RESOLVE(lib, a.ctx_get_current, cuCtxGetCurrent);
      VN_RESOLVE(lib, a.ctx_set_current, cuCtxSetCurrent);
      VN_RESOLVE(lib, a.primary_ctx_retain, cuDevicePrimaryCtxRetain);
      VN_RESOLVE(lib, a.module_load_data, cuModuleLoadData);
      VN_RESOLVE(lib, a.module_get_function, cuModuleGetFunction);
      VN_RESOLVE(lib, a.launch_kernel, cuLaunchKernel);
#endif
    } catch (const std::exception& e) {
      failure = e.what();
    }
  });
  if (!failure.empty()) {
    throw std::runtime_error(failure);
  }
  return a;
}

std::string rtc_error(const Api& a, RtcResult r) {
  const char* s = a.rtc_error_string(r);
  return s != nullptr ? std::string(s) : "compiler error " + std::to_string(static_cast<int>(r));
}

std::string driver_error(const Api& a, DriverResult r) {
  const char* s = nullptr;
#if defined(VN_HIP)
  s = a.driver_error_string(r);
#else
  if (a.driver_error_string(r, &s) != CUDA_SUCCESS) {
    s = nullptr;
  }
#endif
  return s != nullptr ? std::string(s) : "driver error " + std::to_string(static_cast<int>(r));
}

void check(const Api& a, DriverResult r, const std::string& what) {
  if (r != kDriverSuccess) {
    throw std::runtime_error(std::string(kDriver) + " " + what + ": " + driver_error(a, r));
  }
}

void check(const Api& a, RtcResult r, const std::string& what) {
  if (r != kRtcSuccess) {
    throw std::runtime_error(std::string(kCompiler) + " " + what + ": " + rtc_error(a, r));
  }
}

// A compiler program, destroyed on every path: explicitly (and checked) on success, by the
// destructor when an error is already on its way out (a second failure there would only hide it).
class Program {
 public:
  Program(const Api& a, const char* source, const char* name) : a_(a) {
    check(a_, a_.create_program(&prog_, source, name, 0, nullptr, nullptr), "create program");
  }
  ~Program() {
    if (prog_ != nullptr) {
      a_.destroy_program(&prog_);
    }
  }
  Program(const Program&) = delete;
  Program& operator=(const Program&) = delete;

  // Compiles with `options`; a failure carries the compiler's log.
  void compile(const std::vector<std::string>& options, const std::string& what) {
    std::vector<const char*> opts;
    for (const auto& o : options) {
      opts.push_back(o.c_str());
    }
    const RtcResult r = a_.compile_program(prog_, static_cast<int>(opts.size()), opts.data());
    if (r != kRtcSuccess) {
      throw std::runtime_error(std::string(kCompiler) + " could not compile " + what + ": " +
                               rtc_error(a_, r) + "\n" + log());
    }
  }

  // The compiled code object (CUBIN, or an AMD HSA code object).
  std::vector<char> code() {
    size_t size = 0;
    check(a_, a_.code_size(prog_, &size), "code size");
    std::vector<char> out(size);
    check(a_, a_.code(prog_, out.data()), "code");
    return out;
  }

  void destroy() {
    RtcProgram p = prog_;
    prog_ = nullptr;
    check(a_, a_.destroy_program(&p), "destroy program");
  }

 private:
  std::string log() {
    size_t n = 0;
    const RtcResult r = a_.program_log_size(prog_, &n);
    if (r != kRtcSuccess) {
      return "(no compile log: " + rtc_error(a_, r) + ")";
    }
    std::string text(n, '\0');
    const RtcResult got = a_.program_log(prog_, text.data());
    if (got != kRtcSuccess) {
      return "(no compile log: " + rtc_error(a_, got) + ")";
    }
    return text;
  }

  const Api& a_;
  RtcProgram prog_ = nullptr;
};

// Makes `device` libtorch's current device for the scope (c10's device guard header pulls in
// runtime calls this shim does not link).
class DeviceScope {
 public:
  explicit DeviceScope(int device) : previous_(gpu::current_device()) {
    gpu::set_device(static_cast<c10::DeviceIndex>(device));
  }
  ~DeviceScope() { gpu::set_device(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  c10::DeviceIndex previous_;
};

#if defined(VN_HIP)

// HIP loads modules into the current device; there is no context to make current.
void use_device_context(const Api&, int) {}

int warp_size(const Api& a, int device) {
  int lanes = 0;
  check(a, a.device_attribute(&lanes, hipDeviceAttributeWarpSize, device), "hipDeviceGetAttribute");
  return lanes;
}

// The device's target (e.g. gfx1151, or gfx90a:sramecc+:xnack- with its features) and wavefront
// width, as the kernels' source reads it.
std::vector<std::string> compile_options(const Api& a, int device, int warp) {
  hipDeviceProp_t prop;
  std::memset(&prop, 0, sizeof prop);
  check(a, a.device_properties(&prop, device), "hipGetDeviceProperties");
  return {std::string("--offload-arch=") + prop.gcnArchName, "--std=c++17",
          "-DVN_WARP=" + std::to_string(warp)};
}

#else

// Makes `device`'s primary context (the one the CUDA runtime, hence libtorch, uses) current on
// this thread for the driver API.
void use_device_context(const Api& a, int device) {
  CUcontext ctx = nullptr;
  check(a, a.ctx_get_current(&ctx), "cuCtxGetCurrent");
  if (ctx == nullptr) {
    check(a, a.primary_ctx_retain(&ctx, device), "cuDevicePrimaryCtxRetain");
    check(a, a.ctx_set_current(ctx), "cuCtxSetCurrent");
  }
}

// 32 on every CUDA GPU, which the kernels' source assumes on CUDA (VN_WARP's default).
int warp_size(const Api& a, int device) {
  int lanes = 0;
  check(a, a.device_attribute(&lanes, CU_DEVICE_ATTRIBUTE_WARP_SIZE, device),
        "cuDeviceGetAttribute");
  if (lanes != 32) {
    throw std::runtime_error("CUDA device " + std::to_string(device) + " reports " +
                             std::to_string(lanes) + "-lane warps, not 32");
  }
  return lanes;
}

// The device's SASS architecture; VN_WARP keeps the source's default.
std::vector<std::string> compile_options(const Api& a, int device, int /*warp: always 32*/) {
  int major = 0, minor = 0;
  check(a, a.device_attribute(&major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, device),
        "cuDeviceGetAttribute");
  check(a, a.device_attribute(&minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, device),
        "cuDeviceGetAttribute");
  return {"--gpu-architecture=sm_" + std::to_string(major) + std::to_string(minor), "--std=c++17"};
}

#endif

}  // namespace

using vnfarm_shim::guarded;

extern "C" {

// Compiles `source` for `device`, loads it (into the device's primary context on CUDA) and looks
// up the `count` kernels named in `names` (extern "C" names), writing their function handles to
// `functions` and the device's warp width (32, or 64 on CDNA GPUs) to `warp`. Modules stay loaded
// for the life of the process.
char* vn_rtc_build(const char* source, const char* program_name, int device, const char** names,
                   int count, void** functions, int* warp) {
  return guarded([&] {
    const Api& a = api();
    DeviceScope scope(device);
    use_device_context(a, device);
    const int lanes = warp_size(a, device);
    const std::vector<std::string> options = compile_options(a, device, lanes);
    Program prog(a, source, program_name);
    prog.compile(options, std::string(program_name) + " for " + options[0]);
    const std::vector<char> code = prog.code();
    prog.destroy();
    Module module;
    check(a, a.module_load_data(&module, code.data()), "load module");
    for (int i = 0; i < count; ++i) {
      Function f;
      check(a, a.module_get_function(&f, module, names[i]), std::string("function ") + names[i]);
      functions[i] = reinterpret_cast<void*>(f);
    }
    *warp = lanes;
  });
}

// Launches `function` on `device`'s current stream with `args` (pointers to each argument's
// value, as cuLaunchKernel and hipModuleLaunchKernel take them).
char* vn_rtc_launch(void* function, int device, unsigned grid_x, unsigned grid_y, unsigned block_x,
                    unsigned block_y, unsigned shared_bytes, void** args) {
  return guarded([&] {
    const Api& a = api();
    DeviceScope scope(device);
    use_device_context(a, device);
    auto stream = gpu::current_stream(static_cast<c10::DeviceIndex>(device)).stream();
    check(a,
          a.launch_kernel(reinterpret_cast<Function>(function), grid_x, grid_y, 1, block_x,
                          block_y, 1, shared_bytes, stream, args, nullptr),
          "launch kernel");
  });
}

}  // extern "C"
