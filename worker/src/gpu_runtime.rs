//! The GPU runtime libtorch loaded into the process (CUDA's, or HIP's on ROCm builds), looked up by
//! function name: the engine's memory probe and the settings fingerprint's device facts both read it
//! this way, so the worker gains no link dependency on CUDA or ROCm.

use std::ffi::{CStr, c_void};

/// A symbol of any library loaded into the process, in load order.
#[allow(unsafe_code)]
pub(crate) fn symbol(name: &CStr) -> Option<*mut c_void> {
    // SAFETY: `dlsym` with `RTLD_DEFAULT` and a NUL-terminated name only searches the loaded
    // libraries; it returns null when none defines the name.
    let address = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) };
    (!address.is_null()).then_some(address)
}
