//! The dual-stream block's elementwise work, as libtorch's operators (what diffusers runs) or as
//! fused kernels of our own (`nn/kernels/qwen_block.cu`, compiled at run time with NVRTC on CUDA
//! or hiprtc on ROCm by [`ops::rtc_build`]), chosen per piece by [`BlockKernels`]:
//! - [`joint_qkv`]: per-head RMSNorm of q and k, the interleaved RoPE, and the joint
//!   `cat([text, image])` of q, k and v, in one kernel per stream that writes the joint buffers
//!   SDPA reads (libtorch: eight kernels for each norm, three for each RoPE, three copies).
//! - [`residual_norm`]: the gated residual `x + gate ⊙ h` and the LayerNorm with the adaLN
//!   modulation `LN(y) ⊙ (1 + scale) + shift` that follows it, each alone or both in one pass;
//!   [`residual_norm_fp8`] the same with the normalised rows quantised for an fp8 GEMM.
//! - [`gelu_fp8`]: a feed-forward's GELU-tanh quantised for the FF-down fp8 GEMM in one pass.
//!
//! The kernels compute in fp32 and round each output to bf16 once, so they differ from libtorch's
//! chain of bf16 operators by rounding only. Anything they do not cover (not CUDA, not bf16, a
//! head wider than 256, rows wider than 4096, strides or alignments they do not take) takes
//! libtorch's operators, with the same semantics. Both kernels reduce across one warp of
//! `VN_WARP` lanes, 32 on CUDA and RDNA, 64 on CDNA (the width [`ops::rtc_build`] reports, which
//! [`AddLayerNormGrid`] lays rows out by: one warp per row in blocks of 256 threads); checked in
//! emulation at both widths against libtorch (`tests/parity/qwen_kernels_emulated.rs`) and by a
//! device-code compile for AMD.

use tch::{Device, Kind, Tensor};

use crate::nn::fp8::RowQuantized;
use crate::nn::fused::{self, AddLayerNormGrid, NormKernels, arg, cuda_index, u32_of};
use crate::nn::ops::{self, RtcFunction, WarpWidth};
use crate::nn::rope::apply_interleaved;
use crate::nn::{FfGelu, RmsNorm, layer_norm_without_affine};

/// The kernels' CUDA C source (the shared prelude, then `nn/kernels/qwen_block.cu`; the CPU
/// emulation test compiles it too).
pub const SOURCE: &str = concat!(
    include_str!("../nn/kernels/prelude.cuh"),
    include_str!("../nn/kernels/qwen_block.cu")
);
/// The kernels of [`SOURCE`], in the order [`rtc_build`](ops::rtc_build) returns them.
pub const NAMES: [&str; 4] = [
    "qk_norm_rope",
    "modulated_norm",
    "gelu_quant",
    "vae_rms_norm",
];
/// Widest head `qk_norm_rope` takes (`QK_MAX_PAIRS` pairs in the source).
pub const MAX_HEAD_DIM: i64 = 256;
/// Widest row `modulated_norm` takes (`MN_MAX_C8` vectors of 8 in the source).
pub const MAX_CHANNELS: i64 = 4096;
/// Widest row `gelu_quant` takes (`GQ_THREADS · GQ_MAXV` vectors of 8 in the source), and its
/// block size.
pub const GELU_MAX_CHANNELS: i64 = 16384;
pub const GELU_THREADS: i64 = 256;
/// Threads per block of `vae_rms_norm` (a thread per pixel, grid-stride).
pub const VAE_NORM_THREADS: i64 = 256;

/// Which implementation each piece of the block's elementwise work takes. The portable default
/// is libtorch's operators throughout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BlockKernels {
    /// q/k RMSNorm + RoPE + the joint concatenation ([`joint_qkv`]).
    pub qk_norm_rope: NormKernels,
    /// LayerNorm with the adaLN shift and scale.
    pub ada_norm: NormKernels,
    /// The gated residuals (the first carries LayerNorm 2 when `ada_norm` is fused as well).
    pub gated_residual: NormKernels,
    /// The feed-forwards' GELU-tanh: its own kernel, or in the FF-up GEMM's epilogue (cuBLASLt,
    /// CUDA only: the CPU's epilogue would compute erf GELU, so the CPU keeps its own kernel).
    pub ff_gelu: FfGelu,
    /// Each stream's q, k and v projections as one GEMM over weights concatenated at load (dense
    /// weights only: fp8-resident ones keep three GEMMs).
    pub fused_qkv: bool,
    /// The image stream's q/k/v (one GEMM), FF-up and FF-down projections as fp8 GEMMs with
    /// per-channel weight scales and per-token activation scales (`nn::fp8`; CUDA only, fp8
    /// tensor cores), their inputs quantised by the kernels before them (the modulated norms, the
    /// GELU). The text stream (211 tokens: no gain measured) and the modulations stay in bf16.
    pub fp8_gemm: bool,
}

impl BlockKernels {
    /// Whether any piece needs the kernels of this module compiled.
    pub fn any_fused(&self) -> bool {
        self.fp8_gemm
            || [self.qk_norm_rope, self.ada_norm, self.gated_residual].contains(&NormKernels::Fused)
    }

    /// Whether these kernels need the C++ shims of a CUDA (or HIP) build.
    pub fn needs_shims(&self) -> bool {
        self.any_fused() || self.ff_gelu == crate::nn::FfGelu::Epilogue
    }
}

#[derive(Debug, Clone, Copy)]
struct Kernels {
    qk_norm_rope: RtcFunction,
    modulated_norm: RtcFunction,
    gelu_quant: RtcFunction,
    vae_rms_norm: RtcFunction,
    warp: WarpWidth,
}

/// Kernels compiled per CUDA device, once per process.
static KERNELS: ops::DeviceKernels<Kernels> =
    ops::DeviceKernels::new(SOURCE, "vnfarm_qwen_block.cu", &NAMES, |module| Kernels {
        qk_norm_rope: module.functions[0],
        modulated_norm: module.functions[1],
        gelu_quant: module.functions[2],
        vae_rms_norm: module.functions[3],
        warp: module.warp,
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

fn aligned(t: &Tensor, bytes: usize) -> bool {
    (t.data_ptr() as usize).is_multiple_of(bytes)
}

/// One stream's projections and what normalises and rotates them.
#[derive(Debug, Clone, Copy)]
pub struct StreamQkv<'a> {
    /// `[B, S, H·D]` each (the last dim dense; q, k and v with one token stride).
    pub q: &'a Tensor,
    pub k: &'a Tensor,
    pub v: &'a Tensor,
    pub norm_q: &'a RmsNorm,
    pub norm_k: &'a RmsNorm,
    /// fp32 `[S, D/2]` angle tables, and the same as complex64 `cos + i·sin` (libtorch's path).
    pub cos: &'a Tensor,
    pub sin: &'a Tensor,
    pub cis: &'a Tensor,
}

impl StreamQkv<'_> {
    /// `(B, S)`.
    fn tokens(&self) -> (i64, i64) {
        let s = self.q.size();
        (s[0], s[1])
    }

    /// Whether the fused kernel takes this stream with `heads` heads of `head_dim`.
    fn fusable(&self, heads: i64, head_dim: i64, device: Device) -> bool {
        let (b, s) = self.tokens();
        let dense = |t: &Tensor| {
            let st = t.stride();
            t.size() == [b, s, heads * head_dim]
                && t.kind() == Kind::BFloat16
                && t.device() == device
                && st[2] == 1
                && st[1] % 2 == 0
                && st[1] >= heads * head_dim
                && st[0] == s * st[1]
                && aligned(t, 4)
        };
        let table = |t: &Tensor| {
            t.kind() == Kind::Float
                && t.device() == device
                && t.size() == [s, head_dim / 2]
                && t.is_contiguous()
        };
        let weight = |n: &RmsNorm| n.weight.size() == [head_dim] && n.weight.device() == device;
        dense(self.q)
            && dense(self.k)
            && dense(self.v)
            && self.q.stride() == self.k.stride()
            && self.k.stride() == self.v.stride()
            && table(self.cos)
            && table(self.sin)
            && weight(self.norm_q)
            && weight(self.norm_k)
            && self.norm_q.eps() == self.norm_k.eps()
    }

    /// libtorch's path: `[B, S, H, D]` q, k (normalised and rotated) and v.
    fn aten(&self, heads: i64, head_dim: i64) -> [Tensor; 3] {
        let (b, s) = self.tokens();
        let heads_of = |x: &Tensor| x.view([b, s, heads, head_dim]);
        // Tables `[S, D/2]` broadcast over `[B, S, H, D/2]`: one row per token, shared by heads.
        let cis = self.cis.unsqueeze(1);
        let q = apply_interleaved(&self.norm_q.forward(&heads_of(self.q)), &cis);
        let k = apply_interleaved(&self.norm_k.forward(&heads_of(self.k)), &cis);
        [q, k, heads_of(self.v)]
    }
}

/// The joint attention's inputs `[B, H, L + N, D]` (text tokens first): each stream's q and k
/// normalised per head and rotated, and v, concatenated over tokens. Fused (one kernel per
/// stream, writing the joint buffers, token-major `[B, L + N, H, D]` as the concatenation lays
/// them out, transposed as views) where `choice` asks for it and both streams are covered.
pub fn joint_qkv(
    txt: StreamQkv<'_>,
    img: StreamQkv<'_>,
    heads: i64,
    head_dim: i64,
    choice: NormKernels,
) -> [Tensor; 3] {
    let device = txt.q.device();
    let fused = choice == NormKernels::Fused
        && head_dim % 2 == 0
        && head_dim <= MAX_HEAD_DIM
        && txt.tokens().0 == img.tokens().0
        && txt.fusable(heads, head_dim, device)
        && img.fusable(heads, head_dim, device);
    let Some(index) = cuda_index(txt.q).filter(|_| fused) else {
        let [tq, tk, tv] = txt.aten(heads, head_dim);
        let [iq, ik, iv] = img.aten(heads, head_dim);
        let joint = |t: Tensor, i: Tensor| Tensor::cat(&[t, i], 1).transpose(1, 2);
        return [joint(tq, iq), joint(tk, ik), joint(tv, iv)];
    };
    let kern = compiled(index);
    let ((b, l), (_, n)) = (txt.tokens(), img.tokens());
    let joint = || Tensor::empty([b, l + n, heads, head_dim], (Kind::BFloat16, device));
    let (q, k, v) = (joint(), joint(), joint());
    for (stream, off) in [(txt, 0), (img, l)] {
        let s = stream.tokens().1;
        let rows = b * s * heads;
        let grid = AddLayerNormGrid::new(rows, kern.warp);
        let (wq, wk) = (
            stream.norm_q.weight.to_kind(Kind::BFloat16).contiguous(),
            stream.norm_k.weight.to_kind(Kind::BFloat16).contiguous(),
        );
        let (mut pq, mut pk, mut pv) = (
            stream.q.data_ptr(),
            stream.k.data_ptr(),
            stream.v.data_ptr(),
        );
        let (mut pwq, mut pwk) = (wq.data_ptr(), wk.data_ptr());
        let (mut pcos, mut psin) = (stream.cos.data_ptr(), stream.sin.data_ptr());
        let (mut qo, mut ko, mut vo) = (q.data_ptr(), k.data_ptr(), v.data_ptr());
        let mut in_stride = stream.q.stride()[1];
        let mut rows64 = rows;
        let (mut s32, mut h32, mut d32, mut l32, mut off32) = (
            s as i32,
            heads as i32,
            head_dim as i32,
            (l + n) as i32,
            off as i32,
        );
        let mut eps = stream.norm_q.eps() as f32;
        // SAFETY: `qk_norm_rope(q, k, v, in_stride, wq, wk, cos, sin, qo, ko, vo, rows, S, H, D,
        // L, off, eps)`: q, k and v are bf16 [B, S, H·D] on the device with the last dim dense,
        // token stride `in_stride` (even, at least H·D) and batch stride S·in_stride, 4-byte
        // aligned (StreamQkv::fusable); wq and wk D contiguous bf16 values; cos and sin fp32
        // [S, D/2] contiguous; qo, ko and vo are fresh [B, L + N, H, D] bf16 tensors, of which
        // this stream's rows off … off + S − 1 are written; D is even and at most MAX_HEAD_DIM;
        // one warp per row (AddLayerNormGrid), grid.y = 3 for q, k, v. All live past the launch.
        #[allow(unsafe_code)]
        unsafe {
            fused::launch(
                kern.qk_norm_rope,
                index,
                (u32_of(grid.blocks), 3),
                (u32_of(grid.threads), 1),
                0,
                &mut [
                    arg(&mut pq),
                    arg(&mut pk),
                    arg(&mut pv),
                    arg(&mut in_stride),
                    arg(&mut pwq),
                    arg(&mut pwk),
                    arg(&mut pcos),
                    arg(&mut psin),
                    arg(&mut qo),
                    arg(&mut ko),
                    arg(&mut vo),
                    arg(&mut rows64),
                    arg(&mut s32),
                    arg(&mut h32),
                    arg(&mut d32),
                    arg(&mut l32),
                    arg(&mut off32),
                    arg(&mut eps),
                ],
            )
        }
    }
    [q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)]
}

/// A per-(sample, channel) term of a modulation: `[B, C]`, the last dim dense (a chunk of the
/// modulation Linear's output, in place).
fn mod_term_ok(t: &Tensor, b: i64, c: i64, device: Device) -> bool {
    t.size() == [b, c]
        && t.kind() == Kind::BFloat16
        && t.device() == device
        && t.stride()[1] == 1
        && aligned(t, 16)
}

/// `[B, S, C]` bf16, contiguous, 16-byte aligned, with a row width the kernel takes.
fn rows_ok(x: &Tensor, device: Device) -> bool {
    let Ok((_, _, c)) = x.size3() else {
        return false;
    };
    x.kind() == Kind::BFloat16
        && x.device() == device
        && x.is_contiguous()
        && c % 8 == 0
        && c <= MAX_CHANNELS
        && aligned(x, 16)
}

/// The gated residual `x + gate ⊙ h` (`residual = Some((h, gate))`, `gate` `[B, C]`) or `x`, and,
/// with `modulation = Some((shift, scale))` (`[B, C]` each), `LN(y) ⊙ (1 + scale) + shift` of the
/// result `y` (LayerNorm over the last dim without affine, `eps`). `x` and `h` are `[B, S, C]`.
/// Each part fused where its setting asks and the tensors are covered; both in one pass when both
/// are.
pub fn residual_norm(
    x: &Tensor,
    residual: Option<(&Tensor, &Tensor)>,
    modulation: Option<(&Tensor, &Tensor)>,
    eps: f64,
    kernels_choice: BlockKernels,
) -> (Tensor, Option<Tensor>) {
    let (y, normed) = residual_norm_to(x, residual, modulation, eps, kernels_choice, Out::Bf16);
    (
        y,
        normed.map(|n| match n {
            Normed::Bf16(t) => t,
            Normed::Fp8(_) => unreachable!("bf16 was asked for"),
        }),
    )
}

/// [`residual_norm`] with the modulated norm quantised per row for an fp8 GEMM: by the kernel in
/// the same pass where `ada_norm` is fused and the tensors are covered, else the bf16 result
/// quantised by libtorch's operators ([`RowQuantized::of`]).
pub fn residual_norm_fp8(
    x: &Tensor,
    residual: Option<(&Tensor, &Tensor)>,
    modulation: (&Tensor, &Tensor),
    eps: f64,
    kernels_choice: BlockKernels,
) -> (Tensor, RowQuantized) {
    let (y, normed) =
        residual_norm_to(x, residual, Some(modulation), eps, kernels_choice, Out::Fp8);
    let q = match normed.expect("a modulation was passed") {
        Normed::Fp8(q) => q,
        Normed::Bf16(t) => RowQuantized::of(&t),
    };
    (y, q)
}

/// What the modulated norm is written as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Out {
    Bf16,
    /// e4m3fn with per-row scales, where the kernel writes it (else bf16, quantised by the caller).
    Fp8,
}

#[derive(Debug)]
enum Normed {
    Bf16(Tensor),
    Fp8(RowQuantized),
}

fn residual_norm_to(
    x: &Tensor,
    residual: Option<(&Tensor, &Tensor)>,
    modulation: Option<(&Tensor, &Tensor)>,
    eps: f64,
    kernels_choice: BlockKernels,
    out: Out,
) -> (Tensor, Option<Normed>) {
    let device = x.device();
    let size = x.size();
    let (b, c) = (size[0], *size.last().expect("a last dim"));
    let cuda = cuda_index(x);
    let mod_ok = |(shift, scale): (&Tensor, &Tensor)| {
        mod_term_ok(shift, b, c, device)
            && mod_term_ok(scale, b, c, device)
            && shift.stride() == scale.stride()
    };
    let fuse_norm = kernels_choice.ada_norm == NormKernels::Fused && modulation.is_some_and(mod_ok);
    let fuse_res = kernels_choice.gated_residual == NormKernels::Fused
        && rows_ok(x, device)
        && residual.is_some_and(|(h, gate)| {
            h.size() == size && rows_ok(h, device) && mod_term_ok(gate, b, c, device)
        });
    // One pass for both where the kernel's one modulation stride serves the gate and the terms.
    let both = fuse_res
        && fuse_norm
        && residual.map(|(_, gate)| gate.stride()) == modulation.map(|(shift, _)| shift.stride());
    let (y, normed) = match (residual, cuda.filter(|_| fuse_res)) {
        (Some(r), Some(index)) => {
            launch_modulated_norm(index, x, Some(r), modulation.filter(|_| both), eps, out)
        }
        (Some((h, gate)), _) => (x + gate.unsqueeze(1) * h, None),
        (None, _) => (x.shallow_clone(), None),
    };
    let Some((shift, scale)) = modulation else {
        return (y, None);
    };
    if let Some(n) = normed {
        return (y, Some(n));
    }
    let normed = match cuda.filter(|_| fuse_norm && rows_ok(&y, device)) {
        Some(index) => launch_modulated_norm(index, &y, None, Some((shift, scale)), eps, out)
            .1
            .expect("a modulation was passed"),
        None => Normed::Bf16(
            layer_norm_without_affine(&y, c, eps) * (scale.unsqueeze(1) + 1.0) + shift.unsqueeze(1),
        ),
    };
    (y, Some(normed))
}

/// `modulated_norm` on `x` (checked by the caller: [`rows_ok`], and [`mod_term_ok`] for every
/// term, the gate's stride equal to the shift's where both are given). Returns the residual sum
/// (or `x` itself without `residual`) and the modulated norm (with `modulation`).
fn launch_modulated_norm(
    index: usize,
    x: &Tensor,
    residual: Option<(&Tensor, &Tensor)>,
    modulation: Option<(&Tensor, &Tensor)>,
    eps: f64,
    out: Out,
) -> (Tensor, Option<Normed>) {
    let kern = compiled(index);
    let size = x.size();
    let (s, c) = (size[1], size[2]);
    let rows = size[0] * s;
    let y = residual.map(|_| x.empty_like());
    let null = std::ptr::null_mut();
    let normed = modulation.map(|_| match out {
        Out::Bf16 => Normed::Bf16(x.empty_like()),
        Out::Fp8 => Normed::Fp8(RowQuantized {
            values: Tensor::empty(size.as_slice(), (Kind::Float8e4m3fn, x.device())),
            scale: Tensor::empty([size[0], s, 1], (Kind::Float, x.device())),
        }),
    });
    let (mut pnorm, mut pq8, mut pqscale) = match &normed {
        None => (null, null, null),
        Some(Normed::Bf16(t)) => (t.data_ptr(), null, null),
        Some(Normed::Fp8(q)) => (null, q.values.data_ptr(), q.scale.data_ptr()),
    };
    let mut px = x.data_ptr();
    let (mut ph, mut pgate) = residual.map_or((null, null), |(h, g)| (h.data_ptr(), g.data_ptr()));
    let mut pres = y.as_ref().map_or(null, |t| t.data_ptr());
    let (mut pshift, mut pscale) =
        modulation.map_or((null, null), |(sh, sc)| (sh.data_ptr(), sc.data_ptr()));
    let mut mod_stride = residual
        .map(|(_, g)| g.stride()[0])
        .or(modulation.map(|(sh, _)| sh.stride()[0]))
        .unwrap_or(0);
    let (mut rows64, mut s32, mut c32, mut eps32) = (rows, s as i32, c as i32, eps as f32);
    let grid = AddLayerNormGrid::new(rows, kern.warp);
    // SAFETY: `modulated_norm(x, h, gate, res_out, shift, scale, norm_out, norm_q8, norm_scale,
    // rows, S, C, mod_stride, eps)`: x, h, res_out and norm_out are contiguous bf16 [B, S, C]
    // tensors on the device (res_out and norm_out empty_like x), 16-byte aligned, C a multiple of
    // 8 and at most MAX_CHANNELS (rows_ok); norm_q8 a fresh contiguous e4m3fn [B, S, C] tensor and
    // norm_scale a fresh fp32 [B, S, 1] one (fresh allocations: 16-byte aligned), given instead of
    // norm_out; gate, shift and scale [B, C] bf16 with dense, 16-byte aligned rows `mod_stride`
    // elements apart (mod_term_ok, strides compared by the caller); null where a part is not
    // asked for, which the kernel tests. One warp per row (AddLayerNormGrid). All live past the
    // launch.
    #[allow(unsafe_code)]
    unsafe {
        fused::launch(
            kern.modulated_norm,
            index,
            (u32_of(grid.blocks), 1),
            (u32_of(grid.threads), 1),
            0,
            &mut [
                arg(&mut px),
                arg(&mut ph),
                arg(&mut pgate),
                arg(&mut pres),
                arg(&mut pshift),
                arg(&mut pscale),
                arg(&mut pnorm),
                arg(&mut pq8),
                arg(&mut pqscale),
                arg(&mut rows64),
                arg(&mut s32),
                arg(&mut c32),
                arg(&mut mod_stride),
                arg(&mut eps32),
            ],
        )
    }
    (y.unwrap_or_else(|| x.shallow_clone()), normed)
}

/// GELU-tanh of a feed-forward's hidden state `h` (`[…, C]`, the FF-up GEMM's output), quantised
/// per row for the FF-down fp8 GEMM: one kernel pass on CUDA where `h` is contiguous bf16 with C a
/// multiple of 8 up to [`GELU_MAX_CHANNELS`]; libtorch's GELU and [`RowQuantized::of`] otherwise.
pub fn gelu_fp8(h: &Tensor) -> RowQuantized {
    let size = h.size();
    let c = *size.last().expect("a last dim");
    let covered = h.kind() == Kind::BFloat16
        && h.is_contiguous()
        && c % 8 == 0
        && c <= GELU_MAX_CHANNELS
        && aligned(h, 16);
    let Some(index) = cuda_index(h).filter(|_| covered) else {
        return RowQuantized::of(&h.gelu("tanh"));
    };
    let kern = compiled(index);
    let rows: i64 = size[..size.len() - 1].iter().product();
    let mut scale_shape = size.clone();
    *scale_shape.last_mut().expect("a last dim") = 1;
    let q = RowQuantized {
        values: Tensor::empty(size.as_slice(), (Kind::Float8e4m3fn, h.device())),
        scale: Tensor::empty(scale_shape.as_slice(), (Kind::Float, h.device())),
    };
    let (mut px, mut pq, mut ps) = (h.data_ptr(), q.values.data_ptr(), q.scale.data_ptr());
    let mut c32 = c as i32;
    // SAFETY: `gelu_quant(x, q8, qscale, C)`: x is contiguous bf16 [rows, C] on the device,
    // 16-byte aligned, C a multiple of 8 and at most GELU_MAX_CHANNELS (checked above); q8 a
    // fresh contiguous e4m3fn tensor of the same shape and qscale a fresh fp32 [rows] one; one
    // block of GELU_THREADS threads (the source's GQ_THREADS) per row. All live past the launch.
    #[allow(unsafe_code)]
    unsafe {
        fused::launch(
            kern.gelu_quant,
            index,
            (u32_of(rows), 1),
            (u32_of(GELU_THREADS), 1),
            0,
            &mut [arg(&mut px), arg(&mut pq), arg(&mut ps), arg(&mut c32)],
        )
    }
    q
}

/// The launch geometry of `vae_rms_norm` over `pixels` pixels: blocks of [`VAE_NORM_THREADS`], at
/// most enough to cover them once and at most 65535 (the kernel strides over the rest).
pub fn vae_norm_blocks(pixels: i64) -> i64 {
    ((pixels + VAE_NORM_THREADS - 1) / VAE_NORM_THREADS).clamp(1, 65535)
}

/// The Qwen VAE's RMS norm over the channels of each pixel (`F.normalize(x, dim=1) · scale · γ`,
/// then SiLU with `silu`) of a bf16 `[N, C, H, W]` tensor on a CUDA (or HIP) device, in one kernel
/// (`vae_rms_norm`); `None` where it does not apply (another device or dtype, a layout other than
/// dense NCHW), for the caller's libtorch path. The kernel takes NHWC strides too, but a thread
/// per pixel then reads its channels C elements apart from its neighbours': on the H100 it took
/// 2.3× libtorch's chain there (docs/performance.md, attempt 10), so NHWC is left to libtorch.
/// The kernels must have been compiled for the device ([`prepare`]).
pub fn vae_rms_norm(
    x: &Tensor,
    gamma: &Tensor,
    scale: f64,
    eps: f64,
    silu: bool,
) -> Option<Tensor> {
    let index = cuda_index(x)?;
    let (n, c, h, w) = x.size4().ok()?;
    let st = x.stride();
    // Dense NCHW: pixel p = y·W + x at stride 1, neighbouring threads' reads side by side.
    let nchw = st == [c * h * w, h * w, w, 1];
    let dense_gamma = gamma.numel() as i64 == c && gamma.is_contiguous();
    if x.kind() != Kind::BFloat16
        || gamma.kind() != Kind::BFloat16
        || gamma.device() != x.device()
        || !nchw
        || !dense_gamma
        || c > i64::from(i32::MAX)
    {
        return None;
    }
    let out = x.empty_like();
    if out.stride() != st {
        return None;
    }
    let kern = compiled(index);
    let pixels = n * h * w;
    if pixels == 0 {
        return Some(out);
    }
    let (mut px, mut pg, mut po) = (x.data_ptr(), gamma.data_ptr(), out.data_ptr());
    let (mut pixels64, mut p64, mut c32) = (pixels, h * w, c as i32);
    let (mut ns, mut cs, mut ps) = (st[0], st[1], st[3]);
    let (mut scale32, mut eps32, mut silu32) = (scale as f32, eps as f32, i32::from(silu));
    // SAFETY: `vae_rms_norm(x, gamma, out, pixels, P, C, ns, cs, ps, scale, eps, silu)`: x is a
    // dense NCHW bf16 [N, C, H, W] tensor on the device, whose element (n, c, p) for
    // p = y·W + x lies at n·ns + c·cs + p·ps (checked above); out a fresh tensor of the same
    // shape and strides; gamma a contiguous bf16 [C] tensor on the same device. The grid-stride
    // loop covers pixels = N·H·W threads' work. All live past the launch.
    #[allow(unsafe_code)]
    unsafe {
        fused::launch(
            kern.vae_rms_norm,
            index,
            (u32_of(vae_norm_blocks(pixels)), 1),
            (u32_of(VAE_NORM_THREADS), 1),
            0,
            &mut [
                arg(&mut px),
                arg(&mut pg),
                arg(&mut po),
                arg(&mut pixels64),
                arg(&mut p64),
                arg(&mut c32),
                arg(&mut ns),
                arg(&mut cs),
                arg(&mut ps),
                arg(&mut scale32),
                arg(&mut eps32),
                arg(&mut silu32),
            ],
        )
    }
    Some(out)
}
