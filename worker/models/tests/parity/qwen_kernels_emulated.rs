//! The Qwen block's fused kernels (`src/nn/kernels/qwen_block.cu`) run on the CPU, compiled as C++
//! into `tests/support/qwen_emu.cpp` on the emulated GPU of `tests/support/emu_runtime.h` (every
//! GPU thread a thread, warp shuffles through memory), and compared with libtorch's operators: the
//! crate's own portable path (`qwen_image::kernels` with `NormKernels::Aten`, what runs on the CPU
//! and what diffusers computes), in fp32 on the same bf16 inputs (the kernels round once, so the
//! difference is at most one bf16 rounding) and in bf16 (libtorch's chain rounds after each
//! operator: a few roundings).
//!
//! Every case runs at both warp widths, with the geometry `qwen_image::kernels` launches at that
//! width ([`AddLayerNormGrid`]): 32 lanes with CUDA's and HIP's shuffles, 64 with HIP's. Cases:
//! the real model's head (128) and width (3072), a head whose pairs leave lanes idle (16), ragged
//! ones (136 channels per head: 68 pairs, a 64-lane wavefront's second pass on 4 lanes), the widest
//! covered (256, 4096), two samples, a fused-QKV layout (q, k, v read from one `[B, S, 3·H·D]`
//! tensor), two streams written into one joint buffer (the second launch must leave the first's
//! rows alone), the gated residual and the modulation alone and together; the modulation's output
//! quantised for an fp8 GEMM (e4m3fn with per-row scales: each byte equal to libtorch's cast of the
//! kernel's own bf16 output at the kernel's scale) and the feed-forward's GELU quantised so (within
//! fp8's rounding of libtorch's GELU-tanh).
//!
//! Mutations checked by hand (2026-12-04, the same emulator against torch's fp32 operators): a
//! reduction starting at `o = 16` instead of `VN_WARP / 2` fails at 64 lanes (the q/k norm: max
//! relative error 0.71; the LayerNorm's mean: 4.5e-2, against the 7.8e-3 bound here), each
//! half-wavefront normalising with its own sum; RoPE's sine with the wrong sign fails (5.1).

use std::path::{Path, PathBuf};
use std::process::Command;

use tch::{Kind, Tensor};
use vnfarm_models::nn::RmsNorm;
use vnfarm_models::nn::fused::{AddLayerNormGrid, NormKernels};
use vnfarm_models::nn::ops::WarpWidth;
use vnfarm_models::qwen_image::kernels::{
    BlockKernels, SOURCE, StreamQkv, joint_qkv, residual_norm,
};

use crate::support::emulation::{self, Shuffle};

#[test]
fn qwen_block_kernels_match_libtorch_in_emulation_with_32_lane_warps() {
    check(WarpWidth::Lanes32, Shuffle::Cuda);
    check(WarpWidth::Lanes32, Shuffle::Hip);
}

/// The prelude's e4m3fn conversion against libtorch's cast, byte for byte, on every exact tie
/// between two e4m3fn neighbours (normal and subnormal, both signs: round to nearest even), values
/// next to them, zeros, the range's ends, and spread values; above 448 it saturates where
/// libtorch's cast gives NaN from 480 on.
#[test]
fn the_kernels_e4m3fn_conversion_rounds_as_libtorch_casts() {
    let dir = tempfile::tempdir().expect("temp dir");
    let emu = build(dir.path(), WarpWidth::Lanes32, Shuffle::Cuda);
    // Every e4m3fn value's midpoint with the next one up: all positive finite codes 0..=0x7d.
    let codes = Tensor::arange_start(0, 0x7f, (Kind::Uint8, tch::Device::Cpu));
    let grid = codes.view_dtype(Kind::Float8e4m3fn).to_kind(Kind::Float);
    let lo = grid.narrow(0, 0, 0x7e);
    let hi = grid.narrow(0, 1, 0x7e);
    let ties = (&lo + &hi) / 2.0;
    let near = Tensor::cat(&[&ties * (1.0 + 1e-6), &ties * (1.0 - 1e-6)], 0);
    let spread = values(&[4096], 81, 300.0, 0.0).to_kind(Kind::Float);
    let small = values(&[4096], 82, 0.02, 0.0).to_kind(Kind::Float);
    let edges = Tensor::from_slice(&[0.0f32, 448.0, 447.99, 2f32.powi(-6), 2f32.powi(-10), 1e-30]);
    let positive = Tensor::cat(&[ties, near, spread.abs(), small.abs(), edges], 0);
    let all = Tensor::cat(&[&positive, &(-&positive)], 0);
    let n = all.size()[0];
    write(dir.path(), "f.bin", &all);
    run(
        &emu,
        &[
            "e4m3".into(),
            dir.path().display().to_string(),
            n.to_string(),
        ],
        "e4m3",
    );
    let got = read(dir.path(), "q8.bin", &[n], Kind::Uint8);
    let want = all.to_kind(Kind::Float8e4m3fn).view_dtype(Kind::Uint8);
    let differ = want.ne_tensor(&got).sum(Kind::Int64).int64_value(&[]);
    assert_eq!(differ, 0, "{differ} of {n} values convert differently");
    // Saturation: 449 and 1e9 are ±448 (0x7e / 0xfe), not NaN.
    let big = Tensor::from_slice(&[449.0f32, 1e9, -500.0]);
    write(dir.path(), "f.bin", &big);
    run(
        &emu,
        &["e4m3".into(), dir.path().display().to_string(), "3".into()],
        "e4m3",
    );
    let got: Vec<u8> = Vec::try_from(read(dir.path(), "q8.bin", &[3], Kind::Uint8)).unwrap();
    assert_eq!(got, [0x7e, 0x7e, 0xfe]);
}

#[test]
fn qwen_block_kernels_match_libtorch_in_emulation_with_64_lane_wavefronts() {
    check(WarpWidth::Lanes64, Shuffle::Hip);
}

fn check(warp: WarpWidth, shuffle: Shuffle) {
    let dir = tempfile::tempdir().expect("temp dir");
    let emu = build(dir.path(), warp, shuffle);
    let what = format!("{} lanes, {shuffle:?} shuffle", warp.lanes());
    // (B, text tokens, image tokens, heads, head dim, fused-QKV layout)
    for (b, l, n, heads, d, fused_layout) in [
        (1, 3, 10, 2, 128, false),
        (2, 2, 5, 3, 16, false),
        (1, 2, 4, 2, 136, true),
        (2, 1, 3, 1, 256, false),
    ] {
        qk_case(
            &emu,
            dir.path(),
            warp,
            (b, l, n, heads, d),
            fused_layout,
            &what,
        );
    }
    // (B, tokens, channels, residual, modulation)
    for (b, s, c, res, norm) in [
        (1, 9, 3072, true, true),
        (2, 5, 64, true, true),
        (1, 3, 136, false, true),
        (2, 3, 4096, true, false),
        (1, 11, 1280, true, true),
    ] {
        mn_case(&emu, dir.path(), warp, (b, s, c), res, norm, &what);
    }
    // (B, tokens, channels, residual): the modulation quantised for fp8.
    for (b, s, c, res) in [(1, 9, 3072, true), (2, 5, 64, false), (1, 3, 136, true)] {
        mn_fp8_case(&emu, dir.path(), warp, (b, s, c), res, &what);
    }
    // (rows, channels): a row of the real model's FF hidden state (12288), a ragged one, the
    // widest covered, and one row of zeros among others.
    for (rows, c, zero_row) in [(3, 12288, false), (5, 200, true), (1, 16384, false)] {
        gq_case(&emu, dir.path(), (rows, c), zero_row, &what);
    }
    // (N, C, H, W, NHWC, SiLU): the VAE's widths (96, 384), a narrow one with a zero pixel (the
    // norm's eps), and more pixels than the launch has threads (the grid-stride loop).
    for (n, c, h, w, nhwc, silu) in [
        (1, 96, 5, 7, false, true),
        (2, 384, 3, 4, true, false),
        (1, 16, 9, 20, false, false),
        (2, 12, 9, 11, true, true),
    ] {
        vr_case(&emu, dir.path(), (n, c, h, w), nhwc, silu, &what);
    }
}

fn build(dir: &Path, warp: WarpWidth, shuffle: Shuffle) -> PathBuf {
    let source = SOURCE.replace("extern \"C\" ", "");
    emulation::build(dir, &source, "QWEN_SOURCE", "qwen_emu", warp, shuffle)
}

/// Deterministic values in about [-scale, scale] + offset, rounded to bf16 (no libtorch
/// generator: the tests of this binary share it).
fn values(shape: &[i64], seed: u64, scale: f64, offset: f64) -> Tensor {
    let count: i64 = shape.iter().product();
    let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let v: Vec<f32> = (0..count)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 11) as f64 / (1u64 << 53) as f64;
            ((u * 2.0 - 1.0) * scale + offset) as f32
        })
        .collect();
    Tensor::from_slice(&v).view(shape).to_kind(Kind::BFloat16)
}

fn write(dir: &Path, name: &str, t: &Tensor) {
    let t = t.contiguous();
    let mut buf = vec![0u8; t.numel() * t.kind().elt_size_in_bytes()];
    t.copy_data_u8(&mut buf, t.numel());
    std::fs::write(dir.join(name), buf).expect("write input");
}

fn read(dir: &Path, name: &str, shape: &[i64], kind: Kind) -> Tensor {
    let buf = std::fs::read(dir.join(name)).expect("read output");
    Tensor::from_data_size(&buf, shape, kind)
}

fn run(emu: &Path, args: &[String], what: &str) {
    let out = Command::new(emu)
        .args(args)
        .output()
        .expect("run emulation");
    assert!(
        out.status.success(),
        "emulation {args:?} at {what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Largest |got − want| / max(1, |want|), and the mean |got − want|.
fn errors(got: &Tensor, want: &Tensor) -> (f64, f64) {
    let (g, w) = (got.to_kind(Kind::Double), want.to_kind(Kind::Double));
    let diff = (&g - &w).abs();
    let rel = &diff / w.abs().clamp_min(1.0);
    (
        rel.max().double_value(&[]),
        diff.mean(Kind::Double).double_value(&[]),
    )
}

/// Tolerances against fp32 libtorch (one bf16 rounding: 2⁻⁸ relative with margin for the fp32
/// sums' order) and against bf16 libtorch (its chain rounds three to four times).
const ONE_ROUNDING: f64 = 1.0 / 128.0;
const BF16_CHAIN: f64 = 1.0 / 24.0;

fn qk_case(
    emu: &Path,
    dir: &Path,
    warp: WarpWidth,
    (b, l, n, heads, d): (i64, i64, i64, i64, i64),
    fused_layout: bool,
    what: &str,
) {
    let case =
        format!("qk B={b} L={l} N={n} H={heads} D={d} fused_layout={fused_layout} at {what}");
    let eps = 1e-6;
    let hd = heads * d;
    let total = l + n;
    // Each stream's projections, and the memory the kernel reads them from: three tensors, or in
    // the fused-QKV layout one `[B, S, 3·H·D]` tensor with k and v starting H·D and 2·H·D in.
    let stream_inputs = |s: i64, seed: u64| -> ([Tensor; 3], [Tensor; 3]) {
        if fused_layout {
            let qkv = values(&[b, s, 3 * hd], seed, 3.0, 0.2);
            let flat = qkv.flatten(0, -1);
            let from = |o: i64| flat.narrow(0, o, flat.numel() as i64 - o);
            (
                [0, 1, 2].map(|i| qkv.narrow(2, i * hd, hd)),
                [0, 1, 2].map(|i| from(i * hd)),
            )
        } else {
            let t = [0, 1, 2].map(|i| values(&[b, s, hd], seed + i, 3.0, 0.2));
            let memory = t.each_ref().map(Tensor::shallow_clone);
            (t, memory)
        }
    };
    let ([tq, tk, tv], tmem) = stream_inputs(l, 11);
    let ([iq, ik, iv], imem) = stream_inputs(n, 21);
    let norm = |seed| RmsNorm::from_parts(values(&[d], seed, 0.5, 1.0), eps);
    let (nq, nk, naq, nak) = (norm(31), norm(32), norm(33), norm(34));
    let angles = |s: i64, seed: u64| {
        let a = values(&[s, d / 2], seed, 3.0, 0.0).to_kind(Kind::Float);
        (a.cos(), a.sin())
    };
    let ((tcos, tsin), (icos, isin)) = (angles(l, 41), angles(n, 42));
    let (tcis, icis) = (Tensor::complex(&tcos, &tsin), Tensor::complex(&icos, &isin));

    // The emulated kernels: the text stream at offset 0, then the image stream at L.
    let zeros = Tensor::zeros([b, total, heads, d], (Kind::BFloat16, tch::Device::Cpu));
    for name in ["qo.bin", "ko.bin", "vo.bin"] {
        write(dir, name, &zeros);
    }
    for (q, memory, (nq, nk), (cos, sin), s, off) in [
        (&tq, &tmem, (&naq, &nak), (&tcos, &tsin), l, 0),
        (&iq, &imem, (&nq, &nk), (&icos, &isin), n, l),
    ] {
        let in_stride = q.stride()[1];
        for (name, t) in ["q.bin", "k.bin", "v.bin"].iter().zip(memory) {
            write(dir, name, t);
        }
        write(dir, "wq.bin", &nq.weight);
        write(dir, "wk.bin", &nk.weight);
        write(dir, "cos.bin", cos);
        write(dir, "sin.bin", sin);
        let grid = AddLayerNormGrid::new(b * s * heads, warp);
        let args: Vec<String> = ["qk".to_string(), dir.display().to_string()]
            .into_iter()
            .chain(
                [b, s, heads, d, total, off, in_stride]
                    .iter()
                    .map(i64::to_string),
            )
            .chain([format!("{eps:e}")])
            .chain([grid.blocks, grid.threads].iter().map(i64::to_string))
            .collect();
        run(emu, &args, &case);
    }
    let got: Vec<Tensor> = ["qo.bin", "ko.bin", "vo.bin"]
        .iter()
        .map(|f| read(dir, f, &[b, total, heads, d], Kind::BFloat16).transpose(1, 2))
        .collect();

    // libtorch: the portable path on the same bf16 values, in fp32 and in bf16.
    let reference = |kind: Kind| {
        let cast = |t: &Tensor| t.to_kind(kind);
        let (tq, tk, tv, iq, ik, iv) = (
            cast(&tq),
            cast(&tk),
            cast(&tv),
            cast(&iq),
            cast(&ik),
            cast(&iv),
        );
        let norms = [&nq, &nk, &naq, &nak].map(|n| RmsNorm::from_parts(cast(&n.weight), eps));
        joint_qkv(
            StreamQkv {
                q: &tq,
                k: &tk,
                v: &tv,
                norm_q: &norms[2],
                norm_k: &norms[3],
                cos: &tcos,
                sin: &tsin,
                cis: &tcis,
            },
            StreamQkv {
                q: &iq,
                k: &ik,
                v: &iv,
                norm_q: &norms[0],
                norm_k: &norms[1],
                cos: &icos,
                sin: &isin,
                cis: &icis,
            },
            heads,
            d,
            NormKernels::Fused, // on the CPU: libtorch's operators
        )
    };
    let (want32, want16) = (reference(Kind::Float), reference(Kind::BFloat16));
    for (i, name) in ["q", "k", "v"].iter().enumerate() {
        let (max32, mean32) = errors(&got[i], &want32[i]);
        let (max16, mean16) = errors(&got[i], &want16[i]);
        assert!(
            max32 <= ONE_ROUNDING && max16 <= BF16_CHAIN,
            "{case}, {name}: max rel err {max32:.2e} vs fp32 (mean {mean32:.2e}), {max16:.2e} vs bf16 (mean {mean16:.2e})"
        );
        if *name == "v" {
            assert_eq!(max32, 0.0, "{case}: v is a copy");
        }
    }
}

fn mn_case(
    emu: &Path,
    dir: &Path,
    warp: WarpWidth,
    (b, s, c): (i64, i64, i64),
    with_res: bool,
    with_norm: bool,
    what: &str,
) {
    let case = format!("mn B={b} S={s} C={c} residual={with_res} norm={with_norm} at {what}");
    let eps = 1e-6;
    let x = values(&[b, s, c], 51, 4.0, 0.3);
    let h = values(&[b, s, c], 52, 2.0, -0.1);
    // A modulation Linear's output [B, 6C]: (shift, scale, gate) of the first half, then of the
    // second; the kernel reads the terms in place.
    let m = values(&[b, 6 * c], 53, 0.8, 0.05);
    let (shift, scale, gate) = (
        m.narrow(1, 3 * c, c),
        m.narrow(1, 4 * c, c),
        m.narrow(1, 5 * c, c),
    );
    write(dir, "x.bin", &x);
    write(dir, "h.bin", &h);
    write(dir, "mod.bin", &m);
    let flags = i64::from(with_res) | (i64::from(with_norm) << 1);
    run(emu, &mn_args(dir, warp, (b, s, c), flags, eps), &case);

    let fused = BlockKernels {
        ada_norm: NormKernels::Fused,
        gated_residual: NormKernels::Fused,
        ..BlockKernels::default()
    };
    let reference = |x: &Tensor, kind: Kind| {
        let cast = |t: &Tensor| t.to_kind(kind);
        let (h, gate, shift, scale) = (cast(&h), cast(&gate), cast(&shift), cast(&scale));
        residual_norm(
            &cast(x),
            with_res.then_some((&h, &gate)),
            with_norm.then_some((&shift, &scale)),
            eps,
            fused, // on the CPU: libtorch's operators
        )
    };
    let y = if with_res {
        let got = read(dir, "res.bin", &[b, s, c], Kind::BFloat16);
        let (want32, _) = reference(&x, Kind::Float);
        let (want16, _) = reference(&x, Kind::BFloat16);
        let (max32, _) = errors(&got, &want32);
        let (max16, _) = errors(&got, &want16);
        assert!(
            max32 <= ONE_ROUNDING && max16 <= BF16_CHAIN,
            "{case}, residual: max rel err {max32:.2e} vs fp32, {max16:.2e} vs bf16"
        );
        got
    } else {
        x.shallow_clone()
    };
    if with_norm {
        let got = read(dir, "norm.bin", &[b, s, c], Kind::BFloat16);
        // The norm of the kernel's own (bf16) residual, in fp32: one rounding off.
        let (_, want32) = residual_norm(
            &y.to_kind(Kind::Float),
            None,
            Some((&shift.to_kind(Kind::Float), &scale.to_kind(Kind::Float))),
            eps,
            fused,
        );
        let (_, want16) = reference(&x, Kind::BFloat16);
        let (max32, mean32) = errors(&got, &want32.expect("a modulation"));
        let (max16, mean16) = errors(&got, &want16.expect("a modulation"));
        assert!(
            max32 <= ONE_ROUNDING && max16 <= BF16_CHAIN,
            "{case}, norm: max rel err {max32:.2e} vs fp32 (mean {mean32:.2e}), {max16:.2e} vs bf16 (mean {mean16:.2e})"
        );
    }
}

/// e4m3fn bytes as fp32 values (libtorch's cast from the 8-bit kind).
fn fp8_values(bytes: &Tensor) -> Tensor {
    bytes.view_dtype(Kind::Float8e4m3fn).to_kind(Kind::Float)
}

/// A quantised row set against the values it stands for: every element within fp8's rounding
/// (half a unit in the last of 3 mantissa bits, 2⁻⁴ relative; subnormals below 2⁻⁶ · scale a
/// fixed 2⁻¹⁰ · scale) and bf16's before it, and the scales the rows' largest magnitudes over 448.
fn assert_quantised(q8: &Tensor, qs: &Tensor, want: &Tensor, case: &str) {
    let c = *want.size().last().expect("a last dim");
    let want = want.to_kind(Kind::Float).view([-1, c]);
    let qs = qs.view([-1, 1]);
    let got = fp8_values(&q8.view([-1, c])) * &qs;
    let amax = want.abs().amax([1], true);
    let expected_scale = (&amax / 448.0).where_self(&amax.gt(0.0), &amax.ones_like());
    let scale_err = ((&qs - &expected_scale).abs() / &expected_scale)
        .max()
        .double_value(&[]);
    assert!(
        scale_err <= 1.0 / 128.0,
        "{case}: scale off by {scale_err:.2e}"
    );
    let bound = want.abs() * (1.0 / 16.0 + 1.0 / 128.0) + &qs * (1.0 / 512.0);
    let excess = ((&got - &want).abs() - bound).max().double_value(&[]);
    assert!(
        excess <= 0.0,
        "{case}: a value beyond fp8 rounding by {excess:.2e}"
    );
    let rel =
        ((&got - &want).abs().sum(Kind::Double) / want.abs().sum(Kind::Double)).double_value(&[]);
    assert!(rel < 0.04, "{case}: mean relative error {rel:.2e}");
}

/// The emulator's `mn` arguments for the layout `mn_case` writes: a modulation `[B, 6C]` whose
/// gate, shift and scale are its second half's thirds.
fn mn_args(
    dir: &Path,
    warp: WarpWidth,
    (b, s, c): (i64, i64, i64),
    flags: i64,
    eps: f64,
) -> Vec<String> {
    let grid = AddLayerNormGrid::new(b * s, warp);
    ["mn".to_string(), dir.display().to_string()]
        .into_iter()
        .chain(
            [b, s, c, 6 * c, 5 * c, 3 * c, 4 * c, flags]
                .iter()
                .map(i64::to_string),
        )
        .chain([format!("{eps:e}")])
        .chain([grid.blocks, grid.threads].iter().map(i64::to_string))
        .collect()
}

fn mn_fp8_case(
    emu: &Path,
    dir: &Path,
    warp: WarpWidth,
    (b, s, c): (i64, i64, i64),
    with_res: bool,
    what: &str,
) {
    let case = format!("mn fp8 B={b} S={s} C={c} residual={with_res} at {what}");
    let x = values(&[b, s, c], 61, 4.0, 0.3);
    let h = values(&[b, s, c], 62, 2.0, -0.1);
    let m = values(&[b, 6 * c], 63, 0.8, 0.05);
    write(dir, "x.bin", &x);
    write(dir, "h.bin", &h);
    write(dir, "mod.bin", &m);
    let res = i64::from(with_res);
    run(emu, &mn_args(dir, warp, (b, s, c), res | 2, 1e-6), &case);
    let bf16 = read(dir, "norm.bin", &[b, s, c], Kind::BFloat16);
    run(
        emu,
        &mn_args(dir, warp, (b, s, c), res | 2 | 4, 1e-6),
        &case,
    );
    let q8 = read(dir, "q8.bin", &[b, s, c], Kind::Uint8);
    let qs = read(dir, "qs.bin", &[b * s], Kind::Float);
    // Byte for byte: the kernel quantises its own bf16 row at its scale as libtorch's cast does
    // (round to nearest even; nothing here exceeds 448).
    let want = (bf16.to_kind(Kind::Float).view([b * s, c]) * qs.view([-1, 1]).reciprocal())
        .to_kind(Kind::Float8e4m3fn)
        .view_dtype(Kind::Uint8);
    let differ = want
        .ne_tensor(&q8.view([b * s, c]))
        .sum(Kind::Int64)
        .int64_value(&[]);
    assert_eq!(
        differ, 0,
        "{case}: {differ} bytes differ from libtorch's cast"
    );
    assert_quantised(&q8, &qs, &bf16, &case);
}

fn gq_case(emu: &Path, dir: &Path, (rows, c): (i64, i64), zero_row: bool, what: &str) {
    let case = format!("gelu_quant rows={rows} C={c} zero row={zero_row} at {what}");
    let h = values(&[rows, c], 71, 5.0, -0.5);
    if zero_row {
        let _ = h.get(1).fill_(0.0);
    }
    write(dir, "h.bin", &h);
    let threads = vnfarm_models::qwen_image::kernels::GELU_THREADS;
    run(
        emu,
        &["gq".to_string(), dir.display().to_string()]
            .into_iter()
            .chain([rows, c, threads].iter().map(i64::to_string))
            .collect::<Vec<_>>(),
        &case,
    );
    let q8 = read(dir, "q8.bin", &[rows, c], Kind::Uint8);
    let qs = read(dir, "qs.bin", &[rows], Kind::Float);
    let want = h.to_kind(Kind::Float).gelu("tanh");
    assert_quantised(&q8, &qs, &want, &case);
    if zero_row {
        let zeros = fp8_values(&q8.get(1)).abs().max().double_value(&[]);
        assert_eq!(zeros, 0.0, "{case}: a row of zeros quantises to zeros");
    }
}

/// `vae_rms_norm` against the VAE's libtorch chain in bf16 (`qwen_image::vae`'s RMS norm: an fp32
/// copy, `x / max(‖x‖, eps)`, cast to bf16, `· √C`, `· γ`, then SiLU): the same roundings in the
/// same order, so only the norm's summation order differs; at most one bf16 step anywhere, and
/// on a few elements only.
fn vr_case(
    emu: &Path,
    dir: &Path,
    (n, c, h, w): (i64, i64, i64, i64),
    nhwc: bool,
    silu: bool,
    what: &str,
) {
    let case = format!("vae_rms_norm N={n} C={c} {h}x{w} nhwc={nhwc} silu={silu} at {what}");
    let x = values(&[n, c, h, w], 91 + c as u64, 3.0, 0.2);
    // One pixel of zeros: the norm is eps there and the output zero (then SiLU(0) = 0).
    let _ = x.narrow(2, 0, 1).narrow(3, 0, 1).fill_(0.0);
    let gamma = values(&[c], 92, 1.0, 1.0);
    let eps = 1e-12;
    let scale = (c as f64).sqrt();
    // The storage as the device would hold it: NCHW, or NHWC (x permuted, made dense).
    let stored = if nhwc {
        x.permute([0, 2, 3, 1]).contiguous()
    } else {
        x.contiguous()
    };
    let (ns, cs, ps) = if nhwc {
        (h * w * c, 1, c)
    } else {
        (c * h * w, h * w, 1)
    };
    write(dir, "x.bin", &stored);
    write(dir, "g.bin", &gamma);
    let args: Vec<String> = ["vr".to_string(), dir.display().to_string()]
        .into_iter()
        .chain([n, c, h * w, ns, cs, ps].iter().map(i64::to_string))
        .chain([
            format!("{scale}"),
            format!("{eps:e}"),
            i64::from(silu).to_string(),
        ])
        .chain(["2".to_string(), "64".to_string()])
        .collect();
    run(emu, &args, &case);
    let got = read(dir, "y.bin", &stored.size(), Kind::BFloat16);
    let got = if nhwc { got.permute([0, 3, 1, 2]) } else { got };
    let xf = x.to_kind(Kind::Float);
    let denom = xf
        .norm_scalaropt_dim(2, [1].as_slice(), true)
        .clamp_min(eps);
    let normed = (xf / denom).to_kind(Kind::BFloat16) * scale * gamma.view([c, 1, 1]);
    let want = if silu { normed.silu() } else { normed };
    let (got, want) = (got.to_kind(Kind::Float), want.to_kind(Kind::Float));
    let d = (&got - &want).abs();
    // One bf16 step of the larger magnitude (8 bits of mantissa).
    let step = got.abs().maximum(&want.abs()) * 2f64.powi(-7) + 1e-30;
    let beyond = d.gt_tensor(&step).sum(Kind::Int64).int64_value(&[]);
    assert_eq!(
        beyond, 0,
        "{case}: {beyond} elements differ by more than one bf16 step"
    );
    let differ = d.gt(0.0).sum(Kind::Int64).int64_value(&[]);
    let total = got.numel() as i64;
    assert!(
        differ * 100 <= total,
        "{case}: {differ} of {total} elements differ (the summation order alone flips few)"
    );
    let zero = got
        .narrow(2, 0, 1)
        .narrow(3, 0, 1)
        .abs()
        .max()
        .double_value(&[]);
    assert_eq!(zero, 0.0, "{case}: the zero pixel stays zero");
}
