// The CPU emulation of a GPU that tests/support/norms_emu.cpp and qwen_emu.cpp run kernels on (the
// kernels' source compiled as C++ after this header): each CUDA thread a std::thread, the blocks of
// a launch one after another, __syncthreads a barrier of the block, warp shuffles an exchange
// through memory between two barriers of the warp.
//
// The warp width is VN_WARP (-DVN_WARP=32 or 64), the same macro the kernels read: a warp is
// VN_WARP consecutive threads of a block, as on the GPU. Both shuffle spellings are here: CUDA's
// __shfl_xor_sync, and HIP's __shfl_xor(v, mask, width) with the source lane HIP's
// amd_warp_functions.h computes (a lane outside the caller's width segment reads its own value);
// the source takes HIP's when built with -DVN_EMULATE_HIP, which defines __HIP__ at the end of
// this header (include it after every standard header, right before the kernels' source, and
// #undef __HIP__ after that).
#pragma once
#include <barrier>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <thread>
#include <vector>
#include <algorithm>
#include <cstdlib>
#include <string>
struct uint4 { unsigned int x, y, z, w; };
struct float4 { float x, y, z, w; };
struct dim3 { unsigned x = 1, y = 1, z = 1; };
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
std::barrier<>* g_block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> g_warp_barriers;
#ifndef VN_WARP
#error "build with -DVN_WARP=32 or -DVN_WARP=64"
#endif
constexpr unsigned kMaxThreads = 1024;
float g_dyn_shared[1 << 16];
float g_shfl[kMaxThreads / VN_WARP][VN_WARP];
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
inline void __syncthreads() { g_block_barrier->arrive_and_wait(); }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
using std::min; using std::sqrt;
// Every lane of the caller's warp publishes v, then reads lane `from(lane)`'s.
template <class From> float warp_exchange(float v, From from) {
  const unsigned t = threadIdx.x + threadIdx.y * blockDim.x, w = t / VN_WARP, l = t % VN_WARP;
  g_shfl[w][l] = v;
  g_warp_barriers[w]->arrive_and_wait();
  const unsigned src = from(l);
  if (src >= VN_WARP) std::abort();  // a lane the warp does not have
  const float r = g_shfl[w][src];
  g_warp_barriers[w]->arrive_and_wait();
  return r;
}
inline float __shfl_xor_sync(unsigned, float v, int o) {
  return warp_exchange(v, [o](unsigned l) { return l ^ (unsigned)o; });
}
inline float __shfl_xor(float v, int mask, int width) {
  return warp_exchange(v, [=](unsigned l) {
    const unsigned index = l ^ (unsigned)mask;
    return index >= ((l + width) & ~(unsigned)(width - 1)) ? l : index;
  });
}
template <class F> void launch(dim3 grid, dim3 block, F f) {
  gridDim = grid; blockDim = block;
  unsigned nt = block.x * block.y;
  if (nt > kMaxThreads) std::abort();
  for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
    std::barrier<> bar(nt); g_block_barrier = &bar;
    g_warp_barriers.clear();
    for (unsigned w = 0; w < (nt + VN_WARP - 1) / VN_WARP; ++w)
      g_warp_barriers.emplace_back(
          new std::barrier<>(std::min<unsigned>(VN_WARP, nt - w * VN_WARP)));
    std::vector<std::thread> ts;
    for (unsigned ty = 0; ty < block.y; ++ty) for (unsigned tx = 0; tx < block.x; ++tx)
      ts.emplace_back([=] { threadIdx.x = tx; threadIdx.y = ty; blockIdx.x = bx; blockIdx.y = by; f(); });
    for (auto& t : ts) t.join();
  }
}
// The reference's own bf16 conversions, written apart from the kernels' f2bf / bf2f so that a
// rounding fault in those shows: the nearer of the two bf16 neighbours, ties to the even one.
unsigned short tobf(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  const unsigned lo = u & 0xffff0000u, hi = lo + 0x10000u;
  float flo, fhi;
  std::memcpy(&flo, &lo, 4);
  std::memcpy(&fhi, &hi, 4);
  const double dlo = std::fabs((double)f - flo), dhi = std::fabs((double)fhi - f);
  if (dlo != dhi) return (unsigned short)((dlo < dhi ? lo : hi) >> 16);
  return (unsigned short)((((lo >> 16) & 1u) != 0 ? hi : lo) >> 16);
}
float frombf(unsigned short h) {
  const unsigned u = (unsigned)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The source picks HIP's shuffle under __HIP__, which hiprtc's clang defines; set here around the
// source only, so that the standard headers above never see it.
#ifdef VN_EMULATE_HIP
#define __HIP__ 1
#endif
