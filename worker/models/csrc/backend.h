// The libtorch GPU API the shims use (graph.cpp, rtc.cpp), under the names of the backend they are
// built for: CUDA, or HIP when build.rs compiles against a ROCm libtorch (-DVN_HIP, with
// -D__HIP_PLATFORM_AMD__ -DUSE_ROCM as PyTorch's own ROCm build defines them).
//
// ROCm builds of PyTorch are made by hipifying the CUDA sources, and its C++ API for extensions is
// what hipify turns the CUDA names into (torch/utils/hipify/cuda_to_hip_mappings.py, BSD):
// `c10/cuda/CUDAStream.h` becomes `ATen/hip/impl/HIPStreamMasqueradingAsCUDA.h` and
// `c10::cuda::CUDAStream`, `getStreamFromPool`, `getCurrentCUDAStream`, `setCurrentCUDAStream`
// become `c10::hip::HIPStreamMasqueradingAsCUDA`, `getStreamFromPoolMasqueradingAsCUDA`, ...
// (PYTORCH_SPECIFIC_MAPPINGS); `c10/cuda/CUDAFunctions.h` becomes `c10/hip/HIPFunctions.h` and
// `c10::cuda` becomes `c10::hip` (C10_MAPPINGS). The "masquerading" streams report
// DeviceType::CUDA, which is what a ROCm libtorch's tensors and `c10::Event(DeviceType::CUDA)`
// use. The HIP branch below is those replacements applied to the CUDA branch, nothing more.

#pragma once

#if defined(VN_HIP)
#include <ATen/hip/impl/HIPCachingAllocatorMasqueradingAsCUDA.h>
#include <ATen/hip/impl/HIPStreamMasqueradingAsCUDA.h>
#include <c10/hip/HIPFunctions.h>
#else
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace vnfarm_shim::gpu {

#if defined(VN_HIP)

using Stream = c10::hip::HIPStreamMasqueradingAsCUDA;

inline Stream current_stream(c10::DeviceIndex device) {
  return c10::hip::getCurrentHIPStreamMasqueradingAsCUDA(device);
}
inline void set_current_stream(Stream stream) {
  c10::hip::setCurrentHIPStreamMasqueradingAsCUDA(stream);
}
inline Stream stream_from_pool(c10::DeviceIndex device) {
  return c10::hip::getStreamFromPoolMasqueradingAsCUDA(false, device);
}
inline c10::DeviceIndex current_device() { return c10::hip::current_device(); }
inline void set_device(c10::DeviceIndex device) { c10::hip::set_device(device); }
inline void device_synchronize() { c10::hip::device_synchronize(); }
inline void empty_cache() { c10::hip::HIPCachingAllocator::emptyCache(); }
inline constexpr hipStreamCaptureMode kCaptureThreadLocal = hipStreamCaptureModeThreadLocal;

#else

using Stream = c10::cuda::CUDAStream;

inline Stream current_stream(c10::DeviceIndex device) {
  return c10::cuda::getCurrentCUDAStream(device);
}
inline void set_current_stream(Stream stream) { c10::cuda::setCurrentCUDAStream(stream); }
inline Stream stream_from_pool(c10::DeviceIndex device) {
  return c10::cuda::getStreamFromPool(false, device);
}
inline c10::DeviceIndex current_device() { return c10::cuda::current_device(); }
inline void set_device(c10::DeviceIndex device) { c10::cuda::set_device(device); }
inline void device_synchronize() { c10::cuda::device_synchronize(); }
inline void empty_cache() { c10::cuda::CUDACachingAllocator::emptyCache(); }
inline constexpr cudaStreamCaptureMode kCaptureThreadLocal = cudaStreamCaptureModeThreadLocal;

#endif

}  // namespace vnfarm_shim::gpu
