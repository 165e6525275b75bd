//! ATen operators that tch's C API binds wrongly or not at all, reached through the C++ shim
//! `csrc/ops.cpp`. `build.rs` compiles it together with the CUDA graph shim (against a CUDA
//! libtorch with headers: the PyPI wheel here and on CUDA boxes) and sets `cfg(vnfarm_ops_shim)`;
//! without it [`BUILT_IN`] is false and callers take their plain path.

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

#[cfg(not(vnfarm_ops_shim))]
mod imp {
    use tch::Tensor;

    pub fn addmm_gelu(_: &Tensor, _: &Tensor, _: &Tensor) -> Option<Tensor> {
        None
    }
}

// The FFI to the shim: the unsafe code of this module, each block with its SAFETY note.
#[cfg(vnfarm_ops_shim)]
#[allow(unsafe_code)]
mod imp {
    use std::ffi::{CStr, c_char, c_void};

    use tch::Tensor;

    unsafe extern "C" {
        fn vn_ops_error_free(e: *mut c_char);
        fn vn_addmm_gelu(
            bias: *mut c_void,
            mat1: *mut c_void,
            mat2: *mut c_void,
            out: *mut *mut c_void,
        ) -> *mut c_char;
    }

    pub fn addmm_gelu(bias: &Tensor, mat1: &Tensor, mat2: &Tensor) -> Option<Tensor> {
        let mut out = std::ptr::null_mut();
        let arg = |t: &Tensor| t.as_ptr() as *mut c_void;
        // SAFETY: the three handles are live `at::Tensor*` borrowed for the call (the shim only
        // reads them); `out` receives a new `at::Tensor*` or stays null with an error.
        let err = unsafe { vn_addmm_gelu(arg(bias), arg(mat1), arg(mat2), &mut out) };
        if !err.is_null() {
            // SAFETY: a non-null return is a NUL-terminated string the shim malloc'd for us.
            let msg = unsafe { CStr::from_ptr(err) }
                .to_string_lossy()
                .into_owned();
            // SAFETY: freed once, by the shim's allocator.
            unsafe { vn_ops_error_free(err) };
            // As tch's own operators do with libtorch's errors.
            panic!("_addmm_activation: {msg}");
        }
        // SAFETY: `out` is a tensor the shim allocated with `new`; the Tensor owns it from here and
        // frees it with tch's `at_free` (`delete`), as for tensors tch's own calls return.
        Some(unsafe { Tensor::from_ptr(out as *mut torch_sys::C_tensor) })
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
}
