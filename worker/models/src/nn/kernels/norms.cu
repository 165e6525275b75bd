// Fused normalisation kernels of the SDXL UNet (src/nn/fused.rs), compiled at run time by NVRTC
// on CUDA or hiprtc on ROCm (through libtorch's NVRTC stub, csrc/rtc.cpp) for the GPU they run on.
//
// bf16 values travel as their 16 bits and are widened to fp32 by a shift, so the source needs no
// CUDA or HIP header (NVRTC runs without a toolkit's include folder; hiprtc brings its own
// built-ins). Arithmetic is fp32; every output is rounded to bf16 once, to nearest even, as
// libtorch rounds.
//
// One warp-wide reduction (add_layer_norm) depends on the lanes a warp has: VN_WARP, 32 on CUDA;
// on AMD the wavefront width, 32 on RDNA (gfx11, e.g. gfx1151) and 64 on CDNA (gfx9), which
// csrc/rtc.cpp passes as -DVN_WARP from the device's warp-size attribute. Everything else is
// written per block and does not depend on it.
//
// Kernels, all over contiguous rows of C channels (C a multiple of 8, loaded 8 at a time):
// - gn_partial, gn_finalize, gn_apply: GroupNorm of an NHWC activation [N, HW, C], optionally
//   with a per-(sample, channel) term added to the input first (a ResNet's time embedding and
//   conv1 bias) and a SiLU after, in three launches: per-channel sums over row blocks, per-group
//   statistics turned into a per-(sample, channel) scale and shift, one vectorised pass that
//   normalises.
// - add_layer_norm: s = a + b (the residual stream, rounded to bf16 as libtorch's add) and
//   LayerNorm(s), one warp per row, the row held in registers.
// - bias_residual: y = h + r + bias[c], a ResNet's output (conv2 without its bias, plus the
//   shortcut) in one vectorised pass, where libtorch adds a convolution's bias in an unvectorised
//   pass of its own and the residual in another.
//
// The ideas are the usual ones of NHWC GroupNorm kernels (two-pass sums then apply, as in
// NVIDIA's TensorRT groupNormPlugin and apex's group_norm, Apache-2.0 / BSD) and of warp-per-row
// LayerNorm kernels; the code is ours.

// (The prelude, src/nn/kernels/prelude.cuh, comes first: VN_WARP, bf16, bf2f / f2bf, unpack8 /
// pack8, warp_xor, warp_sum.)

// Grid (NB, N), block (C/8, Y). Block (b, n) sums rows [b·rows, min((b+1)·rows, HW)) of sample n
// and writes, per channel, the sum and the sum of squares: part[((n·NB + b)·2 + {0, 1})·C + c].
// Shared memory: blockDim.x · blockDim.y · 16 floats when blockDim.y > 1.
extern "C" __global__ void gn_partial(const uint4* __restrict__ x, float* __restrict__ part,
                                      int HW, int C, int rows) {
  extern __shared__ float sh[];
  const int C8 = C >> 3;
  const int c8 = threadIdx.x;
  const int n = blockIdx.y;
  const int b = blockIdx.x;
  const int NB = gridDim.x;
  float s[8], q[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    s[k] = 0.f;
    q[k] = 0.f;
  }
  const int r0 = b * rows;
  const int r1 = min(r0 + rows, HW);
  const uint4* base = x + (unsigned long long)n * HW * C8 + c8;
#pragma unroll 4
  for (int r = r0 + threadIdx.y; r < r1; r += blockDim.y) {
    float f[8];
    unpack8(base[(unsigned long long)r * C8], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      s[k] += f[k];
      q[k] += f[k] * f[k];
    }
  }
  if (blockDim.y > 1) {
    float* mine = sh + (threadIdx.y * C8 + c8) * 16;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      mine[k] = s[k];
      mine[8 + k] = q[k];
    }
    __syncthreads();
    if (threadIdx.y != 0) {
      return;
    }
    for (int y = 1; y < blockDim.y; ++y) {
      const float* other = sh + (y * C8 + c8) * 16;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        s[k] += other[k];
        q[k] += other[8 + k];
      }
    }
  }
  float* out = part + ((unsigned long long)n * NB + b) * 2 * C + c8 * 8;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    out[k] = s[k];
    out[C + k] = q[k];
  }
}

// Grid N·G, block 256 (a power of two). Adds up one group's partial sums in double (with `add`,
// the per-(sample, channel) term t, folded in: Σ(h+t) = Σh + m·t, Σ(h+t)² = Σh² + 2t·Σh + m·t²
// over the m rows of each partial), takes the mean and 1/sqrt(var + eps) with the biased variance
// (as torch.nn.GroupNorm), and writes each channel's affine map of the raw input h:
// ss[(n·2 + 0)·C + c] = rstd·γ[c] (scale), ss[(n·2 + 1)·C + c] = β[c] + (t − mean)·scale (shift).
extern "C" __global__ void gn_finalize(const float* __restrict__ part,
                                       const float* __restrict__ add,
                                       const bf16* __restrict__ gamma,
                                       const bf16* __restrict__ beta, float* __restrict__ ss,
                                       int NB, int HW, int C, int G, int rows, float eps) {
  __shared__ double red[2][256];
  __shared__ float mean_rstd[2];
  const int n = blockIdx.x / G;
  const int g = blockIdx.x % G;
  const int cpg = C / G;
  double s = 0.0, q = 0.0;
  for (int i = threadIdx.x; i < NB * cpg; i += blockDim.x) {
    const int b = i / cpg;
    const int c = g * cpg + (i - b * cpg);
    const float* p = part + ((unsigned long long)n * NB + b) * 2 * C;
    double ps = p[c], pq = p[C + c];
    if (add != 0) {
      const double t = add[(unsigned long long)n * C + c];
      const double m = (double)(min((b + 1) * rows, HW) - b * rows);
      pq += 2.0 * t * ps + m * t * t;
      ps += m * t;
    }
    s += ps;
    q += pq;
  }
  red[0][threadIdx.x] = s;
  red[1][threadIdx.x] = q;
  __syncthreads();
  for (int w = blockDim.x / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) {
      red[0][threadIdx.x] += red[0][threadIdx.x + w];
      red[1][threadIdx.x] += red[1][threadIdx.x + w];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const double count = (double)HW * cpg;
    const double mean = red[0][0] / count;
    double var = red[1][0] / count - mean * mean;
    if (var < 0.0) {
      var = 0.0;
    }
    mean_rstd[0] = (float)mean;
    mean_rstd[1] = (float)(1.0 / sqrt(var + (double)eps));
  }
  __syncthreads();
  for (int k = threadIdx.x; k < cpg; k += blockDim.x) {
    const int c = g * cpg + k;
    const float t = add != 0 ? add[(unsigned long long)n * C + c] : 0.f;
    const float scale = mean_rstd[1] * bf2f(gamma[c]);
    ss[(unsigned long long)n * 2 * C + c] = scale;
    ss[((unsigned long long)n * 2 + 1) * C + c] = bf2f(beta[c]) + (t - mean_rstd[0]) * scale;
  }
}

// Grid-stride over the N·HW·C/8 vectors of x: y = x·scale + shift per (sample, channel) from
// gn_finalize, then SiLU when `silu` is set.
extern "C" __global__ void gn_apply(const uint4* __restrict__ x, const float4* __restrict__ ss,
                                    uint4* __restrict__ y, long long total8, int HW, int C,
                                    int silu) {
  const int C8 = C >> 3;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total8;
       i += (long long)gridDim.x * blockDim.x) {
    const long long row = i / C8;
    const int c8 = (int)(i - row * C8);
    const int n = (int)(row / HW);
    // Two float4 of scales then two of shifts: channels c8·8 … c8·8 + 7 of sample n.
    const float4* sc = ss + ((unsigned long long)n * 2 * C + c8 * 8) / 4;
    const float4* sh = sc + C / 4;
    const float4 a0 = sc[0], a1 = sc[1], b0 = sh[0], b1 = sh[1];
    const float scale[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
    const float shift[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
    float f[8];
    unpack8(x[i], f);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float o = f[k] * scale[k] + shift[k];
      if (silu) {
        o = o / (1.f + __expf(-o));
      }
      f[k] = o;
    }
    y[i] = pack8(f);
  }
}

// Grid-stride over the total8 vectors of [rows, C]: y = h + r + bias[c].
extern "C" __global__ void bias_residual(const uint4* __restrict__ h, const uint4* __restrict__ r,
                                         const bf16* __restrict__ bias, uint4* __restrict__ y,
                                         long long total8, int C) {
  const int C8 = C >> 3;
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total8;
       i += (long long)gridDim.x * blockDim.x) {
    const int c0 = (int)(i % C8) * 8;
    float fh[8], fr[8];
    unpack8(h[i], fh);
    unpack8(r[i], fr);
    const uint4 bv = *reinterpret_cast<const uint4*>(bias + c0);
    float fb[8];
    unpack8(bv, fb);
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      fh[k] += fr[k] + fb[k];
    }
    y[i] = pack8(fh);
  }
}

// Rows up to 1280 channels (160 vectors of 8): each lane holds ADD_LN_MAXV vectors, 5 at 32 lanes
// (8 · 32 · 5 = 1280), 3 at 64 (8 · 64 · 3 = 1536).
#define ADD_LN_MAX_C8 160
#define ADD_LN_MAXV ((ADD_LN_MAX_C8 + VN_WARP - 1) / VN_WARP)

// One warp per row; blockDim.x a multiple of VN_WARP. s = a + b, y = LayerNorm(s)·w + bias over C.
extern "C" __global__ void add_layer_norm(const uint4* __restrict__ a, const uint4* __restrict__ b,
                                          const bf16* __restrict__ w,
                                          const bf16* __restrict__ bias, uint4* __restrict__ s_out,
                                          uint4* __restrict__ y_out, long long rows, int C,
                                          float eps) {
  const int lane = threadIdx.x & (VN_WARP - 1);
  const long long row = (long long)blockIdx.x * (blockDim.x / VN_WARP) + (threadIdx.x / VN_WARP);
  if (row >= rows) {
    return;
  }
  const int C8 = C >> 3;
  const unsigned long long off = (unsigned long long)row * C8;
  float v[ADD_LN_MAXV][8];
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < ADD_LN_MAXV; ++j) {
    const int k = lane + VN_WARP * j;
    if (k < C8) {
      float fa[8], fb[8];
      unpack8(a[off + k], fa);
      unpack8(b[off + k], fb);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        v[j][e] = bf2f(f2bf(fa[e] + fb[e]));
        sum += v[j][e];
      }
      s_out[off + k] = pack8(v[j]);
    }
  }
  sum = warp_sum(sum);
  const float mean = sum / C;
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < ADD_LN_MAXV; ++j) {
    if (lane + VN_WARP * j < C8) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float d = v[j][e] - mean;
        sq += d * d;
      }
    }
  }
  sq = warp_sum(sq);
  const float rstd = rsqrtf(sq / C + eps);
#pragma unroll
  for (int j = 0; j < ADD_LN_MAXV; ++j) {
    const int k = lane + VN_WARP * j;
    if (k < C8) {
      float o[8];
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int c = k * 8 + e;
        o[e] = (v[j][e] - mean) * rstd * bf2f(w[c]) + bf2f(bias[c]);
      }
      y_out[off + k] = pack8(o);
    }
  }
}
