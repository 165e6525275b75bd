//! ATen operators and libtorch services that tch's C API binds wrongly or not at all, reached
//! through the C++ shim `csrc/ops.cpp`. `build.rs` compiles it together with the CUDA graph shim
//! (against a CUDA libtorch with headers: the PyPI wheel here and on CUDA boxes) and sets
//! `cfg(vnfarm_ops_shim)`; without it [`BUILT_IN`] is false and callers take their plain path.

use std::path::Path;

use tch::Tensor;

/// Whether the shim is compiled into this binary.
pub const BUILT_IN: bool = cfg!(vnfarm_ops_shim);

/// `gelu(mat1 @ mat2 + bias)` for 2-D `mat1`, `mat2` and 1-D `bias`, the GELU in the matmul's
/// epilogue: `at::_addmm_activation(bias, mat1, mat2, 1, 1, use_gelu=true)`. On CUDA libtorch runs
/// it as one cuBLASLt matmul whose epilogue adds the bias and applies the tanh approximation of
/// GELU; on the CPU (and where cuBLASLt is not used) it is the matmul, then erf GELU. tch 0.24's own
/// `internal_addmm_activation` passes `use_gelu` as `beta` and never applies the GELU (found by
/// kernels attempt 8, docs/performance.md). `None` when the shim is not built in.
pub fn addmm_gelu(bias: &Tensor, mat1: &Tensor, mat2: &Tensor) -> Option<Tensor> {
    imp::addmm_gelu(bias, mat1, mat2)
}

/// Starts libtorch's Kineto profiler (what torch.profiler drives) on this process: operators, and
/// GPU kernels with `cuda`. For benches (`examples/bench.rs --profile-trace`).
pub fn profile_start(cuda: bool) -> Result<(), String> {
    imp::profile_start(cuda)
}

/// Stops the profiler and writes what it recorded to `path` as a Chrome trace (JSON).
pub fn profile_stop(path: &Path) -> Result<(), String> {
    imp::profile_stop(path)
}

#[cfg(not(vnfarm_ops_shim))]
mod imp {
    use std::path::Path;

    use tch::Tensor;

    const NOT_BUILT: &str = "the operator shim (csrc/ops.cpp) is not built into this binary";

    pub fn addmm_gelu(_: &Tensor, _: &Tensor, _: &Tensor) -> Option<Tensor> {
        None
    }

    pub fn profile_start(_: bool) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    pub fn profile_stop(_: &Path) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }
}

// The FFI to the shim: the unsafe code of this module, each block with its SAFETY note.
#[cfg(vnfarm_ops_shim)]
#[allow(unsafe_code)]
mod imp {
    use std::ffi::{CStr, CString, c_char, c_void};
    use std::path::Path;

    use tch::Tensor;

    unsafe extern "C" {
        fn vn_ops_error_free(e: *mut c_char);
        fn vn_profile_start(cuda: i32) -> *mut c_char;
        fn vn_profile_stop(path: *const c_char) -> *mut c_char;
        fn vn_addmm_gelu(
            bias: *mut c_void,
            mat1: *mut c_void,
            mat2: *mut c_void,
            out: *mut *mut c_void,
        ) -> *mut c_char;
    }

    /// The shim's error string (NULL: success), freed here.
    fn check(err: *mut c_char) -> Result<(), String> {
        if err.is_null() {
            return Ok(());
        }
        // SAFETY: a non-null return is a NUL-terminated string the shim malloc'd for us.
        let msg = unsafe { CStr::from_ptr(err) }
            .to_string_lossy()
            .into_owned();
        // SAFETY: freed once, by the shim's allocator.
        unsafe { vn_ops_error_free(err) };
        Err(msg)
    }

    pub fn addmm_gelu(bias: &Tensor, mat1: &Tensor, mat2: &Tensor) -> Option<Tensor> {
        let mut out = std::ptr::null_mut();
        let arg = |t: &Tensor| t.as_ptr() as *mut c_void;
        // SAFETY: the three handles are live `at::Tensor*` borrowed for the call (the shim only
        // reads them); `out` receives a new `at::Tensor*` or stays null with an error.
        let err = unsafe { vn_addmm_gelu(arg(bias), arg(mat1), arg(mat2), &mut out) };
        // As tch's own operators do with libtorch's errors.
        check(err).unwrap_or_else(|msg| panic!("_addmm_activation: {msg}"));
        // SAFETY: `out` is a tensor the shim allocated with `new`; the Tensor owns it from here and
        // frees it with tch's `at_free` (`delete`), as for tensors tch's own calls return.
        Some(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
    }

    pub fn profile_start(cuda: bool) -> Result<(), String> {
        // SAFETY: a plain value argument.
        check(unsafe { vn_profile_start(i32::from(cuda)) })
    }

    pub fn profile_stop(path: &Path) -> Result<(), String> {
        let path = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|e| format!("trace path: {e}"))?;
        // SAFETY: `path` is a NUL-terminated string alive for the call.
        check(unsafe { vn_profile_stop(path.as_ptr()) })
    }
}

#[cfg(test)]
mod tests {
    use tch::{Kind, Tensor};

    /// The GELU is applied (tch's own binding computes `bias + mat1 @ mat2` without it): on the CPU
    /// the epilogue is the matmul and then erf GELU, the same as `linear` + `gelu`.
    #[test]
    fn addmm_gelu_applies_the_gelu() {
        tch::manual_seed(0);
        let opts = (Kind::Float, tch::Device::Cpu);
        let (x, w, b) = (
            Tensor::randn([16, 8], opts),
            Tensor::randn([12, 8], opts),
            Tensor::randn([12], opts),
        );
        let fused = super::addmm_gelu(&b, &x, &w.tr());
        assert_eq!(fused.is_some(), super::BUILT_IN);
        let Some(fused) = fused else {
            return;
        };
        let linear = x.linear(&w, Some(&b));
        let max = |t: Tensor| t.abs().max().double_value(&[]);
        assert!(max(&fused - linear.gelu("none")) < 1e-6);
        assert!(max(&fused - &linear) > 0.1, "the GELU was not applied");
    }

    /// The profiler records the operators run between start and stop, into a Chrome trace.
    #[test]
    fn the_profiler_writes_a_trace_of_the_operators() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("trace.json");
        let started = super::profile_start(false);
        assert_eq!(started.is_ok(), super::BUILT_IN, "{started:?}");
        if started.is_err() {
            return;
        }
        let x = Tensor::randn([64, 64], (Kind::Float, tch::Device::Cpu));
        let _ = x.matmul(&x).gelu("none");
        super::profile_stop(&path).expect("stop");
        let trace: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).expect("trace")).expect("JSON");
        let names: Vec<&str> = trace["traceEvents"]
            .as_array()
            .expect("traceEvents")
            .iter()
            .filter_map(|e| e["name"].as_str())
            .collect();
        assert!(names.contains(&"aten::gelu"), "{names:?}");
        let again = super::profile_stop(&path);
        assert!(again.is_err(), "a second stop: {again:?}");
    }
}
