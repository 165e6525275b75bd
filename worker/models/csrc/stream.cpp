// Streams and events for vnfarm-models (src/nn/stream.rs), which tch's C API does not bind: a
// thread's current stream read, set and waited for by its id, side streams from libtorch's pool,
// and events recorded on the current stream and waited for from the host.
//
// Streams travel to Rust as their id (`c10::StreamId`, what `c10::Stream::id` returns) and device
// index, and come back through `c10::Stream::unpack3`, the way libtorch itself passes streams
// through Python (torch.cuda.Stream's `stream_id`, `device_index`, `device_type`). Streams and
// devices go through backend.h, so the same code builds against a ROCm libtorch, whose
// "masquerading" streams report DeviceType::CUDA.
//
// Every function catches C++ exceptions and returns them as a malloc'd message (NULL on success),
// freed with vn_graph_error_free (graph.cpp): nothing unwinds into Rust.

#include "backend.h"
#include "guarded.h"

#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>

namespace {

namespace gpu = vnfarm_shim::gpu;
using vnfarm_shim::guarded;

c10::Stream unpack(int64_t device, int64_t id) {
  return c10::Stream::unpack3(static_cast<c10::StreamId>(id), static_cast<c10::DeviceIndex>(device),
                              c10::DeviceType::CUDA);
}

}  // namespace

extern "C" {

char* vn_stream_current(int64_t device, int64_t* id) {
  return guarded([&] { *id = gpu::current_stream(static_cast<c10::DeviceIndex>(device)).id(); });
}

char* vn_stream_from_pool(int64_t device, int64_t* id) {
  return guarded([&] { *id = gpu::stream_from_pool(static_cast<c10::DeviceIndex>(device)).id(); });
}

char* vn_stream_set(int64_t device, int64_t id) {
  return guarded([&] { gpu::set_current_stream(gpu::Stream(unpack(device, id))); });
}

char* vn_stream_synchronize(int64_t device, int64_t id) {
  return guarded([&] { unpack(device, id).synchronize(); });
}

char* vn_event_new(void** out) {
  *out = nullptr;
  return guarded([&] { *out = new c10::Event(c10::DeviceType::CUDA); });
}

void vn_event_drop(void* e) { delete static_cast<c10::Event*>(e); }

// Records `e` on the current stream of `device`; a second record replaces the first (an event
// marks the point of one stream at a time).
char* vn_event_record(void* e, int64_t device) {
  return guarded([&] {
    auto stream = gpu::current_stream(static_cast<c10::DeviceIndex>(device)).unwrap();
    static_cast<c10::Event*>(e)->record(stream);
  });
}

// The host waits until the work before the event's last record is done (at once if never recorded).
char* vn_event_synchronize(void* e) {
  return guarded([&] { static_cast<c10::Event*>(e)->synchronize(); });
}

}  // extern "C"
