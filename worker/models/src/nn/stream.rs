//! GPU streams and events that tch does not bind, through the C++ shim `csrc/stream.cpp`
//! (`cfg(vnfarm_cuda_graphs)`, built against a CUDA or a ROCm libtorch): a thread's current
//! stream, side streams from libtorch's pool, and events the host waits for.
//!
//! What they are for: libtorch queues every kernel and copy of a thread on that thread's *current*
//! stream, the device's default stream unless set. Loaders that queue their copies there wait for
//! model compute other threads queued before them (a warm-up), and a loader that must wait for its
//! own copies (before reusing a staging buffer) waited for the whole device. On a side stream a
//! load overlaps other work, and an [`Event`] waits for one stream up to one point.
//!
//! Where the shim is not built (a CPU-only libtorch) or the device is not a GPU, streams are
//! `None` and events are never made: callers fall back to what they did before, the default
//! stream and `cuda synchronize`.

use tch::Device;

/// A stream of one GPU, by libtorch's id (`c10::StreamId`): `Copy` and `Send`, so that another
/// thread can make the same stream current.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stream {
    device: i64,
    id: i64,
}

impl Stream {
    /// This thread's current stream on `device`; `None` off the GPU or without the shim.
    pub fn current(device: Device) -> Option<Stream> {
        let Device::Cuda(index) = device else {
            return None;
        };
        let device = index as i64;
        imp::current(device).map(|id| Stream { device, id })
    }

    /// A side stream from libtorch's pool (streams there are shared round-robin, never freed, and
    /// do not wait for the default stream); `None` off the GPU or without the shim.
    pub fn from_pool(device: Device) -> Option<Stream> {
        let Device::Cuda(index) = device else {
            return None;
        };
        let device = index as i64;
        imp::from_pool(device).map(|id| Stream { device, id })
    }

    /// The host waits until everything queued on this stream so far is done.
    pub fn synchronize(self) {
        imp::synchronize(self.device, self.id);
    }
}

/// `stream` is this thread's current stream on its device until the guard drops; then the one
/// before is again. Not `Send`: a thread's current stream is the thread's own.
#[derive(Debug)]
pub struct OnStream {
    previous: Stream,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl OnStream {
    /// Makes `stream` current; `None` when the shim refused (then nothing changed).
    pub fn enter(stream: Stream) -> Option<OnStream> {
        let previous = imp::current(stream.device).map(|id| Stream {
            device: stream.device,
            id,
        })?;
        imp::set(stream.device, stream.id).then_some(OnStream {
            previous,
            _not_send: std::marker::PhantomData,
        })
    }
}

impl Drop for OnStream {
    fn drop(&mut self) {
        imp::set(self.previous.device, self.previous.id);
    }
}

/// Waits for the work this thread queued on `device`: its current stream only, so work other
/// threads queue on side streams (loads) is not waited for; `cuda synchronize` (the whole device)
/// without the shim.
pub fn synchronize_current(device: Device) {
    let Device::Cuda(index) = device else {
        return;
    };
    match Stream::current(device) {
        Some(stream) => stream.synchronize(),
        None => tch::Cuda::synchronize(index as i64),
    }
}

/// A point in a stream's work the host can wait for.
#[derive(Debug)]
pub struct Event(imp::RawEvent);

impl Event {
    /// A new event; `None` without the shim.
    pub fn new() -> Option<Event> {
        imp::RawEvent::new().map(Event)
    }

    /// Marks the end of what this thread has queued so far on its current stream of `device`;
    /// `false` when the shim refused (then the event is not to be trusted).
    pub fn record(&mut self, device: Device) -> bool {
        let Device::Cuda(index) = device else {
            return false;
        };
        self.0.record(index as i64)
    }

    /// The host waits until the work before the last [`Event::record`] is done; `false` when the
    /// shim refused.
    pub fn synchronize(&self) -> bool {
        self.0.synchronize()
    }
}

// The FFI to the C++ shim: the unsafe code of this module, each block with its SAFETY note.
// Failures are logged here and reported as `None`/`false`, which makes every caller take its
// fallback (the default stream, or waiting for the whole device).
#[cfg(vnfarm_cuda_graphs)]
#[allow(unsafe_code)]
mod imp {
    use std::ffi::{CStr, c_char, c_void};

    unsafe extern "C" {
        fn vn_graph_error_free(e: *mut c_char);
        fn vn_stream_current(device: i64, id: *mut i64) -> *mut c_char;
        fn vn_stream_from_pool(device: i64, id: *mut i64) -> *mut c_char;
        fn vn_stream_set(device: i64, id: i64) -> *mut c_char;
        fn vn_stream_synchronize(device: i64, id: i64) -> *mut c_char;
        fn vn_event_new(out: *mut *mut c_void) -> *mut c_char;
        fn vn_event_drop(e: *mut c_void);
        fn vn_event_record(e: *mut c_void, device: i64) -> *mut c_char;
        fn vn_event_synchronize(e: *mut c_void) -> *mut c_char;
    }

    /// `true` on success; the shim's error (a NUL-terminated string it malloc'd) logged and freed.
    fn ok(what: &str, e: *mut c_char) -> bool {
        if e.is_null() {
            return true;
        }
        // SAFETY: a non-null return is a NUL-terminated string the shim malloc'd for us.
        let message = unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned();
        // SAFETY: freed once, by the shim's allocator.
        unsafe { vn_graph_error_free(e) };
        tracing::warn!(error = message, "GPU {what} failed");
        false
    }

    pub fn current(device: i64) -> Option<i64> {
        let mut id = 0;
        // SAFETY: `id` is a valid place for the shim to write.
        ok("stream query", unsafe {
            vn_stream_current(device, &mut id)
        })
        .then_some(id)
    }

    pub fn from_pool(device: i64) -> Option<i64> {
        let mut id = 0;
        // SAFETY: as above.
        ok("side stream", unsafe {
            vn_stream_from_pool(device, &mut id)
        })
        .then_some(id)
    }

    pub fn set(device: i64, id: i64) -> bool {
        // SAFETY: plain values; the shim checks the device.
        ok("stream switch", unsafe { vn_stream_set(device, id) })
    }

    pub fn synchronize(device: i64, id: i64) {
        // SAFETY: plain values.
        ok("stream synchronize", unsafe {
            vn_stream_synchronize(device, id)
        });
    }

    /// Owns one `c10::Event` of the shim.
    #[derive(Debug)]
    pub struct RawEvent(*mut c_void);

    // SAFETY: a c10::Event holds no thread-bound state; it is recorded and waited for through
    // `&mut self`/`&self` of its one owner, which may move between threads.
    unsafe impl Send for RawEvent {}

    impl RawEvent {
        pub fn new() -> Option<Self> {
            let mut e = std::ptr::null_mut();
            // SAFETY: `e` is written with a valid pointer, or left null with an error.
            ok("event", unsafe { vn_event_new(&mut e) }).then_some(Self(e))
        }
        pub fn record(&mut self, device: i64) -> bool {
            // SAFETY: `self.0` is a live event.
            ok("event record", unsafe { vn_event_record(self.0, device) })
        }
        pub fn synchronize(&self) -> bool {
            // SAFETY: as above.
            ok("event synchronize", unsafe { vn_event_synchronize(self.0) })
        }
    }

    impl Drop for RawEvent {
        fn drop(&mut self) {
            // SAFETY: dropped once; the pointer came from vn_event_new.
            unsafe { vn_event_drop(self.0) }
        }
    }
}

#[cfg(not(vnfarm_cuda_graphs))]
mod imp {
    pub fn current(_device: i64) -> Option<i64> {
        None
    }
    pub fn from_pool(_device: i64) -> Option<i64> {
        None
    }
    pub fn set(_device: i64, _id: i64) -> bool {
        false
    }
    pub fn synchronize(device: i64, _id: i64) {
        tch::Cuda::synchronize(device);
    }

    /// Never constructed: `new` is `None`, so the other methods are unreachable.
    #[derive(Debug)]
    pub enum RawEvent {}

    impl RawEvent {
        pub fn new() -> Option<Self> {
            None
        }
        pub fn record(&mut self, _device: i64) -> bool {
            match *self {}
        }
        pub fn synchronize(&self) -> bool {
            match *self {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Off the GPU there are no streams: callers keep the default stream.
    #[test]
    fn the_cpu_has_no_streams() {
        assert_eq!(Stream::current(Device::Cpu), None);
        assert_eq!(Stream::from_pool(Device::Cpu), None);
        synchronize_current(Device::Cpu);
    }
}
