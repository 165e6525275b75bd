// What every run-time compiled kernel source of this crate begins with (prepended to norms.cu and
// qwen_block.cu by the Rust module that compiles each, src/nn/fused.rs and src/qwen_image/kernels.rs):
// the warp width VN_WARP, bf16 as its 16 bits, and the conversions and shuffle written on them, so
// that no source needs a CUDA or HIP header (NVRTC runs without a toolkit's include folder; hiprtc
// brings its own built-ins).
//
// VN_WARP: 32 on CUDA; on AMD the wavefront width, 32 on RDNA (gfx11, e.g. gfx1151) and 64 on CDNA
// (gfx9), which csrc/rtc.cpp passes as -DVN_WARP from the device's warp-size attribute.
// bf16 values are widened to fp32 by a shift and rounded back to nearest even, as libtorch rounds.

#if defined(__HIP__)
// hiprtc (clang -x hip): the compiler knows the wavefront width it compiles for; a -DVN_WARP that
// disagrees would reduce over lanes the wavefront does not have.
#if !defined(VN_WARP) && defined(__AMDGCN_WAVEFRONT_SIZE)
#define VN_WARP __AMDGCN_WAVEFRONT_SIZE
#endif
#if !defined(VN_WARP)
#error "VN_WARP: compile with the device's wavefront width, -DVN_WARP=32 or -DVN_WARP=64"
#elif defined(__AMDGCN_WAVEFRONT_SIZE) && VN_WARP != __AMDGCN_WAVEFRONT_SIZE
#error "VN_WARP differs from the wavefront width this code is compiled for"
#endif
#elif !defined(VN_WARP)
#define VN_WARP 32
#endif
#if VN_WARP != 32 && VN_WARP != 64
#error "VN_WARP must be 32 or 64"
#endif

typedef unsigned short bf16;

// v from the lane whose index is this lane's xor `mask` (mask < VN_WARP), all lanes taking part.
__device__ __forceinline__ float warp_xor(float v, int mask) {
#if defined(__HIP__)
  return __shfl_xor(v, mask, VN_WARP);
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}

// The sum and the largest value of v over the warp's VN_WARP lanes, in every lane.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = VN_WARP / 2; o > 0; o >>= 1) {
    v += warp_xor(v, o);
  }
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = VN_WARP / 2; o > 0; o >>= 1) {
    v = fmaxf(v, warp_xor(v, o));
  }
  return v;
}

__device__ __forceinline__ float bf2f(bf16 h) {
  return __uint_as_float(((unsigned int)h) << 16);
}

__device__ __forceinline__ bf16 f2bf(float f) {
  unsigned int u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return (bf16)((u >> 16) | 0x40u);  // NaN stays a (quiet) NaN
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  return (bf16)(u >> 16);
}

__device__ __forceinline__ void unpack8(uint4 v, float* f) {
  unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

__device__ __forceinline__ uint4 pack8(const float* f) {
  unsigned int w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    w[i] = (unsigned int)f2bf(f[2 * i]) | ((unsigned int)f2bf(f[2 * i + 1]) << 16);
  }
  uint4 r;
  r.x = w[0];
  r.y = w[1];
  r.z = w[2];
  r.w = w[3];
  return r;
}

// fp8 e4m3fn (1 sign, 4 exponent bits of bias 7, 3 mantissa bits; no infinities; 0x7f is NaN) of f,
// rounded to nearest even, saturating at ±448 (libtorch's cast turns what exceeds it into NaN; a
// quantiser whose scale puts the row's largest value at 448 must not, when fp32 rounding lands a
// hair above). Written on the bits so that no fp8 header is needed (none exists for hiprtc and
// the CPU emulation alike).
__device__ __forceinline__ unsigned int f2e4m3(float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int sign = (u >> 24) & 0x80u;
  const unsigned int a = u & 0x7fffffffu;
  if (a > 0x7f800000u) {
    return sign | 0x7fu;  // NaN
  }
  if (a >= 0x43e00000u) {  // ≥ 448
    return sign | 0x7eu;
  }
  if (a < 0x3c800000u) {  // < 2^-6: subnormal, m·2^-9 with m = round(|f|·2^9), ties to even
    return sign | (unsigned int)rintf(__uint_as_float(a) * 512.f);
  }
  // Normal: round the mantissa at its 3rd bit to nearest even; a carry moves into the exponent.
  const unsigned int r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  return sign | (r - ((127u - 7u) << 3));
}
