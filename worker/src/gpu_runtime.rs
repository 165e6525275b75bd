//! The GPU runtime libtorch loaded into the process (CUDA's, or HIP's on ROCm builds), its functions
//! looked up by name among the libraries already loaded (`libloading`'s handle of the process
//! itself, `dlopen(NULL)`): the engine's memory probe and the settings fingerprint's device facts
//! both read it this way, so the worker gains no link dependency on CUDA or ROCm. Where no runtime
//! is loaded (a CPU-only libtorch) every lookup finds nothing.

use std::ffi::CStr;
use std::sync::OnceLock;

use libloading::os::unix::Library;

/// The process's own handle: its symbols are those of every library loaded at start (libtorch's
/// GPU backend and the runtime it links), in load order. Opened once and never closed.
fn process() -> &'static Library {
    static PROCESS: OnceLock<Library> = OnceLock::new();
    PROCESS.get_or_init(Library::this)
}

/// The loaded function `name`, as the function pointer type `F`; `None` where no loaded library
/// defines it.
///
/// # Safety
///
/// `F` must be the function's C signature (an `unsafe extern "C" fn` type of its parameters and
/// return value).
#[allow(unsafe_code)]
pub(crate) unsafe fn function<F: Copy>(name: &CStr) -> Option<F> {
    // SAFETY: the caller vouches for `F`. The pointer is copied out of the symbol: it stays valid
    // because the process handle, and the libraries loaded at start, are never unloaded.
    unsafe { process().get::<F>(name.to_bytes_with_nul()) }
        .ok()
        .map(|symbol| *symbol)
}
