// What norms.cu and qwen_block.cu take from hiprtc's built-in header, written on clang's AMDGPU builtins, so that
// tests/parity/fused_kernels_hip_compile.rs can compile the kernels as HIP device code with a plain clang
// (`-x hip --cuda-device-only -nogpuinc -nogpulib`, no ROCm install). Each definition does what
// HIP's own (hip/amd_detail/*.h) does: the same barrier and fences, and __shfl_xor's source lane
// as amd_warp_functions.h computes it, through ds_bpermute.
#pragma once

#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __shared__ __attribute__((shared))
#define __forceinline__ __inline__ __attribute__((always_inline))

struct __attribute__((aligned(16))) uint4 {
  unsigned int x, y, z, w;
};
struct __attribute__((aligned(16))) float4 {
  float x, y, z, w;
};

struct vn_dim3 {
  unsigned x, y, z;
};
__device__ __forceinline__ vn_dim3 vn_thread_idx() {
  return {__builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(),
          __builtin_amdgcn_workitem_id_z()};
}
__device__ __forceinline__ vn_dim3 vn_block_idx() {
  return {__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),
          __builtin_amdgcn_workgroup_id_z()};
}
__device__ __forceinline__ vn_dim3 vn_block_dim() {
  return {__builtin_amdgcn_workgroup_size_x(), __builtin_amdgcn_workgroup_size_y(),
          __builtin_amdgcn_workgroup_size_z()};
}
__device__ __forceinline__ vn_dim3 vn_grid_dim() {
  return {__builtin_amdgcn_grid_size_x() / __builtin_amdgcn_workgroup_size_x(),
          __builtin_amdgcn_grid_size_y() / __builtin_amdgcn_workgroup_size_y(),
          __builtin_amdgcn_grid_size_z() / __builtin_amdgcn_workgroup_size_z()};
}
#define threadIdx (vn_thread_idx())
#define blockIdx (vn_block_idx())
#define blockDim (vn_block_dim())
#define gridDim (vn_grid_dim())

__device__ __forceinline__ void __syncthreads() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

__device__ __forceinline__ float __uint_as_float(unsigned int u) {
  return __builtin_bit_cast(float, u);
}
__device__ __forceinline__ unsigned int __float_as_uint(float f) {
  return __builtin_bit_cast(unsigned int, f);
}
__device__ __forceinline__ float __expf(float x) { return __builtin_expf(x); }
// HIP's (amd_detail/amd_math_functions.h) are OCML's correctly rounded square root and exp.
__device__ __forceinline__ float sqrtf(float x) { return __builtin_sqrtf(x); }
__device__ __forceinline__ float expf(float x) { return __builtin_expf(x); }
__device__ __forceinline__ float rsqrtf(float x) { return __builtin_amdgcn_rsqf(x); }
__device__ __forceinline__ double sqrt(double x) { return __builtin_sqrt(x); }
__device__ __forceinline__ int min(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ float fmaxf(float a, float b) { return __builtin_fmaxf(a, b); }
__device__ __forceinline__ float rintf(float x) { return __builtin_rintf(x); }

__device__ __forceinline__ float __shfl_xor(float var, int lane_mask, int width) {
  const int self = __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
  int index = self ^ lane_mask;
  index = index >= ((self + width) & ~(width - 1)) ? self : index;
  return __builtin_bit_cast(
      float, __builtin_amdgcn_ds_bpermute(index << 2, __builtin_bit_cast(int, var)));
}
