// CPU emulation of src/nn/kernels/qwen_block.cu for tests/parity/qwen_kernels_emulated.rs: the
// kernels' source (after the prelude; the test drops `extern "C"`) compiled as C++ on the emulated
// GPU of emu_runtime.h. Each invocation runs one launch on raw little-endian files in DIR, written
// and read back by the test, which compares them with libtorch's operators:
//
//   qwen_emu qk DIR B S H D L OFF IN_STRIDE EPS BLOCKS THREADS
//     reads q.bin k.bin v.bin (bf16 [B, S, IN_STRIDE]), wq.bin wk.bin (bf16 [D]), cos.bin sin.bin
//     (fp32 [S, D/2]) and qo.bin ko.bin vo.bin (bf16 [B, L, H, D]), runs qk_norm_rope on grid
//     (BLOCKS, 3) × THREADS, writes qo.bin ko.bin vo.bin back (the rows of other streams kept);
//   qwen_emu mn DIR B S C MOD_STRIDE GATE SHIFT SCALE FLAGS EPS BLOCKS THREADS
//     reads x.bin h.bin (bf16 [B, S, C]) and mod.bin (bf16 [B, MOD_STRIDE]; the gate, shift and
//     scale start at elements GATE, SHIFT, SCALE of it), runs modulated_norm with the residual
//     (FLAGS bit 0) and the modulation (bit 1), writes res.bin and norm.bin for the parts run;
//     with FLAGS bit 2 the modulation's output quantised instead: q8.bin (e4m3fn [B, S, C]) and
//     qs.bin (fp32 [B·S]) in place of norm.bin;
//   qwen_emu e4m3 DIR N
//     reads f.bin (fp32 [N]), writes q8.bin: the prelude's f2e4m3 of each value;
//   qwen_emu gq DIR ROWS C THREADS
//     reads h.bin (bf16 [ROWS, C]), runs gelu_quant on ROWS blocks of THREADS, writes q8.bin
//     (e4m3fn [ROWS, C]) and qs.bin (fp32 [ROWS]);
//   qwen_emu vr DIR N C P NS CS PS SCALE EPS SILU BLOCKS THREADS
//     reads x.bin (bf16, N·C·P values laid out by the strides NS, CS, PS) and g.bin (bf16 [C]),
//     runs vae_rms_norm on BLOCKS × THREADS, writes y.bin (laid out as x).
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
#include <cstdint>
#include <cstdlib>
#include <string>
#include "emu_runtime.h"
#include QWEN_SOURCE
#undef __HIP__

template <class T> std::vector<T> load(const std::string& dir, const char* name) {
  const std::string p = dir + "/" + name;
  FILE* f = std::fopen(p.c_str(), "rb");
  if (!f) { std::fprintf(stderr, "cannot read %s\n", p.c_str()); std::exit(101); }
  std::fseek(f, 0, SEEK_END);
  const long n = std::ftell(f);
  std::fseek(f, 0, SEEK_SET);
  // Padded to whole 16-byte vectors, as a GPU allocation is.
  std::vector<T> v((n + 15) / sizeof(T) + 16 / sizeof(T));
  if (std::fread(v.data(), 1, n, f) != (size_t)n) std::exit(102);
  std::fclose(f);
  return v;
}

template <class T> void store(const std::string& dir, const char* name, const std::vector<T>& v, size_t n) {
  const std::string p = dir + "/" + name;
  FILE* f = std::fopen(p.c_str(), "wb");
  if (!f || std::fwrite(v.data(), sizeof(T), n, f) != n) { std::fprintf(stderr, "cannot write %s\n", p.c_str()); std::exit(103); }
  std::fclose(f);
}

// 16-byte aligned copies (uint4 loads), as device memory is.
template <class T> T* aligned_copy(std::vector<unsigned char>& keep, const std::vector<T>& v) {
  keep.resize(v.size() * sizeof(T) + 16);
  unsigned char* p = keep.data();
  while (reinterpret_cast<uintptr_t>(p) % 16 != 0) ++p;
  std::memcpy(p, v.data(), v.size() * sizeof(T));
  return reinterpret_cast<T*>(p);
}

int main(int argc, char** argv) {
  if (argc < 3) return 100;
  const std::string kind = argv[1], dir = argv[2];
  auto n = [&](int k) { return std::atol(argv[2 + k]); };
  if (kind == "qk" && argc == 13) {
    const long B = n(1), S = n(2), H = n(3), D = n(4), L = n(5), off = n(6), in_stride = n(7);
    const float eps = std::strtof(argv[10], nullptr);
    const unsigned blocks = (unsigned)n(9), threads = (unsigned)n(10);
    auto q = load<bf16>(dir, "q.bin"), k = load<bf16>(dir, "k.bin"), v = load<bf16>(dir, "v.bin");
    auto wq = load<bf16>(dir, "wq.bin"), wk = load<bf16>(dir, "wk.bin");
    auto cs = load<float>(dir, "cos.bin"), sn = load<float>(dir, "sin.bin");
    auto qo = load<bf16>(dir, "qo.bin"), ko = load<bf16>(dir, "ko.bin"), vo = load<bf16>(dir, "vo.bin");
    launch({blocks, 3}, {threads, 1}, [&] {
      qk_norm_rope(q.data(), k.data(), v.data(), in_stride, wq.data(), wk.data(), cs.data(),
                   sn.data(), qo.data(), ko.data(), vo.data(), B * S * H, (int)S, (int)H, (int)D,
                   (int)L, (int)off, eps);
    });
    const size_t out = (size_t)(B * L * H * D);
    store(dir, "qo.bin", qo, out);
    store(dir, "ko.bin", ko, out);
    store(dir, "vo.bin", vo, out);
    return 0;
  }
  if (kind == "mn" && argc == 14) {
    const long B = n(1), S = n(2), C = n(3), mod_stride = n(4);
    const long gate = n(5), shift = n(6), scale = n(7), flags = n(8);
    const float eps = std::strtof(argv[11], nullptr);
    const unsigned blocks = (unsigned)n(10), threads = (unsigned)n(11);
    std::vector<unsigned char> kx, kh, km, kr, kn;
    bf16* x = aligned_copy(kx, load<bf16>(dir, "x.bin"));
    bf16* h = aligned_copy(kh, load<bf16>(dir, "h.bin"));
    bf16* m = aligned_copy(km, load<bf16>(dir, "mod.bin"));
    const size_t total = (size_t)(B * S * C);
    std::vector<bf16> res(total + 8), norm(total + 8);
    bf16* pres = aligned_copy(kr, res);
    bf16* pnorm = aligned_copy(kn, norm);
    const bool with_res = flags & 1, with_norm = flags & 2, quantized = flags & 4;
    std::vector<unsigned char> kq;
    std::vector<unsigned int> q8((total + 3) / 4 + 4);
    unsigned int* pq8 = aligned_copy(kq, q8);
    std::vector<float> qs((size_t)(B * S));
    launch({blocks, 1}, {threads, 1}, [&] {
      modulated_norm(reinterpret_cast<const uint4*>(x),
                     with_res ? reinterpret_cast<const uint4*>(h) : nullptr,
                     with_res ? m + gate : nullptr,
                     with_res ? reinterpret_cast<uint4*>(pres) : nullptr,
                     with_norm ? m + shift : nullptr, with_norm ? m + scale : nullptr,
                     with_norm && !quantized ? reinterpret_cast<uint4*>(pnorm) : nullptr,
                     with_norm && quantized ? pq8 : nullptr,
                     with_norm && quantized ? qs.data() : nullptr, B * S, (int)S, (int)C,
                     mod_stride, eps);
    });
    std::memcpy(res.data(), pres, total * sizeof(bf16));
    std::memcpy(norm.data(), pnorm, total * sizeof(bf16));
    std::memcpy(q8.data(), pq8, total);
    if (with_res) store(dir, "res.bin", res, total);
    if (with_norm && !quantized) store(dir, "norm.bin", norm, total);
    if (with_norm && quantized) {
      std::vector<unsigned char> bytes(total);
      std::memcpy(bytes.data(), q8.data(), total);
      store(dir, "q8.bin", bytes, total);
      store(dir, "qs.bin", qs, (size_t)(B * S));
    }
    return 0;
  }
  if (kind == "e4m3" && argc == 4) {
    const size_t count = (size_t)n(1);
    auto f = load<float>(dir, "f.bin");
    std::vector<unsigned char> q(count);
    for (size_t i = 0; i < count; ++i) q[i] = (unsigned char)f2e4m3(f[i]);
    store(dir, "q8.bin", q, count);
    return 0;
  }
  if (kind == "gq" && argc == 6) {
    const long rows = n(1), C = n(2);
    const unsigned threads = (unsigned)n(3);
    std::vector<unsigned char> kh, kq;
    bf16* h = aligned_copy(kh, load<bf16>(dir, "h.bin"));
    const size_t total = (size_t)(rows * C);
    std::vector<unsigned int> q8(total / 4 + 4);
    unsigned int* pq8 = aligned_copy(kq, q8);
    std::vector<float> qs((size_t)rows);
    launch({(unsigned)rows, 1}, {threads, 1}, [&] {
      gelu_quant(reinterpret_cast<const uint4*>(h), pq8, qs.data(), (int)C);
    });
    std::vector<unsigned char> bytes(total);
    std::memcpy(bytes.data(), pq8, total);
    store(dir, "q8.bin", bytes, total);
    store(dir, "qs.bin", qs, (size_t)rows);
    return 0;
  }
  if (kind == "vr" && argc == 14) {
    const long N = n(1), C = n(2), P = n(3), ns = n(4), cs = n(5), ps = n(6);
    const float scale = std::strtof(argv[9], nullptr), eps = std::strtof(argv[10], nullptr);
    const int silu = (int)n(9);
    const unsigned blocks = (unsigned)n(10), threads = (unsigned)n(11);
    auto x = load<bf16>(dir, "x.bin");
    auto g = load<bf16>(dir, "g.bin");
    const size_t total = (size_t)(N * C * P);
    std::vector<bf16> y(total + 8);
    launch({blocks, 1}, {threads, 1}, [&] {
      vae_rms_norm(x.data(), g.data(), y.data(), N * P, P, (int)C, ns, cs, ps, scale, eps, silu);
    });
    store(dir, "y.bin", y, total);
    return 0;
  }
  std::fprintf(stderr, "bad arguments\n");
  return 100;
}
