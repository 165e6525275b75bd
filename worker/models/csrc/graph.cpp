// CUDA graph capture and replay for vnfarm-models (src/nn/cuda_graph.rs), around
// `at::cuda::CUDAGraph`, which tch's C API does not bind.
//
// On ROCm the same class captures HIP graphs: PyTorch hipifies `ATen/cuda/CUDAGraph.h` into
// `ATen/hip/HIPGraph.h` (torch/utils/hipify/hipify_python.py, get_hip_file_path: a `cuda` folder
// becomes `hip`, `CUDA` in a file name `HIP`), and no mapping renames the class or its `at::cuda`
// namespace, so a ROCm libtorch exports `at::cuda::CUDAGraph` over hipGraph (what
// `torch.cuda.graph` runs on ROCm). Streams and devices go through backend.h.
//
// A graph owns one side stream from libtorch's pool. Work runs on it between `enter` and `leave`
// (the warm-up) and between `capture_begin` and `capture_end` (the capture): libtorch's ops, tch's
// included, launch on the thread's current stream, so eager tch calls in between are what the graph
// records. Capture needs a stream other than the default one, and the warm-up must run on the same
// stream as the capture: cuBLAS workspaces and cuDNN plans are set up per stream on first use,
// outside the graph's memory pool. The side stream first waits for the current stream's queued work;
// on leaving, the previous stream is made current again and waits for the side stream, so eager work
// that follows is ordered after what ran (or was captured) on it. `replay` launches the graph on the
// current stream.
//
// Every function catches C++ exceptions and returns them as a malloc'd message (NULL on success),
// freed with vn_graph_error_free: nothing unwinds into Rust.

#include "backend.h"
#include "guarded.h"

#if defined(VN_HIP)
#include <ATen/hip/HIPGraph.h>
#else
#include <ATen/cuda/CUDAGraph.h>
#endif
#include <c10/core/Event.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <string>

namespace {

namespace gpu = vnfarm_shim::gpu;

struct VnGraph {
  explicit VnGraph(c10::DeviceIndex device)
      : device(device), side(gpu::stream_from_pool(device)) {}
  c10::DeviceIndex device;
  gpu::Stream side;
  // The stream that was current before `enter`; set while work runs on the side stream.
  std::optional<gpu::Stream> previous;
  // Created by the first `capture_begin`; a graph is captured once.
  std::optional<at::cuda::CUDAGraph> graph;
};

using vnfarm_shim::guarded;

// `waiter` waits for the work queued on `on` so far.
void wait_for(const gpu::Stream& waiter, const gpu::Stream& on) {
  c10::Event event(c10::DeviceType::CUDA);
  event.record(on.unwrap());
  event.block(waiter.unwrap());
}

void enter(VnGraph* g) {
  if (g->previous) {
    throw std::runtime_error("already on the graph's side stream");
  }
  auto current = gpu::current_stream(g->device);
  wait_for(g->side, current);
  gpu::set_current_stream(g->side);
  g->previous = current;
}

void leave(VnGraph* g) {
  if (!g->previous) {
    throw std::runtime_error("not on the graph's side stream");
  }
  auto previous = *g->previous;
  g->previous.reset();
  gpu::set_current_stream(previous);
  wait_for(previous, g->side);
}

}  // namespace

extern "C" {

char* vn_graph_new(int64_t device, void** out) {
  *out = nullptr;
  return guarded([&] { *out = new VnGraph(static_cast<c10::DeviceIndex>(device)); });
}

void vn_graph_drop(void* g) {
  // The destructor of at::cuda::CUDAGraph frees the graph and marks its private memory pool free;
  // it does not throw (libtorch logs failures there). The pool's memory stays reserved by the
  // caching allocator until emptyCache (or an out-of-memory retry), invisible to other pools and
  // counted by NVML as used: handed back to the device here. Callers drop a graph on a shape
  // change or a weight swap, not per step.
  delete static_cast<VnGraph*>(g);
  try {
    gpu::empty_cache();
  } catch (...) {
  }
}

void vn_graph_error_free(char* e) { std::free(e); }

char* vn_graph_enter(void* g) {
  return guarded([&] { enter(static_cast<VnGraph*>(g)); });
}

char* vn_graph_leave(void* g) {
  return guarded([&] { leave(static_cast<VnGraph*>(g)); });
}

// Captures in CUDA's thread-local mode: only this thread must not make calls that are unsafe during
// a capture; other threads may allocate, free and synchronise meanwhile, as loaders do (in the
// global mode, libtorch's default, any thread's such call invalidates the capture).
char* vn_graph_capture_begin(void* raw) {
  auto* g = static_cast<VnGraph*>(raw);
  return guarded([&] {
    if (g->graph) {
      throw std::runtime_error("this graph was captured already");
    }
    // As torch.cuda.graph does: nothing of the eager work before may still be running.
    gpu::device_synchronize();
    enter(g);
    try {
      g->graph.emplace();
      g->graph->capture_begin({0, 0}, gpu::kCaptureThreadLocal);
    } catch (...) {
      g->graph.reset();
      leave(g);
      throw;
    }
  });
}

// Ends the capture and instantiates the graph. The side stream is left in every case, also when the
// capture failed (an operation that is not allowed while capturing invalidates it), so that the
// thread's eager work runs on its own stream again.
char* vn_graph_capture_end(void* raw) {
  auto* g = static_cast<VnGraph*>(raw);
  char* err = guarded([&] {
    if (!g->graph) {
      throw std::runtime_error("capture_end without capture_begin");
    }
    g->graph->capture_end();
  });
  char* left = guarded([&] {
    if (g->previous) {
      leave(g);
    }
  });
  if (err == nullptr) {
    return left;
  }
  std::free(left);
  return err;
}

char* vn_graph_replay(void* raw) {
  auto* g = static_cast<VnGraph*>(raw);
  return guarded([&] {
    if (!g->graph) {
      throw std::runtime_error("replay of a graph that was never captured");
    }
    g->graph->replay();
  });
}

}  // extern "C"
