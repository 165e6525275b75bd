//! ATen operators and libtorch services that tch's C API binds wrongly or not at all, reached
//! through the C++ shims `csrc/ops.cpp` and `csrc/rtc.cpp`. `build.rs` compiles them together with
//! the CUDA graph shim (against a CUDA libtorch with headers, the PyPI wheel here and on CUDA
//! boxes, or a ROCm libtorch with the HIP headers) and sets `cfg(vnfarm_ops_shim)`; without it
//! [`BUILT_IN`] is false and callers take their plain path.

use std::path::Path;

use tch::Tensor;

/// Whether the shim is compiled into this binary.
pub const BUILT_IN: bool = cfg!(vnfarm_ops_shim);

/// Why a setting that needs the shim is refused where it is not [`BUILT_IN`].
pub const NOT_BUILT_IN: &str = "the operator shim (csrc/ops.cpp, csrc/rtc.cpp) is not built into \
                                this binary (built against a CUDA or ROCm libtorch with its GPU \
                                headers only)";

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

/// A kernel compiled at run time ([`rtc_build`]): its CUDA driver (or HIP module) handle, for
/// [`rtc_launch`].
#[derive(Debug, Clone, Copy)]
pub struct RtcFunction(pub(crate) usize);

/// What [`rtc_build`] compiled: the kernels, in the order they were named, and the device's warp
/// width, which the source was compiled for and launch geometry must use.
#[derive(Debug, Clone)]
pub struct RtcModule {
    pub functions: Vec<RtcFunction>,
    pub warp: WarpWidth,
}

/// The lanes of a warp (CUDA: always 32) or an AMD wavefront (32 on RDNA, 64 on CDNA): the
/// `VN_WARP` a run-time compiled source is built with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WarpWidth {
    Lanes32,
    Lanes64,
}

impl WarpWidth {
    /// The width a device reports, or why the kernels cannot serve it.
    pub fn from_lanes(lanes: i32) -> Result<Self, String> {
        match lanes {
            32 => Ok(Self::Lanes32),
            64 => Ok(Self::Lanes64),
            n => Err(format!(
                "the device reports {n}-lane warps; the kernels take 32 or 64"
            )),
        }
    }

    pub const fn lanes(self) -> i64 {
        match self {
            Self::Lanes32 => 32,
            Self::Lanes64 => 64,
        }
    }
}

/// A run-time compiled source's kernels per CUDA device, compiled once per process: `pick` turns the
/// module into the caller's table of kernels. The fused-kernel families each keep one in a static.
#[derive(Debug)]
pub(crate) struct DeviceKernels<K: Copy> {
    source: &'static str,
    program: &'static str,
    names: &'static [&'static str],
    pick: fn(&RtcModule) -> K,
    compiled: std::sync::Mutex<Option<std::collections::HashMap<usize, K>>>,
}

impl<K: Copy> DeviceKernels<K> {
    pub(crate) const fn new(
        source: &'static str,
        program: &'static str,
        names: &'static [&'static str],
        pick: fn(&RtcModule) -> K,
    ) -> Self {
        Self {
            source,
            program,
            names,
            pick,
            compiled: std::sync::Mutex::new(None),
        }
    }

    /// The kernels of CUDA device `device`, compiled now if they were not yet.
    pub(crate) fn get(&self, device: usize) -> Result<K, String> {
        let mut guard = self.compiled.lock().unwrap_or_else(|e| e.into_inner());
        let map = guard.get_or_insert_with(std::collections::HashMap::new);
        if let Some(k) = map.get(&device) {
            return Ok(*k);
        }
        let module = rtc_build(self.source, self.program, device, self.names)?;
        let k = (self.pick)(&module);
        map.insert(device, k);
        Ok(k)
    }

    /// The kernels of `device`, compiled by [`Self::prepare`] at load (a failure this late is a
    /// bug).
    pub(crate) fn compiled(&self, device: usize) -> K {
        self.get(device)
            .unwrap_or_else(|e| panic!("{}: {e}", self.program))
    }

    /// Compiles the kernels for `device` now (a model load calls this, so that a GPU or driver the
    /// run-time compiler cannot serve is a load error with the compiler's log, not a failed job).
    /// Nothing to do on the CPU.
    pub(crate) fn prepare(&self, device: tch::Device) -> Result<(), String> {
        match device {
            tch::Device::Cuda(i) => self.get(i).map(|_| ()),
            _ => Ok(()),
        }
    }
}

/// Compiles the CUDA C `source` for device `device` with NVRTC (CUDA) or hiprtc (ROCm), through
/// libtorch's NVRTC stub as its jiterator does (`csrc/rtc.cpp`), loads it, and returns the
/// `extern "C"` kernels named in `names`, in order. On ROCm the source is compiled for the device's
/// `gcnArchName` with `-DVN_WARP=` its wavefront width; on CUDA `VN_WARP` is left undefined (the
/// source's default is 32). The compile log comes back as the error.
pub fn rtc_build(
    source: &str,
    program: &str,
    device: usize,
    names: &[&str],
) -> Result<RtcModule, String> {
    imp::rtc_build(source, program, device, names)
}

/// Launches `f` on GPU `device`'s current stream (so that graph capture records it) with
/// grid `(grid.0, grid.1)`, block `(block.0, block.1)` and `shared` bytes of dynamic shared
/// memory. `args` holds a pointer to each argument's value, as `cuLaunchKernel` (or
/// `hipModuleLaunchKernel`) takes them.
///
/// # Safety
/// `args` must match `f`'s parameter list in number, order and type, and every device pointer
/// among them must point to memory of `device` that stays alive until the kernel has run (on
/// the stream: tensors held by the caller until the launch is queued, as libtorch's own
/// launches assume) and is large enough for what the kernel reads and writes at that shape.
#[allow(unsafe_code)]
pub unsafe fn rtc_launch(
    f: RtcFunction,
    device: usize,
    grid: (u32, u32),
    block: (u32, u32),
    shared: u32,
    args: &mut [*mut std::ffi::c_void],
) -> Result<(), String> {
    // SAFETY: forwarded to the caller's contract above.
    unsafe { imp::rtc_launch(f, device, grid, block, shared, args) }
}

#[cfg(not(vnfarm_ops_shim))]
mod imp {
    use std::path::Path;

    use tch::Tensor;

    use super::NOT_BUILT_IN as NOT_BUILT;

    pub fn addmm_gelu(_: &Tensor, _: &Tensor, _: &Tensor) -> Option<Tensor> {
        None
    }

    pub fn profile_start(_: bool) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    pub fn profile_stop(_: &Path) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    pub fn rtc_build(_: &str, _: &str, _: usize, _: &[&str]) -> Result<super::RtcModule, String> {
        Err(NOT_BUILT.into())
    }

    #[allow(unsafe_code)]
    pub unsafe fn rtc_launch(
        _: super::RtcFunction,
        _: usize,
        _: (u32, u32),
        _: (u32, u32),
        _: u32,
        _: &mut [*mut std::ffi::c_void],
    ) -> Result<(), String> {
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
        fn vn_rtc_build(
            source: *const c_char,
            program: *const c_char,
            device: i32,
            names: *const *const c_char,
            count: i32,
            functions: *mut *mut c_void,
            warp: *mut i32,
        ) -> *mut c_char;
        fn vn_rtc_launch(
            function: *mut c_void,
            device: i32,
            grid_x: u32,
            grid_y: u32,
            block_x: u32,
            block_y: u32,
            shared_bytes: u32,
            args: *mut *mut c_void,
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

    pub fn rtc_build(
        source: &str,
        program: &str,
        device: usize,
        names: &[&str],
    ) -> Result<super::RtcModule, String> {
        let cstr = |s: &str| CString::new(s).map_err(|e| format!("{s:?}: {e}"));
        let (source, program) = (cstr(source)?, cstr(program)?);
        let names = names
            .iter()
            .map(|n| cstr(n))
            .collect::<Result<Vec<_>, _>>()?;
        let name_ptrs: Vec<*const c_char> = names.iter().map(|n| n.as_ptr()).collect();
        let mut out = vec![std::ptr::null_mut::<c_void>(); names.len()];
        let device = i32::try_from(device).map_err(|e| e.to_string())?;
        let count = i32::try_from(names.len()).map_err(|e| e.to_string())?;
        let mut warp = 0i32;
        // SAFETY: every string is NUL-terminated and alive for the call; `name_ptrs` and `out`
        // hold `count` entries each; `warp` is written once, on success.
        check(unsafe {
            vn_rtc_build(
                source.as_ptr(),
                program.as_ptr(),
                device,
                name_ptrs.as_ptr(),
                count,
                out.as_mut_ptr(),
                &mut warp,
            )
        })?;
        Ok(super::RtcModule {
            functions: out
                .into_iter()
                .map(|f| super::RtcFunction(f as usize))
                .collect(),
            warp: super::WarpWidth::from_lanes(warp)?,
        })
    }

    pub unsafe fn rtc_launch(
        f: super::RtcFunction,
        device: usize,
        grid: (u32, u32),
        block: (u32, u32),
        shared: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), String> {
        let device = i32::try_from(device).map_err(|e| e.to_string())?;
        // SAFETY: `f` came from `vn_rtc_build`; the arguments are the caller's contract
        // (`super::rtc_launch`).
        check(unsafe {
            vn_rtc_launch(
                f.0 as *mut c_void,
                device,
                grid.0,
                grid.1,
                block.0,
                block.1,
                shared,
                args.as_mut_ptr(),
            )
        })
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
