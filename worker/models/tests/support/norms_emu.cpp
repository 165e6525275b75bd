// CPU emulation of src/nn/kernels/norms.cu for tests/parity/fused_kernels_emulated.rs: the kernels'
// source compiled as C++ (the test rewrites `extern __shared__` and `extern "C"` first) on the
// emulated GPU of emu_runtime.h. Each case named on the command line runs against a
// double-precision reference; the exit status is the number of cases off by more than bf16
// rounding.
//
//   norms_emu gn N C HW G ADD SILU NB ROWS TY   (launch geometry as src/nn/fused.rs computes it)
//   norms_emu ln ROWS C BLOCKS THREADS
//   norms_emu br ROWS C
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
#include "emu_runtime.h"
#include NORMS_SOURCE
#undef __HIP__


static int gn_case(int N, int C, int HW, int G, bool with_add, bool silu, long nb, long rows, long ty) {
  std::mt19937 rng(N * 7919 + C * 31 + HW);
  std::normal_distribution<float> nd;
  const int C8 = C / 8;
  std::vector<unsigned short> x(N * HW * C), gamma(C), beta(C), y(N * HW * C);
  std::vector<float> add(N * C);
  for (auto& v : x) v = tobf(nd(rng) * 3 + 0.5f);
  for (auto& v : gamma) v = tobf(nd(rng) * 0.5f + 1);
  for (auto& v : beta) v = tobf(nd(rng) * 0.2f);
  for (auto& v : add) v = frombf(tobf(nd(rng)));
  std::vector<float> part(N * nb * 2 * C), ss(N * 2 * C);
  const uint4* px = reinterpret_cast<const uint4*>(x.data());
  launch({(unsigned)nb, (unsigned)N}, {(unsigned)C8, (unsigned)ty},
         [&] { gn_partial(px, part.data(), HW, C, (int)rows); });
  const float* padd = with_add ? add.data() : nullptr;
  launch({(unsigned)(N * G), 1}, {256, 1}, [&] {
    gn_finalize(part.data(), padd, gamma.data(), beta.data(), ss.data(), (int)nb, HW, C, G,
                (int)rows, 1e-5f);
  });
  const long long total8 = (long long)N * HW * C8;
  // A grid smaller than the work, so that the grid-stride loop runs.
  launch({3, 1}, {64, 1}, [&] {
    gn_apply(px, reinterpret_cast<const float4*>(ss.data()), reinterpret_cast<uint4*>(y.data()),
             total8, HW, C, silu ? 1 : 0);
  });
  double maxerr = 0;
  const int cpg = C / G;
  for (int n = 0; n < N; ++n) {
    for (int g = 0; g < G; ++g) {
      auto in = [&](int r, int c) {
        return (double)frombf(x[(n * HW + r) * C + c]) + (with_add ? add[n * C + c] : 0.0);
      };
      double s = 0, q = 0;
      for (int r = 0; r < HW; ++r)
        for (int c = g * cpg; c < (g + 1) * cpg; ++c) { s += in(r, c); q += in(r, c) * in(r, c); }
      const double cnt = (double)HW * cpg, mean = s / cnt;
      const double rstd = 1 / std::sqrt(q / cnt - mean * mean + 1e-5);
      for (int r = 0; r < HW; ++r) {
        for (int c = g * cpg; c < (g + 1) * cpg; ++c) {
          double o = (in(r, c) - mean) * rstd * frombf(gamma[c]) + frombf(beta[c]);
          if (silu) o = o / (1 + std::exp(-o));
          const double got = frombf(y[(n * HW + r) * C + c]);
          maxerr = std::max(maxerr, std::fabs(o - got) / std::max(1.0, std::fabs(o)));
        }
      }
    }
  }
  const bool ok = maxerr <= 4.0e-3;  // one bf16 rounding of the output: 2^-8 relative
  printf("gn N=%d C=%d HW=%d G=%d add=%d silu=%d nb=%ld rows=%ld ty=%ld: max rel err %.3e %s\n", N,
         C, HW, G, with_add, silu, nb, rows, ty, maxerr, ok ? "ok" : "OFF");
  return ok ? 0 : 1;
}

static int ln_case(long rows, int C, unsigned blocks, unsigned threads) {
  std::mt19937 rng(rows * 31 + C);
  std::normal_distribution<float> nd;
  std::vector<unsigned short> a(rows * C), b(rows * C), w(C), bias(C), s(rows * C), y(rows * C);
  for (auto& v : a) v = tobf(nd(rng) * 4);
  for (auto& v : b) v = tobf(nd(rng));
  for (auto& v : w) v = tobf(nd(rng) * 0.5f + 1);
  for (auto& v : bias) v = tobf(nd(rng) * 0.2f);
  launch({blocks, 1}, {threads, 1}, [&] {
    add_layer_norm(reinterpret_cast<const uint4*>(a.data()), reinterpret_cast<const uint4*>(b.data()),
                   w.data(), bias.data(), reinterpret_cast<uint4*>(s.data()),
                   reinterpret_cast<uint4*>(y.data()), rows, C, 1e-5f);
  });
  double maxerr = 0;
  int sum_off = 0;
  for (long r = 0; r < rows; ++r) {
    std::vector<double> v(C);
    double m = 0, q = 0;
    for (int c = 0; c < C; ++c) {
      // The residual sum as libtorch's bf16 add rounds it, bit for bit.
      const unsigned short sb = tobf(frombf(a[r * C + c]) + frombf(b[r * C + c]));
      sum_off += sb != s[r * C + c];
      v[c] = frombf(sb);
      m += v[c];
    }
    m /= C;
    for (int c = 0; c < C; ++c) q += (v[c] - m) * (v[c] - m);
    const double rstd = 1 / std::sqrt(q / C + 1e-5);
    for (int c = 0; c < C; ++c) {
      const double o = (v[c] - m) * rstd * frombf(w[c]) + frombf(bias[c]);
      maxerr = std::max(maxerr, std::fabs(o - frombf(y[r * C + c])) / std::max(1.0, std::fabs(o)));
    }
  }
  const bool ok = maxerr <= 4.0e-3 && sum_off == 0;
  printf("ln rows=%ld C=%d blocks=%u threads=%u lanes=%d: sums off %d, max rel err %.3e %s\n",
         rows, C, blocks, threads, VN_WARP, sum_off, maxerr, ok ? "ok" : "OFF");
  return ok ? 0 : 1;
}

static int br_case(long rows, int C) {
  std::mt19937 rng(rows * 17 + C);
  std::normal_distribution<float> nd;
  std::vector<unsigned short> h(rows * C), r(rows * C), bias(C), y(rows * C);
  for (auto& v : h) v = tobf(nd(rng) * 2);
  for (auto& v : r) v = tobf(nd(rng) * 4);
  for (auto& v : bias) v = tobf(nd(rng) * 0.5f);
  const long long total8 = rows * C / 8;
  launch({2, 1}, {32, 1}, [&] {
    bias_residual(reinterpret_cast<const uint4*>(h.data()), reinterpret_cast<const uint4*>(r.data()),
                  bias.data(), reinterpret_cast<uint4*>(y.data()), total8, C);
  });
  double maxerr = 0;
  for (long i = 0; i < rows * C; ++i) {
    const double o = (double)frombf(h[i]) + frombf(r[i]) + frombf(bias[i % C]);
    maxerr = std::max(maxerr, std::fabs(o - frombf(y[i])) / std::max(1.0, std::fabs(o)));
  }
  const bool ok = maxerr <= 4.0e-3;
  printf("br rows=%ld C=%d: max rel err %.3e %s\n", rows, C, maxerr, ok ? "ok" : "OFF");
  return ok ? 0 : 1;
}

int main(int argc, char** argv) {
  int off = 0;
  for (int i = 1; i < argc;) {
    const std::string kind = argv[i];
    if (kind == "gn" && i + 9 < argc) {
      auto n = [&](int k) { return std::atol(argv[i + k]); };
      off += gn_case(n(1), n(2), n(3), n(4), n(5) != 0, n(6) != 0, n(7), n(8), n(9));
      i += 10;
    } else if (kind == "br" && i + 2 < argc) {
      off += br_case(std::atol(argv[i + 1]), std::atoi(argv[i + 2]));
      i += 3;
    } else if (kind == "ln" && i + 4 < argc) {
      off += ln_case(std::atol(argv[i + 1]), std::atoi(argv[i + 2]),
                     (unsigned)std::atol(argv[i + 3]), (unsigned)std::atol(argv[i + 4]));
      i += 5;
    } else {
      fprintf(stderr, "bad case at argument %d\n", i);
      return 100;
    }
  }
  return off;
}
