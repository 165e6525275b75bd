//! CUDA graph capture and replay of eager tch work: [`CudaGraph`] wraps `at::cuda::CUDAGraph`
//! through the C++ shim `csrc/graph.cpp`, which `build.rs` compiles against a CUDA libtorch, or a
//! ROCm one, where the same class captures HIP graphs (`cfg(vnfarm_cuda_graphs)`); elsewhere
//! (a CPU-only libtorch, or GPU headers missing at build time) [`CudaGraph::new`] returns
//! [`GraphError::NotBuilt`]. A [`CudaGraph`] is `Send` but not `Sync`: replays must not overlap.
//!
//! How a graph is used (as `torch.cuda.graph` does it):
//! 1. [`CudaGraph::on_side_stream`]: the work run eagerly once or more on the graph's side stream
//!    (the warm-up), so that cuBLAS workspaces, cuDNN plans and the allocator's blocks for that
//!    stream exist before the capture;
//! 2. [`CudaGraph::capture`]: the same work recorded, not run; the tensors it returns live in the
//!    graph's private memory pool and are the graph's outputs, rewritten by every replay. Captures
//!    use CUDA's thread-local capture mode (`torch.cuda.graph`'s `capture_error_mode=
//!    "thread_local"`): only the capturing thread must not allocate, free or synchronise
//!    meanwhile, so other threads may load models while one is captured (in the global mode,
//!    libtorch's default, any thread's such call invalidates the capture);
//! 3. [`CudaGraph::replay`]: the recorded kernels launched again on the current stream, reading the
//!    same input tensors (refill them with `copy_`) and writing the same outputs.
//!
//! Invariants for the captured work: no host↔device synchronisation (`int64_value`, `.to_device`
//! of host tensors, `nonzero`), no tensor read from the host, shapes fixed, and every tensor it
//! reads that is not created inside it must stay alive and in place for as long as the graph is
//! replayed (weights replaced rather than written into, as LoRA fusing does, need a new capture).

use std::panic::{AssertUnwindSafe, catch_unwind};

use tch::Device;

/// Why graph capture or replay failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GraphError {
    /// The binary was built against a libtorch without a GPU backend (or without its headers).
    #[error(
        "CUDA graph capture not built into this binary (needs a CUDA or ROCm libtorch at build time)"
    )]
    NotBuilt,
    /// Graphs are captured on a CUDA device only.
    #[error("CUDA graph capture needs a CUDA device, not {0:?}")]
    NotCuda(Device),
    /// libtorch or CUDA refused (the C++ exception's message), or the captured work panicked.
    #[error("CUDA graph: {0}")]
    Backend(String),
}

/// One capturable CUDA graph with its side stream. Captured once; dropped to free its memory pool.
#[derive(Debug)]
pub struct CudaGraph {
    raw: imp::Raw,
    captured: bool,
}

impl CudaGraph {
    /// A graph for `device`, not yet captured.
    pub fn new(device: Device) -> Result<Self, GraphError> {
        let Device::Cuda(index) = device else {
            return Err(GraphError::NotCuda(device));
        };
        Ok(Self {
            raw: imp::Raw::new(index as i64)?,
            captured: false,
        })
    }

    /// Runs `f` eagerly on the graph's side stream (after the stream waits for the current one;
    /// the current one then waits for it). A panic in `f` is returned as [`GraphError::Backend`]
    /// after the thread's stream is restored.
    pub fn on_side_stream<T>(&mut self, f: impl FnOnce() -> T) -> Result<T, GraphError> {
        self.raw.enter()?;
        let out = catch_unwind(AssertUnwindSafe(f));
        let left = self.raw.leave();
        let out = out.map_err(|p| GraphError::Backend(panic_message(&*p)))?;
        left?;
        Ok(out)
    }

    /// Records `f` into the graph (its kernels are not run) and instantiates it; returns what `f`
    /// returned, whose tensors are the graph's outputs. A graph is captured once.
    pub fn capture<T>(&mut self, f: impl FnOnce() -> T) -> Result<T, GraphError> {
        if self.captured {
            return Err(GraphError::Backend(
                "this graph was captured already".into(),
            ));
        }
        self.raw.capture_begin()?;
        let out = catch_unwind(AssertUnwindSafe(f));
        // Ends the capture also after a panic, so that the stream leaves capture mode.
        let ended = self.raw.capture_end();
        let out = match out {
            Ok(out) => out,
            Err(p) => {
                let what = panic_message(&*p);
                return Err(GraphError::Backend(match ended {
                    Ok(()) => format!("captured work failed: {what}"),
                    Err(e) => format!("captured work failed: {what}; then {e}"),
                }));
            }
        };
        ended?;
        self.captured = true;
        Ok(out)
    }

    /// Launches the captured kernels on the current stream.
    pub fn replay(&self) -> Result<(), GraphError> {
        if !self.captured {
            return Err(GraphError::Backend("replay before capture".into()));
        }
        self.raw.replay()
    }
}

/// Whether this binary can capture CUDA graphs at all (it was built against a CUDA or ROCm
/// libtorch).
pub const fn built_in() -> bool {
    cfg!(vnfarm_cuda_graphs)
}

/// Whether graphs can be captured on `device` by this binary, without touching the device.
pub fn check_available(device: Device) -> Result<(), GraphError> {
    if !device.is_cuda() {
        return Err(GraphError::NotCuda(device));
    }
    if !built_in() {
        return Err(GraphError::NotBuilt);
    }
    Ok(())
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

// The FFI to the C++ shim: the unsafe code of this module, each block with its SAFETY note.
#[cfg(vnfarm_cuda_graphs)]
#[allow(unsafe_code)]
mod imp {
    use std::ffi::{CStr, c_char, c_void};

    use super::GraphError;

    unsafe extern "C" {
        fn vn_graph_new(device: i64, out: *mut *mut c_void) -> *mut c_char;
        fn vn_graph_drop(g: *mut c_void);
        fn vn_graph_error_free(e: *mut c_char);
        fn vn_graph_enter(g: *mut c_void) -> *mut c_char;
        fn vn_graph_leave(g: *mut c_void) -> *mut c_char;
        fn vn_graph_capture_begin(g: *mut c_void) -> *mut c_char;
        fn vn_graph_capture_end(g: *mut c_void) -> *mut c_char;
        fn vn_graph_replay(g: *mut c_void) -> *mut c_char;
    }

    /// The shim's error string (NULL: success), freed here.
    fn check(e: *mut c_char) -> Result<(), GraphError> {
        if e.is_null() {
            return Ok(());
        }
        // SAFETY: a non-null return is a NUL-terminated string the shim malloc'd for us.
        let msg = unsafe { CStr::from_ptr(e) }.to_string_lossy().into_owned();
        // SAFETY: freed once, by the shim's allocator.
        unsafe { vn_graph_error_free(e) };
        Err(GraphError::Backend(msg))
    }

    /// Owns one `VnGraph` of the shim.
    #[derive(Debug)]
    pub struct Raw(*mut c_void);

    // SAFETY: the shim's graph holds no thread-bound state between calls: each call that switches
    // the current stream (thread-local in libtorch) switches it back before returning, except
    // enter/leave and capture_begin/capture_end, which `CudaGraph` pairs within one `&mut self`
    // call on one thread. Not `Sync`: a graph must not be replayed from two threads at once (its
    // kernels write the same output tensors, and at::cuda::CUDAGraph makes no promise for
    // concurrent calls), so a shared graph goes behind a lock, as the SDXL pipeline's
    // `Mutex<GraphedUNet>` holds it.
    unsafe impl Send for Raw {}

    impl Raw {
        pub fn new(device: i64) -> Result<Self, GraphError> {
            let mut g = std::ptr::null_mut();
            // SAFETY: `g` is written with a valid pointer, or left null with an error.
            check(unsafe { vn_graph_new(device, &mut g) })?;
            Ok(Self(g))
        }
        pub fn enter(&mut self) -> Result<(), GraphError> {
            // SAFETY: `self.0` is a live VnGraph.
            check(unsafe { vn_graph_enter(self.0) })
        }
        pub fn leave(&mut self) -> Result<(), GraphError> {
            // SAFETY: as above.
            check(unsafe { vn_graph_leave(self.0) })
        }
        pub fn capture_begin(&mut self) -> Result<(), GraphError> {
            // SAFETY: as above.
            check(unsafe { vn_graph_capture_begin(self.0) })
        }
        pub fn capture_end(&mut self) -> Result<(), GraphError> {
            // SAFETY: as above.
            check(unsafe { vn_graph_capture_end(self.0) })
        }
        pub fn replay(&self) -> Result<(), GraphError> {
            // SAFETY: as above.
            check(unsafe { vn_graph_replay(self.0) })
        }
    }

    impl Drop for Raw {
        fn drop(&mut self) {
            // SAFETY: dropped once; the pointer came from vn_graph_new.
            unsafe { vn_graph_drop(self.0) }
        }
    }
}

#[cfg(not(vnfarm_cuda_graphs))]
mod imp {
    use super::GraphError;

    /// Never constructed: `new` fails, so the other methods are unreachable.
    #[derive(Debug)]
    pub enum Raw {}

    impl Raw {
        pub fn new(_device: i64) -> Result<Self, GraphError> {
            Err(GraphError::NotBuilt)
        }
        pub fn enter(&mut self) -> Result<(), GraphError> {
            match *self {}
        }
        pub fn leave(&mut self) -> Result<(), GraphError> {
            match *self {}
        }
        pub fn capture_begin(&mut self) -> Result<(), GraphError> {
            match *self {}
        }
        pub fn capture_end(&mut self) -> Result<(), GraphError> {
            match *self {}
        }
        pub fn replay(&self) -> Result<(), GraphError> {
            match *self {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_graph_on_the_cpu_is_refused_with_a_clear_error() {
        let err = CudaGraph::new(Device::Cpu).expect_err("no graphs on the CPU");
        assert_eq!(err, GraphError::NotCuda(Device::Cpu));
    }

    #[test]
    fn a_binary_without_the_shim_says_so() {
        if built_in() {
            return;
        }
        let err = CudaGraph::new(Device::Cuda(0)).expect_err("shim not built");
        assert_eq!(
            err.to_string(),
            "CUDA graph capture not built into this binary (needs a CUDA or ROCm libtorch at build \
             time)"
        );
    }
}
