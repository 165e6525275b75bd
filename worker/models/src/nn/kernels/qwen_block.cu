// Fused elementwise kernels of the QwenImage dual-stream transformer block
// (src/qwen_image/kernels.rs), compiled at run time by NVRTC on CUDA or hiprtc on ROCm after the
// prelude (src/nn/kernels/prelude.cuh: VN_WARP, bf16, the conversions, warp_sum and warp_max, f2e4m3).
//
// Arithmetic is fp32; every output is rounded to bf16 once. libtorch's chain of bf16 operators
// (the portable path, as diffusers runs it) rounds after each operator, so results differ from it
// by rounding only.
//
// - qk_norm_rope: one stream's (image or text) per-head RMSNorm of q and k with their weights, the
//   interleaved RoPE rotation of both, written straight into the joint [B, L_text + N_image, H, D]
//   buffers at the stream's token offset (what SDPA reads, transposed, without the concatenation's
//   copies), and the stream's v rows copied into the joint v buffer. One warp per (token, head)
//   row, the row's pairs spread over the lanes.
// - modulated_norm: an adaLN block's residual and normalisation, one warp per token row of C:
//   optionally y = x + gate ⊙ h (the gated residual, rounded to bf16 and written: the residual
//   stream), then optionally LayerNorm(y) (no affine) ⊙ (1 + scale) + shift (the modulation the
//   next attention or feed-forward takes). gate, scale and shift are per (sample, channel). The
//   normalised row is written as bf16, or quantised for an fp8 GEMM: e4m3fn values with one fp32
//   scale per row (the row's largest magnitude over 448), so x ≈ q · scale.
// - gelu_quant: GELU-tanh of a feed-forward's hidden row (the FF-up GEMM's bf16 output), quantised
//   per row as above for the FF-down GEMM: one pass where the bf16 path reads and writes the
//   hidden state and the quantisation would read it again. One block per row.
//
// - vae_rms_norm: the Qwen VAE's RMS norm over the channels of each pixel,
//   F.normalize(x, dim=1) · √C · γ, with the SiLU that follows it in the residual blocks, in one
//   pass of reads per channel and one of writes (libtorch's chain: an fp32 copy, the norm, the
//   division, the cast back, two products and the SiLU, each a pass of its own). One thread per
//   pixel; x is read through strides (NCHW and NHWC both run), but the launcher gives it NCHW
//   tensors only: with NHWC a thread's reads lie C elements from its neighbours' and it measured
//   2.3x slower than libtorch's chain (H100). Unlike the
//   others it rounds as libtorch's chain does, after the division, each product and the SiLU,
//   so that it differs from the portable path only by the order of the norm's sum.
//
// Both reductions are warp-wide over VN_WARP lanes (32 on CUDA and RDNA, 64 on CDNA) and written
// for either width: a lane handles the elements at lane, lane + VN_WARP, … of its row.
//
// The ideas are those of the fused QK-norm + RoPE and adaLN kernels of open DiT serving stacks
// (e.g. SGLang's and LightX2V's, Apache-2.0); the code is ours.

// The per-row scale that puts a row's largest magnitude at e4m3fn's largest value (448); 1 for a
// row of zeros, whose values quantise to 0 at any scale.
__device__ __forceinline__ float quant_scale(float amax) {
  return amax > 0.f ? amax / 448.f : 1.f;
}

// Eight values times inv quantised to e4m3fn, written as two little-endian words at out.
__device__ __forceinline__ void store_e4m3x8(unsigned int* out, const float* f, float inv) {
  out[0] = f2e4m3(f[0] * inv) | (f2e4m3(f[1] * inv) << 8) | (f2e4m3(f[2] * inv) << 16) |
           (f2e4m3(f[3] * inv) << 24);
  out[1] = f2e4m3(f[4] * inv) | (f2e4m3(f[5] * inv) << 8) | (f2e4m3(f[6] * inv) << 16) |
           (f2e4m3(f[7] * inv) << 24);
}

// Pairs of a row held per lane: D/2 ≤ 128 (head dim up to 256).
#define QK_MAX_PAIRS 128
#define QK_MAXP ((QK_MAX_PAIRS + VN_WARP - 1) / VN_WARP)

// Grid (ceil(rows / (blockDim.x / VN_WARP)), 3), blockDim.x a multiple of VN_WARP. Row r of
// rows = B·S·H is (b, s, h) = (r / (S·H), r / H % S, r % H); blockIdx.y picks q (0), k (1) or v (2).
// Source row: src + (b·S + s)·in_stride + h·D (in_stride: elements between tokens, so that a fused
// QKV projection's output can be read in place). Destination row: dst + ((b·L + off + s)·H + h)·D.
// q and k: y = RMSNorm(x)·w (fp32 mean square over D, eps), then pair k = (y[2k], y[2k+1]) rotated
// by the angle whose cos and sin are cosv[s·D/2 + k] and sinv[s·D/2 + k] (fp32 tables [S, D/2]).
// v: copied. D even, D/2 ≤ QK_MAX_PAIRS; rows of 4-byte aligned pairs.
extern "C" __global__ void qk_norm_rope(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                        const bf16* __restrict__ v, long long in_stride,
                                        const bf16* __restrict__ wq, const bf16* __restrict__ wk,
                                        const float* __restrict__ cosv,
                                        const float* __restrict__ sinv, bf16* __restrict__ qo,
                                        bf16* __restrict__ ko, bf16* __restrict__ vo,
                                        long long rows, int S, int H, int D, int L, int off,
                                        float eps) {
  const int lane = threadIdx.x & (VN_WARP - 1);
  const long long row = (long long)blockIdx.x * (blockDim.x / VN_WARP) + (threadIdx.x / VN_WARP);
  if (row >= rows) {
    return;
  }
  const int which = blockIdx.y;
  const int h = (int)(row % H);
  const long long bs = row / H;
  const int s = (int)(bs % S);
  const long long b = bs / S;
  const bf16* src = which == 0 ? q : (which == 1 ? k : v);
  bf16* dst = which == 0 ? qo : (which == 1 ? ko : vo);
  const unsigned int* in =
      reinterpret_cast<const unsigned int*>(src + (b * S + s) * in_stride + (long long)h * D);
  unsigned int* out = reinterpret_cast<unsigned int*>(dst + ((b * L + off + s) * H + h) * D);
  const int P = D >> 1;
  if (which == 2) {
    for (int p = lane; p < P; p += VN_WARP) {
      out[p] = in[p];
    }
    return;
  }
  float x0[QK_MAXP], x1[QK_MAXP];
  float ss = 0.f;
#pragma unroll
  for (int j = 0; j < QK_MAXP; ++j) {
    const int p = lane + VN_WARP * j;
    x0[j] = 0.f;
    x1[j] = 0.f;
    if (p < P) {
      const unsigned int u = in[p];
      x0[j] = __uint_as_float(u << 16);
      x1[j] = __uint_as_float(u & 0xffff0000u);
      ss += x0[j] * x0[j] + x1[j] * x1[j];
    }
  }
  ss = warp_sum(ss);
  const float rstd = rsqrtf(ss / D + eps);
  const bf16* w = which == 0 ? wq : wk;
  const float* cs = cosv + (long long)s * P;
  const float* sn = sinv + (long long)s * P;
#pragma unroll
  for (int j = 0; j < QK_MAXP; ++j) {
    const int p = lane + VN_WARP * j;
    if (p < P) {
      const float a = x0[j] * rstd * bf2f(w[2 * p]);
      const float c = x1[j] * rstd * bf2f(w[2 * p + 1]);
      const float co = cs[p], si = sn[p];
      const float r0 = a * co - c * si;
      const float r1 = a * si + c * co;
      out[p] = (unsigned int)f2bf(r0) | ((unsigned int)f2bf(r1) << 16);
    }
  }
}

// Rows up to 4096 channels (512 vectors of 8): each lane holds MN_MAXV vectors, 16 at 32 lanes,
// 8 at 64, as packed bf16 (the residual is rounded to bf16 before it is normalised, as the
// reference stores it).
#define MN_MAX_C8 512
#define MN_MAXV ((MN_MAX_C8 + VN_WARP - 1) / VN_WARP)

// One warp per row of C (C a multiple of 8, C/8 ≤ MN_MAX_C8); row r belongs to sample r / S.
// With h (non-null): y = x + gate[b]·h, written to res_out; otherwise y = x. With norm_out
// (non-null): norm_out = (y − mean)·rstd·(1 + scale[b]) + shift[b], mean and biased variance of
// the row in fp32 (LayerNorm without affine, eps); with norm_q8 (non-null) instead, that row rounded
// to bf16 (as norm_out would hold it) and quantised: norm_q8 its e4m3fn bytes ([rows, C]),
// norm_scale[row] its scale. gate, scale and shift point at sample 0's C values; sample b's are
// mod_stride elements further (a modulation Linear's chunks, in place). Every pointer 16-byte
// aligned.
extern "C" __global__ void modulated_norm(const uint4* __restrict__ x, const uint4* __restrict__ h,
                                          const bf16* __restrict__ gate,
                                          uint4* __restrict__ res_out,
                                          const bf16* __restrict__ shift,
                                          const bf16* __restrict__ scale,
                                          uint4* __restrict__ norm_out,
                                          unsigned int* __restrict__ norm_q8,
                                          float* __restrict__ norm_scale, long long rows, int S,
                                          int C, long long mod_stride, float eps) {
  const int lane = threadIdx.x & (VN_WARP - 1);
  const long long row = (long long)blockIdx.x * (blockDim.x / VN_WARP) + (threadIdx.x / VN_WARP);
  if (row >= rows) {
    return;
  }
  const int C8 = C >> 3;
  const long long b = row / S;
  const unsigned long long off = (unsigned long long)row * C8;
  const long long moff = b * mod_stride;
  uint4 yv[MN_MAXV];
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < MN_MAXV; ++j) {
    const int kk = lane + VN_WARP * j;
    if (kk < C8) {
      uint4 xv = x[off + kk];
      if (h != 0) {
        float fx[8], fh[8], fg[8];
        unpack8(xv, fx);
        unpack8(h[off + kk], fh);
        unpack8(*reinterpret_cast<const uint4*>(gate + moff + kk * 8), fg);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          fx[e] += fg[e] * fh[e];
        }
        xv = pack8(fx);
        res_out[off + kk] = xv;
      }
      yv[j] = xv;
      float f[8];
      unpack8(xv, f);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        sum += f[e];
      }
    }
  }
  if (norm_out == 0 && norm_q8 == 0) {
    return;
  }
  const float mean = warp_sum(sum) / C;
  float sq = 0.f;
#pragma unroll
  for (int j = 0; j < MN_MAXV; ++j) {
    if (lane + VN_WARP * j < C8) {
      float f[8];
      unpack8(yv[j], f);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float d = f[e] - mean;
        sq += d * d;
      }
    }
  }
  const float rstd = rsqrtf(warp_sum(sq) / C + eps);
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < MN_MAXV; ++j) {
    const int kk = lane + VN_WARP * j;
    if (kk < C8) {
      float f[8], fs[8], fb[8];
      unpack8(yv[j], f);
      unpack8(*reinterpret_cast<const uint4*>(scale + moff + kk * 8), fs);
      unpack8(*reinterpret_cast<const uint4*>(shift + moff + kk * 8), fb);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        f[e] = (f[e] - mean) * rstd * (1.f + fs[e]) + fb[e];
      }
      if (norm_q8 == 0) {
        norm_out[off + kk] = pack8(f);
      } else {
        // Kept packed as bf16 until the row's scale is known: the values the bf16 path writes.
        yv[j] = pack8(f);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          amax = fmaxf(amax, __uint_as_float(__float_as_uint(f[e]) & 0x7fffffffu));
        }
      }
    }
  }
  if (norm_q8 == 0) {
    return;
  }
  const float qs = quant_scale(warp_max(amax));
#pragma unroll
  for (int j = 0; j < MN_MAXV; ++j) {
    const int kk = lane + VN_WARP * j;
    if (kk < C8) {
      float f[8];
      unpack8(yv[j], f);
      store_e4m3x8(norm_q8 + (off + kk) * 2, f, 1.f / qs);
    }
  }
  if (lane == 0) {
    norm_scale[row] = qs;
  }
}

// Rows up to 16384 channels (2048 vectors of 8) at GQ_THREADS threads: each thread holds GQ_MAXV
// vectors of the row's GELU in fp32.
#define GQ_THREADS 256
#define GQ_MAXV 8

// One block of GQ_THREADS threads per row of C (C a multiple of 8, C/8 ≤ GQ_THREADS·GQ_MAXV):
// g = GELU-tanh(x) in fp32 (0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), diffusers' "gelu-approximate"),
// then q8 = e4m3fn(g / s), qscale[row] = s = max|g| / 448 (1 for a row of zeros). Every pointer
// 16-byte aligned.
extern "C" __global__ void gelu_quant(const uint4* __restrict__ x, unsigned int* __restrict__ q8,
                                      float* __restrict__ qscale, int C) {
  __shared__ float warp_amax[GQ_THREADS / 32];
  const long long row = blockIdx.x;
  const int C8 = C >> 3;
  const int lane = threadIdx.x & (VN_WARP - 1);
  const unsigned long long off = (unsigned long long)row * C8;
  float g[GQ_MAXV][8];
  float amax = 0.f;
#pragma unroll
  for (int j = 0; j < GQ_MAXV; ++j) {
    const int kk = threadIdx.x + GQ_THREADS * j;
    if (kk < C8) {
      unpack8(x[off + kk], g[j]);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float v = g[j][e];
        const float y = 0.7978845608028654f * (v + 0.044715f * v * v * v);
        // tanh(y) = 1 − 2 / (exp(2y) + 1): exact at both ends (exp overflowing to inf gives 1).
        g[j][e] = 0.5f * v * (2.f - 2.f / (__expf(2.f * y) + 1.f));
        amax = fmaxf(amax, __uint_as_float(__float_as_uint(g[j][e]) & 0x7fffffffu));
      }
    }
  }
  amax = warp_max(amax);
  if (lane == 0) {
    warp_amax[threadIdx.x / VN_WARP] = amax;
  }
  __syncthreads();
  amax = 0.f;
  for (int w = 0; w < GQ_THREADS / VN_WARP; ++w) {
    amax = fmaxf(amax, warp_amax[w]);
  }
  const float qs = quant_scale(amax);
#pragma unroll
  for (int j = 0; j < GQ_MAXV; ++j) {
    const int kk = threadIdx.x + GQ_THREADS * j;
    if (kk < C8) {
      store_e4m3x8(q8 + (off + kk) * 2, g[j], 1.f / qs);
    }
  }
  if (threadIdx.x == 0) {
    qscale[row] = qs;
  }
}

// See the file header. x and out: bf16 [N, C, P] with strides (ns, cs, ps) in elements (out laid
// out as x), P the pixels of a sample; gamma bf16 [C]; scale = √C; silu: 0 or 1. Grid-stride over
// the N · P pixels.
extern "C" __global__ void vae_rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ gamma,
                                        bf16* __restrict__ out, long long pixels, long long P,
                                        int C, long long ns, long long cs, long long ps,
                                        float scale, float eps, int silu) {
  for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < pixels;
       i += (long long)gridDim.x * blockDim.x) {
    const long long base = (i / P) * ns + (i % P) * ps;
    float ss = 0.f;
    for (int c = 0; c < C; ++c) {
      const float v = bf2f(x[base + c * cs]);
      ss += v * v;
    }
    // F.normalize: x / max(‖x‖₂, eps).
    const float d = fmaxf(sqrtf(ss), eps);
    for (int c = 0; c < C; ++c) {
      float v = bf2f(f2bf(bf2f(x[base + c * cs]) / d));
      v = bf2f(f2bf(v * scale));
      v = bf2f(f2bf(v * bf2f(gamma[c])));
      if (silu) {
        v = v / (1.f + expf(-v));
      }
      out[base + c * cs] = f2bf(v);
    }
  }
}
