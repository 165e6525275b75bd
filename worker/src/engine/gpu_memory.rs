//! The GPU's memory for heartbeats: total and free as the device runtime reports them
//! (`cudaMemGetInfo`, or `hipMemGetInfo` on ROCm builds of libtorch).
//!
//! The runtime is found at run time among the libraries already loaded (libtorch's GPU backend
//! brings it; [`crate::gpu_runtime`]), so the worker gains no link dependency on CUDA or ROCm: on a
//! CPU-only build, or where no device answers, there is simply no reading. libtorch's caching allocator keeps its
//! reserved bytes behind a C++ API only, so `reserved_bytes` is not reported.

use std::ffi::{CStr, c_int};
use std::sync::OnceLock;

use vnfarm_proto::GpuMemory;

use crate::gpu_runtime;

type SetDevice = unsafe extern "C" fn(c_int) -> c_int;
type MemGetInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;

/// The two runtime functions a reading needs.
#[derive(Clone, Copy)]
struct Runtime {
    set_device: SetDevice,
    mem_get_info: MemGetInfo,
}

/// Reads one device's memory.
#[derive(Debug)]
pub struct GpuMemoryProbe {
    device: i32,
}

impl GpuMemoryProbe {
    /// A probe of device `index` (libtorch's `cuda:N`, which is a HIP device on ROCm builds).
    pub fn new(index: usize) -> Self {
        Self {
            device: i32::try_from(index).unwrap_or(i32::MAX),
        }
    }

    /// The device's memory now, or `None` where no GPU runtime is loaded or the device does not
    /// answer. Fast (no device synchronisation), callable from any thread.
    #[allow(unsafe_code)]
    pub fn read(&self) -> Option<GpuMemory> {
        let runtime = runtime()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both functions were resolved from the loaded CUDA or HIP runtime under their
        // documented C names, with these signatures (`cudaError_t cudaSetDevice(int)`,
        // `cudaError_t cudaMemGetInfo(size_t *free, size_t *total)`, HIP's identical). Selecting a
        // device only sets this thread's current device; the pointers are valid for the call.
        let ok = unsafe {
            (runtime.set_device)(self.device) == 0
                && (runtime.mem_get_info)(&mut free, &mut total) == 0
        };
        (ok && total > 0).then_some(GpuMemory {
            total_bytes: total as u64,
            free_bytes: free as u64,
            reserved_bytes: None,
        })
    }
}

/// The CUDA runtime's functions, else HIP's, looked up once.
fn runtime() -> Option<Runtime> {
    static RUNTIME: OnceLock<Option<Runtime>> = OnceLock::new();
    *RUNTIME.get_or_init(|| {
        let found = lookup(c"cudaSetDevice", c"cudaMemGetInfo")
            .or_else(|| lookup(c"hipSetDevice", c"hipMemGetInfo"));
        if found.is_none() {
            tracing::debug!("no CUDA or HIP runtime loaded: GPU memory is not reported");
        }
        found
    })
}

#[allow(unsafe_code)]
fn lookup(set_device: &CStr, mem_get_info: &CStr) -> Option<Runtime> {
    // SAFETY: these are the runtime's functions of the signatures above (see `read`).
    unsafe {
        Some(Runtime {
            set_device: gpu_runtime::function::<SetDevice>(set_device)?,
            mem_get_info: gpu_runtime::function::<MemGetInfo>(mem_get_info)?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a GPU (CI) there is no reading at all. On a machine with one, `VNFARM_TEST_GPU=1`
    /// makes the first device's reading required.
    #[test]
    fn the_first_gpu_reads_and_a_device_that_is_not_there_does_not() {
        assert_eq!(GpuMemoryProbe::new(10_000).read(), None);
        let first = GpuMemoryProbe::new(0).read();
        if std::env::var_os("VNFARM_TEST_GPU").is_some_and(|v| v == "1") {
            let memory = first.expect("a reading of cuda:0");
            println!("cuda:0: {memory:?}");
            assert!(memory.total_bytes >= 1 << 30, "{memory:?}");
        }
        if let Some(memory) = first {
            assert!(
                memory.free_bytes > 0 && memory.free_bytes <= memory.total_bytes,
                "{memory:?}"
            );
        }
    }
}
