// ATen operators that tch's C API binds wrongly or not at all, for vnfarm-models (src/nn/ops.rs).
//
// `vn_addmm_gelu`: `at::_addmm_activation(bias, mat1, mat2, 1, 1, /*use_gelu=*/true)`, GELU in the
// matmul's epilogue (cuBLASLt where libtorch uses it, else the matmul and then the GELU). tch 0.24's
// binding (`atg__addmm_activation`) passes `use_gelu` in the place of `beta`, so through tch the GELU
// is never applied.
//
// `vn_profile_start` / `vn_profile_stop`: libtorch's Kineto profiler (what torch.profiler drives),
// which tch does not bind: CPU operators and, with `cuda`, GPU kernels, saved as a Chrome trace.
//
// Tensors cross as tch's handles (`at::Tensor*`, allocated with `new`, freed by tch with `delete`).
// C++ exceptions come back as a malloc'd message (NULL on success), freed with vn_ops_error_free.

#include "guarded.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <set>
#include <stdexcept>
#include <string>

using vnfarm_shim::guarded;

extern "C" {

void vn_ops_error_free(char* e) { std::free(e); }

char* vn_profile_start(int cuda) {
  return guarded([&] {
    using torch::profiler::impl::ActivityType;
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda != 0) {
      activities.insert(ActivityType::CUDA);
    }
    torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  });
}

char* vn_profile_stop(const char* path) {
  return guarded([&] {
    auto result = torch::autograd::profiler::disableProfiler();
    if (!result) {
      throw std::runtime_error("the profiler was not running");
    }
    result->save(path);
  });
}

char* vn_addmm_gelu(void* bias, void* mat1, void* mat2, void** out) {
  *out = nullptr;
  return guarded([&] {
    auto* b = static_cast<at::Tensor*>(bias);
    auto* m1 = static_cast<at::Tensor*>(mat1);
    auto* m2 = static_cast<at::Tensor*>(mat2);
    *out = new at::Tensor(at::_addmm_activation(*b, *m1, *m2, 1, 1, true));
  });
}

}  // extern "C"
