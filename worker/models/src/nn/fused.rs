//! Fused normalisation kernels of our own for the SDXL UNet (`kernels/norms.cu`), compiled at run
//! time with NVRTC ([`ops::rtc_build`]) for the GPU they run on, chosen by [`NormKernels`]:
//! - [`group_norm`]: GroupNorm of an NHWC activation, with an optional per-(sample, channel) term
//!   added to its input first (a ResNet's time embedding) and an optional SiLU after, in three
//!   launches (row-block sums, group statistics, one vectorised normalising pass) where libtorch
//!   needs a statistics pass, a normalising pass and a SiLU pass, plus the add.
//! - [`add_layer_norm`]: the residual add of a transformer block and the LayerNorm after it in
//!   one pass that reads the two operands once and writes the sum and the normalised rows.
//! - [`bias_residual`]: a ResNet's output, conv2 (without its bias) plus the shortcut plus the
//!   bias, in one pass where libtorch needs an unvectorised bias pass and an add.
//!
//! Both compute in fp32 and round each output to bf16 once, so their results differ from
//! libtorch's chain of bf16 kernels by rounding only. Any input they do not cover (not CUDA, not
//! bf16, not NHWC, channels not a multiple of 8, LayerNorm rows wider than 1280) takes libtorch's
//! operators, with the same semantics. docs/performance.md, kernels attempt 11.
//!
//! Builds with the operator shim compile them: NVRTC on CUDA, hiprtc on ROCm (a binary without the
//! shim refuses [`NormKernels::Fused`] at load). The source needs no CUDA or HIP header. Its one
//! warp-wide reduction (`add_layer_norm`, one warp per row) is written for the width `VN_WARP`:
//! 32 on CUDA; on AMD the device's wavefront width, 64 lanes on CDNA and 32 on RDNA such as the
//! Radeon 8060S (gfx1151), which [`ops::rtc_build`] compiles for and reports, and
//! [`AddLayerNormGrid`] lays rows out by. The ROCm path is build-ready and checked in emulation
//! and by a device-code compile (`tests/fused_kernels_*.rs`), not yet on an AMD GPU.

use std::ffi::c_void;

use tch::{Device, Kind, Tensor};

use super::ops::{self, RtcFunction, WarpWidth};
use super::{GroupNorm, LayerNorm, is_channels_last};

/// Which kernels normalise the UNet's activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKernels {
    /// libtorch's operators (GroupNorm, LayerNorm, add, SiLU), as diffusers runs them.
    #[default]
    Aten,
    /// The fused kernels of this module where they apply (CUDA, bf16), libtorch's elsewhere.
    /// Needs the operator shim ([`ops::BUILT_IN`]) and NVRTC on the GPU.
    Fused,
}

/// The kernels' CUDA C source (`kernels/prelude.cuh`, then `kernels/norms.cu`; the CPU emulation
/// test compiles it too).
pub const SOURCE: &str = concat!(
    include_str!("kernels/prelude.cuh"),
    include_str!("kernels/norms.cu")
);
const NAMES: [&str; 5] = [
    "gn_partial",
    "gn_finalize",
    "gn_apply",
    "add_layer_norm",
    "bias_residual",
];
/// Row width `add_layer_norm` holds in registers (`ADD_LN_MAX_C8` vectors of 8 in the source).
const ADD_LN_MAX_CHANNELS: i64 = 1280;

#[derive(Debug, Clone, Copy)]
struct Kernels {
    gn_partial: RtcFunction,
    gn_finalize: RtcFunction,
    gn_apply: RtcFunction,
    add_layer_norm: RtcFunction,
    bias_residual: RtcFunction,
    /// The warp width the source was compiled for on this device.
    warp: WarpWidth,
}

/// Kernels compiled per CUDA device, once per process.
static KERNELS: ops::DeviceKernels<Kernels> =
    ops::DeviceKernels::new(SOURCE, "vnfarm_norms.cu", &NAMES, |module| {
        let f = &module.functions;
        Kernels {
            gn_partial: f[0],
            gn_finalize: f[1],
            gn_apply: f[2],
            add_layer_norm: f[3],
            bias_residual: f[4],
            warp: module.warp,
        }
    });

/// The kernels of `device`, compiled by [`prepare`] at load (a failure this late is a bug).
fn compiled(device: usize) -> Kernels {
    KERNELS.compiled(device)
}

/// Compiles the kernels for `device` now (a model load calls this, so that a GPU or driver NVRTC
/// cannot serve is a load error with the compiler's log, not a failed job). Nothing to do on the
/// CPU.
pub fn prepare(device: Device) -> Result<(), String> {
    KERNELS.prepare(device)
}

pub(crate) fn cuda_index(x: &Tensor) -> Option<usize> {
    match x.device() {
        Device::Cuda(i) => Some(i),
        _ => None,
    }
}

/// A kernel argument: a pointer to the value.
pub(crate) fn arg<T>(v: &mut T) -> *mut c_void {
    (v as *mut T).cast()
}

/// [`ops::rtc_launch`], panicking on a launch error (the kernels were compiled at load; a failure
/// here is a device fault). Also launches the Qwen block's kernels (`crate::qwen_image::kernels`).
///
/// # Safety
/// `args` must be the argument list of `f`'s signature in its source, in order and type,
/// and its device pointers must be those of contiguous tensors on `device`, of at least the sizes
/// the kernel indexes at the given geometry, held by the caller past this call (libtorch's caching
/// allocator keeps freed memory for the stream's later work, as for its own kernels).
#[allow(unsafe_code)]
pub(crate) unsafe fn launch(
    f: RtcFunction,
    device: usize,
    grid: (u32, u32),
    block: (u32, u32),
    shared: u32,
    args: &mut [*mut c_void],
) {
    // SAFETY: the caller's contract above is `rtc_launch`'s.
    let r = unsafe { ops::rtc_launch(f, device, grid, block, shared, args) };
    r.unwrap_or_else(|e| panic!("fused kernel launch: {e}"));
}

pub(crate) fn u32_of(v: i64) -> u32 {
    u32::try_from(v).expect("launch size fits in u32")
}

/// Whether `x` is a bf16 CUDA tensor in dense NHWC order with a channel count the kernels take.
fn nhwc_bf16(x: &Tensor) -> bool {
    let Ok((_, c, h, w)) = x.size4() else {
        return false;
    };
    x.kind() == Kind::BFloat16
        && is_channels_last(x)
        && x.stride() == [h * w * c, 1, w * c, c]
        && c % 8 == 0
        && c / 8 <= 1024
}

/// `h + r + bias` (`bias` `[C]` per channel, or `None`) for `[N, C, H, W]` activations: a
/// ResNet's output. One fused pass where `h` and `r` are NHWC bf16 CUDA tensors of one shape,
/// libtorch's adds otherwise.
pub fn bias_residual(
    h: &Tensor,
    r: &Tensor,
    bias: Option<&Tensor>,
    kernels_choice: NormKernels,
) -> Tensor {
    let fused = kernels_choice == NormKernels::Fused
        && nhwc_bf16(h)
        && r.size() == h.size()
        && r.stride() == h.stride()
        && r.kind() == h.kind()
        && r.device() == h.device();
    let device = cuda_index(h).filter(|_| fused);
    let (Some(device), Some(bias)) = (device, bias) else {
        let y = h + r;
        return match bias {
            Some(b) => y + b.view([1, -1, 1, 1]),
            None => y,
        };
    };
    let k = compiled(device);
    let c = h.size()[1];
    let bias = bias.to_kind(Kind::BFloat16).contiguous();
    let y = h.empty_like();
    let (mut ph, mut pr, mut pb, mut py) =
        (h.data_ptr(), r.data_ptr(), bias.data_ptr(), y.data_ptr());
    let mut total8 = h.numel() as i64 / 8;
    let mut c32 = c as i32;
    // SAFETY: `bias_residual(h, r, bias, y, total8, C)`: `h`, `r` and `y` (empty_like `h`) are
    // dense NHWC bf16 tensors of `total8` vectors of 8 on `device` (nhwc_bf16 and the shape and
    // stride checks above), `bias` C contiguous bf16 values; all live until this function returns.
    #[allow(unsafe_code)]
    unsafe {
        launch(
            k.bias_residual,
            device,
            (u32_of((total8 + 255) / 256), 1),
            (256, 1),
            0,
            &mut [
                arg(&mut ph),
                arg(&mut pr),
                arg(&mut pb),
                arg(&mut py),
                arg(&mut total8),
                arg(&mut c32),
            ],
        )
    }
    y
}

/// How `gn_partial` splits an `[n, hw, c]` activation: `nb` blocks of `rows` rows per sample
/// (about 1024 blocks over the batch, at least 8 rows each), `ty` rows in flight per block (blocks
/// of `c / 8 × ty` threads, about 256). Public for the kernels' CPU emulation test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupNormGrid {
    pub nb: i64,
    pub rows: i64,
    pub ty: i64,
}

impl GroupNormGrid {
    pub fn new(n: i64, c: i64, hw: i64) -> Self {
        let nb = ((1024 + n - 1) / n).clamp(1, (hw + 7) / 8);
        let rows = (hw + nb - 1) / nb;
        Self {
            nb: (hw + rows - 1) / rows,
            rows,
            ty: (256 / (c / 8)).max(1),
        }
    }
}

/// How `add_layer_norm` covers `rows` rows: one warp per row in blocks of 256 threads, so eight
/// rows per block with 32-lane warps and four with 64-lane wavefronts. Public for the kernels' CPU
/// emulation test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AddLayerNormGrid {
    pub blocks: i64,
    pub threads: i64,
}

impl AddLayerNormGrid {
    const THREADS: i64 = 256;

    pub fn new(rows: i64, warp: WarpWidth) -> Self {
        let rows_per_block = Self::THREADS / warp.lanes();
        Self {
            blocks: (rows + rows_per_block - 1) / rows_per_block,
            threads: Self::THREADS,
        }
    }
}

/// `norm(x + add)`, then SiLU when `silu`: `x` `[N, C, H, W]`, `add` a per-(sample, channel)
/// term `[N, C]` (or `None`). The fused kernels where `x` is an NHWC bf16 CUDA tensor,
/// libtorch's operators otherwise.
pub fn group_norm(
    norm: &GroupNorm,
    x: &Tensor,
    add: Option<&Tensor>,
    silu: bool,
    kernels_choice: NormKernels,
) -> Tensor {
    let (n, c, h, w) = x.size4().expect("GroupNorm input is [N, C, H, W]");
    let fused = kernels_choice == NormKernels::Fused && nhwc_bf16(x) && c % norm.groups == 0;
    let device = cuda_index(x).filter(|_| fused);
    let Some(device) = device else {
        let y = match add {
            Some(t) => norm.forward(&(x + t.view([n, c, 1, 1]))),
            None => norm.forward(x),
        };
        return if silu { y.silu() } else { y };
    };
    let k = compiled(device);
    let (g, hw) = (norm.groups, h * w);
    let c8 = c / 8;
    let GroupNormGrid { nb, rows, ty } = GroupNormGrid::new(n, c, hw);
    let opts = (Kind::Float, x.device());
    let part = Tensor::empty([n, nb, 2, c], opts);
    let ss = Tensor::empty([n, 2, c], opts);
    let add = add.map(|t| t.to_kind(Kind::Float).contiguous());
    let (gamma, beta) = (
        norm.weight.to_kind(Kind::BFloat16).contiguous(),
        norm.bias.to_kind(Kind::BFloat16).contiguous(),
    );
    let y = x.empty_like();
    let (mut px, mut ppart, mut pss, mut py) =
        (x.data_ptr(), part.data_ptr(), ss.data_ptr(), y.data_ptr());
    let mut padd = add.as_ref().map_or(std::ptr::null_mut(), |t| t.data_ptr());
    let (mut pgamma, mut pbeta) = (gamma.data_ptr(), beta.data_ptr());
    let (mut hw32, mut c32, mut g32, mut rows32, mut nb32) =
        (hw as i32, c as i32, g as i32, rows as i32, nb as i32);
    let mut eps = norm.eps as f32;
    let shared = if ty > 1 { u32_of(c8 * ty * 16 * 4) } else { 0 };
    // SAFETY: `gn_partial(x, part, HW, C, rows)`: `x` is a dense NHWC bf16 [n, hw, c] tensor on
    // `device` (nhwc_bf16), `part` fp32 [n, nb, 2, c]; the grid (nb, n) and `rows` come from
    // GroupNormGrid, so every block reads rows below `hw` and writes its own slice of `part`; the
    // shared memory is the c8 · ty · 16 floats the kernel uses when ty > 1.
    #[allow(unsafe_code)]
    unsafe {
        launch(
            k.gn_partial,
            device,
            (u32_of(nb), u32_of(n)),
            (u32_of(c8), u32_of(ty)),
            shared,
            &mut [
                arg(&mut px),
                arg(&mut ppart),
                arg(&mut hw32),
                arg(&mut c32),
                arg(&mut rows32),
            ],
        )
    }
    // SAFETY: `gn_finalize(part, add, gamma, beta, ss, NB, HW, C, G, rows, eps)`: `part` as
    // gn_partial wrote it (same stream, same nb, hw, c, rows), `add` fp32 [n, c] or null,
    // `gamma` and `beta` c contiguous bf16 values, `ss` fp32 [n, 2, c]; one block per (sample,
    // group), g dividing c (checked above).
    #[allow(unsafe_code)]
    unsafe {
        launch(
            k.gn_finalize,
            device,
            (u32_of(n * g), 1),
            (256, 1),
            0,
            &mut [
                arg(&mut ppart),
                arg(&mut padd),
                arg(&mut pgamma),
                arg(&mut pbeta),
                arg(&mut pss),
                arg(&mut nb32),
                arg(&mut hw32),
                arg(&mut c32),
                arg(&mut g32),
                arg(&mut rows32),
                arg(&mut eps),
            ],
        )
    }
    let mut total8 = n * hw * c8;
    let mut silu32 = i32::from(silu);
    // SAFETY: `gn_apply(x, ss, y, total8, HW, C, silu)`: `x` and `y` (empty_like `x`, so NHWC as
    // well) hold `total8` vectors of 8 bf16 values, `ss` the [n, 2, c] fp32 gn_finalize wrote.
    #[allow(unsafe_code)]
    unsafe {
        launch(
            k.gn_apply,
            device,
            (u32_of((total8 + 255) / 256), 1),
            (256, 1),
            0,
            &mut [
                arg(&mut px),
                arg(&mut pss),
                arg(&mut py),
                arg(&mut total8),
                arg(&mut hw32),
                arg(&mut c32),
                arg(&mut silu32),
            ],
        )
    }
    y
}

/// `(a + b, norm(a + b))` over the last dim: a transformer block's residual add and the
/// LayerNorm after it. One fused kernel where both are contiguous bf16 CUDA tensors of one shape
/// with at most 1280 channels (a multiple of 8), libtorch's add and LayerNorm otherwise.
pub fn add_layer_norm(
    a: &Tensor,
    b: &Tensor,
    norm: &LayerNorm,
    kernels_choice: NormKernels,
) -> (Tensor, Tensor) {
    let size = a.size();
    let c = *size.last().expect("LayerNorm input has a last dim");
    let fused = kernels_choice == NormKernels::Fused
        && a.kind() == Kind::BFloat16
        && b.kind() == Kind::BFloat16
        && b.size() == size
        && a.is_contiguous()
        && b.is_contiguous()
        && c == norm.dim
        && c % 8 == 0
        && c <= ADD_LN_MAX_CHANNELS
        && a.device() == b.device();
    let Some(device) = cuda_index(a).filter(|_| fused) else {
        let s = a + b;
        let y = norm.forward(&s);
        return (s, y);
    };
    let k = compiled(device);
    let rows = a.numel() as i64 / c;
    let (w, bias) = (
        norm.weight.to_kind(Kind::BFloat16).contiguous(),
        norm.bias.to_kind(Kind::BFloat16).contiguous(),
    );
    let (s, y) = (a.empty_like(), a.empty_like());
    let (mut pa, mut pb, mut pw, mut pbias, mut ps, mut py) = (
        a.data_ptr(),
        b.data_ptr(),
        w.data_ptr(),
        bias.data_ptr(),
        s.data_ptr(),
        y.data_ptr(),
    );
    let (mut rows64, mut c32, mut eps) = (rows, c as i32, norm.eps as f32);
    let grid = AddLayerNormGrid::new(rows, k.warp);
    // SAFETY: `add_layer_norm(a, b, w, bias, s, y, rows, C, eps)`: `a`, `b`, `s` and `y` (the last
    // two empty_like `a`) are contiguous bf16 tensors of `rows` rows of `c` on `device`, `w` and
    // `bias` c bf16 values; c is a multiple of 8 and at most ADD_LN_MAX_CHANNELS (checked above),
    // so each lane's vectors fit the registers the source reserves; one warp of the width the
    // source was compiled for per row (AddLayerNormGrid).
    #[allow(unsafe_code)]
    unsafe {
        launch(
            k.add_layer_norm,
            device,
            (u32_of(grid.blocks), 1),
            (u32_of(grid.threads), 1),
            0,
            &mut [
                arg(&mut pa),
                arg(&mut pb),
                arg(&mut pw),
                arg(&mut pbias),
                arg(&mut ps),
                arg(&mut py),
                arg(&mut rows64),
                arg(&mut c32),
                arg(&mut eps),
            ],
        )
    }
    (s, y)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At 32 lanes the layout is the one CUDA always ran: eight rows per block of 256 threads.
    #[test]
    fn add_layer_norm_puts_one_row_on_each_warp_of_a_256_thread_block() {
        for rows in [1, 7, 8, 9, 4096, 4097] {
            let cuda = AddLayerNormGrid::new(rows, WarpWidth::Lanes32);
            assert_eq!(
                cuda,
                AddLayerNormGrid {
                    blocks: (rows + 7) / 8,
                    threads: 256
                }
            );
            let cdna = AddLayerNormGrid::new(rows, WarpWidth::Lanes64);
            assert_eq!(
                cdna,
                AddLayerNormGrid {
                    blocks: (rows + 3) / 4,
                    threads: 256
                }
            );
        }
    }

    #[test]
    fn only_32_and_64_lane_warps_are_taken() {
        assert_eq!(WarpWidth::from_lanes(32), Ok(WarpWidth::Lanes32));
        assert_eq!(WarpWidth::from_lanes(64), Ok(WarpWidth::Lanes64));
        let e = WarpWidth::from_lanes(16).expect_err("16 lanes");
        assert!(e.contains("16-lane"), "{e}");
    }
}
